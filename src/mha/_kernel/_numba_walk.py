"""numba code of :mod:`mha._kernel.compiled`'s tile walks; importing it needs numba. Each
function runs a list of work items from start to end without returning to Python: the GEMMs
call NumPy's own BLAS through the address of its ``cblas_?gemm`` (and ``cblas_?gemv`` for a
decoding step's few rows; :mod:`.blas`), so they are the very calls ``np.matmul`` makes,
and the rest (stacking and scaling the query rows, a decoding step's scores, the softmax
step, rescaling, the division at the end) are loops compiled here.

The walks are plain functions here: :mod:`.compiled` compiles each for one signature per
dtype when first used (cached on disk by numba).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from ._numba_step import exp, row_step

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS's enums


def _cblas_codegen(dtype: Any, spec: tuple[Any, ...]) -> Any:
    """The code calling a CBLAS function (64-bit integers) at the address in argument 0,
    row-major, with the C arguments ``spec`` lists in order: ``("i32", i)``, ``("i64", i)``
    and ``("real", i)`` pass argument ``i`` cast so, ``("ptr", i)`` argument ``i``'s array
    from the flat element offset in argument ``i + 1``, ``("one",)`` a unit increment."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i32, i64, void_p = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        real = context.get_value_type(dtype)
        llvm = {"i32": i32, "i64": i64, "real": real, "ptr": void_p, "one": i64}

        def cast(i: int, to: Any) -> Any:
            return context.cast(builder, args[i], sig.args[i], to)

        def value(kind: str, *at: int) -> Any:
            if kind == "one":
                return context.get_constant(types.int64, 1)
            if kind == "ptr":
                array = context.make_array(sig.args[at[0]])(context, builder, args[at[0]])
                offset = builder.gep(array.data, [cast(at[0] + 1, types.int64)])
                return builder.bitcast(offset, void_p)
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
def _gemv(typingctx, address, ta, M, N, alpha, A, a_at, lda, X, x_at, beta, Y, y_at):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``cblas_?gemv`` (64-bit integers) at ``address``, row-major, unit increments:
    ``Y = alpha op(A) X + beta Y`` for the ``M x N`` matrix ``A`` from element ``a_at``."""
    signature = types.void(address, ta, M, N, alpha, A, a_at, lda, X, x_at, beta, Y, y_at)
    spec = (("i32", 1), ("i64", 2), ("i64", 3), ("real", 4), ("ptr", 5), ("i64", 7), ("ptr", 8),
            ("one",), ("real", 10), ("ptr", 11), ("one",))  # fmt: skip
    return signature, _cblas_codegen(Y.dtype, spec)


@intrinsic
def _pointer(typingctx, A, at):  # type: ignore[no-untyped-def]  # pragma: no cover
    """A pointer to ``A``'s element at the flat offset ``at`` from its data pointer."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.gep(array.data, [context.cast(builder, args[1], sig.args[1], types.int64)])

    return types.CPointer(A.dtype)(A, at), codegen


GEMV_ROWS = 8
"""Stacked rows up to which a tile is a decoding step's: its scores are :func:`_few_scores`'
dot products, each key read from memory once for every row (twice as fast as BLAS's
matrix-vector products per row, measured for 4 rows of 128 against 1,024 keys: 0.16
against 0.33 ms; a GEMM of so few rows packs the keys into a buffer first, slower still),
and ``p @ v`` is BLAS's matrix-vector product per row, block by block of ``GEMV_KEYS`` keys
that the other rows read from L2 (as fast as the GEMM and a compiled loop, measured)."""

