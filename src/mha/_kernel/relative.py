"""A learned relative-position bias (T5, CPM-Ant): a table of one logit per head and bucket,
added to the scores at the bucket of each query and key, computed tile by tile from their
positions (:meth:`ItemVisibility.query_positions`), never as an ``(L, S)`` array.

The buckets are T5's: the first half of the distances exactly, the rest on a log scale up to
``max_distance``, computed in float32 as transformers computes them (``torch.log`` of a
float32 ratio, then truncated), so that a bucket at the edge of two falls as the model's does.

* ``"bidirectional"`` (T5's encoder, CPM-Ant): half the buckets for keys after the query;
* ``"causal"`` (T5's decoder): keys at or before the query, by their distance alone;
* ``"segments"`` (CPM-Ant): the bidirectional bucket where the query and the key are in the
  same segment, else the bucket ``num_buckets + segment_q * num_segments + segment_k``; each
  position's segment is the call's ``segments (B or 1, P)``.

Its gradient is the scores' gradient summed per head over the cells of each bucket
(:meth:`RelativeBias.table_gradient`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..errors import AttentionValueError
from .item import ItemVisibility
from .scores import Tile

__all__ = ["LAWS", "RelativeBias", "position_buckets"]

LAWS = ("bidirectional", "causal", "segments")


def position_buckets(
    relative: np.ndarray, num_buckets: int, max_distance: int, bidirectional: bool
) -> np.ndarray:
    """T5's bucket of each ``relative = key position - query position`` (int64), among
    ``num_buckets`` (half of them for keys after the query when ``bidirectional``, none
    when not: those keys take bucket 0), log-scaled up to ``max_distance``, as transformers'
    ``_relative_position_bucket`` computes it (its float32 logarithm).

    >>> import mha
    >>> mha.position_buckets([-9, -1, 0, 1, 9, 100], 8, 16, True).tolist()
    [3, 1, 0, 5, 7, 7]
    >>> mha.position_buckets([-9, -1, 0, 1], 8, 16, False).tolist()
    [6, 1, 0, 0]
    """
    relative = np.asarray(relative, dtype=np.int64)
    buckets = np.zeros(relative.shape, np.int64)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        distance = np.abs(relative)
    else:
        distance = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    ratio = np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact)
    with np.errstate(divide="ignore"):
        scaled = np.log(ratio) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + (scaled * np.float32(num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    buckets += np.where(distance < max_exact, distance, large)
    return buckets


@dataclass(frozen=True, eq=False)
class RelativeBias:
    """The bias ``table[h, bucket(query, key)]`` of each head's scores (see the module's
    docstring): ``table (H, T)`` float64, the ``law`` of :data:`LAWS`, T5's ``num_buckets``
    and ``max_distance``, and for ``"segments"`` the segment of each position ``segments
    (B or 1, P)`` (int64) and ``num_segments`` (``T = num_buckets + num_segments ** 2``)."""

    table: np.ndarray
    law: str
    num_buckets: int
    max_distance: int
    segments: np.ndarray | None = None
    num_segments: int = 0
    nonlinear = False
    compiled = False

    def block(self, sequences: np.ndarray) -> RelativeBias:
        """This bias for the batch block of the call's flat ``sequences``, numbered from 0."""
        segments = self.segments
        if segments is None or segments.shape[0] == 1:
            return self
        return replace(self, segments=segments[sequences])

    def buckets(self, item: ItemVisibility, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """The bucket of rows ``[r0, r1)`` against key slots ``[c0, c1)``, ``(n, w)``."""
        q_at, k_at = item.query_positions(r0, r1), item.key_positions(c0, c1)
        relative = k_at[None, :] - q_at[:, None]
        law = self.law
        buckets = position_buckets(relative, self.num_buckets, self.max_distance, law != "causal")
        if law != "segments":
            return buckets
        segments = self.segments
        assert segments is not None
        row = segments[0 if segments.shape[0] == 1 else item.sequence]
        first = min(q_at.min(initial=0), k_at.min(initial=0))
        last = max(q_at.max(initial=0), k_at.max(initial=0))
        if first < 0 or last >= row.shape[0]:
            raise AttentionValueError(
                f"segments holds the segment of {row.shape[0]} positions, but the call "
                f"reaches position {last if first >= 0 else first}: give one segment per "
                "position, the cached ones included (queries past the keys sit at negative "
                "positions: give the keys of every query)"
            )
        seg_q, seg_k = row[q_at][:, None], row[k_at][None, :]
        across = self.num_buckets + seg_q * self.num_segments + seg_k
        return np.where(seg_q == seg_k, buckets, across)

    def apply(self, s: np.ndarray, tile: Tile, derivative: bool) -> np.ndarray | None:
        item, r0, r1, c0, c1 = tile
        n, w = r1 - r0, c1 - c0
        bias = self.table[item.heads][:, self.buckets(item, r0, r1, c0, c1)]  # (G, n, w)
        stacked = s.reshape(s.size // max(1, n * w), n, w)
        stacked += bias.astype(s.dtype, copy=False)
        return None

    def table_gradient(self, ds: np.ndarray, tile: Tile, into: np.ndarray) -> None:
        """The scores' gradient ``ds (G, group * n, w)`` of a tile into the table's
        gradient ``into (H, T)``: each head's cells summed per bucket."""
        item, r0, r1, c0, c1 = tile
        n, w, T = r1 - r0, c1 - c0, self.table.shape[1]
        flat = self.buckets(item, r0, r1, c0, c1).ravel()
        cells = ds.reshape(ds.size // max(1, n * w), n * w)
        for g, h in enumerate(range(item.heads.start, item.heads.stop)):
            into[h] += np.bincount(flat, weights=cells[g], minlength=T)
