"""The small functions: ``mha.merge_attention``, ``mha.apply_rotary`` and
``mha.alibi_slopes``, with every keyword, valid and not, against formulas from their
docstrings."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha
from support.reference import paper_slopes

from . import dense
from .arrays import chance, data, data_dtypes, drawn_rng, pick, sizes, values
from .keywords import NOT_FLAGS, NOT_POSITIVE, NOT_REAL
from .outcome import Call, expect_array, expect_close
from .rules import as_float64, dtype_of, dtypes, tolerance


@st.composite
def merge_calls(draw: Any) -> Call:
    """``merge_attention(outputs, lses, sinks=)`` over 1 to 3 parts ``(..., L, d_v)``."""
    rng = drawn_rng(draw, "seed")
    lead = tuple(draw(sizes, label="axis") for _ in range(draw(st.integers(0, 2), label="axes")))
    L, d_v = draw(sizes, label="L"), draw(sizes, label="d_v")
    parts = draw(st.integers(1, 3), label="parts")
    dtype = draw(data_dtypes, label="dtype")
    outputs = [draw(data(rng, (*lead, L, d_v), dtype), label="output") for _ in range(parts)]
    lses = []
    for _ in range(parts):
        lse = values(rng, (*lead, L), np.float64, 3.0)
        lse[rng.random(lse.shape) < 0.3] = -np.inf  # rows that saw no key in this part
        lses.append(lse.astype(draw(pick([np.float64, np.float32]), label="lse")))
    kwargs: dict[str, Any] = {}
    refuse: set[str] = set()
    if lead and draw(chance(0.25), label="sinks"):
        kwargs["sinks"] = values(rng, lead[-1:], np.float64, 2.0)
    spoil = draw(pick(["none"] * 30 + ["outputs", "lses", "counts", "shapes",
                                                 "sinks"]), label="spoil")  # fmt: skip
    outs: Any = outputs
    if spoil == "outputs":
        outs = np.asarray(outputs) if draw(st.booleans(), label="array") else outputs[0]
        refuse.add("outputs")
    elif spoil == "lses":
        lses = [np.zeros((*lead, L + 1))] * parts
        refuse |= {"lses", "outputs"}
    elif spoil == "counts":
        lses = lses[:-1]
        refuse |= {"lses", "outputs"}
    elif spoil == "shapes" and parts > 1:
        outs = [*outputs[:-1], np.zeros((*lead, L, d_v + 1))]
        refuse.add("outputs")
    elif spoil == "sinks":
        kwargs["sinks"] = draw(pick([np.zeros(7), np.full(1, np.nan)]), label="sinks")
        refuse.add("sinks")
    call = Call("merge_attention", mha.merge_attention, (outs, lses), kwargs,
                frozenset(refuse) or None)  # fmt: skip
    call.check = lambda result: check_merge(outputs, lses, kwargs.get("sinks"), result)
    return call


def check_merge(outputs: list[Any], lses: list[np.ndarray], sinks: Any, result: Any) -> float:
    """``out = sum_p exp(lse_p - lse) out_p`` with ``lse = log sum_p exp(lse_p)`` (plus
    ``exp(sink_h)``, which scales every row down); rows with no key anywhere stay zero
    with ``lse = -inf`` (``sink_h`` with sinks)."""
    out, lse = result
    rdtype, cdtype = dtypes(*outputs)
    ldtype = dtypes(*outputs, *lses)[1]
    expect_array("out", out, np.shape(outputs[0]), rdtype, finite=True)
    expect_array("lse", lse, lses[0].shape, ldtype, finite=False)
    logs = np.stack([np.asarray(x, np.float64) for x in lses])
    if sinks is not None:
        logs = np.concatenate([logs, np.broadcast_to(
            np.asarray(sinks, np.float64)[:, None], logs.shape[1:])[None]])  # fmt: skip
    with np.errstate(divide="ignore", invalid="ignore"):
        top = np.max(logs, axis=0)
        top = np.where(np.isfinite(top), top, 0.0)
        merged = np.log(np.exp(logs - top).sum(axis=0)) + top
        weights = np.exp(logs[: len(outputs)] - np.where(np.isfinite(merged), merged, 0.0))
    expected = sum(w[..., None] * as_float64(o) for w, o in zip(weights, outputs, strict=True))
    tol = tolerance(rdtype, cdtype)
    error = expect_close("out", out, np.asarray(expected), tol)
    return max(error, expect_close("lse", lse, merged, tolerance(ldtype, ldtype)))


SCALINGS: list[Any] = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4096},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
]  # fmt: skip
"""Rope scalings; the reference knows ``linear`` and ``dynamic`` below its threshold
(the unscaled frequencies), the others are checked for shape, dtype and finiteness."""

BAD_SCALINGS = [{"rope_type": "linear"}, {"rope_type": "bogus", "factor": 2.0},
                {"rope_type": "linear", "factor": 0.5}, {"rope_type": "linear", "factor": 2.0,
                                                         "ntk": True}, "linear"]  # fmt: skip


def rope_factor(scaling: Any, positions: Any) -> float | None:
    """The factor that divides the positions, for the scalings the reference knows."""
    if scaling is None:
        return 1.0
    if scaling["rope_type"] == "linear":
        return float(scaling["factor"])
    if scaling["rope_type"] == "dynamic" and np.size(positions) and (
        np.max(positions) + 1 <= scaling["max_position_embeddings"]
    ):  # fmt: skip
        return 1.0
    return None


@st.composite
def rotary_calls(draw: Any) -> Call:
    """``apply_rotary(x, positions, theta=, rotary_dim=, interleaved=, scaling=, inverse=)``."""
    rng = drawn_rng(draw, "seed")
    lead = tuple(draw(sizes, label="axis") for _ in range(draw(st.integers(0, 2), label="axes")))
    L, d = draw(sizes, label="L"), draw(pick([2, 4, 6, 8, 0, 2, 4, 3]), label="d")
    x = draw(data(rng, (*lead, L, d), draw(data_dtypes, label="dtype")), label="x")
    positions: Any = rng.integers(0, 50, (lead[0], L) if lead and draw(
        chance(0.3), label="per sequence") else (L,))  # fmt: skip
    if draw(chance(0.25), label="real positions"):
        positions = positions + rng.random(positions.shape)
    kwargs: dict[str, Any] = {}
    refuse: set[str] = set()
    if draw(chance(0.5), label="theta"):
        kwargs["theta"] = draw(pick([10000.0, 1.0, 500000, 3.5]), label="theta")
    if draw(chance(0.3), label="rotary_dim"):
        kwargs["rotary_dim"] = draw(pick([r for r in (2, 4) if r <= d] or [2]))
    for name in ("interleaved", "inverse"):
        if draw(chance(0.3), label=name):
            kwargs[name] = draw(st.booleans(), label=name)
    if draw(chance(0.3), label="scaling"):
        kwargs["scaling"] = draw(pick(SCALINGS), label="scaling")
        if (kwargs["scaling"] or {}).get("rope_type") == "yarn" and kwargs.get("theta") == 1.0:
            refuse |= {"theta", "scaling"}  # yarn divides by log(theta)
    if d % 2 and "rotary_dim" not in kwargs:
        refuse.add("rotary_dim")
    if kwargs.get("rotary_dim", 0) > d:
        refuse.add("rotary_dim")
    if (kwargs.get("scaling") or {}).get("rope_type") == "dynamic" and kwargs.get(
        "rotary_dim", d) == 2:  # fmt: skip
        refuse |= {"rotary_dim", "scaling"}
    spoil = draw(pick(["none"] * 48 + ["x", "positions", "theta", "rotary_dim",
                                                 "interleaved", "inverse", "scaling",
                                                 "seq_len"]), label="spoil")  # fmt: skip
    if spoil == "x":
        x = np.zeros(d)
    elif spoil == "positions":
        positions = draw(pick([np.arange(L + 1), np.zeros((7, L)), np.ones(L, bool),
                                          np.zeros(L, complex), "0, 1"]), label="bad")  # fmt: skip
    elif spoil == "theta":
        kwargs["theta"] = draw(pick(NOT_REAL), label="bad theta")
    elif spoil == "rotary_dim":
        kwargs["rotary_dim"] = draw(pick([3, d + 2, *NOT_POSITIVE]), label="bad")
    elif spoil in ("interleaved", "inverse"):
        kwargs[spoil] = draw(pick(NOT_FLAGS[:-1]), label="bad flag")
    elif spoil == "scaling":
        kwargs["scaling"] = draw(pick(BAD_SCALINGS), label="bad scaling")
    elif spoil == "seq_len":
        kwargs["seq_len"] = draw(pick(NOT_REAL), label="bad seq_len")
    if spoil != "none":
        refuse.add(spoil)
    call = Call("apply_rotary", mha.apply_rotary, (x, positions), kwargs,
                frozenset(refuse) or None)  # fmt: skip
    call.check = lambda result: check_rotary(x, positions, kwargs, result)
    return call


def check_rotary(x: Any, positions: Any, kw: dict[str, Any], result: Any) -> float | None:
    shape, rdtype = np.shape(x), dtype_of(x)
    expect_array("x rotated", result, shape, rdtype, finite=True)
    factor = rope_factor(kw.get("scaling"), positions)
    if factor is None:
        return None
    at = np.asarray(positions, np.float64)
    if at.ndim == 2:  # (B, L): one row per sequence along x's first axis
        at = at.reshape(at.shape[0], *(1,) * (len(shape) - 3), at.shape[1])
    sign = -1.0 if kw.get("inverse") else 1.0
    expected = dense.rotate(as_float64(x), sign * at, float(kw.get("theta", 10000.0)),
                            kw.get("rotary_dim"), bool(kw.get("interleaved")), factor)  # fmt: skip
    return expect_close("x rotated", result, expected, tolerance(rdtype))


@st.composite
def alibi_calls(draw: Any) -> Call:
    """``alibi_slopes(num_heads)`` against the paper's code."""
    n = draw(st.one_of(st.integers(1, 70), pick([np.int64(8), 2**10])), label="n")
    refuse = None
    if draw(chance(0.2), label="spoil"):
        n = draw(pick(NOT_POSITIVE), label="bad n")
        refuse = frozenset({"num_heads"})

    def check(result: Any) -> float:
        expect_array("slopes", result, (n,), np.float64, finite=True)
        return expect_close("slopes", result, paper_slopes(int(n)), 1e-12)

    return Call("alibi_slopes", mha.alibi_slopes, (n,), refuse=refuse, check=check)
