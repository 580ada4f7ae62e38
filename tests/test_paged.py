"""Paged caches: ``mha.paged_attention`` over a pool of blocks, and ``mha.PagedKVCache``.

Oracles: a dense float64 computation written here from the same block tables (the keys
gathered with NumPy, the mask written out), torch's SDPA on the gathered keys, a fresh
whole-sequence call for every cached step, and ``mha.KVCache`` (the same bits on the NumPy
walk, which both then take with the same tiles).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.extras import needs_numba
from support.interleavings import History, interleave

import mha
from mha._kernel import compiled


def gathered(pool, table, length):
    """Sequence keys ``(H_kv, length, d)`` from a pool ``(num_blocks, block_size, H_kv, d)``."""
    size = pool.shape[1]
    blocks = [pool[table[j]] for j in range(-(-length // size))]
    rows = np.concatenate(blocks, axis=0) if blocks else pool[:0].reshape(0, *pool.shape[2:])
    return rows[:length].transpose(1, 0, 2)


def dense(q, pool_k, pool_v, table, seq_lens, causal=False, window=None, scale=None):
    """The attention of ``q (B, L, H, d)`` over each sequence's gathered keys, in float64,
    with the bottom-right causal mask and the window written out."""
    B, L, H, d = q.shape
    out = np.zeros((B, L, H, pool_v.shape[-1]))
    for b in range(B):
        n = int(seq_lens[b])
        k = gathered(pool_k, table[b], n).astype(np.float64)
        v = gathered(pool_v, table[b], n).astype(np.float64)
        group = H // k.shape[0]
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        s = np.einsum("lhd,hsd->hls", q[b].astype(np.float64), k)
        s *= 1 / np.sqrt(d) if scale is None else scale
        i, j = np.arange(L)[:, None] + n - L, np.arange(n)[None]
        allowed = np.ones((L, n), bool)
        if causal:
            allowed &= j <= i
        if window is not None:
            allowed &= i - j < window
        s = np.where(allowed, s, -np.inf)
        top = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        top[~np.isfinite(top)] = 0
        e = np.exp(s - top)
        total = e.sum(-1, keepdims=True)
        out[b] = np.einsum("hls,hsd->lhd", e / np.where(total == 0, 1, total), v)
    return out


def random_pool(rng, num_blocks, size, H_kv, d, dtype=np.float64):
    return (rng.standard_normal((num_blocks, size, H_kv, d)).astype(dtype) for _ in range(2))


def shuffled_tables(rng, B, seq_lens, size, num_blocks, shared=0):
    """Block tables of shuffled blocks; the first ``shared`` blocks of every sequence are
    the same ones (a common prefix); unused entries hold garbage (-7)."""
    width = max(-(-int(n) // size) for n in seq_lens)
    table = np.full((B, width + 1), -7)
    blocks = list(rng.permutation(num_blocks))
    prefix = [blocks.pop() for _ in range(shared)]
    for b, n in enumerate(seq_lens):
        need = -(-int(n) // size)
        own = [blocks.pop() for _ in range(max(0, need - shared))]
        table[b, :need] = (prefix + own)[:need]
    return table


CASES = [  # B, L, H, H_kv, d, block_size, seq_lens, keywords
    (3, 1, 4, 2, 16, 4, [10, 3, 1], {}),  # decoding, partial blocks
    (2, 5, 6, 3, 8, 8, [21, 5], {"causal": True}),  # several new tokens, bottom-right
    (2, 3, 2, 1, 8, 2, [9, 2], {"causal": True}),  # a sequence with fewer keys than queries
    (2, 4, 4, 4, 8, 16, [40, 16], {"causal": True, "window": 6}),
    (3, 1, 8, 1, 32, 1, [7, 0, 12], {}),  # blocks of one token; an empty sequence
    (1, 2, 2, 2, 4, 32, [5], {"scale": 0.3}),  # one block larger than the sequence
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=[str(c[:7]) for c in CASES])
def test_paged_attention_matches_a_dense_computation(record_error, case, shared, dtype):
    B, L, H, H_kv, d, size, seq_lens, keywords = case
    rng = np.random.default_rng(sum(seq_lens) + size)
    pool_k, pool_v = random_pool(rng, 64, size, H_kv, d, dtype)
    table = shuffled_tables(rng, B, seq_lens, size, 64, shared=shared if min(seq_lens) else 0)
    q = rng.standard_normal((B, L, H, d)).astype(dtype)
    out, lse = mha.paged_attention(q, pool_k, pool_v, table, seq_lens, return_lse=True,
                                   **keywords)  # fmt: skip
    expected = dense(q, pool_k, pool_v, table, seq_lens, **keywords)
    assert out.dtype == dtype and out.shape == (B, L, H, d) and lse.shape == (B, H, L)
    error = record_error(f"paged_attention vs dense float64, {np.dtype(dtype).name}",
                         float(np.abs(out - expected).max()))  # fmt: skip
    assert error <= (1e-14 if dtype == np.float64 else 2e-6)
    if 0 in seq_lens:  # a sequence without keys: zeros, lse -inf
        b = seq_lens.index(0)
        assert not out[b].any() and np.isneginf(lse[b]).all()


def test_paged_attention_matches_torch_on_the_gathered_keys(torch, record_error):
    rng = np.random.default_rng(1)
    B, L, H, H_kv, d, size, seq_lens = 4, 3, 8, 2, 16, 16, [70, 3, 48, 129]
    pool_k, pool_v = random_pool(rng, 40, size, H_kv, d)
    table = shuffled_tables(rng, B, seq_lens, size, 40, shared=1)
    q = rng.standard_normal((B, L, H, d))
    out, lse = mha.paged_attention(q, pool_k, pool_v, table, seq_lens, causal=True,
                                   return_lse=True)  # fmt: skip
    for b, n in enumerate(seq_lens):
        k = torch.from_numpy(gathered(pool_k, table[b], n).copy())[None]
        v = torch.from_numpy(gathered(pool_v, table[b], n).copy())[None]
        tq = torch.from_numpy(q[b].transpose(1, 0, 2).copy())[None]
        i, j = torch.arange(L)[:, None] + n - L, torch.arange(n)[None]
        mask = j <= i  # bottom-right: the last query sees every key
        expected = torch.nn.functional.scaled_dot_product_attention(tq, k, v, attn_mask=mask,
                                                                    enable_gqa=True)  # fmt: skip
        scores = tq @ torch.repeat_interleave(k, H // H_kv, dim=1).transpose(-1, -2) / d**0.5
        expected_lse = torch.logsumexp(scores.masked_fill(~mask, -torch.inf), dim=-1)
        got = out[b].transpose(1, 0, 2)
        record_error("paged_attention vs torch SDPA, float64",
                     float(np.abs(got - expected[0].numpy()).max()))  # fmt: skip
        np.testing.assert_allclose(got, expected[0].numpy(), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse[b], expected_lse[0].numpy(), rtol=1e-12, atol=1e-13)


def test_paged_attention_takes_bfloat16_pools_in_float32(record_error):
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16  # the test extra installs it
    rng = np.random.default_rng(2)
    pool_k, pool_v = (p.astype(bfloat16) for p in random_pool(rng, 16, 8, 2, 16))
    table = shuffled_tables(rng, 2, [30, 9], 8, 16)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    out = mha.paged_attention(q, pool_k, pool_v, table, [30, 9])
    assert out.dtype == np.float32
    expected = dense(q, pool_k.astype(np.float32), pool_v.astype(np.float32), table, [30, 9])
    assert record_error("paged_attention bfloat16 pool vs float64", float(np.abs(out - expected).max())) <= 2e-6  # fmt: skip  # noqa: E501


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda a: {**a, "block_table": a["block_table"] + 100}, r"block_table\[0, 0\] = 1\d\d is not a block"),  # noqa: E501
        (lambda a: {**a, "seq_lens": [99, 3]}, r"seq_lens must lie in \[0, 12\]"),
        (lambda a: {**a, "seq_lens": [1.0, 3.0]}, "seq_lens must hold integers"),
        (lambda a: {**a, "seq_lens": [3]}, r"seq_lens must have shape \(num_seqs,\) with num_seqs = 2"),  # noqa: E501
        (lambda a: {**a, "q": a["q"][..., :3]}, "same head width d_k"),
        (lambda a: {**a, "q": a["q"][:, :, :3]}, "3 query heads"),
        (lambda a: {**a, "value_cache": a["value_cache"][:, :2]}, "must share"),
        (lambda a: {**a, "key_cache": a["key_cache"][0]}, r"key_cache must have shape \(num_blocks"),  # noqa: E501
    ],
)  # fmt: skip
def test_paged_attention_refuses_what_does_not_fit_by_name(change, said):
    rng = np.random.default_rng(3)
    pool_k, pool_v = random_pool(rng, 8, 4, 2, 8)
    arguments = {"q": rng.standard_normal((2, 1, 4, 8)), "key_cache": pool_k,
                 "value_cache": pool_v, "block_table": np.array([[1, 2, 3], [4, 0, 0]]),
                 "seq_lens": [10, 3]}  # fmt: skip
    with pytest.raises(mha.AttentionError, match=said):
        mha.paged_attention(**change(arguments))


def test_padding_entries_of_a_block_table_are_never_read():
    rng = np.random.default_rng(4)
    pool_k, pool_v = random_pool(rng, 8, 4, 1, 8)
    q = rng.standard_normal((1, 1, 2, 8))
    table = np.array([[3, 1, -1, 10**9]])
    out = mha.paged_attention(q, pool_k, pool_v, table, [6])
    np.testing.assert_array_equal(out, mha.paged_attention(q, pool_k, pool_v, table[:, :2], [6]))


# The paged cache ------------------------------------------------------------------------


def reference_step(history, q, scale=None):
    """One sequence's attention over its whole history ``(H_kv, n, d)`` keys and values,
    its ``L`` newest queries ``(H, L, d)`` aligned bottom-right: a fresh call."""
    k, v = history
    return mha.scaled_dot_product_attention(q[None], k[None], v[None], causal=True)[0]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.data())
def test_random_interleavings_match_whole_sequence_calls(record_error, data):
    """Sequences added, appended to (prefill and decoding), forked, truncated and
    released in any order: every step's output equals a fresh call over that sequence's
    whole history, and the pool gets every block back."""
    size = data.draw(st.sampled_from([1, 3, 4, 16]), label="block_size")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    H, H_kv, d = 4, 2, 8
    cache = mha.PagedKVCache(256, size, H_kv, d, dtype=np.float64)

    def attend(history):  # every sequence appends L tokens and attends: one call
        L = data.draw(st.integers(1, 6), label="new tokens")
        B = len(history)
        q = rng.standard_normal((B, H, L, d))
        k, v = rng.standard_normal((2, B, H_kv, L, d))
        out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
        for b, seq in enumerate(cache.sequences):
            history[seq].append(k[b], v[b])
            expected = reference_step((history[seq].keys, history[seq].values), q[b])
            error = float(np.abs(out[b] - expected).max()) / float(np.abs(expected).max())
            assert record_error("paged cache vs whole-sequence calls", error) <= 1e-12

    interleave(data, cache, lambda: History(H_kv, d), attend)


@pytest.mark.parametrize("path", ["compiled walk", "NumPy walk"])
def test_the_same_bits_as_a_contiguous_cache(monkeypatch, path):
    """Prefill and decoding on a paged cache (blocks of 4, shuffled by releases) and on a
    KVCache give the same bits, on either walk: the same tiles, each key tile either read
    from its blocks in place (decoding's few rows) or copied from them for the GEMMs."""
    if path == "NumPy walk":
        monkeypatch.setattr(compiled, "walk_available", lambda: False)
    else:
        needs_numba(compiled.walk_available(), "the NumPy walk runs alone")
    ran = []
    real = compiled.forward_walk
    monkeypatch.setattr(compiled, "forward_walk", lambda *a: ran.append(1) or real(*a))
    rng = np.random.default_rng(5)
    H, H_kv, d = 8, 2, 16
    paged = mha.PagedKVCache(100, 4, H_kv, d, dtype=np.float64)
    for seq in "xabyc":  # x and y released: the others' blocks lie apart
        paged.add(seq)
    x = rng.standard_normal((5, H, 3, d))
    mha.scaled_dot_product_attention(x, x[:, :H_kv], x[:, :H_kv], cache=paged)
    for seq in "abc":
        paged.truncate(seq, 0)
    paged.release("x")
    paged.release("y")
    contiguous = mha.KVCache(3, H_kv, d, capacity=8)
    for L in [7, 1, 1, 4, 1, 9, 1]:
        q = rng.standard_normal((3, H, L, d))
        k, v = rng.standard_normal((2, 3, H_kv, L, d))
        a = mha.scaled_dot_product_attention(q, k, v, cache=paged)
        b = mha.scaled_dot_product_attention(q, k, v, cache=contiguous)
        np.testing.assert_array_equal(a, b)
    assert (len(ran) > 0) == (path == "compiled walk")
    assert any((np.diff(row[row >= 0]) != 1).any() for row in paged.block_table())  # apart


def test_the_layer_takes_a_paged_cache(record_error):
    """MultiHeadAttention with rotary positions and grouped heads: the paged cache's steps
    equal the KVCache's."""
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=2, rope_theta=10000.0, seed=0)
    X = np.random.default_rng(6).standard_normal((2, 12, 32))
    paged = mha.PagedKVCache(32, 4, 2, 8, dtype=np.float64)
    paged.add(0)
    paged.add(1)
    contiguous = layer.new_cache(batch_size=2)
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 12)]:
        ours = layer(X[:, a:b], cache=paged)
        theirs = layer(X[:, a:b], cache=contiguous)
        error = float(np.abs(ours - theirs).max())
        assert record_error("paged cache vs KVCache, the layer", error) <= 1e-13
    np.testing.assert_allclose(layer(X, mask=True)[:, 7:], ours, rtol=1e-12, atol=1e-13)


