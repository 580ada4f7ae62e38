"""What a model changes in the scores and the softmax, each with its gradient beside it.

Each tile's scores ``s = (q * scale) @ k_tile.T`` pass through a pipeline of transforms
(:class:`ScoreTransform`), in the order the call's spec lists them, before the bias and the
masks; today, in this order:

* :class:`SoftCap` (Gemma 2): ``s = c * tanh(s / c)``, derivative ``1 - tanh(s / c)^2``;
* :class:`ScoreMod`: ``score_mod(s, b, h, q_idx, kv_idx)`` (FlexAttention's), derivative
  ``score_mod_grad``;
* :class:`Alibi` (BLOOM, MPT): ``s += -slope_h * (position_i - position_j)``, computed per
  tile from the positions (:meth:`ItemVisibility.query_positions`), never as an ``(L, S)``
  array.

A new change to the scores is one more class with ``apply`` (and its derivative), placed in
the pipeline by the spec (:mod:`mha.api.spec`). A change that scales each query's row alike
(:class:`QueryTemperature`) is no transform: the kernel folds it into the queries, where the
models apply it, and every walk takes the call.

Learned sinks (gpt-oss) add ``exp(sink_h)`` to each row's softmax denominator: a key with
logit ``sink_h`` and no value. The kernel computes the rows without it and :func:`add_sinks`
folds it in at the end, the log-sum-exp merge of the rows with a part whose output is zero;
so split keys, merged partials and every tile size add it exactly once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .item import ItemVisibility
from .traced import traced

__all__ = [
    "Alibi",
    "QueryTemperature",
    "ScoreMod",
    "ScoreTransform",
    "Scores",
    "SoftCap",
    "Tile",
    "add_sinks",
    "sink_gradient",
]


class Tile(NamedTuple):
    """Rows ``[r0, r1)`` and keys ``[c0, c1)`` of one work item's query heads."""

    item: ItemVisibility
    r0: int
    r1: int
    c0: int
    c1: int


class ScoreTransform(Protocol):
    """One change to the scaled scores, in the pipeline of :class:`Scores`: ``apply``
    changes a tile ``s (G, group * n, w)`` in place and, with ``derivative``, returns
    d(changed)/d(given) (``None`` where it is 1). ``nonlinear``: the backward needs that
    derivative (and so the raw scores); ``compiled``: the compiled softmax step can apply
    it itself (:meth:`Alibi.rows`)."""

    @property
    def nonlinear(self) -> bool: ...

    @property
    def compiled(self) -> bool: ...

    def apply(self, s: np.ndarray, tile: Tile, derivative: bool) -> np.ndarray | None: ...


@dataclass(frozen=True)
class SoftCap:
    """Gemma 2's soft-capping: ``s = cap * tanh(s / cap)``, derivative ``1 - tanh(s / cap)^2``."""

    cap: float
    nonlinear = True
    compiled = False

    def apply(self, s: np.ndarray, tile: Tile, derivative: bool) -> np.ndarray | None:
        s *= 1.0 / self.cap
        np.tanh(s, out=s)
        factor = 1.0 - s * s if derivative else None
        s *= self.cap
        return factor


