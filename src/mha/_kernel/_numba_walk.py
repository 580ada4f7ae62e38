"""numba code of :mod:`mha._kernel.compiled`'s tile walks; importing it needs numba. Each
walk takes work items from a counter its call's workers share (:func:`_take`) and runs
them from start to end without returning to Python: the GEMMs call NumPy's own BLAS
through the address of its ``cblas_?gemm`` (:mod:`.blas`), so they are the very calls
``np.matmul`` makes, and the rest (stacking and scaling the query rows, the softmax step,
rescaling, the division at the end) are loops compiled here. The forward reads keys and
values from pools of blocks (a paged cache's, or an array as one block per sequence), and a
decoding step's products read them where they lie (:mod:`._numba_pool`).

A walk takes its arguments as numba tuples (the work, the operands, the outputs, the band,
the sizes, the scratch) and hands them on whole: to a task (:func:`_forward_task`,
:func:`_backward_task`), and to each key tile of it (:func:`_tile`, whose band is
:mod:`.geometry`'s, compiled here). The walks are plain functions here: :mod:`.compiled`
compiles each for one signature per dtype when first used (cached on disk by numba). Their
parts are inlined in numba's IR (``inline="always"``, with the walks' fastmath flags,
:data:`FAST`): each walk compiles to one function, its loops as when it was written as one,
and the tuples' arrays need no reference counting from part to part. The parts that read a
``mask_mod``'s block map (:func:`_map_state`, :func:`_map_keys`, :func:`_next_tile`,
:func:`_task_keys`, :func:`_hide`) are plain calls instead, one per tile or per row:
inlined, they took each walk's first compilation to 18-22 s (the backward's from 4-5 s);
as calls, 6-15 s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import geometry
from ._numba_pool import (
    FEW_ROWS,
    address,
    few_accumulate,
    few_scores,
    finite,
    key_ld,
    run_at,
    run_end,
    tile_at,
)
from ._numba_step import change_row, exp, row_softmax, tanh
from ._numba_stored import STAGE_ROWS, flat, in_place, stage, stored, stored_scores, stored_sums
from .geometry import BLOCK, EMPTY, FULL, PARTIAL

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS's enums


def _flat(builder: Any, sig: Any, args: Any) -> list[tuple[Any, Any]]:
    """The arguments of an intrinsic as ``(value, type)`` pairs, each tuple's elements in its
    place."""
    flat = []
    for value, kind in zip(args, sig.args, strict=True):
        if isinstance(kind, types.BaseTuple):
            elements = cgutils.unpack_tuple(builder, value, len(kind.types))
            flat += zip(elements, kind.types, strict=True)
        else:
            flat.append((value, kind))
    return flat


def _cblas_codegen(dtype: Any, spec: tuple[Any, ...]) -> Any:
    """The code calling a CBLAS function (64-bit integers) at the address in argument 0,
    row-major, with the C arguments ``spec`` lists in order, arguments counted with each
    tuple's elements in its place (:func:`_flat`): ``("i32", i)``, ``("i64", i)`` and
    ``("real", i)`` pass argument ``i`` cast so, ``("ptr", i)`` argument ``i``'s array from
    the flat element offset in argument ``i + 1``, ``("addr", i)`` the address in argument
    ``i``."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i32, i64, void_p = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        real = context.get_value_type(dtype)
        llvm = {"i32": i32, "i64": i64, "real": real, "ptr": void_p, "addr": void_p}
        flat = _flat(builder, sig, args)

        def cast(i: int, to: Any) -> Any:
            return context.cast(builder, flat[i][0], flat[i][1], to)

        def value(kind: str, at: int) -> Any:
            if kind == "ptr":
                array = context.make_array(flat[at][1])(context, builder, flat[at][0])
                offset = builder.gep(array.data, [cast(at + 1, types.int64)])
                return builder.bitcast(offset, void_p)
            if kind == "addr":
                return builder.inttoptr(cast(at, types.int64), void_p)
            return cast(at, {"i32": types.int32, "i64": types.int64, "real": dtype}[kind])

        function = ir.FunctionType(ir.VoidType(), [i32] + [llvm[item[0]] for item in spec])
        callee = builder.inttoptr(cast(0, types.int64), function.as_pointer())
        order = context.get_constant(types.int32, ROW_MAJOR)
        builder.call(callee, [order] + [value(*item) for item in spec])
        return context.get_dummy_value()

    return codegen


