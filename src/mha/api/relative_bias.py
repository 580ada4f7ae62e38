"""A learned relative-position bias as a score change: T5's bucketed bias (bidirectional or
causal) and CPM-Ant's, whose bucket also depends on each token's segment. It is given as
``score_mod=`` (FlexAttention writes it the same way, a bias looked up per ``(h, q_idx,
kv_idx)``), computed per tile from the positions (:mod:`mha._kernel.relative`), with the
table's gradient (``"relative_bias"`` among a backward's gradients), and with a cache the
positions of the cached keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_float_array, positive_int
from .._kernel.relative import LAWS, RelativeBias, position_buckets
from ..errors import AttentionTypeError, AttentionValueError, ShapeError

__all__ = ["RelativeBias", "check_relative_bias", "position_buckets", "relative_position_bias"]


def relative_position_bias(
    table: Any,
    law: str = "bidirectional",
    *,
    num_buckets: Any = None,
    max_distance: Any = 128,
    segments: Any = None,
    num_segments: Any = None,
) -> RelativeBias:
    """A learned relative-position bias, for ``score_mod=``: ``table (H, T)`` one logit per
    head and bucket, added to head ``h``'s score of query ``i`` and key ``j`` at
    ``table[h, bucket(i, j)]``. ``law``: ``"bidirectional"`` (T5's encoder), ``"causal"``
    (T5's decoder), both with ``T = num_buckets`` (default: the table's width) and
    ``max_distance`` (where the log-scaled buckets end; farther keys take the last), or
    ``"segments"`` (CPM-Ant: the bidirectional bucket within a segment, the bucket
    ``num_buckets + s_i * num_segments + s_j`` across two, ``T = num_buckets +
    num_segments ** 2`` for ``num_segments`` segments), with ``segments (P,)`` or ``(B,
    P)`` (``B`` the batch flattened), the segment of every position the call reaches (a
    cache's too).

    >>> import numpy as np, mha
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 2, 5, 4))
    >>> table = rng.standard_normal((2, 8))
    >>> bias = mha.relative_position_bias(table, max_distance=16)
    >>> out = mha.scaled_dot_product_attention(q, k, v, score_mod=bias)
    >>> at = mha.position_buckets(np.arange(5)[None] - np.arange(5)[:, None], 8, 16, True)
    >>> dense = mha.scaled_dot_product_attention(q, k, v, bias=table[:, at][None])
    >>> bool(np.allclose(out, dense, rtol=0, atol=1e-15))
    True
    """
    if law not in LAWS:
        raise AttentionValueError(f"law must be one of {', '.join(LAWS)}; got {law!r}")
    values = as_float_array("table", table)
    if values.ndim != 2:
        raise ShapeError(
            f"table must have shape (H, T), one logit per head and bucket; got {values.shape}"
        )
    if not np.isfinite(values).all():
        raise AttentionValueError("table must be finite")
    T = values.shape[1]
    groups = 0
    if law == "segments":
        if num_segments is None or segments is None:
            raise AttentionValueError("law='segments' needs segments= and num_segments=")
        groups = positive_int("num_segments", num_segments)
    buckets = positive_int(
        "num_buckets", T - groups * groups if num_buckets is None else num_buckets
    )
    distance = positive_int("max_distance", max_distance)
    if buckets + groups * groups != T:
        raise ShapeError(
            f"table has {T} buckets per head; law={law!r} takes num_buckets"
            + (" + num_segments ** 2" if groups else "")
            + f" = {buckets + groups * groups}"
        )
    exact = buckets // 4 if law != "causal" else buckets // 2  # the distances kept exact
    if exact < 1 or distance <= exact:
        raise AttentionValueError(
            f"num_buckets={buckets} and max_distance={distance} leave no log-scaled buckets: "
            "T5's law needs max_distance past the exact half"
        )
    held = None
    if law == "segments":
        held = np.asarray(segments)
        if held.dtype.kind not in "iu" or held.ndim not in (1, 2):
            raise AttentionTypeError(
                f"segments must be integers, shape (P,) or (B, P); got {held.dtype} {held.shape}"
            )
        if held.size and (held.min() < 0 or held.max() >= groups):
            raise AttentionValueError(f"segments must lie in [0, num_segments={groups})")
        held = held.reshape(-1, held.shape[-1]).astype(np.int64)
    elif segments is not None:
        raise AttentionValueError(f"segments= belongs to law='segments', not law={law!r}")
    return RelativeBias(np.array(values, np.float64), law, buckets, distance, held, groups)


def check_relative_bias(bias: RelativeBias, H: int) -> RelativeBias:
    """``bias`` for a call of ``H`` query heads (its table holds one row per head)."""
    if bias.table.shape[0] != H:
        raise ShapeError(
            f"the relative-position bias's table holds {bias.table.shape[0]} heads; the call "
            f"has {H} query heads"
        )
    return bias
