"""The keywords of the contract, drawn valid (most of the time) or not.

:func:`masking` and :func:`scores` draw the keywords every attention entry point shares (the
mask contract; the score variants and the scale); :func:`spoil` replaces one of them with a
value the contract refuses, or draws a combination it refuses, and says which names the
refusal must mention. The ``mask_mod`` and ``score_mod`` functions are small NumPy
functions of index arrays, each with a docstring that says what it is (for reproducers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .arrays import INVALID, chance, pick, values
from .outcome import UserCallbackError


@dataclass
class Drawn:
    """Keywords drawn for one call, and what the contract says of them: ``refuse`` holds the
    names one of which a refusal must mention (empty: the call must compute);
    ``may_refuse``: a refusal is documented but not certain (a failing callback that a call
    with nothing to compute never calls, say)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    refuse: set[str] = field(default_factory=set)
    may_refuse: bool = False
    lazy: str | None = None  # a callback whose refusal comes only when mha calls it

    def spoilt_by_callback(self, name: str) -> None:
        """``name`` holds a callback refused (or failing) only once called: whether it must
        be depends on what the call computes (:func:`called`)."""
        self.refuse.add(name)
        self.may_refuse, self.lazy = True, name


def described(text: str, function: Callable[..., Any]) -> Callable[..., Any]:
    function.__doc__ = text
    return function


def _raise(*args: Any) -> Any:
    raise UserCallbackError("the fuzzer's own callback failed on purpose")


def mask_mods(rng: np.random.Generator) -> list[Callable[..., Any]]:
    """Valid ``mask_mod`` functions (elementwise in their index arrays)."""
    table = rng.random((2, 5, 5)) < 0.7
    return [
        described("q >= kv", lambda b, h, q, kv: q >= kv),
        described("(q + kv + b + h) % 3 != 1", lambda b, h, q, kv: (q + kv + b + h) % 3 != 1),
        described("table[h % 2, q % 5, kv % 5]", lambda b, h, q, kv: table[h % 2, q % 5, kv % 5]),
        described("kv < 2 (no b, h or q axis)", lambda b, h, q, kv: kv < 2),
    ]


def score_mods(rng: np.random.Generator) -> list[tuple[Callable[..., Any], Callable[..., Any]]]:
    """Valid ``score_mod`` functions with their derivatives."""
    table = rng.standard_normal((2, 5, 5))
    return [
        (described("s * 0.5 + 0.25 * h", lambda s, b, h, q, kv: s * 0.5 + 0.25 * h),
         described("0.5", lambda s, b, h, q, kv: np.full_like(s, 0.5))),
        (described("s + table[h % 2, q % 5, kv % 5]",
                   lambda s, b, h, q, kv: s + table[h % 2, q % 5, kv % 5]),
         described("1", lambda s, b, h, q, kv: np.ones_like(s))),
        (described("2 tanh(s / 2)", lambda s, b, h, q, kv: 2.0 * np.tanh(s / 2.0)),
         described("1 - tanh(s / 2)^2", lambda s, b, h, q, kv: 1.0 - np.tanh(s / 2.0) ** 2)),
        (described("s - 0.1 |q - kv| + 0 b",
                   lambda s, b, h, q, kv: s - 0.1 * np.abs(q - kv) + 0 * b),
         described("1", lambda s, b, h, q, kv: np.ones_like(s))),
    ]  # fmt: skip


def lengths(rng: np.random.Generator, batch: tuple[int, ...], top: int, form: int) -> Any:
    """Lengths in ``[0, top]`` of the batch shape: an array, a list, or a Python int."""
    n = rng.integers(0, top + 1, size=batch)
    if form == 1 and len(batch) == 1:  # a list keeps the shape only in one axis
        return n.tolist()
    if form == 2:
        return n.astype(np.int32)
    return int(n) if not batch else n


