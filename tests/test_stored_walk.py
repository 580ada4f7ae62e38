"""Caches stored narrower than float32 (bfloat16, float16, and the quantized kinds) read by
the compiled tile walk in place, each tile's codes read back as it goes.

Oracles: NumPy's own reading of the cache (``Quantization.dequantize``, ``astype``), which
the compiled read-back must equal bit for bit; and a dense float64 softmax written here over
the values the cache stands for (``cache.dequantized``), for each decoding step and each
prompt, which every kind must meet within float32's rounding. A spy on the compiled walk
shows which calls it took.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from support.extras import needs_numba

import mha
from mha._kernel import compiled, walk


@pytest.fixture
def walks():
    """The compiled walk, or a skip where numba is absent (a failure under
    MHA_REQUIRE_NUMBA=1, as CI's tiers with the ``fast`` extra set it)."""
    needs_numba(compiled.walk_available(), "the NumPy walk runs alone")


KINDS = [
    ("int8", np.float32, 32), ("int4", np.float32, 32), ("int8", np.float32, 64),
    ("int4", np.float32, 64), ("kivi8", np.float32, 16), ("kivi4", np.float32, 32),
    ("fp8", np.float32, 32), (None, "bfloat16", None), (None, np.float16, None),
]  # fmt: skip


def storage(dtype):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def paged(kind, dtype, group, H_kv, d, blocks=64):
    size = 32 if kind and kind.startswith("kivi") else 16
    return mha.PagedKVCache(
        blocks, size, H_kv, d, quantize=kind, group_size=group, dtype=storage(dtype)
    )


def pool_of(x, d):
    """The compiled walk's pool of a cache's keys or values ``x`` (``_attended``'s)."""
    return walk.stored_pool(x.pool, x.table, x.block_size, d, *x.stored_parts())


@functools.cache
def _value_sums():  # type: ignore[no-untyped-def]
    """``stored_sums`` over head 0 of sequence 0 of a pool, by ``s``'s rows: compiled once
    for the tests that check its finite flag."""
    from numba import njit

    from mha._kernel._numba_stored import flat, stored_sums

    @njit
    def accumulate(pool, c0, c1, s, acc, partial):
        return stored_sums(flat(pool), 0, 0, c0, c1, s, acc, 0, s.shape[0], partial)

    return accumulate


def dense64(q, k, v, lengths, counts):
    """Each sequence's ``counts[b]`` last queries ``q (B, H, L, d)`` (its first rows) over
    its ``lengths[b]`` keys, the query at position ``lengths[b] - counts[b] + i`` seeing the
    keys up to it: float64 softmax written out, grouped-query heads."""
    B, H, L, d = q.shape
    group = H // k[0].shape[0]
    out = np.zeros((B, H, L, v[0].shape[-1]))
    for b in range(B):
        n, m = int(lengths[b]), int(counts[b])
        for h in range(H):
            keys, values = k[b][h // group].astype(np.float64), v[b][h // group].astype(np.float64)
            for i in range(m):
                seen = n - m + i + 1
                s = keys[:seen] @ q[b, h, i].astype(np.float64) / np.sqrt(d)
                w = np.exp(s - s.max())
                out[b, h, i] = w @ values[:seen] / w.sum()
    return out


def spy(monkeypatch):
    calls = []
    walked = compiled.stored_forward_walk

    def counted(*args):
        calls.append(args[0])
        return walked(*args)

    monkeypatch.setattr(compiled, "stored_forward_walk", counted)
    return calls


# The read-back, value by value -----------------------------------------------------------


@pytest.mark.parametrize(("kind", "dtype", "group"), KINDS)
def test_the_walk_reads_back_the_bits_numpy_reads(walks, kind, dtype, group):
    """Rows read back by the compiled walk's ``stage`` (any range: within a block, across
    blocks apart, KIVI's unfilled group) equal NumPy's tile of the same rows bit for bit,
    NaNs included; the finite flag says whether they all are."""
    from numba import njit

    from mha._kernel._numba_pool import address
    from mha._kernel._numba_stored import flat, stage

    @njit
    def read(pool, b, g, c0, c1, out, check):
        return stage(flat(pool), b, g, c0, c1, address(out, 0), out.shape[1], c1, check)

    rng = np.random.default_rng(7)
    H_kv, d = 3, 64
    cache = paged(kind, dtype, group, H_kv, d)
    for seq, n in zip("abc", (70, 45, 101), strict=True):
        cache.add(seq)
        k = rng.standard_normal((H_kv, n, d)).astype(np.float32) * 3
        k[:, :, 5] += 40.0  # a channel of large magnitude
        if kind == "fp8":
            k[:, :4] *= 1e-3  # float8's subnormals, relative to the group's scale
        cache.append(seq, k, rng.standard_normal((H_kv, n, d)).astype(np.float32))
    cache.release("b")
    cache.add("d")  # into b's blocks: a table of blocks apart
    cache.append("d", *(rng.standard_normal((H_kv, 60, d)).astype(np.float32) for _ in "kv"))
    keys, values = cache._attended(int(cache.lengths.max()))
    for x in (keys, values):
        pool = pool_of(x, d)
        for b, n in enumerate(cache.lengths):
            for c0, c1 in [(0, int(n)), (3, 37), (15, 17), (int(n) - 5, int(n))]:
                for g in range(H_kv):
                    out = np.full((c1 - c0, d), np.nan, np.float32)
                    finite = read(pool, b, g, c0, c1, out, True)
                    expected = x[b][g : g + 1][:, c0:c1][0]
                    np.testing.assert_array_equal(out, expected)
                    assert finite == bool(np.isfinite(expected).all())


@pytest.mark.parametrize("dtype", ["bfloat16", np.float16])
def test_non_finite_stored_values_are_flagged(walks, dtype):
    from numba import njit

    from mha._kernel._numba_pool import address
    from mha._kernel._numba_stored import flat, stage

    @njit
    def read(pool, c1, out, check):
        return stage(flat(pool), 0, 0, 0, c1, address(out, 0), out.shape[1], c1, check)

    cache = paged(None, dtype, None, 1, 16)
    cache.add(0)
    v = np.ones((1, 40, 16), np.float32)
    v[0, 33, 7] = np.inf
    cache.append(0, v, v)
    _, values = cache._attended(40)
    pool = walk.stored_pool(values.pool, values.table, values.block_size, 16)
    out = np.empty((40, 16), np.float32)
    assert not read(pool, 40, out, True)
    assert read(pool, 33, out, True)
    assert read(pool, 40, out, False)  # unchecked (keys): always True


@pytest.mark.parametrize("rows", [4, 1, 3])
@pytest.mark.parametrize(("kind", "dtype"), [("int8", np.float32), ("int4", np.float32),
                                             ("fp8", np.float32), (None, "bfloat16"),
                                             (None, np.float16)])  # fmt: skip
def test_values_multiplied_in_place_flag_a_value_not_finite(walks, kind, dtype, rows):
    """The values' products read back in registers (a decoding step's four rows, one or
    three: bfloat16's sums two rows and one) say whether every value they read is finite:
    an infinity stored (bfloat16, float16), or a group's scale of infinity (int8, int4,
    float8: written into the pool, which refuses to quantize one), among the positions read
    or not. The keys' and values' products in place are taken for the forms read per token
    and rows of whole pairs of vectors, whatever the step's rows."""
    from numba import njit

    from mha._kernel._numba_stored import flat, in_place

    accumulate = _value_sums()

    @njit
    def taken(pool):
        return in_place(flat(pool), False)

    d = 64
    cache = paged(kind, dtype, 32 if kind else None, 1, d)
    cache.add(0)
    v = np.random.default_rng(3).standard_normal((1, 40, d)).astype(np.float32)
    if kind is None:
        v[0, 33, 7] = np.inf
    cache.append(0, v, v)
    if kind is not None:  # (a quantized cache refuses to hold one: its pool's bits written)
        scales = cache._values.arrays[1]
        scales[cache.block_table()[0, 33 // 16], 33 % 16, 0, 0] = np.inf
    _, values = cache._attended(40)
    pool = pool_of(values, d)
    s = np.full((rows, 40), 0.5, np.float32)
    s[:, 33 - 20] = 0.0  # (a weight of 0: a hidden key, where the flag matters)
    acc, partial = np.zeros((rows, d), np.float32), np.zeros((rows, d), np.float32)
    assert not accumulate(pool, 0, 40, s, acc, partial)
    assert not accumulate(pool, 20, 36, s, acc, partial)
    partial[:] = 0.0
    assert accumulate(pool, 0, 32, s, acc, partial)
    if kind is None:  # values finite but their sums too large for float32: finite
        big = paged(kind, dtype, None, 1, d)
        big.add(0)
        huge = np.full((1, 40, d), 3e38 if dtype == "bfloat16" else 6e4, np.float32)
        big.append(0, huge, huge)
        _, held = big._attended(40)
        pool = walk.stored_pool(held.pool, held.table, held.block_size, d)
        s[:] = 1.0
        partial[:] = 0.0
        assert accumulate(pool, 0, 40, s, acc, partial)
    assert taken(pool)


@pytest.mark.parametrize(("kind", "group", "d"), [
    ("int8", 16, 64), ("int8", 32, 96), ("int8", 64, 64), ("int8", 48, 96),
    ("int4", 32, 64), ("fp8", 16, 96),
])  # fmt: skip
@pytest.mark.parametrize("part", ["scales", "zeros"])
def test_a_scale_or_zero_point_not_finite_is_flagged_in_any_group(walks, kind, group, d, part):
    """Whichever group of a row holds it, a scale of infinity or a zero point of NaN among
    the values read makes the value sums say a value was not finite (a chunk's groups read
    back at once: one, two or four of them, or one at a time in groups of 48), and a range
    that skips its row does not; float8's zero points are not read (its values are
    ``code * scale``)."""
    accumulate = _value_sums()
    v = np.random.default_rng(4).standard_normal((1, 40, d)).astype(np.float32)
    for j in range(d // group):
        cache = paged(kind, np.float32, group, 1, d)
        cache.add(0)
        cache.append(0, v, v)
        array = cache._values.arrays[1 if part == "scales" else 2]
        array[cache.block_table()[0, 33 // 16], 33 % 16, 0, j] = (
            np.inf if part == "scales" else np.nan
        )
        _, values = cache._attended(40)
        pool = pool_of(values, d)
        s = np.full((4, 40), 0.5, np.float32)
        acc, partial = np.zeros((4, d), np.float32), np.zeros((4, d), np.float32)
        read = accumulate(pool, 20, 40, s, acc, partial)
        assert read == (kind == "fp8" and part == "zeros"), (j, read)
        partial[:] = 0.0
        assert accumulate(pool, 0, 33, s, acc, partial), j


def test_kivi_keys_are_multiplied_in_place_as_scores_only(walks):
    """KIVI's keys, a scale per channel, are read in place by the scores' products (their
    group of tokens or the unfilled one in float32 alike); a pool per channel is never
    summed as values (KIVI's values are per token)."""
    from numba import njit

    from mha._kernel._numba_stored import flat, in_place

    @njit
    def taken(pool, keys):
        return in_place(flat(pool), keys)

    cache = paged("kivi8", np.float32, 32, 1, 64)
    cache.add(0)
    x = np.ones((1, 40, 64), np.float32)
    cache.append(0, x, x)
    keys, values = cache._attended(40)
    pools = [pool_of(x, 64) for x in (keys, values)]
    assert taken(pools[0], True) and not taken(pools[0], False)
    assert taken(pools[1], False) and taken(pools[1], True)


WIDTHS = [(*kind, d) for kind in KINDS for d in (64, 96, 128)
          if kind[2] is None or 96 % kind[2] == 0 or d != 96]  # fmt: skip
WIDTHS += [("int8", np.float32, 16, 80), ("int8", np.float32, 16, 48),
           ("fp8", np.float32, 16, 80), ("kivi8", np.float32, 16, 80),
           (None, "bfloat16", None, 80), (None, np.float16, None, 48),
           ("int8", np.float32, 48, 144), ("fp8", np.float32, 80, 80),
           ("int8", np.float32, 96, 192), ("int8", np.float32, 128, 256),
           ("int8", np.float32, 32, 256), ("fp8", np.float32, 16, 128),
           ("int8", np.float32, 48, 96)]  # fmt: skip
"""(Rows of 80, 48 and 144 values: an odd number of AVX-512's vectors, the sums' last one
alone; groups of 48 and 80: vectors read alone within a group, under its scale, in chunks of
four and two vectors; of 96: two vectors under a scale, the next two under the same; rows of
2, 3 and 8 groups, the value sums' scales of a chunk's groups read back at once: one, two
or four.)"""


@functools.cache
def _products():  # type: ignore[no-untyped-def]
    """The products in place, those of the rows read back first, and whether a pair of
    pools is multiplied in place: compiled once for every case of the test below (each
    case's own closures took 8 s to compile)."""
    from numba import njit

    from mha._kernel._numba_pool import address, few_accumulate, few_scores
    from mha._kernel._numba_stored import flat, in_place, stage, stored_scores, stored_sums

    @njit
    def in_place_products(keys, values, b, g, c0, c1, q, rows, s, acc, partial):
        stored_scores(flat(keys), b, g, c0, c1, q, 0, rows, s)
        partial[:] = 0.0
        return stored_sums(flat(values), b, g, c0, c1, s, acc, 0, rows, partial)

    @njit
    def read_back_products(keys, values, b, g, c0, c1, q, rows, s, acc, partial, rows_k, rows_v):
        d_k, d_v = rows_k.shape[1], rows_v.shape[1]
        stage(flat(keys), b, g, c0, c1, address(rows_k, 0), d_k, c1, False)
        few_scores((address(rows_k, 0), d_k, c1 - c0, 0, 0), q, 0, rows, s, 0, False)
        finite = stage(flat(values), b, g, c0, c1, address(rows_v, 0), d_v, c1, True)
        partial[:] = 0.0
        run = (address(rows_v, 0), d_v, c1 - c0, 0, 0)
        few_accumulate(run, s, 0, c1 - c0, acc, 0, rows, partial)
        return finite

    @njit
    def taken(keys, values):
        return in_place(flat(keys), True) and in_place(flat(values), False)

    return in_place_products, read_back_products, taken


@pytest.mark.parametrize(("kind", "dtype", "group", "d"), WIDTHS)
def test_products_in_place_give_the_bits_of_products_of_the_rows_read_back(
    walks, kind, dtype, group, d
):
    """A decoding step's products on the stored rows in place (``stored_scores``,
    ``stored_sums``: 1 to 4, 7 and 8 rows; rows of 48, 64, 80, 96 and 128 values, whole and
    partial chunks of the sums; ranges within a block, across blocks apart, ending
    mid-block, past the sums' flush every 256 positions; KIVI's unfilled group) equal bit
    for bit the products of the float32 rows read back first (``stage``, then
    ``few_scores`` and ``few_accumulate``)."""
    in_place_products, read_back_products, taken = _products()
    rng = np.random.default_rng(11)
    H_kv = 2
    cache = paged(kind, dtype, group, H_kv, d, blocks=96)
    for seq, n in zip("abc", (70, 45, 601), strict=True):
        cache.add(seq)
        cache.append(seq, *(rng.standard_normal((H_kv, n, d)).astype(np.float32) for _ in "kv"))
    cache.release("b")
    cache.add("d")  # into b's blocks: a table of blocks apart
    cache.append("d", *(rng.standard_normal((H_kv, 60, d)).astype(np.float32) for _ in "kv"))
    pools = [pool_of(x, d) for x in cache._attended(int(cache.lengths.max()))]
    assert taken(*pools)
    for rows in (1, 2, 3, 4, 7, 8):
        q = rng.standard_normal((rows, d)).astype(np.float32)
        for b, n in enumerate(cache.lengths):
            for c0, c1 in [(0, int(n)), (3, 37), (15, 17), (int(n) - 5, int(n)), (1, 300)]:
                c1 = min(c1, int(n))
                for g in range(H_kv):
                    outs = []
                    for product in (in_place_products, read_back_products):
                        # each within a larger array of NaN: a write beyond it fails the test
                        outer = [np.full((rows + 1, w + 16), np.nan, np.float32)
                                 for w in (c1 - c0, d, d)]  # fmt: skip
                        s, acc, partial = (x[:rows, : x.shape[1] - 16] for x in outer)
                        acc[:], partial[:] = 0.0, 0.0
                        buffers = (np.empty((c1 - c0, d), np.float32),) * 2
                        extra = () if product is in_place_products else buffers
                        finite = product(*pools, b, g, c0, c1, q, rows, s, acc, partial, *extra)
                        for x in outer:
                            assert np.isnan(x[rows:]).all() and np.isnan(x[:, -16:]).all()
                        outs.append((s, acc, finite))
                    (s1, acc1, f1), (s2, acc2, f2) = outs
                    np.testing.assert_array_equal(s1.view(np.uint32), s2.view(np.uint32))
                    np.testing.assert_array_equal(acc1.view(np.uint32), acc2.view(np.uint32))
                    assert f1 and f2


def _read_back(pool, c0, c1, d):
    from numba import njit

    from mha._kernel._numba_pool import address
    from mha._kernel._numba_stored import flat, stage

    @njit
    def read(pool, c0, c1, out):
        return stage(flat(pool), 0, 0, c0, c1, address(out, 0), out.shape[1], c1, True)

    out = np.full((c1 - c0, d), np.nan, np.float32)
    return out, read(pool, c0, c1, out)


def test_float16_special_values_read_back_as_numpy_reads(walks):
    """float16 rows holding subnormals, the largest number, signed zeros, infinities and a
    NaN, and int8 codes whose float16 scales are subnormal: read back into NumPy's float32
    bits (the same bits however numba converts float16: F16C's instruction, or integer
    operations on a CPU without it, the test below)."""
    special = np.array(
        [6e-8, -6e-8, 3.1e-5, 6.1e-5, 65504, -65504, 0.0, -0.0, np.inf, -np.inf, np.nan, 1.0,
         -2.5, 1e-3, 0.333, 7.0],
        np.float16,
    )  # fmt: skip
    rows = np.tile(special, (1, 20, 1)).astype(np.float32)  # (1, 20, 16)
    cache = paged(None, np.float16, None, 1, 16)
    cache.add(0)
    cache.append(0, rows, rows)
    _, values = cache._attended(20)
    pool = walk.stored_pool(values.pool, values.table, values.block_size, 16)
    out, finite = _read_back(pool, 0, 20, 16)
    expected = values[0][0:1][:, 0:20][0].astype(np.float32)  # NumPy's float16 -> float32
    assert not finite
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    same = ~np.isnan(expected)
    np.testing.assert_array_equal(out.view(np.uint32)[same], expected.view(np.uint32)[same])

    tiny = paged("int8", np.float32, 16, 1, 32)
    tiny.add(0)
    small = np.random.default_rng(3).standard_normal((1, 20, 32)).astype(np.float32) * 3e-4
    small[0, 3, :16] = -0.0  # a group of negative zeros: its step 0 and its zero point -0.0
    tiny.append(0, small, small)
    _, values = tiny._attended(20)
    used = values.table[0][values.table[0] >= 0]
    steps = values.parts[1][used].astype(np.float32)[:, :, 0]
    assert ((steps > 0) & (steps < 6.1e-5)).sum() >= 30  # subnormal float16 steps
    pool = walk.stored_pool(
        values.pool, values.table, values.block_size, 32, *values.stored_parts()
    )
    out, finite = _read_back(pool, 0, 20, 32)
    assert finite
    expected = values[0][0:1][:, 0:20][0]
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_the_read_back_compiled_for_a_cpu_without_f16c_or_avx512_gives_the_same_bits(
    walks, tmp_path
):
    """numba compiling for a generic x86-64 CPU (``NUMBA_CPU_NAME=generic``, no
    ``NUMBA_CPU_FEATURES``: no F16C, no AVX-512; its own cache directory): float16 decoded
    in integer operations, the value sums' narrow vectors and the scores' blocks of two keys
    chosen; the read-back tests above, and the products in place, pass there too."""
    script = (
        "import sys; sys.path.insert(0, 'tests'); import numpy as np\n"
        "import test_stored_walk as t\n"
        "from mha._kernel import _numba_vectors as v\n"
        "assert not v.F16C and v.WIDE_BITS == 256 and v.BLOCK_KEYS == 2\n"
        "for kind, dtype, group in [('int8', np.float32, 32), (None, np.float16, None),\n"
        "                           ('kivi4', np.float32, 32), ('fp8', np.float32, 32)]:\n"
        "    t.test_the_walk_reads_back_the_bits_numpy_reads(None, kind, dtype, group)\n"
        "t.test_float16_special_values_read_back_as_numpy_reads(None)\n"
        "for kind, dtype in t.MIRRORED:\n"
        "    for H in (8, 6):\n"
        "        t.test_a_stored_cache_gives_the_bits_of_a_float32_cache_of_its_values(\n"
        "            None, kind, dtype, H)\n"
        "    for rows in (4, 3):\n"
        "        t.test_values_multiplied_in_place_flag_a_value_not_finite(\n"
        "            None, kind, dtype, rows)\n"
        "print('generic ok')\n"
    )
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CPU_FEATURES", None)  # (which numba would take over the CPU's name)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generic ok" in done.stdout


# Attention through each kind ---------------------------------------------------------------


@pytest.mark.parametrize(("kind", "dtype", "group"), KINDS)
def test_each_stored_cache_takes_the_compiled_walk_and_meets_float64(
    walks, monkeypatch, record_error, kind, dtype, group
):
    """A prompt (24 tokens: the walk's GEMM tiles) then decoding steps (few rows: the
    vector products) with grouped-query heads, for sequences of different lengths: every
    call takes the compiled walk, and each output is the float64 attention over the values
    the cache stands for, within float32's rounding."""
    calls = spy(monkeypatch)
    rng = np.random.default_rng(11)
    H, H_kv, d = 8, 2, 64
    cache = paged(kind, dtype, group, H_kv, d, blocks=128)
    for b, n in enumerate((5, 40, 77)):
        cache.add(b)
        cache.append(b, *(rng.standard_normal((H_kv, n, d)).astype(np.float32) for _ in "kv"))
    name = kind or storage(dtype).name
    label = f"{name} cache, compiled walk vs float64"
    steps_meet_float64(cache, (24, 1, 1, 1, 3, 1), H, calls, rng, record_error, label)


def steps_meet_float64(cache, steps, H, calls, rng, record_error, label):
    """Calls of ``steps`` rows each (random queries, keys and values) over ``cache``: each
    takes the compiled walk (``calls``: :func:`spy`'s), and its output is the float64
    attention over the values the cache stands for, within float32's rounding."""
    B, (H_kv, _, d) = len(cache.sequences), cache.dequantized(cache.sequences[0])[0].shape
    for L in steps:
        before = len(calls)
        q = rng.standard_normal((B, H, L, d)).astype(np.float32)
        k, v = (rng.standard_normal((B, H_kv, L, d)).astype(np.float32) for _ in "kv")
        out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
        assert len(calls) > before, "the call did not take the compiled walk"
        stood = [cache.dequantized(seq) for seq in cache.sequences]
        counts = np.full(B, L)
        expected = dense64(q, [s[0] for s in stood], [s[1] for s in stood], cache.lengths, counts)
        error = float(np.abs(out - expected).max() / np.abs(expected).max())
        assert record_error(label, error) <= 1e-6


def _interleaved(kind, dtype, group, size, H_kv, d, lengths, rng):
    """A paged cache of blocks of ``size`` whose sequences grew together, a block of each
    in turn: each sequence's blocks lie apart in the pool."""
    blocks = sum(-(-n // size) + 2 for n in lengths)
    cache = mha.PagedKVCache(
        blocks, size, H_kv, d, quantize=kind, group_size=group, dtype=storage(dtype)
    )
    rows = [[rng.standard_normal((H_kv, n, d)).astype(np.float32) for _ in "kv"] for n in lengths]
    for b in range(len(lengths)):
        cache.add(b)
    for start in range(0, max(lengths), size):
        for b, (k, v) in enumerate(rows):
            cache.append(b, k[:, start : start + size], v[:, start : start + size])
    return cache


@pytest.mark.parametrize(("kind", "dtype", "group", "size"), [
    *[(kind, dtype, group, 32 if kind and kind.startswith("kivi") else 16)
      for kind, dtype, group in KINDS],
    ("int8", np.float32, 32, 48), ("int8", np.float32, 32, 256), (None, "bfloat16", None, 48),
])  # fmt: skip
def test_blocks_of_sequences_grown_together_are_read_as_they_lie(
    walks, monkeypatch, record_error, kind, dtype, group, size
):
    """Decoding steps over sequences longer than the 128 positions that the walks ask for
    ahead, in whole blocks, whose blocks lie apart (appended a block of each sequence in
    turn; blocks of 16 to 256) and each ending mid-block: each output is the float64
    attention over the values the cache stands for, within float32's rounding."""
    calls = spy(monkeypatch)
    rng = np.random.default_rng(13)
    H, H_kv, d = 8, 2, 64
    cache = _interleaved(kind, dtype, group, size, H_kv, d, [301, 530, 97], rng)
    table = cache.block_table()
    assert (np.diff(table[1, : -(-530 // size)]) != 1).any()  # blocks apart
    label = f"{kind or storage(dtype).name} cache, blocks apart vs float64"
    steps_meet_float64(cache, (1, 4, 1), H, calls, rng, record_error, label)


@pytest.mark.parametrize("dtype", ["bfloat16", np.float16])
def test_a_contiguous_cache_of_a_storage_dtype_takes_the_compiled_walk(
    walks, monkeypatch, record_error, dtype
):
    calls = spy(monkeypatch)
    rng = np.random.default_rng(12)
    B, H, H_kv, d, n = 2, 8, 2, 64, 300
    cache = mha.KVCache(B, H_kv, d, capacity=400, dtype=storage(dtype))
    x = rng.standard_normal((B, H, n, d)).astype(np.float32)
    kv = rng.standard_normal((B, H_kv, n, d)).astype(np.float32)
    mha.scaled_dot_product_attention(x, kv, kv, cache=cache, causal=True)
    for L in (1, 1, 17):
        before = len(calls)
        q = rng.standard_normal((B, H, L, d)).astype(np.float32)
        k = rng.standard_normal((B, H_kv, L, d)).astype(np.float32)
        out = mha.scaled_dot_product_attention(q, k, k, cache=cache, causal=True)
        assert len(calls) > before
        held = cache.k.astype(np.float32), cache.v.astype(np.float32)
        expected = dense64(q, held[0], held[1], cache.lengths, np.full(B, L))
        error = float(np.abs(out - expected).max() / np.abs(expected).max())
        name = f"contiguous {storage(dtype).name} cache, compiled walk vs float64"
        assert record_error(name, error) <= 1e-6


def test_a_hidden_non_finite_stored_value_sends_its_task_to_the_numpy_walk():
    """A bfloat16 value of +inf at a key some rows of a prompt cannot see: those rows'
    outputs finite and equal to the float64 attention over what they see (0 * inf is not
    spread), the others non-finite, as the NumPy walk gives them."""
    rng = np.random.default_rng(13)
    H, H_kv, d, L = 4, 2, 32, 40
    cache = paged(None, "bfloat16", None, H_kv, d)
    cache.add(0)
    q = rng.standard_normal((1, H, L, d)).astype(np.float32)
    k = rng.standard_normal((1, H_kv, L, d)).astype(np.float32)
    v = rng.standard_normal((1, H_kv, L, d)).astype(np.float32)
    v[0, :, 30] = np.inf  # seen by rows 30 and on
    out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
    keys, values = cache.dequantized(0)
    expected = dense64(q[:, :, :30], [keys], [values], [30], [30])
    assert np.isfinite(out[0, :, :30]).all()
    error = np.abs(out[0, :, :30] - expected[0]).max() / np.abs(expected).max()
    assert error <= 1e-6
    assert not np.isfinite(out[0, :, 30:]).any()


def test_a_hidden_non_finite_value_in_a_step_multiplied_in_place_goes_to_the_numpy_walk():
    """Two query rows a key/value head of four (eight rows: the products in place), a
    bfloat16 value of +inf at the step's last new key, which its first row cannot see: that
    row's output finite and equal to the float64 attention over what it sees, the other's
    not finite."""
    rng = np.random.default_rng(21)
    H, H_kv, d, n = 8, 2, 64, 300
    cache = paged(None, "bfloat16", None, H_kv, d)
    cache.add(0)
    cache.append(0, *(rng.standard_normal((H_kv, n, d)).astype(np.float32) for _ in "kv"))
    q = rng.standard_normal((1, H, 2, d)).astype(np.float32)
    k = rng.standard_normal((1, H_kv, 2, d)).astype(np.float32)
    v = rng.standard_normal((1, H_kv, 2, d)).astype(np.float32)
    v[0, :, 1] = np.inf
    out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
    keys, values = cache.dequantized(0)
    expected = dense64(q[:, :, :1], [keys[:, : n + 1]], [values[:, : n + 1]], [n + 1], [1])
    assert np.isfinite(out[0, :, 0]).all()
    error = np.abs(out[0, :, 0] - expected[0, :, 0]).max() / np.abs(expected).max()
    assert error <= 1e-6
    assert not np.isfinite(out[0, :, 1]).any()


def test_groups_apart_from_the_walks_vectors_take_the_numpy_walk(monkeypatch, record_error):
    """int8 groups of 8 channels (the compiled read-back takes multiples of 16): the NumPy
    walk, the same attention."""
    calls = spy(monkeypatch)
    rng = np.random.default_rng(14)
    cache = paged("int8", np.float32, 8, 2, 64)
    cache.add(0)
    cache.append(0, *(rng.standard_normal((2, 50, 64)).astype(np.float32) for _ in "kv"))
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    out = mha.scaled_dot_product_attention(q, k, k, cache=cache)
    assert not calls
    keys, values = cache.dequantized(0)
    expected = dense64(q, [keys], [values], [51], [1])
    error = float(np.abs(out - expected).max() / np.abs(expected).max())
    assert record_error("int8 groups of 8, NumPy walk vs float64", error) <= 1e-6


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_a_step_quantizes_every_sequence_at_once_as_one_by_one(kind):
    """A decoding step's rows quantized in one call (``write_many``) hold the codes,
    scales and zero points that appending each sequence alone gives, across block edges."""
    rng = np.random.default_rng(15)
    together, alone = (paged(kind, np.float32, 32, 2, 64) for _ in "ab")
    lengths = (15, 16, 31, 3)
    for b, n in enumerate(lengths):
        for cache in (together, alone):
            cache.add(b)
            cache.append(b, *(np.ones((2, n, 64), np.float32) for _ in "kv"))
    k, v = (rng.standard_normal((4, 2, 2, 64)).astype(np.float32) for _ in "kv")
    together._append(k, v, np.full(4, 2))
    together._commit(np.full(4, 2))
    for b in range(4):
        alone.append(b, k[b], v[b])
    for seq in range(4):
        for a, b in zip(together.dequantized(seq), alone.dequantized(seq), strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(together._keys.arrays + together._values.arrays,
                    alone._keys.arrays + alone._values.arrays, strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


MIRRORED = [("int8", np.float32), ("int4", np.float32), ("fp8", np.float32),
            (None, "bfloat16"), (None, np.float16)]  # fmt: skip
"""(Not KIVI: its keys' group filled by a step is quantized after it, as it stood then.)"""


@pytest.mark.parametrize("H", [8, 16, 4, 2, 6])
@pytest.mark.parametrize(("kind", "dtype"), MIRRORED)
def test_a_stored_cache_gives_the_bits_of_a_float32_cache_of_its_values(walks, kind, dtype, H):
    """On the compiled walk as on the NumPy one: every step's output is the same bits as a
    float32 paged cache holding the values the stored one stands for (the same tiles, the
    same products, the stored rows read back first or in registers as they are multiplied:
    a decoding step's 1 to 8 rows by blocks of up to four, in place)."""
    rng = np.random.default_rng(16)
    H_kv, d = 2, 64
    group = 32 if kind else None
    stored, mirror = paged(kind, dtype, group, H_kv, d), paged(None, np.float32, None, H_kv, d)
    for cache in (stored, mirror):
        cache.add("a")
        cache.add("b")
    for L in (30, 1, 1, 5, 1):
        q = rng.standard_normal((2, H, L, d)).astype(np.float32)
        k, v = (rng.standard_normal((2, H_kv, L, d)).astype(np.float32) for _ in "kv")
        out = mha.scaled_dot_product_attention(q, k, v, cache=stored)
        held = [np.stack([stored.dequantized(s)[i][:, -L:] for s in "ab"]) for i in (0, 1)]
        np.testing.assert_array_equal(out, mha.scaled_dot_product_attention(q, *held, cache=mirror))


def test_block_tables_in_any_layout_read_the_same_blocks(walks, monkeypatch):
    """A bfloat16 pool through ``paged_attention`` with the block table C-ordered and
    Fortran-ordered (padded with -1 past each sequence's blocks, as engines pad): the same
    bits, each the float64 attention over the blocks the table names."""
    calls = spy(monkeypatch)
    rng = np.random.default_rng(17)
    blocks, size, H_kv, H, d = 12, 16, 2, 8, 64
    pool_k, pool_v = (
        rng.standard_normal((blocks, size, H_kv, d)).astype(ml_dtypes.bfloat16) for _ in "kv"
    )
    table = np.array([[7, 2, 9, -1], [0, 11, 4, 5], [3, -1, -1, -1]])
    lengths = np.array([40, 61, 9])
    q = rng.standard_normal((3, H, 1, d)).astype(np.float32)
    outs = [  # (paged_attention takes and gives (B, L, H, d), as engines do)
        mha.paged_attention(q.transpose(0, 2, 1, 3), pool_k, pool_v, layout, lengths).transpose(
            0, 2, 1, 3
        )
        for layout in (np.ascontiguousarray(table), np.asfortranarray(table))
    ]
    assert len(calls) == 2
    np.testing.assert_array_equal(outs[0], outs[1])
    for b, n in enumerate(lengths):
        rows = (
            [pool_k[t] for t in table[b, : -(-n // size)]],
            [pool_v[t] for t in table[b, : -(-n // size)]],
        )
        keys, values = (np.concatenate(r)[:n].transpose(1, 0, 2).astype(np.float32) for r in rows)
        expected = dense64(q[b : b + 1], [keys], [values], [n], [1])
        assert np.abs(outs[0][b] - expected[0]).max() <= 1e-6 * np.abs(expected).max()
