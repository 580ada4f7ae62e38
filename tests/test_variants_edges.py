"""The variants' edges, each found once wrong: masks that differ by head on the compiled
path, weights with chunks and sink tokens, refused cached calls, zero sizes, truncating
into the sink tokens, and NumPy 2.4's strided ``out=``. References are dense NumPy."""

from __future__ import annotations

import numpy as np
import pytest

import mha

rng = np.random.default_rng(181)


def dense(q, k, v, allowed, sinks=None):
    """Plain softmax attention, float64, with the sinks in the denominator."""
    s = np.where(allowed, q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), -np.inf)
    top = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[:, None, None] - top)
    return (e / np.where(total == 0, 1, total)) @ v, e / np.where(total == 0, 1, total)


def close(a, b, tolerance=1e-13):
    return np.abs(a - b).max() <= tolerance * max(1.0, np.abs(b).max())


@pytest.mark.parametrize("max_memory", [None, 10**9])
def test_masks_that_differ_by_head_on_every_path(max_memory):
    """Large enough for the compiled step, one head per work item: a per-head mask_mod,
    and a per-head boolean mask beside a mask_mod, each head seeing its own keys."""
    q, k, v = rng.standard_normal((3, 2, 600, 4))
    i, j = np.arange(600)[:, None], np.arange(600)[None]
    h = np.arange(2)[:, None, None]
    per_head = mha.scaled_dot_product_attention(
        q, k, v, mask_mod=lambda b, h, i, j: (i >= j) & (i - j < 50 * (h + 1)),
        max_memory=max_memory,
    )  # fmt: skip
    assert close(per_head, dense(q, k, v, (i >= j) & (i - j < 50 * (h + 1)))[0])
    striped = np.ones((2, 600, 600), bool)
    striped[1, :, ::2] = False
    both = mha.scaled_dot_product_attention(
        q, k, v, mask=striped, mask_mod=lambda b, h, i, j: i >= j, max_memory=max_memory
    )
    assert close(both, dense(q, k, v, striped & (i >= j))[0])


@pytest.mark.parametrize(
    "keywords",
    [{"causal": True, "chunk": 3}, {"causal": True, "window": 2, "sink_tokens": 1},
     {"causal": True, "window": 3, "sink_tokens": 2, "chunk": 4, "sinks": np.array([0.5])}],
)  # fmt: skip
def test_weights_with_chunks_and_sink_tokens(keywords):
    q, k, v = rng.standard_normal((3, 1, 9, 4))
    out, weights = mha.scaled_dot_product_attention(q, k, v, return_weights=True, **keywords)
    i, j = np.arange(9)[:, None], np.arange(9)[None]
    allowed = j <= i
    if "chunk" in keywords:
        allowed &= i // keywords["chunk"] == j // keywords["chunk"]
    if "window" in keywords:
        allowed &= (j < keywords["sink_tokens"]) | (i - j < keywords["window"])
    expected, expected_weights = dense(q, k, v, allowed, keywords.get("sinks"))
    assert close(out, expected) and close(weights, expected_weights)
    assert close(out, weights @ v)


def test_a_refused_cached_call_leaves_the_cache_as_it_was():
    cache = mha.KVCache(1, 2, 4, window=4, capacity=8)
    x = rng.standard_normal((1, 2, 9, 4))
    mha.scaled_dot_product_attention(x, x, x, cache=cache)
    state = (cache.first.copy(), cache.lengths.copy(), cache.capacity, cache.k.copy())
    refusals = [
        ({"chunk": 0}, mha.AttentionValueError, "chunk"),
        ({"mask_mod": lambda b, h, i, j: (i >= j).astype(int)}, mha.AttentionTypeError,
         "mask_mod must return booleans"),
        ({"score_mod": lambda s, b, h, i, j: s[..., :1]}, mha.ShapeError, "score_mod"),
    ]  # fmt: skip
    for keywords, error, match in refusals:
        with pytest.raises(error, match=match):
            mha.scaled_dot_product_attention(x, x, x, cache=cache, **keywords)
        assert (cache.first == state[0]).all() and (cache.lengths == state[1]).all()
        assert cache.capacity == state[2] and np.array_equal(cache.k, state[3])
    unwindowed = mha.KVCache(1, 1, 4, capacity=4)
    ones = np.ones((1, 1, 6, 4))
    with pytest.raises(mha.AttentionValueError, match="sink_tokens=2"):
        mha.scaled_dot_product_attention(ones, ones, ones, cache=unwindowed, sink_tokens=2)
    assert unwindowed.capacity == 4


