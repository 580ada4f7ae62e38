"""numba code of :mod:`mha._kernel.compiled`'s tile walks; importing it needs numba. Each
walk takes work items from a counter its call's workers share (:func:`_take`) and runs
them from start to end without returning to Python: the GEMMs
call NumPy's own BLAS through the address of its ``cblas_?gemm`` (:mod:`.blas`), so they
are the very calls ``np.matmul`` makes, and the rest (stacking and scaling the query rows,
a decoding step's products, the softmax step, rescaling, the division at the end) are loops
compiled here. The forward reads keys and values from pools of blocks (a paged cache's, or
an array as one block per sequence).

The walks are plain functions here: :mod:`.compiled` compiles each for one signature per
dtype when first used (cached on disk by numba).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_step import VECTOR_BITS, exp, row_step

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS's enums


def _cblas_codegen(dtype: Any, spec: tuple[Any, ...]) -> Any:
    """The code calling a CBLAS function (64-bit integers) at the address in argument 0,
    row-major, with the C arguments ``spec`` lists in order: ``("i32", i)``, ``("i64", i)``
    and ``("real", i)`` pass argument ``i`` cast so, ``("ptr", i)`` argument ``i``'s array
    from the flat element offset in argument ``i + 1``, ``("addr", i)`` the address in
    argument ``i``, ``("one",)`` a unit increment."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i32, i64, void_p = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        real = context.get_value_type(dtype)
        llvm = {"i32": i32, "i64": i64, "real": real, "ptr": void_p, "addr": void_p, "one": i64}

        def cast(i: int, to: Any) -> Any:
            return context.cast(builder, args[i], sig.args[i], to)

        def value(kind: str, *at: int) -> Any:
            if kind == "one":
                return context.get_constant(types.int64, 1)
            if kind == "ptr":
                array = context.make_array(sig.args[at[0]])(context, builder, args[at[0]])
                offset = builder.gep(array.data, [cast(at[0] + 1, types.int64)])
                return builder.bitcast(offset, void_p)
            if kind == "addr":
                return builder.inttoptr(cast(at[0], types.int64), void_p)
            return cast(at[0], {"i32": types.int32, "i64": types.int64, "real": dtype}[kind])

        function = ir.FunctionType(ir.VoidType(), [i32] + [llvm[item[0]] for item in spec])
        callee = builder.inttoptr(cast(0, types.int64), function.as_pointer())
        order = context.get_constant(types.int32, ROW_MAJOR)
        builder.call(callee, [order] + [value(*item) for item in spec])
        return context.get_dummy_value()

    return codegen


