"""Keys and values that lie in a pool of fixed-size blocks (a paged cache), as the kernel
reads them: tile by tile, each tile gathered from the blocks it spans, never the whole
sequence at once.

A pool is ``(num_blocks, block_size, H_kv, d)``, the layout of vLLM's FlashAttention backend
and of ``flash_attn_with_kvcache``; sequence ``b``'s position ``j`` lies in block
``table[b, j // block_size]``, row ``j % block_size``. :class:`PagedKV` stands where the
kernel takes a ``(B, H_kv, S, d)`` array: indexed by a sequence, then by its key/value
heads, then by a range of positions, it returns that tile as an array ``(G, w, d)`` (a
copy of ``w`` rows, the only one made). The Python walk reads every tile so, with the
same arithmetic as for a contiguous cache: for the same tiles the results are the same
bits.

KIVI's keys (quantized per channel over groups of tokens, :mod:`.quantized`) keep the rows
of a block's group that has not filled yet in full precision, in a :class:`Residual`; a key
tile is then read back from its groups' codes and those rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .quantized import Quantization

__all__ = ["PagedKV", "Residual"]


@dataclass
class Residual:
    """The keys of each block's unfilled group of tokens (KIVI's residual): block ``b``'s
    first ``sealed[b]`` rows are quantized (whole groups of ``group`` tokens); its rows from
    ``sealed[b]`` on, one group at most, lie in ``rows[b] (H_kv, group, d)`` in float32.
    Only a sequence's last block has such rows."""

    group: int
    sealed: np.ndarray  # (num_blocks,) rows of each block held as codes
    rows: dict[int, np.ndarray] = field(default_factory=dict)


class PagedKV:
    """``pool (num_blocks, block_size, H_kv, d)`` seen as ``(B, H_kv, S, d)`` through
    ``table (B, max_blocks)``: positions past a sequence's blocks are never read (the
    kernel is given each sequence's length). With ``quantization``, ``pool`` holds codes
    and ``scales`` and ``zeros`` (``(num_blocks, block_size, H_kv, d / group)``, per
    channel ``(num_blocks, block_size / group, H_kv, d)``) the rest (:mod:`.quantized`),
    and ``residual`` the rows of unfilled groups, per channel; each tile is read back in
    float32."""

    def __init__(
        self,
        pool: np.ndarray,
        table: np.ndarray,
        S: int,
        quantization: Quantization | None = None,
        scales: np.ndarray | None = None,
        zeros: np.ndarray | None = None,
        residual: Residual | None = None,
    ) -> None:
        self.pool = pool
        self.table = np.asarray(table, np.int64)
        self.block_size = pool.shape[1]
        self.quantization = quantization
        self.residual = residual
        self.parts: tuple[np.ndarray, ...] = (pool,)
        if quantization is not None:
            assert scales is not None and zeros is not None
            self.parts = (pool, scales, zeros)
        d = pool.shape[3] if quantization is None or quantization.bits == 8 else 2 * pool.shape[3]
        self.shape = (self.table.shape[0], pool.shape[2], S, d)
        self.dtype = pool.dtype if quantization is None else np.dtype(np.float32)
        self.ndim = 4

    def __getitem__(self, index: Any) -> _Heads:
        (b,) = index if isinstance(index, tuple) else (index,)
        return _Heads(self, int(b), slice(0, self.shape[1]))


class _Heads:
    """One sequence's key/value heads ``heads`` of a :class:`PagedKV`: ``(G, S, d)``."""

    def __init__(self, paged: PagedKV, b: int, heads: slice) -> None:
        self._paged, self._b, self._heads = paged, b, heads
        _, H_kv, S, d = paged.shape
        start, stop, _ = heads.indices(H_kv)
        self.shape = (stop - start, S, d)
        self.dtype = paged.dtype

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):  # the kernel's k[batch][kv]: choose heads
            start, stop, _ = index.indices(self.shape[0])
            first = self._heads.start
            return _Heads(self._paged, self._b, slice(first + start, first + stop))
        heads, positions = index  # the tile: [:, c0:c1]
        assert heads == slice(None)
        return self.tile(*positions.indices(self.shape[1])[:2])

    def tile(self, c0: int, c1: int) -> np.ndarray:
        """Positions ``[c0, c1)`` of these heads, ``(G, c1 - c0, d)``: each block's rows in
        turn (a run of blocks adjacent in the pool is read as one), read back from their
        codes when the pool is quantized."""
        paged = self._paged
        quantization = paged.quantization
        if quantization is not None and quantization.per_channel:
            return self._per_channel_tile(quantization, c0, c1)
        parts = [self._gathered(part, c0, c1) for part in paged.parts]
        if quantization is None:
            return parts[0]
        return quantization.dequantize(*parts)

    def _per_channel_tile(self, quantization: Quantization, c0: int, c1: int) -> np.ndarray:
        """KIVI's keys ``[c0, c1)``: the whole groups of tokens the tile spans read back
        from their codes (groups lie within blocks), then the rows of unfilled groups from
        the residual."""
        paged, T = self._paged, quantization.group
        a0, a1 = c0 // T * T, -(-c1 // T) * T
        codes = self._gathered(paged.pool, a0, a1)
        scales, zeros = (self._gathered(part, a0 // T, a1 // T) for part in paged.parts[1:])
        keys = quantization.dequantize(codes, scales, zeros)[:, c0 - a0 : c1 - a0]
        keys = np.ascontiguousarray(keys)
        residual, size, row = paged.residual, paged.block_size, paged.table[self._b]
        assert residual is not None
        spanned = np.arange(c0 // size, -(-c1 // size))
        for block in spanned[residual.sealed[row[spanned]] < size]:
            recent = residual.rows.get(int(row[block]))
            if recent is None:  # a block taken but not yet written
                continue
            start = int(block * size + residual.sealed[row[block]])  # the residual's first
            lo, hi = max(c0, start), min(c1, start + T)
            if lo < hi:
                keys[:, lo - c0 : hi - c0] = recent[self._heads, lo - start : hi - start]
        return keys

    def _gathered(self, pool: np.ndarray, c0: int, c1: int) -> np.ndarray:
        """Rows ``[c0, c1)`` of a pool ``(num_blocks, rows a block, H_kv, width)`` (a
        block's positions, or per channel its groups of tokens) for these heads."""
        paged = self._paged
        size, row = pool.shape[1], paged.table[self._b]
        G = self.shape[0]
        out = np.empty((G, c1 - c0, pool.shape[3]), pool.dtype)
        at = c0
        while at < c1:
            block, offset = divmod(at, size)
            run = 1  # blocks that follow each other in the pool too
            while (at // size + run) * size < c1 and row[block + run] == row[block] + run:
                run += 1
            end = min(c1, (block + run) * size)
            first = int(row[block])
            heads = pool[first : first + run, :, self._heads]  # (run, size, G, width)
            rows = heads.transpose(2, 0, 1, 3).reshape(G, run * size, pool.shape[3])
            out[:, at - c0 : end - c0] = rows[:, offset : offset + end - at]
            at = end
        return out