def test_a_full_pool_is_refused_by_name_before_anything_changes():
    rng = np.random.default_rng(7)
    cache = mha.PagedKVCache(5, 4, 1, 8, dtype=np.float64)
    cache.add("a")
    cache.add("b")
    q, k, v = rng.standard_normal((3, 2, 1, 6, 8))
    mha.scaled_dot_product_attention(q, k, v, cache=cache)  # 2 blocks each: 1 left
    cache.fork("a", "c")  # shares a's blocks, the last one half full
    before = (cache.block_table(), cache.lengths.copy(), cache.num_free_blocks,
              cache.key_cache.copy(), cache.value_cache.copy())  # fmt: skip
    q, k, v = rng.standard_normal((3, 3, 1, 3, 8))  # 3 new blocks and 2 copies: 5 > 1
    with pytest.raises(mha.PoolExhaustedError, match="1 free blocks but this append needs 5"):
        mha.scaled_dot_product_attention(q, k, v, cache=cache)
    after = (cache.block_table(), cache.lengths, cache.num_free_blocks, cache.key_cache,
             cache.value_cache)  # fmt: skip
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_forked_sequence_copies_a_shared_block_only_when_it_writes_into_it():
    rng = np.random.default_rng(8)
    cache = mha.PagedKVCache(16, 4, 1, 8, dtype=np.float64)
    cache.add("prompt")
    k, v = rng.standard_normal((2, 1, 10, 8))
    cache.append("prompt", k, v)  # blocks 0, 1 full, 2 half full
    for child in "xyz":
        cache.fork("prompt", child)
    assert cache.num_free_blocks == 13  # shared, not copied
    table = cache.block_table()
    assert (table == table[0]).all()
    parent_before = cache.key_cache[table[0, 2]].copy()
    k1, v1 = rng.standard_normal((2, 1, 1, 8))
    cache.append("x", k1, v1)  # into the shared half-full block: x gets its own copy
    assert cache.num_free_blocks == 12
    tx = cache.block_table(["x"])[0]
    assert list(tx[:2]) == list(table[0, :2]) and tx[2] != table[0, 2]
    np.testing.assert_array_equal(cache.key_cache[table[0, 2]], parent_before)  # untouched
    np.testing.assert_array_equal(cache.key_cache[tx[2], 2, 0], k1[0, 0])
    np.testing.assert_array_equal(cache.key_cache[tx[2], :2], parent_before[:2])
    for seq in list(cache.sequences):
        cache.release(seq)
    assert cache.num_free_blocks == 16


