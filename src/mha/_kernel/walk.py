"""The compiled walks' Python side: which calls they take, the arrays as the compiled code
takes them, the plan of work items and the thread team. The walks themselves are numba code
(:mod:`._numba_walk`, run through :mod:`.compiled`); whatever they cannot do goes to the
Python walk (:mod:`.forward`, :mod:`.backward`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from . import compiled, tasks
from .contract import Visibility
from .dropout import Dropout
from .paged import PagedKV
from .scores import Scores
from .tasks import Parts, Task, batch_index
from .team import Team

__all__ = ["BACKWARD_ROWS", "WALK_ROWS", "ForwardPlan", "backward_walkable", "forward_walkable",
           "run_backward", "run_forward", "walk_views"]  # fmt: skip

WALK_ROWS = 256
"""Query rows (per query head) of a compiled walk's work item, at most. Its tile of scores,
256 x 512 (512 KiB in float32), stays close to a core's L2 cache between the two GEMMs and
the softmax step, and BLAS packs each key tile for twice the rows it did at 128: S2 and S4
ran 5-7% faster in float32 (1.20 -> 1.14 and 1.12 -> 1.05 of torch's SDPA, interleaved,
on the README's machine; float64 3-8%), as torch's own kernel tiles them (256 query rows
for long sequences)."""


def forward_walkable(
    q: np.ndarray,
    k: np.ndarray | PagedKV,
    v: np.ndarray | PagedKV,
    out: np.ndarray,
    lse: np.ndarray | None,
    visibility: Visibility,
    weights: np.ndarray | None,
    dropout: Dropout | None,
    scores: Scores | None,
) -> list[np.ndarray] | None:
    """The arrays as the compiled walk takes them (:func:`walk_views`; a paged cache's
    pools as they are) when it computes this call, else ``None``: what hides keys is a band
    (causal, the window, the lengths), the scores are plain ones, in float32 or float64
    throughout, and every array is one the compiled code can take as it is."""
    outputs = (out,) if lse is None else (out, lse[..., None])
    paged = isinstance(k, PagedKV) and isinstance(v, PagedKV)
    if isinstance(k, PagedKV) != isinstance(v, PagedKV):
        return None
    keys = k.pool if isinstance(k, PagedKV) else k
    values = v.pool if isinstance(v, PagedKV) else v
    if (
        weights is not None
        or not _band_and_plain_scores(visibility, dropout, scores, (q, keys, values, *outputs))
        or not compiled.walk_available()
    ):
        return None
    if not paged:
        return walk_views((q, keys, values), outputs, operands=(q, keys, values))
    if not all(map(_pool_rows, (keys, values))):
        return None
    views = walk_views((q,), outputs, operands=(q,))
    return None if views is None else [views[0], keys, values, *views[1:]]


def _band_and_plain_scores(
    visibility: Visibility,
    dropout: Dropout | None,
    scores: Scores | None,
    arrays: tuple[np.ndarray, ...],
) -> bool:
    """What both walks need of a call: no dropout, plain scores (sinks aside), keys hidden
    by a band alone, and ``arrays`` all of one dtype, float32 or float64, none empty."""
    dtype = arrays[0].dtype
    return (
        dropout is None
        and (scores is None or not scores.changes_scores)
        and dtype in (np.float32, np.float64)
        and all(x.dtype == dtype for x in arrays)
        and visibility.mask is None
        and visibility.bias is None
        and visibility.mask_mod is None
        and visibility.chunk is None
        and visibility.sink_tokens == 0
        and visibility.held_sinks == 0
        and min(x.size for x in arrays) > 0
    )


def walk_views(
    inputs: tuple[np.ndarray, ...],
    outputs: tuple[np.ndarray, ...],
    operands: tuple[np.ndarray, ...],
) -> list[np.ndarray] | None:
    """``inputs`` and ``outputs`` ``(*batch, a, b, c)`` as views ``(B, a, b, c)`` with one
    batch axis, for the compiled walks; ``None`` when one cannot be taken as it is: not
    aligned, an output not writeable, a stride not a whole number of elements, batch axes
    that do not merge without a copy, or a GEMM operand (of ``operands``) whose matrices'
    rows BLAS cannot read (:func:`_blas_rows`)."""
    views = []
    for x in (*inputs, *outputs):
        size = x.itemsize
        if not x.flags.aligned or not all(stride % size == 0 for stride in x.strides):
            return None
        view = _merged_batch(x)
        if view is None:
            return None
        views.append(view)
    if not all(x.flags.writeable for x in outputs) or not all(map(_blas_rows, operands)):
        return None
    return views


def _pool_rows(pool: np.ndarray) -> bool:
    """Whether a pool ``(blocks, block, H_kv, d)``'s rows are ones BLAS can read: aligned,
    each row contiguous, a block's rows in order and apart."""
    size = pool.itemsize
    return (
        pool.flags.aligned
        and all(stride % size == 0 for stride in pool.strides)
        and pool.strides[3] == size
        and (pool.shape[1] == 1 or pool.strides[1] >= pool.shape[3] * size)
    )


def _blas_rows(x: np.ndarray) -> bool:
    """Whether the matrices of ``x (..., n, d)`` are rows BLAS can read and write: each row
    contiguous, rows in order (not broadcast, not reversed, not overlapping)."""
    return x.strides[-1] == x.itemsize and (
        x.shape[-2] == 1 or x.strides[-2] >= x.shape[-1] * x.itemsize
    )


PACK_FROM_TILES = 4
"""Tiles of query rows from which keys and values whose rows lie apart are copied first."""

PACK_MOST = 16 * 2**20
"""The largest keys (and values) copied so: beyond, the copies' memory would outgrow the
64 MiB the kernel promises to stay within beside the call's inputs and outputs."""


def _packed(x: np.ndarray, L: int, rows: int) -> np.ndarray:
    """Keys or values ``x (B, H, S, d)`` with each head's rows adjacent: a copy when they lie
    apart (as a fused projection leaves them, between the queries') and ``L`` queries in
    tiles of ``rows`` read them at least ``PACK_FROM_TILES`` times. Rows thousands of bytes
    apart cost BLAS's packing more than one copy does (measured on S4: 15% of the attention's
    time); read once or twice (S3), the copy costs more than it saves. At most
    ``PACK_MOST`` bytes are copied."""
    if x.shape[-2] == 1 or x.strides[-2] == x.shape[-1] * x.itemsize or x.nbytes > PACK_MOST:
        return x
    return np.ascontiguousarray(x) if -(-L // rows) >= PACK_FROM_TILES else x


def _merged_batch(array: np.ndarray) -> np.ndarray | None:
    """``array (*batch, a, b, c)`` as a view ``(B, a, b, c)`` (the last three axes as they
    are: a transposed view stays one), or ``None`` when the batch axes do not merge without
    a copy."""
    if array.ndim == 4:
        return array
    if array.ndim == 3:
        return array[None]
    sized = [(n, stride) for n, stride in zip(array.shape[:-3], array.strides[:-3], strict=True)
             if n != 1]  # fmt: skip
    if any(s0 != s1 * n1 for (_, s0), (n1, s1) in itertools.pairwise(sized)):
        return None
    shape = (math.prod(array.shape[:-3]), *array.shape[-3:])
    strides = (sized[-1][1] if sized else 0, *array.strides[-3:])
    merged: np.ndarray = np.lib.stride_tricks.as_strided(
        array, shape, strides, writeable=array.flags.writeable
    )
    return merged


def _limits(
    visibility: Visibility, batch_shape: tuple[int, ...], L: int, S: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sequence's key length, query length and alignment offset, as int64 ``(B,)``, for
    ``L`` queries and ``S`` keys."""
    B = math.prod(batch_shape)

    def per_sequence(values: np.ndarray | None, default: int) -> np.ndarray:
        if values is None:
            return np.full(B, default, np.int64)
        return np.broadcast_to(values, batch_shape).reshape(B).astype(np.int64)

    return (
        per_sequence(visibility.key_lengths, S),
        per_sequence(visibility.query_lengths, L),
        per_sequence(visibility.offsets, visibility.causal_offset),
    )


def run_forward(
    q: np.ndarray,
    k: np.ndarray | PagedKV,
    v: np.ndarray | PagedKV,
    visibility: Visibility,
    scale: float,
    out: np.ndarray,
    lse: np.ndarray | None,
    views: list[np.ndarray],
    tiles: Any,
    group: int,
    team: Team,
    flip_below: int,
    product_chunk: int,
) -> tuple[list[Task], Parts | None]:
    """Run the call's work items as compiled code, one call of it per worker, on ``views``
    (:func:`forward_walkable`'s); returns the items it left to the NumPy walk and the split
    keys' partial results, if any. Tiles of fewer than ``flip_below`` rows take ``k @
    q^T``, and ``p @ v`` in runs of ``product_chunk`` keys (the Python walk's choices,
    :mod:`.forward`)."""
    plan = ForwardPlan(q.shape, k, v.shape[-1], visibility, scale, out.dtype, tiles, group,
                       team.workers, flip_below, product_chunk)  # fmt: skip
    failed, parts = plan.run(views, k, team)
    left: list[Task] = []
    for t in plan.table[failed] if failed.any() else ():
        batch = batch_index(t[0], plan.batch_shape)
        kv = slice(int(t[1]), int(t[1]) + 1)
        item = visibility.item(batch, slice(kv.start * group, kv.stop * group))
        part = None if t[6] < 0 else int(t[6])
        left.append(Task(batch, kv, item, int(t[2]), int(t[3]), int(t[4]), int(t[5]), part))
    return left, parts


class ForwardPlan:
    """What the compiled forward walk does for a call, worked out from the shapes and the
    visibility alone: its table of tasks, longest first, and, when there are fewer than
    ``workers``, the split of their keys. It holds no array of the call's, so a call of the
    same shapes, dtype and options runs the same plan again (:mod:`mha.api.plans` keeps
    them); :meth:`run` takes the arrays."""

    def __init__(
        self,
        q_shape: tuple[int, ...],
        k: np.ndarray | PagedKV,
        d_v: int,
        visibility: Visibility,
        scale: float,
        dtype: np.dtype,
        tiles: Any,
        group: int,
        workers: int,
        flip_below: int,
        product_chunk: int,
    ) -> None:
        L, d_k = q_shape[-2:]
        H_kv, S = k.shape[-3], k.shape[-2]
        self.batch_shape = batch_shape = q_shape[:-3]
        B = math.prod(batch_shape)
        key_end, query_end, self.offsets = _limits(visibility, batch_shape, L, S)
        self.rows = rows = max(1, min(tiles.rows, WALK_ROWS))
        self.L, self.d_k, self.d_v, self.dtype, self.scale = L, d_k, d_v, dtype, scale
        self.R, self.cols, self.paged = group * rows, tiles.cols, isinstance(k, PagedKV)
        self.flip_below, self.product_chunk = flip_below, product_chunk
        self.causal = visibility.causal
        self.window = -1 if visibility.window is None else visibility.window
        self.blocks = np.arange(B, dtype=np.int64)[:, None]  # contiguous: a block each
        self.block = max(S, 1)
        table = compiled.plan_walk(B, H_kv, L, rows, key_end, query_end, self.offsets,
                                   self.causal, self.window)  # fmt: skip
        self.split: tuple[list[Task], list[list[Task]]] | None = None
        self.group = group
        if 0 < len(table) < workers:  # few items (decoding): split their keys
            whole = [Task(batch_index(t[0], batch_shape), slice(int(t[1]), int(t[1]) + 1),
                           None, int(t[2]), int(t[3]), int(t[4]), int(t[5]))  # type: ignore[arg-type]
                     for t in table]  # fmt: skip
            parts = tasks.split_keys(whole, workers, tiles.cols, group, L, d_v, dtype)
            if parts is not None:
                self.split = parts.whole, parts.chunks
                flat = {id(task): row for task, row in zip(whole, table[:, 0], strict=True)}
                table = np.array([
                    [flat[id(task)], p.kv.start, p.r0, p.r1, p.start, p.stop, p.part]
                    for task, pieces in zip(parts.whole, parts.chunks, strict=True)
                    for p in pieces
                ], np.int64).reshape(-1, 7)  # fmt: skip
            table = table[np.argsort((table[:, 2] - table[:, 3]) * (table[:, 5] - table[:, 4]),
                                     kind="stable")]  # longest first  # fmt: skip
        self.table = table

    def run(
        self, views: list[np.ndarray], k: np.ndarray | PagedKV, team: Team
    ) -> tuple[np.ndarray, Parts | None]:
        """Run the tasks on ``views`` (:func:`forward_walkable`'s, of a call of the plan's
        shapes; ``k`` the call's keys, for a paged cache's block table) on ``team``: which
        tasks were left undone (a non-finite value at a hidden key), and the split keys'
        partial results, to merge."""
        dtype, R, cols, d_k, d_v = self.dtype, self.R, self.cols, self.d_k, self.d_v
        q4, out4 = views[0], views[3]
        lse4 = views[4][..., 0] if len(views) > 4 else np.empty((1, 1, 0), dtype)
        if isinstance(k, PagedKV):  # the pools and the block tables as they are
            kp, vp, blocks, block = views[1], views[2], k.table, k.block_size
        else:  # one block per sequence: (B, S, H_kv, d) views of the arrays
            k4, v4 = _packed(views[1], self.L, self.rows), _packed(views[2], self.L, self.rows)
            kp, vp = k4.transpose(0, 2, 1, 3), v4.transpose(0, 2, 1, 3)
            blocks, block = self.blocks, self.block
        parts = None
        if self.split is not None:
            parts = Parts(*self.split, self.group, self.L, d_v, dtype)
        part_out = parts.all_out if parts is not None else np.empty((0, 1, 1, 1), dtype)
        part_lse = parts.all_lse if parts is not None else np.empty((0, 1, 1), dtype)
        table, failed = self.table, np.zeros(len(self.table), bool)  # per run, not per plan:
        counter = np.zeros(1, np.int64)  # concurrent calls of one plan each have their own
        scale, causal, window, offsets = self.scale, self.causal, self.window, self.offsets
        flip_below, product_chunk, spans = self.flip_below, self.product_chunk, self.paged

        def make_walk() -> Callable[[], None]:
            s = np.empty((R, cols), dtype)
            flipped = np.empty(cols * min(R, flip_below), dtype)  # few rows' tiles
            stacked, acc = np.empty((R, d_k), dtype), np.empty((R, d_v), dtype)
            m, ref, total = np.empty(R, dtype), np.empty(R, dtype), np.empty(R, dtype)
            width = cols if spans else 0  # tiles copied from blocks apart
            k_tile, v_tile = np.empty((width, d_k), dtype), np.empty((width, d_v), dtype)
            partial = np.empty((R, d_v), dtype)  # a decoding step's sums

            def walk() -> None:
                compiled.forward_walk(
                    dtype, table, counter, q4, kp, vp, blocks, block, out4, lse4, part_out,
                    part_lse, scale, causal, window, offsets, cols, flip_below, product_chunk,
                    s, flipped, stacked, acc, m, ref, total, partial, k_tile, v_tile, failed,
                )  # fmt: skip

            return walk

        _walk_once_per_worker(team, len(table), counter, make_walk)
        return failed, parts


BACKWARD_ROWS = 512
"""Query rows (per query head) of a tile of the compiled backward walk, at most (the
backward benchmark's figures are at this size)."""


def _walk_once_per_worker(
    team: Team, tasks: int, counter: np.ndarray, make_walk: Callable[[], Callable[[], None]]
) -> None:
    """Run a compiled walk once on each of ``team``'s workers (``make_walk()`` makes a
    worker's, with its buffers); each takes tasks from ``counter`` until none are left
    (longest first), so a worker that starts late, or runs slower, takes fewer, and none
    waits on Python's lock between tasks. A worker that finds them all taken runs no walk.
    (Runs of tasks dealt out in advance, two per worker in the forward and four in the
    backward, lost up to a whole run's time whenever one core ran slow, and a helper woken
    late found the caller busy on a run it could have shared.)"""

    def make_worker() -> Callable[[int], None]:
        walk = make_walk()

        def run(_: int) -> None:
            if counter[0] < tasks:  # else the other workers took every task
                walk()

        return run

    team.run(list(range(max(1, min(team.workers, tasks)))), make_worker)


def backward_walkable(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    visibility: Visibility,
    dbias: np.ndarray | None,
    dropout: Dropout | None,
    scores: Scores | None,
) -> bool:
    """Whether the compiled walk computes these gradients (as the forward's
    :func:`forward_walkable`: a band hides keys, plain scores, one dtype)."""
    arrays = (q, k, v, out, lse, grad_out, dq, dk, dv)
    inputs = (q, k, v, out, lse[..., None], grad_out)
    return (
        dbias is None
        and _band_and_plain_scores(visibility, dropout, scores, arrays)
        and walk_views(inputs, (dq, dk, dv), operands=(q, k, v, dk, dv)) is not None
        and compiled.walk_available()
    )


def run_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    visibility: Visibility,
    scale: float,
    dq_factor: float,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    tiles: Any,
    group: int,
    team: Team,
) -> list[tuple[tuple[int, ...], slice]]:
    """The gradients as compiled code, one task per ``(sequence, key/value head)``; returns
    the items it left to the NumPy walk."""
    L, d_k = q.shape[-2:]
    H_kv, S, d_v = k.shape[-3], k.shape[-2], v.shape[-1]
    batch_shape = q.shape[:-3]
    B = math.prod(batch_shape)
    views = walk_views((q, k, v, out, lse[..., None], grad_out), (dq, dk, dv),
                       operands=(q, k, v, dk, dv))  # fmt: skip
    assert views is not None  # checked by backward_walkable
    q4, k4, v4, out4, lse4, do4, dq4, dk4, dv4 = views
    key_end, query_end, offsets = _limits(visibility, batch_shape, L, S)
    window = -1 if visibility.window is None else visibility.window
    rows = max(1, min(tiles.rows, BACKWARD_ROWS))
    k4, v4 = _packed(k4, L, rows), _packed(v4, L, rows)
    table = np.stack(np.meshgrid(np.arange(B), np.arange(H_kv), indexing="ij"), -1).reshape(-1, 2)
    pairs = query_end[table[:, 0]] * key_end[table[:, 0]]  # about each task's work
    table = table[np.argsort(-pairs, kind="stable")]  # longest first, as the forward's
    # Per run, never on a plan: concurrent calls each have their own.
    failed, counter = np.zeros(len(table), bool), np.zeros(1, np.int64)
    R, cols, dtype = group * rows, tiles.cols, dq.dtype

    def make_walk() -> Callable[[], None]:
        stacked, dq_t, do = (np.empty((R, d), dtype) for d in (d_k, d_k, d_v))
        D, row_lse = np.empty(R, dtype), np.empty(R, dtype)
        p, ds = np.empty((R, cols), dtype), np.empty((R, cols), dtype)

        def walk() -> None:
            compiled.backward_walk(
                dtype, table, counter, q4, k4, v4, out4, lse4[..., 0], do4, dq4, dk4, dv4,
                scale, scale * dq_factor, visibility.causal, window, offsets, key_end,
                query_end, rows, cols, stacked, do, D, row_lse, dq_t, p, ds, failed,
            )  # fmt: skip

        return walk

    _walk_once_per_worker(team, len(table), counter, make_walk)
    return [(batch_index(b, batch_shape), slice(int(g), int(g) + 1)) for b, g in table[failed]]
