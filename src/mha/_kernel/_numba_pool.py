# mypy: ignore-errors
# (compiled code: numba types it, and numba ships no stubs; as for its siblings in pyproject)
"""numba code of the compiled forward walk (:mod:`._numba_walk`) that reads its keys and
values; importing it needs numba.

They lie in pools of blocks: a pool is ``(data, table, block, scales, zeros)``, ``data
(blocks, block, H_kv, d)`` with each row contiguous, sequence ``b``'s position ``c`` in block
``table[b, c // block]`` (a paged cache's, or a contiguous array seen as one block per
sequence), and ``scales`` and ``zeros`` a quantized pool's (empty: the walk reads float
pools only). Positions that follow each other in a block, or in blocks that follow each
other in the pool, are one run of rows (:func:`run_end`): a GEMM reads a tile of keys where
it lies when it is one run, else a copy (:func:`tile_at`); a decoding step's few rows
(:data:`FEW_ROWS`) read each run where it lies, each key and each value once for all the
rows (:func:`few_scores`, :func:`few_accumulate`). The functions a walk calls per run are
inlined in numba's IR (``inline="always"``): a pool's arrays then need no reference counting
per call (a paged cache's decoding step calls them for every block).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from ._numba_step import VECTOR_BITS
from ._numba_vectors import (
    BLOCK_KEYS,
    BLOCK_ROWS,
    FLOAT,
    WIDE_BITS,
    accumulator,
    dots,
)

__all__ = [
    "FEW_ROWS",
    "address",
    "few_accumulate",
    "few_scores",
    "finite",
    "flush",
    "key_ld",
    "lines_ahead",
    "run_at",
    "run_end",
    "tile_at",
    "typed",
]


@intrinsic
def address(typingctx, A, at):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The address of ``A``'s element at the flat offset ``at`` from its data pointer."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        array = context.make_array(sig.args[0])(context, builder, args[0])
        offset = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.ptrtoint(builder.gep(array.data, [offset]), ir.IntType(64))

    return types.int64(A, at), codegen


@intrinsic
def typed(typingctx, address, like):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``address`` as a pointer to elements of ``like``'s dtype (for :func:`numba.carray`)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pointee = context.get_value_type(sig.args[1].dtype)
        return builder.inttoptr(args[0], pointee.as_pointer())

    return types.CPointer(like.dtype)(address, like), codegen


@intrinsic
def _prefetch(typingctx, address):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Ask for the cache line at ``address`` (int64) to be read into L2 ahead (``llvm.prefetch``
    with locality 2: x86's ``prefetcht1``, into L2 on Intel and on AMD since Zen 4). Into
    L1 as well (locality 3, ``prefetcht0``), the walks' prefetches did not help on a Zen 4
    EPYC (lines asked for ahead of a decoding step's keys: 49 ns a key of 128 float32 for 4
    rows from memory with or without them, 19 into L2; a paged step over interleaved
    blocks, int8 21.2 ms -> 13.2). Not measured on the Zen 5 EPYC, whose walks were tuned
    with ``prefetcht0``, nor on an Intel CPU."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        void_p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        function = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [void_p, i32, i32, i32])
        )
        read, l2, data = (ir.Constant(i32, value) for value in (0, 2, 1))
        builder.call(function, [builder.inttoptr(args[0], void_p), read, l2, data])
        return context.get_dummy_value()

    return types.void(address), codegen


@njit(boundscheck=False, nogil=True, inline="always")
def lines_ahead(at, size):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Ask for the ``size`` bytes at address ``at`` to be read into L2 (:func:`_prefetch`):
    every line of 64 bytes they touch. (NumPy's arrays here start 16 bytes into a line: a
    head's 2 KiB of int8 codes of a block touch 33 lines, its 128 bytes of scales 3; asking
    for as many lines as the bytes fill, the last unasked, a decoding step over interleaved
    blocks took 5-10% longer on the Zen 5 EPYC, every stored kind.)"""
    for line in range(at & -64, at + size, 64):
        _prefetch(line)