@pytest.mark.parametrize(
    ("call", "error", "said"),
    [
        (lambda c: c.add("a"), mha.AttentionValueError, "already in the cache"),
        (lambda c: c.add(["unhashable"]), mha.AttentionTypeError, "must be hashable"),
        (lambda c: c.release("nobody"), mha.AttentionValueError, "no sequence 'nobody'"),
        (lambda c: c.fork("nobody", "d"), mha.AttentionValueError, "no sequence 'nobody'"),
        (lambda c: c.truncate("a", 9), mha.AttentionValueError, "holds 0 tokens"),
        (lambda c: c.truncate("a", 1.5), mha.AttentionTypeError, "must be an integer"),
        (lambda c: c.append("a", np.ones((1, 2, 8)), np.ones((1, 3, 8))), mha.ShapeError, "k and v must be"),  # noqa: E501
    ],
)  # fmt: skip
def test_the_paged_cache_refuses_by_name(call, error, said):
    cache = mha.PagedKVCache(4, 4, 1, 8)
    cache.add("a")
    with pytest.raises(error, match=said):
        call(cache)
    assert cache.sequences == ("a",) and cache.num_free_blocks == 4


def test_a_call_whose_batch_is_not_the_caches_sequences_is_refused():
    cache = mha.PagedKVCache(4, 4, 1, 8, dtype=np.float64)
    cache.add("a")
    x = np.ones((2, 1, 1, 8))
    with pytest.raises(mha.ShapeError, match=r"do not fit the cache \(1 sequences"):
        mha.scaled_dot_product_attention(x, x, x, cache=cache)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("B", "L"), [(8, 1), (3, 4)])