@intrinsic
def _gemm(typingctx, address, op, a, b, c):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``cblas_?gemm`` (64-bit integers) at ``address``, row-major, in ``c``'s dtype: ``op =
    (transa, transb, M, N, K, alpha, beta)`` and ``C = alpha op(A) op(B) + beta C`` for the
    matrices ``a``, ``b``, ``c``, each ``(array, at, ld)`` from its array's element at the
    flat offset ``at``, or ``(address, ld)`` at an address (int64, :func:`address`: keys
    and values in a cache's blocks), ``ld`` elements from row to row."""
    spec = [("i32", 1), ("i32", 2), ("i64", 3), ("i64", 4), ("i64", 5), ("real", 6)]
    at = 1 + len(op.types)  # a's first element, counted as _flat counts
    for i, matrix in enumerate((a, b, c)):
        if i == 2:
            spec.append(("real", 7))  # beta
        if isinstance(matrix.types[0], types.Array):
            spec += [("ptr", at), ("i64", at + 2)]
        else:
            spec += [("addr", at), ("i64", at + 1)]
        at += len(matrix.types)
    return types.void(address, op, a, b, c), _cblas_codegen(c.types[0].dtype, tuple(spec))


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


_keys_seen = njit(inline="always")(geometry.keys_seen)
_rows_seeing = njit(inline="always")(geometry.rows_seeing)
_cut = njit(inline="always")(geometry.cut)
_band = njit(inline="always")(geometry.band)


@njit(boundscheck=False, nogil=True, inline="always")
def _tile(at, c0, c1, group, band, var):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The key tile ``[c0, c1)`` of the rows ``at = (b, g, r0, r1)`` (each of the ``group``
    query heads of key/value head ``g`` of sequence ``b``), as the walks compute it: ``(b,
    g, r0, n, c0, c1, i0, rows, cut)``, the ``rows`` stacked rows from ``i0`` that may see a
    key of it (with one query head, only the rows that do; 0 when none does), and ``cut =
    (banded, offset, causal, window, chunk, q_base, k_base, mapped)``: whether the band, the
    chunks or the mask's map hide some of its keys from them, the sequence's band
    (:mod:`.geometry`), its chunks (:func:`_chunk_rows`) and whether the map hides some of
    its keys (:func:`_hide`). ``var``: the call's variants (:func:`forward`)."""
    b, g, r0, r1 = at
    causal, window, offset = band[0], band[1], band[2][b]
    chunk, q_base, k_base, blocks = var[0], var[1][b], var[2][b], var[5]
    a, e = _rows_seeing(r0, r1, c0, c1, offset, causal, window)
    if chunk > 0:
        a, e = _chunk_rows(a, e, c0, c1, chunk, q_base, k_base)
    mapped = False
    if a < e and blocks.shape[0] > 0:
        state = _map_state(blocks, b, g, group, a, e, c0, c1)
        if state == EMPTY:
            a = e
        mapped = state == PARTIAL
    if a >= e:
        cut = (False, offset, causal, window, chunk, q_base, k_base, False)
        return b, g, r0, r1 - r0, c0, c1, 0, 0, cut
    if group > 1:
        a, e = r0, r1
    banded = _cut(a, e, c0, c1, offset, causal, window) or mapped
    if chunk > 0 and not banded:
        banded = _chunk_cuts(a, e, c0, c1, chunk, q_base, k_base)
    i0 = (a - r0) if group == 1 else 0
    rows = (e - a) if group == 1 else group * (r1 - r0)
    cut = (banded, offset, causal, window, chunk, q_base, k_base, mapped)
    return b, g, r0, r1 - r0, c0, c1, i0, rows, cut


@njit(boundscheck=False, nogil=True, inline="always")
def _row_band(tile, i):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Stacked row ``i``'s visible keys ``[lo, hi)`` of ``tile`` (:func:`_tile`; query row
    ``r0 + i % n``) by the band and the chunks, from the tile's first key."""
    _, _, r0, n, c0, c1, _, _, cut = tile
    banded, offset, causal, window, chunk, q_base, k_base, _ = cut
    if not banded:
        return 0, c1 - c0
    r = r0 + i % n
    lo, hi = _band(r, c0, c1, offset, causal, window)
    if chunk > 0:  # the keys of the row's chunk: positions [first, first + chunk)
        first = (r + q_base) // chunk * chunk - k_base - c0
        lo = min(max(lo, first), c1 - c0)
        hi = max(min(hi, first + chunk), lo)
    return lo, hi


