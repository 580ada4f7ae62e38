"""``mha.flash_compat.flash_attn_with_kvcache`` against a reference written from
FlashAttention's own test of it (``test_flash_attn_kvcache``): the new keys rotated at
``cache_seqlens[b] + t`` and written into the cache there, the queries rotated at
``cache_seqlens[b] + i`` (causal or windowed) or all at ``cache_seqlens[b]``, keys seen from
``cache_leftpad[b]`` to ``cache_seqlens[b] + seqlen_new``, the window bottom-right on those,
in plain NumPy one sequence and head at a time; and ``mha.apply_rotary``'s ``cos=``/``sin=``
tables against the rotation written out."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.flash import reference, relative

import mha
from mha.errors import AttentionError
from mha.flash_compat import flash_attn_with_kvcache


def rotated(x, cos, sin, positions, interleaved):
    """``x (seqlen, H, d)`` rotated at ``positions (seqlen,)`` by the tables, written out
    (FlashAttention's ``apply_rotary_emb``)."""
    out = x.copy()
    half = cos.shape[1]
    for t, p in enumerate(positions):
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            c, s = cos[p, i], sin[p, i]
            out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return out


def expected(q, k_cache, v_cache, k, v, tables, held, rows, leftpad, causal, window, slopes):
    """The reference's outputs ``(batch, seqlen, H, d_v)``, lse ``(batch, H, seqlen)`` and
    the caches after the append."""
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    batch, seqlen = q.shape[:2]
    local = window != (-1, -1)
    outs, lses = [], []
    for b in range(batch):
        queries = q[b]
        if k is not None:
            new_k = k[b]
            if tables is not None:
                cos, sin, interleaved = tables
                steps = np.arange(seqlen) if causal or local else np.zeros(seqlen, int)
                queries = rotated(queries, cos, sin, held[b] + steps, interleaved)
                new_k = rotated(new_k, cos, sin, held[b] + np.arange(len(new_k)), interleaved)
            k_cache[rows[b], held[b] : held[b] + len(new_k)] = new_k
            v_cache[rows[b], held[b] : held[b] + len(new_k)] = v[b]
        end = held[b] + (0 if k is None else k.shape[1])
        keys = k_cache[rows[b], leftpad[b] : end]
        values = v_cache[rows[b], leftpad[b] : end]
        per = None if slopes is None else slopes
        out, lse, _ = reference(queries, keys, values, causal=causal, window=window, slopes=per,
                                seqlen_k=k_cache.shape[1])  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses), k_cache, v_cache


CASES = list(
    itertools.product(
        [False, True],  # causal
        [(-1, -1), (3, 0), (2, 2)],  # window_size
        [None, "interleaved", "halves"],  # rotary
        [False, True],  # cache_batch_idx
        [False, True],  # cache_leftpad
    )
)


@pytest.mark.parametrize(("causal", "window", "rotary", "indexed", "padded"), CASES)
def test_flash_attn_with_kvcache_matches_its_definition(
    causal, window, rotary, indexed, padded, record_error
):
    rng = np.random.default_rng(len(CASES))
    batch, seqlen, new, H, H_kv, d, room = 3, 2, 2, 4, 2, 8, 12
    rows_cache = 5 if indexed else batch
    q = rng.standard_normal((batch, seqlen, H, d))
    k_cache = rng.standard_normal((rows_cache, room, H_kv, d))
    v_cache = rng.standard_normal((rows_cache, room, H_kv, d))
    k, v = rng.standard_normal((2, batch, new, H_kv, d))
    held = np.array([0, 4, 9])
    rows = np.array([3, 0, 4]) if indexed else np.arange(batch)
    leftpad = np.array([0, 3, 2]) if padded else np.zeros(batch, int)
    tables = None
    if rotary is not None:
        angles = rng.uniform(0, 2 * np.pi, (room, 3))  # rotary_dim 6 of 8
        tables = (np.cos(angles), np.sin(angles), rotary == "interleaved")
    slopes = rng.uniform(0.1, 1, H)
    want = expected(q, k_cache, v_cache, k, v, tables, held, rows, leftpad, causal, window, slopes)
    given = [x.copy() for x in (q, k, v)]
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v,
        rotary_cos=None if tables is None else tables[0],
        rotary_sin=None if tables is None else tables[1],
        cache_seqlens=held, cache_batch_idx=rows if indexed else None,
        cache_leftpad=leftpad if padded else None, causal=causal, window_size=window,
        rotary_interleaved=True if tables is None else tables[2], alibi_slopes=slopes,
        return_softmax_lse=True,
    )  # fmt: skip
    np.testing.assert_allclose(out, want[0], rtol=0, atol=1e-12)
    record_error("flash_attn_with_kvcache vs FlashAttention's definition, float64",
                 relative(out, want[0]))  # fmt: skip
    assert np.array_equal(np.isinf(lse), np.isinf(want[1]))
    finite = np.isfinite(want[1])
    np.testing.assert_allclose(lse[finite], want[1][finite], rtol=1e-12)
    np.testing.assert_allclose(k_cache, want[2], rtol=0, atol=1e-15)  # the append, in place
    assert np.array_equal(v_cache, want[3])
    for x, y in zip(given, (q, k, v), strict=True):
        assert np.array_equal(x, y)