@dataclass(frozen=True)
class ScoreMod:
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``, with its derivative
    ``gradient`` (same arguments) for the backward: each computed over a tile by its traced
    loop where it can be (:mod:`.traced`), else by the function itself."""

    function: Callable[..., Any]
    gradient: Callable[..., Any] | None = None
    nonlinear = True
    compiled = False

    def apply(self, s: np.ndarray, tile: Tile, derivative: bool) -> np.ndarray | None:
        n, w = tile.r1 - tile.r0, tile.c1 - tile.c0
        view = s.reshape(1, s.size // max(1, n * w), n, w)
        view.flags.writeable = False  # the function returns its result
        indices = tile.item.indices(tile.r0, tile.r1, tile.c0, tile.c1)
        slope = None
        if derivative:
            assert self.gradient is not None  # checked with the call
            slope = traced(self.gradient, view, indices)
            if slope is None:
                given = _call(self.gradient, view, *indices)
                slope = _result("score_mod_grad", given, view)
        writable = s.reshape(view.shape[1:])  # (the loop reads each pair before writing it)
        if not np.may_share_memory(writable, s):  # (a copy: the rows of s lie apart)
            writable = np.empty(writable.shape, s.dtype)
        changed = traced(self.function, view, indices, out=writable)  # one compiled pass
        if changed is None:
            changed = _result("score_mod", _call(self.function, view, *indices), view)
        if not np.may_share_memory(changed, s):
            np.copyto(s, changed.reshape(s.shape), casting="same_kind")
        return slope


@dataclass(frozen=True, eq=False)
class Alibi:
    """ALiBi (BLOOM, MPT): ``s += -slope_h * (position_i - position_j)``, computed per
    tile from the positions (:meth:`ItemVisibility.query_positions`), never as an ``(L,
    S)`` array. ``slopes (H,)`` float64, or ``(sequences, H)``: each sequence's own (the
    flat batch index, :attr:`ItemVisibility.sequence`). ``symmetric``: ``-slope_h *
    |position_i - position_j|`` (FlashAttention's for keys on both sides, MosaicBERT's),
    the same where the keys are at or before the query; in the NumPy pass."""

    slopes: np.ndarray
    symmetric: bool = False
    nonlinear = False

    @property
    def compiled(self) -> bool:  # (the compiled softmax step adds the signed distance)
        return not self.symmetric

    def _slopes(self, item: ItemVisibility) -> np.ndarray:
        """The slopes of ``item``'s heads: its sequence's, when each has its own."""
        slopes = self.slopes if self.slopes.ndim == 1 else self.slopes[item.sequence]
        return slopes[item.heads]

    def apply(self, s: np.ndarray, tile: Tile, derivative: bool) -> np.ndarray | None:
        item, r0, r1, c0, c1 = tile
        n, w = r1 - r0, c1 - c0
        distance = item.key_positions(c0, c1)[None, :] - item.query_positions(r0, r1)[:, None]
        if self.symmetric:
            distance = -np.abs(distance)
        distance = distance.astype(s.dtype)  # exact: whole numbers
        slopes = self._slopes(item).astype(s.dtype)
        stacked = s.reshape(s.size // max(1, n * w), n, w)
        for g in range(stacked.shape[0]):  # one pass per head over an (n, w) tile
            stacked[g] += slopes[g] * distance
        return None

    def rows(
        self, item: ItemVisibility, r0: int, r1: int, c0: int, G: int, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        """ALiBi for the compiled step: each stacked row's slope ``(G, group * n)`` and its
        query position less key ``c0``'s (the tile's keys have consecutive positions)."""
        n = r1 - r0
        slopes = np.repeat(self._slopes(item).astype(dtype), n).reshape(G, -1)
        base = item.query_positions(r0, r1) - int(item.key_positions(c0, c0 + 1)[0])
        return slopes, np.tile(base, slopes.shape[1] // max(n, 1))


@dataclass(frozen=True)
class QueryTemperature:
    """A temperature of each query that grows with its position: the scores of the query at
    position ``p`` times ``t(p)``, by one of two laws of ``x = (p + offset) / floor``:
    ``"log"``, ``t(p) = 1 + beta * log(1 + floor(x))`` (Llama 4's ``attn_temperature_tuning``:
    ``beta = attn_scale``, ``floor = floor_scale``, ``offset = 1``; Ministral 3's and
    Mistral 4's ``llama_4_scaling_beta``: ``floor = original_max_position_embeddings``,
    ``offset = 0``), or ``"power"``, ``t(p) = (1 + x) ** beta`` (Beam's scalable softmax:
    ``(0.1, 2048, 1)``). It is a factor of the query's row, so the kernel folds it into the
    queries (:meth:`mha._kernel.call.KernelCall.folded`), as the models do: every walk,
    compiled or not, takes the call, and the queries' gradient is the folded one's times
    ``t(p)``."""

    beta: float
    floor: float
    offset: float = 0.0
    law: str = "log"

    def factors(self, positions: np.ndarray) -> np.ndarray:
        """``t(p)`` of integer ``positions``, in float64."""
        x = (positions + self.offset) / self.floor
        if self.law == "power":
            return np.exp(self.beta * np.log1p(x))  # (1 + x) ** beta, as Beam computes it
        return 1.0 + self.beta * np.log1p(np.floor(x))

    def keyword(self) -> tuple[float | str, ...]:
        """The keyword ``query_temperature`` that gives this temperature: ``(beta, floor,
        offset)``, and the law when it is ``"power"``."""
        given = (self.beta, self.floor, self.offset)
        return given if self.law == "log" else (*given, self.law)


@dataclass(frozen=True, eq=False)
class Scores:
    """A call's changes to the scores: the ``transforms``, applied in order, and the learned
    ``sinks (H,)`` (float64 logits per query head, or ``None``), added to the softmax."""

    transforms: tuple[ScoreTransform, ...] = ()
    sinks: np.ndarray | None = None
    temperature: QueryTemperature | None = None  # folded into the queries before the walks

    @functools.cached_property
    def _alibi(self) -> Alibi | None:  # (read once a tile: kept)
        alibi: Alibi | None = self._first(Alibi)
        return alibi

    def _first(self, kind: type) -> Any:
        return next((t for t in self.transforms if isinstance(t, kind)), None)

    @property
    def relative(self) -> Any:
        """The relative-position bias among the transforms (:mod:`.relative`), or ``None``."""
        return next((t for t in self.transforms if hasattr(t, "table_gradient")), None)

    @property
    def softcap(self) -> float | None:
        cap = self._first(SoftCap)
        return None if cap is None else float(cap.cap)

    @property
    def alibi(self) -> np.ndarray | None:
        alibi = self._alibi
        return None if alibi is None else alibi.slopes

    @property
    def fused_alibi(self) -> bool:
        """Whether the compiled softmax step adds the ALiBi bias (its signed form)."""
        alibi = self._alibi
        return alibi is not None and alibi.compiled

    @property
    def changes_scores(self) -> bool:
        return bool(self.transforms) or self.temperature is not None

    def without_sinks(self) -> Scores | None:
        """These changes less the sinks (for parts that a merge adds them to once)."""
        if not self.changes_scores:
            return None
        return Scores(self.transforms, temperature=self.temperature)

    @functools.cached_property
    def nonlinear(self) -> bool:
        """Whether the backward pass needs the raw scores and a derivative (read once a
        tile: kept)."""
        return any(t.nonlinear for t in self.transforms)

    def apply(
        self,
        s: np.ndarray,
        item: ItemVisibility,
        r0: int,
        r1: int,
        c0: int,
        c1: int,
        derivative: bool = False,
        alibi: bool = True,
    ) -> np.ndarray | None:
        """Change the scaled scores ``s (G, group * n, w)`` of rows ``[r0, r1)`` and keys
        ``[c0, c1)`` of ``item``'s query heads (``group`` stacked per key/value head) in
        place, by each transform in turn; with ``derivative``, return d(changed)/d(scaled),
        or ``None`` where it is 1. ``alibi=False`` leaves the transforms the compiled
        softmax step applies (ALiBi: :meth:`alibi_rows`) to it."""
        tile = Tile(item, r0, r1, c0, c1)
        factor = None
        for transform in self.transforms:
            if transform.compiled and not alibi:
                continue
            slope = transform.apply(s, tile, derivative)
            if slope is not None:
                factor = slope if factor is None else factor * slope.reshape(factor.shape)
        return None if factor is None else factor.reshape(s.shape)

    def alibi_rows(
        self, item: ItemVisibility, r0: int, r1: int, c0: int, G: int, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        """ALiBi for the compiled step (:meth:`Alibi.rows`)."""
        alibi = self._alibi
        assert alibi is not None
        rows: tuple[np.ndarray, np.ndarray] = alibi.rows(item, r0, r1, c0, G, dtype)
        return rows


def _call(function: Callable[..., Any], score: np.ndarray, *indices: np.ndarray) -> Any:
    """A score function at read-only scores: one that writes into them is told to return."""
    try:
        return function(score, *indices)
    except ValueError as error:
        if "read-only" not in str(error):
            raise
        raise AttentionValueError(
            f"{getattr(function, '__name__', 'score_mod')} changed the scores it was given in "
            "place; return the changed scores instead (score + bias, not score += bias)"
        ) from None


def _result(name: str, value: Any, score: np.ndarray) -> np.ndarray:
    result = np.asarray(value)
    if result.shape != score.shape:
        raise ShapeError(
            f"{name} must return an array of the score's shape {score.shape}; it returned "
            f"shape {result.shape}"
        )
    if result.dtype.kind != "f":
        raise AttentionTypeError(
            f"{name} must return real floating scores; it returned dtype {result.dtype}"
        )
    return result


def add_sinks(out: np.ndarray, lse: np.ndarray, sinks: np.ndarray) -> None:
    """Fold each head's sink logit into the rows' softmax, in place: ``out (*batch, H, L,
    d)`` and ``lse (*batch, H, L)`` computed without it become those with it (``lse`` the
    log of the whole denominator; a row that saw no key keeps a zero output, with lse the
    sink's logit)."""
    sink = sinks.astype(lse.dtype)[:, None]  # (H, 1): broadcast over rows
    total = np.logaddexp(lse, sink)
    out *= np.exp(lse - total)[..., None]
    lse[...] = total


def sink_gradient(
    out: np.ndarray, lse: np.ndarray, grad_out: np.ndarray, sinks: np.ndarray
) -> np.ndarray:
    """The gradient of ``sum(grad_out * out)`` for each head's sink logit, ``(H,)``: a sink
    takes the share ``p = exp(sink - lse)`` of each row's softmax from its keys, so
    ``d out_i / d sink = -p_i * out_i``."""
    share = np.exp(sinks.astype(lse.dtype)[:, None] - lse)  # (*batch, H, L)
    D = np.einsum("...d,...d->...", grad_out, out.astype(grad_out.dtype, copy=False))
    total = -(share * D)  # (*batch, H, L)
    per_head: np.ndarray = total.sum(
        axis=tuple(a for a in range(total.ndim) if a != total.ndim - 2)
    )
    return per_head
