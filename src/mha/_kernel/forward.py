"""The attention kernel: FlashAttention-2's forward pass, written for NumPy.

Every public entry point ends here, so every path computes the same function. The work is
cut into independent items, one per ``(*batch, head)`` index and tile of query rows. Each
item walks the key tiles its rows can see, keeping per row a running maximum ``m``, a
running sum ``l`` and an unnormalised accumulator ``acc``::

    s     = (q * scale) @ k_tile.T + bias_tile        hidden pairs overwritten with -inf
    m_new = max(m, rowmax(s));  ref = m_new, or 0 where m_new is -inf (no visible key yet)
    e     = exp(s - ref)                              computed in place in s
    l     = l * exp(ref_old - ref) + rowsum(e)
    acc   = acc * exp(ref_old - ref) + e @ v_tile

and divides once at the end: ``out = acc / l``. With a single key tile this is the plain
stable softmax, so tile sizes change results only by rounding. Rows that see no key keep
``l = 0`` and get a zero output, never NaN. The full score matrix exists only when weights
are asked for; otherwise memory beyond the inputs and outputs is a fixed scratch per worker.

With numba installed (the ``fast`` extra, :mod:`.compiled`), a call whose hidden keys are a
band (causal, window, lengths, a cache) runs its work items as compiled code, each walking
its key tiles with NumPy's own BLAS for the GEMMs and compiled loops for the rest, work items
of ``walk.WALK_ROWS`` query rows whose tile of scores stays in L2; every other call walks its
tiles here in Python (:class:`_QueryTile`), the softmax lines (maximum, ``exp``, sum,
rescaling) one compiled sweep per row for large calls, NumPy passes otherwise and without
numba. Each walk declares what it supports and :func:`.walk.choose` picks one by what the
call sets. All give the same function up to rounding and are tested against each other and
PyTorch.

Masks are cut per tile: causal skips every tile above the diagonal and masks only tiles that
cross it, a sliding window skips every tile below its band (both walks with the band of
:mod:`.geometry`); ``key_lengths`` and ``query_lengths`` bound the loops; boolean masks and
bias are sliced. Items run on a thread
pool (NumPy releases the GIL in BLAS calls and ufuncs), with BLAS limited to one thread
inside the workers when threadpoolctl is installed.

Grouped-query attention: with ``H`` query heads and ``H_kv`` key/value heads, the
``H / H_kv`` query heads of one group are stacked into one tile of rows that shares the
group's key and value tiles, so the repeated keys are never built. When a call has fewer
work items than workers (decoding one token against a long cache), each item's keys are
split into chunks that run on different workers, and the partial results are combined with
the log-sum-exp merge (flash-decoding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import compiled, runtime, tasks, walk, walk_inputs
from .call import DEFAULT_MAX_MEMORY, KernelCall, Outputs
from .paged import PagedKV
from .scores import add_sinks
from .tasks import Parts, Task, merge_partials
from .team import Team

__all__ = [
    "BAND_FEATURES",
    "DEFAULT_MAX_MEMORY",
    "Tiles",
    "attend",
    "attend_band",
    "attend_step",
    "call_tiles",
    "merge_partials",
    "plan_tiles",
]

# The sizes the tiles turn on (keys per tile, the rows under which a tile is wide, the keys
# per BLAS call of a few rows' product, the scores from which the compiled softmax step
# pays) are runtime.DEFAULT.thresholds: key_tile, wide_key_tile, wide_below_rows,
# product_chunk, compiled_above (each explained where it is used below).


@dataclass(frozen=True)
class Tiles:
    rows: int  # queries per tile, per query head
    cols: int  # keys per tile
    heads: int  # key/value heads per work item (more than one only when all rows fit)


def plan_tiles(
    L: int,
    S: int,
    H: int,
    d_k: int,
    d_v: int,
    itemsize: int,
    max_memory: int,
    whole_rows: bool = False,
    group: int = 1,
    cast: bool = False,
) -> Tiles:
    """Tile sizes whose scratch fits in ``max_memory`` bytes.

    ``H`` counts key/value heads, each serving ``group`` query heads whose rows are stacked
    in one tile. A tile of ``R x cols`` scores (``R = group * rows``) needs the scores, a few
    boolean masks of the same size, the scaled query rows and two accumulators of width
    ``d_v``. ``whole_rows`` keeps every key in one tile (used when the weights are
    returned). When all of a head's rows fit, several heads share a work item, which keeps
    Python's per-tile cost small. ``cast``: the keys and values are stored in another dtype
    (bfloat16, float16), so each head's key and value tiles are copies in the compute dtype,
    counted too (at most half the budget: a short cache is not copied whole).
    """
    per_pair = itemsize + 3
    per_row = (d_k + 2 * d_v + 6) * itemsize
    per_key = (d_k + d_v) * itemsize if cast else 0  # a head's key and value, upcast
    # Tiles of few rows (decoding) take wide_key_tile keys, where Python's per-tile cost
    # dominates; others key_tile keys when the budget allows.
    tuned = runtime.DEFAULT.thresholds
    wide = group * max(L, 1) < tuned.wide_below_rows
    cols = max(1, S if whole_rows else min(S, tuned.wide_key_tile if wide else tuned.key_tile))
    if per_key and not whole_rows:
        cols = max(1, min(cols, max_memory // (2 * per_key)))
    rows = (max_memory - cols * per_key) // (group * (cols * per_pair + per_row))
    if group * rows < 16 and not whole_rows and not wide:  # a small budget: narrower key tiles
        rows = min(max(L, 1), -(-16 // group))  # 16 stacked rows (a wide group's: fewer each)
        cols = max(1, min(cols, (max_memory // (group * rows) - per_row) // per_pair))
    rows = int(max(1, min(max(L, 1), rows)))
    heads = 1
    if rows >= L:
        per_head = group * rows * (cols * per_pair + per_row) + cols * per_key
        heads = int(max(1, min(H, max_memory // per_head)))
    return Tiles(rows=rows, cols=int(cols), heads=heads)


def attend(call: KernelCall, outputs: Outputs, team: Team | None = None) -> None:
    """Fill ``outputs`` with the attention of ``call`` (:class:`.call.KernelCall`), per
    ``(*batch, head)``: the output, and the weights and the log-sum-exp of each row's
    logits where asked for. Work items run on ``team`` (serially without one). ``dropout``
    drops weights after the softmax's sums (the log-sum-exp is the undropped one, as the
    backward pass needs); ``scores`` change the scores and add the sinks (:mod:`.scores`).
    The compiled walk takes the call when :func:`.walk.choose` picks it; the rest, and
    what it leaves, the NumPy walk here does (:class:`_QueryTile`).
    """
    visibility = call.visibility.classified(team)  # with mask_mod's block map
    if visibility is not call.visibility:
        call = replace(call, visibility=visibility)
    call, _ = call.folded()  # a query temperature, into the queries
    sinks = None if call.scores is None else call.scores.sinks
    if sinks is not None and outputs.lse is None:  # the sinks are added through it
        lse = np.full(outputs.out.shape[:-1], -np.inf, dtype=outputs.out.dtype)
        outputs = replace(outputs, lse=lse)
    tiles = call_tiles(call, outputs)
    team = team or Team(1)
    views = walk.forward_walkable(call, outputs)
    tuned = runtime.DEFAULT.thresholds
    if views:
        # The compiled walk; a task it could not do (a non-finite value at a hidden key)
        # is done below by the NumPy walk, with the compiled softmax step.
        work, parts = walk.run_forward(
            call, views, tiles, team, tuned.wide_below_rows, tuned.product_chunk
        )
        fused = True
    else:
        work, parts = _work_items(call, outputs, tiles, team.workers)
        # The compiled softmax step for calls large enough to repay loading numba (a third
        # of a second, once per process); small calls, and float16 or longdouble, take
        # NumPy's passes.
        fused = (
            outputs.out.dtype in (np.float32, np.float64)
            and call.group * sum(task.cost for task in work) >= tuned.compiled_above
            and compiled.available()
        )
    if work:
        team.run(work, _NumpyWalk(call, outputs, tiles, parts, fused).make_worker)
    if parts is not None:
        parts.merge_into(outputs.out, outputs.lse)
    if sinks is not None and outputs.lse is not None:
        _add_sinks(outputs, sinks)


BAND_FEATURES = (
    "visibility.causal", "visibility.causal_offset", "visibility.offsets",
    "visibility.key_lengths", "visibility.query_lengths", "visibility.query_index",
    "visibility.key_index", "budget", "lse",
)  # fmt: skip
"""What a call given to :func:`attend_band` may set (:func:`.walk.features`; its dtype's
besides): the walk it takes is the one :func:`.walk.choose` would give such a call."""


@functools.cache
def _band_needs(dtype: np.dtype) -> tuple[str, ...]:
    """:data:`BAND_FEATURES` and ``dtype``'s feature."""
    return (*BAND_FEATURES, walk.dtype_feature(dtype))


