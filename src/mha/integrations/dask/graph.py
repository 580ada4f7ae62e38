"""The graph of :mod:`mha.dask`: how the scores are cut into chunks (:class:`Grid`), and the
tasks keyed by name and index in one layer (:class:`Graph`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import is_dask
from .tasks import merge


@dataclass(frozen=True)
class Grid:
    """How the scores ``(*batch, H, L, S)`` are cut: the batch blocks, the query chunks
    (``rows``) and the key chunks (``cols``)."""

    batch_chunks: tuple[tuple[int, ...], ...]
    row_chunks: tuple[int, ...]
    col_chunks: tuple[int, ...]
    H: int
    heads_axis: bool

    @classmethod
    def of(cls, q: Any, k: Any, v: Any, H: int, *, heads_axis: bool) -> Grid:
        n_batch = q.ndim - (3 if heads_axis else 2)
        lead = next((x for x in (q, k, v) if is_dask(x)), None)
        batch = (
            lead.chunks[:n_batch] if lead is not None else tuple((n,) for n in q.shape[:n_batch])
        )
        rows = q.chunks[-2] if is_dask(q) else (q.shape[-2],)
        keyed = next((x for x in (k, v) if is_dask(x)), None)
        cols = keyed.chunks[-2] if keyed is not None else (k.shape[-2],)
        return cls(batch, nonempty(rows), nonempty(cols), H, heads_axis)

    @property
    def rows(self) -> list[slice]:
        return slices(self.row_chunks)

    @property
    def cols(self) -> list[slice]:
        return slices(self.col_chunks)

    @property
    def one_pair(self) -> bool:
        return len(self.row_chunks) == 1 and len(self.col_chunks) == 1

    def batch_blocks(self) -> Any:
        """``(block index, slices)`` for every block of the batch axes."""
        per_axis = [list(enumerate(slices(chunks))) for chunks in self.batch_chunks]
        for combo in itertools.product(*per_axis):
            yield tuple(n for n, _ in combo), tuple(s for _, s in combo)

    def block_shape(self, batch: tuple[slice, ...]) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in batch)

    def fit(self, x: Any, positions: str, da: Any) -> Any:
        """``x`` as a Dask array cut by this grid: batch blocks, its positions as the rows
        or the columns, everything else whole."""
        along = self.row_chunks if positions == "rows" else self.col_chunks
        if x.shape[-2] == 0:
            along = (0,)
        middle = ((x.shape[-3],),) if self.heads_axis else ()
        chunks = (*self.batch_chunks, *middle, along, (x.shape[-1],))
        if not is_dask(x):
            return da.from_array(x, chunks=chunks)
        return x if x.chunks == chunks else x.rechunk(chunks)


def nonempty(chunks: tuple[int, ...]) -> tuple[int, ...]:
    kept = tuple(c for c in chunks if c)
    return kept or (0,)


def slices(chunks: tuple[int, ...]) -> list[slice]:
    ends = np.cumsum((0, *chunks))
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(ends)]


class Graph:
    """Tasks keyed ``(name-token, *index)``, in one layer."""

    def __init__(self, prefix: str, inputs: Any) -> None:
        from dask.base import tokenize

        self.token = tokenize(*inputs)
        self.prefix = prefix
        self.layer: dict[Any, Any] = {}

    def name(self, kind: str) -> str:
        return f"{self.prefix}-{kind}-{self.token}"

    def data(self, kind: str, value: Any) -> str:
        key = self.name(kind)
        self.layer[key] = value
        return key

    def task(self, kind: str, index: tuple[int, ...], function: Any, *args: Any) -> Any:
        key = (self.name(kind), *index)
        self.layer[key] = (function, *args)
        return key

    def reduce(self, parts: list[Any], index: tuple[int, ...], fan_in: int) -> list[Any]:
        """At most ``fan_in`` keys whose merge is the merge of ``parts``: a tree of merges,
        ``fan_in`` parts at a time, of depth ``log(parts)``."""
        level, depth = parts, 0
        while len(level) > fan_in:
            level = [
                self.task("merge", (depth, *index, n), merge, level[a : a + fan_in])
                for n, a in enumerate(range(0, len(level), fan_in))
            ]
            depth += 1
        return level

    def array(
        self, kind: str, chunks: tuple[tuple[int, ...], ...], dtype: np.dtype, deps: Any, da: Any
    ) -> Any:
        """The Dask array of the ``kind`` tasks (the outputs), over every other task."""
        from dask.highlevelgraph import HighLevelGraph

        outputs = {self.name(output) for output in ("out", "lse")}
        inner = {key: task for key, task in self.layer.items() if key_name(key) not in outputs}
        mine = {key: task for key, task in self.layer.items() if key_name(key) == self.name(kind)}
        graph = HighLevelGraph.from_collections(
            self.name("tasks"), inner, dependencies=[x for x in deps if x is not None]
        )
        name = self.name(kind)
        graph = HighLevelGraph(
            {**graph.layers, name: mine}, {**graph.dependencies, name: {self.name("tasks")}}
        )
        return da.Array(graph, name, chunks, meta=np.empty((0,) * len(chunks), dtype))


def key_name(key: Any) -> str:
    return str(key[0] if isinstance(key, tuple) else key)