GEMV_KEYS = 256


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


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def _few_scores(k, b, g, c0, w, stacked, i0, rows, s):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``s[i, c] = stacked[i0 + i] . k[b, g, c0 + c]`` for a decoding step's few ``rows``
    and ``w`` keys: four rows' dot products per key, so that each key is read from memory
    once (BLAS's matrix-vector product reads it once per row, and its matrix product packs
    the keys first: both measured slower, :data:`GEMV_ROWS`), by blocks of ``GEMV_KEYS``
    keys that stay in L2 for the next four rows."""
    d_k = stacked.shape[1]
    keys = carray(_pointer(k, _at(k, b, g, c0)), (w, _rows(k)))  # rows contiguous
    zero = s.dtype.type(0)
    for start in range(0, w, GEMV_KEYS):
        stop = min(start + GEMV_KEYS, w)
        i = 0
        while i < rows:
            if i + 4 <= rows:
                q0, q1, q2, q3 = stacked[i0 + i], stacked[i0 + i + 1], stacked[i0 + i + 2], stacked[i0 + i + 3]  # fmt: skip  # noqa: E501
                for c in range(start, stop):
                    key = keys[c, :d_k]
                    a0 = a1 = a2 = a3 = zero
                    for d in range(d_k):
                        x = key[d]
                        a0 += q0[d] * x
                        a1 += q1[d] * x
                        a2 += q2[d] * x
                        a3 += q3[d] * x
                    s[i, c], s[i + 1, c], s[i + 2, c], s[i + 3, c] = a0, a1, a2, a3
                i += 4
            else:
                q0 = stacked[i0 + i]
                for c in range(start, stop):
                    key = keys[c, :d_k]
                    a0 = zero
                    for d in range(d_k):
                        a0 += q0[d] * key[d]
                    s[i, c] = a0
                i += 1


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
    gemm, gemv, tasks, q, k, v, out, lse, part_out, part_lse, scale, causal, window, offsets, cols,
    flip_below, chunk, s, flipped, stacked, acc, m, ref, total, failed,
):  # fmt: skip
    """Attention for each task ``(b, g, r0, r1, start, stop, part)`` of ``tasks``: rows
    ``[r0, r1)`` of key/value head ``g``'s query heads in sequence ``b``, over keys
    ``[start, stop)``, written to ``out`` and ``lse`` (``lse`` of size 0: not wanted), or to
    ``part_out[part]`` and ``part_lse[part]`` when ``part >= 0``. ``q (B, H, L, d_k)``,
    ``k (B, H_kv, S, d_k)``, ``v (B, H_kv, S, d_v)``, each row contiguous. ``offsets[b]``
    aligns the causal mask and the window (``window < 0``: none). A task whose band tiles
    hold a non-finite value (which ``0 * value`` would spread) is left undone and flagged in
    ``failed``, for the NumPy walk to do."""
    H, d_k, d_v = q.shape[1], q.shape[3], v.shape[3]
    group = H // k.shape[1]
    dtype = s.dtype.type
    factor = dtype(scale)
    alpha = np.empty(total.shape[0], s.dtype)
    for t in range(tasks.shape[0]):
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
            if banded:  # a hidden key's value must be finite: 0 * inf would be NaN
                for c in range(c0, c1):
                    for d in range(d_v):
                        if not np.isfinite(v[b, g, c, d]):
                            bad = True
                if bad:
                    break
            i0 = (a - r0) if group == 1 else 0
            rows = (e - a) if group == 1 else R
            if rows <= GEMV_ROWS:  # a decoding step's few rows: each key read once
                _few_scores(k, b, g, c0, w, stacked, i0, rows, s)
            elif flip:  # few rows: k @ q^T streams the keys, then transposed into s
                _gemm(gemm, NO_TRANS, TRANS, w, rows, d_k, 1.0, k, _at(k, b, g, c0), _rows(k),
                      stacked, i0 * d_k, d_k, 0.0, flipped, 0, rows)  # fmt: skip
                for c in range(w):
                    for i in range(rows):
                        s[i, c] = flipped[c * rows + i]
            else:
                _gemm(gemm, NO_TRANS, TRANS, rows, w, d_k, 1.0, stacked, i0 * d_k, d_k, k,
                      _at(k, b, g, c0), _rows(k), 0.0, s, 0, cols)  # fmt: skip
            for i in range(rows):
                lo, hi = 0, w
                if banded:
                    lo, hi = _band(i0 + i, n, r0, c0, w, offset, causal, window)
                row = i0 + i
                new, new_ref, row_total, rescale = row_step(
                    s[i, :w], lo, hi, m[row], ref[row], total[row], False, dtype(0), 0, False
                )
                m[row], ref[row], total[row], alpha[row] = new, new_ref, row_total, rescale
                if rescale != 1.0:
                    for d in range(d_v):
                        acc[row, d] *= rescale
            if rows <= GEMV_ROWS:  # acc_i += v^T p_i, block by block of keys
                for c in range(0, w, GEMV_KEYS):
                    width = min(GEMV_KEYS, w - c)
                    for i in range(rows):
                        _gemv(gemv, TRANS, width, d_v, 1.0, v, _at(v, b, g, c0 + c), _rows(v), s,
                              i * cols + c, 1.0, acc, (i0 + i) * d_v)  # fmt: skip
            else:
                for c in range(0, w, chunk):  # acc += p @ v, in chunks of keys for few rows
                    width = min(chunk, w - c)
                    _gemm(gemm, NO_TRANS, NO_TRANS, rows, d_v, width, 1.0, s, c, cols, v,
                          _at(v, b, g, c0 + c), _rows(v), 1.0, acc, i0 * d_v, d_v)  # fmt: skip
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
    sees no key (``lse = -inf``). Whole rows with a select, which the compiler vectorises."""
    zero = p.dtype.type(0)
    for i in range(m):
        lo, hi = 0, w
        if banded:
            lo, hi = _band(i0 + i, n, r0, c0, w, offset, causal, window)
        shift = row_lse[i0 + i]
        if shift == -np.inf:
            lo = hi = 0
        row = p[i, :w]
        for c in range(w):
            e = exp(row[c] - shift)
            row[c] = e if lo <= c < hi else zero


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def _score_gradients(ds, p, m, w, i0, n, r0, c0, offset, causal, window, banded, D):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Rows ``[0, m)`` of ``ds``, holding ``dp``, become ``p * (dp - D)``: 0 outside each
    row's band (where ``dp`` may be NaN from a hidden value)."""
    zero = ds.dtype.type(0)
    for i in range(m):
        lo, hi = 0, w
        if banded:
            lo, hi = _band(i0 + i, n, r0, c0, w, offset, causal, window)
        centre = D[i0 + i]
        row, weights = ds[i, :w], p[i, :w]
        for c in range(w):
            x = weights[c] * (row[c] - centre)
            row[c] = x if lo <= c < hi else zero


def backward(  # type: ignore[no-untyped-def]  # pragma: no cover
    gemm, tasks, q, k, v, out, lse, grad_out, dq, dk, dv, scale, dq_scale, causal, window,
    offsets, key_end, query_end, rows, cols, stacked, do, D, row_lse, dq_t, p, ds, failed,
):  # fmt: skip
    """The gradients of each task ``(b, g)``: key/value head ``g`` of sequence ``b`` and its
    query heads, by tiles of ``rows`` queries (per query head) and ``cols`` keys. ``dk`` and
    ``dv`` arrive zeroed and are accumulated; ``dq`` is written (it may be ``grad_out``:
    each tile of rows is read before it is written). Shapes as :func:`forward`'s, ``lse
    (B, H, L)`` the forward's. A task whose keys hold a non-finite value where some row
    cannot see it (``0 * inf`` would spread) is left undone and flagged in ``failed``."""
    H, L, d_k, d_v = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    group = H // k.shape[1]
    dtype = p.dtype.type
    factor, dq_factor = dtype(scale), dtype(dq_scale)
    for t in range(tasks.shape[0]):
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
