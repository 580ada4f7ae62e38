"""KIVI in ``mha.PagedKVCache``: keys quantized per channel over groups of tokens, values
per token, the last unfilled group of keys in float32 until it fills.

Oracles: ``Quantization.error_bound`` (the stated bound) for the round trip; a model of
what each sequence stands for, written here from the design (whole groups quantized as they
fill, a truncate keeping the values, a group reopened by the next append), which the cache
must equal bit for bit through forks, truncates and releases; a dense float64 computation
over those values for every step's output; and per-token int8/int4 caches on the same data
for KIVI's point, keys with a few channels of large magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.interleavings import History, interleave

import mha
from mha._kernel import compiled
from mha._kernel.quantized import Quantization


def outlier_keys(rng, shape, channels=(3, 17, 40), offsets=(20.0, -15.0, 12.0), spread=1.0):
    """Keys as trained models have them (KIVI's observation): a few channels of large
    magnitude in every token; ``spread`` scales those channels' variation too."""
    x = rng.standard_normal(shape).astype(np.float32)
    large = [c % shape[-1] for c in channels]  # distinct for the widths used here
    x[..., large] *= np.float32(spread)
    x[..., large] += np.array(offsets, np.float32)
    return x


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def attention64(q, k, v):
    """``q (H, L, d)``'s attention over ``k, v (H_kv, n, d)``, bottom-right causal, float64."""
    return mha.scaled_dot_product_attention(
        q[None].astype(np.float64), k[None].astype(np.float64), v[None].astype(np.float64),
        causal=True,
    )[0]  # fmt: skip


class StoodFor(History):
    """What one sequence of a KIVI cache stands for, from the design alone: the keys of each
    whole group of ``T`` tokens quantized per channel when it fills, the rest as given; the
    values quantized per token; a truncate keeps what is left, and an append into a group
    cut short reads it back and quantizes it again when it fills."""

    def __init__(self, bits, T, H_kv, d):
        super().__init__(H_kv, d, np.float32)
        self.keys_kind = Quantization(bits=bits, group=T, per_channel=True)
        self.values_kind = Quantization(bits=bits, group=T)
        self.sealed = 0  # positions in quantized groups

    def append(self, k, v):
        T, n = self.keys_kind.group, self.keys.shape[1]
        if self.sealed > n:  # a group cut short by a truncate: open again
            self.sealed = n // T * T
        super().append(k, self.values_kind.dequantize(*self.values_kind.quantize(v)))
        while self.keys.shape[1] - self.sealed >= T:
            group = slice(self.sealed, self.sealed + T)
            self.keys[:, group] = self.keys_kind.dequantize(
                *self.keys_kind.quantize(self.keys[:, group])
            )
            self.sealed += T


# The round trip ------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "group"), [(8, 8), (8, 32), (4, 32), (4, 64)])
def test_per_channel_quantization_round_trips_within_its_stated_bound(bits, group):
    kind = Quantization(bits=bits, group=group, per_channel=True)
    rng = np.random.default_rng(bits + group)
    for x in (normal(rng, (3, 2 * group, 128)) * 3, outlier_keys(rng, (3, 2 * group, 128)),
              np.full((1, group, 128), 7.25, np.float32),
              rng.uniform(-60000, 60000, (1, group, 128)).astype(np.float32)):  # fmt: skip
        codes, scale, zero = kind.quantize(x)
        assert codes.shape == (*x.shape[:2], 128 if bits == 8 else 64)
        assert scale.shape == zero.shape == (x.shape[0], x.shape[1] // group, 128)
        back = kind.dequantize(codes, scale, zero)
        error = np.abs(back - x).reshape(x.shape[0], -1, group, 128).max(axis=2)
        assert (error <= kind.error_bound(x)).all()  # per group of tokens and channel
        step = np.ptp(x.reshape(x.shape[0], -1, group, 128), axis=2) / kind.levels
        assert (kind.error_bound(x) <= 0.51 * step + 1e-3 * np.abs(x).max()).all()


@pytest.mark.parametrize(("quantize", "T"), [("kivi8", 8), ("kivi4", 32)])
def test_a_kivi_cache_holds_keys_per_channel_values_per_token_and_the_last_group_exactly(
    quantize, T
):
    """Keys of whole groups within the per-channel bound of their group, the unfilled
    group's as given (bit for bit), values within the per-token bound of each token."""
    H_kv, d = 2, 64
    cache = mha.PagedKVCache(8, 64, H_kv, d, quantize=quantize, group_size=T)
    cache.add(0)
    rng = np.random.default_rng(20)
    k, v = outlier_keys(rng, (H_kv, 2 * T + 5, d)), normal(rng, (H_kv, 2 * T + 5, d))
    for a, b in [(0, 3), (3, T + 1), (T + 1, 2 * T + 5)]:  # across groups and a block
        cache.append(0, k[:, a:b], v[:, a:b])
    keys, values = cache.dequantized(0)
    per_channel = Quantization(int(quantize[-1]), T, per_channel=True)
    sealed = 2 * T
    error = np.abs(keys[:, :sealed] - k[:, :sealed]).reshape(H_kv, 2, T, d).max(axis=2)
    assert (error <= per_channel.error_bound(k[:, :sealed])).all()
    np.testing.assert_array_equal(keys[:, sealed:], k[:, sealed:])  # the residual: exact
    per_token = Quantization(int(quantize[-1]), T)
    error = np.abs(values - v).reshape(H_kv, -1, d // T, T).max(axis=-1)
    assert (error <= per_token.error_bound(v)).all()


def test_key_tiles_read_anywhere_are_the_sequence_as_it_stands():
    """The kernel's key tiles, any range of positions (across groups, blocks apart, the
    residual) and any heads, are the slices of the whole sequence read back."""
    rng = np.random.default_rng(21)
    cache = mha.PagedKVCache(32, 16, 3, 16, quantize="kivi8", group_size=4)
    for seq in "xaby":
        cache.add(seq)
    for length, seq in zip((9, 23, 14, 5), "xaby", strict=True):
        cache.append(seq, normal(rng, (3, length, 16)), normal(rng, (3, length, 16)))
    cache.release("x")
    cache.append("a", normal(rng, (3, 30, 16)), normal(rng, (3, 30, 16)))  # into x's blocks
    keys, _ = cache._attended(53)
    for b, seq in enumerate(cache.sequences):
        whole, n = cache.dequantized(seq)[0], cache.length(seq)
        ranges = [(0, n), (1, n), (3, 7), (5, 6), (n - 1, n), (2, n - 3), (9, 17)]
        for c0, c1 in [(c0, c1) for c0, c1 in ranges if 0 <= c0 < c1 <= n]:
            for heads in (slice(0, 3), slice(1, 2), slice(2, 3)):
                got = keys[b][heads][:, c0:c1]
                assert got.flags.c_contiguous and got.dtype == np.float32
                np.testing.assert_array_equal(got, whole[heads, c0:c1])


# Attention through the cache ----------------------------------------------------------


@pytest.mark.parametrize(("quantize", "T"), [("kivi8", 8), ("kivi4", 32)])
def test_every_decoding_step_attends_to_what_the_cache_stands_for(record_error, quantize, T):
    """Prefill then one token a step across several group boundaries (and a few tokens
    at once): each step's output is the float64 attention over the values the cache stands
    for (its codes, and the unfilled group as given), which the model of the design gives
    bit for bit."""
    rng = np.random.default_rng(22)
    H, H_kv, d = 8, 2, 64
    cache = mha.PagedKVCache(16, 32, H_kv, d, quantize=quantize, group_size=T)
    stood = [StoodFor(int(quantize[-1]), T, H_kv, d) for _ in range(2)]
    for seq in "ab":
        cache.add(seq)
    for L in [13, *[1] * 10, 5, *[1] * 8] if T == 8 else [29, 1, 1, 1, 1, 40, 1, 1]:
        q = normal(rng, (2, H, L, d))
        k, v = outlier_keys(rng, (2, H_kv, L, d)), normal(rng, (2, H_kv, L, d))
        out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
        for b, seq in enumerate(cache.sequences):
            stood[b].append(k[b], v[b])
            keys, values = cache.dequantized(seq)
            np.testing.assert_array_equal(keys, stood[b].keys)
            np.testing.assert_array_equal(values, stood[b].values)
            expected = attention64(q[b], keys, values)
            error = float(np.abs(out[b] - expected).max() / np.abs(expected).max())
            assert record_error(f"{quantize} cache vs its values, float64", error) <= 1e-5


def spread_keys(rng, shape):
    """A few channels 20 times as spread as the rest, around 0 (no large magnitude)."""
    return outlier_keys(rng, shape, offsets=(0.0, 0.0, 0.0), spread=20.0)


@pytest.mark.parametrize(
    ("make", "margin", "keys"),
    [(normal, 1 / 1.2, "random keys"), (outlier_keys, 3, "large key channels"),
     (spread_keys, 1.5, "spread key channels")],
    ids=["random", "large channels", "spread channels"],
)  # fmt: skip
@pytest.mark.parametrize("bits", [8, 4])
def test_per_channel_keys_beat_per_token_ones_on_large_channels(record_error, bits, make,
                                                                margin, keys):  # fmt: skip
    """KIVI's point: keys whose few large channels set the step of every per-token group
    they lie in get steps of their own per channel. The output's distance from a float32
    cache, worst over the steps, on the same data (the same bits, groups of 32, blocks of
    32), measured: random keys int8 7.9e-3, kivi8 7.8e-3, int4 0.13, kivi4 0.11; channels
    of large magnitude 4.1e-2, 7.3e-3 (5.5 times smaller), 1.15, 0.12 (9.8 times); channels
    only 20 times as spread 5.6e-2, 2.2e-2 (2.5 times), 0.72, 0.42 (1.7 times)."""
    H, H_kv, d = 8, 2, 64
    drift = {}
    for quantize in (f"int{bits}", f"kivi{bits}"):
        rng = np.random.default_rng(23)
        quantized, exact = (mha.PagedKVCache(16, 32, H_kv, d, quantize=kind)
                            for kind in (quantize, None))  # fmt: skip
        for cache in (quantized, exact):
            cache.add("a")
            cache.add("b")
        worst = 0.0
        for L in (100, 1, 1, 5, 30, 1):
            q = normal(rng, (2, H, L, d))
            k, v = make(rng, (2, H_kv, L, d)), normal(rng, (2, H_kv, L, d))
            out = mha.scaled_dot_product_attention(q, k, v, cache=quantized)
            reference = mha.scaled_dot_product_attention(q, k, v, cache=exact)
            worst = max(worst, float(np.abs(out - reference).max() / np.abs(reference).max()))
        family = f"{quantize} cache vs float32 cache, {keys}"
        drift[quantize] = record_error(family, worst)
    assert drift[f"kivi{bits}"] * margin <= drift[f"int{bits}"]
    assert drift[f"kivi{bits}"] <= {8: 0.03, 4: 0.5}[bits]


# Sequences coming and going -----------------------------------------------------------


def kivi_cache(num_blocks=8, block_size=8, group_size=4, d=8, quantize="kivi8"):
    return mha.PagedKVCache(num_blocks, block_size, 1, d, quantize=quantize,
                            group_size=group_size)  # fmt: skip


def snapshot(cache):
    """Everything a refused call must leave as it was."""
    return ([cache.dequantized(s) for s in cache.sequences], cache.block_table(),
            cache.lengths.copy(), cache.num_free_blocks, cache.nbytes)  # fmt: skip


def assert_same(before, after):
    (seqs, *rest), (seqs_after, *rest_after) = before, after
    for (k, v), (k2, v2) in zip(seqs, seqs_after, strict=True):
        np.testing.assert_array_equal(k, k2)
        np.testing.assert_array_equal(v, v2)
    for x, y in zip(rest, rest_after, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_fork_shares_the_residual_and_copies_it_on_write():
    rng = np.random.default_rng(24)
    cache = kivi_cache()
    empty = cache.nbytes
    cache.add("p")
    k, v = normal(rng, (2, 1, 10, 8))
    cache.append("p", k, v)  # block 0 quantized, block 1 two rows of the residual
    assert cache.nbytes == empty + 4 * 8 * 4  # one group of float32 keys
    cache.fork("p", "c")
    assert cache.num_free_blocks == 6 and cache.nbytes == empty + 4 * 8 * 4  # shared
    before = cache.dequantized("p")
    k1, v1, k2, v2, k3, v3 = 5 * normal(rng, (6, 1, 1, 8))
    cache.append("c", k1, v1)  # into the shared block: its own copy, with the residual
    assert cache.num_free_blocks == 5 and cache.nbytes == empty + 2 * 4 * 8 * 4
    table = cache.block_table()
    assert table[0, 0] == table[1, 0] and table[0, 1] != table[1, 1]
    for a, b in zip(cache.dequantized("p"), before, strict=True):
        np.testing.assert_array_equal(a, b)  # the parent's block and residual untouched
    cache.append("p", k2, v2)  # the parent's block is its own now: written in place
    assert cache.num_free_blocks == 5
    np.testing.assert_array_equal(
        cache.dequantized("c")[0][:, 8:], np.concatenate([k[:, 8:], k1], 1)
    )
    np.testing.assert_array_equal(
        cache.dequantized("p")[0][:, 8:], np.concatenate([k[:, 8:], k2], 1)
    )
    cache.append("c", k3, v3)  # the child's group fills: quantized, the parent's not
    child = cache.dequantized("c")[0]
    np.testing.assert_array_equal(child[:, :8], before[0][:, :8])
    assert not np.array_equal(child[:, 8:10], k[:, 8:])
    np.testing.assert_array_equal(
        cache.dequantized("p")[0][:, 8:], np.concatenate([k[:, 8:], k2], 1)
    )
    for seq in ("p", "c"):
        cache.release(seq)
    assert cache.num_free_blocks == 8 and cache.nbytes == empty


def test_a_truncate_into_a_quantized_group_reopens_it_in_a_copy_of_the_block():
    """A truncate changes nothing but the length; the next append reads the group's kept
    rows back (the values their codes stand for) in a copy of the block, and quantizes them
    again with the new rows when the group fills: within the two roundings' bounds."""
    rng = np.random.default_rng(25)
    cache = kivi_cache()
    cache.add(0)
    k, v = normal(rng, (2, 1, 12, 8))
    cache.append(0, k, v)
    codes = cache.dequantized(0)[0]
    cache.truncate(0, 6)  # inside block 0's second group
    np.testing.assert_array_equal(cache.dequantized(0)[0], codes[:, :6])
    block = cache.block_table()[0, 0]
    k1, v1 = normal(rng, (2, 1, 1, 8))
    cache.append(0, k1, v1)  # reopened: rows 4, 5 back as they stand, row 6 as given
    assert cache.block_table()[0, 0] != block and cache.num_free_blocks == 7
    now = cache.dequantized(0)[0]
    np.testing.assert_array_equal(now[:, :6], codes[:, :6])
    np.testing.assert_array_equal(now[:, 6], k1[:, 0])
    k2, v2 = normal(rng, (2, 1, 1, 8))
    cache.append(0, k2, v2)  # the group fills: quantized again
    group = np.concatenate([codes[:, 4:6], k1, k2], axis=1)  # what was quantized again
    given = np.concatenate([k[:, 4:6], k1, k2], axis=1)
    per_channel = Quantization(8, 4, per_channel=True)
    once, twice = per_channel.error_bound(group), per_channel.error_bound(k[:, 4:8])
    error = np.abs(cache.dequantized(0)[0][:, 4:8] - given)
    assert (error[:, 2:] <= once).all() and (error[:, :2] <= once + twice).all()
    cache.truncate(0, 4)  # at a group's first row: reopened in place, no copy
    block = cache.block_table()[0, 0]
    cache.append(0, k1, v1)
    assert cache.block_table()[0, 0] == block and cache.num_free_blocks == 7


def test_a_full_pool_refuses_the_copy_a_reopened_group_needs_before_anything_changes():
    rng = np.random.default_rng(26)
    cache = kivi_cache(num_blocks=2)
    cache.add("a")
    cache.add("b")
    cache.append("a", *normal(rng, (2, 1, 8, 8)))  # block 0 quantized
    cache.append("b", *normal(rng, (2, 1, 3, 8)))  # block 1, a residual of 3 rows
    cache.truncate("a", 6)
    before = snapshot(cache)
    with pytest.raises(mha.PoolExhaustedError, match="0 free blocks but this append needs 1"):
        cache.append("a", *normal(rng, (2, 1, 1, 8)))
    q, k, v = normal(rng, (3, 2, 1, 1, 8))
    with pytest.raises(mha.PoolExhaustedError):
        mha.scaled_dot_product_attention(q, k, v, cache=cache)
    assert_same(before, snapshot(cache))
    for seq in "ab":
        cache.release(seq)
    assert cache.num_free_blocks == 2


def test_a_kivi_cache_refuses_values_it_cannot_hold_before_anything_changes():
    cache = kivi_cache()
    cache.add(0)
    cache.append(0, np.ones((1, 6, 8), np.float32), np.ones((1, 6, 8), np.float32))
    before = snapshot(cache)
    for bad in (np.inf, np.nan, 1e6):
        for keys in (True, False):
            x = np.ones((1, 3, 8), np.float32)
            x[0, 1, 2] = bad
            new = (x, np.ones_like(x)) if keys else (np.ones_like(x), x)
            with pytest.raises(mha.AttentionValueError, match="within float16's range"):
                cache.append(0, *new)
            assert_same(before, snapshot(cache))


def test_a_failed_call_gives_back_the_residual_and_the_groups_as_they_were():
    """One sequence's append fills a group, another's reopens a truncated one; the call
    then fails (a mask_mod): every sequence reads as before, and the next call is right."""
    rng = np.random.default_rng(27)
    cache = kivi_cache()
    stood = {s: StoodFor(8, 4, 1, 8) for s in "ab"}
    for seq, n in (("a", 6), ("b", 8)):
        cache.add(seq)
        k, v = normal(rng, (2, 1, n, 8))
        cache.append(seq, k, v)
        stood[seq].append(k, v)
    cache.truncate("b", 6)
    stood["b"].truncate(6)
    before = snapshot(cache)

    def fails(b, h, q_idx, kv_idx):
        raise RuntimeError("a mask_mod that fails")

    q, k, v = normal(rng, (3, 2, 1, 2, 8))
    with pytest.raises(RuntimeError, match="fails"):
        mha.scaled_dot_product_attention(q, k, v, cache=cache, mask_mod=fails)
    assert_same(before, snapshot(cache))
    out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
    for b, seq in enumerate("ab"):
        stood[seq].append(k[b], v[b])
        np.testing.assert_array_equal(cache.dequantized(seq)[0], stood[seq].keys)
        expected = attention64(q[b], stood[seq].keys, stood[seq].values)
        assert np.abs(out[b] - expected).max() <= 1e-5 * np.abs(expected).max()


def test_a_failed_call_after_a_truncate_into_a_sealed_group_keeps_its_rows():
    """One sequence, truncated into its block's sealed group: the next append copies the
    block (the group is reopened) and takes another as it crosses the block's end. The
    block given back must not be the one taken, for the call fails and keeps the first."""
    rng = np.random.default_rng(28)
    cache = mha.PagedKVCache(4, 4, 1, 2, quantize="kivi8", group_size=2)
    cache.add("a")
    x = rng.standard_normal((1, 4, 2)).astype(np.float32)
    cache.append("a", x, x)
    cache.truncate("a", 3)
    before, table = cache.dequantized("a"), cache.block_table().tolist()

    def fails(score, b, h, q_idx, kv_idx):
        raise RuntimeError("a score_mod that fails")

    q = rng.standard_normal((1, 1, 3, 2)).astype(np.float32)
    with pytest.raises(RuntimeError, match="fails"):
        mha.scaled_dot_product_attention(q, q, q, cache=cache, score_mod=fails)
    for now, then in zip(cache.dequantized("a"), before, strict=True):
        np.testing.assert_array_equal(now, then)
    assert cache.block_table().tolist() == table and cache.num_free_blocks == 3


KINDS = {"kivi8": (4, [4, 8, 16], 8, 6), "kivi4": (32, [32, 64], 32, 40)}
"""group_size, block sizes, head width, most new tokens in a call"""


@pytest.mark.parametrize("quantize", sorted(KINDS))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_random_interleavings_stand_for_what_the_design_says(record_error, quantize, data):
    """Sequences added, appended to, forked, truncated and released in any order: each
    sequence reads back bit for bit as the model of the design says, each step's output is
    the float64 attention over that, and the pool gets every block (and residual) back."""
    T, sizes, d, most = KINDS[quantize]
    size = data.draw(st.sampled_from(sizes), label="block_size")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    H, H_kv = 4, 2
    cache = mha.PagedKVCache(64, size, H_kv, d, quantize=quantize, group_size=T)
    empty = cache.nbytes

    def attend(stood):  # every sequence appends L tokens and attends: one call
        L = data.draw(st.integers(1, most), label="new tokens")
        B = len(stood)
        q = normal(rng, (B, H, L, d))
        k, v = outlier_keys(rng, (B, H_kv, L, d)), normal(rng, (B, H_kv, L, d))
        out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
        for b, seq in enumerate(cache.sequences):
            stood[seq].append(k[b], v[b])
            expected = attention64(q[b], stood[seq].keys, stood[seq].values)
            error = float(np.abs(out[b] - expected).max() / np.abs(expected).max())
            assert record_error(f"{quantize} cache vs the design, float64", error) <= 1e-5

    def check(stood):  # bit for bit, and only the residuals held besides the pools
        for seq in cache.sequences:
            keys, values = cache.dequantized(seq)
            np.testing.assert_array_equal(keys, stood[seq].keys)
            np.testing.assert_array_equal(values, stood[seq].values)
        assert cache.nbytes <= empty + len(cache.sequences) * T * H_kv * d * 4

    interleave(data, cache, lambda: StoodFor(int(quantize[-1]), T, H_kv, d), attend, check)
    assert cache.nbytes == empty


# Options and memory -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: mha.PagedKVCache(4, 16, 1, 32, quantize="kivi2"), "'kivi8', 'kivi4' or 'fp8'"),
        (lambda: mha.PagedKVCache(4, 16, 1, 32, quantize="kivi8"), r"block_size=16 must be a multiple of group_size"),  # noqa: E501
        (lambda: mha.PagedKVCache(4, 48, 1, 32, quantize="kivi8", group_size=32), "block_size=48"),
        (lambda: mha.PagedKVCache(4, 32, 1, 32, quantize="kivi4", group_size=16), "'kivi4' takes group_size 32 or 64"),  # noqa: E501
        (lambda: mha.PagedKVCache(4, 32, 1, 48, quantize="kivi8"), "must divide head_dim=48"),
        (lambda: mha.PagedKVCache(4, 32, 1, 32, quantize="kivi8", dtype=np.float64), "float32"),
    ],
)  # fmt: skip
def test_kivi_options_are_refused_by_name(make, said):
    with pytest.raises(mha.AttentionValueError, match=said):
        make()


def test_kivi_memory_per_token_and_its_residual():
    """head_dim 128, 8 key/value heads, groups of 32: the same bytes a token as int8 and
    int4 (each channel's float16 scale and zero point over 32 tokens), and a float32 group
    of keys (32 x 8 x 128 x 4 bytes) for each sequence whose last group has not filled."""
    full = mha.PagedKVCache(64, 32, 8, 128)
    for quantize, per_token in (("kivi8", 128 + 4 * 4), ("kivi4", 64 + 4 * 4)):
        cache = mha.PagedKVCache(64, 32, 8, 128, quantize=quantize)
        assert cache.bytes_per_token == 8 * 2 * per_token
        empty = cache.nbytes
        assert empty == 64 * 32 * cache.bytes_per_token
        assert empty / full.nbytes <= {"kivi8": 0.29, "kivi4": 0.16}[quantize]
        assert repr(cache).count(f"quantize='{quantize}', group_size=32") == 1
        cache.add(0)
        x = np.ones((8, 40, 128), np.float32)
        cache.append(0, x, x)
        assert cache.nbytes == empty + 32 * 8 * 128 * 4
        cache.append(0, x[:, :24], x[:, :24])  # 64 tokens: two whole groups, no residual
        assert cache.nbytes == empty
        cache.append(0, x[:, :1], x[:, :1])
        cache.release(0)
        assert cache.nbytes == empty and cache.num_free_blocks == 64


def test_the_compiled_walk_is_never_given_kivi_pools(monkeypatch):
    """The compiled walk reads pools as they lie (float rows); a KIVI cache's codes and
    residual go to the NumPy walk, which reads them back tile by tile. The same call on a
    float32 paged cache does take the compiled walk where numba is (the spy sees calls)."""
    ran = []
    real = compiled.forward_walk
    monkeypatch.setattr(compiled, "forward_walk", lambda *a: ran.append(1) or real(*a))
    x = np.ones((1, 1, 5, 8), np.float32)
    for quantize in ("kivi8", None):
        cache = mha.PagedKVCache(8, 8, 1, 8, quantize=quantize, group_size=quantize and 4)
        cache.add(0)
        mha.scaled_dot_product_attention(x, x, x, cache=cache)
        assert bool(ran) == (quantize is None and compiled.walk_available())