def test_cascade_attention_equals_the_unshared_computation(record_error, monkeypatch, causal,
                                                           B, L):  # fmt: skip
    """The shared prefix's blocks are read by one sequence's table for every sequence's
    queries (the tables the kernel gets are counted), and the result is the attention over
    each whole sequence."""
    from mha._kernel import paged

    rng = np.random.default_rng(9)
    size, H, H_kv, d = 4, 4, 2, 8
    pool_k, pool_v = random_pool(rng, 64, size, H_kv, d)
    prefix = rng.permutation(64)[:5]  # 20 positions every sequence holds
    own_lens = rng.integers(L, 11, B)
    own = shuffled_tables(rng, B, own_lens, size, 64)
    own[own >= 0] = np.array([b for b in range(64) if b not in prefix])[: (own >= 0).sum()]
    whole = np.concatenate([np.tile(prefix, (B, 1)), own], axis=1)
    q = rng.standard_normal((B, L, H, d))
    tables = []  # the block tables each call hands the kernel
    made = paged.PagedKV.__init__

    def spy(self, pool, table, S):
        tables.append(np.asarray(table))
        made(self, pool, table, S)

    monkeypatch.setattr(paged.PagedKV, "__init__", spy)
    out, lse = mha.cascade_attention(q, pool_k, pool_v, prefix, 20, own, own_lens,
                                     causal=causal, return_lse=True)  # fmt: skip
    cascade_tables, tables[:] = list(tables), []
    expected, expected_lse = mha.paged_attention(q, pool_k, pool_v, whole, own_lens + 20,
                                                 causal=causal, return_lse=True)  # fmt: skip

    def rows_reading_the_prefix(found):
        return sum(int(np.isin(row, prefix).any()) for table in found[::2] for row in table)

    assert rows_reading_the_prefix(cascade_tables) == 1  # the prefix once, for every query
    assert rows_reading_the_prefix(tables) == B  # unshared: once per sequence
    error = record_error("cascade vs unshared attention, float64",
                         float(np.abs(out - expected).max()))  # fmt: skip
    assert error <= 1e-12
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(expected, dense(q, pool_k, pool_v, whole, own_lens + 20,
                                               causal=causal), rtol=1e-12, atol=1e-13)  # fmt: skip


