"""ALiBi's forms beyond one slope per head: each sequence's own slopes ``(*batch, H)``
(FlashAttention's ``(batch, nheads)``) and the symmetric distance ``-slope * |p_i - p_j|``
(``mha.symmetric_alibi``, FlashAttention's for keys on both sides), forward and backward, on
both walks, against the bias written out densely (NumPy, and torch's autograd for the
gradients)."""

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


def dense(q, k, v, slopes, *, symmetric, causal, offset=None):
    """``softmax(q k^T / sqrt(d) + bias) v`` with the bias of each sequence's slopes
    ``(B, H)`` at positions ``i + offset`` and ``j`` (``offset``: ``S - L`` by default)."""
    L, d = q.shape[-2:]
    S = k.shape[-2]
    offset = S - L if offset is None else offset
    distance = (np.arange(L)[:, None] + offset) - np.arange(S)[None]
    distance = np.abs(distance) if symmetric else distance
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(d) - slopes[:, :, None, None] * distance
    if causal:
        scores = np.where(np.arange(S)[None] <= np.arange(L)[:, None] + offset, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ v


@pytest.mark.parametrize("walk", ["default", "numpy"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_per_sequence_and_symmetric_slopes(causal, symmetric, walk, monkeypatch, record_error):
    if walk == "numpy":
        monkeypatch.setattr(compiled, "walk_available", lambda: False)
    rng = np.random.default_rng(int(causal) * 2 + int(symmetric))
    q = rng.standard_normal((3, 4, 5, 8))
    k, v = rng.standard_normal((2, 3, 4, 7, 8))
    slopes = rng.uniform(0.05, 1.0, (3, 4))
    alibi = mha.symmetric_alibi(slopes) if symmetric else slopes
    out = mha.scaled_dot_product_attention(q, k, v, causal=causal, alibi=alibi)
    want = dense(q, k, v, slopes, symmetric=symmetric, causal=causal)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-13)
    record_error(
        "ALiBi per sequence, symmetric vs the bias written out, float64",
        relative(out, want),
    )
    per_head = mha.scaled_dot_product_attention(  # one row for every sequence: (H,) as before
        q, k, v, causal=causal,
        alibi=mha.symmetric_alibi(slopes[0]) if symmetric else slopes[0],
    )  # fmt: skip
    want = dense(q, k, v, np.broadcast_to(slopes[0], (3, 4)), symmetric=symmetric, causal=causal)
    np.testing.assert_allclose(per_head, want, rtol=0, atol=1e-13)


def test_the_forms_agree_where_every_key_is_at_or_before_its_query():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 2, 4, 6, 8))
    signed = mha.scaled_dot_product_attention(q, k, v, causal=True, alibi=True)
    both = mha.scaled_dot_product_attention(q, k, v, causal=True, alibi=mha.symmetric_alibi())
    np.testing.assert_allclose(both, signed, rtol=0, atol=1e-14)


def test_gradients_of_the_symmetric_and_per_sequence_forms_match_torch(torch):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 3, 4, 8))
    k, v = rng.standard_normal((2, 2, 3, 6, 8))
    slopes = rng.uniform(0.1, 1.0, (2, 3))
    out, backward = mha.scaled_dot_product_attention(
        q, k, v, alibi=mha.symmetric_alibi(slopes), return_backward=True
    )
    grad = rng.standard_normal(out.shape)
    grads = backward(grad)
    distance = np.abs(np.arange(4)[:, None] + 2 - np.arange(6)[None])
    bias = -slopes[:, :, None, None] * distance
    expected, expected_grads = dense_autograd(torch, q, k, v, grad, 1 / np.sqrt(8), bias=bias)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-13)
    for name in "qkv":
        np.testing.assert_allclose(grads[name], expected_grads[name], rtol=0, atol=1e-12)