@njit(boundscheck=False, nogil=True, inline="always")
def _chunk_rows(a, e, c0, c1, chunk, q_base, k_base):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The rows of ``[a, e)`` whose chunk holds some key of ``[c0, c1)``: row ``r`` is at
    position ``r + q_base``, key ``c`` at ``c + k_base`` (none when ``a >= e``)."""
    first = (c0 + k_base) // chunk * chunk - q_base
    last = ((c1 - 1 + k_base) // chunk + 1) * chunk - q_base
    return max(a, first), min(e, last)


@njit(boundscheck=False, nogil=True, inline="always")
def _chunk_keys(start, stop, r0, r1, chunk, q_base, k_base):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The keys of ``[start, stop)`` in the chunks of rows ``[r0, r1)``."""
    first = (r0 + q_base) // chunk * chunk - k_base
    last = ((r1 - 1 + q_base) // chunk + 1) * chunk - k_base
    return max(start, first), min(stop, last)


@njit(boundscheck=False, nogil=True, inline="always")
def _chunk_cuts(a, e, c0, c1, chunk, q_base, k_base):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether the chunks hide some key of ``[c0, c1)`` from some row of ``[a, e)``: not
    all of them in one chunk."""
    first = (a + q_base) // chunk
    return (
        (e - 1 + q_base) // chunk != first
        or (c0 + k_base) // chunk != first
        or (c1 - 1 + k_base) // chunk != first
    )


@njit(boundscheck=False, nogil=True)
def _map_state(blocks, b, g, group, a, e, c0, c1):  # type: ignore[no-untyped-def]  # pragma: no cover
    """What the mask's block map (:mod:`.block_mask`) says of rows ``[a, e)`` and keys
    ``[c0, c1)`` for the query heads of key/value head ``g``: ``EMPTY`` when every block is,
    ``FULL`` when every block is, else ``PARTIAL``."""
    bb = b if blocks.shape[0] > 1 else 0
    heads = group if blocks.shape[1] > 1 else 1
    empty = full = True
    for j in range(heads):
        h = g * group + j if blocks.shape[1] > 1 else 0
        for rb in range(a // BLOCK, (e - 1) // BLOCK + 1):
            for cb in range(c0 // BLOCK, (c1 - 1) // BLOCK + 1):
                kind = blocks[bb, h, rb, cb]
                empty = empty and kind == EMPTY
                full = full and kind == FULL
    return EMPTY if empty else (FULL if full else PARTIAL)


@njit(boundscheck=False, nogil=True)
def _map_keys(blocks, b, g, group, r0, r1, c0, c1, whole):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The keys ``[first, last)`` of ``[c0, c1)`` from the first to the last block of the
    map that is not ``EMPTY`` for some row of ``[r0, r1)`` (``first = c1`` when none is);
    without ``whole``, only ``first`` (``last`` is then that block's end)."""
    bb = b if blocks.shape[0] > 1 else 0
    heads = group if blocks.shape[1] > 1 else 1
    first, last = c1, c0
    for cb in range(c0 // BLOCK, (c1 - 1) // BLOCK + 1):
        seen = False
        for j in range(heads):
            h = g * group + j if blocks.shape[1] > 1 else 0
            for rb in range(r0 // BLOCK, (r1 - 1) // BLOCK + 1):
                seen = seen or blocks[bb, h, rb, cb] != EMPTY
        if seen:
            if first == c1:
                first = max(c0, cb * BLOCK)
            last = min(c1, (cb + 1) * BLOCK)
            if not whole:
                break
    return first, last


@njit(boundscheck=False, nogil=True)
def _next_tile(c0, stop, cols, at, group, var):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The next key tile ``[c0, c1)`` of the rows ``at = (b, g, r0, r1)`` from key ``c0``:
    at most ``cols`` keys, none across a chunk's edge, from the first to the last key of
    the mask's map blocks that some row sees (``c0 = c1 = stop``: none is left)."""
    b, g, r0, r1 = at
    chunk, blocks = var[0], var[5]
    if blocks.shape[0] > 0:
        c0, _ = _map_keys(blocks, b, g, group, r0, r1, c0, stop, False)
        if c0 >= stop:
            return stop, stop
    c1 = min(c0 + cols, stop)
    if chunk > 0:
        k_base = var[2][b]
        c1 = min(c1, ((c0 + k_base) // chunk + 1) * chunk - k_base)
    if blocks.shape[0] > 0:
        _, c1 = _map_keys(blocks, b, g, group, r0, r1, c0, c1, True)
    return c0, c1


@njit(boundscheck=False, nogil=True)
def _task_keys(at, group, band, var):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The keys ``[start, stop)`` that some row of ``at = (b, g, r0, r1)`` may see, by the
    band, the chunks and the mask's map (none when ``start >= stop``)."""
    b, g, r0, r1 = at
    causal, window, offsets, key_end = band[0], band[1], band[2], band[3]
    start, stop = _keys_seen(r0, r1, offsets[b], key_end[b], causal, window)
    if var[0] > 0 and start < stop:
        start, stop = _chunk_keys(start, stop, r0, r1, var[0], var[1][b], var[2][b])
    if var[5].shape[0] > 0 and start < stop:
        start, stop = _map_keys(var[5], b, g, group, r0, r1, start, stop, True)
    return start, stop


@njit(boundscheck=False, nogil=True)
def _hide(row, lo, hi, tile, i, group, var):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Stacked row ``i``'s keys ``[lo, hi)`` of ``tile`` (of key/value head ``g``'s
    ``group`` query heads) that the mask hides set to
    ``-inf``: its map's ``EMPTY`` blocks, and in a ``PARTIAL`` block the keys its mask
    there (evaluated once per call, :func:`.block_mask.classify`) hides."""
    b, g, r0, n, c0, _, _, _, _ = tile
    blocks, index, masks = var[5], var[6], var[7]
    r, h = r0 + i % n, g * group + i // n
    bb = b if blocks.shape[0] > 1 else 0
    hh = h if blocks.shape[1] > 1 else 0
    rb, minus_inf = r // BLOCK, row.dtype.type(-np.inf)
    k = lo
    while k < hi:
        cb = (c0 + k) // BLOCK
        end = min(hi, (cb + 1) * BLOCK - c0)
        kind = blocks[bb, hh, rb, cb]
        if kind == EMPTY:
            row[k:end] = minus_inf
        elif kind == PARTIAL:
            allowed, base = masks[index[bb, hh, rb, cb], r % BLOCK], c0 - cb * BLOCK
            for j in range(k, end):
                if not allowed[j + base]:
                    row[j] = minus_inf
        k = end


def plan(B, H_kv, L, rows, band, var, group):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The forward's tasks ``(b, g, r0, r1, start, stop, -1)``: every sequence, key/value
    head and tile of ``rows`` queries whose rows may see a key, with the keys they may see
    (``[start, stop)``, :func:`_task_keys`), longest first (ties in order). ``band =
    (causal, window, offsets, key_end, query_end)``: the causal mask, the window (``-1``:
    none) and each sequence's alignment offset, key length and query length; ``var`` the
    call's variants (:func:`forward`), ``group`` query heads per key/value head."""
    query_end = band[4]
    tiles = (L + rows - 1) // rows
    table = np.empty((B * H_kv * tiles, 7), np.int64)
    cost = np.empty(B * H_kv * tiles, np.int64)
    n = 0
    for b in range(B):
        for g in range(H_kv):
            for r0 in range(0, min(L, query_end[b]), rows):
                r1 = min(r0 + rows, query_end[b])
                start, stop = _task_keys((b, g, r0, r1), group, band, var)
                if start < stop:
                    table[n, 0], table[n, 1], table[n, 2], table[n, 3] = b, g, r0, r1
                    table[n, 4], table[n, 5], table[n, 6] = start, stop, -1
                    cost[n] = -(r1 - r0) * (stop - start)
                    n += 1
    order = np.argsort(cost[:n], kind="mergesort")
    return table[:n][order]


FAST = {"reassoc", "contract"}
"""The walks' fastmath flags (:mod:`.compiled`), which the parts of a walk keep."""


def forward(gemm, work, operands, outputs, band, var, sizes, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Attention for each task ``(b, g, r0, r1, start, stop, part)`` that this call takes
    from the work ``(tasks, counter, failed)`` (:func:`_take`; the call's workers share the
    counter): rows ``[r0, r1)`` of key/value head ``g``'s query heads in sequence ``b``,
    over keys ``[start, stop)``, written to ``out`` and ``lse`` (``lse`` of size 0: not
    wanted), or to ``part_out[part]`` and ``part_lse[part]`` when ``part >= 0``
    (``outputs = (out, lse, part_out, part_lse)``). ``operands = (q, keys, values)``: ``q
    (B, H, L, d_k)``, the keys and values each a pool of blocks (:mod:`._numba_pool`: a
    paged cache's, or a contiguous array seen as one block per sequence; float pools only).
    ``band`` as :func:`plan`'s; ``var = (chunk, q_base, k_base, slopes, cap, blocks, index,
    masks)`` the variants computed in the walk: the chunks (0: none; row ``r`` of sequence
    ``b`` at position ``r + q_base[b]``, key ``c`` at ``c + k_base[b]``), ALiBi's ``slopes
    (1 or B, H)`` (size 0: none), soft-capping's ``cap`` (0: none), and a ``mask_mod``'s
    block map ``blocks (1 or B, 1 or H, row blocks, key blocks)`` (size 0: none) with, for
    its ``PARTIAL`` blocks, ``masks[index[...]]`` (:func:`.block_mask.classify`); ``sizes =
    (scale, cols, flip_below, chunk)``; ``scratch =
    (s, flipped, stacked, acc, m, ref, total, partial, k_tile, v_tile)``. A tile of keys
    that spans blocks apart is copied into ``k_tile`` and ``v_tile`` (``(cols, d)``) for the
    GEMMs; a decoding step's few rows read the blocks where they lie, summing through
    ``partial`` (``(rows, d_v)``). A task whose band tiles hold a non-finite value (which
    ``0 * value`` would spread) is left undone and flagged in ``failed``, for the NumPy walk
    to do."""
    tasks, counter, failed = work
    while True:
        t = _take(counter)
        if t >= tasks.shape[0]:
            break
        if not _forward_task(gemm, tasks[t], operands, outputs, band, var, sizes, scratch):
            failed[t] = True


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _forward_task(gemm, task, operands, outputs, band, var, sizes, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """One task of :func:`forward`, from its first key tile to its rows' outputs; ``False``
    when a hidden key's value is not finite (0 * inf would be NaN): nothing is written."""
    q, keys, values = operands
    scale, cols, flip_below = sizes[0], sizes[1], sizes[2]
    _, _, stacked, acc, m, ref, total, _, _, _ = scratch
    at, start, stop = (task[0], task[1], task[2], task[3]), task[4], task[5]
    group = q.shape[1] // keys[0].shape[2]
    R = group * (task[3] - task[2])
    _stack_queries(q, at, group, scale, stacked)
    m[:R] = -np.inf
    ref[:R] = 0.0
    total[:R] = 0.0
    acc[:R] = 0.0
    flip = flip_below > R  # few rows: k @ q^T
    c0, c1 = _next_tile(start, stop, cols, at, group, var)
    while c0 < stop:
        tile = _tile(at, c0, c1, group, band, var)
        b, g, _, _, _, _, _, rows, cut = tile
        if rows > 0:
            if cut[0] and not stored(values) and not finite(values, b, g, c0, c1):
                return False  # a hidden key's value must be finite: 0 * inf would be NaN
            _tile_scores(gemm, tile, keys, flip, sizes, scratch)
            _tile_softmax(tile, group, var, scratch)
            if not _tile_values(gemm, tile, values, sizes, scratch) and cut[0]:
                return False  # (a stored pool's values, checked as they are read back)
        c0, c1 = _next_tile(c1, stop, cols, at, group, var)
    _write_rows(task, group, outputs, scratch)
    return True


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _stack_queries(q, at, group, scale, stacked):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The query rows ``at = (b, g, r0, r1)`` of key/value head ``g``'s ``group`` query
    heads, stacked (head by head) into ``stacked`` and scaled."""
    b, g, r0, r1 = at
    n, d_k = r1 - r0, q.shape[3]
    factor = stacked.dtype.type(scale)
    for j in range(group):
        for i in range(n):
            for d in range(d_k):
                stacked[j * n + i, d] = q[b, g * group + j, r0 + i, d] * factor


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _tile_scores(gemm, tile, keys, flip, sizes, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``s = stacked @ k_tile^T`` for ``tile``'s rows (:func:`_tile`): a decoding step's few
    rows read the blocks where they lie; else a GEMM, ``k @ q^T`` (then transposed into
    ``s``) when ``flip`` (few rows: it streams the keys)."""
    b, g, _, _, c0, c1, i0, rows, _ = tile
    s, flipped, stacked, _, _, _, _, _, k_tile, _ = scratch
    cols, d_k, w = sizes[1], stacked.shape[1], c1 - c0
    if rows <= FEW_ROWS and stored(keys) and in_place(flat(keys), True):
        stored_scores(flat(keys), b, g, c0, c1, stacked, i0, rows, s)
        return
    if rows <= FEW_ROWS and stored(keys):  # read back a few rows at a time, in L1
        c, pool, into = c0, flat(keys), address(k_tile, 0)
        while c < c1:
            end = min(c1, c + STAGE_ROWS)
            stage(pool, b, g, c, end, into, d_k, c1, False)
            few_scores((into, d_k, end - c, 0, 0), stacked, i0, rows, s, c - c0, False)
            c = end
        return
    if rows <= FEW_ROWS:  # a decoding step's: the blocks read where they lie
        c, at, end = c0, run_at(keys, b, g, c0), run_end(keys, b, c0, c1)
        while c < c1:
            following, ahead, after = _following(keys, b, g, c, end, c1)
            run = (at, key_ld(keys), end - c, following, ahead)
            few_scores(run, stacked, i0, rows, s, c - c0, True)
            c, at, end = end, following, after
        return
    if stored(keys):  # the tile read back whole, for the GEMM
        K = (address(k_tile, 0), d_k)
        stage(flat(keys), b, g, c0, c1, K[0], d_k, c1, False)
    else:
        K = tile_at(keys, b, g, c0, w, k_tile)
    Q = (stacked, i0 * d_k, d_k)
    if flip:
        _gemm(gemm, (NO_TRANS, TRANS, w, rows, d_k, 1.0, 0.0), K, Q, (flipped, 0, rows))
        for c in range(w):
            for i in range(rows):
                s[i, c] = flipped[c * rows + i]
    else:
        _gemm(gemm, (NO_TRANS, TRANS, rows, w, d_k, 1.0, 0.0), Q, K, (s, 0, cols))


@njit(boundscheck=False, nogil=True, inline="always")
def _following(pool, b, g, c, end, c1):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The run after ``[c, end)`` of sequence ``b``'s head ``g`` (before ``c1``): its
    address (0: none), how many of its rows to prefetch while the last as many of this one
    are read (no more than either has: a long run of blocks that follow each other in the
    pool asks for no rows past a short next one), and where it ends."""
    if end >= c1:
        return 0, 0, c1
    after = run_end(pool, b, end, c1)
    return run_at(pool, b, g, end), min(after - end, end - c), after


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _tile_softmax(tile, group, var, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The online softmax's step for ``tile``'s rows of ``s`` (of key/value head ``g``'s
    ``group`` query heads): each row's visible scores changed (:func:`.change_row`: the
    soft-capping and ALiBi of ``var``, :func:`forward`), the mask's hidden keys set to
    ``-inf`` (:func:`_hide`), then :func:`.row_softmax` (``s`` becomes ``exp(s - ref)``, 0
    outside each row's band), ``acc`` rescaled."""
    b, g, r0, n, c0, c1, i0, rows, cut = tile
    s, _, _, acc, m, ref, total, _, _, _ = scratch
    dtype, d_v, w = s.dtype.type, acc.shape[1], c1 - c0
    q_base, k_base, slopes, cap = cut[5], cut[6], var[3], var[4]
    biased, mapped = slopes.shape[1] > 0, cut[7]
    sb = b if slopes.shape[0] > 1 else 0
    for i in range(rows):
        row = i0 + i
        lo, hi = _row_band(tile, row)
        if biased or cap != 0.0:  # ALiBi's distance from key lo: lo + c0 - query position
            rate = dtype(slopes[sb, g * group + row // n]) if biased else dtype(0)
            at = lo + c0 + k_base - (r0 + row % n + q_base)
            change_row(s[i, lo:hi], rate, at, biased, cap)
        if mapped:
            _hide(s[i, :w], lo, hi, tile, row, group, var)
        new, new_ref, row_total, rescale = row_softmax(
            s[i, :w], lo, hi, m[row], ref[row], total[row], False
        )
        m[row], ref[row], total[row] = new, new_ref, row_total
        if rescale != 1.0:
            for d in range(d_v):
                acc[row, d] *= rescale


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _tile_values(gemm, tile, values, sizes, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``acc += s @ v_tile`` for ``tile``'s rows: a decoding step's few rows read each value
    once where it lies; else GEMMs, in runs of ``chunk`` keys (for few rows). Whether the
    values are all finite (a stored pool's, as read back; ``True`` for the others, which
    :func:`._numba_pool.finite` checks first where it matters)."""
    b, g, _, _, c0, c1, i0, rows, _ = tile
    s, _, _, acc, _, _, _, partial, _, v_tile = scratch
    cols, chunk, d_v, w = sizes[1], sizes[3], acc.shape[1], c1 - c0
    if rows <= FEW_ROWS:
        partial[:rows] = 0.0
        c, finite_ = c0, True
        if stored(values) and in_place(flat(values), False):
            return stored_sums(flat(values), b, g, c0, c1, s, acc, i0, rows, partial)
        if stored(values):  # read back a few rows at a time, in L1
            pool, into = flat(values), address(v_tile, 0)
            while c < c1:
                end = min(c1, c + STAGE_ROWS)
                finite_ &= stage(pool, b, g, c, end, into, d_v, c1, True)
                run = (into, d_v, end - c, 0, 0)
                few_accumulate(run, s, c - c0, w, acc, i0, rows, partial)
                c = end
            return finite_
        at, end = run_at(values, b, g, c0), run_end(values, b, c0, c1)
        while c < c1:
            following, ahead, after = _following(values, b, g, c, end, c1)
            run = (at, key_ld(values), end - c, following, ahead)
            few_accumulate(run, s, c - c0, w, acc, i0, rows, partial)
            c, at, end = end, following, after
        return True
    finite_ = True
    if stored(values):  # the tile read back whole, for the GEMMs
        at, ld, size = address(v_tile, 0), d_v, v_tile.itemsize
        finite_ = stage(flat(values), b, g, c0, c1, at, d_v, c1, True)
    else:
        (at, ld), size = tile_at(values, b, g, c0, w, v_tile), values[0].itemsize
    for c in range(0, w, chunk):
        V = (at + c * ld * size, ld)
        op = (NO_TRANS, NO_TRANS, rows, d_v, min(chunk, w - c), 1.0, 1.0)
        _gemm(gemm, op, (s, c, cols), V, (acc, i0 * d_v, d_v))
    return finite_


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _write_rows(task, group, outputs, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """A task's rows divided by their sums, with their log-sum-exp, into ``outputs``."""
    b, g, r0, r1, part = task[0], task[1], task[2], task[3], task[6]
    out, lse, part_out, part_lse = outputs
    _, _, _, acc, _, ref, total, _, _, _ = scratch
    dtype, d_v, n = acc.dtype.type, acc.shape[1], r1 - r0
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


def backward(gemm, work, operands, grads, band, var, sizes, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The gradients of each task ``(b, g)`` this call takes from the work ``(tasks,
    counter, failed)`` (as :func:`forward`'s): key/value head ``g`` of sequence ``b`` and its
    query heads, by tiles of ``rows`` queries (per query head) and ``cols`` keys. ``operands
    = (q, k, v, out, lse, grad_out)``, shaped as :func:`forward`'s (``k`` and ``v`` arrays
    ``(B, H_kv, S, d)``), ``lse (B, H, L)`` the forward's; ``grads = (dq, dk, dv)``: ``dk``
    and ``dv`` arrive zeroed and are accumulated; ``dq`` is written (it may be
    ``grad_out``: each tile of rows is read before it is written). ``band`` as
    :func:`plan`'s, ``var`` as :func:`forward`'s; ``sizes = (scale, dq_scale, rows, cols)``;
    ``scratch = (stacked, do, D, row_lse, dq_t, p, ds, slope)``, ``slope`` soft-capping's
    derivative of each score (``(0, 0)`` without it). A task whose keys or values hold a
    non-finite value where some row cannot see it (``0 * inf`` would spread) is left
    undone and flagged in ``failed``."""
    tasks, counter, failed = work
    while True:
        t = _take(counter)
        if t >= tasks.shape[0]:
            break
        if not _backward_task(gemm, tasks[t], operands, grads, band, var, sizes, scratch):
            failed[t] = True


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _backward_task(gemm, task, operands, grads, band, var, sizes, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """One task of :func:`backward`, tile of rows by tile of rows; ``False`` when a key or
    value that some row cannot see is not finite: nothing is written."""
    q, k, v = operands[0], operands[1], operands[2]
    dq = grads[0]
    causal, window, key_end, query_end = band[0], band[1], band[3], band[4]
    b, g, rows = task[0], task[1], sizes[2]
    group = q.shape[1] // k.shape[1]
    keys, queries = key_end[b], query_end[b]
    if causal or window >= 0 or var[0] > 0 or var[5].shape[0] > 0:  # some keys hidden
        first, last = keys, 0  # the keys some tile of rows reads
        for r0 in range(0, queries, rows):
            start, stop = _task_keys((b, g, r0, min(r0 + rows, queries)), group, band, var)
            if start < stop:
                first, last = min(first, start), max(last, stop)
        bad = False
        for c in range(first, last):  # (a loop without an exit, which the compiler vectorises)
            for d in range(k.shape[3]):
                if not np.isfinite(k[b, g, c, d]):
                    bad = True
            for d in range(v.shape[3]):
                if not np.isfinite(v[b, g, c, d]):
                    bad = True
        if bad:
            return False
    for j in range(group):  # padded rows: no gradient
        for r in range(queries, q.shape[2]):
            dq[b, g * group + j, r, :] = 0.0
    for r0 in range(0, queries, rows):
        at = (b, g, r0, min(r0 + rows, queries))
        _backward_rows(gemm, at, operands, grads, band, var, sizes, scratch)
    return True


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _backward_rows(gemm, at, operands, grads, band, var, sizes, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The rows ``at = (b, g, r0, r1)`` of :func:`backward`: their stacked operands, each
    key tile they may see, and their ``dq``."""
    q, k = operands[0], operands[1]
    dq = grads[0]
    dq_scale, cols = sizes[1], sizes[3]
    dq_t = scratch[4]
    b, g, r0, r1 = at
    group, n, d_k = q.shape[1] // k.shape[1], r1 - r0, q.shape[3]
    start, stop = _task_keys(at, group, band, var)
    _stack_rows(at, operands, sizes[0], scratch)
    dq_t[: group * n] = 0.0
    c0, c1 = _next_tile(start, stop, cols, at, group, var)
    while c0 < stop:
        tile = _tile(at, c0, c1, group, band, var)
        if tile[7] > 0:  # rows that see a key of it
            _backward_tile(gemm, tile, operands, grads, group, var, scratch)
        c0, c1 = _next_tile(c1, stop, cols, at, group, var)
    factor = dq_t.dtype.type(dq_scale)
    for j in range(group):
        for i in range(n):
            for d in range(d_k):
                dq[b, g * group + j, r0 + i, d] = dq_t[j * n + i, d] * factor


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _stack_rows(at, operands, scale, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The rows ``at = (b, g, r0, r1)`` of each query head of key/value head ``g``, stacked:
    ``q * scale``, ``dO``, the forward's ``lse`` and ``D = rowsum(dO * O)``."""
    q, _, _, out, lse, grad_out = operands
    stacked, do, D, row_lse = scratch[0], scratch[1], scratch[2], scratch[3]
    b, g, r0, r1 = at
    dtype, n, d_k, d_v = stacked.dtype.type, r1 - r0, q.shape[3], out.shape[3]
    group = q.shape[1] // operands[1].shape[1]
    factor = dtype(scale)
    for j in range(group):
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


@njit(fastmath=FAST, boundscheck=False, nogil=True, inline="always")
def _backward_tile(gemm, tile, operands, grads, group, var, scratch):  # type: ignore[no-untyped-def]  # pragma: no cover
    """One key tile's share of the gradients (:func:`_tile`'s rows and keys): five GEMMs,
    the weights and the scores' gradients between them."""
    b, g, _, _, c0, c1, i0, m, _ = tile
    _, k, v, _, _, _ = operands
    _, dk, dv = grads
    stacked, do, D, row_lse, dq_t, p, ds, slope = scratch
    cols, d_k, d_v, w = p.shape[1], stacked.shape[1], do.shape[1], c1 - c0
    Q, dO = (stacked, i0 * d_k, d_k), (do, i0 * d_v, d_v)
    K, V = (k, _at(k, b, g, c0), _rows(k)), (v, _at(v, b, g, c0), _rows(v))
    P, dS = (p, 0, cols), (ds, 0, cols)
    _gemm(gemm, (NO_TRANS, TRANS, m, w, d_k, 1.0, 0.0), Q, K, P)  # s = q k^T
    _weights(p, tile, row_lse, group, var, slope)
    dV = (dv, _at(dv, b, g, c0), _rows(dv))
    _gemm(gemm, (TRANS, NO_TRANS, w, d_v, m, 1.0, 1.0), P, dO, dV)  # dv += p^T dO
    _gemm(gemm, (NO_TRANS, TRANS, m, w, d_v, 1.0, 0.0), dO, V, dS)  # dp = dO v^T
    _score_gradients(ds, p, tile, D, row_lse, var[4] != 0.0, slope)
    _gemm(gemm, (NO_TRANS, NO_TRANS, m, d_k, w, 1.0, 1.0), dS, K, (dq_t, i0 * d_k, d_k))
    dK = (dk, _at(dk, b, g, c0), _rows(dk))
    _gemm(gemm, (TRANS, NO_TRANS, w, d_k, m, 1.0, 1.0), dS, Q, dK)  # dk += ds^T q


@njit(fastmath=FAST, boundscheck=False, nogil=True)
def _weights(p, tile, row_lse, group, var, slope):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``tile``'s rows of ``p`` (stacked rows ``i0 + i``), holding ``s - 0``, become
    ``exp(s' - lse)``, the forward's weights, ``s'`` the scores changed as the forward
    changes them (soft-capping, whose derivative goes to ``slope``, then ALiBi; ``var`` as
    :func:`forward`'s): 0 outside each row's band, where the mask hides a key, and for a
    row that sees no key (``lse = -inf``). Each pair on its own: the band's slice is swept
    (a loop from 0 over a slice vectorises), the rest set to 0."""
    b, g, r0, n, c0, c1, i0, m, cut = tile
    q_base, k_base, slopes, cap = cut[5], cut[6], var[3], var[4]
    biased, mapped = slopes.shape[1] > 0, cut[7]
    sb = b if slopes.shape[0] > 1 else 0
    dtype = p.dtype.type
    for i in range(m):
        lo, hi = _row_band(tile, i0 + i)
        shift = row_lse[i0 + i]
        if shift == -np.inf:
            lo = hi = 0
        row = p[i, : c1 - c0]
        row[:lo] = 0.0
        row[hi:] = 0.0
        visible = row[lo:hi]
        if cap != 0.0:
            cap_, inverse = dtype(cap), dtype(1.0 / cap)
            derivative = slope[i, lo:hi]
            for c in range(visible.shape[0]):
                t = tanh(visible[c] * inverse)
                derivative[c] = 1.0 - t * t
                visible[c] = cap_ * t
        if biased:
            rate = dtype(slopes[sb, g * group + (i0 + i) // n])
            at = lo + c0 + k_base - (r0 + (i0 + i) % n + q_base)
            for c in range(visible.shape[0]):
                visible[c] += rate * dtype(c + at)
        if mapped:
            _hide(row, lo, hi, tile, i0 + i, group, var)
        for c in range(visible.shape[0]):
            visible[c] = exp(visible[c] - shift)


@njit(fastmath=FAST, boundscheck=False, nogil=True)
def _score_gradients(ds, p, tile, D, row_lse, capped, slope):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``tile``'s rows of ``ds``, holding ``dp``, become ``p * (dp - D)``, times
    soft-capping's derivative ``slope`` when ``capped``: 0 outside each row's band (where
    ``dp`` may be NaN from a hidden value) and for a row that sees no key (``lse = -inf``,
    whose ``slope`` :func:`_weights` left unwritten)."""
    _, _, _, _, c0, c1, i0, m, _ = tile
    for i in range(m):
        lo, hi = _row_band(tile, i0 + i)
        if row_lse[i0 + i] == -np.inf:
            lo = hi = 0
        centre = D[i0 + i]
        row = ds[i, : c1 - c0]
        row[:lo] = 0.0
        row[hi:] = 0.0
        visible, weights = row[lo:hi], p[i, lo:hi]
        if capped:
            derivative = slope[i, lo:hi]
            for c in range(visible.shape[0]):
                visible[c] = weights[c] * (visible[c] - centre) * derivative[c]
        else:
            for c in range(visible.shape[0]):
                visible[c] = weights[c] * (visible[c] - centre)


__all__ = ["backward", "exp", "forward"]