@intrinsic
def _gemm(
    typingctx, address, ta, tb, M, N, K, alpha, A, a_at, lda, B, b_at, ldb, beta, C, c_at, ldc
):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``cblas_?gemm`` (64-bit integers) at ``address``, row-major, on the arrays ``A``,
    ``B``, ``C`` from their elements ``a_at``, ``b_at``, ``c_at`` (flat offsets)."""
    signature = types.void(address, ta, tb, M, N, K, alpha, A, a_at, lda, B, b_at, ldb, beta, C,
                           c_at, ldc)  # fmt: skip
    spec = (("i32", 1), ("i32", 2), ("i64", 3), ("i64", 4), ("i64", 5), ("real", 6),
            ("ptr", 7), ("i64", 9), ("ptr", 10), ("i64", 12), ("real", 13), ("ptr", 14),
            ("i64", 16))  # fmt: skip
    return signature, _cblas_codegen(C.dtype, spec)


@intrinsic
def _gemm_at(typingctx, address, like, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc):  # type: ignore[no-untyped-def]  # pragma: no cover
    """:func:`_gemm` on the matrices at the addresses ``A``, ``B``, ``C`` (int64, from
    :func:`_address`) of ``like``'s dtype: the forward walk's, whose keys lie in a cache's
    blocks or in a copy of them."""
    signature = types.void(address, like, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
    spec = (("i32", 2), ("i32", 3), ("i64", 4), ("i64", 5), ("i64", 6), ("real", 7),
            ("addr", 8), ("i64", 9), ("addr", 10), ("i64", 11), ("real", 12), ("addr", 13),
            ("i64", 14))  # fmt: skip
    return signature, _cblas_codegen(like.dtype, spec)


@intrinsic
def _address(typingctx, A, at):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The address of ``A``'s element at the flat offset ``at`` from its data pointer."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        array = context.make_array(sig.args[0])(context, builder, args[0])
        offset = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.ptrtoint(builder.gep(array.data, [offset]), ir.IntType(64))

    return types.int64(A, at), codegen


@intrinsic
def _typed(typingctx, address, like):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``address`` as a pointer to elements of ``like``'s dtype (for :func:`numba.carray`)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pointee = context.get_value_type(sig.args[1].dtype)
        return builder.inttoptr(args[0], pointee.as_pointer())

    return types.CPointer(like.dtype)(address, like), codegen


@intrinsic
def _take(typingctx, counter):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The next task's index from ``counter[0]`` (int64), raised by one atomically: the
    workers of one call each run their walk once, taking tasks until none are left, with
    no hand-off through Python (and its lock) between tasks."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        array = context.make_array(sig.args[0])(context, builder, args[0])
        one = ir.Constant(ir.IntType(64), 1)
        return builder.atomic_rmw("add", array.data, one, "monotonic")

    return types.int64(counter), codegen


@intrinsic
def _prefetch(typingctx, address):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Ask for the cache line at ``address`` (int64) to be read into the caches ahead."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        void_p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        function = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [void_p, i32, i32, i32])
        )
        read, keep, data = (ir.Constant(i32, value) for value in (0, 3, 1))
        builder.call(function, [builder.inttoptr(args[0], void_p), read, keep, data])
        return context.get_dummy_value()

    return types.void(address), codegen


@njit(boundscheck=False, nogil=True)
def _ahead(following, c, ld, size, width):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Prefetch row ``c`` (``width`` elements) of the run at ``following`` (0: none)."""
    if following != 0:
        row = following + c * ld * size
        for line in range(0, width * size, 64):
            _prefetch(row + line)


FEW_ROWS = 8
"""Stacked rows up to which a tile is a decoding step's, memory-bound: its products are
compiled loops that read each key and each value once for all its rows
(:func:`_few_scores`, :func:`_few_accumulate`). BLAS reads them once per row
(``cblas_?gemv``), or packs them into a buffer first (a GEMM of so few rows): for 4 rows of
128 against 1,024 keys of 8 heads, float32, the scores took 0.16 ms compiled, 0.33 with
``gemv`` per row and 0.40 with the GEMM; ``p @ v`` 0.30, 0.32 and 0.28."""

FEW_KEYS = 256
"""Keys per block of :func:`_few_scores`: they stay in L2 for the next four rows."""


