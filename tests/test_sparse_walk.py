"""The sparse top-k attention's walk over the chosen keys alone (:mod:`mha.api.sparse_walk`)
against the dense walk over every key with the others masked, the reference it replaces for
speed: the same output whole sequences and decoding, with tiles of one query or of many,
gathered or (most keys chosen) masked; a failed call leaves the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import relative_error

import mha
from mha.api import sparse_walk
from mha.api.sparse import IndexerSpec

SIZES = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}


def layer(topk):
    return mha.LatentAttention(
        32, 4, q_lora_rank=12, indexer=IndexerSpec(topk, 2, 6), seed=1, **SIZES
    )


def masked(monkeypatch):
    """The dense walk: every call of the module walked over all keys, masked."""
    monkeypatch.setattr("mha.api.latent_math.walks_chosen", lambda attention, dtype: False)


@pytest.mark.parametrize("topk", [3, 7, 30])
@pytest.mark.parametrize("tile_bytes", [1, 5000, 1 << 25])
def test_whole_sequences_equal_the_masked_walk(topk, tile_bytes, monkeypatch):
    """Tiles of one query (1 byte), of a few (5000 bytes: the queries' keys partly shared,
    masked among them) and of all of them; 30 of 40 keys: most keys, walked masked."""
    attention = layer(topk)
    x = np.random.default_rng(topk).standard_normal((2, 40, 32))
    padding = np.tri(40, dtype=bool)[None, None].repeat(2, 0)
    padding[1, ..., :3] = False  # the second sequence's first keys hidden
    monkeypatch.setattr(sparse_walk, "GATHERED_BYTES", tile_bytes)
    gathered = [attention(x, padding), attention(x[0], mask=True)]
    with monkeypatch.context() as patch:
        masked(patch)
        expected = [attention(x, padding), attention(x[0], mask=True)]
    for got, want in zip(gathered, expected, strict=True):
        assert relative_error(got, want) <= 1e-14
    assert relative_error(attention(x, mask=True, return_backward=True)[0][0], gathered[1]) <= 1e-14


def test_decoding_equals_the_masked_walk(monkeypatch):
    """Prefill then one token at a time past ``topk``, the sequences at different lengths."""
    attention = layer(5)
    x = np.random.default_rng(7).standard_normal((2, 30, 32))

    def run():
        cache = attention.new_cache(2, capacity=8)
        outs = [attention(x[:, :12], cache=cache)]
        cache.truncate([12, 9])  # the second sequence three tokens behind
        for step in range(12, 30):
            outs.append(attention(x[:, step : step + 1], cache=cache))
        return outs, cache.lengths.tolist(), cache.index_keys.copy()

    gathered = run()
    masked(monkeypatch)
    expected = run()
    assert gathered[1] == expected[1] == [30, 27]
    assert np.array_equal(gathered[2], expected[2])
    for got, want in zip(gathered[0], expected[0], strict=True):
        assert relative_error(got, want) <= 1e-14


def test_a_failed_call_leaves_the_cache_as_it_was(monkeypatch):
    attention = layer(3)
    x = np.random.default_rng(8).standard_normal((1, 6, 32))
    cache = attention.new_cache(1)
    attention(x[:, :4], cache=cache)
    before = (cache.lengths.copy(), cache.k[:, :, :4].copy(), cache.index_keys.copy())

    def fails(*args, **kwargs):
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(sparse_walk, "scaled_dot_product_attention", fails)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        attention(x[:, 4:], cache=cache)
    assert np.array_equal(cache.lengths, before[0])
    assert np.array_equal(cache.k[:, :, :4], before[1])  # past the length: free slots
    assert np.array_equal(cache.index_keys, before[2])


def test_calls_it_does_not_take_are_walked_masked():
    attention = layer(3)
    float32 = attention.new_cache(1, dtype=np.float32)
    assert sparse_walk.walks_chosen({"mask": None, "cache": None}, np.dtype(np.float64))
    assert not sparse_walk.walks_chosen({"cache": float32}, np.dtype(np.float64))
    assert not sparse_walk.walks_chosen({"cache": None, "window": 4}, np.dtype(np.float64))
    assert sparse_walk.walks_chosen({"cache": None, "window": None}, np.dtype(np.float64))
    assert not sparse_walk.walks_chosen({"cache": mha.KVCache(1, 1, 4)}, np.dtype(np.float64))


@pytest.mark.parametrize("tile_bytes", [1, 1 << 22])
def test_the_indexer_scores_in_tiles_equal_its_formula(tile_bytes, monkeypatch):
    """``s_ij = sum_h w_ih relu(q_ih . k_j / sqrt(d))`` by a plain loop, against the tiles of
    64 queries by 64 keys (1 byte) and one tile."""
    from mha.api import sparse

    attention = layer(4)
    plan, spec = attention._plan(), attention.indexer
    rng = np.random.default_rng(9)
    x, q_low = rng.standard_normal((2, 70, 32)), rng.standard_normal((2, 70, 12))
    keys = rng.standard_normal((2, 1, 150, spec.head_dim))
    W = attention.weights()
    at = np.arange(80, 150)
    monkeypatch.setattr(sparse, "INDEX_TILE_BYTES", tile_bytes)
    got = sparse.index_scores(plan, spec, q_low, x, W, at, keys)
    n, d = spec.num_heads, spec.head_dim
    q = sparse._rotated(
        plan, spec, np.moveaxis((q_low @ W["W_index_q"]).reshape(2, 70, n, d), 2, 1), at
    )
    w = x @ W["W_index_weights"] * n**-0.5
    expected = np.zeros((2, 70, 150))
    for b in range(2):
        for i in range(70):
            for j in range(150):
                for h in range(n):
                    dot = float(q[b, h, i] @ keys[b, 0, j]) / np.sqrt(d)
                    expected[b, i, j] += w[b, i, h] * max(dot, 0.0)
    assert relative_error(got, expected) <= 1e-14


def test_the_walk_takes_each_of_its_ways(monkeypatch):
    """The cases above reach tiles of several queries (masked among the keys they
    gathered), tiles walked over all keys, and queries walked alone, gathered, several in
    one call of the kernel (their keys' counts as its key lengths where they differ)."""
    ways = set()
    attend, alone = sparse_walk._attend_tile, sparse_walk.scaled_dot_product_attention

    def spy(q, keys, picked, used, *rest):
        gathered = 2 * used.size <= keys.shape[-2]
        ways.add((q.shape[1] > 1, gathered, bool(picked[:, used].all())))
        return attend(q, keys, picked, used, *rest)

    def spy_alone(q, k, v, **keywords):
        if keywords.get("mask") is None:  # the queries walked alone
            ways.add(("alone", q.shape[0] > 1, keywords["key_lengths"] is not None))
        return alone(q, k, v, **keywords)

    monkeypatch.setattr(sparse_walk, "_attend_tile", spy)
    monkeypatch.setattr(sparse_walk, "scaled_dot_product_attention", spy_alone)
    monkeypatch.setattr(sparse_walk, "GATHERED_BYTES", 5000)
    x = np.random.default_rng(7).standard_normal((1, 40, 32))
    layer(7)(x, mask=True)
    layer(30)(x, mask=True)
    expected = {(True, True, False), (False, False, True), ("alone", True, True),
                ("alone", True, False)}  # fmt: skip
    assert expected <= ways, ways


def test_sinks_are_walked_with_the_chosen_keys(monkeypatch):
    """HY-V4's sinks (one logit a head, no position) beside the gathered keys."""
    attention = mha.LatentAttention(
        32, 4, q_lora_rank=12, indexer=IndexerSpec(5, 2, 6), sinks=True, seed=2, **SIZES
    )
    attention.sinks[...] = np.random.default_rng(3).standard_normal(4)
    x = np.random.default_rng(4).standard_normal((2, 30, 32))
    gathered = attention(x, mask=True)
    masked(monkeypatch)
    assert relative_error(gathered, attention(x, mask=True)) <= 1e-14
