"""``window=(left, right)``: FlashAttention's ``window_size`` as a keyword of every entry
point, query ``i`` seeing key ``j`` iff ``i + offset - left <= j <= i + offset + right``
(-1 unbounded; ``causal`` makes ``right`` 0), forward and backward on both walks, against
the mask written out densely (and torch's autograd for the gradients)."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
from support.flash import relative
from support.torch_reference import dense_autograd

import mha
from mha._kernel import compiled
from mha.errors import AttentionError

SIDES = [(2, 1), (-1, 2), (1, -1), (0, 0), (3, 2), (-1, 0), (0, 3), (-1, -1)]


def allowed(L, S, sides, causal, offset=None):
    offset = S - L if offset is None else offset
    left, right = sides
    right = 0 if causal else right
    i, j = np.arange(L)[:, None] + offset, np.arange(S)[None]
    ok = np.ones((L, S), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def dense(q, k, v, ok):
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    scores = np.where(ok, scores, -np.inf)
    top = np.max(scores, -1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0))
    total = weights.sum(-1, keepdims=True)
    return np.where(total > 0, weights / np.where(total > 0, total, 1), 0) @ v


@pytest.mark.parametrize("walk", ["default", "numpy"])
@pytest.mark.parametrize(("L", "S"), [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_both_sides(causal, L, S, walk, monkeypatch, record_error):
    if walk == "numpy":
        monkeypatch.setattr(compiled, "walk_available", lambda: False)
    rng = np.random.default_rng(L * 10 + S)
    q = rng.standard_normal((2, 3, L, 8))
    k, v = rng.standard_normal((2, 2, 3, S, 8))
    for sides in SIDES:
        out = mha.scaled_dot_product_attention(q, k, v, window=sides, causal=causal)
        want = dense(q, k, v, allowed(L, S, sides, causal))
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-13, err_msg=str(sides))
        record_error(
            "window=(left, right) vs the mask written out, float64",
            relative(out, want),
        )
    one_side = mha.scaled_dot_product_attention(q, k, v, window=(2, -1), causal=causal)
    assert np.array_equal(one_side, mha.scaled_dot_product_attention(q, k, v, window=3,
                                                                     causal=causal))  # fmt: skip


def test_gradients_match_torch(torch):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2, 7, 4))
    k, v = rng.standard_normal((2, 2, 2, 7, 4))
    for sides in [(2, 1), (-1, 2), (1, 3)]:
        out, backward = mha.scaled_dot_product_attention(q, k, v, window=sides,
                                                         return_backward=True)  # fmt: skip
        grad = rng.standard_normal(out.shape)
        grads = backward(grad)
        ok = allowed(7, 7, sides, False)
        expected, expected_grads = dense_autograd(torch, q, k, v, grad, 0.5, allowed=ok)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-13)
        for name in "qkv":
            np.testing.assert_allclose(grads[name], expected_grads[name], rtol=0, atol=1e-12)


def test_the_layer_the_module_paged_attention_and_dask_take_it():
    rng = np.random.default_rng(4)
    B, L, E, H = 2, 6, 8, 2
    layer = mha.MultiHeadAttention(E, H, seed=0, window=3)
    X = rng.standard_normal((B, L, E))
    out = layer(X, window=(4, 2))  # the module's window narrows the left side: (2, 2)
    q, k, v = ((X @ w).reshape(B, L, H, 4).transpose(0, 2, 1, 3)
               for w in (layer.W_q, layer.W_k, layer.W_v))  # fmt: skip
    heads = dense(q, k, v, allowed(L, L, (2, 2), False))
    want = heads.transpose(0, 2, 1, 3).reshape(B, L, E) @ layer.W_o
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-13)
    function = mha.multi_head_attention(X, X, X, layer.W_q, layer.W_k, layer.W_v, layer.W_o, H,
                                        window=(2, 2))  # fmt: skip
    np.testing.assert_allclose(function, want, rtol=0, atol=1e-13)
    pool_k = k.transpose(0, 2, 1, 3).reshape(B * L, 1, H, 4)  # blocks of one token
    pool_v = v.transpose(0, 2, 1, 3).reshape(B * L, 1, H, 4)
    table = np.arange(B * L).reshape(B, L)
    paged = mha.paged_attention(q.transpose(0, 2, 1, 3), pool_k, pool_v, table, [L, L],
                                window=(2, 2))  # fmt: skip
    np.testing.assert_allclose(paged.transpose(0, 2, 1, 3), heads, rtol=0, atol=1e-13)
    if os.environ.get("MHA_REQUIRE_DASK") == "1":
        import dask.array  # noqa: F401  (a missing dask fails the run)
    da = pytest.importorskip("dask.array", reason="the dask extra is not installed")
    lazy = importlib.import_module("mha.dask").scaled_dot_product_attention(
        da.from_array(q, chunks=(1, H, 2, 4)), da.from_array(k, chunks=(1, H, 3, 4)), v,
        window=(2, 2),
    )  # fmt: skip
    np.testing.assert_allclose(lazy.compute(), heads, rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    ("window", "named"),
    [((1, 2, 3), "pair"), ((-2, 0), "window's left"), ((0, 1.5), "window's right"),
     (("a", 0), "window's left"), ((True, 0), "window's left")],
)  # fmt: skip
def test_refusals_name_the_window(window, named):
    q = np.ones((1, 2, 3, 4))
    with pytest.raises(AttentionError, match=named):
        mha.scaled_dot_product_attention(q, q, q, window=window)


def test_sink_tokens_need_a_left_side():
    q = np.ones((1, 1, 3, 4))
    with pytest.raises(AttentionError, match="a left side of -1"):
        mha.scaled_dot_product_attention(q, q, q, window=(-1, 1), sink_tokens=1)


def test_a_cache_refuses_the_right_side_and_is_left_unchanged():
    layer = mha.MultiHeadAttention(8, 2, seed=0)
    cache = layer.new_cache(1)
    X = np.ones((1, 3, 8))
    layer(X, cache=cache)
    with pytest.raises(AttentionError, match="right side"):
        layer(X, cache=cache, window=(2, 1))
    assert cache.lengths.tolist() == [3]
    layer(X, cache=cache, window=(2, 0))  # the left side alone: as window=3