@st.composite
def masking(draw: Any, rng: np.random.Generator, batch: tuple[int, ...], H: int, L: int, S: int,
            cached: bool = False) -> dict[str, Any]:  # fmt: skip
    """The mask contract's keywords for scores ``(*batch, H, L, S)``, each given or not.
    ``cached``: a call with a cache (no key lengths, no top-left; causal unless
    ``causal=False`` or ``mask=False``)."""
    kw: dict[str, Any] = {}
    use = lambda name, p: draw(chance(p), label=name)  # noqa: E731
    if use("mask", 0.25):
        kw["mask"] = draw(pick([True, False, np.True_]), label="mask flag") if (
            draw(st.integers(0, 3), label="mask kind") == 3) else scores_array(
            draw, rng, batch, H, L, S, bool)  # fmt: skip
    if use("causal", 0.3):
        kw["causal"] = draw(pick([True, False, np.True_]), label="causal")
    if use("window", 0.25):
        kw["window"] = draw(st.integers(1, S + 2), label="window")
        if use("sink_tokens", 0.5):
            kw["sink_tokens"] = draw(st.integers(0, 3), label="sink_tokens")
    if (
        not cached
        and (kw.get("causal") or kw.get("mask") is True or "window" in kw)
        and use("causal_alignment", 0.5)
    ):
        kw["causal_alignment"] = draw(pick(["bottom_right", "top_left"]), label="al")
    if not cached and use("key_lengths", 0.25):
        kw["key_lengths"] = lengths(rng, batch, S, draw(st.integers(0, 2), label="form"))
    if use("query_lengths", 0.25):
        kw["query_lengths"] = lengths(rng, batch, L, draw(st.integers(0, 2), label="form"))
    if use("bias", 0.25):
        kw["bias"] = scores_array(draw, rng, batch, H, L, S, np.float64)
    if use("chunk", 0.15):
        kw["chunk"] = draw(st.integers(1, S + 2), label="chunk")
    if use("mask_mod", 0.15):
        kw["mask_mod"] = draw(pick(mask_mods(rng)), label="mask_mod")
    return kw


def scores_array(draw: Any, rng: np.random.Generator, batch: tuple[int, ...], H: int, L: int,
                 S: int, dtype: Any) -> np.ndarray:  # fmt: skip
    """A mask (``bool``) or bias for scores ``(*batch, H, L, S)``: each axis full or one,
    some leading axes left out (which may not fit: see :func:`.dense.fit`); a bias holds
    ``-inf`` in some cells."""
    full = (*batch, H, L, S)
    keep = draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)), label="axes")
    shape = tuple(n if k else 1 for n, k in zip(full, keep, strict=True))
    drop = draw(st.integers(0, len(full)), label="leading axes dropped")
    shape = shape[drop:]  # with batch axes, one axis fewer reads (*batch, L, S): it may not fit
    if np.dtype(dtype) == bool:
        return np.asarray(rng.random(shape) < 0.7)  # a 0-d array stays an array
    bias = values(rng, shape, draw(pick([np.float64, np.float32, np.int64])))
    if bias.dtype.kind == "f" and draw(st.booleans(), label="-inf"):
        bias[rng.random(shape) < 0.25] = -np.inf
    return bias


@st.composite
def scores(draw: Any, rng: np.random.Generator, H: int, backward: bool) -> dict[str, Any]:
    """The score variants and the scale, each given or not; ``backward``: the call asks for
    gradients (a ``score_mod`` comes with its derivative)."""
    kw: dict[str, Any] = {}
    given = lambda name: draw(chance(0.2), label=name)  # noqa: E731
    if given("sinks"):
        sinks = values(rng, (H,), np.float64, 2.0)
        kw["sinks"] = sinks.tolist() if draw(st.booleans(), label="as list") else sinks
    if given("softcap"):
        kw["softcap"] = float(rng.uniform(0.5, 5.0))
    if given("alibi"):
        kw["alibi"] = draw(pick([True, False, "slopes"]), label="alibi")
        if kw["alibi"] == "slopes":
            kw["alibi"] = rng.uniform(0.0, 1.0, H)
    if given("score_mod"):
        mod, grad = draw(pick(score_mods(rng)), label="score_mod")
        kw["score_mod"] = mod
        if backward or draw(st.booleans(), label="with its gradient"):
            kw["score_mod_grad"] = grad
    if given("scale"):
        kw["scale"] = draw(pick([0.5, 1, np.float32(0.25), 2.0, 0.05]), label="scale")
    return kw


def flags(name: str) -> st.SearchStrategy[Any]:
    return pick([True, False, np.False_])


@st.composite
def kernel(draw: Any) -> dict[str, Any]:
    """``max_memory`` and ``workers``: tiny budgets make many tiles of small calls."""
    kw: dict[str, Any] = {}
    if draw(chance(0.5), label="max_memory given"):
        kw["max_memory"] = draw(pick([1, 64, 4096, 2**20, np.int64(5000)]))
    if draw(chance(0.5), label="workers given"):
        kw["workers"] = draw(pick([1, 2, 3]))
    return kw