@pytest.mark.parametrize("kind", ["KVCache", "PagedKVCache"])
def test_left_padded_prompts_decode_as_each_prompt_alone(kind, record_error):
    """A batch of prompts padded on the left (as transformers' tokenizers do for
    generation), through a rotary layer with a cache: every real row, and every decoding
    step after, equals the prompt computed alone; the padding rows are left out."""
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=2, rope_theta=10000.0, seed=1)
    rng = np.random.default_rng(10)
    prompts = [rng.standard_normal((n, 32)) for n in (6, 2, 4)]
    steps = rng.standard_normal((3, 3, 32))
    X = np.zeros((3, 6, 32))
    for b, p in enumerate(prompts):
        X[b, 6 - len(p) :] = p  # left padding
    if kind == "KVCache":
        cache = layer.new_cache(batch_size=3)
    else:
        cache = mha.PagedKVCache(16, 4, 2, 8, dtype=np.float64)
        for b in range(3):
            cache.add(b)
    lengths = [len(p) for p in prompts]
    out = [layer(X, cache=cache, query_lengths=lengths, padding_side="left")]
    out += [layer(steps[:, t : t + 1], cache=cache) for t in range(3)]
    assert cache.lengths.tolist() == [n + 3 for n in lengths]
    for b, p in enumerate(prompts):
        alone = layer(np.concatenate([p, steps[b]])[None], mask=True)[0]
        got = np.concatenate([out[0][b, 6 - len(p) :], *(o[b] for o in out[1:])])
        error = record_error(f"left-padded prompts, {kind}", float(np.abs(got - alone).max()))
        assert error <= 1e-13
    q, k, v = rng.standard_normal((3, 3, 4, 6, 8))
    with pytest.raises(mha.AttentionValueError, match="padding_side='left' says which rows"):
        mha.scaled_dot_product_attention(q, k, v, query_lengths=lengths, padding_side="left")
    with pytest.raises(mha.AttentionValueError, match="padding_side must be 'left' or 'right'"):
        layer(X, cache=cache, padding_side="top")


def test_left_padding_in_the_attention_core_keeps_the_rows_where_they_are():
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((3, 2, 4, 5, 8))
    lengths = [5, 2]
    left = mha.KVCache(2, 4, 8)
    right = mha.KVCache(2, 4, 8)
    moved = [np.stack([np.roll(x[b], -(5 - n), axis=-2) for b, n in enumerate(lengths)])
             for x in (q, k, v)]  # fmt: skip
    out, lse = mha.scaled_dot_product_attention(q, k, v, cache=left, query_lengths=lengths,
                                                padding_side="left", return_lse=True)  # fmt: skip
    expected, expected_lse = mha.scaled_dot_product_attention(
        *moved, cache=right, query_lengths=lengths, return_lse=True
    )
    np.testing.assert_array_equal(out[1, :, 3:], expected[1, :, :2])
    np.testing.assert_array_equal(lse[1, :, 3:], expected_lse[1, :, :2])
    assert not out[1, :, :3].any() and np.isneginf(lse[1, :, :3]).all()
    np.testing.assert_array_equal(left.k[:, :, :5], right.k[:, :, :5])


# Quantized pools ------------------------------------------------------------------------


