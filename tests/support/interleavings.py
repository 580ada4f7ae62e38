"""Random interleavings of a paged cache's operations, drawn by hypothesis, with a model of
what each sequence should hold beside it (the tests of ``mha.PagedKVCache``, plain and
quantized, share the walk and check different models)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st


class History:
    """What a sequence holds: its keys and values ``(H_kv, n, d)`` as they were given."""

    def __init__(self, H_kv: int, d: int, dtype: Any = np.float64) -> None:
        self.keys = np.zeros((H_kv, 0, d), dtype)
        self.values = np.zeros((H_kv, 0, d), dtype)

    def copy(self) -> Any:
        return copy.copy(self)  # the arrays are replaced, never written: shared safely

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        self.keys = np.concatenate([self.keys, k.astype(self.keys.dtype)], axis=1)
        self.values = np.concatenate([self.values, v.astype(self.values.dtype)], axis=1)

    def truncate(self, n: int) -> None:
        self.keys, self.values = self.keys[:, :n], self.values[:, :n]


def interleave(
    data: Any,
    cache: Any,
    new: Callable[[], Any],
    attend: Callable[[dict[int, Any]], None],
    check: Callable[[dict[int, Any]], None] | None = None,
) -> None:
    """Up to 12 operations on ``cache`` drawn by ``data``: add (its model ``new()``), fork
    (the parent's model's ``copy()``), truncate (``truncate(n)``), release, and append:
    ``attend(models)`` makes one call appending to every sequence, appends to their models
    and checks the output. After each operation, ``check(models)`` and the pool's count of
    free blocks (none lost); at the end every sequence is released and every block free."""
    models: dict[int, Any] = {}
    next_id = 0
    for _ in range(data.draw(st.integers(1, 12), label="operations")):
        kinds = ["add"] + (["append", "append", "fork", "release", "truncate"] if models else [])
        kind = data.draw(st.sampled_from(kinds), label="operation")
        if kind == "add":
            cache.add(next_id)
            models[next_id] = new()
            next_id += 1
        elif kind == "fork":
            parent = data.draw(st.sampled_from(sorted(models)), label="parent")
            cache.fork(parent, next_id)
            models[next_id] = models[parent].copy()
            next_id += 1
        elif kind == "release":
            gone = data.draw(st.sampled_from(sorted(models)), label="released")
            cache.release(gone)
            del models[gone]
        elif kind == "truncate":
            seq = data.draw(st.sampled_from(sorted(models)), label="truncated")
            n = data.draw(st.integers(0, models[seq].keys.shape[1]), label="length")
            cache.truncate(seq, n)
            models[seq].truncate(n)
        else:
            attend(models)
        assert list(cache.sequences) == sorted(models)
        assert [cache.length(s) for s in cache.sequences] == [
            models[s].keys.shape[1] for s in cache.sequences
        ]
        if check is not None:
            check(models)
        held = {b for s in cache.sequences for b in cache.block_table([s])[0]}
        assert cache.num_free_blocks == cache.num_blocks - len(held)  # no block lost
    for seq in list(cache.sequences):
        cache.release(seq)
    assert cache.num_free_blocks == cache.num_blocks