def test_the_layer_function_paged_attention_and_dask_take_them():
    rng = np.random.default_rng(7)
    B, L, E, H = 2, 5, 16, 4
    X = rng.standard_normal((B, L, E))
    W = rng.standard_normal((4, E, E)) / 4
    slopes = rng.uniform(0.1, 1.0, (B, H))
    out = mha.multi_head_attention(X, X, X, *W, H, causal=True, alibi=slopes)
    q, k, v = ((X @ w).reshape(B, L, H, 4).transpose(0, 2, 1, 3) for w in W[:3])
    heads = dense(q, k, v, slopes, symmetric=False, causal=True)
    want = heads.transpose(0, 2, 1, 3).reshape(B, L, E) @ W[3]
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    pool_k = k.transpose(0, 2, 1, 3).reshape(B * L, 1, H, 4)  # blocks of one token
    pool_v = v.transpose(0, 2, 1, 3).reshape(B * L, 1, H, 4)
    table = np.arange(B * L).reshape(B, L)
    paged = mha.paged_attention(q.transpose(0, 2, 1, 3), pool_k, pool_v, table, [L, L],
                                causal=True, alibi=mha.symmetric_alibi(slopes))  # fmt: skip
    np.testing.assert_allclose(paged.transpose(0, 2, 1, 3), heads, rtol=0, atol=1e-13)
    if os.environ.get("MHA_REQUIRE_DASK") == "1":
        pass  # (a missing dask fails the run)
    da = pytest.importorskip("dask.array", reason="the dask extra is not installed")
    lazy = importlib.import_module("mha.dask").scaled_dot_product_attention(
        da.from_array(q, chunks=(1, H, 2, 4)), da.from_array(k, chunks=(1, H, 3, 4)), v,
        alibi=mha.symmetric_alibi(slopes),
    )  # fmt: skip
    want = dense(q, k, v, slopes, symmetric=True, causal=False)
    np.testing.assert_allclose(lazy.compute(), want, rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda q: mha.scaled_dot_product_attention(q, q, q, alibi=np.ones((3, 2))), r"\(2, 2\)"),
        (lambda q: mha.scaled_dot_product_attention(q, q, q, alibi=mha.symmetric_alibi([1.0])),
         r"\(2,\)"),
        (lambda q: mha.MultiHeadAttention(4, 2, alibi=mha.symmetric_alibi()), "a call's"),
        (lambda q: mha.scaled_dot_product_attention(q, q, q, alibi=np.full((2, 2), np.nan)),
         "finite"),
    ],
)  # fmt: skip
def test_refusals_name_the_argument_and_the_shapes(call, named):
    with pytest.raises(AttentionError, match=named):
        call(np.ones((2, 2, 3, 4)))


def test_dask_cuts_each_sequences_slopes_with_its_batch_blocks():
    """A batch chunked in blocks of two runs each block by the in-memory function with its
    own rows of the slopes (the whole call's were refused as the wrong shape)."""
    if os.environ.get("MHA_REQUIRE_DASK") == "1":
        import dask.array  # noqa: F401  (a missing dask fails the run)
    da = pytest.importorskip("dask.array", reason="the dask extra is not installed")
    lazy_mha = importlib.import_module("mha.dask")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 2, 6, 4))
    slopes = rng.uniform(0.1, 1.0, (4, 2))
    for alibi in (slopes, mha.symmetric_alibi(slopes)):
        lazy = lazy_mha.scaled_dot_product_attention(
            da.from_array(x, chunks=(2, 2, 6, 4)), x, x, alibi=alibi, causal=True
        )
        want = mha.scaled_dot_product_attention(x, x, x, alibi=alibi, causal=True)
        np.testing.assert_allclose(lazy.compute(), want, rtol=0, atol=1e-14)
    X = rng.standard_normal((4, 6, 8))
    W = rng.standard_normal((4, 8, 8))
    chunked = da.from_array(X, chunks=(2, 6, 8))
    lazy = lazy_mha.multi_head_attention(chunked, chunked, chunked, *W, 2, alibi=slopes,
                                         causal=True)  # fmt: skip
    want = mha.multi_head_attention(X, X, X, *W, 2, alibi=slopes, causal=True)
    np.testing.assert_allclose(lazy.compute(), want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("slopes", [None, False])
def test_symmetric_alibi_needs_slopes(slopes):
    with pytest.raises(AttentionError, match="leave alibi= out"):
        mha.symmetric_alibi(slopes)