def real_looking(rng, shape, outliers=(3, 17), scale=20.0):
    """Keys as trained models have them: a few channels far larger than the rest."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., list(outliers)] *= scale
    return x


@pytest.mark.parametrize(("bits", "group"), [(8, 32), (8, 64), (4, 32), (4, 64)])
def test_quantization_round_trips_within_its_stated_bound(bits, group):
    from mha._kernel.quantized import Quantization

    kind = Quantization(bits=bits, group=group)
    rng = np.random.default_rng(bits + group)
    for x in (rng.standard_normal((50, 3, 128)).astype(np.float32) * 3,
              real_looking(rng, (50, 3, 128)), np.full((2, 1, 128), 7.25, np.float32),
              rng.uniform(-60000, 60000, (5, 1, 128)).astype(np.float32)):  # fmt: skip
        codes, scale, zero = kind.quantize(x)
        assert codes.dtype == np.uint8 and codes.shape[-1] == (128 if bits == 8 else 64)
        back = kind.dequantize(codes, scale, zero)
        error = np.abs(back - x).reshape(*x.shape[:-1], -1, group).max(axis=-1)
        assert (error <= kind.error_bound(x)).all()
        # and the bound is about half a step: the formula is not loose
        step = np.ptp(x.reshape(*x.shape[:-1], -1, group), axis=-1) / kind.levels
        assert (kind.error_bound(x) <= 0.51 * step + 1e-3 * np.abs(x).max()).all()


@pytest.mark.parametrize("quantize", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("data", ["random", "real-looking"])
def test_a_quantized_cache_attends_to_what_its_codes_stand_for(record_error, monkeypatch,
                                                               quantize, data):  # fmt: skip
    """Every step's output is the attention over the keys and values read back from the
    codes: the same bits as a float32 cache holding those values (both on the NumPy walk
    here; ``tests/test_stored_walk.py`` checks the compiled one), and a dense float64
    computation over them; the distance
    from a float32 cache of the original values is recorded."""
    monkeypatch.setattr(compiled, "walk_available", lambda: False)
    rng = np.random.default_rng(12)
    H, H_kv, d = 8, 2, 64
    quantized = mha.PagedKVCache(64, 16, H_kv, d, quantize=quantize)
    mirror = mha.PagedKVCache(64, 16, H_kv, d)  # the values the codes stand for
    exact = mha.PagedKVCache(64, 16, H_kv, d)  # the original values
    for cache in (quantized, mirror, exact):
        cache.add("a")
        cache.add("b")
    make = real_looking if data == "real-looking" else (
        lambda r, shape: r.standard_normal(shape).astype(np.float32))  # fmt: skip
    for L in (30, 1, 1, 5):
        q = rng.standard_normal((2, H, L, d)).astype(np.float32)
        k, v = make(rng, (2, H_kv, L, d)), rng.standard_normal((2, H_kv, L, d)).astype(np.float32)
        out = mha.scaled_dot_product_attention(q, k, v, cache=quantized)
        stood_for = [np.stack([quantized.dequantized(s)[i][:, -L:] for s in "ab"]) for i in (0, 1)]
        np.testing.assert_array_equal(
            out, mha.scaled_dot_product_attention(q, *stood_for, cache=mirror)
        )
        for b, seq in enumerate(quantized.sequences):
            keys, values = quantized.dequantized(seq)
            dense = mha.scaled_dot_product_attention(
                q[b : b + 1].astype(np.float64), keys[None].astype(np.float64),
                values[None].astype(np.float64), causal=True,
            )[0]  # fmt: skip
            error = np.abs(out[b] - dense).max() / np.abs(dense).max()
            assert record_error(f"{quantize} cache vs its codes' values, float64", error) <= 1e-5
        reference = mha.scaled_dot_product_attention(q, k, v, cache=exact)
        drift = float(np.abs(out - reference).max() / np.abs(reference).max())
        record_error(f"{quantize} cache vs float32 cache, {data} data", drift)
        assert drift <= {"int8": 0.05, "int4": 1.0, "fp8": 0.2}[quantize]  # measured: the docs


def test_quantized_memory_per_token():
    """head_dim 128, groups of 32: int8 0.28 and int4 0.16 of float32's bytes."""
    full = mha.PagedKVCache(64, 16, 8, 128)
    int8 = mha.PagedKVCache(64, 16, 8, 128, quantize="int8")
    int4 = mha.PagedKVCache(64, 16, 8, 128, quantize="int4")
    assert full.bytes_per_token == 8 * 2 * 128 * 4
    assert int8.bytes_per_token == 8 * 2 * (
        128 + 4 * 4
    )  # codes, a float16 scale and zero per group
    assert int4.bytes_per_token == 8 * 2 * (64 + 4 * 4)
    for cache in (full, int8, int4):
        assert cache.nbytes == 64 * 16 * cache.bytes_per_token
    assert int8.nbytes / full.nbytes <= 0.3 and int4.nbytes / full.nbytes <= 0.17