def attend_band(call: KernelCall, outputs: Outputs, team: Team) -> None:
    """:func:`attend` of a call that sets no more than :data:`BAND_FEATURES` (a band, no
    changes to the scores, one float dtype throughout: a cache's decoding step or prompt) without
    asking :func:`.walk.choose` of its features (the compiled forward walk is asked about
    these instead), with the tiles of :func:`plan_tiles`: the same walk, the same bits,
    microseconds less a call. What the compiled walk does not take here (a paged cache's
    pools, arrays it cannot read as they are, an empty one, a non-finite value at a hidden
    key) :func:`attend` computes, from the start."""
    q, k, v, out, lse = call.q, call.k, call.v, outputs.out, outputs.lse
    written = (out,) if lse is None else (out, lse[..., None])
    views = _band_views(q, k, v, written)
    if views is not None:  # attend's compiled half, its tiles and its walk
        if team.workers == 1 and lse is None and q.shape[-2] == 1:  # one query row a head
            band = walk_inputs.band_of(call.visibility, q.shape[:-3], 1, k.shape[-2])
            if _run_lone(views, band, call.scale, call.budget):
                return
        else:
            tuned, tiles = runtime.DEFAULT.thresholds, call_tiles(call, outputs)
            left, parts = walk.run_forward(
                call, views, tiles, team, tuned.wide_below_rows, tuned.product_chunk
            )
            if not left:
                if parts is not None:
                    parts.merge_into(out, lse)
                return
        out[...] = 0  # the outputs as they were, for attend
        if lse is not None:
            lse[...] = -np.inf
    attend(call, outputs, team)


