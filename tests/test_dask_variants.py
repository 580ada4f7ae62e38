"""mha.dask with the variants of today's models (sinks, sink tokens, soft-capping, ALiBi,
chunks, mask_mod, score_mod) against the in-memory functions, every chunking: the sinks
are added once after the merge, and a mask_mod or score_mod sees the call's indices (its
sequence numbers included) in every chunk."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mha

if os.environ.get("MHA_REQUIRE_DASK") == "1":
    import dask  # noqa: F401  (a missing dask fails the run)
da = pytest.importorskip("dask.array", reason="the dask extra is not installed")

import mha.dask  # noqa: E402

B, H, L, S, D = 3, 4, 23, 29, 8
rng = np.random.default_rng(18)
q, k, v = (rng.standard_normal((B, H, n, D)) for n in (L, S, S))
X = rng.standard_normal((B, L, 16))
WEIGHTS = [rng.standard_normal((16, 16)) / 4 for _ in range(4)]
SINKS = rng.standard_normal(H)

# (batch, queries, keys) per chunk; sizes that do not divide the lengths
CHUNKINGS = {"one": (B, L, S), "batch": (1, L, S), "queries": (B, 7, S), "all": (2, 7, 6)}


def by_sequence(b, h, i, j):  # depends on the sequence, the head and both positions
    return ((i + j + b) % 4 != 0) | (h == 1)


def relative(score, b, h, i, j):
    return score + 0.1 * np.cos(i - j) + 0.01 * b * h


VARIANTS = {
    "sinks": {"causal": True, "sinks": SINKS},
    "sinks, window, sink tokens": {"causal": True, "window": 5, "sink_tokens": 2, "sinks": SINKS},
    "softcap, alibi": {"causal": True, "softcap": 1.5, "alibi": True},
    "chunk": {"causal": True, "chunk": 6},
    "mask_mod, score_mod": {"mask_mod": by_sequence, "score_mod": relative},
    "everything": {
        "causal": True,
        "chunk": 10,
        "window": 7,
        "sinks": SINKS,
        "softcap": 2.0,
        "alibi": True,
        "mask_mod": by_sequence,
    },
}


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_split_heads_match_in_memory(chunking, variant, record_error):
    b, n, m = CHUNKINGS[chunking]
    keywords = VARIANTS[variant]
    exact, exact_lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True, **keywords)
    lazy, lazy_lse = mha.dask.scaled_dot_product_attention(
        da.from_array(q, chunks=(b, H, n, D)), da.from_array(k, chunks=(b, H, m, D)),
        da.from_array(v, chunks=(b, H, m, D)), return_lse=True, **keywords,
    )  # fmt: skip
    out, lse = da.compute(lazy, lazy_lse, scheduler="sync")
    error = np.abs(out - exact).max() / np.abs(exact).max()
    assert record_error("mha.dask variants vs in-memory, float64", error) <= 1e-13
    np.testing.assert_allclose(lse, exact_lse, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("chunking", ["one", "batch", "queries"])
@pytest.mark.parametrize("variant", ["sinks", "softcap, alibi", "mask_mod, score_mod"])
def test_projected_match_in_memory(chunking, variant, record_error):
    b, n, _ = CHUNKINGS[chunking]
    keywords = dict(VARIANTS[variant])
    exact = mha.multi_head_attention(X, X, X, *WEIGHTS, H, **keywords)
    lazy = mha.dask.multi_head_attention(
        da.from_array(X, chunks=(b, n, 16)), X, X, *WEIGHTS, H, **keywords
    )
    out = lazy.compute(scheduler="threads")
    error = np.abs(out - exact).max() / np.abs(exact).max()
    assert record_error("mha.dask variants vs in-memory, float64", error) <= 1e-13


def test_refusals_are_the_in_memory_ones():
    lazy_q = da.from_array(q, chunks=(1, H, 7, D))
    with pytest.raises(mha.ShapeError, match="sinks"):
        mha.dask.scaled_dot_product_attention(lazy_q, k, v, sinks=np.zeros(H + 1))
    with pytest.raises(mha.AttentionValueError, match="softcap"):
        mha.dask.scaled_dot_product_attention(lazy_q, k, v, softcap=0.0)
    with pytest.raises(mha.AttentionValueError, match="sink_tokens"):
        mha.dask.scaled_dot_product_attention(lazy_q, k, v, sink_tokens=2)
