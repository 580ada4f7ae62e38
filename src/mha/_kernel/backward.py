"""The backward pass: FlashAttention-2's, written for NumPy beside the forward.

Nothing of size ``L x S`` is kept from the forward pass: only q, k, v, the output and each
row's log-sum-exp ``lse``. Each tile's probabilities are recomputed from them::

    s - lse = [q * scale, -lse] @ [k_tile, 1].T + bias_tile
    p  = exp(s - lse)                              exactly the forward's weights, 0 if hidden
    dv_tile += p.T @ dO
    dp - D = [dO, -D] @ [v_tile, 1].T,   D = rowsum(dO * O)
    ds = p * (dp - D)                              ds = 0 where the key is hidden
    dq += ds @ k_tile * scale,   dk_tile += ds.T @ (q * scale),   dbias_tile = ds

Both subtractions ride on the GEMMs as one extra column of ones: BLAS does them for about
1% of a GEMM's time, where a NumPy pass over the tile costs a quarter of one. Hidden pairs
are zeroed after ``exp`` rather than set to ``-inf`` before it (NumPy's float64 ``exp`` is
several times slower on ``-inf``).

A work item is one ``(*batch, key/value head)`` (:class:`_ItemBackward`): it owns that
head's ``dk`` and ``dv`` and its query heads' ``dq``, so the workers share no accumulator
and need no lock. The tiles an item visits are the forward's: causal tiles above the
diagonal and window tiles below the band are skipped, padded rows and keys are never
visited. Grouped query heads are stacked into one tile, so their ``dk``/``dv``
contributions sum in the GEMMs.

With numba, a call whose hidden keys are a band runs these steps as compiled code
(:func:`mha._kernel.compiled.backward_walk`, NumPy's BLAS for the five GEMMs, chosen by
:func:`.walk.choose`), one task per ``(*batch, key/value head)``; the subtractions are then
done in the sweep that takes ``exp``, without the extra column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import walk
from .call import Gradients, KernelCall, Outputs
from .forward import Tiles, _cast, _product, _stack, plan_tiles
from .scores import Tile, sink_gradient
from .team import Team

__all__ = ["attend_backward"]


def attend_backward(
    call: KernelCall,
    forward: Outputs,
    grad_out: np.ndarray,
    grads: Gradients,
    team: Team | None = None,
) -> None:
    """Fill ``grads`` (:class:`.call.Gradients`) with the gradients of ``sum(grad_out *
    out)`` for the attention :func:`.forward.attend` computed for ``call``: ``forward``
    holds that call's ``out`` and ``lse``, ``grad_out (*batch, H, L, d_v)`` is the output's
    gradient; everything in ``grads.dq.dtype`` (float32 or wider). ``dq`` may be
    ``grad_out`` itself: each tile of rows reads its rows of ``grad_out`` before it writes
    them to ``dq``, so the caller needs no buffer. The dropout is the forward's, whose mask
    is regenerated tile by tile: ``dv`` takes the dropped weights and ``dp`` the mask, while
    ``D = rowsum(dO * O)`` already includes it. ``dsinks``, when given, gets the sinks'
    gradient (``lse`` is then the forward's, with the sinks). The compiled walk takes the
    call when :func:`.walk.choose` picks it; the rest, and what it leaves, the NumPy walk
    here does (:class:`_ItemBackward`).
    """
    assert forward.lse is not None  # the backward reads the forward's log-sum-exp
    visibility = call.visibility.classified(team)  # with mask_mod's block map
    if visibility is not call.visibility:
        call = replace(call, visibility=visibility)
    call, temperature = call.folded()  # the forward's queries; dq is theirs times it
    scores = call.scores
    if grads.dsinks is not None and scores is not None and scores.sinks is not None:
        grads.dsinks += sink_gradient(forward.out, forward.lse, grad_out, scores.sinks)
    q, k, v = call.q, call.k, call.v
    L, d_k, H_kv, S, d_v = q.shape[-2], q.shape[-1], k.shape[-3], k.shape[-2], v.shape[-1]
    # Two tiles of scores (p and ds) instead of one: half the forward's budget for each.
    # When all of a head's rows fit, a work item takes several key/value heads (batched
    # GEMMs), which keeps Python's per-tile cost small for short sequences.
    itemsize, budget = grads.dq.dtype.itemsize, call.budget // 2
    tiles = plan_tiles(L, S, H_kv, d_k, d_v, itemsize, budget, False, call.group)
    team = team or Team(1)
    if walk.backward_walkable(call, forward, grad_out, grads):
        items = walk.run_backward(call, forward, grad_out, grads, tiles, team)
        # what the compiled walk left (a non-finite key some row cannot see): NumPy's walk
        tiles = replace(tiles, heads=1)
    else:
        items = [
            (batch, slice(h, min(h + tiles.heads, H_kv)))
            for batch in np.ndindex(q.shape[:-3])
            for h in range(0, H_kv, tiles.heads)
        ]
    if items:
        _BackwardWalk(call, forward, grad_out, grads, tiles).run(items, team)
    if temperature is not None:
        grads.dq *= temperature


def _bias_cells(dbias: np.ndarray, batch: tuple[int, ...], heads: slice) -> np.ndarray:
    """The ``(group or 1, L or 1, S or 1)`` part of a full-rank bias gradient that one batch
    index and run of heads adds to (broadcast axes have size 1)."""
    index: tuple[Any, ...] = tuple(
        0 if size == 1 else i for size, i in zip(dbias.shape, batch, strict=False)
    )
    cells: np.ndarray = dbias[(*index, heads if dbias.shape[-3] != 1 else slice(None))]
    return cells


class _Scratch:
    """One worker's buffers for the largest tile: ``G`` key/value heads, ``R`` stacked rows
    each, by ``cols`` keys."""

    def __init__(self, G: int, R: int, cols: int, d_k: int, d_v: int, dtype: np.dtype) -> None:
        self.p = np.empty(G * R * cols, dtype)
        self.ds = np.empty(G * R * cols, dtype)
        self.dv = np.empty(G * cols * d_v, dtype)
        self.dk = np.empty(G * cols * d_k, dtype)
        self.dq = np.empty(G * R * d_k, dtype)
        self.part = np.empty(G * R * d_k, dtype)
        self.q_aug = np.empty(G * R * (d_k + 1), dtype)  # [q * scale, -lse]
        self.do_aug = np.empty(G * R * (d_v + 1), dtype)  # [dO, -D]
        self.k_aug = np.empty(G * cols * (d_k + 1), dtype)  # [k, 1]
        self.v_aug = np.empty(G * cols * (d_v + 1), dtype)  # [v, 1]


@dataclass(frozen=True)
class _BackwardWalk:
    """The NumPy walk of a call's gradients: its work items ``(batch index, key/value
    heads)`` on a team, each worker with its scratch and, for a bias, a gradient of its own
    (items may share its cells), summed into ``dbias`` at the end."""

    call: KernelCall
    forward: Outputs
    grad_out: np.ndarray
    grads: Gradients
    tiles: Tiles

    def run(self, items: list[tuple[tuple[int, ...], slice]], team: Team) -> None:
        sums: list[np.ndarray] = []  # each worker's bias gradient
        tables: list[np.ndarray] = []  # each worker's relative-position table's

        def make_worker() -> Callable[[Any], None]:
            dtype, tiles, group = self.grads.dq.dtype, self.tiles, self.call.group
            d_k, d_v = self.call.q.shape[-1], self.call.v.shape[-1]
            scratch = _Scratch(tiles.heads, group * tiles.rows, tiles.cols, d_k, d_v, dtype)
            own = None
            if self.grads.dbias is not None:
                own = np.zeros(self.grads.dbias.shape, dtype)
                sums.append(own)
            table = None
            if self.grads.dtable is not None:
                table = np.zeros(self.grads.dtable.shape, dtype)
                tables.append(table)
            return lambda task: _ItemBackward(self, task, scratch, own, table).run()

        team.run(items, make_worker)
        if self.grads.dbias is not None:
            for part in sums:
                self.grads.dbias += part
        if self.grads.dtable is not None:
            for part in tables:
                self.grads.dtable += part


@dataclass(slots=True)
class _Rows:
    """One tile of rows' stacked operands: ``q_a = [q * scale, -lse]`` ``(G, R, d_k + 1)``,
    ``do_a = [dO, -D]`` ``(G, R, d_v + 1)``, their ``dq`` (unscaled) ``(G, R, d_k)``, and
    ``shift = -lse`` ``(G, R)`` when ``q_a``'s last column is 0 instead (the scores change
    nonlinearly: the raw scores first)."""

    q_a: np.ndarray
    do_a: np.ndarray
    dq: np.ndarray
    shift: np.ndarray | None

    def part(self, rows: slice) -> _Rows:
        """The stacked rows ``rows`` of these."""
        shift = None if self.shift is None else self.shift[:, rows]
        return _Rows(self.q_a[:, rows], self.do_a[:, rows], self.dq[:, rows], shift)


class _ItemBackward:
    """The gradients of one work item: ``G`` key/value heads of a batch index and their
    query heads, whose rows are stacked per key/value head into tiles of ``R = group * n``
    rows, as in the forward pass."""

    def __init__(
        self,
        walk: _BackwardWalk,
        task: tuple[tuple[int, ...], slice],
        scratch: _Scratch,
        dbias: np.ndarray | None,
        dtable: np.ndarray | None = None,
    ) -> None:
        call, forward, grads = walk.call, walk.forward, walk.grads
        batch, kv = task
        self.group = call.group
        heads = slice(kv.start * self.group, kv.stop * self.group)
        self.q, self.k, self.v = call.q[batch][heads], call.k[batch][kv], call.v[batch][kv]
        assert forward.lse is not None
        self.lse, self.out = forward.lse[batch][heads], forward.out[batch][heads]
        self.grad_out = walk.grad_out[batch][heads]
        self.dq, self.dk, self.dv = grads.dq[batch][heads], grads.dk[batch][kv], grads.dv[batch][kv]
        self.dbias = None if dbias is None else _bias_cells(dbias, batch, heads)
        self.item = call.visibility.item(batch, heads)
        self.scale, self.dq_scale = call.scale, call.scale * grads.dq_factor
        self.scores, self.tiles, self.scratch = call.scores, walk.tiles, scratch
        self.relative = None  # a relative-position bias and its table's gradient
        if dtable is not None and call.scores is not None:
            self.relative = call.scores.relative, dtable
        self.dtype, self.G = grads.dq.dtype, self.k.shape[0]
        self.dropout = None
        if call.dropout is not None:  # its flat batch index and first head, for its mask
            flat = int(np.ravel_multi_index(batch, call.q.shape[:-3])) if batch else 0
            self.dropout = call.dropout, flat, heads.start

    def run(self) -> None:
        """Every tile of rows, each against the key tiles it may see."""
        item = self.item
        self.dq[:, item.query_end :] = 0.0  # padded rows: no gradient
        for r0 in range(0, item.query_end, self.tiles.rows):
            r1 = min(r0 + self.tiles.rows, item.query_end)
            ranges = item.key_ranges(r0, r1)
            if not ranges:
                self.dq[:, r0:r1] = 0.0
                continue
            stacked = self._stacked_rows(r0, r1)
            for c0, c1 in item.key_tiles(r0, r1, ranges[0][0], ranges[-1][1], self.tiles.cols):
                self._key_tile(stacked, r0, r1, c0, c1)
            n, d_k = r1 - r0, self.q.shape[-1]
            np.multiply(
                stacked.dq.reshape(self.G * self.group, n, d_k),
                self.dq_scale,
                out=self.dq[:, r0:r1],
            )

    def _stacked_rows(self, r0: int, r1: int) -> _Rows:
        """Rows ``[r0, r1)``'s stacked operands (:class:`_Rows`). Both subtractions ride on
        GEMMs as one extra column: ``s - lse = [q, -lse] @ [k, 1]^T`` and ``dp - D = [dO,
        -D] @ [v, 1]^T``, which costs BLAS far less than two passes."""
        G, R, dtype, scratch = self.G, self.group * (r1 - r0), self.dtype, self.scratch
        d_k, d_v = self.q.shape[-1], self.v.shape[-1]
        q_a = scratch.q_aug[: G * R * (d_k + 1)].reshape(G, R, d_k + 1)
        np.multiply(
            self.q[:, r0:r1].reshape(G, R, d_k), self.scale, out=q_a[..., :d_k], dtype=dtype
        )
        lse_t = self.lse[:, r0:r1].reshape(G, R)
        # (not np.negative(..., out=): NumPy 2.4 writes a (G, 1) slice's negation into this
        # strided column from the wrong elements)
        q_a[..., d_k] = -lse_t
        q_a[..., d_k][lse_t == -np.inf] = -np.inf  # rows seeing no key: p = 0
        shift = None
        if self.scores is not None and self.scores.nonlinear:  # the raw scores, then - lse
            shift = q_a[..., d_k].copy()
            q_a[..., d_k] = 0.0
        do_a = scratch.do_aug[: G * R * (d_v + 1)].reshape(G, R, d_v + 1)
        np.copyto(do_a[..., :d_v], self.grad_out[:, r0:r1].reshape(G, R, d_v))
        o_t = _cast(self.out[:, r0:r1], dtype).reshape(G, R, d_v)
        D = np.einsum("grd,grd->gr", do_a[..., :d_v], o_t)  # rowsum(dO * O)
        do_a[..., d_v] = -D
        dq_t = scratch.dq[: G * R * d_k].reshape(G, R, d_k)
        dq_t.fill(0.0)
        return _Rows(q_a, do_a, dq_t, shift)

    def _key_tile(self, stacked: _Rows, r0: int, r1: int, c0: int, c1: int) -> None:
        """Rows ``[r0, r1)`` against keys ``[c0, c1)``: only the rows that can see them (the
        diagonal's, a window's edge), with the keys and values as ``[k, 1]`` and ``[v, 1]``."""
        G, w, d_k, d_v = self.G, c1 - c0, self.q.shape[-1], self.v.shape[-1]
        a, b = self.item.rows_seeing(r0, r1, c0, c1) if self.group == 1 else (r0, r1)
        if a == b:
            return
        k_a = self.scratch.k_aug[: G * w * (d_k + 1)].reshape(G, w, d_k + 1)
        v_a = self.scratch.v_aug[: G * w * (d_v + 1)].reshape(G, w, d_v + 1)
        np.copyto(k_a[..., :d_k], self.k[:, c0:c1])
        np.copyto(v_a[..., :d_v], self.v[:, c0:c1])
        k_a[..., d_k] = 1.0
        v_a[..., d_v] = 1.0
        rows = slice(a - r0, b - r0) if self.group == 1 else slice(None)
        self._tile(stacked.part(rows), (k_a, v_a), a, b, c0, c1)

    def _tile(
        self, rows: _Rows, kv: tuple[np.ndarray, np.ndarray], r0: int, r1: int, c0: int, c1: int
    ) -> None:
        """One tile's share of the gradients: rows ``[r0, r1)`` of the query heads (stacked
        ``R = group * n`` rows per key/value head, :class:`_Rows`) against keys ``[c0, c1)``,
        ``kv = ([k, 1], [v, 1])`` ``(G, w, d + 1)``."""
        G, group, n, w, scratch = self.G, self.group, r1 - r0, c1 - c0, self.scratch
        (k_a, v_a), R = kv, group * n
        hidden = _stack(self.item.hidden(r0, r1, c0, c1), G, group, n, w)
        if hidden is not None and hidden.all():
            return
        d_k, d_v = k_a.shape[-1] - 1, v_a.shape[-1] - 1
        k_c, q_t, do_t = k_a[..., :d_k], rows.q_a[..., :d_k], rows.do_a[..., :d_v]
        p, factor = self._weights(rows, k_a, hidden, r0, r1, c0, c1)
        ds = scratch.ds[: G * R * w].reshape(G, R, w)
        kept = None if self.dropout is None else self._kept(r0, r1, c0, c1)  # 0 if dropped
        dropped = p if kept is None else np.multiply(p, kept, out=ds)
        self.dv[:, c0:c1] += _transposed_product(dropped, do_t, scratch.dv)
        if kept is None:
            np.matmul(rows.do_a, v_a.transpose(0, 2, 1), out=ds)  # dp - D
        else:  # dp of the dropped weights: (dp * kept) - D
            np.matmul(do_t, v_a[..., :d_v].transpose(0, 2, 1), out=ds)
            ds *= kept
            ds += rows.do_a[..., d_v:]
        ds *= p
        attended = None
        if hidden is not None:
            np.copyto(ds, 0.0, where=hidden)  # NaN in a hidden value stops here
            if not np.isfinite(k_c).all():
                attended = ~np.broadcast_to(hidden, ds.shape)
        if self.dbias is not None:
            self._bias_gradient(ds, r0, r1, c0, c1)
        if self.relative is not None:  # an additive change: its gradient is ds
            relative, dtable = self.relative
            relative.table_gradient(ds, Tile(self.item, r0, r1, c0, c1), dtable)
        if factor is not None:  # through soft-capping and score_mod to the scaled scores
            ds *= factor
            if hidden is not None:
                np.copyto(ds, 0.0, where=hidden)
        part = scratch.part[: G * R * d_k].reshape(G, R, d_k)
        rows.dq += _product(ds, k_c, attended, out=part)
        self.dk[:, c0:c1] += _transposed_product(ds, q_t, scratch.dk)

    def _weights(
        self,
        rows: _Rows,
        k_a: np.ndarray,
        hidden: np.ndarray | None,
        r0: int,
        r1: int,
        c0: int,
        c1: int,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The forward's weights of the tile, recomputed: ``p (G, R, w)``, 0 where hidden,
        and the derivative of the scores' changes (``None``: none)."""
        G, group, w, scores = self.G, self.group, c1 - c0, self.scores
        p = self.scratch.p[: G * group * (r1 - r0) * w].reshape(G, group * (r1 - r0), w)
        np.matmul(rows.q_a, k_a.transpose(0, 2, 1), out=p)  # the scores less the log-sum-exp
        factor = None
        if scores is not None and scores.changes_scores:  # the forward's changes, recomputed
            factor = scores.apply(p, self.item, r0, r1, c0, c1, derivative=scores.nonlinear)
            if rows.shift is not None:
                p += rows.shift[..., None]
        bias = _stack(self.item.bias_block(r0, r1, c0, c1), G, group, r1 - r0, w)
        if bias is not None:
            p += bias
        np.exp(p, out=p)
        if hidden is not None:  # after exp: exp(-inf) is slow in some NumPy builds
            np.copyto(p, 0.0, where=hidden)
        return p, factor

    def _kept(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """The dropout's scale of the tile's weights (0 where dropped), stacked."""
        assert self.dropout is not None
        dropout, flat, h0 = self.dropout
        heads = self.G * self.group
        scaled = dropout.scale(flat, h0, heads, r0, r1, c0, c1, self.dtype)
        return scaled.reshape(self.G, self.group * (r1 - r0), c1 - c0)

    def _bias_gradient(self, ds: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> None:
        """``ds`` into the bias's gradient, summed over the axes the bias broadcasts along."""
        dbias = self.dbias
        assert dbias is not None
        cell = ds.reshape(self.G * self.group, r1 - r0, c1 - c0)
        axes = tuple(a for a in range(3) if dbias.shape[a] == 1)
        rows = slice(r0, r1) if dbias.shape[1] != 1 else slice(None)
        cols = slice(c0, c1) if dbias.shape[2] != 1 else slice(None)
        dbias[:, rows, cols] += cell.sum(axis=axes, keepdims=True) if axes else cell


def _transposed_product(a: np.ndarray, b: np.ndarray, buffer: np.ndarray) -> np.ndarray:
    """``a^T @ b`` for ``a (G, R, w)`` and ``b (G, R, d)``, through ``buffer``. In float64 it
    is computed as ``(b^T @ a)^T``: OpenBLAS's float64 kernels ran that form 2-15% faster at
    these shapes on an AVX-512 Xeon (its float32 kernels ran both alike or slower)."""
    G, w, d = a.shape[0], a.shape[-1], b.shape[-1]
    if a.dtype.itemsize == 8:
        part = buffer[: G * d * w].reshape(G, d, w)
        return np.matmul(b.transpose(0, 2, 1), a, out=part).transpose(0, 2, 1)
    return np.matmul(a.transpose(0, 2, 1), b, out=buffer[: G * w * d].reshape(G, w, d))
