"""``mha.flash_compat`` (FlashAttention's ``flash_attn_func`` and ``flash_attn_varlen_func``)
and ``causal_alignment="bottom_right_per_sequence"``, against a reference written from
FlashAttention's own definitions (its tests' ``construct_local_mask`` and
``attn_bias_from_alibi_slopes`` rules, in plain NumPy, one sequence and head at a time): a
query ``i`` of a sequence of ``sq`` queries and ``sk`` keys sees key ``j`` iff ``i + sk - sq -
left <= j <= i + sk - sq + right`` (a side of -1 unbounded, ``right = 0`` when causal); the
score is ``softcap * tanh(scale * q.k / softcap)`` (with a softcap), then ``- slope * |i + sk -
sq - j|`` (with ALiBi); a row that sees nothing is zero with a log-sum-exp of ``+inf``."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from support.flash import reference, relative
from support.torch_reference import dense_autograd

import mha
from mha._kernel import compiled
from mha.errors import AttentionError
from mha.flash_compat import flash_attn_func, flash_attn_varlen_func

WINDOWS = [(-1, -1), (2, 0), (1, 3), (0, 2), (-1, 1), (3, -1), (0, 0), (-1, 0)]


def operands(rng, batch, sq, sk, H=4, H_kv=2, d=8, dtype=np.float64):
    q = rng.standard_normal((batch, sq, H, d)).astype(dtype)
    k = rng.standard_normal((batch, sk, H_kv, d)).astype(dtype)
    v = rng.standard_normal((batch, sk, H_kv, d)).astype(dtype)
    return q, k, v


def slopes_for(kind, batch, H, rng):
    if kind is None:
        return None
    if kind == "heads":
        return rng.uniform(0.1, 1.0, H)
    return rng.uniform(0.1, 1.0, (batch, H))


@pytest.mark.parametrize("walk", ["default", "numpy"])  # (default: compiled where it runs)
@pytest.mark.parametrize(("sq", "sk"), [(5, 5), (3, 8), (8, 3)])
@pytest.mark.parametrize("alibi", [None, "heads", "per_sequence"])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_matches_its_definition(
    causal, softcap, alibi, sq, sk, walk, monkeypatch, record_error
):
    if walk == "numpy":
        monkeypatch.setattr(compiled, "walk_available", lambda: False)
    rng = np.random.default_rng(sq * 100 + sk)
    batch, H = 2, 4
    q, k, v = operands(rng, batch, sq, sk, H)
    slopes = slopes_for(alibi, batch, H, rng)
    given = [x.copy() for x in (q, k, v)]
    for window in WINDOWS:
        out, lse, probabilities = flash_attn_func(
            q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
            return_attn_probs=True,
        )  # fmt: skip
        assert out.shape == (batch, sq, H, 8) and lse.shape == (batch, H, sq)
        for b in range(batch):
            per = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
            want = reference(
                q[b], k[b], v[b], causal=causal, window=window, softcap=softcap, slopes=per
            )
            np.testing.assert_allclose(out[b], want[0], rtol=0, atol=1e-12, err_msg=str(window))
            record_error("flash_attn_func vs FlashAttention's definition, float64",
                         relative(out[b], want[0]))  # fmt: skip
            assert np.array_equal(np.isinf(lse[b]), np.isinf(want[1]))
            finite = np.isfinite(want[1])
            np.testing.assert_allclose(lse[b][finite], want[1][finite], rtol=1e-12, atol=0)
            np.testing.assert_allclose(probabilities[b], want[2], rtol=0, atol=1e-12)
        plain = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                alibi_slopes=slopes)  # fmt: skip
        np.testing.assert_allclose(plain, out, rtol=0, atol=1e-13)  # (another route's rounding)
    for x, y in zip(given, (q, k, v), strict=True):
        assert np.array_equal(x, y)


def test_flash_attn_func_scale_float32_and_empty_rows():
    rng = np.random.default_rng(1)
    q, k, v = operands(rng, 1, 6, 4, dtype=np.float32)
    out, lse, _ = flash_attn_func(
        q, k, v, softmax_scale=0.3, causal=True, return_attn_probs=True
    )  # 6 queries, 4 keys: the first two see none
    assert out.dtype == np.float32 and lse.dtype == np.float32
    want = reference(*(x[0].astype(np.float64) for x in (q, k, v)), scale=0.3, causal=True)
    np.testing.assert_allclose(out[0], want[0], rtol=0, atol=2e-6)
    assert np.all(out[0, :2] == 0) and np.all(lse[0, :, :2] == np.inf)


def packed(rng, q_lengths, k_lengths, H=4, H_kv=2, d=8):
    cu_q = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lengths)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, d))
    k = rng.standard_normal((cu_k[-1], H_kv, d))
    v = rng.standard_normal((cu_k[-1], H_kv, d))
    return q, k, v, cu_q, cu_k


VARLEN = [([3, 0, 5, 1, 4], [4, 2, 5, 0, 9]), ([1, 1, 1], [7, 1, 3]), ([6, 2], [2, 6])]


@pytest.mark.parametrize(("q_lengths", "k_lengths"), VARLEN)
@pytest.mark.parametrize("alibi", [None, "heads", "per_sequence"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_matches_its_definition(
    causal, alibi, q_lengths, k_lengths, record_error
):
    rng = np.random.default_rng(len(q_lengths))
    q, k, v, cu_q, cu_k = packed(rng, q_lengths, k_lengths)
    slopes = slopes_for(alibi, len(q_lengths), 4, rng)
    given = [x.copy() for x in (q, k, v, cu_q, cu_k)]
    for window, softcap in itertools.product(WINDOWS, (0.0, 3.0)):
        out, lse, probabilities = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths) + 1, causal=causal,
            window_size=window, softcap=softcap, alibi_slopes=slopes, return_attn_probs=True,
        )  # fmt: skip
        assert out.shape == q.shape and lse.shape == (4, len(q))
        for b in range(len(q_lengths)):
            rows = slice(cu_q[b], cu_q[b + 1])
            keys = slice(cu_k[b], cu_k[b + 1])
            per = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
            want = reference(q[rows], k[keys], v[keys], causal=causal, window=window,
                             softcap=softcap, slopes=per, seqlen_k=max(k_lengths) + 1)  # fmt: skip
            np.testing.assert_allclose(out[rows], want[0], rtol=0, atol=1e-12)
            if len(want[0]):
                record_error("flash_attn_varlen_func vs FlashAttention's definition, float64",
                             relative(out[rows], want[0]))  # fmt: skip
            assert np.array_equal(np.isinf(lse[:, rows]), np.isinf(want[1]))
            finite = np.isfinite(want[1])
            np.testing.assert_allclose(lse[:, rows][finite], want[1][finite], rtol=1e-12)
            sq, sk = q_lengths[b], k_lengths[b]
            np.testing.assert_allclose(probabilities[b, :, :sq, :sk], want[2], atol=1e-12)
            assert not probabilities[b, :, sq:].any() and not probabilities[b, :, :, sk:].any()
    for x, y in zip(given, (q, k, v, cu_q, cu_k), strict=True):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_flash_attn_varlen_func_reads_a_paged_cache(block_size):
    rng = np.random.default_rng(block_size)
    q_lengths, k_lengths = [2, 1, 3], [5, 3, 7]
    q, k, v, cu_q, cu_k = packed(rng, q_lengths, k_lengths)
    dense = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 7, causal=True, window_size=(3, 0))
    blocks = [-(-n // block_size) for n in k_lengths]
    order = rng.permutation(sum(blocks) + 2)  # blocks in any order, two unused
    table = np.zeros((3, max(blocks)), np.int32)
    pool_k = rng.standard_normal((len(order), block_size, 2, 8))
    pool_v = rng.standard_normal((len(order), block_size, 2, 8))
    used = 0
    for b in range(len(k_lengths)):
        for i in range(blocks[b]):
            block = order[used]
            used += 1
            table[b, i] = block
            rows = slice(cu_k[b] + i * block_size, min(cu_k[b] + (i + 1) * block_size, cu_k[b + 1]))
            count = rows.stop - rows.start
            pool_k[block, :count], pool_v[block, :count] = k[rows], v[rows]
    paged = flash_attn_varlen_func(
        q, pool_k, pool_v, cu_q, cu_k, 3, 7, causal=True, window_size=(3, 0), block_table=table
    )
    assert np.array_equal(paged, dense)


def per_sequence_reference(q, k, v, key_lengths, query_lengths, window=None):
    out = np.zeros((*q.shape[:-1], v.shape[-1]))
    for b in range(len(q)):
        sq, sk = query_lengths[b], key_lengths[b]
        left = -1 if window is None else window - 1
        got = reference(
            q[b, :, :sq].transpose(1, 0, 2), k[b, :, :sk].transpose(1, 0, 2),
            v[b, :, :sk].transpose(1, 0, 2), causal=True, window=(left, 0),
        )[0]  # fmt: skip
        out[b, :, :sq] = got.transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("walk", ["default", "numpy"])  # (default: compiled where it runs)
@pytest.mark.parametrize("window", [None, 1, 3])
def test_per_sequence_alignment(window, walk, monkeypatch):
    """Each sequence's last real query sees its last real key, as FlashAttention's varlen
    causal mask, where ``"bottom_right"`` aligns every sequence on the padded sizes."""
    if walk == "numpy":
        monkeypatch.setattr(compiled, "walk_available", lambda: False)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 2, 6, 8))
    k, v = rng.standard_normal((2, 4, 2, 9, 8))
    query_lengths, key_lengths = np.array([6, 2, 4, 0]), np.array([9, 3, 2, 5])
    out = mha.scaled_dot_product_attention(
        q, k, v, causal=True, causal_alignment="bottom_right_per_sequence", window=window,
        key_lengths=key_lengths, query_lengths=query_lengths,
    )  # fmt: skip
    want = per_sequence_reference(q, k, v, key_lengths, query_lengths, window)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    same = mha.scaled_dot_product_attention(  # without lengths: the padded sizes, as before
        q, k, v, causal=True, causal_alignment="bottom_right_per_sequence", window=window
    )
    plain = mha.scaled_dot_product_attention(q, k, v, causal=True, window=window)
    assert np.array_equal(same, plain)


def test_per_sequence_alignment_gradients_match_torch(torch):
    """The backward walk reads the same alignment: gradients against torch's autograd of
    the mask written out."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 2, 5, 4))
    k, v = rng.standard_normal((2, 3, 2, 7, 4))
    query_lengths, key_lengths = np.array([5, 3, 1]), np.array([7, 2, 6])
    out, backward = mha.scaled_dot_product_attention(
        q, k, v, causal=True, causal_alignment="bottom_right_per_sequence", window=3,
        key_lengths=key_lengths, query_lengths=query_lengths, return_backward=True,
    )  # fmt: skip
    grad = rng.standard_normal(out.shape)
    grads = backward(grad)
    i, j = np.arange(5)[:, None], np.arange(7)[None]
    allowed = np.zeros((3, 1, 5, 7), bool)
    for b in range(3):
        offset = key_lengths[b] - query_lengths[b]
        allowed[b, 0] = (j <= i + offset) & (i + offset - j < 3) & (j < key_lengths[b])
        allowed[b, 0, query_lengths[b] :] = False
    expected, expected_grads = dense_autograd(torch, q, k, v, grad, 0.5, allowed=allowed)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    for name in "qkv":
        np.testing.assert_allclose(grads[name], expected_grads[name], rtol=0, atol=1e-12)