def test_a_quantized_fork_copies_codes_scales_and_zeros_on_write():
    rng = np.random.default_rng(13)
    cache = mha.PagedKVCache(8, 4, 1, 32, quantize="int4")
    cache.add("p")
    k, v = rng.standard_normal((2, 1, 6, 32)).astype(np.float32)
    cache.append("p", k, v)
    cache.fork("p", "c")
    before = cache.dequantized("p")
    k1, v1 = 5 * rng.standard_normal((2, 1, 1, 32)).astype(np.float32)
    cache.append("c", k1, v1)
    for a, b in zip(cache.dequantized("p"), before, strict=True):
        np.testing.assert_array_equal(a, b)  # the parent's shared block untouched
    child_k, _ = cache.dequantized("c")
    np.testing.assert_array_equal(child_k[:, :6], before[0])
    assert np.abs(child_k[:, 6] - k1[:, 0]).max() <= 5 * 2 * 4 * 5 / 15  # about a step


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: mha.PagedKVCache(4, 4, 1, 32, quantize="int2"), "quantize must be None"),
        (lambda: mha.PagedKVCache(4, 4, 1, 32, quantize="int4", group_size=16), "32 or 64"),
        (lambda: mha.PagedKVCache(4, 4, 1, 48, quantize="int8"), "must divide head_dim=48"),
        (lambda: mha.PagedKVCache(4, 4, 1, 32, quantize="int8", dtype=np.float64), "float32"),
        (lambda: mha.PagedKVCache(4, 4, 1, 32, group_size=64), "no quantize= was given"),
    ],
)
def test_quantized_options_are_refused_by_name(make, said):
    with pytest.raises(mha.AttentionValueError, match=said):
        make()


def test_a_quantized_cache_refuses_values_it_cannot_hold_before_anything_changes():
    cache = mha.PagedKVCache(4, 4, 1, 32, quantize="int8")
    cache.add(0)
    for bad in (np.inf, np.nan, 1e6):
        k = np.ones((1, 3, 32), np.float32)
        k[0, 1, 2] = bad
        with pytest.raises(mha.AttentionValueError, match="within float16's range"):
            cache.append(0, k, np.ones_like(k))
        assert cache.length(0) == 0 and cache.num_free_blocks == 4


def test_a_failed_call_leaves_every_sequence_as_it_was_after_a_truncate_of_a_shared_block():
    """ "a" and "b" share a half-filled block; "b" is truncated into it. A call appending to
    both that fails after the append gives back the blocks as they were: "a"'s rows too."""
    cache = mha.PagedKVCache(8, 4, 1, 2, dtype=np.float64)
    cache.add("a")
    cache.append("a", *np.random.default_rng(14).standard_normal((2, 1, 10, 2)))
    cache.fork("a", "b")
    cache.truncate("b", 9)
    before = [cache.dequantized(s) for s in "ab"]
    free = cache.num_free_blocks

    def fails(b, h, q_idx, kv_idx):
        raise RuntimeError("a mask_mod that fails")

    x = np.ones((2, 1, 1, 2))
    with pytest.raises(RuntimeError, match="fails"):
        mha.scaled_dot_product_attention(x, x, x, cache=cache, mask_mod=fails)
    for seq, (k, v) in zip("ab", before, strict=True):
        np.testing.assert_array_equal(cache.dequantized(seq)[0], k)
        np.testing.assert_array_equal(cache.dequantized(seq)[1], v)
    assert cache.num_free_blocks == free and cache.lengths.tolist() == [10, 9]


@pytest.mark.parametrize("quantize", [None, "int8", "kivi8"])
def test_a_failed_call_does_not_write_into_a_block_it_gave_back(quantize):
    """ "a" and "b" share a half-filled block, so each copies it before writing; the last
    copy frees it, and "c" needs a fresh block in the same call. The freed block must not be
    the one "c" writes into: the call then fails, and "a" and "b" get that block back."""
    cache = mha.PagedKVCache(4, 4, 1, 8, quantize=quantize, group_size=quantize and 4)
    cache.add("a")
    x = np.random.default_rng(15).standard_normal((1, 3, 8)).astype(np.float32)
    cache.append("a", x, x)
    cache.fork("a", "b")
    cache.add("c")
    before = [cache.dequantized(s) for s in "abc"]
    table, free = cache.block_table().tolist(), cache.num_free_blocks

    def fails(b, h, q_idx, kv_idx):
        raise RuntimeError("a mask_mod that fails")

    q = np.full((3, 1, 1, 8), 99, np.float32)
    with pytest.raises(RuntimeError, match="fails"):
        mha.scaled_dot_product_attention(q, q, q, cache=cache, mask_mod=fails)
    for seq, (k, v) in zip("abc", before, strict=True):
        np.testing.assert_array_equal(cache.dequantized(seq)[0], k)
        np.testing.assert_array_equal(cache.dequantized(seq)[1], v)
    assert cache.block_table().tolist() == table and cache.num_free_blocks == free


