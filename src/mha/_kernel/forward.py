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

Masks are cut per tile: causal skips every tile above the diagonal and masks only tiles that
cross it; ``key_lengths`` and ``query_lengths`` bound the loops; boolean masks and bias are
sliced. Items run on a thread pool (NumPy releases the GIL in BLAS calls and ufuncs), with
BLAS limited to one thread inside the workers when threadpoolctl is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .contract import ItemVisibility, Visibility
from .team import Team

__all__ = ["DEFAULT_MAX_MEMORY", "Tiles", "attend", "plan_tiles"]

DEFAULT_MAX_MEMORY = 4 * 2**20
"""Bytes of scratch each worker may use for its tiles, unless the caller says otherwise."""

KEY_TILE = 512
"""Keys per tile when the memory budget allows it."""


@dataclass(frozen=True)
class Tiles:
    rows: int  # queries per tile
    cols: int  # keys per tile
    heads: int  # heads per work item (more than one only when a head's rows fit in a tile)


def plan_tiles(
    L: int,
    S: int,
    H: int,
    d_k: int,
    d_v: int,
    itemsize: int,
    max_memory: int,
    whole_rows: bool = False,
) -> Tiles:
    """Tile sizes whose scratch fits in ``max_memory`` bytes.

    A tile of ``rows x cols`` scores needs the scores themselves, a few boolean masks of the
    same size, the scaled query rows and two accumulators of width ``d_v``. ``whole_rows``
    keeps every key in one tile (used when the weights are returned). When all of a head's
    rows fit, several heads share a work item, which keeps Python's per-tile cost small.
    """
    per_pair = itemsize + 3
    per_row = (d_k + 2 * d_v + 6) * itemsize
    cols = max(1, S if whole_rows else min(S, KEY_TILE))
    rows = max_memory // (cols * per_pair + per_row)
    if rows < 16 and not whole_rows:  # a small budget: narrower key tiles keep rows useful
        rows = min(max(L, 1), 16)
        cols = max(1, min(cols, (max_memory // rows - per_row) // per_pair))
    rows = int(max(1, min(max(L, 1), rows)))
    heads = 1
    if rows >= L:
        heads = int(max(1, min(H, max_memory // (rows * (cols * per_pair + per_row)))))
    return Tiles(rows=rows, cols=int(cols), heads=heads)


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    visibility: Visibility,
    scale: float,
    out: np.ndarray,
    *,
    weights: np.ndarray | None = None,
    lse: np.ndarray | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    team: Team | None = None,
) -> None:
    """Fill ``out`` with attention of ``q`` over ``k`` and ``v``, per ``(*batch, head)``.

    ``q (*batch, H, L, d_k)``, ``k (*batch, H, S, d_k)``, ``v (*batch, H, S, d_v)`` may be
    strided views of any floating dtype; tiles are computed in ``out.dtype``, which must be
    float32 or wider. ``out (*batch, H, L, d_v)``, ``weights (*batch, H, L, S)`` and
    ``lse (*batch, H, L)`` (log-sum-exp of each row's logits) must arrive filled with 0, 0
    and ``-inf``: rows and items that see no key are not visited. ``scale`` is a Python
    float, so it never promotes float32 work to float64. Work items run on ``team``
    (serially without one).
    """
    H, L, S, d_k, d_v = q.shape[-3], q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    dtype = out.dtype
    tiles = plan_tiles(
        L, S, H, d_k, d_v, dtype.itemsize, max_memory, whole_rows=weights is not None
    )
    tasks = []
    for batch in np.ndindex(q.shape[:-3]):
        for h0 in range(0, H, tiles.heads):
            heads = slice(h0, min(h0 + tiles.heads, H))
            item = visibility.item(batch, heads)
            for r0 in range(0, min(L, item.query_end), tiles.rows):
                r1 = min(r0 + tiles.rows, item.query_end)
                stop = item.key_stop(r0, r1)
                if stop > 0:
                    cost = (heads.stop - heads.start) * (r1 - r0) * stop
                    tasks.append((cost, batch, heads, item, r0, r1, stop))
    tasks.sort(key=lambda task: task[0], reverse=True)  # longest first

    def make_worker() -> Callable[[Any], None]:
        scratch = _Scratch(tiles, d_k, d_v, dtype)

        def run(task: Any) -> None:
            _, batch, heads, item, r0, r1, stop = task
            _query_tile(
                q[batch][heads], k[batch][heads], v[batch][heads], item, scale, r0, r1, stop,
                tiles.cols, scratch, out[batch][heads],
                None if weights is None else weights[batch][heads],
                None if lse is None else lse[batch][heads],
            )  # fmt: skip

        return run

    (team or Team(1)).run(tasks, make_worker)


class _Scratch:
    """One worker's preallocated buffers, sized for the largest tile."""

    def __init__(self, tiles: Tiles, d_k: int, d_v: int, dtype: np.dtype) -> None:
        G, rows = tiles.heads, tiles.rows
        self.scores = np.empty(G * rows * tiles.cols, dtype=dtype)
        self.q = np.empty((G, rows, d_k), dtype=dtype)
        self.acc = np.empty((G, rows, d_v), dtype=dtype)
        self.pv = np.empty((G, rows, d_v), dtype=dtype)
        self.m = np.empty((G, rows), dtype=dtype)  # running maximum (-inf: no key seen yet)
        self.ref = np.empty((G, rows), dtype=dtype)  # the maximum used for exp, never -inf
        self.ref_new = np.empty((G, rows), dtype=dtype)
        self.total = np.empty((G, rows), dtype=dtype)  # running sum of exp(s - ref)


def _query_tile(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    item: ItemVisibility,
    scale: float,
    r0: int,
    r1: int,
    stop: int,
    key_tile: int,
    scratch: _Scratch,
    out: np.ndarray,
    weights: np.ndarray | None,
    lse: np.ndarray | None,
) -> None:
    """Rows ``[r0, r1)`` of ``G`` heads (``q (G, L, d_k)``) against keys ``[0, stop)``."""
    G, n = q.shape[0], r1 - r0
    dtype = out.dtype
    q_tile = q[:, r0:r1]
    if scale != 1.0 or q_tile.dtype != dtype:
        q_tile = np.multiply(q_tile, scale, out=scratch.q[:G, :n])
    m, ref, ref_new = scratch.m[:G, :n], scratch.ref[:G, :n], scratch.ref_new[:G, :n]
    total, acc, pv = scratch.total[:G, :n], scratch.acc[:G, :n], scratch.pv[:G, :n]
    s = scratch.scores[:0].reshape(G, n, 0)
    first = True
    for c0 in range(0, stop, key_tile):
        c1 = min(c0 + key_tile, stop)
        hidden = item.hidden(r0, r1, c0, c1)
        if hidden is not None and hidden.all():
            continue
        s = scratch.scores[: G * n * (c1 - c0)].reshape(G, n, c1 - c0)
        np.matmul(q_tile, _cast(k[:, c0:c1], dtype).transpose(0, 2, 1), out=s)
        bias = item.bias_block(r0, r1, c0, c1)
        if bias is not None:
            s += bias
        if hidden is not None:
            np.copyto(s, -np.inf, where=hidden)
        v_tile = _cast(v[:, c0:c1], dtype)
        attended = None if np.isfinite(v_tile).all() else s != -np.inf

        tile_max = s.max(axis=-1)
        if first:
            np.copyto(m, tile_max)
        else:
            unseen = m == -np.inf  # rows that saw no key before this tile: nothing to rescale
            np.maximum(m, tile_max, out=m)
        np.copyto(ref_new, m)
        ref_new[m == -np.inf] = 0.0  # rows with no visible key so far
        s -= ref_new[..., None]
        np.exp(s, out=s)
        if first:
            np.sum(s, axis=-1, out=total)
            _product(s, v_tile, attended, out=acc)
            first = False
        else:
            alpha = np.exp(ref - ref_new)  # rescales what earlier tiles accumulated
            alpha[unseen] = 0.0  # their ref was a stand-in 0: exp(0 - ref_new) may overflow
            total *= alpha
            total += s.sum(axis=-1)
            acc *= alpha[..., None]
            acc += _product(s, v_tile, attended, out=pv)
        ref, ref_new = ref_new, ref

    if first:  # every tile was hidden: the rows stay zero
        return
    empty = total == 0.0
    total[empty] = 1.0
    inverse = np.reciprocal(total, out=m)[..., None]  # multiplying is cheaper than dividing
    np.multiply(acc, inverse, out=out[:, r0:r1])
    if weights is not None:  # whole rows: s holds every key's exp(s - ref)
        np.multiply(s, inverse, out=weights[:, r0:r1, : s.shape[-1]])
    if lse is not None:
        row_lse = ref + np.log(total)
        row_lse[empty] = -np.inf
        lse[:, r0:r1] = row_lse


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
        return np.matmul(e, v, out=out)
    non_finite = ~np.isfinite(v)
    np.matmul(e, np.where(non_finite, 0.0, v), out=out)
    for j in np.flatnonzero(non_finite.any(axis=(0, 2))):
        v_j = np.where(non_finite[:, j], v[:, j], 0.0)[:, None, :]  # (G, 1, d_v)
        out += np.where(attended[:, :, j, None], e[:, :, j, None] * v_j, 0.0)
    return out