RUN_LEAD = 8192
"""Bytes of a head's keys ahead of those multiplied that a decoding step's products ask
into L2 (:func:`_within`): 16 keys of 128 float32."""


@njit(boundscheck=False, nogil=True, inline="always")
def _within(run, c, count, lead, size, width):  # type: ignore[no-untyped-def]  # pragma: no cover
    """While keys ``[c, c + count)`` of ``run = (address, ld, n, following, ahead)`` are
    multiplied, ask for the keys ``lead`` on (0: none; those before the run's end) to be
    read into L2: the lines of their ``width`` elements (at once where the keys lie one
    after another, ``ld == width``). The products read a block's keys a vector of each in
    turn (:func:`._numba_vectors.dots`), four streams 512 bytes apart for float32 that a Zen
    4's own prefetcher does not follow: 4 rows' scores of 128 float32 keys from memory took
    49 ns a key, 19 with these (9.7 from L1)."""
    address, ld, n, _, _ = run
    k = c + lead
    if lead == 0 or k >= n:
        return
    end = min(n, k + count)
    if ld == width:
        lines_ahead(address + k * ld * size, (end - k) * ld * size)
    else:  # (a head's keys among the other heads')
        for key in range(k, end):
            lines_ahead(address + key * ld * size, width * size)


@njit(boundscheck=False, nogil=True)
def _ahead(run, c, size, width):  # type: ignore[no-untyped-def]  # pragma: no cover
    """While row ``c`` of ``run = (address, ld, n, following, ahead)`` is read, prefetch
    the matching row (``width`` elements) of the ``ahead`` rows of the run at ``following``
    (0: none): its rows ``0, 1, ...`` as rows ``n - ahead, ...`` of this one go by."""
    _, ld, n, following, ahead = run
    j = c - (n - ahead)
    if following != 0 and 0 <= j < ahead:
        lines_ahead(following + j * ld * size, width * size)


FEW_ROWS = 8
"""Stacked rows up to which a tile is a decoding step's, memory-bound: its products are
compiled loops that read each key and each value once for all its rows
(:func:`few_scores`, :func:`few_accumulate`). BLAS reads them once per row
(``cblas_?gemv``), or packs them into a buffer first (a GEMM of so few rows): for 4 rows of
128 against 1,024 keys of 8 heads, float32, the scores took 0.16 ms compiled, 0.33 with
``gemv`` per row and 0.40 with the GEMM; ``p @ v`` 0.30, 0.32 and 0.28."""

FEW_KEYS = 256
"""Keys per block of :func:`few_scores`: they stay in L2 for the next four rows."""


