"""The backward pass: FlashAttention-2's, written for NumPy beside the forward.

Nothing of size ``L x S`` is kept from the forward pass: only q, k, v, the output and each
row's log-sum-exp ``lse``. Each tile's probabilities are recomputed from them::

    s  = (q * scale) @ k_tile.T + bias_tile        hidden pairs overwritten with -inf
    p  = exp(s - lse)                              exactly the forward's weights
    dv_tile += p.T @ dO
    dp = dO @ v_tile.T
    ds = p * (dp - D),   D = rowsum(dO * O)        ds = 0 where the key is hidden
    dq += ds @ k_tile * scale,   dk_tile += ds.T @ (q * scale),   dbias_tile = ds

A work item is one ``(*batch, key/value head)``: it owns that head's ``dk`` and ``dv`` and
its query heads' ``dq``, so the workers share no accumulator and need no lock. The tiles an
item visits are the forward's: causal tiles above the diagonal and window tiles below the
band are skipped, padded rows and keys are never visited. Grouped query heads are stacked
into one tile, so their ``dk``/``dv`` contributions sum in the GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .contract import Visibility
from .dropout import Dropout
from .forward import DEFAULT_MAX_MEMORY, _cast, _product, plan_tiles
from .team import Team

__all__ = ["attend_backward"]


def attend_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    visibility: Visibility,
    scale: float,
    *,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    dbias: np.ndarray | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    team: Team | None = None,
    dropout: Dropout | None = None,
) -> None:
    """Fill ``dq`` and ``dk``, ``dv`` (and ``dbias``, shaped like ``visibility.bias``: the
    bias's own size, never the scores'), the last three arriving zeroed, with the gradients
    of ``sum(grad_out * out)`` for the attention :func:`attend` computed. ``dq`` may be
    ``grad_out`` itself: each tile of rows reads its rows of ``grad_out`` before it writes
    them to ``dq``, so the caller needs no buffer.

    Shapes are the forward's: ``q (*batch, H, L, d_k)``, ``k (*batch, H_kv, S, d_k)``,
    ``v (*batch, H_kv, S, d_v)``, ``out`` and ``grad_out (*batch, H, L, d_v)``,
    ``lse (*batch, H, L)``; everything in ``dq.dtype`` (float32 or wider). ``dropout`` is
    the forward's, whose mask is regenerated tile by tile: ``dv`` takes the dropped weights
    and ``dp`` the mask, while ``D = rowsum(dO * O)`` already includes it.
    """
    H, L, d_k = q.shape[-3], q.shape[-2], q.shape[-1]
    H_kv, S, d_v = k.shape[-3], k.shape[-2], v.shape[-1]
    group = H // H_kv
    dtype = dq.dtype
    # Two tiles of scores (p and ds) instead of one: half the forward's budget for each.
    # When all of a head's rows fit, a work item takes several key/value heads (batched
    # GEMMs), which keeps Python's per-tile cost small for short sequences.
    tiles = plan_tiles(L, S, H_kv, d_k, d_v, dtype.itemsize, max_memory // 2, False, group)
    items = [
        (batch, slice(h, min(h + tiles.heads, H_kv)))
        for batch in np.ndindex(q.shape[:-3])
        for h in range(0, H_kv, tiles.heads)
    ]
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
                out[batch][heads], grad_out[batch][heads], item, scale, tiles, dtype,
                dq[batch][heads], dk[batch][kv], dv[batch][kv],
                None if own is None else _bias_cells(own, batch, heads), drop, scratch,
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


def _item_backward(
    q: np.ndarray,  # (G * group, L, d_k)
    k: np.ndarray,  # (G, S, d_k)
    v: np.ndarray,  # (G, S, d_v)
    lse: np.ndarray,  # (G * group, L)
    out: np.ndarray,  # (G * group, L, d_v): the forward's output
    grad_out: np.ndarray,  # (G * group, L, d_v)
    item: Any,
    scale: float,
    tiles: Any,
    dtype: np.dtype,
    dq: np.ndarray,  # (G * group, L, d_k), written
    dk: np.ndarray,  # (G, S, d_k), accumulated
    dv: np.ndarray,  # (G, S, d_v), accumulated
    dbias: np.ndarray | None,  # (G * group or 1, L or 1, S or 1), accumulated
    drop: Callable[[int, int, int, int], np.ndarray] | None,
    scratch: _Scratch,
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
        start, stop = item.key_start(r0, r1), item.key_stop(r0, r1)
        if stop <= start:
            dq[:, r0:r1] = 0.0
            continue
        q_t = np.multiply(q[:, r0:r1], scale, dtype=dtype).reshape(G, R, d_k)
        do_t = _cast(grad_out[:, r0:r1], dtype).reshape(G, R, d_v)
        lse_t = lse[:, r0:r1].reshape(G, R)
        lse_t = np.where(lse_t == -np.inf, np.inf, lse_t)[..., None]  # rows seeing no key
        o_t = _cast(out[:, r0:r1], dtype).reshape(G, R, d_v)
        D_t = np.einsum("grd,grd->gr", do_t, o_t)[..., None]  # rowsum(dO * O)
        do_t = do_t.copy() if np.may_share_memory(do_t, dq) else do_t  # dq may be grad_out
        dq_t = scratch.dq[: G * R * d_k].reshape(G, R, d_k)
        dq_t.fill(0.0)
        for c0 in range(start, stop, tiles.cols):
            c1 = min(c0 + tiles.cols, stop)
            w = c1 - c0
            hidden = _tile(item.hidden(r0, r1, c0, c1), G, group, n, w)
            if hidden is not None and hidden.all():
                continue
            k_c, v_c = _cast(k[:, c0:c1], dtype), _cast(v[:, c0:c1], dtype)
            p = scratch.p[: G * R * w].reshape(G, R, w)
            np.matmul(q_t, k_c.transpose(0, 2, 1), out=p)  # the scores
            bias = _tile(item.bias_block(r0, r1, c0, c1), G, group, n, w)
            if bias is not None:
                p += bias
            if hidden is not None:
                np.copyto(p, -np.inf, where=hidden)
            p -= lse_t
            np.exp(p, out=p)  # the forward's weights, recomputed
            ds = scratch.ds[: G * R * w].reshape(G, R, w)
            kept = None if drop is None else drop(r0, r1, c0, c1)
            dropped = p if kept is None else np.multiply(p, kept, out=ds)
            part = scratch.dv[: G * w * d_v].reshape(G, w, d_v)
            dv[:, c0:c1] += np.matmul(dropped.transpose(0, 2, 1), do_t, out=part)
            np.matmul(do_t, v_c.transpose(0, 2, 1), out=ds)  # dp (of the dropped weights)
            if kept is not None:
                ds *= kept
            ds -= D_t
            ds *= p
            attended = None
            if hidden is not None:
                np.copyto(ds, 0.0, where=hidden)  # NaN in a hidden value stops here
                if not np.isfinite(k_c).all():
                    attended = ~hidden
            dq_t += _product(ds, k_c, attended, out=scratch.part[: G * R * d_k].reshape(G, R, d_k))
            part = scratch.dk[: G * w * d_k].reshape(G, w, d_k)
            dk[:, c0:c1] += np.matmul(ds.transpose(0, 2, 1), q_t, out=part)
            if dbias is not None:  # ds, summed over the axes the bias broadcasts along
                cell = ds.reshape(G * group, n, w)
                axes = tuple(a for a in range(3) if dbias.shape[a] == 1)
                rows = slice(r0, r1) if dbias.shape[1] != 1 else slice(None)
                cols = slice(c0, c1) if dbias.shape[2] != 1 else slice(None)
                dbias[:, rows, cols] += cell.sum(axis=axes, keepdims=True) if axes else cell
        dq[:, r0:r1] = (dq_t * scale).reshape(G * group, n, d_k)


def _tile(block: np.ndarray | None, G: int, group: int, n: int, w: int) -> np.ndarray | None:
    """A mask or bias block for the ``G * group`` query heads, broadcast and stacked as the
    tile's ``(G, group * n, w)`` (its size-1 axes really broadcast, never reinterpreted)."""
    if block is None:
        return None
    return np.broadcast_to(block, (G * group, n, w)).reshape(G, group * n, w)