@njit(boundscheck=False, nogil=True)
def _at(array, i, j, r):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The flat element offset of ``array[i, j, r, 0]`` from its data pointer."""
    size = array.itemsize
    return (i * array.strides[0] + j * array.strides[1] + r * array.strides[2]) // size


@njit(boundscheck=False, nogil=True)
def _rows(array):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The leading dimension of ``array (..., n, d)``'s matrices, in elements (any value of
    at least ``d`` for a single row, whose stride NumPy leaves arbitrary)."""
    return max(array.strides[array.ndim - 2] // array.itemsize, array.shape[array.ndim - 1], 1)


@njit(boundscheck=False, nogil=True)
def _band(i, n, r0, c0, w, offset, causal, window):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Stacked row ``i`` (query row ``r0 + i % n``)'s visible keys ``[lo, hi)`` of the key
    tile ``[c0, c0 + w)``, by the causal mask and the window (``window < 0``: none)."""
    aligned = r0 + i % n + offset - c0  # the row's own key, from c0
    lo, hi = 0, w
    if causal:
        hi = min(max(aligned + 1, 0), w)
    if window >= 0:
        lo = min(max(aligned - window + 1, 0), w)
    return lo, max(lo, hi)


@njit(boundscheck=False, nogil=True)
def _key_row(pool, table, block, b, g, c):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The flat element offset of sequence ``b``'s key ``c`` of head ``g``: ``pool[table[b,
    c // block], c % block, g, 0]`` for a pool ``(blocks, block, H_kv, d)``."""
    at = table[b, c // block] * pool.strides[0] + (c % block) * pool.strides[1]
    return (at + g * pool.strides[2]) // pool.itemsize


@njit(boundscheck=False, nogil=True)
def _key_ld(pool):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Elements between a block's rows (at least ``d``: a block of one row has any stride)."""
    return max(pool.strides[1] // pool.itemsize, pool.shape[3], 1)


@njit(boundscheck=False, nogil=True)
def _run_end(pool, table, block, b, c, stop):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Where the run of sequence ``b``'s positions from ``c`` (before ``stop``) that lie one
    row after another in memory ends: its block's end, or further when the next blocks
    follow it in the pool (a contiguous cache is one block per sequence)."""
    end = min((c // block + 1) * block, stop)
    adjacent = pool.strides[0] == block * pool.strides[1]
    while adjacent and end < stop and table[b, end // block] == table[b, end // block - 1] + 1:
        end = min(end + block, stop)
    return end


@njit(boundscheck=False, nogil=True)
def _tile_at(pool, table, block, b, g, c0, w, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``(address, leading dimension)`` of keys (or values) ``[c0, c0 + w)`` of sequence
    ``b``, head ``g``, for a GEMM: where they lie when they are one run, else copied run by
    run into ``scratch (>= w, d)``: the same numbers in the same layout, so the GEMM gives
    the same bits."""
    if _run_end(pool, table, block, b, c0, c0 + w) == c0 + w:
        return _address(pool, _key_row(pool, table, block, b, g, c0)), _key_ld(pool)
    d = pool.shape[3]
    c = c0
    while c < c0 + w:
        end = _run_end(pool, table, block, b, c, c0 + w)
        address = _address(pool, _key_row(pool, table, block, b, g, c))
        rows = carray(_typed(address, scratch), (end - c, _key_ld(pool)))
        scratch[c - c0 : end - c0, :] = rows[:, :d]
        c = end
    return _address(scratch, 0), d


@njit(boundscheck=False, nogil=True)
def _finite(pool, table, block, b, g, c0, c1):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether sequence ``b``'s values (or keys) ``[c0, c1)`` of head ``g`` are all finite."""
    d = pool.shape[3]
    c = c0
    while c < c1:
        end = _run_end(pool, table, block, b, c, c1)
        address = _address(pool, _key_row(pool, table, block, b, g, c))
        rows = carray(_typed(address, pool), (end - c, _key_ld(pool)))
        for r in range(end - c):
            for e in range(d):
                if not np.isfinite(rows[r, e]):
                    return False
        c = end
    return True


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def _few_scores(address, ld, n, stacked, i0, rows, s, at, following):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``s[i, at + c] = stacked[i0 + i] . key_c`` for a decoding step's few ``rows`` and the
    ``n`` keys from ``address`` (``ld`` elements apart): four rows' dot products per key as
    it is read, by blocks of ``FEW_KEYS`` keys; the run at ``following`` (a paged cache's
    next block) is prefetched meanwhile, row for row."""
    d_k, size = stacked.shape[1], stacked.itemsize
    keys = carray(_typed(address, stacked), (n, ld))
    zero = s.dtype.type(0)
    for start in range(0, n, FEW_KEYS):
        stop = min(start + FEW_KEYS, n)
        i = 0
        while i < rows:
            if i + 4 <= rows:
                q0, q1, q2, q3 = stacked[i0 + i], stacked[i0 + i + 1], stacked[i0 + i + 2], stacked[i0 + i + 3]  # fmt: skip  # noqa: E501
                for c in range(start, stop):
                    if i == 0:
                        _ahead(following, c, ld, size, d_k)
                    key = keys[c, :d_k]
                    a0 = a1 = a2 = a3 = zero
                    for d in range(d_k):
                        x = key[d]
                        a0 += q0[d] * x
                        a1 += q1[d] * x
                        a2 += q2[d] * x
                        a3 += q3[d] * x
                    s[i, at + c], s[i + 1, at + c], s[i + 2, at + c], s[i + 3, at + c] = a0, a1, a2, a3  # fmt: skip  # noqa: E501
                i += 4
            else:
                q0 = stacked[i0 + i]
                for c in range(start, stop):
                    if i == 0:
                        _ahead(following, c, ld, size, d_k)
                    key = keys[c, :d_k]
                    a0 = zero
                    for d in range(d_k):
                        a0 += q0[d] * key[d]
                    s[i, at + c] = a0
                i += 1


BLOCK_ROWS = 4
"""Rows of :func:`_accumulate_block`'s register block: a grouped-query step's 4 query heads
per key/value head, or 8 as two blocks."""


@intrinsic
def _accumulate_block(typingctx, address, ld, c0, c1, s, at, partial, i):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``partial[i + r, d] += s[r, at + c] * value_c[d]`` for the :data:`BLOCK_ROWS` rows
    ``r``, every ``d`` and ``c`` from ``c0`` to ``c1`` in order (value ``c`` at ``address``
    plus ``c * ld`` elements; ``partial``'s width a multiple of two vectors; ``s`` and
    ``partial`` with contiguous rows).

    LLVM vector code: for each two vectors of features, the block's eight partial sums stay
    in registers while the values go by, each ``llvm.fmuladd`` (fused where the CPU has FMA),
    the order and rounding of ``a += p * x`` compiled with contraction. numba's loop kept
    them in memory (a load and a store per multiply-add: 0.36 ms for 4 rows of 8 heads of
    1,024 values of 128, float32, against 0.19 here)."""
    dtype = partial.dtype

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        real = context.get_value_type(dtype)
        lanes = VECTOR_BITS // dtype.bitwidth
        vector = ir.VectorType(real, lanes)
        index = ir.IntType(64)
        align = dtype.bitwidth // 8

        def arg(k: int) -> Any:
            return context.cast(builder, args[k], signature.args[k], types.int64)

        def const(value: int) -> Any:
            return ir.Constant(index, value)

        values = builder.inttoptr(arg(0), real.as_pointer())
        ld, c0, c1, at, i = arg(1), arg(2), arg(3), arg(5), arg(7)
        scores = context.make_array(signature.args[4])(context, builder, args[4])
        sums = context.make_array(signature.args[6])(context, builder, args[6])
        item = const(align)
        s_ld = builder.sdiv(builder.extract_value(scores.strides, 0), item)
        p_ld = builder.sdiv(builder.extract_value(sums.strides, 0), item)
        width = builder.extract_value(sums.shape, 1)
        kind = "f32" if dtype.bitwidth == 32 else "f64"
        fma = cgutils.get_or_insert_function(  # fused where the CPU has FMA, as contraction
            builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fmuladd.v{lanes}{kind}"
        )
        zero32 = ir.Constant(ir.IntType(32), 0)
        splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)

        def vector_at(base: Any, offset: Any) -> Any:
            return builder.bitcast(builder.gep(base, [offset]), vector.as_pointer())

        held = [[cgutils.alloca_once(builder, vector) for _ in range(2)] for _ in range(BLOCK_ROWS)]
        step = const(2 * lanes)
        with cgutils.for_range_slice(builder, const(0), width, step, index) as (d0, _):
            rows = [builder.mul(builder.add(i, const(r)), p_ld) for r in range(BLOCK_ROWS)]
            for r, pair in enumerate(held):
                for h, slot in enumerate(pair):
                    at_d = builder.add(builder.add(rows[r], d0), const(h * lanes))
                    builder.store(builder.load(vector_at(sums.data, at_d), align=align), slot)
            with cgutils.for_range_slice(builder, c0, c1, const(1), index) as (c, _):
                row = builder.add(builder.mul(c, ld), d0)
                halves = [vector_at(values, builder.add(row, const(h * lanes))) for h in range(2)]
                xs = [builder.load(half, align=align) for half in halves]
                for r, pair in enumerate(held):
                    here = builder.add(builder.mul(const(r), s_ld), builder.add(at, c))
                    p = builder.load(builder.gep(scores.data, [here]), align=align)
                    p = builder.insert_element(ir.Constant(vector, ir.Undefined), p, zero32)
                    p = builder.shuffle_vector(p, ir.Constant(vector, ir.Undefined), splat)
                    for x, slot in zip(xs, pair, strict=True):
                        builder.store(builder.call(fma, [p, x, builder.load(slot)]), slot)
            for r, pair in enumerate(held):
                for h, slot in enumerate(pair):
                    at_d = builder.add(builder.add(rows[r], d0), const(h * lanes))
                    builder.store(builder.load(slot), vector_at(sums.data, at_d), align=align)
        return context.get_dummy_value()

    signature = types.void(address, ld, c0, c1, s, at, partial, i)
    return signature, codegen


@njit(boundscheck=False, nogil=True)
def _flush(acc, partial, i0, j0, j1):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Rows ``[j0, j1)`` of ``partial`` added into ``acc``'s rows from ``i0 + j0``, and zeroed."""
    for j in range(j0, j1):
        for d in range(acc.shape[1]):
            acc[i0 + j, d] += partial[j, d]
            partial[j, d] = 0.0


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def _few_accumulate(address, ld, n, s, at, w, acc, i0, rows, partial, following):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``acc[i0 + i] += sum_c s[i, at + c] * value_c`` for ``rows`` rows and the ``n``
    values from ``address`` (positions ``at`` to ``at + n`` of a tile of ``w``): two rows per
    value as it is read. The sums go through ``partial`` (zero at the tile's start), added
    to ``acc`` every ``FEW_KEYS`` positions of the tile and at its end: the rounding of a
    sum of a few hundred terms, not of thousands, and the same however the tile's values
    are split into runs (a paged cache's blocks). The run at ``following`` is prefetched
    meanwhile."""
    d_v, size = acc.shape[1], acc.itemsize
    values = carray(_typed(address, acc), (n, ld))
    i = 0
    lanes = VECTOR_BITS // (8 * size)
    blocked = (
        d_v % (2 * lanes) == 0
        and partial.shape[1] == d_v
        and partial.strides[1] == size
        and s.strides[1] == size
    )
    while blocked and i + BLOCK_ROWS <= rows:  # four rows at a time, in registers
        c = 0
        while c < n:
            end = min(n, w - at, (at + c) // FEW_KEYS * FEW_KEYS + FEW_KEYS - at)
            if i == 0:
                for k in range(c, end):
                    _ahead(following, k, ld, size, d_v)
            _accumulate_block(address, ld, c, end, s[i:], at, partial, i)
            if (at + end) % FEW_KEYS == 0 or at + end == w:
                _flush(acc, partial, i0, i, i + BLOCK_ROWS)
            c = end
        i += BLOCK_ROWS
    while i < rows:
        pair = i + 2 <= rows
        a0, a1 = partial[i], partial[i + 1 if pair else i]
        for c in range(n):
            if i == 0:
                _ahead(following, c, ld, size, d_v)
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
                _flush(acc, partial, i0, i, i + 2 if pair else i + 1)
        i += 2 if pair else 1


def plan(B, H_kv, L, rows, key_end, query_end, offsets, causal, window):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The forward's tasks ``(b, g, r0, r1, start, stop, -1)``: every sequence, key/value
    head and tile of ``rows`` queries whose rows may see a key, with the keys they may see
    (``[start, stop)``), longest first (ties in order)."""
    tiles = (L + rows - 1) // rows
    table = np.empty((B * H_kv * tiles, 7), np.int64)
    cost = np.empty(B * H_kv * tiles, np.int64)
    n = 0
    for b in range(B):
        for g in range(H_kv):
            for r0 in range(0, min(L, query_end[b]), rows):
                r1 = min(r0 + rows, query_end[b])
                stop = min(key_end[b], r1 + offsets[b]) if causal else key_end[b]
                start = max(0, r0 + offsets[b] - window + 1) if window >= 0 else 0
                if start < stop:
                    table[n, 0], table[n, 1], table[n, 2], table[n, 3] = b, g, r0, r1
                    table[n, 4], table[n, 5], table[n, 6] = start, stop, -1
                    cost[n] = -(r1 - r0) * (stop - start)
                    n += 1
    order = np.argsort(cost[:n], kind="mergesort")
    return table[:n][order]


def forward(  # type: ignore[no-untyped-def]  # pragma: no cover
    gemm, tasks, counter, q, kp, vp, table, block, out, lse, part_out, part_lse, scale, causal,
    window, offsets, cols, flip_below, chunk, s, flipped, stacked, acc, m, ref, total, partial,
    k_tile, v_tile, failed,
):  # fmt: skip
    """Attention for each task ``(b, g, r0, r1, start, stop, part)`` of ``tasks`` that this
    call takes from ``counter`` (:func:`_take`; the call's workers share it): rows
    ``[r0, r1)`` of key/value head ``g``'s query heads in sequence ``b``, over keys
    ``[start, stop)``, written to ``out`` and ``lse`` (``lse`` of size 0: not wanted), or to
    ``part_out[part]`` and ``part_lse[part]`` when ``part >= 0``. ``q (B, H, L, d_k)``;
    the keys and values are pools ``kp (blocks, block, H_kv, d_k)``, ``vp (blocks, block,
    H_kv, d_v)`` (each row contiguous), sequence ``b``'s position ``c`` in block ``table[b,
    c // block]``: a paged cache's, or a contiguous array seen as one block per sequence.
    A tile of keys that spans blocks apart is copied into ``k_tile`` and ``v_tile`` (``(cols,
    d)``) for the GEMMs; a decoding step's few rows read the blocks where they lie, summing
    through ``partial`` (``(rows, d_v)``).
    ``offsets[b]`` aligns the causal mask and the window (``window < 0``: none). A task
    whose band tiles hold a non-finite value (which ``0 * value`` would spread) is left
    undone and flagged in ``failed``, for the NumPy walk to do."""
    H, d_k, d_v = q.shape[1], q.shape[3], vp.shape[3]
    group = H // kp.shape[2]
    dtype = s.dtype.type
    factor = dtype(scale)
    while True:
        t = _take(counter)
        if t >= tasks.shape[0]:
            break
        b, g, r0, r1 = tasks[t, 0], tasks[t, 1], tasks[t, 2], tasks[t, 3]
        start, stop, part = tasks[t, 4], tasks[t, 5], tasks[t, 6]
        n = r1 - r0
        R = group * n
        offset = offsets[b]
        for j in range(group):  # the group's query rows, stacked and scaled
            for i in range(n):
                for d in range(d_k):
                    stacked[j * n + i, d] = q[b, g * group + j, r0 + i, d] * factor
        m[:R] = -np.inf
        ref[:R] = 0.0
        total[:R] = 0.0
        acc[:R] = 0.0
        flip = flip_below > R  # few rows
        bad = False
        c0 = start
        while c0 < stop and not bad:
            c1 = min(c0 + cols, stop)
            w = c1 - c0
            a, e = r0, r1  # the rows that may see a key of the tile
            if causal:
                a = max(a, c0 - offset)
            if window >= 0:
                e = min(e, c1 - 1 - offset + window)
            if a >= e:
                c0 = c1
                continue
            if group > 1:
                a, e = r0, r1
            banded = (causal and c1 - 1 > a + offset) or (window >= 0 and c0 <= e - 1 + offset - window)  # fmt: skip  # noqa: E501
            if banded and not _finite(vp, table, block, b, g, c0, c1):
                bad = True  # a hidden key's value must be finite: 0 * inf would be NaN
                break
            i0 = (a - r0) if group == 1 else 0
            rows = (e - a) if group == 1 else R
            few = rows <= FEW_ROWS  # a decoding step's: the blocks read where they lie
            if few:
                c, address = c0, _address(kp, _key_row(kp, table, block, b, g, c0))
                while c < c1:
                    end = _run_end(kp, table, block, b, c, c1)
                    following = _address(kp, _key_row(kp, table, block, b, g, end)) if end < c1 else 0  # fmt: skip  # noqa: E501
                    _few_scores(address, _key_ld(kp), end - c, stacked, i0, rows, s, c - c0,
                                following)  # fmt: skip
                    c, address = end, following
            else:
                keys, ld = _tile_at(kp, table, block, b, g, c0, w, k_tile)
                if flip:  # few rows: k @ q^T streams the keys, then transposed into s
                    _gemm_at(gemm, s, NO_TRANS, TRANS, w, rows, d_k, 1.0, keys, ld,
                             _address(stacked, i0 * d_k), d_k, 0.0, _address(flipped, 0), rows)  # fmt: skip  # noqa: E501
                    for c in range(w):
                        for i in range(rows):
                            s[i, c] = flipped[c * rows + i]
                else:
                    _gemm_at(gemm, s, NO_TRANS, TRANS, rows, w, d_k, 1.0,
                             _address(stacked, i0 * d_k), d_k, keys, ld, 0.0, _address(s, 0),
                             cols)  # fmt: skip
            for i in range(rows):
                lo, hi = 0, w
                if banded:
                    lo, hi = _band(i0 + i, n, r0, c0, w, offset, causal, window)
                row = i0 + i
                new, new_ref, row_total, rescale = row_step(
                    s[i, :w], lo, hi, m[row], ref[row], total[row], False, dtype(0), 0, False
                )
                m[row], ref[row], total[row] = new, new_ref, row_total
                if rescale != 1.0:
                    for d in range(d_v):
                        acc[row, d] *= rescale
            if few:  # acc += p @ v, each value read once
                partial[:rows] = 0.0
                c, address = c0, _address(vp, _key_row(vp, table, block, b, g, c0))
                while c < c1:
                    end = _run_end(vp, table, block, b, c, c1)
                    following = _address(vp, _key_row(vp, table, block, b, g, end)) if end < c1 else 0  # fmt: skip  # noqa: E501
                    _few_accumulate(address, _key_ld(vp), end - c, s, c - c0, w, acc, i0, rows,
                                    partial, following)  # fmt: skip
                    c, address = end, following
            else:
                values, ld = _tile_at(vp, table, block, b, g, c0, w, v_tile)
                size = vp.itemsize
                for c in range(0, w, chunk):  # acc += p @ v, in chunks of keys for few rows
                    width = min(chunk, w - c)
                    _gemm_at(gemm, s, NO_TRANS, NO_TRANS, rows, d_v, width, 1.0,
                             _address(s, c), cols, values + c * ld * size, ld, 1.0,
                             _address(acc, i0 * d_v), d_v)  # fmt: skip
            c0 = c1
        if bad:
            failed[t] = True
            continue
        for j in range(group):
            for i in range(n):
                row = j * n + i
                inverse = dtype(1.0) / total[row] if total[row] != 0.0 else dtype(1.0)
                if part >= 0:
                    for d in range(d_v):
                        part_out[part, j, r0 + i, d] = acc[row, d] * inverse
                else:
                    for d in range(d_v):
                        out[b, g * group + j, r0 + i, d] = acc[row, d] * inverse
                row_lse = ref[row] + np.log(total[row]) if total[row] != 0.0 else -np.inf
                if part >= 0:
                    part_lse[part, j, r0 + i] = row_lse
                elif lse.shape[2] > 0:
                    lse[b, g * group + j, r0 + i] = row_lse


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def _weights(p, m, w, i0, n, r0, c0, offset, causal, window, banded, row_lse):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Rows ``[0, m)`` of ``p`` (stacked rows ``i0 + i``), holding ``s - 0``, become
    ``exp(s - lse)``, the forward's weights: 0 outside each row's band and for a row that
    sees no key (``lse = -inf``). Each pair on its own: the band's slice is swept (a loop
    from 0 over a slice vectorises), the rest set to 0."""
    for i in range(m):
        lo, hi = 0, w
        if banded:
            lo, hi = _band(i0 + i, n, r0, c0, w, offset, causal, window)
        shift = row_lse[i0 + i]
        if shift == -np.inf:
            lo = hi = 0
        row = p[i, :w]
        row[:lo] = 0.0
        row[hi:] = 0.0
        visible = row[lo:hi]
        for c in range(visible.shape[0]):
            visible[c] = exp(visible[c] - shift)


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def _score_gradients(ds, p, m, w, i0, n, r0, c0, offset, causal, window, banded, D):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Rows ``[0, m)`` of ``ds``, holding ``dp``, become ``p * (dp - D)``: 0 outside each
    row's band (where ``dp`` may be NaN from a hidden value)."""
    for i in range(m):
        lo, hi = 0, w
        if banded:
            lo, hi = _band(i0 + i, n, r0, c0, w, offset, causal, window)
        centre = D[i0 + i]
        row = ds[i, :w]
        row[:lo] = 0.0
        row[hi:] = 0.0
        visible, weights = row[lo:hi], p[i, lo:hi]
        for c in range(visible.shape[0]):
            visible[c] = weights[c] * (visible[c] - centre)


def backward(  # type: ignore[no-untyped-def]  # pragma: no cover
    gemm, tasks, counter, q, k, v, out, lse, grad_out, dq, dk, dv, scale, dq_scale, causal,
    window, offsets, key_end, query_end, rows, cols, stacked, do, D, row_lse, dq_t, p, ds, failed,
):  # fmt: skip
    """The gradients of each task ``(b, g)`` this call takes from ``counter`` (as
    :func:`forward`'s): key/value head ``g`` of sequence ``b`` and its
    query heads, by tiles of ``rows`` queries (per query head) and ``cols`` keys. ``dk`` and
    ``dv`` arrive zeroed and are accumulated; ``dq`` is written (it may be ``grad_out``:
    each tile of rows is read before it is written). Shapes as :func:`forward`'s, ``lse
    (B, H, L)`` the forward's. A task whose keys hold a non-finite value where some row
    cannot see it (``0 * inf`` would spread) is left undone and flagged in ``failed``."""
    H, L, d_k, d_v = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    group = H // k.shape[1]
    dtype = p.dtype.type
    factor, dq_factor = dtype(scale), dtype(dq_scale)
    while True:
        t = _take(counter)
        if t >= tasks.shape[0]:
            break
        b, g = tasks[t, 0], tasks[t, 1]
        offset, keys, queries = offsets[b], key_end[b], query_end[b]
        if causal or window >= 0:  # some rows do not see some keys
            bad = False
            for c in range(keys):
                for d in range(d_k):
                    if not np.isfinite(k[b, g, c, d]):
                        bad = True
            if bad:
                failed[t] = True
                continue
        for j in range(group):  # padded rows: no gradient
            for r in range(queries, L):
                dq[b, g * group + j, r, :] = 0.0
        for r0 in range(0, queries, rows):
            r1 = min(r0 + rows, queries)
            n = r1 - r0
            R = group * n
            stop = min(keys, r1 + offset) if causal else keys
            start = max(0, r0 + offset - window + 1) if window >= 0 else 0
            for j in range(group):  # stacked rows: q * scale, dO, lse, D = rowsum(dO * O)
                h = g * group + j
                for i in range(n):
                    row = j * n + i
                    total = dtype(0)
                    for d in range(d_v):
                        x = grad_out[b, h, r0 + i, d]
                        do[row, d] = x
                        total += x * out[b, h, r0 + i, d]
                    D[row] = total
                    row_lse[row] = lse[b, h, r0 + i]
                    for d in range(d_k):
                        stacked[row, d] = q[b, h, r0 + i, d] * factor
            dq_t[:R] = 0.0
            for c0 in range(start, stop, cols):
                c1 = min(c0 + cols, stop)
                w = c1 - c0
                a, e = r0, r1
                if causal:
                    a = max(a, c0 - offset)
                if window >= 0:
                    e = min(e, c1 - 1 - offset + window)
                if a >= e:
                    continue
                if group > 1:
                    a, e = r0, r1
                banded = (causal and c1 - 1 > a + offset) or (window >= 0 and c0 <= e - 1 + offset - window)  # fmt: skip  # noqa: E501
                i0 = (a - r0) if group == 1 else 0
                m = (e - a) if group == 1 else R
                _gemm(gemm, NO_TRANS, TRANS, m, w, d_k, 1.0, stacked, i0 * d_k, d_k, k,
                      _at(k, b, g, c0), _rows(k), 0.0, p, 0, cols)  # fmt: skip
                _weights(p, m, w, i0, n, r0, c0, offset, causal, window, banded, row_lse)
                _gemm(gemm, TRANS, NO_TRANS, w, d_v, m, 1.0, p, 0, cols, do, i0 * d_v, d_v, 1.0,
                      dv, _at(dv, b, g, c0), _rows(dv))  # fmt: skip
                _gemm(gemm, NO_TRANS, TRANS, m, w, d_v, 1.0, do, i0 * d_v, d_v, v,
                      _at(v, b, g, c0), _rows(v), 0.0, ds, 0, cols)  # fmt: skip
                _score_gradients(ds, p, m, w, i0, n, r0, c0, offset, causal, window, banded, D)
                _gemm(gemm, NO_TRANS, NO_TRANS, m, d_k, w, 1.0, ds, 0, cols, k, _at(k, b, g, c0),
                      _rows(k), 1.0, dq_t, i0 * d_k, d_k)  # fmt: skip
                _gemm(gemm, TRANS, NO_TRANS, w, d_k, m, 1.0, ds, 0, cols, stacked, i0 * d_k, d_k,
                      1.0, dk, _at(dk, b, g, c0), _rows(dk))  # fmt: skip
            for j in range(group):
                for i in range(n):
                    for d in range(d_k):
                        dq[b, g * group + j, r0 + i, d] = dq_t[j * n + i, d] * dq_factor


__all__ = ["backward", "exp", "forward"]