def test_the_same_bits_as_a_contiguous_cache_on_long_float32_sequences():
    """A decoding step over 4,000 keys of width 128 in float32: the paged cache's tiles are
    the contiguous cache's, so the bits are the same."""
    rng = np.random.default_rng(15)
    paged = mha.PagedKVCache(260, 16, 2, 128)
    paged.add(0)
    contiguous = mha.KVCache(1, 2, 128, capacity=4001, dtype=np.float32)
    k, v = rng.standard_normal((2, 1, 2, 4000, 128), dtype=np.float32)
    q = rng.standard_normal((1, 8, 4000, 128), dtype=np.float32)
    for cache in (paged, contiguous):  # the prompt, then one step
        mha.scaled_dot_product_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], cache=cache)
    paged.append(0, k[0, :, 8:], v[0, :, 8:])
    mha.scaled_dot_product_attention(  # the same rows, appended by attending
        q[:, :, 8:3999], k[:, :, 8:3999], v[:, :, 8:3999], cache=contiguous
    )
    paged.truncate(0, 3999)
    step = [mha.scaled_dot_product_attention(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], cache=c)
            for c in (paged, contiguous)]  # fmt: skip
    np.testing.assert_array_equal(step[0], step[1])


def test_left_padding_refuses_a_mask_or_bias_in_the_padded_layout():
    cache = mha.KVCache(1, 1, 8)
    x = np.ones((1, 1, 2, 8))
    for keywords in ({"bias": np.zeros((1, 1, 2, 2))}, {"mask": np.ones((2, 2), bool)}):
        with pytest.raises(mha.AttentionValueError, match="cannot be combined with a mask="):
            mha.scaled_dot_product_attention(x, x, x, cache=cache, query_lengths=[1],
                                             padding_side="left", **keywords)  # fmt: skip
    assert cache.lengths.tolist() == [0]


def test_causal_cascade_attention_refuses_queries_inside_the_prefix():
    pool = np.zeros((4, 4, 1, 8))
    with pytest.raises(mha.AttentionValueError, match="seq_lens >= L"):
        mha.cascade_attention(np.zeros((1, 2, 1, 8)), pool, pool, [0, 1], 8, [[2]], [1],
                              causal=True)  # fmt: skip


@pytest.mark.parametrize("quantize", ["int8", "int4", "kivi8", "kivi4", "fp8"])
def test_paged_attention_refuses_a_quantized_caches_codes_as_keys(quantize):
    """A quantized cache's pools hold its codes: read as keys they were 350x off, silently."""
    cache = mha.PagedKVCache(4, 32, 1, 32, quantize=quantize)
    cache.add(0)
    x = np.random.default_rng(0).standard_normal((1, 1, 5, 32)).astype(np.float32)
    mha.scaled_dot_product_attention(x, x, x, cache=cache)
    q = x.transpose(0, 2, 1, 3)[:, -1:]
    with pytest.raises(mha.AttentionTypeError, match=r"key_cache holds integers \(uint8"):
        mha.paged_attention(q, cache.key_cache, cache.value_cache, cache.block_table(), [5])
    pool = np.zeros((4, 32, 1, 32), np.float32)
    with pytest.raises(mha.AttentionTypeError, match=r"value_cache holds integers.*cache="):
        mha.paged_attention(q, pool, cache.value_cache, cache.block_table(), [5])


@pytest.mark.parametrize(
    ("prefix_blocks", "prefix_len", "error", "said"),
    [
        ([0], 9, mha.AttentionValueError, r"prefix_len=9 but prefix_blocks holds 1 blocks"),
        ([0, 7], 5, mha.AttentionValueError, r"prefix_blocks\[1\] = 7 is not a block"),
        ([0], -1, mha.AttentionValueError, "prefix_len must be a non-negative integer; got -1"),
        ([0], 2.0, mha.AttentionTypeError, "prefix_len must be a non-negative integer; got 2.0"),
        ([[0]], 2, mha.ShapeError, "prefix_blocks must be one row of block ids"),
        ([0.5], 2, mha.AttentionTypeError, "prefix_blocks must hold integers"),
    ],
)
def test_cascade_attention_names_its_prefixs_mistakes(prefix_blocks, prefix_len, error, said):
    """The prefix's mistakes were reported as block_table's and seq_lens' (or not at all)."""
    rng = np.random.default_rng(0)
    pool_k, pool_v = rng.standard_normal((2, 4, 4, 1, 8))
    q = rng.standard_normal((2, 1, 1, 8))
    with pytest.raises(error, match=said):
        mha.cascade_attention(q, pool_k, pool_v, prefix_blocks, prefix_len, [[1], [2]], [1, 1])


@pytest.mark.parametrize("shape", [(2, 0, 1, 8), (0, 1, 1, 8), (0, 0, 2, 8)])
def test_cascade_attention_takes_zero_queries_and_zero_sequences(shape):
    """A reshape of an empty result raised NumPy's error here (found by fuzzing)."""
    rng = np.random.default_rng(0)
    pool_k, pool_v = rng.standard_normal((2, 4, 4, 1, 8))
    q = np.zeros(shape)
    own = np.ones((shape[0], 1), np.int64)
    lens = [shape[1]] * shape[0]
    out, lse = mha.cascade_attention(q, pool_k, pool_v, [0], 3, own, lens, return_lse=True)
    assert out.shape == shape and lse.shape == (shape[0], shape[2], shape[1])
    np.testing.assert_array_equal(out, mha.paged_attention(q, pool_k, pool_v, own, lens))