# Values the contract refuses, per keyword (a value or a function of the call's sizes).
NOT_FLAGS = [1, 0, "yes", 1.0, None]
NOT_POSITIVE = [0, -1, 2.5, "3", True, np.float64(2.0)]
NOT_REAL = [0, -1.0, float("nan"), float("inf"), "2", True]
BAD: dict[str, Callable[[np.random.Generator, tuple[int, ...], int, int, int], list[Any]]] = {
    "mask": lambda g, batch, H, L, S: [
        np.ones((L, S), np.int64),
        np.ones((L, S)),
        "causal",
        np.ones((L + 1, S + 2), bool),
        [[1, 0]],
    ],
    "causal": lambda *_: NOT_FLAGS[:-1],
    "causal_alignment": lambda *_: ["bottom-right", "TOP_LEFT", 0],
    "key_lengths": lambda g, batch, H, L, S: bad_lengths(batch, S),
    "query_lengths": lambda g, batch, H, L, S: bad_lengths(batch, L),
    "bias": lambda g, batch, H, L, S: [
        np.zeros((L + 1, S + 2)),
        np.zeros((L, S), complex),
        np.zeros((L, S), bool),
        np.zeros((L, S), object),
    ],
    "window": lambda *_: NOT_POSITIVE,
    "sink_tokens": lambda *_: [-1, 1.5, "2", True],
    "chunk": lambda *_: NOT_POSITIVE,
    "mask_mod": lambda *_: [
        3,
        described("(b, h, q) -> q", lambda b, h, q: q),
        described("ints", lambda b, h, q, kv: (q >= kv).astype(int)),
        described("5-D", lambda b, h, q, kv: np.ones((3,) * 5, bool)),
    ],
    "sinks": lambda g, batch, H, L, S: [  # (with no query heads, none is empty: bad still)
        np.zeros(H + 1),
        np.full(max(H, 1), np.nan),
        np.full(max(H, 1), np.inf),
        np.zeros(max(H, 1), complex),
    ],
    "softcap": lambda *_: NOT_REAL,
    "alibi": lambda g, batch, H, L, S: [np.ones(H + 1), np.full(max(H, 1), np.nan), "yes"],
    "score_mod": lambda *_: [
        3,
        described("(s, b) -> s", lambda s, b: s),
        described("changes shape", lambda s, b, h, q, kv: np.concatenate([s, s], axis=-1)),
    ],
    "scale": lambda *_: NOT_REAL,
    "max_memory": lambda *_: NOT_POSITIVE,
    "workers": lambda *_: NOT_POSITIVE,
    "dropout_p": lambda *_: [1.0, -0.1, float("nan"), "0.1", True],
}


def bad_lengths(batch: tuple[int, ...], top: int) -> list[Any]:
    """Lengths the contract refuses for a batch shape and a count of positions ``top``:
    past it, negative, not integers (a value of an empty batch is no value: its shape)."""
    wrong_shape = [np.zeros((*batch, 2), int), [[0]]]
    if math.prod(batch) == 0:
        return wrong_shape
    return [np.full(batch, top + 1), np.full(batch, -1), np.full(batch, 0.5), *wrong_shape]


@st.composite
def spoil(draw: Any, rng: np.random.Generator, drawn: Drawn, names: list[str],
          sizes: tuple[tuple[int, ...], int, int, int]) -> None:  # fmt: skip
    """Replace one of ``names`` in ``drawn`` with a value the contract refuses."""
    name = draw(pick(names), label="spoiled keyword")
    value = draw(pick(BAD[name](rng, *sizes)), label=f"bad {name}")
    if name == "sink_tokens":
        drawn.kwargs.setdefault("window", 2)
    if name == "causal_alignment":
        drawn.kwargs["causal"] = True
    if name == "dropout_p":
        drawn.kwargs["generator"] = np.random.default_rng(0)
    drawn.kwargs[name] = value
    drawn.refuse.add(name)
    if getattr(value, "__doc__", None) in LAZY:
        drawn.spoilt_by_callback(name)


@st.composite
def failing_callback(draw: Any, drawn: Drawn) -> None:
    """A ``mask_mod`` or ``score_mod`` that raises: mha must let the error through."""
    name = draw(pick(["mask_mod", "score_mod"]), label="failing callback")
    drawn.kwargs[name] = described("raises UserCallbackError", _raise)
    if name == "score_mod":
        drawn.kwargs.pop("return_backward", None)
        drawn.kwargs.pop("score_mod_grad", None)
    drawn.spoilt_by_callback(name)


LAZY = {"ints", "5-D", "changes shape", "raises UserCallbackError"}
"""The callbacks refused only when called."""


def refused_dtype_value(rng: np.random.Generator, shape: tuple[int, ...], kind: int) -> Any:
    return values(rng, shape, INVALID[kind % len(INVALID)])
