"""What one work item may see: a batch index's run of heads, cut into tiles.

:meth:`mha._kernel.contract.Visibility.item` makes one :class:`ItemVisibility` per work
item; the kernel asks it, tile by tile, which keys its rows may see (the runs of keys, the
rows that see a block, each row's band) and what else hides keys in a block, as a boolean
block. Nothing of size ``L x S`` is built. The band of the causal mask, the window and the
lengths is :mod:`.geometry`'s, which the compiled walks compute with too; the rest (sink
tokens, chunks, masks, bias, ``mask_mod``) is this module's alone. The contract's arguments
themselves are checked in :mod:`.contract`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import geometry
from .block_mask import BLOCK, FULL, PARTIAL, evaluate
from .geometry import NO_WINDOW

__all__ = ["ItemVisibility", "Memo", "cut_block"]


@dataclass(frozen=True)
class ItemVisibility:
    """What one batch index's run of heads may see: limits, and views cut into tiles.

    Keys at or after ``key_end`` and queries at or after ``query_end`` are padding; the
    kernel bounds its loops with them instead of masking. ``mask`` and ``bias`` are
    ``(G or 1, L or 1, S or 1)`` for the run of ``G`` heads, ``blocks`` is ``mask_mod``'s
    block map ``(G or 1, rows, keys)``. Rows and keys are the call's indices (slots, with a
    cache); their positions are :meth:`query_positions` and :meth:`key_positions`.
    """

    key_end: int
    query_end: int
    offset: int  # query i is aligned with key i + offset (causal mask and window)
    causal: bool
    window: int | None
    mask: np.ndarray | None  # True = may attend
    bias: np.ndarray | None
    bias_hides_keys: bool
    sink_tokens: int = 0
    chunk: int | None = None
    mask_mod: Callable[..., Any] | None = None
    blocks: np.ndarray | None = None
    query_index: int = 0  # mask_mod's q_idx of row 0
    key_index: int = 0  # the position of key slot 0 (after the held sink tokens)
    held_sink_tokens: int = 0
    sequence: int = 0  # mask_mod's b
    heads: slice = field(default_factory=lambda: slice(0, 1))  # mask_mod's h
    memo: Memo | None = None
    alike: bool = True  # every head sees the same keys
    ahead: int = 0  # with causal: the keys visible after the query's own (a right window)
    # read once a tile: the band's offset and window as geometry takes them (a right window
    # moves the causal bound and widens the window by as much) and the sink tokens' end
    _offset: int = field(default=0, init=False, repr=False, compare=False)
    _window: int = field(default=NO_WINDOW, init=False, repr=False, compare=False)
    _sink_end: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        window = NO_WINDOW if self.window is None else self.window + self.ahead
        object.__setattr__(self, "_offset", self.offset + self.ahead)
        object.__setattr__(self, "_window", window)
        sink_end = 0
        if self.sink_tokens and self.window is not None:
            if self.held_sink_tokens:
                sink_end = min(self.held_sink_tokens, self.key_end)
            else:
                sink_end = max(0, min(self._slot(self.sink_tokens), self.key_end))
        object.__setattr__(self, "_sink_end", sink_end)

    def query_positions(self, r0: int, r1: int) -> np.ndarray:
        """The positions of rows ``[r0, r1)``, aligned with the keys' (ALiBi, chunks)."""
        return np.arange(r0 + self.offset + self.key_index, r1 + self.offset + self.key_index)

    def key_positions(self, c0: int, c1: int) -> np.ndarray:
        """The positions of key slots ``[c0, c1)``."""
        slots = np.arange(c0, c1)
        if self.held_sink_tokens:
            return np.where(slots < self.held_sink_tokens, slots, slots + self.key_index)
        return slots + self.key_index

    def _slot(self, position: int) -> int:
        """The slot of ``position`` among the keys after the held sink tokens."""
        return position - self.key_index

    def sink_token_end(self) -> int:
        """One past the last key slot holding a sink token (0 when there are none)."""
        return self._sink_end

    def key_ranges(self, r0: int, r1: int) -> list[tuple[int, int]]:
        """The runs of keys ``[start, stop)`` that some query of rows ``[r0, r1)`` may see
        by the lengths, the causal mask, the window (and its sink tokens) and the chunks,
        in order; a mask or bias may hide more."""
        start, stop = geometry.keys_seen(
            r0, r1, self._offset, self.key_end, self.causal, self._window
        )
        first = last = 0
        if self.chunk is not None:  # positions of the first and past the last row's chunk
            c = self.chunk
            first = (r0 + self.offset + self.key_index) // c * c
            last = ((r1 - 1 + self.offset + self.key_index) // c + 1) * c
            start, stop = max(start, self._slot(first)), min(stop, self._slot(last))
        ranges = []
        sink_slots = self._sink_end
        if sink_slots and start > 0:
            lo, hi = 0, min(sink_slots, stop)
            if self.chunk is not None:
                held = self.held_sink_tokens > 0
                lo = max(lo, first if held else self._slot(first))
                hi = min(hi, last if held else self._slot(last))
            if hi > lo:
                ranges.append((lo, hi))
        if stop > start:
            if ranges and start <= ranges[-1][1]:
                start = ranges.pop()[0]
            ranges.append((start, stop))
        return ranges

    def key_tiles(
        self, r0: int, r1: int, start: int, stop: int, width: int, whole: bool = False
    ) -> Iterator[tuple[int, int]]:
        """Tiles ``[c0, c1)`` of at most ``width`` keys over what rows ``[r0, r1)`` may see
        of ``[start, stop)``: none across the end of the sink tokens or a chunk's edge.
        ``whole``: one tile over everything they may see (the weights are returned)."""
        if whole:
            ranges = self.key_ranges(r0, r1)
            if ranges and max(start, ranges[0][0]) < min(stop, ranges[-1][1]):
                yield max(start, ranges[0][0]), min(stop, ranges[-1][1])
            return
        sink_slots = self._sink_end
        for a, b in self.key_ranges(r0, r1):
            c0, b = max(a, start), min(b, stop)
            while c0 < b:
                c1 = min(c0 + width, b)
                if c0 < sink_slots < c1:
                    c1 = sink_slots
                if self.chunk is not None:
                    at = int(self.key_positions(c0, c0 + 1)[0])
                    edge = (at // self.chunk + 1) * self.chunk  # the next chunk's position
                    c1 = min(c1, edge if c0 < self.held_sink_tokens else self._slot(edge))
                yield c0, c1
                c0 = c1

    def bias_block(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray | None:
        return None if self.bias is None else cut_block(self.bias, r0, r1, c0, c1)

    def rows_seeing(self, r0: int, r1: int, c0: int, c1: int) -> tuple[int, int]:
        """The run ``[a, b)`` of rows of ``[r0, r1)`` that may see some key of ``[c0, c1)``
        by the causal mask, the window, the chunks and the mask's block map: rows outside it
        see no key of the block. ``a == b`` when no row does."""
        window = self._band_window(c0)
        a, b = geometry.rows_seeing(r0, r1, c0, c1, self._offset, self.causal, window)
        if self.chunk is not None:
            c, base = self.chunk, self.offset + self.key_index
            keys = self.key_positions(c0, c1)
            a = max(a, int(keys[0]) // c * c - base)
            b = min(b, (int(keys[-1]) // c + 1) * c - base)
        if self.blocks is not None and b > a:
            rb0, rb1 = a // BLOCK, -(-b // BLOCK)
            seen = (self.blocks[:, rb0:rb1, c0 // BLOCK : -(-c1 // BLOCK)] != 0).any(axis=(0, 2))
            if not seen.any():
                return a, a
            a = max(a, (rb0 + int(np.argmax(seen))) * BLOCK)
            b = min(b, (rb1 - int(np.argmax(seen[::-1]))) * BLOCK)
        return a, max(a, b)

    def _band_window(self, c0: int) -> int:
        """The window where it bounds a block starting at key ``c0`` as a band, else
        :data:`.geometry.NO_WINDOW` (a block with sink tokens in it is bounded by them)."""
        return self._window if c0 >= self._sink_end else NO_WINDOW

    def band(self, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray] | None:
        """For each row of ``[r0, r1)``, the keys ``[lo, hi)`` of the block ``[c0, c1)`` (as
        offsets from ``c0``) that the causal mask and the window leave visible, as two int64
        arrays; ``None`` when they hide nothing in the block (:func:`.geometry.band`)."""
        window = self._band_window(c0)
        if not geometry.cut(r0, r1, c0, c1, self._offset, self.causal, window):
            return None
        lo, hi = geometry.band(np.arange(r0, r1), c0, c1, self._offset, self.causal, window)
        return lo, hi

    def band_and_hidden(
        self, r0: int, r1: int, c0: int, c1: int
    ) -> tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]:
        """For the compiled step: each row's band of visible keys (:meth:`band`), narrowed by
        whatever else hides keys where each row still sees one run of them (as causal,
        window and document masks written as ``mask_mod`` do), and the boolean block of what
        a band cannot say (``None`` when nothing). With a ``mask_mod`` the result is kept
        for the other heads of the call, when it is the same for every head."""
        key = None
        if self.memo is not None:  # a mask_mod's call: its tiles' masks are kept
            heads = None if self.alike else (self.heads.start, self.heads.stop)
            tile = (r0, r1, c0, c1)
            key = (self.sequence, heads, self.offset, self.key_index, self.query_index, tile)
        if self.memo is not None and key in self.memo:
            kept: tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]
            kept = self.memo[key]
            return kept
        band = self.band(r0, r1, c0, c1)
        hidden = self.hidden(r0, r1, c0, c1, band=False)
        if hidden is not None and hidden.shape[0] == 1:
            runs = _runs(~hidden[0])
            if runs is not None:
                if band is not None:
                    runs = np.maximum(band[0], runs[0]), np.minimum(band[1], runs[1])
                band = runs
                hidden = None
        if self.memo is not None:
            self.memo.keep(key, (band, hidden))
        return band, hidden

    def hidden(self, r0: int, r1: int, c0: int, c1: int, band: bool = True) -> np.ndarray | None:
        """Boolean ``(G or 1, r1 - r0, c1 - c0)``: True where the causal mask, the window,
        the chunks, the boolean mask, ``mask_mod`` or a ``-inf`` bias hides the key;
        ``None`` when nothing in the block is hidden. Padding is not included: the kernel's
        loops stop at it. With ``band=False``, the causal mask and the window (where
        :meth:`band` can say it) are left to :meth:`band`."""
        hidden = None
        w, window = c1 - c0, self._window
        if band and geometry.cut(r0, r1, c0, c1, self._offset, self.causal, NO_WINDOW):
            _, hi = geometry.band(np.arange(r0, r1)[:, None], c0, c1, self._offset, True, NO_WINDOW)
            hidden = np.arange(w) >= hi  # the keys after each row's own
        sink_tokens_apart = self._band_window(c0) == NO_WINDOW  # the band cannot say this window
        edge = geometry.cut(r0, r1, c0, c1, self._offset, False, window)
        if (band or sink_tokens_apart) and edge:
            lo, _ = geometry.band(np.arange(r0, r1)[:, None], c0, c1, self._offset, False, window)
            below = np.arange(w) < lo  # the keys before each row's window
            sink_slots = self._sink_end
            if sink_slots > c0:  # sink tokens stay visible
                below &= np.arange(c0, c1)[None, :] >= sink_slots
            hidden = _or(hidden, below)
        if self.chunk is not None:
            rows = self.query_positions(r0, r1) // self.chunk
            keys = self.key_positions(c0, c1) // self.chunk
            if rows[0] != rows[-1] or keys[0] != keys[-1] or rows[0] != keys[0]:
                hidden = _or(hidden, rows[:, None] != keys[None, :])
        if self.mask is not None:
            hidden = _or(hidden, ~cut_block(self.mask, r0, r1, c0, c1))
        if self.bias_hides_keys and self.bias is not None:
            hidden = _or(hidden, np.isneginf(cut_block(self.bias, r0, r1, c0, c1)))
        if self.mask_mod is not None:
            hidden = self._mask_mod_hides(hidden, r0, r1, c0, c1)
        return hidden

    def _mask_mod_hides(
        self, hidden: np.ndarray | None, r0: int, r1: int, c0: int, c1: int
    ) -> np.ndarray | None:
        """``hidden`` with what ``mask_mod`` hides in the block: its empty blocks from the
        block map, its partial ones by evaluating it there (its full ones need nothing)."""
        mask_mod = self.mask_mod
        assert mask_mod is not None
        if self.blocks is None:  # no map: evaluate it over the block
            seq, h, q, k = self.indices(r0, r1, c0, c1)
            allowed = evaluate(mask_mod, seq, h, q, k, (1, h.shape[1], r1 - r0, c1 - c0))
            return _or(hidden, ~allowed[0])
        cb0, cb1 = c0 // BLOCK, -(-c1 // BLOCK)
        region = self.blocks[:, r0 // BLOCK : -(-r1 // BLOCK), cb0:cb1]
        if (region == FULL).all():
            return hidden
        heads = region.shape[0]
        hides = np.zeros((heads, r1 - r0, c1 - c0), bool)
        skip = c0 - cb0 * BLOCK  # the block's first key, in its first map block
        for n, classes in enumerate(region.transpose(1, 0, 2)):  # one row of map blocks
            a, b = max(r0, (r0 // BLOCK + n) * BLOCK), min(r1, (r0 // BLOCK + n + 1) * BLOCK)
            rows = slice(a - r0, b - r0)
            empty = np.repeat(classes == 0, BLOCK, axis=-1)[:, skip : skip + c1 - c0]
            hides[:, rows] |= empty[:, None, :]
            partial = np.flatnonzero((classes == PARTIAL).any(axis=0))
            if partial.size:  # evaluate it over the span of the partial map blocks
                lo = max(c0, (cb0 + int(partial[0])) * BLOCK)
                hi = min(c1, (cb0 + int(partial[-1]) + 1) * BLOCK)
                seq, h, q, k = self.indices(a, b, lo, hi)
                allowed = evaluate(mask_mod, seq, h, q, k, (1, h.shape[1], b - a, hi - lo))[0]
                hides[:, rows, lo - c0 : hi - c0] = ~allowed
        return _or(hidden, hides)

    def indices(
        self, r0: int, r1: int, c0: int, c1: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The index arrays ``b, h, q_idx, kv_idx`` of ``mask_mod`` and ``score_mod`` for
        rows ``[r0, r1)`` and keys ``[c0, c1)`` of this item's heads, shaped ``(1, 1, 1, 1)``,
        ``(1, G, 1, 1)``, ``(1, 1, n, 1)``, ``(1, 1, 1, w)``."""
        b = np.full((1, 1, 1, 1), self.sequence, np.int64)
        h = np.arange(self.heads.start, self.heads.stop, dtype=np.int64).reshape(1, -1, 1, 1)
        q = np.arange(r0 + self.query_index, r1 + self.query_index).reshape(1, 1, -1, 1)
        k = self.key_positions(c0, c1).reshape(1, 1, 1, -1)
        return b, h, q, k


class Memo(dict[Any, Any]):
    """What a call's tiles computed of ``mask_mod``, kept for its other heads, up to
    ``LIMIT`` bytes (then nothing more is kept)."""

    LIMIT = 64 * 2**20

    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    def keep(self, key: Any, value: tuple[Any, np.ndarray | None]) -> None:
        band, hidden = value
        size = (0 if band is None else 2 * band[0].nbytes) + (
            0 if hidden is None else hidden.nbytes
        )
        if self.size + size <= self.LIMIT:
            self[key] = value
            self.size += size


def _runs(visible: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Each row's visible keys ``[lo, hi)`` of a boolean ``visible (n, w)``, when every
    row sees one run of keys (or none); ``None`` otherwise."""
    w = visible.shape[-1]
    seen = visible.any(axis=-1)
    lo = np.where(seen, visible.argmax(axis=-1), 0)
    hi = np.where(seen, w - visible[:, ::-1].argmax(axis=-1), 0)
    if (np.count_nonzero(visible, axis=-1) != hi - lo).any():
        return None
    return lo.astype(np.int64), hi.astype(np.int64)


def _or(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    return b if a is None else a | b


def cut_block(array: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    """Cut rows ``[r0, r1)`` and columns ``[c0, c1)``, leaving broadcast (size-1) axes whole."""
    rows = slice(r0, r1) if array.shape[-2] != 1 else slice(None)
    cols = slice(c0, c1) if array.shape[-1] != 1 else slice(None)
    return array[..., rows, cols]
