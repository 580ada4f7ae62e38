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

A work item is one ``(*batch, key/value head)``: it owns that head's ``dk`` and ``dv`` and
its query heads' ``dq``, so the workers share no accumulator and need no lock. The tiles an
item visits are the forward's: causal tiles above the diagonal and window tiles below the
band are skipped, padded rows and keys are never visited. Grouped query heads are stacked
into one tile, so their ``dk``/``dv`` contributions sum in the GEMMs.

With numba, a call whose hidden keys are a band runs these steps as compiled code
(:func:`mha._kernel.compiled.backward_walk`, NumPy's BLAS for the five GEMMs), one task per
``(*batch, key/value head)``; the subtractions are then done in the sweep that takes ``exp``,
without the extra column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from . import walk
from .call import Gradients, KernelCall, Outputs
from .forward import _cast, _product, _stack, plan_tiles
from .scores import Scores, sink_gradient
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
    gradient (``lse`` is then the forward's, with the sinks).
    """
    q, k, v, visibility, scale = call.q, call.k, call.v, call.visibility, call.scale
    scores, dropout, max_memory = call.scores, call.dropout, call.budget
    out, lse = forward.out, forward.lse
    assert lse is not None  # the backward reads the forward's log-sum-exp
    dq, dk, dv, dbias, dsinks = grads.dq, grads.dk, grads.dv, grads.dbias, grads.dsinks
    dq_factor = grads.dq_factor
    visibility = visibility.classified(team)
    if dsinks is not None and scores is not None and scores.sinks is not None:
        dsinks += sink_gradient(out, lse, grad_out, scores.sinks)
    H, L, d_k = q.shape[-3], q.shape[-2], q.shape[-1]
    H_kv, S, d_v = k.shape[-3], k.shape[-2], v.shape[-1]
    group = H // H_kv
    dtype = dq.dtype
    # Two tiles of scores (p and ds) instead of one: half the forward's budget for each.
    # When all of a head's rows fit, a work item takes several key/value heads (batched
    # GEMMs), which keeps Python's per-tile cost small for short sequences.
    tiles = plan_tiles(L, S, H_kv, d_k, d_v, dtype.itemsize, max_memory // 2, False, group)
    call = replace(call, visibility=visibility)
    if walk.backward_walkable(call, forward, grad_out, grads):
        left = walk.run_backward(call, forward, grad_out, grads, tiles, team or Team(1))
        if not left:
            return
        # what the compiled walk left (a non-finite key some row cannot see): NumPy's walk
        tiles = replace(tiles, heads=1)
        items = left
    else:
        items = None
    items = (
        items
        if items is not None
        else [
            (batch, slice(h, min(h + tiles.heads, H_kv)))
            for batch in np.ndindex(q.shape[:-3])
            for h in range(0, H_kv, tiles.heads)
        ]
    )
    sums: list[np.ndarray] = []  # each worker's bias gradient: items may share its cells

    def make_worker() -> Callable[[Any], None]:
        scratch = _Scratch(tiles.heads, group * tiles.rows, tiles.cols, d_k, d_v, dtype)
        own = None
        if dbias is not None:
            own = np.zeros(dbias.shape, dtype)
            sums.append(own)

        def run(task: Any) -> None:
            batch, kv = task
            heads = slice(kv.start * group, kv.stop * group)
            item = visibility.item(batch, heads)
            drop = None
            if dropout is not None:
                index = int(np.ravel_multi_index(batch, q.shape[:-3])) if batch else 0
                G = kv.stop - kv.start

                def drop(r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
                    scaled = dropout.scale(index, heads.start, G * group, r0, r1, c0, c1, dtype)
                    return scaled.reshape(G, group * (r1 - r0), c1 - c0)

            _item_backward(
                q[batch][heads], k[batch][kv], v[batch][kv], lse[batch][heads],
                out[batch][heads], grad_out[batch][heads], item, scale, scale * dq_factor,
                tiles, dtype,
                dq[batch][heads], dk[batch][kv], dv[batch][kv],
                None if own is None else _bias_cells(own, batch, heads), drop, scratch, scores,
            )  # fmt: skip

        return run

    (team or Team(1)).run(items, make_worker)
    if dbias is not None:
        for part in sums:
            dbias += part


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


def _item_backward(
    q: np.ndarray,  # (G * group, L, d_k)
    k: np.ndarray,  # (G, S, d_k)
    v: np.ndarray,  # (G, S, d_v)
    lse: np.ndarray,  # (G * group, L)
    out: np.ndarray,  # (G * group, L, d_v): the forward's output
    grad_out: np.ndarray,  # (G * group, L, d_v)
    item: Any,
    scale: float,
    dq_scale: float,
    tiles: Any,
    dtype: np.dtype,
    dq: np.ndarray,  # (G * group, L, d_k), written
    dk: np.ndarray,  # (G, S, d_k), accumulated
    dv: np.ndarray,  # (G, S, d_v), accumulated
    dbias: np.ndarray | None,  # (G * group or 1, L or 1, S or 1), accumulated
    drop: Callable[[int, int, int, int], np.ndarray] | None,
    scratch: _Scratch,
    scores: Scores | None = None,
) -> None:
    """The gradients of ``G`` key/value heads and their query heads, whose rows are stacked
    per key/value head into tiles of ``R = group * n`` rows, as in the forward pass."""
    G, d_k, d_v = k.shape[0], q.shape[-1], v.shape[-1]
    group = q.shape[0] // G
    dq[:, item.query_end :] = 0.0  # padded rows: no gradient
    for r0 in range(0, item.query_end, tiles.rows):
        r1 = min(r0 + tiles.rows, item.query_end)
        n = r1 - r0
        R = group * n
        ranges = item.key_ranges(r0, r1)
        if not ranges:
            dq[:, r0:r1] = 0.0
            continue
        # Both subtractions ride on GEMMs as one extra column: s - lse = [q, -lse] @ [k, 1]^T
        # and dp - D = [dO, -D] @ [v, 1]^T, which costs BLAS far less than two passes.
        q_a = scratch.q_aug[: G * R * (d_k + 1)].reshape(G, R, d_k + 1)
        np.multiply(q[:, r0:r1].reshape(G, R, d_k), scale, out=q_a[..., :d_k], dtype=dtype)
        lse_t = lse[:, r0:r1].reshape(G, R)
        # (not np.negative(..., out=): NumPy 2.4 writes a (G, 1) slice's negation into this
        # strided column from the wrong elements)
        q_a[..., d_k] = -lse_t
        q_a[..., d_k][lse_t == -np.inf] = -np.inf  # rows seeing no key: p = 0
        shift = None
        if scores is not None and scores.nonlinear:  # the raw scores first, then - lse
            shift = q_a[..., d_k].copy()
            q_a[..., d_k] = 0.0
        do_a = scratch.do_aug[: G * R * (d_v + 1)].reshape(G, R, d_v + 1)
        np.copyto(do_a[..., :d_v], grad_out[:, r0:r1].reshape(G, R, d_v))
        o_t = _cast(out[:, r0:r1], dtype).reshape(G, R, d_v)
        D = np.einsum("grd,grd->gr", do_a[..., :d_v], o_t)  # rowsum(dO * O)
        do_a[..., d_v] = -D
        dq_t = scratch.dq[: G * R * d_k].reshape(G, R, d_k)
        dq_t.fill(0.0)
        for c0, c1 in item.key_tiles(r0, r1, ranges[0][0], ranges[-1][1], tiles.cols):
            w = c1 - c0
            # only the rows that can see this key tile (the diagonal's, a window's edge)
            a, b = item.rows_seeing(r0, r1, c0, c1) if group == 1 else (r0, r1)
            if a == b:
                continue
            k_a = scratch.k_aug[: G * w * (d_k + 1)].reshape(G, w, d_k + 1)
            v_a = scratch.v_aug[: G * w * (d_v + 1)].reshape(G, w, d_v + 1)
            np.copyto(k_a[..., :d_k], k[:, c0:c1])
            np.copyto(v_a[..., :d_v], v[:, c0:c1])
            k_a[..., d_k] = 1.0
            v_a[..., d_v] = 1.0
            rows = slice(a - r0, b - r0) if group == 1 else slice(None)
            _tile_backward(
                q_a[:, rows], do_a[:, rows], k_a, v_a, dq_t[:, rows], dk[:, c0:c1],
                dv[:, c0:c1], item, a, b, c0, c1, G, group, dbias, drop, scratch, scores,
                None if shift is None else shift[:, rows],
            )  # fmt: skip
        np.multiply(dq_t.reshape(G * group, n, d_k), dq_scale, out=dq[:, r0:r1])


def _tile_backward(
    q_a: np.ndarray,  # (G, R, d_k + 1): [q * scale, -lse]
    do_a: np.ndarray,  # (G, R, d_v + 1): [dO, -D]
    k_a: np.ndarray,  # (G, w, d_k + 1): [k, 1]
    v_a: np.ndarray,  # (G, w, d_v + 1): [v, 1]
    dq_t: np.ndarray,  # (G, R, d_k), accumulated (unscaled)
    dk: np.ndarray,  # (G, w, d_k), accumulated
    dv: np.ndarray,  # (G, w, d_v), accumulated
    item: Any,
    r0: int,
    r1: int,
    c0: int,
    c1: int,
    G: int,
    group: int,
    dbias: np.ndarray | None,
    drop: Callable[[int, int, int, int], np.ndarray] | None,
    scratch: _Scratch,
    scores: Scores | None = None,
    shift: np.ndarray | None = None,  # (G, R): -lse, when q_a's last column is 0
) -> None:
    """One tile's share of the gradients: rows ``[r0, r1)`` of the query heads (stacked
    ``R = group * n`` rows per key/value head) against keys ``[c0, c1)``."""
    n, w = r1 - r0, c1 - c0
    R, d_k, d_v = group * n, k_a.shape[-1] - 1, v_a.shape[-1] - 1
    hidden = _stack(item.hidden(r0, r1, c0, c1), G, group, n, w)
    if hidden is not None and hidden.all():
        return
    k_c, q_t, do_t = k_a[..., :d_k], q_a[..., :d_k], do_a[..., :d_v]
    p = scratch.p[: G * R * w].reshape(G, R, w)
    np.matmul(q_a, k_a.transpose(0, 2, 1), out=p)  # the scores less the log-sum-exp
    factor = None
    if scores is not None and scores.changes_scores:  # the forward's changes, recomputed
        factor = scores.apply(p, item, r0, r1, c0, c1, derivative=scores.nonlinear)
        if shift is not None:
            p += shift[..., None]
    bias = _stack(item.bias_block(r0, r1, c0, c1), G, group, n, w)
    if bias is not None:
        p += bias
    np.exp(p, out=p)  # the forward's weights, recomputed
    if hidden is not None:  # after exp: exp(-inf) is slow in some NumPy builds
        np.copyto(p, 0.0, where=hidden)
    ds = scratch.ds[: G * R * w].reshape(G, R, w)
    kept = None if drop is None else drop(r0, r1, c0, c1)  # kept weights' scale, 0 if dropped
    dropped = p if kept is None else np.multiply(p, kept, out=ds)
    dv += _transposed_product(dropped, do_t, scratch.dv)
    if kept is None:
        np.matmul(do_a, v_a.transpose(0, 2, 1), out=ds)  # dp - D
    else:  # dp of the dropped weights: (dp * kept) - D
        np.matmul(do_t, v_a[..., :d_v].transpose(0, 2, 1), out=ds)
        ds *= kept
        ds += do_a[..., d_v:]
    ds *= p
    attended = None
    if hidden is not None:
        np.copyto(ds, 0.0, where=hidden)  # NaN in a hidden value stops here
        if not np.isfinite(k_c).all():
            attended = ~np.broadcast_to(hidden, ds.shape)
    if dbias is not None:  # ds, summed over the axes the bias broadcasts along
        cell = ds.reshape(G * group, n, w)
        axes = tuple(a for a in range(3) if dbias.shape[a] == 1)
        rows = slice(r0, r1) if dbias.shape[1] != 1 else slice(None)
        cols = slice(c0, c1) if dbias.shape[2] != 1 else slice(None)
        dbias[:, rows, cols] += cell.sum(axis=axes, keepdims=True) if axes else cell
    if factor is not None:  # through soft-capping and score_mod to the scaled scores
        ds *= factor
        if hidden is not None:
            np.copyto(ds, 0.0, where=hidden)
    dq_t += _product(ds, k_c, attended, out=scratch.part[: G * R * d_k].reshape(G, R, d_k))
    dk += _transposed_product(ds, q_t, scratch.dk)


def _transposed_product(a: np.ndarray, b: np.ndarray, buffer: np.ndarray) -> np.ndarray:
    """``a^T @ b`` for ``a (G, R, w)`` and ``b (G, R, d)``, through ``buffer``. In float64 it
    is computed as ``(b^T @ a)^T``: OpenBLAS's float64 kernels ran that form 2-15% faster at
    these shapes on an AVX-512 Xeon (its float32 kernels ran both alike or slower)."""
    G, w, d = a.shape[0], a.shape[-1], b.shape[-1]
    if a.dtype.itemsize == 8:
        part = buffer[: G * d * w].reshape(G, d, w)
        return np.matmul(b.transpose(0, 2, 1), a, out=part).transpose(0, 2, 1)
    return np.matmul(a.transpose(0, 2, 1), b, out=buffer[: G * w * d].reshape(G, w, d))