def test_per_sequence_alignment_in_dask():
    if os.environ.get("MHA_REQUIRE_DASK") == "1":
        pass  # (a missing dask fails the run)
    da = pytest.importorskip("dask.array", reason="the dask extra is not installed")

    import mha.dask

    rng = np.random.default_rng(7)
    q = rng.standard_normal((3, 2, 8, 4))
    k, v = rng.standard_normal((2, 3, 2, 8, 4))
    query_lengths, key_lengths = np.array([8, 3, 5]), np.array([6, 8, 2])
    keywords = dict(causal=True, causal_alignment="bottom_right_per_sequence",
                    key_lengths=key_lengths, query_lengths=query_lengths)  # fmt: skip
    want = mha.scaled_dot_product_attention(q, k, v, **keywords)
    np.testing.assert_allclose(
        want, per_sequence_reference(q, k, v, key_lengths, query_lengths), rtol=0, atol=1e-12
    )
    for rows, keys in ((3, 3), (8, 2), (5, 8)):  # the queries and keys cut into chunks
        lazy = mha.dask.scaled_dot_product_attention(
            da.from_array(q, chunks=(1, 2, rows, 4)),
            da.from_array(k, chunks=(1, 2, keys, 4)), v, **keywords,
        )  # fmt: skip
        np.testing.assert_allclose(lazy.compute(), want, rtol=0, atol=1e-12)
    _, natural = mha.scaled_dot_product_attention(q, k, v, return_lse=True, **keywords)
    _, lazy_lse = mha.dask.scaled_dot_product_attention(
        da.from_array(q, chunks=(1, 2, 3, 4)), k, v, return_lse=True, lse_base=2, **keywords
    )  # (the lse in base 2 from the Dask graph too)
    seen = np.isfinite(natural)
    np.testing.assert_allclose(lazy_lse.compute()[seen], natural[seen] / np.log(2), rtol=1e-13)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.1), "dropout_p"),
        (lambda q, k, v: flash_attn_func(q, k, v, window_size=(-2, 0)), "window_size"),
        (lambda q, k, v: flash_attn_func(q, k, v, window_size="wide"), "window_size"),
        (lambda q, k, v: flash_attn_func(q, k, v, softcap=-1.0), "softcap"),
        (lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=np.ones(3)), "alibi_slopes"),
        (lambda q, k, v: flash_attn_func(q[0], k, v), "q"),
        (lambda q, k, v: flash_attn_func(q, k[:1], v[:1]), "batch"),
        (lambda q, k, v: flash_attn_func(q, k, v, causal=1), "causal"),
        (lambda q, k, v: flash_attn_func(q, k, v, return_attn_probs="yes"), "return_attn_probs"),
    ],
)
def test_flash_attn_func_refusals_name_the_argument(call, named):
    q, k, v = operands(np.random.default_rng(0), 2, 3, 3)
    with pytest.raises(AttentionError, match=named):
        call(q, k, v)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"cu_seqlens_q": [1, 3, 7]}, "cu_seqlens_q"),
        ({"cu_seqlens_q": [0, 5, 4]}, "cu_seqlens_q"),
        ({"cu_seqlens_k": [0, 3, 6]}, "cu_seqlens_k"),
        ({"cu_seqlens_k": [0, 7]}, "cu_seqlens_q and cu_seqlens_k"),
        ({"cu_seqlens_q": [0.0, 3.0, 7.0]}, "cu_seqlens_q"),
        ({"max_seqlen_q": 3}, "max_seqlen_q"),
        ({"max_seqlen_k": 2}, "max_seqlen_k"),
        ({"alibi_slopes": np.ones((3, 4))}, "alibi_slopes"),
        ({"block_table": np.zeros((2, 1), np.int32)}, "k must have shape"),
    ],
)
def test_flash_attn_varlen_func_refusals_name_the_argument(change, named):
    q, k, v, cu_q, cu_k = packed(np.random.default_rng(0), [3, 4], [3, 4])
    arguments = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 4, "max_seqlen_k": 4}
    arguments |= change
    with pytest.raises(AttentionError, match=named):
        flash_attn_varlen_func(q, k, v, **arguments)


def test_a_paged_varlen_call_refuses_blocks_outside_the_pool():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 8))
    pool_k, pool_v = rng.standard_normal((2, 4, 2, 2, 8))
    cu_q, cu_k = np.array([0, 3]), np.array([0, 4])  # 4 blocks of 2 in the pool
    with pytest.raises(AttentionError, match=r"block_table\[0\]"):
        flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 3, 4, block_table=[[0, 4]])
    with pytest.raises(AttentionError, match="need 2 blocks"):
        flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 3, 4, block_table=[[0]])
