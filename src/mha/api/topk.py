"""The top ``k`` of each row as ``torch.topk`` picks them on the CPU, ties included.

A sparse attention's indexer (:mod:`.sparse`) keeps each query's ``k`` best-scored keys.
Where the ``k``-th best score is shared by more keys than places remain, which of them
``torch.topk`` keeps is not documented: its CPU kernel pairs each value with its index and
runs ``std::partial_sort`` (when ``64 k <= n``) or ``std::nth_element`` (otherwise) with the
comparison ``a > b``, and the keys it keeps are those the C++ standard library's algorithms
leave in the first ``k`` places. :func:`top_k` settles every row whose choice the values fix
alone (no tie across the ``k``-th place) with NumPy, and replays those algorithms, as
libstdc++ writes them, for the rows with such a tie (a ReLU indexer's zero scores, say).

>>> import numpy as np
>>> top_k(np.zeros((1, 10)), 3)[0].nonzero()[0].tolist()  # torch.topk: [8, 6, 7]
[6, 7, 8]
"""

from __future__ import annotations

import numpy as np

__all__ = ["top_k"]

Item = tuple[float, int]
"""A value and its index, as torch's kernel pairs them."""


def top_k(rows: np.ndarray, k: int) -> np.ndarray:
    """Which entries of each row of ``rows (..., n)`` (real, no NaN; ``-inf`` allowed)
    ``torch.topk(rows, min(k, n))`` keeps: a boolean array shaped like ``rows``."""
    n = rows.shape[-1]
    k = min(k, n)
    if k == 0 or n == 0:
        return np.zeros(rows.shape, bool)
    kth = -np.partition(-rows, k - 1, axis=-1)[..., k - 1 : k]  # each row's k-th largest
    above, at = rows > kth, rows == kth
    kept: np.ndarray = above | at
    tied = above.sum(-1) + at.sum(-1) > k  # the k-th value is shared across the k-th place
    for index in zip(*np.nonzero(tied), strict=True):
        row = rows[index]
        kept[index] = False
        kept[index][_selected(row.tolist(), k)] = True
    return kept


def _selected(values: list[float], k: int) -> list[int]:
    """The indices ``torch.topk`` keeps of ``values`` (one row, ``0 < k <= len``)."""
    items = [(value, i) for i, value in enumerate(values)]
    if k * 64 <= len(items):
        _heap_select(items, 0, k, len(items))  # std::partial_sort's selection
    else:
        _introselect(items, 0, k - 1, len(items), 2 * (len(items).bit_length() - 1))
    return [i for _, i in items[:k]]


# libstdc++'s algorithms (bits/stl_algo.h, bits/stl_heap.h) with the comparison
# ``before(a, b) = a > b`` on the values, over items[first:last].


def _before(a: Item, b: Item) -> bool:
    return a[0] > b[0]


def _introselect(items: list[Item], first: int, nth: int, last: int, depth: int) -> None:
    while last - first > 3:
        if depth == 0:
            _heap_select(items, first, nth + 1, last)
            items[first], items[nth] = items[nth], items[first]
            return
        depth -= 1
        cut = _partition_pivot(items, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(items, first, last)


def _partition_pivot(items: list[Item], first: int, last: int) -> int:
    mid = first + (last - first) // 2
    _median_to_first(items, first, first + 1, mid, last - 1)
    return _unguarded_partition(items, first + 1, last, first)


def _median_to_first(items: list[Item], result: int, a: int, b: int, c: int) -> None:
    x, y, z = items[a], items[b], items[c]
    if _before(x, y):
        pick = b if _before(y, z) else c if _before(x, z) else a
    else:
        pick = a if _before(x, z) else c if _before(y, z) else b
    items[result], items[pick] = items[pick], items[result]


def _unguarded_partition(items: list[Item], first: int, last: int, pivot: int) -> int:
    while True:
        while _before(items[first], items[pivot]):
            first += 1
        last -= 1
        while _before(items[pivot], items[last]):
            last -= 1
        if not first < last:
            return first
        items[first], items[last] = items[last], items[first]
        first += 1


def _insertion_sort(items: list[Item], first: int, last: int) -> None:
    if first == last:
        return
    for i in range(first + 1, last):
        value = items[i]
        if _before(value, items[first]):
            items[first + 1 : i + 1] = items[first:i]
            items[first] = value
        else:
            j = i
            while _before(value, items[j - 1]):
                items[j] = items[j - 1]
                j -= 1
            items[j] = value


def _heap_select(items: list[Item], first: int, middle: int, last: int) -> None:
    _make_heap(items, first, middle)
    for i in range(middle, last):
        if _before(items[i], items[first]):
            value = items[i]
            items[i] = items[first]
            _adjust_heap(items, first, 0, middle - first, value)


def _make_heap(items: list[Item], first: int, last: int) -> None:
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(items, first, parent, length, items[first + parent])
        if parent == 0:
            return
        parent -= 1


def _adjust_heap(items: list[Item], first: int, hole: int, length: int, value: Item) -> None:
    top, child = hole, hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _before(items[first + child], items[first + child - 1]):
            child -= 1
        items[first + hole] = items[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        items[first + hole] = items[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and _before(items[first + parent], value):
        items[first + hole] = items[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    items[first + hole] = value
