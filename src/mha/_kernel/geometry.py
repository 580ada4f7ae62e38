"""The band: which keys the causal mask, the sliding window and the lengths leave to each
query, as the integer formulas both tile walks compute it with.

Query row ``r`` of a sequence aligned by ``offset`` has its own key at ``r + offset``. The
causal mask hides the keys after it, a window of ``window`` keys (itself included) the keys
at or before ``r + offset - window``, and the key length every key from ``key_end`` on. So
each row sees one run of keys, and a tile of keys ``[c0, c0 + w)`` shows each row the run
``[lo, hi)`` of its keys counted from ``c0``: the tile's band (:func:`band`). A tile whose
band hides nothing (:func:`cut` is false) needs no mask, and a tile no row sees
(:func:`rows_seeing` empty) is skipped.

Every function here is integer arithmetic on Python ints or NumPy's int64, each written once:
the NumPy walk calls them as they are (:class:`.item.ItemVisibility`; :func:`band` over an
array of rows at once), and the compiled walks compile them with numba (:mod:`._numba_walk`).
``window`` is :data:`NO_WINDOW` (``-1``) where there is none.

>>> import numpy as np
>>> band(np.arange(4), 0, 4, 0, True, 2)  # rows 0-3, keys 0-3: causal, a window of 2
(array([0, 0, 1, 2]), array([1, 2, 3, 4]))
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BLOCK",
    "EMPTY",
    "FULL",
    "NO_WINDOW",
    "PARTIAL",
    "band",
    "cut",
    "keys_seen",
    "rows_seeing",
]

NO_WINDOW = -1
"""``window`` when there is no sliding window."""

BLOCK = 128
"""Rows and keys per block of a ``mask_mod``'s block map (:mod:`.block_mask`; FlexAttention's
default block size), which both walks read."""

EMPTY, PARTIAL, FULL = 0, 1, 2
"""The block map's classes: no pair of a block visible, some, every one."""


def keys_seen(r0: int, r1: int, offset: int, key_end: int, causal: bool, window: int) -> Any:
    """The keys ``[start, stop)`` that some row of ``[r0, r1)`` may see by the key length, the
    causal mask and the window (none when ``start >= stop``)."""
    stop = min(key_end, r1 + offset) if causal else key_end
    start = max(0, r0 + offset - window + 1) if window >= 0 else 0
    return start, stop


def rows_seeing(r0: int, r1: int, c0: int, c1: int, offset: int, causal: bool, window: int) -> Any:
    """The rows ``[a, b)`` of ``[r0, r1)`` that may see some key of ``[c0, c1)`` by the causal
    mask and the window (none when ``a >= b``): the causal mask hides the keys from the rows
    before ``c0 - offset``, the window from the rows after ``c1 - 1 - offset + window``."""
    a = max(r0, c0 - offset) if causal else r0
    b = min(r1, c1 - 1 - offset + window) if window >= 0 else r1
    return a, b


def cut(r0: int, r1: int, c0: int, c1: int, offset: int, causal: bool, window: int) -> bool:
    """Whether the band hides some key of ``[c0, c1)`` from some row of ``[r0, r1)`` (rows
    and keys that :func:`rows_seeing` and :func:`keys_seen` left): the tile crosses the
    diagonal (the causal mask hides a key before ``c1`` from row ``r0``) or the window's
    edge (the window hides key ``c0`` from row ``r1 - 1``). Otherwise every row sees every
    key of it. Either alone: the other given as absent."""
    crosses_diagonal = causal and c1 - 1 > r0 + offset
    crosses_edge = window >= 0 and c0 <= r1 - 1 + offset - window
    return crosses_diagonal or crosses_edge


def band(r: Any, c0: int, c1: int, offset: int, causal: bool, window: int) -> Any:
    """Row ``r``'s visible keys ``[lo, hi)`` of the tile ``[c0, c1)`` by the causal mask and
    the window, counted from ``c0`` (``0 <= lo <= hi <= c1 - c0``); ``r`` an int, or an int64
    array of rows (and ``lo``, ``hi`` arrays of them)."""
    own, w = r + offset - c0, c1 - c0  # the row's own key, counted from c0
    lo, hi = own * 0, own * 0 + w  # (an int, or one for each row)
    # Each bound computed only where it applies (the compiled softmax step ran 2% slower
    # computing both for every row), and limited to [0, w] by comparisons, not by min and
    # max, which take no arrays: one formula serves an int and an array of rows.
    if causal:  # the keys after the row's own are hidden
        hi = own + 1
        hi = hi * (hi > 0)
        hi = hi - (hi > w) * (hi - w)
    if window >= 0:  # the keys before the window's first are hidden
        lo = own - window + 1
        lo = lo * (lo > 0)
        lo = lo - (lo > w) * (lo - w)
    return lo, hi