@pytest.mark.parametrize(("B", "L", "S"), [(2, 0, 5), (2, 0, 0), (0, 0, 3), (0, 3, 3)])
def test_sinks_gradients_of_zero_sizes(B, L, S):
    q, k = np.ones((B, 2, L, 4)), np.ones((B, 2, S, 4))
    out, backward = mha.scaled_dot_product_attention(
        q, k, k, sinks=np.zeros(2), return_backward=True
    )
    grads = backward(np.ones_like(out))
    assert grads["sinks"].shape == (2,) and (grads["sinks"] == 0).all()
    assert grads["q"].shape == q.shape and grads["k"].shape == k.shape


def test_truncating_into_the_sink_tokens():
    cache = mha.KVCache(1, 1, 4, window=4, sink_tokens=2, capacity=4)
    y = rng.standard_normal((1, 1, 20, 4))
    for t in range(20):
        step = y[:, :, t : t + 1]
        mha.scaled_dot_product_attention(step, step, step, cache=cache)
    cache.truncate(2)  # the next token sees the sink tokens alone: all held
    steps = [mha.scaled_dot_product_attention(*(y[:, :, t : t + 1],) * 3, cache=cache)
             for t in range(2, 12)]  # fmt: skip
    whole = mha.scaled_dot_product_attention(
        *(y[:, :, :12],) * 3, causal=True, window=4, sink_tokens=2
    )
    assert close(np.concatenate(steps, axis=2), whole[:, :, 2:12])
    for t in range(12, 18):
        mha.scaled_dot_product_attention(*(y[:, :, t : t + 1],) * 3, cache=cache)
    with pytest.raises(mha.AttentionValueError, match="dropped its positions"):
        cache.truncate(8)  # positions 5..7 were dropped


def test_module_settings_read_back():
    assert mha.MultiHeadAttention(8, 2, window=4, sink_tokens=0).sink_tokens is None
    custom = mha.MultiHeadAttention(8, 2, alibi=[0.5, 0.25])
    assert "alibi=[0.5, 0.25]" in repr(custom)
    assert "alibi=True" in repr(mha.MultiHeadAttention(8, 2, alibi=True))
    with pytest.raises(mha.AttentionValueError, match="non-negative"):
        mha.scaled_dot_product_attention(*np.ones((3, 1, 2, 3, 4)), window=2, sink_tokens=-1)


def test_a_score_mod_that_writes_in_place_is_told_to_return():
    def in_place(score, b, h, i, j):
        score += 1.0
        return score

    with pytest.raises(mha.AttentionValueError, match="in place; return"):
        mha.scaled_dot_product_attention(*np.ones((3, 1, 2, 3, 4)), score_mod=in_place)


def test_one_query_row_per_sequence_backward_is_finite():
    """NumPy 2.4 wrote a (G, 1) slice's negation into a strided column from the wrong
    elements; the backward's -lse column took +inf for the second head."""
    q = rng.standard_normal((2, 8, 8, 3))
    k = rng.standard_normal((2, 8, 31, 3))
    out, backward = mha.scaled_dot_product_attention(
        q, k, k, query_lengths=[1, 1], return_backward=True
    )
    grads = backward(np.ones_like(out))
    assert all(np.isfinite(g).all() for g in grads.values())
    one, backward_one = mha.scaled_dot_product_attention(q[:, :, :1], k, k, return_backward=True)
    assert close(grads["q"][:, :, :1], backward_one(np.ones_like(one))["q"], 1e-12)
