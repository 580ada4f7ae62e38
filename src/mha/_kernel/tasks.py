"""The kernel's work items: one per ``(*batch, run of key/value heads)`` and tile of query
rows, over the keys its rows may see; when there are fewer than workers (decoding one token
against a long cache), their keys split into chunks whose partial results are merged by
their log-sum-exp (flash-decoding). The Python walk (:mod:`.forward`) and the compiled one
(:mod:`.walk`) share them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import runtime
from .item import ItemVisibility

__all__ = ["Parts", "Task", "batch_index", "merge_partials", "split_keys"]


@dataclass
class Task:
    batch: tuple[int, ...]
    kv: slice  # key/value heads
    item: ItemVisibility
    r0: int
    r1: int
    start: int  # keys [start, stop)
    stop: int
    part: int | None = None  # index into the split partial buffers

    @property
    def cost(self) -> int:
        heads: int = self.kv.stop - self.kv.start
        return heads * (self.r1 - self.r0) * (self.stop - self.start)


class Parts:
    """Tasks whose keys were split into chunks, each chunk's result in buffers of its own,
    merged into the caller's ``out`` and ``lse`` once every chunk is done."""

    def __init__(
        self, whole: list[Task], chunks: list[list[Task]], group: int, L: int, d_v: int, dtype: Any
    ) -> None:
        self.whole, self.chunks, self.group = whole, chunks, group
        self.tasks: list[Task] = []
        for pieces in chunks:
            for piece in pieces:
                piece.part = len(self.tasks)
                self.tasks.append(piece)
        heads = [(piece.kv.stop - piece.kv.start) * group for piece in self.tasks]
        # one buffer for every piece (the compiled walk takes them as one array)
        self.all_out = np.zeros((len(heads), max(heads, default=0), L, d_v), dtype)
        self.all_lse = np.full(self.all_out.shape[:-1], -np.inf, dtype)
        self.out = [self.all_out[p, :G] for p, G in enumerate(heads)]
        self.lse = [self.all_lse[p, :G] for p, G in enumerate(heads)]

    def merge_into(self, out: np.ndarray, lse: np.ndarray | None) -> None:
        for task, pieces in zip(self.whole, self.chunks, strict=True):
            rows = slice(task.r0, task.r1)
            merged, merged_lse = merge_partials(
                [self.out[p.part][:, rows] for p in pieces if p.part is not None],
                [self.lse[p.part][:, rows] for p in pieces if p.part is not None],
            )
            heads = slice(task.kv.start * self.group, task.kv.stop * self.group)
            out[task.batch][heads, rows] = merged
            if lse is not None:
                lse[task.batch][heads, rows] = merged_lse


def split_keys(
    tasks: list[Task], workers: int, key_tile: int, group: int, L: int, d_v: int, dtype: Any
) -> Parts | None:
    """When there are fewer tasks than workers, split each task's keys into chunks (whole
    key tiles, at least ``thresholds.split_min_keys`` keys each) so that every worker gets work."""
    if not tasks or len(tasks) >= workers:
        return None
    wanted = ceil(workers, len(tasks))
    chunks = []
    for task in tasks:
        keys = task.stop - task.start
        count = max(1, min(wanted, keys // runtime.DEFAULT.thresholds.split_min_keys))
        width = ceil(ceil(keys, count), key_tile) * key_tile  # whole key tiles
        edges = [*range(task.start, task.stop, width), task.stop]
        keys_of = itertools.pairwise(edges)  # each chunk's keys
        chunks.append(
            [Task(task.batch, task.kv, task.item, task.r0, task.r1, a, b) for a, b in keys_of]
        )
    if all(len(pieces) == 1 for pieces in chunks):
        return None
    return Parts(tasks, chunks, group, L, d_v, dtype)


def batch_index(flat: Any, batch_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The batch index of sequence ``flat`` of the flattened batch axes."""
    return tuple(int(x) for x in np.unravel_index(int(flat), batch_shape)) if batch_shape else ()


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def merge_partials(outs: list[np.ndarray], lses: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Attention over disjoint key ranges merged into the attention over all of them:
    ``outs[p] (..., d_v)`` and ``lses[p] (...)`` in one floating dtype. A part in which a
    row sees no key (``lse = -inf``) adds nothing; a row that sees no key in any part stays
    zero with ``lse = -inf``."""
    stacked = np.stack(lses)  # (P, ...)
    top = stacked.max(axis=0)
    top[top == -np.inf] = 0.0  # rows that see no key in any part
    share = np.exp(stacked - top)  # each part's sum of exp, relative to the top
    total = share.sum(axis=0)
    merged = np.zeros(outs[0].shape, dtype=outs[0].dtype)
    for out, part in zip(outs, share, strict=True):
        weight = part[..., None].astype(merged.dtype, copy=False)
        merged += np.where(weight > 0, weight * out, 0.0)  # a part that saw no key adds 0
    empty = total == 0.0
    total[empty] = 1.0
    merged /= total[..., None].astype(merged.dtype, copy=False)
    merged_lse = top + np.log(total)
    merged_lse[empty] = -np.inf
    return merged, merged_lse