def test_without_new_tokens_the_caches_are_read_only():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 2, 4))
    k_cache, v_cache = rng.standard_normal((2, 2, 6, 1, 4))
    k_cache.flags.writeable = v_cache.flags.writeable = False
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=[4, 6], causal=True)
    want = expected(q, k_cache, v_cache, None, None, None, [4, 6], [0, 1], [0, 0], True,
                    (-1, -1), None)  # fmt: skip
    np.testing.assert_allclose(out, want[0], rtol=0, atol=1e-12)
    whole = flash_attn_with_kvcache(q, k_cache, v_cache)  # no lengths: the whole cache
    np.testing.assert_allclose(
        whole, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=6), rtol=0, atol=0
    )


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_a_paged_cache_gives_the_dense_caches_answer(block_size):
    rng = np.random.default_rng(block_size)
    batch, room, H_kv, d = 3, 12, 2, 8
    q = rng.standard_normal((batch, 2, 4, d))
    k, v = rng.standard_normal((2, batch, 2, H_kv, d))
    dense_k, dense_v = rng.standard_normal((2, batch, room, H_kv, d))
    held = np.array([1, 5, 10])
    blocks = -(-room // block_size)
    order = rng.permutation(batch * blocks + 1)
    table = order[: batch * blocks].reshape(batch, blocks)
    pool_k = rng.standard_normal((len(order), block_size, H_kv, d))
    pool_v = rng.standard_normal((len(order), block_size, H_kv, d))
    for b in range(batch):
        for position in range(room):
            block, slot = table[b, position // block_size], position % block_size
            pool_k[block, slot], pool_v[block, slot] = dense_k[b, position], dense_v[b, position]
    angles = rng.uniform(0, 6, (room + 2, 4))
    keywords = dict(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles), cache_seqlens=held,
                    causal=True, window_size=(4, 0))  # fmt: skip
    dense = flash_attn_with_kvcache(q, dense_k, dense_v, k, v, **keywords)
    paged = flash_attn_with_kvcache(q, pool_k, pool_v, k, v, block_table=table, **keywords)
    np.testing.assert_allclose(paged, dense, rtol=0, atol=0)
    for b in range(batch):  # the same tokens written where the table says
        for position in range(held[b], held[b] + 2):
            block, slot = table[b, position // block_size], position % block_size
            assert np.array_equal(pool_k[block, slot], dense_k[b, position])
            assert np.array_equal(pool_v[block, slot], dense_v[b, position])


def refusals():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 2, 4))
    k, v = rng.standard_normal((2, 2, 1, 1, 4))
    cos = np.ones((8, 2))
    return (
        q,
        k,
        v,
        cos,
        [
            ({"k": k, "v": v}, "cache_seqlens is needed"),
            ({"k": k, "v": v, "cache_seqlens": [3, 6]}, "more than the cache's room"),
            ({"k": k, "cache_seqlens": 1}, "k and v come together"),
            ({"cache_seqlens": [1, 2], "cache_leftpad": [2, 0]}, "cache_leftpad"),
            ({"k": k, "v": v, "cache_seqlens": 1, "cache_batch_idx": [1, 1]}, "names a row twice"),
            ({"cache_seqlens": 1, "cache_batch_idx": [0, 5]}, "cache_batch_idx"),
            ({"cache_seqlens": 1, "rotary_cos": cos, "rotary_sin": cos}, "give k and v too"),
            ({"k": k, "v": v, "cache_seqlens": 1, "rotary_cos": cos}, "come together"),
            (
                {
                    "k": k,
                    "v": v,
                    "cache_seqlens": [1, 5],
                    "rotary_cos": cos[:5],
                    "rotary_sin": cos[:5],
                },
                "positions must lie in",
            ),
            ({"k": k[:, :, :, :3], "v": v, "cache_seqlens": 1}, "k must have shape"),
            ({"cache_seqlens": [1.0, 2.0]}, "cache_seqlens"),
            ({"num_splits": -1}, "num_splits"),
        ],
    )