def attend_step(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    band: tuple[Any, ...],
    scale: float,
    budget: int,
) -> np.ndarray | None:
    """:func:`attend_band`'s route for a decoding step on one worker, from the step's arrays
    rather than a :class:`.call.KernelCall`: ``q (B, H, 1, d_k)`` over ``keys`` and
    ``values`` ``(B, H_kv, S, d)`` of ``q``'s dtype (float32 or float64), within ``band``
    (:func:`.walk_inputs.band_of`'s form), scaled by ``scale``, in the key tiles
    :func:`plan_tiles` gives a budget of ``budget`` bytes: the output ``(B, H, 1, d_v)``,
    the same walk and bits as :func:`attend_band` on a team of one worker. ``None`` where
    that route would compute it whole by :func:`attend` (the compiled walk unavailable,
    arrays it cannot read as they are, an empty one, a task left undone: a non-finite value
    at a hidden key)."""
    out = np.zeros((*q.shape[:-1], values.shape[-1]), q.dtype)
    views = _band_views(q, keys, values, (out,))
    if views is None or not _run_lone(views, band, scale, budget):
        return None
    return out


def _band_views(q: Any, k: Any, v: Any, written: tuple[np.ndarray, ...]) -> list[np.ndarray] | None:
    """The views the compiled walk takes of a band's call (:func:`.walk.walk_views`), or
    ``None`` where it does not take it: keys or values not arrays (a paged cache's) or not
    of the output's dtype (a bfloat16 cache's), an empty one, the walk unavailable, arrays
    it cannot read as they are."""
    out = written[0]
    arrays = type(k) is np.ndarray and type(v) is np.ndarray
    arrays = arrays and k.dtype == out.dtype and v.dtype == out.dtype
    if not (arrays and q.size and k.size and v.size):
        return None
    if not walk.COMPILED_FORWARD.takes(_band_needs(out.dtype)):
        return None
    return walk.walk_views((q, k, v), written, operands=(q, k, v))


