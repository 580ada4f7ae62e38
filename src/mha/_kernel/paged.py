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

    def stored_parts(self) -> tuple[Quantization | None, tuple[np.ndarray, ...], Residual | None]:
        """What :func:`stored_pool` takes besides the pool: the quantization, the scales and
        zero points, KIVI's residual."""
        return self.quantization, self.parts[1:], self.residual

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


# The compiled walk's stored pools ------------------------------------------------------

FLOAT, BFLOAT16, FLOAT16, PER_TOKEN, PER_TOKEN4, FLOAT8, PER_CHANNEL, PER_CHANNEL4 = range(8)
"""How a pool's rows are stored, as the compiled walk reads them (:mod:`._numba_stored`):
in the compute dtype (``FLOAT``: read where they lie), bfloat16 or float16 bits, or codes
(:mod:`.quantized`): 8 or 4 bits per token with a scale and a zero point per group of
channels, float8 e4m3 with a scale per group, or per channel over groups of tokens (KIVI's
keys, the rows of unfilled groups in float32)."""

LANES = 16
"""Values the compiled walk reads back from stored rows at a time (one AVX-512 vector of
float32, two AVX2 ones): stored rows, and a quantized cache's groups of channels, of a
multiple of it are read so; others take the NumPy walk."""

_NO_ROWS = np.empty((0, 1, 1, 1), np.float32)
_NO_INDEX = np.empty(0, np.int64)
_NO_BITS = np.empty((0, 0, 0, 0), np.uint16)
FLOAT_FORM = (FLOAT, 0, 0, _NO_ROWS, _NO_INDEX, _NO_INDEX)
"""The form of a pool read as it is (:func:`stored_pool` gives a stored one's): ``(kind,
group, d, residual rows, residual index, sealed rows)``."""


def stored_kind(quantization: Quantization | None, dtype: np.dtype) -> int:
    """The kind of a pool of ``dtype`` with ``quantization`` (:data:`FLOAT` and the rest)."""
    if quantization is not None:
        if quantization.float8:
            return FLOAT8
        if quantization.per_channel:
            return PER_CHANNEL if quantization.bits == 8 else PER_CHANNEL4
        return PER_TOKEN if quantization.bits == 8 else PER_TOKEN4
    if dtype == np.float16:
        return FLOAT16
    return BFLOAT16 if dtype.name == "bfloat16" else FLOAT


def stored_pool(
    data: np.ndarray,
    table: np.ndarray,
    block: int,
    d: int,
    quantization: Quantization | None = None,
    parts: tuple[np.ndarray, ...] = (),
    residual: Residual | None = None,
) -> tuple[Any, ...]:
    """A pool of stored rows as the compiled walk takes it: ``(bytes, table, block, scales,
    zeros, form)``, ``bytes (blocks, block, H_kv, row bytes)`` the data's bytes (bfloat16
    and float16 bits, or codes), ``scales`` and ``zeros`` float16 bits (empty without
    quantization), ``form = (kind, group, d, residual rows (n, H_kv, group, d), each
    block's residual (-1: none), each block's rows held as codes)``. KIVI's residual rows are
    stacked into one array here, once per call (``group * H_kv * d`` floats a sequence)."""
    kind = stored_kind(quantization, data.dtype)
    raw = data.view(np.uint8)
    if quantization is None:
        return raw, table, block, _NO_BITS, _NO_BITS, (kind, 0, d, _NO_ROWS, _NO_INDEX, _NO_INDEX)
    scales, zeros = (part.view(np.uint16) for part in parts)
    rows, at, sealed = _NO_ROWS, _NO_INDEX, _NO_INDEX
    if residual is not None:
        at = np.full(data.shape[0], -1, np.int64)
        held = sorted(residual.rows)
        if held:
            rows = np.stack([residual.rows[b] for b in held])
            at[held] = np.arange(len(held))
        sealed = residual.sealed
    return raw, table, block, scales, zeros, (kind, quantization.group, d, rows, at, sealed)