@pytest.mark.parametrize("case", range(len(refusals()[4])))
def test_refusals_name_the_argument_and_leave_the_caches_alone(case):
    q, _, _, _, cases = refusals()
    keywords, named = cases[case]
    rng = np.random.default_rng(1)
    k_cache, v_cache = rng.standard_normal((2, 2, 6, 1, 4))
    saved = k_cache.copy(), v_cache.copy()
    with pytest.raises(AttentionError, match=named):
        flash_attn_with_kvcache(q, k_cache, v_cache, **keywords)
    assert np.array_equal(k_cache, saved[0]) and np.array_equal(v_cache, saved[1])


def test_a_cache_that_cannot_be_written_is_refused():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 1, 1, 4))
    k, v = rng.standard_normal((2, 1, 1, 1, 4))
    frozen = rng.standard_normal((1, 4, 1, 4))
    frozen.flags.writeable = False
    with pytest.raises(AttentionError, match="read-only"):
        flash_attn_with_kvcache(q, frozen, frozen.copy(), k, v, cache_seqlens=0)
    with pytest.raises(AttentionError, match="written into them"):
        flash_attn_with_kvcache(q, [[[[0.0] * 4]] * 4], np.zeros((1, 4, 1, 4)), k, v,
                                cache_seqlens=0)  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_with_tables(interleaved):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 5, 8))  # (B, H, L, d)
    angles = rng.uniform(0, 6, (12, 3))  # rotary_dim 6
    positions = rng.integers(0, 12, (2, 5))
    got = mha.apply_rotary(x, positions, cos=np.cos(angles), sin=np.sin(angles),
                           interleaved=interleaved)  # fmt: skip
    for b in range(2):
        want = rotated(x[b].transpose(1, 0, 2), np.cos(angles), np.sin(angles), positions[b],
                       interleaved).transpose(1, 0, 2)  # fmt: skip
        np.testing.assert_allclose(got[b], want, rtol=0, atol=1e-15)
    back = mha.apply_rotary(got, positions, cos=np.cos(angles), sin=np.sin(angles),
                            interleaved=interleaved, inverse=True)  # fmt: skip
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-14)
    theta = 10000.0 ** (-np.arange(0, 8, 2) / 8)  # the default tables give the default rotation
    table = np.arange(12)[:, None] * theta
    np.testing.assert_allclose(
        mha.apply_rotary(x, positions, cos=np.cos(table), sin=np.sin(table)),
        mha.apply_rotary(x, positions), rtol=0, atol=1e-14,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"cos": np.ones((4, 2))}, "come together"),
        ({"cos": np.ones((4, 2)), "sin": np.ones((4, 3))}, "same shape"),
        ({"cos": np.ones((4, 5)), "sin": np.ones((4, 5))}, "at most the head width"),
        ({"cos": np.ones((4, 2)), "sin": np.ones((4, 2)), "rotary_dim": 2}, "rotary_dim"),
        ({"cos": np.ones((4, 2)), "sin": np.ones((4, 2)), "theta": 500.0}, "give one or the other"),
        ({"cos": np.ones((2, 2)), "sin": np.ones((2, 2))}, r"positions must lie in \[0, 2\)"),
        ({"cos": np.full((4, 2), np.nan), "sin": np.ones((4, 2))}, "finite"),
    ],
)
def test_apply_rotary_tables_refusals(keywords, named):
    with pytest.raises(AttentionError, match=named):
        mha.apply_rotary(np.ones((3, 8)), [0, 1, 2], **keywords)
    with pytest.raises(AttentionError, match="integers"):
        mha.apply_rotary(np.ones((3, 8)), [0.0, 1.0, 2.0], cos=np.ones((4, 4)), sin=np.ones((4, 4)))


def test_a_refused_append_leaves_both_caches_as_they_were():
    """The blocks the new tokens go to are checked before anything is written: a block of
    the second sequence outside the pool left the first's keys written and its values not
    (the review of this change found it)."""
    rng = np.random.default_rng(8)
    k_cache, v_cache = rng.standard_normal((2, 6, 4, 1, 8))
    saved = k_cache.copy(), v_cache.copy()
    q, k, v = rng.standard_normal((3, 2, 2, 1, 8))
    with pytest.raises(AttentionError, match=r"block_table\[1\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=[3, 3],
                                block_table=np.array([[0, 1], [2, 9]]), causal=True)  # fmt: skip
    assert np.array_equal(k_cache, saved[0]) and np.array_equal(v_cache, saved[1])


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"block_table": 3}, "block_table"),
        ({"softcap": None}, "softcap"),
        ({"softcap": "x"}, "softcap"),
        ({"window_size": (1.7, 0.2)}, "window_size's left"),
        ({"window_size": (True, False)}, "window_size's left"),
        ({"alibi_slopes": np.ones((3, 2))}, "alibi_slopes"),
    ],
)
def test_more_refusals_name_the_argument(keywords, named):
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 1, 2, 4))
    k_cache, v_cache = rng.standard_normal((2, 2, 6, 1, 4))
    with pytest.raises(AttentionError, match=named):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2, **keywords)