def _run_lone(views: list[np.ndarray], band: tuple[Any, ...], scale: float, budget: int) -> bool:
    """:func:`.walk.run_lone` of ``views = (q, keys, values, out)`` (one query row a head,
    a batch axis) in the key tiles :func:`call_tiles` gives such a call (no weights, no
    chunks, no ``mask_mod``, nothing stored narrower)."""
    q, keys, values, out = views
    H, d_k, H_kv, S, d_v = q.shape[1], q.shape[3], keys.shape[1], keys.shape[2], values.shape[3]
    tiles = plan_tiles(1, S, H_kv, d_k, d_v, out.itemsize, budget, group=H // H_kv)
    return walk.run_lone(views, band, scale, tiles.cols)


def call_tiles(call: KernelCall, outputs: Outputs) -> Tiles:
    """The call's tile sizes (:func:`plan_tiles`), in whole chunks of rows where its rows
    are chunked."""
    q, k, v, visibility = call.q, call.k, call.v, call.visibility
    dtype = outputs.out.dtype
    # Stored narrower or quantized: each tile is a copy in the compute dtype. (A paged
    # cache's float tiles are tiled as a contiguous cache's are, for the same bits.)
    quantized = isinstance(k, PagedKV) and k.quantization is not None
    cast = k.dtype != dtype or v.dtype != dtype or quantized
    L, d_k, H_kv, S, d_v = q.shape[-2], q.shape[-1], k.shape[-3], k.shape[-2], v.shape[-1]
    whole = outputs.weights is not None
    tiles = plan_tiles(L, S, H_kv, d_k, d_v, dtype.itemsize, call.budget, whole, call.group, cast)
    # Rows in whole chunks per tile (or whole key tiles, for a mask_mod, whose documents or
    # blocks often are): no chunk's keys are then computed for two tiles of rows.
    align = visibility.chunk or (tiles.cols if visibility.mask_mod is not None else None)
    if align is not None and tiles.rows > align and tiles.heads == 1:
        tiles = replace(tiles, rows=tiles.rows // align * align)
    return tiles


def _work_items(
    call: KernelCall, outputs: Outputs, tiles: Tiles, workers: int
) -> tuple[list[Task], Parts | None]:
    """The NumPy walk's work items, longest first: per batch index, run of ``tiles.heads``
    key/value heads and tile of rows, over the keys its rows may see; with fewer than
    ``workers``, their keys split (:func:`.tasks.split_keys`) unless the weights are
    returned or dropped."""
    q, visibility, group = call.q, call.visibility, call.group
    H_kv, L = call.k.shape[-3], q.shape[-2]
    items: list[Task] = []
    for batch in np.ndindex(q.shape[:-3]):
        for g0 in range(0, H_kv, tiles.heads):
            kv = slice(g0, min(g0 + tiles.heads, H_kv))
            item = visibility.item(batch, slice(kv.start * group, kv.stop * group))
            for r0 in range(0, min(L, item.query_end), tiles.rows):
                r1 = min(r0 + tiles.rows, item.query_end)
                ranges = item.key_ranges(r0, r1)
                if ranges:
                    items.append(Task(batch, kv, item, r0, r1, ranges[0][0], ranges[-1][1]))
    parts = None
    if outputs.weights is None and call.dropout is None:
        d_v, dtype = call.v.shape[-1], outputs.out.dtype
        parts = tasks.split_keys(items, workers, tiles.cols, group, L, d_v, dtype)
    work = parts.tasks if parts is not None else items
    work.sort(key=lambda task: task.cost, reverse=True)  # longest first
    return work, parts


def _add_sinks(outputs: Outputs, sinks: np.ndarray) -> None:
    """The sinks folded into the finished rows (:func:`.scores.add_sinks`), and into the
    returned weights."""
    out, weights, lse = outputs.out, outputs.weights, outputs.lse
    assert lse is not None  # attend made one
    before = lse.copy() if weights is not None else None
    add_sinks(out, lse, sinks)
    if weights is not None and before is not None:
        weights *= np.exp(before - lse)[..., None]


class _Scratch:
    """One worker's preallocated buffers, sized for the largest tile."""

    def __init__(self, tiles: Tiles, group: int, d_k: int, d_v: int, dtype: np.dtype) -> None:
        G, R = tiles.heads, group * tiles.rows
        self.scores = np.empty(G * R * tiles.cols, dtype=dtype)
        # Few rows (decoding): k @ q^T streams the keys faster than q @ k^T (BLAS packs the
        # wide operand otherwise); its (keys, rows) result is transposed into scores.
        wide = runtime.DEFAULT.thresholds.wide_below_rows > R
        self.flipped = np.empty(G * R * tiles.cols if wide else 0, dtype=dtype)
        self.q = np.empty((G, R, d_k), dtype=dtype)
        self.acc = np.empty((G, R, d_v), dtype=dtype)
        self.pv = np.empty((G, R, d_v), dtype=dtype)
        self.m = np.empty((G, R), dtype=dtype)  # running maximum (-inf: no key seen yet)
        self.ref = np.empty((G, R), dtype=dtype)  # the maximum used for exp, never -inf
        self.ref_new = np.empty((G, R), dtype=dtype)
        self.total = np.empty((G, R), dtype=dtype)  # running sum of exp(s - ref)
        self.alpha = np.empty((G, R), dtype=dtype)  # rescaling of earlier tiles' sums


@dataclass(frozen=True)
class _NumpyWalk:
    """What the NumPy walk's work items of one call share: the call, where its rows go
    (``parts``: the split keys' partial results), its tiles, and whether the softmax lines
    run as the compiled step (``fused``) or as NumPy's passes."""

    call: KernelCall
    outputs: Outputs
    tiles: Tiles
    parts: Parts | None
    fused: bool

    def make_worker(self) -> Callable[[Task], None]:
        """A worker's function of a work item, with its scratch."""
        call, dtype = self.call, self.outputs.out.dtype
        scratch = _Scratch(self.tiles, call.group, call.q.shape[-1], call.v.shape[-1], dtype)
        return lambda task: _QueryTile(self, task, self._targets(task), scratch).run()

    def _targets(self, task: Task) -> Outputs:
        """Where a work item's rows go: its heads of the outputs, or its part's buffers."""
        batch, kv, group = task.batch, task.kv, self.call.group
        heads = slice(kv.start * group, kv.stop * group)
        weights, lse = self.outputs.weights, self.outputs.lse
        targets = Outputs(
            self.outputs.out[batch][heads],
            None if weights is None else weights[batch][heads],
            None if lse is None else lse[batch][heads],
        )
        if task.part is not None and self.parts is not None:
            targets = Outputs(self.parts.out[task.part], None, self.parts.lse[task.part])
        return targets


class _QueryTile:
    """One work item: rows ``[r0, r1)`` of the query heads of its ``G`` key/value heads
    (``k (G, S, d_k)``: an array, or a paged cache's heads, whose ``[:, c0:c1]`` is a
    gathered tile) against its keys ``[start, stop)``, the rows of each group's query heads
    stacked into one tile of ``R = group * n`` rows. :meth:`run` walks its key tiles with
    the running state of the online softmax (``m``, ``ref``, ``total``, ``acc``), then
    divides."""

    def __init__(self, walk: _NumpyWalk, task: Task, targets: Outputs, scratch: _Scratch):
        call, batch, kv = walk.call, task.batch, task.kv
        self.k, self.v = call.k[batch][kv], call.v[batch][kv]
        self.item, self.scores, self.fused = task.item, call.scores, walk.fused
        self.r0, self.r1, self.start, self.stop = task.r0, task.r1, task.start, task.stop
        self.targets, self.scratch, self.key_tile = targets, scratch, walk.tiles.cols
        self.G, self.n, self.group = self.k.shape[0], task.r1 - task.r0, call.group
        G, R = self.G, self.group * self.n
        self.dtype = targets.out.dtype
        self.heads = slice(kv.start * self.group, kv.stop * self.group)
        self.q = self._stacked_queries(call.q[batch][self.heads], call.scale)
        self.dropout = None
        if call.dropout is not None:  # its flat batch index, for its mask
            flat = int(np.ravel_multi_index(batch, call.q.shape[:-3])) if batch else 0
            self.dropout = call.dropout, flat
        self.m, self.ref, self.total = scratch.m[:G, :R], scratch.ref[:G, :R], scratch.total[:G, :R]
        self.ref_new, self.alpha = scratch.ref_new[:G, :R], scratch.alpha[:G, :R]
        self.acc, self.pv = scratch.acc[:G, :R], scratch.pv[:G, :R]
        self.s = scratch.scores[:0].reshape(G, R, 0)
        self.first = True  # no key tile seen yet
        # A key tile that only some rows can see (the diagonal's, a window's edge) is
        # computed for those rows alone: with tiles of ~1000 rows, causal attention
        # otherwise computes up to half of its last key tiles in vain.
        self.narrow = (
            self.group == 1
            and targets.weights is None
            and self.dropout is None
            and not scratch.flipped.size
        )
        scores = self.scores
        self.changes = scores is not None and scores.changes_scores
        self.fused_alibi = self.fused and scores is not None and scores.fused_alibi

    def _stacked_queries(self, q: np.ndarray, scale: float) -> np.ndarray:
        """Rows ``[r0, r1)`` of the query heads ``q (G * group, L, d_k)``, stacked per
        key/value head and scaled, in the tile's dtype: ``(G, R, d_k)``."""
        G, group, n = self.G, self.group, self.n
        q_tile = q[:, self.r0 : self.r1]
        if group == 1 and scale == 1.0 and q_tile.dtype == self.dtype:
            return q_tile
        stacked = self.scratch.q[:G, : group * n]
        np.multiply(  # in the tile's dtype: a bfloat16 q times the scale rounds otherwise
            q_tile.reshape(G, group, n, -1),
            scale,
            out=stacked.reshape(G, group, n, -1),
            dtype=self.dtype,
        )
        return stacked

    def run(self) -> None:
        """Every key tile the rows may see, then the division."""
        whole = self.targets.weights is not None  # one tile over every visible key
        for c0, c1 in self.item.key_tiles(
            self.r0, self.r1, self.start, self.stop, self.key_tile, whole=whole
        ):
            block = self._block(c0, c1)
            if block is not None:
                self._key_tile(block)
        if not self.first:  # else every tile was hidden: the rows stay zero
            self._finish()

    def _block(self, c0: int, c1: int) -> _Block | None:
        """The key tile ``[c0, c1)`` for the rows that see some key of it (all of them unless
        :attr:`narrow`), with what hides its keys; ``None`` when it hides every key."""
        item, r0, r1, w = self.item, self.r0, self.r1, c1 - c0
        a, b = item.rows_seeing(r0, r1, c0, c1)
        if a == b:  # the causal mask and the window hide the whole block
            return None
        if not self.narrow:
            a, b = r0, r1
        # The compiled step takes the causal mask and the window as each row's band of
        # keys; NumPy's passes take them, like every other mask, as a boolean block.
        if self.fused:  # None: the band hides nothing
            edge, raw = item.band_and_hidden(a, b, c0, c1)
        else:
            edge, raw = None, item.hidden(a, b, c0, c1)
        hidden = _stack(raw, self.G, self.group, b - a, w)
        if hidden is not None and hidden.all():
            return None
        rows = slice(a - r0, b - r0) if self.narrow else slice(None)  # among the state's
        k_tile = _cast(self.k[:, c0:c1], self.dtype)
        v_tile = _cast(self.v[:, c0:c1], self.dtype)
        # Hidden keys' values may hold NaN or inf, which 0 * value would spread; a tile
        # with nothing hidden needs no check (and decoding reads each value once, not twice).
        finite = (hidden is None and edge is None) or bool(np.isfinite(v_tile).all())
        halves = None  # score_mod and soft-capping see the whole tile
        nonlinear = self.changes and self.scores is not None and self.scores.nonlinear
        if self.narrow and edge is not None and finite and not nonlinear:
            halves = _halves(edge, w)
        return _Block(a, b, c0, c1, rows, edge, hidden, k_tile, v_tile, finite, halves)

    def _key_tile(self, block: _Block) -> None:
        """One key tile's step of the online softmax, for the block's rows."""
        if self.first and (block.a, block.b) != (self.r0, self.r1):
            self.m.fill(-np.inf)  # the other rows start from nothing seen
            self.ref.fill(0.0)
            self.total.fill(0.0)
            self.acc.fill(0.0)
            self.first = False
        s = self.s = self._scores(block)
        # Hidden pairs leave the maximum out and get weight 0. NumPy's float64 exp is slow
        # on -inf (several times its usual cost), so there they are zeroed after exp instead.
        hidden = block.hidden
        late = hidden is not None and self.dtype.itemsize == 8 and not self.fused
        if hidden is not None and not late:
            np.copyto(s, -np.inf, where=hidden)
        attended = None
        if not block.finite:
            every = self._stacked(self.item.hidden(block.a, block.b, block.c0, block.c1), block)
            attended = s != -np.inf
            if every is not None:
                attended &= ~every
        self._softmax(block, s, hidden if late else None)
        if self.dropout is not None:
            s *= self._dropped(block.c0, block.c1)  # after the sums: the undropped normaliser
        self._accumulate(block, s, attended)

    def _stacked(self, block: np.ndarray | None, tile: _Block) -> np.ndarray | None:
        """A mask or bias block of ``tile``'s rows, as the stacked tile's (:func:`_stack`)."""
        return _stack(block, self.G, self.group, tile.b - tile.a, tile.c1 - tile.c0)

    def _scores(self, block: _Block) -> np.ndarray:
        """The block's scores ``q k^T`` (scaled with ``q``), changed by the call's scores
        and bias: ``(G, group * (b - a), w)``."""
        G, group, a, b, w = self.G, self.group, block.a, block.b, block.c1 - block.c0
        s = self.scratch.scores[: G * group * (b - a) * w].reshape(G, group * (b - a), w)
        k_tile, q_tile, flipped = block.k, self.q, self.scratch.flipped
        if flipped.size:
            transposed = flipped[: G * group * self.n * w].reshape(G, w, group * self.n)
            np.matmul(k_tile, q_tile.transpose(0, 2, 1), out=transposed)
            np.copyto(s, transposed.transpose(0, 2, 1))
        elif block.halves is not None:  # a band's tile: each half of its rows, its keys only
            rows_q = q_tile[:, block.rows]
            for rows, keys in block.halves:
                np.matmul(rows_q[:, rows], k_tile[:, keys].transpose(0, 2, 1), out=s[:, rows, keys])
        else:
            np.matmul(q_tile[:, block.rows], k_tile.transpose(0, 2, 1), out=s)
        if self.changes and self.scores is not None:
            alibi = not self.fused_alibi
            self.scores.apply(s, self.item, a, b, block.c0, block.c1, alibi=alibi)
        bias = self._stacked(self.item.bias_block(a, b, block.c0, block.c1), block)
        if bias is not None:
            s += bias
        return s

    def _softmax(self, block: _Block, s: np.ndarray, late: np.ndarray | None) -> None:
        """The online softmax's step for the block's rows: ``s`` becomes ``exp(s - ref)``;
        the compiled step with each row's band, or NumPy's passes (``late``: the hidden
        pairs, zeroed after ``exp``)."""
        rows = block.rows
        state = (self.m[:, rows], self.ref[:, rows], self.total[:, rows], self.alpha[:, rows])
        if not self.fused:
            m, ref, total, alpha = state
            _softmax_step(s, late, m, ref, self.ref_new[:, rows], total, alpha, self.first)
            return
        band = _stacked_band(block.edge, self.group, block.b - block.a, block.c1 - block.c0)
        alibi = None
        if self.fused_alibi and self.scores is not None:
            alibi = self.scores.alibi_rows(
                self.item, block.a, block.b, block.c0, self.G, self.dtype
            )
        compiled.softmax_step(s, band, *state, self.first, alibi)

    def _dropped(self, c0: int, c1: int) -> np.ndarray:
        """The dropout's scale of the rows' weights of keys ``[c0, c1)``, stacked."""
        assert self.dropout is not None
        dropout, flat = self.dropout
        heads, n = self.heads, self.n
        count = heads.stop - heads.start
        scaled = dropout.scale(flat, heads.start, count, self.r0, self.r1, c0, c1, self.dtype)
        return scaled.reshape(self.G, self.group * n, c1 - c0)

    def _accumulate(self, block: _Block, s: np.ndarray, attended: np.ndarray | None) -> None:
        """``acc = acc * alpha + s @ v_tile`` for the block's rows."""
        rows, acc, alpha, v_tile = block.rows, self.acc, self.alpha, block.v
        if block.halves is not None:  # the keys outside each half's are zero weights
            target = acc if self.first else self.pv[:, rows]
            for half, keys in block.halves:
                np.matmul(s[:, half, keys], v_tile[:, keys], out=target[:, half])
            if not self.first:
                acc[:, rows] *= alpha[:, rows, None]
                acc[:, rows] += target
        elif self.first:
            _product(s, v_tile, attended, out=acc)
        else:
            acc[:, rows] *= alpha[:, rows, None]
            acc[:, rows] += _product(s, v_tile, attended, out=self.pv[:, rows])
        self.first = False

    def _finish(self) -> None:
        """The rows divided by their sums, with the weights and the log-sum-exp where
        asked for, into the targets."""
        G, group, n, total, s = self.G, self.group, self.n, self.total, self.s
        out, weights, lse = self.targets.out, self.targets.weights, self.targets.lse
        empty = total == 0.0
        total[empty] = 1.0
        inverse = np.reciprocal(total, out=self.m)[..., None]  # cheaper than dividing
        rows = slice(self.r0, self.r1)
        if group == 1:
            np.multiply(self.acc, inverse, out=out[:, rows])
        else:
            out[:, rows] = np.multiply(self.acc, inverse, out=self.acc).reshape(G * group, n, -1)
        if weights is not None:  # whole rows: s holds every visible key's exp(s - ref)
            keys = slice(self.start, self.start + s.shape[-1])
            if group == 1:
                np.multiply(s, inverse, out=weights[:, rows, keys])
            else:
                weights[:, rows, keys] = (s * inverse).reshape(G * group, n, -1)
        if lse is not None:
            row_lse = self.ref + np.log(total)
            row_lse[empty] = -np.inf
            lse[:, rows] = row_lse.reshape(G * group, n)


@dataclass(slots=True)
class _Block:
    """One key tile ``[c0, c1)`` of a :class:`_QueryTile` for its rows ``[a, b)`` (``rows``
    among the item's stacked state): the band of the causal mask and the window (``edge``,
    for the compiled step; ``None``: it hides nothing) and the boolean block of what else
    hides keys (``hidden``, stacked), the key and value tiles in the compute dtype, whether
    its values are finite, and its two halves of rows when it is computed so
    (:func:`_halves`)."""

    a: int
    b: int
    c0: int
    c1: int
    rows: slice
    edge: tuple[np.ndarray, np.ndarray] | None
    hidden: np.ndarray | None
    k: np.ndarray
    v: np.ndarray
    finite: bool
    halves: list[tuple[slice, slice]] | None


def _softmax_step(
    s: np.ndarray,
    hidden: np.ndarray | None,
    m: np.ndarray,
    ref: np.ndarray,
    ref_new: np.ndarray,
    total: np.ndarray,
    alpha: np.ndarray,
    first: bool,
) -> None:
    """:func:`compiled.softmax_step` in NumPy passes. ``hidden``, when given, marks pairs
    that still hold their scores: they are left out of the maximum and zeroed after exp."""
    if hidden is None:
        tile_max = s.max(axis=-1)
    else:
        tile_max = np.max(s, axis=-1, where=~hidden, initial=-np.inf)
    unseen = None if first else m == -np.inf  # rows that saw no key before this tile
    if first:
        np.copyto(m, tile_max)
    else:
        np.maximum(m, tile_max, out=m)
    np.copyto(ref_new, m)
    ref_new[m == -np.inf] = 0.0  # rows with no visible key so far
    s -= ref_new[..., None]
    np.exp(s, out=s)
    if hidden is not None:
        np.copyto(s, 0.0, where=hidden)
    if first:
        np.sum(s, axis=-1, out=total)
    else:
        np.exp(ref - ref_new, out=alpha)  # rescales what earlier tiles accumulated
        alpha[unseen] = 0.0  # nothing to rescale; their stand-in ref 0 could overflow exp
        total *= alpha
        total += s.sum(axis=-1)
    np.copyto(ref, ref_new)


HALF_ROWS = 128
"""The fewest rows in each half of a band's tile computed by halves."""


def _halves(band: tuple[np.ndarray, np.ndarray] | None, w: int) -> list[tuple[slice, slice]] | None:
    """A tile whose rows see the keys ``band = (lo, hi)`` of its ``w`` (the diagonal's, a
    window's edge) computed as two halves of its rows, each with only the keys it sees:
    ``[(rows, keys), (rows, keys)]``, or ``None`` when that saves less than a fifth."""
    if band is None or len(band[0]) < 2 * HALF_ROWS:
        return None
    lo, hi = band
    n = len(lo)
    m = n // 2
    parts = []
    for rows in (slice(0, m), slice(m, n)):
        k0, k1 = int(lo[rows].min()), int(hi[rows].max())
        parts.append((rows, slice(k0, max(k0, k1))))
    computed = sum((r.stop - r.start) * (k.stop - k.start) for r, k in parts)
    return parts if computed <= 0.8 * n * w else None


def _stacked_band(
    band: tuple[np.ndarray, np.ndarray] | None, group: int, n: int, w: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each stacked row's visible keys ``[lo, hi)`` in a block of ``n`` rows (per query head
    of the ``group``) by ``w`` keys, from :meth:`ItemVisibility.band` (``None``: all)."""
    if band is None:
        return compiled.full_band(group * n, w)
    lo, hi = band
    return (np.tile(lo, group), np.tile(hi, group)) if group > 1 else (lo, hi)


def _stack(block: np.ndarray | None, G: int, group: int, n: int, w: int) -> np.ndarray | None:
    """A mask or bias block for the query heads ``(G * group or 1, n or 1, w or 1)``, as the
    stacked tile's ``(G, group * n, w)``; unchanged without grouping."""
    if block is None or group == 1:
        return block
    return np.broadcast_to(block, (G * group, n, w)).reshape(G, group * n, w)


def _cast(tile: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return tile if tile.dtype == dtype else tile.astype(dtype)


def _product(
    e: np.ndarray, v: np.ndarray, attended: np.ndarray | None, out: np.ndarray
) -> np.ndarray:
    """``e @ v`` into ``out``, where ``0 * inf`` and ``0 * nan`` from hidden keys count as 0.

    BLAS would turn a zero weight times a NaN value into NaN. When ``v (G, w, d_v)`` holds
    non-finite values, multiply by ``v`` with them zeroed, then add each one's product back
    only for the rows that attend to its key (``attended (G, n, w)``). Extra work is
    proportional to the number of keys holding a non-finite value, usually none.
    """
    if attended is None:
        w, tuned = e.shape[-1], runtime.DEFAULT.thresholds
        chunk = tuned.product_chunk
        if e.shape[-2] >= tuned.wide_below_rows or w <= chunk:
            return np.matmul(e, v, out=out)
        # Few rows (decoding): chunks of keys let BLAS skip packing a large panel of v,
        # which streams v from memory faster.
        np.matmul(e[..., :chunk], v[:, :chunk], out=out)
        part = np.empty_like(out)
        for c in range(chunk, w, chunk):
            out += np.matmul(e[..., c : c + chunk], v[:, c : c + chunk], out=part)
        return out
    non_finite = ~np.isfinite(v)
    np.matmul(e, np.where(non_finite, 0.0, v), out=out)
    for j in np.flatnonzero(non_finite.any(axis=(0, 2))):
        v_j = np.where(non_finite[:, j], v[:, j], 0.0)[:, None, :]  # (G, 1, d_v)
        out += np.where(attended[:, :, j, None], e[:, :, j, None] * v_j, 0.0)
    return out