@njit(boundscheck=False, nogil=True, inline="always")
def _key_row(pool, b, g, c):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The flat element offset of sequence ``b``'s key ``c`` of head ``g`` in ``pool = (data,
    table, block, scales, zeros)``: ``data[table[b, c // block], c % block, g, 0]``."""
    data, table, block = pool[0], pool[1], pool[2]
    at = table[b, c // block] * data.strides[0] + (c % block) * data.strides[1]
    return (at + g * data.strides[2]) // data.itemsize


@njit(boundscheck=False, nogil=True, inline="always")
def key_ld(pool):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Elements between a block's rows (at least ``d``: a block of one row has any stride)."""
    data = pool[0]
    return max(data.strides[1] // data.itemsize, data.shape[3], 1)


@njit(boundscheck=False, nogil=True, inline="always")
def run_end(pool, b, c, stop):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Where the run of sequence ``b``'s positions from ``c`` (before ``stop``) that lie one
    row after another in memory ends: its block's end, or further when the next blocks
    follow it in the pool (a contiguous cache is one block per sequence)."""
    data, table, block = pool[0], pool[1], pool[2]
    end = min((c // block + 1) * block, stop)
    # The next block follows where a run reads on: key_ld elements per row (a block of one
    # row has any stride of its own, such as a broadcast's 0, so its stride is not that test)
    adjacent = data.strides[0] == block * key_ld(pool) * data.itemsize
    while adjacent and end < stop and table[b, end // block] == table[b, end // block - 1] + 1:
        end = min(end + block, stop)
    return end


@njit(boundscheck=False, nogil=True, inline="always")
def run_at(pool, b, g, c):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The address of sequence ``b``'s key (or value) ``c`` of head ``g``."""
    return address(pool[0], _key_row(pool, b, g, c))


@njit(boundscheck=False, nogil=True)
def tile_at(pool, b, g, c0, w, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``(address, leading dimension)`` of keys (or values) ``[c0, c0 + w)`` of sequence
    ``b``, head ``g``, for a GEMM: where they lie when they are one run, else copied run by
    run into ``scratch (>= w, d)``: the same numbers in the same layout, so the GEMM gives
    the same bits."""
    if run_end(pool, b, c0, c0 + w) == c0 + w:
        return run_at(pool, b, g, c0), key_ld(pool)
    d = pool[0].shape[3]
    c = c0
    while c < c0 + w:
        end = run_end(pool, b, c, c0 + w)
        rows = carray(typed(run_at(pool, b, g, c), scratch), (end - c, key_ld(pool)))
        scratch[c - c0 : end - c0, :] = rows[:, :d]
        c = end
    return address(scratch, 0), d


@njit(boundscheck=False, nogil=True)
def finite(pool, b, g, c0, c1):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether sequence ``b``'s values (or keys) ``[c0, c1)`` of head ``g`` are all finite."""
    data = pool[0]
    d = data.shape[3]
    c = c0
    while c < c1:
        end = run_end(pool, b, c, c1)
        rows = carray(typed(run_at(pool, b, g, c), data), (end - c, key_ld(pool)))
        for r in range(end - c):
            for e in range(d):
                if not np.isfinite(rows[r, e]):
                    return False
        c = end
    return True


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def few_scores(run, stacked, i0, rows, s, at, where_they_lie):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``s[i, at + c] = stacked[i0 + i] . key_c`` for a decoding step's few ``rows`` and the
    run of keys ``run = (address, ld, n, following, ahead)``: ``n`` keys from ``address``,
    ``ld`` elements apart. Four rows' dot products per key as it is read, by blocks of
    ``FEW_KEYS`` keys; the first ``ahead`` keys of the run at ``following`` (a paged cache's
    next block; 0: none) are prefetched meanwhile (:func:`_ahead`), and where the keys are
    read ``where_they_lie`` (not rows just read back into L1), the run's keys
    :data:`RUN_LEAD` bytes on (:func:`_within`)."""
    address, ld, n, _, _ = run
    d_k, size = stacked.shape[1], stacked.itemsize
    lead = max(1, RUN_LEAD // max(1, d_k * size)) if where_they_lie else 0
    keys = carray(typed(address, stacked), (n, ld))
    zero = s.dtype.type(0)
    vectors = d_k % (WIDE_BITS // (8 * size)) == 0 and stacked.strides[1] == size
    vectors = vectors and s.strides[1] == size  # (dots: rows of contiguous vectors)
    for start in range(0, n, FEW_KEYS):
        stop = min(start + FEW_KEYS, n)
        i = 0
        while vectors and i < rows:  # blocks of keys by up to four rows
            count, j, c = min(BLOCK_ROWS, rows - i), i0 + i, start
            while c + BLOCK_KEYS <= stop:
                if i == 0:
                    _within(run, c, BLOCK_KEYS, lead, size, d_k)
                    for k in range(c, c + BLOCK_KEYS):
                        _ahead(run, k, size, d_k)
                _float_dots(address, ld * size, c, stacked, j, s, i, at + c, True, count)
                c += BLOCK_KEYS
            while c < stop:
                if i == 0:
                    _within(run, c, 1, lead, size, d_k)
                    _ahead(run, c, size, d_k)
                _float_dots(address, ld * size, c, stacked, j, s, i, at + c, False, count)
                c += 1
            i += count
        while i < rows:  # (rows not of whole vectors)
            if i + 4 <= rows:
                j = i0 + i
                c = start
                q0, q1, q2, q3 = stacked[j], stacked[j + 1], stacked[j + 2], stacked[j + 3]
                while c + 4 <= stop:  # 16 sums in registers
                    if i == 0:
                        for k in range(c, c + 4):
                            _ahead(run, k, size, d_k)
                    _four_by_four(keys, c, q0, q1, q2, q3, s, i, at + c, zero)
                    c += 4
                for k in range(c, stop):  # the last keys, one at a time
                    if i == 0:
                        _ahead(run, k, size, d_k)
                    key = keys[k, :d_k]
                    a0 = a1 = a2 = a3 = zero
                    for d in range(d_k):
                        x = key[d]
                        a0 += q0[d] * x
                        a1 += q1[d] * x
                        a2 += q2[d] * x
                        a3 += q3[d] * x
                    col = at + k
                    s[i, col], s[i + 1, col], s[i + 2, col], s[i + 3, col] = a0, a1, a2, a3
                i += 4
            else:
                q0 = stacked[i0 + i]
                for c in range(start, stop):
                    if i == 0:
                        _ahead(run, c, size, d_k)
                    key = keys[c, :d_k]
                    a0 = zero
                    for d in range(d_k):
                        a0 += q0[d] * key[d]
                    s[i, at + c] = a0
                i += 1


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True, inline="always")
def _four_by_four(keys, c, q0, q1, q2, q3, s, i, col, zero):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``s[i + r, col + k] = q_r . keys[c + k]`` for four rows and four keys: each query
    vector read once for four keys (one key at a time, the four rows' loads outnumbered
    their multiply-adds: 15.4 ns a key of 128 from L1 on an AMD EPYC with AVX-512, 6.9
    here)."""
    d_k = q0.shape[0]
    k0, k1, k2, k3 = keys[c, :d_k], keys[c + 1, :d_k], keys[c + 2, :d_k], keys[c + 3, :d_k]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zero
    e0 = e1 = e2 = e3 = f0 = f1 = f2 = f3 = zero
    for d in range(d_k):
        x, y, z, w = k0[d], k1[d], k2[d], k3[d]
        p0, p1, p2, p3 = q0[d], q1[d], q2[d], q3[d]
        a0 += p0 * x
        b0 += p0 * y
        e0 += p0 * z
        f0 += p0 * w
        a1 += p1 * x
        b1 += p1 * y
        e1 += p1 * z
        f1 += p1 * w
        a2 += p2 * x
        b2 += p2 * y
        e2 += p2 * z
        f2 += p2 * w
        a3 += p3 * x
        b3 += p3 * y
        e3 += p3 * z
        f3 += p3 * w
    s[i, col], s[i + 1, col], s[i + 2, col], s[i + 3, col] = a0, a1, a2, a3
    s[i, col + 1], s[i + 1, col + 1], s[i + 2, col + 1], s[i + 3, col + 1] = b0, b1, b2, b3
    s[i, col + 2], s[i + 1, col + 2], s[i + 2, col + 2], s[i + 3, col + 2] = e0, e1, e2, e3
    s[i, col + 3], s[i + 1, col + 3], s[i + 2, col + 3], s[i + 3, col + 3] = f0, f1, f2, f3


_accumulate_wide, _accumulate_narrow = accumulator(FLOAT), accumulator(FLOAT, VECTOR_BITS)
_dots_block, _dots_one = dots(FLOAT, BLOCK_KEYS), dots(FLOAT, 1)


@njit(boundscheck=False, nogil=True)
def _float_dots(address, row_bytes, c, stacked, j, s, i, col, block, count):  # type: ignore[no-untyped-def]  # pragma: no cover
    """:func:`._numba_vectors.dots` of a float pool's keys, a block or one, by ``count``
    rows: called from here, compiled without the walks' fastmath flags (which numba gives
    every instruction of a function), so the sums' order is the intrinsic's own, as where
    the stored pools' products call it (:mod:`._numba_stored`)."""
    if block:
        _dots_block(address, row_bytes, 0, 0, 0, 0, c, stacked, j, s, i, col, count)
    else:
        _dots_one(address, row_bytes, 0, 0, 0, 0, c, stacked, j, s, i, col, count)


@njit(boundscheck=False, nogil=True)
def _float_sums(address, row_bytes, c0, c1, s, at, partial, i, wide, count):  # type: ignore[no-untyped-def]  # pragma: no cover
    """:func:`._numba_vectors.accumulator` of a float pool's values by ``count`` rows,
    compiled without the walks' fastmath flags (as :func:`_float_dots`)."""
    if wide:
        _accumulate_wide(address, row_bytes, 0, 0, 0, 0, c0, c1, s, at, partial, i, count)
    else:
        _accumulate_narrow(address, row_bytes, 0, 0, 0, 0, c0, c1, s, at, partial, i, count)


@njit(boundscheck=False, nogil=True)
def flush(acc, partial, i0, j0, j1):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Rows ``[j0, j1)`` of ``partial`` added into ``acc``'s rows from ``i0 + j0``, and zeroed."""
    for j in range(j0, j1):
        for d in range(acc.shape[1]):
            acc[i0 + j, d] += partial[j, d]
            partial[j, d] = 0.0


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def few_accumulate(run, s, at, w, acc, i0, rows, partial):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``acc[i0 + i] += sum_c s[i, at + c] * value_c`` for ``rows`` rows and the run of
    values ``run = (address, ld, n, following, ahead)`` (:func:`few_scores`'s; positions ``at`` to
    ``at + n`` of a tile of ``w``): two rows per value as it is read. The sums go through
    ``partial`` (zero at the tile's start), added to ``acc`` every ``FEW_KEYS`` positions of
    the tile and at its end: the rounding of a sum of a few hundred terms, not of
    thousands, and the same however the tile's values are split into runs (a paged cache's
    blocks). The run at ``following`` is prefetched meanwhile."""
    address, ld, n, _, _ = run
    d_v, size = acc.shape[1], acc.itemsize
    values = carray(typed(address, acc), (n, ld))
    i = 0
    lanes = VECTOR_BITS // (8 * size)
    wide = d_v % (WIDE_BITS // (8 * size)) == 0
    blocked = (
        d_v % lanes == 0
        and partial.shape[1] == d_v
        and partial.strides[1] == size
        and s.strides[1] == size
    )
    while blocked and i < rows:  # up to four rows at a time, in registers
        count = min(BLOCK_ROWS, rows - i)
        c = 0
        while c < n:
            end = min(n, w - at, (at + c) // FEW_KEYS * FEW_KEYS + FEW_KEYS - at)
            if i == 0:
                for k in range(c, end):
                    _ahead(run, k, size, d_v)
            _float_sums(address, ld * size, c, end, s[i:], at, partial, i, wide, count)
            if (at + end) % FEW_KEYS == 0 or at + end == w:
                flush(acc, partial, i0, i, i + count)
            c = end
        i += count
    while i < rows:
        pair = i + 2 <= rows
        a0, a1 = partial[i], partial[i + 1 if pair else i]
        for c in range(n):
            if i == 0:
                _ahead(run, c, size, d_v)
            value = values[c, :d_v]
            p0 = s[i, at + c]
            if pair:
                p1 = s[i + 1, at + c]
                for d in range(d_v):
                    x = value[d]
                    a0[d] += p0 * x
                    a1[d] += p1 * x
            else:
                for d in range(d_v):
                    a0[d] += p0 * value[d]
            position = at + c + 1
            if position % FEW_KEYS == 0 or position == w:
                flush(acc, partial, i0, i, i + 2 if pair else i + 1)
        i += 2 if pair else 1
