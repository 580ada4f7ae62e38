"""The mask contract: every way of hiding keys from queries, combined with AND.

The attention scores have shape ``(*batch, H, L, S)`` (``batch`` is ``(B,)`` for the usual
batched call and ``()`` for an unbatched one). A query ``i`` may attend to a key ``j`` when
every one of these that was given allows it:

* ``mask``: a boolean array, **True = may attend**, broadcastable to ``(*batch, H, L, S)``.
  An array with the batch axes and ``(L, S)`` but no head axis (``(B, L, S)``) is accepted
  and applies to every head.
* ``causal``: ``j <= i + offset`` with ``offset = S - L`` (``causal_alignment=
  "bottom_right"``, the default: the last query sees every key) or ``offset = 0``
  (``"top_left"``, PyTorch's ``is_causal``). ``causal_alignment`` without a causal mask or a
  window is refused: it would change nothing.
* ``window``: a sliding window, ``(i + offset) - j < window`` (transformers'
  ``sliding_window``): each query sees at most ``window`` keys, itself included.
* ``key_lengths``: integers of the batch shape; keys at index ``>= length`` are padding.
* ``query_lengths``: integers of the batch shape; query rows at index ``>= length`` are
  padding, see no key, and get a zero attention output (after the output projection of
  :func:`mha.multi_head_attention` that row is ``b_o``, or zero without a bias).
* ``bias``: an additive float array broadcastable like ``mask``; ``-inf`` hides a key.
* ``sink_tokens``: with a window, keys at positions ``< sink_tokens`` are never outside it
  (StreamingLLM's attention sinks): ``j < sink_tokens or (i + offset) - j < window``.
* ``chunk``: query ``i`` sees key ``j`` only in the same chunk of ``chunk`` positions,
  ``(i + offset) // chunk == j // chunk`` (Llama 4), positions counted from the start of
  the sequence.
* ``mask_mod``: a function ``(b, h, q_idx, kv_idx) -> bool`` of index arrays (see
  :mod:`.block_mask`), classified once per call block by block.

Positions: the rows and keys of a call are its indices; a cache's are the tokens'
positions in their sequences (``key_index`` is the position of slot 0, and the first
``held_sinks`` slots hold the sink tokens ``0..held_sinks-1`` once a window dropped the
positions after them); a block of a call (:meth:`Visibility.block`) keeps the call's.

A query row that can see no key gets all-zero weights and a zero attention output.

>>> import numpy as np
>>> from mha._kernel.contract import Visibility
>>> vis = Visibility.build(batch_shape=(1,), H=1, L=2, S=3, causal=True, key_lengths=[2])
>>> vis.allowed()[0, 0]
array([[ True,  True, False],
       [ True,  True, False]])
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .._arrays import (
    as_array,
    as_float_array,
    broadcasts_to,
    flag,
    non_negative_int,
    positive_int,
)
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .block_mask import BLOCK, FULL, PARTIAL, classify, evaluate
from .team import Team

__all__ = ["CAUSAL_ALIGNMENTS", "Visibility", "check_lengths", "fit_to_scores", "split_mask"]

CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


@dataclass(frozen=True)
class Visibility:
    """Which keys each query may see, kept as its parts so any block can be cut from it.

    ``item(index)`` gives what one ``(*batch, head)`` index may see, from which the kernel
    cuts each tile's mask without ever building the full-size combined mask.
    """

    index_shape: tuple[int, ...]  # (*batch, H)
    L: int
    S: int
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    causal_offset: int = 0  # the alignment's offset: S - L, or 0 for top-left
    key_lengths: np.ndarray | None = None
    query_lengths: np.ndarray | None = None
    bias_hides_keys: bool = False
    causal: bool = False
    window: int | None = None
    offsets: np.ndarray | None = None  # per sequence, overriding causal_offset (the KV cache)
    sink_tokens: int = 0
    chunk: int | None = None
    mask_mod: Callable[..., Any] | None = None
    blocks: np.ndarray | None = None  # mask_mod's block map, from classified()
    query_index: np.ndarray | None = None  # per sequence: mask_mod's q_idx of row 0
    key_index: np.ndarray | None = None  # per sequence: the position of key slot 0
    held_sinks: int = 0  # leading key slots that hold positions 0.. (a cache's sink tokens)
    sequences: np.ndarray | None = None  # per sequence: mask_mod's b (a block's, the call's)
    memo: Memo | None = field(default=None, compare=False, repr=False)  # from classified()

    @classmethod
    def build(
        cls,
        *,
        batch_shape: tuple[int, ...],
        H: int,
        L: int,
        S: int,
        mask: Any = None,
        causal: Any = False,
        causal_alignment: Any = None,
        key_lengths: Any = None,
        query_lengths: Any = None,
        bias: Any = None,
        window: Any = None,
        sink_tokens: Any = None,
        chunk: Any = None,
        mask_mod: Any = None,
        offsets: np.ndarray | None = None,
        query_index: np.ndarray | None = None,
        key_index: np.ndarray | None = None,
        held_sinks: int = 0,
        dtype: Any = np.float64,
        context: str = "",
    ) -> Visibility:
        """Check every masking argument against the scores' shape and keep the parts.

        ``context`` (such as "Q (2, 5, 8), K (2, 6, 8)") is added to length errors.
        ``offsets``, ``query_index``, ``key_index`` and ``held_sinks`` (internal, for the KV
        cache) give each sequence its own alignment offset ``i + offset`` for the causal
        mask and the window, and its positions."""
        full = (*batch_shape, H, L, S)
        mask_is_causal, mask_array = split_mask(mask)
        causal = flag("causal", causal) or mask_is_causal
        if causal_alignment is not None and (
            not isinstance(causal_alignment, str) or causal_alignment not in CAUSAL_ALIGNMENTS
        ):
            raise AttentionValueError(
                f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}; got {causal_alignment!r}"
            )
        window = None if window is None else positive_int("window", window)
        if causal_alignment is not None and not causal and window is None:
            raise AttentionValueError(
                f"causal_alignment={causal_alignment!r} has no effect without a causal mask: "
                "pass causal=True (or mask=True) with it, or leave it out"
            )
        sinks = 0 if sink_tokens is None else non_negative_int("sink_tokens", sink_tokens)
        if sinks and window is None:
            raise AttentionValueError(
                f"sink_tokens={sink_tokens} keeps the first keys visible beside a sliding "
                "window, but no window= was given: give window= too, or leave sink_tokens out"
            )
        chunk = None if chunk is None else positive_int("chunk", chunk)
        if mask_mod is not None and not callable(mask_mod):
            raise AttentionTypeError(
                f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool array; got "
                f"{reprlib.repr(mask_mod)} of type {type(mask_mod).__name__}"
            )
        offset = 0 if causal_alignment == "top_left" else S - L
        if mask_array is not None:
            mask_array = fit_to_scores("mask", mask_array, full, batch_shape)
        bias_array = None
        hides = False
        if bias is not None:
            bias_array = as_float_array("bias", bias)
            bias_array = fit_to_scores("bias", bias_array, full, batch_shape)
            with np.errstate(over="ignore"):
                bias_array = bias_array.astype(dtype, copy=False)
            hides = bool(np.isneginf(bias_array).any())
        return cls(
            index_shape=(*batch_shape, H),
            L=L,
            S=S,
            mask=mask_array,
            bias=bias_array,
            causal_offset=offset,
            key_lengths=check_lengths("key_lengths", key_lengths, batch_shape, S, "key", context),
            query_lengths=check_lengths(
                "query_lengths", query_lengths, batch_shape, L, "query", context
            ),
            bias_hides_keys=hides,
            causal=causal,
            window=window,
            offsets=offsets,
            sink_tokens=sinks,
            chunk=chunk,
            mask_mod=mask_mod,
            query_index=query_index,
            key_index=key_index,
            held_sinks=held_sinks,
        )

    def classified(self, team: Team | None = None) -> Visibility:
        """This visibility with ``mask_mod``'s block map (computed once, on ``team``;
        unchanged without a ``mask_mod`` or when the map is already there)."""
        if self.mask_mod is None or self.blocks is not None:
            return self
        batch_shape = self.index_shape[:-1]
        count = int(np.prod(batch_shape)) if batch_shape else 1
        rows, keys = np.arange(self.L, dtype=np.int64), np.arange(self.S, dtype=np.int64)
        q = rows[None] if self.query_index is None else self.query_index.reshape(-1, 1) + rows
        k = keys[None]
        if self.key_index is not None:
            k = np.where(keys < self.held_sinks, keys, keys + self.key_index.reshape(-1, 1))
        b = np.arange(count) if self.sequences is None else self.sequences.reshape(-1)
        blocks = classify(self.mask_mod, b, self.index_shape[-1], q, k, team)
        return replace(self, blocks=blocks, memo=Memo())

    def item(self, batch: tuple[int, ...], heads: slice) -> ItemVisibility:
        """The parts that apply to one batch index and a run of its heads."""
        offset = self.causal_offset if self.offsets is None else int(self.offsets[batch])
        flat = int(np.ravel_multi_index(batch, self.index_shape[:-1])) if batch else 0
        sequence = flat if self.sequences is None else int(self.sequences[batch])
        blocks = None
        if self.blocks is not None:
            picked = self.blocks[flat if self.blocks.shape[0] > 1 else 0]
            blocks = picked[heads] if picked.shape[0] > 1 else picked
        return ItemVisibility(
            key_end=self.S if self.key_lengths is None else int(self.key_lengths[batch]),
            query_end=self.L if self.query_lengths is None else int(self.query_lengths[batch]),
            offset=offset,
            causal=self.causal,
            window=self.window,
            mask=_select(self.mask, batch, heads),
            bias=_select(self.bias, batch, heads),
            bias_hides_keys=self.bias_hides_keys,
            sink_tokens=self.sink_tokens,
            chunk=self.chunk,
            mask_mod=self.mask_mod,
            blocks=blocks,
            query_index=0 if self.query_index is None else int(self.query_index[batch]),
            key_index=0 if self.key_index is None else int(self.key_index[batch]),
            held_sinks=self.held_sinks,
            sequence=sequence,
            memo=self.memo,
            alike=self._heads_alike(),
            heads=heads,
        )

    def _heads_alike(self) -> bool:
        """Whether every head sees the same keys (what the memo of a tile may share)."""
        per_head = [
            self.mask is not None and self.mask.shape[-3] > 1,
            self.bias_hides_keys and self.bias is not None and self.bias.shape[-3] > 1,
            self.blocks is not None and self.blocks.shape[1] > 1,
        ]
        return not any(per_head)

    def block(self, batch: tuple[slice, ...], rows: slice, cols: slice) -> Visibility:
        """The visibility of one block of the scores: the batch indices ``batch`` (one slice
        per batch axis, every head), query rows ``rows`` and keys ``cols`` (slices with
        start and stop), as a call over just those queries and keys would see it. The
        causal mask and the window keep their alignment, lengths count from the block's
        first row and key, and a mask or bias is cut (:meth:`with_arrays` gives a block its
        own instead). Positions stay the call's, and so do the sequence numbers (``b``) of a
        ``mask_mod``."""
        r0, r1, c0, c1 = rows.start, rows.stop, cols.start, cols.stop
        if self.held_sinks or self.offsets is not None:
            raise ValueError("a cached call's visibility is not cut into blocks")
        sizes = _sizes(batch, self.index_shape[:-1])

        def index(values: np.ndarray | None, start: int) -> np.ndarray | None:
            if values is None and start == 0:
                return None
            base = np.zeros(sizes, np.int64) if values is None else values[batch]
            return base + start

        def cut(lengths: np.ndarray | None, start: int, stop: int) -> np.ndarray | None:
            return None if lengths is None else np.clip(lengths[batch] - start, 0, stop - start)

        def part(array: np.ndarray | None) -> np.ndarray | None:
            if array is None:
                return None
            index = tuple(
                slice(None) if size == 1 else axis
                for size, axis in zip(array.shape, (*batch, slice(None)), strict=False)
            )
            return _block(array[index], r0, r1, c0, c1)

        return Visibility(
            index_shape=(*sizes, self.index_shape[-1]),
            L=r1 - r0,
            S=c1 - c0,
            mask=part(self.mask),
            bias=part(self.bias),
            causal_offset=self.causal_offset + r0 - c0,
            key_lengths=cut(self.key_lengths, c0, c1),
            query_lengths=cut(self.query_lengths, r0, r1),
            bias_hides_keys=self.bias_hides_keys,
            causal=self.causal,
            window=self.window,
            sink_tokens=self.sink_tokens,
            chunk=self.chunk,
            mask_mod=self.mask_mod,
            query_index=index(self.query_index, r0),
            key_index=index(self.key_index, c0),
            sequences=(
                np.arange(int(np.prod(self.index_shape[:-1])), dtype=np.int64).reshape(
                    self.index_shape[:-1]
                )
                if self.sequences is None
                else self.sequences
            )[batch],
        )

    def with_arrays(self, mask: np.ndarray | None, bias: np.ndarray | None) -> Visibility:
        """This visibility with the given full-rank ``mask`` and ``bias`` blocks (each
        ``None``, or broadcastable to the scores with as many axes)."""
        full = (*self.index_shape, self.L, self.S)
        for name, array in (("mask", mask), ("bias", bias)):
            if array is not None and np.broadcast_shapes(array.shape, full) != full:
                raise ShapeError(f"a {name} block {array.shape} does not fit the scores {full}")
        return replace(
            self,
            mask=mask,
            bias=bias,
            bias_hides_keys=bias is not None and bool(np.isneginf(bias).any()),
        )

    def sees_any(self) -> bool:
        """Whether some query may see some key by the limits alone (lengths, the causal mask,
        the window); a mask or bias may still hide the rest. Blocks that do not are skipped."""
        for index in np.ndindex(self.index_shape[:-1]):
            item = self.item(index, slice(0, self.index_shape[-1]))
            rows = min(self.L, item.query_end)
            if rows > 0 and item.key_ranges(0, rows):
                return True
        return False

    def allowed(self) -> np.ndarray:
        """The full boolean ``(*batch, H, L, S)`` visibility, for inspection and plots."""
        allowed = np.ones((*self.index_shape, self.L, self.S), dtype=bool)
        for batch in np.ndindex(self.index_shape[:-1]):
            item = self.item(batch, slice(0, self.index_shape[-1]))
            hidden = item.hidden(0, self.L, 0, self.S)
            if hidden is not None:
                allowed[batch] = ~hidden
            allowed[batch][..., item.key_end :] = False
            allowed[batch][..., item.query_end :, :] = False
        return allowed


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
    key_index: int = 0  # the position of key slot 0 (after the held sinks)
    held_sinks: int = 0
    sequence: int = 0  # mask_mod's b
    heads: slice = field(default_factory=lambda: slice(0, 1))  # mask_mod's h
    memo: Memo | None = None
    alike: bool = True  # every head sees the same keys

    def query_positions(self, r0: int, r1: int) -> np.ndarray:
        """The positions of rows ``[r0, r1)``, aligned with the keys' (ALiBi, chunks)."""
        return np.arange(r0 + self.offset + self.key_index, r1 + self.offset + self.key_index)

    def key_positions(self, c0: int, c1: int) -> np.ndarray:
        """The positions of key slots ``[c0, c1)``."""
        slots = np.arange(c0, c1)
        if self.held_sinks:
            return np.where(slots < self.held_sinks, slots, slots + self.key_index)
        return slots + self.key_index

    def _slot(self, position: int) -> int:
        """The slot of ``position`` among the keys after the held sinks."""
        return position - self.key_index

    def sink_end(self) -> int:
        """One past the last key slot holding a sink token (0 when there are none)."""
        if not self.sink_tokens or self.window is None:
            return 0
        if self.held_sinks:
            return min(self.held_sinks, self.key_end)
        return max(0, min(self._slot(self.sink_tokens), self.key_end))

    def key_ranges(self, r0: int, r1: int) -> list[tuple[int, int]]:
        """The runs of keys ``[start, stop)`` that some query of rows ``[r0, r1)`` may see
        by the lengths, the causal mask, the window (and its sink tokens) and the chunks,
        in order; a mask or bias may hide more."""
        stop = self.key_end
        if self.causal:
            stop = min(stop, r1 + self.offset)
        start = 0 if self.window is None else max(0, r0 + self.offset - self.window + 1)
        first = last = 0
        if self.chunk is not None:  # positions of the first and past the last row's chunk
            c = self.chunk
            first = (r0 + self.offset + self.key_index) // c * c
            last = ((r1 - 1 + self.offset + self.key_index) // c + 1) * c
            start, stop = max(start, self._slot(first)), min(stop, self._slot(last))
        ranges = []
        sinks = self.sink_end()
        if sinks and start > 0:
            lo, hi = 0, min(sinks, stop)
            if self.chunk is not None:
                held = self.held_sinks > 0
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
        sinks = self.sink_end()
        for a, b in self.key_ranges(r0, r1):
            c0, b = max(a, start), min(b, stop)
            while c0 < b:
                c1 = min(c0 + width, b)
                if c0 < sinks < c1:
                    c1 = sinks
                if self.chunk is not None:
                    at = int(self.key_positions(c0, c0 + 1)[0])
                    edge = (at // self.chunk + 1) * self.chunk  # the next chunk's position
                    c1 = min(c1, edge if c0 < self.held_sinks else self._slot(edge))
                yield c0, c1
                c0 = c1

    def bias_block(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray | None:
        return None if self.bias is None else _block(self.bias, r0, r1, c0, c1)

    def rows_seeing(self, r0: int, r1: int, c0: int, c1: int) -> tuple[int, int]:
        """The run ``[a, b)`` of rows of ``[r0, r1)`` that may see some key of ``[c0, c1)``
        by the causal mask, the window, the chunks and the mask's block map: rows outside it
        see no key of the block. ``a == b`` when no row does."""
        a, b = r0, r1
        if self.causal:
            a = max(a, c0 - self.offset)
        if self._window_applies(c0):
            b = min(b, c1 - 1 - self.offset + (self.window or 0))
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

    def _window_applies(self, c0: int) -> bool:
        """Whether the window bounds a block starting at key ``c0`` as a band (a block with
        sink tokens in it is bounded by them instead)."""
        return self.window is not None and c0 >= self.sink_end()

    def band(self, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray] | None:
        """For each row of ``[r0, r1)``, the keys ``[lo, hi)`` of the block ``[c0, c1)`` (as
        offsets from ``c0``) that the causal mask and the window leave visible, as two int64
        arrays; ``None`` when they hide nothing in the block."""
        crosses_diagonal = self.causal and c1 - 1 > r0 + self.offset
        window = self.window or 0
        crosses_edge = self._window_applies(c0) and c0 <= r1 - 1 + self.offset - window
        if not (crosses_diagonal or crosses_edge):
            return None
        rows = np.arange(r0 + self.offset - c0, r1 + self.offset - c0)  # aligned key, from c0
        w = c1 - c0
        lo = np.zeros(r1 - r0, np.int64)
        hi = np.full(r1 - r0, w, np.int64)
        if crosses_diagonal:
            hi = np.clip(rows + 1, 0, w)
        if crosses_edge:
            lo = np.clip(rows - window + 1, 0, w)
        return lo, hi

    def band_and_hidden(
        self, r0: int, r1: int, c0: int, c1: int
    ) -> tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]:
        """For the compiled step: each row's band of visible keys (:meth:`band`), narrowed by
        whatever else hides keys where each row still sees one run of them (as causal,
        window and document masks written as ``mask_mod`` do), and the boolean block of what
        a band cannot say (``None`` when nothing). With a ``mask_mod`` the result is kept
        for the other heads of the call, when it is the same for every head."""
        heads = None if self.alike else (self.heads.start, self.heads.stop)
        key = (self.sequence, heads, self.offset, self.key_index, self.query_index, r0, r1, c0, c1)
        if self.memo is not None and key in self.memo:
            kept: tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]
            kept = self.memo[key]
            return kept
        band = self.band(r0, r1, c0, c1)
        hidden = self.hidden(r0, r1, c0, c1, band=False)
        if hidden is not None and hidden.shape[0] == 1:
            runs = _runs(~hidden[0])
            if runs is not None:
                band = runs if band is None else (np.maximum(band[0], runs[0]),
                                                  np.minimum(band[1], runs[1]))  # fmt: skip
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
        offset = self.offset
        if band and self.causal and c1 - 1 > r0 + offset:  # the block crosses the diagonal
            hidden = np.arange(c0, c1)[None, :] > np.arange(r0 + offset, r1 + offset)[:, None]
        window = self.window or 0
        if (
            self.window is not None
            and (band or not self._window_applies(c0))
            and c0 <= r1 - 1 + offset - window
        ):
            below = np.arange(c0, c1)[None, :] <= np.arange(r0, r1)[:, None] + (offset - window)
            sinks = self.sink_end()
            if sinks > c0:  # sink tokens stay visible
                below &= np.arange(c0, c1)[None, :] >= sinks
            hidden = _or(hidden, below)
        if self.chunk is not None:
            rows = self.query_positions(r0, r1) // self.chunk
            keys = self.key_positions(c0, c1) // self.chunk
            if rows[0] != rows[-1] or keys[0] != keys[-1] or rows[0] != keys[0]:
                hidden = _or(hidden, rows[:, None] != keys[None, :])
        if self.mask is not None:
            hidden = _or(hidden, ~_block(self.mask, r0, r1, c0, c1))
        if self.bias_hides_keys and self.bias is not None:
            hidden = _or(hidden, np.isneginf(_block(self.bias, r0, r1, c0, c1)))
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


def _select(array: np.ndarray | None, batch: tuple[int, ...], heads: slice) -> np.ndarray | None:
    """The ``(G or 1, L or 1, S or 1)`` part of a full-rank array for one batch index."""
    if array is None:
        return None
    index: tuple[Any, ...] = tuple(
        0 if size == 1 else i for size, i in zip(array.shape, batch, strict=False)
    )
    picked: np.ndarray = array[(*index, heads if array.shape[-3] != 1 else slice(None))]
    return picked


def split_mask(mask: Any) -> tuple[bool, np.ndarray | None]:
    """A Python or NumPy bool (``mask=True``) is the causal flag; an array, even a 0-d one,
    is a visibility mask."""
    if mask is None:
        return False, None
    if isinstance(mask, (bool, np.bool_)):
        return bool(mask), None
    array = as_array("mask", mask)
    if array.dtype.kind != "b":
        given = (
            f"an array of dtype {array.dtype}"
            if isinstance(mask, (np.ndarray, list, tuple))
            else f"{reprlib.repr(mask)} of type {type(mask).__name__}"
        )
        raise AttentionTypeError(
            f"mask must be None, True/False (causal) or a boolean array with True = may "
            f"attend; got {given}. For an additive mask of 0 and -inf, pass it as bias= instead."
        )
    return False, array


def _describe(full: tuple[int, ...], batch_shape: tuple[int, ...]) -> str:
    names = {0: "(H, L, S)", 1: "(B, H, L, S)"}.get(len(batch_shape), "(batch..., H, L, S)")
    return f"{names} = {full}"


def fit_to_scores(
    name: str, array: np.ndarray, full: tuple[int, ...], batch_shape: tuple[int, ...]
) -> np.ndarray:
    """``array`` as a view that broadcasts against the scores, or a ShapeError."""
    given = array.shape
    if batch_shape and array.ndim == len(full) - 1:
        array = np.expand_dims(array, -3)  # (B, L, S): the same for every head
    if not broadcasts_to(array.shape, full):
        hint = ""
        if batch_shape:
            hint = (
                f"; a {len(full) - 1}-D {name} is read as (B, L, S) for every head, "
                f"a per-head {name} needs {len(full)} axes (B or 1, H, L, S)"
            )
        raise ShapeError(
            f"{name} of shape {given} does not broadcast to the scores' shape "
            f"{_describe(full, batch_shape)}{hint}"
        )
    return array.reshape((1,) * (len(full) - array.ndim) + array.shape)  # full rank, a view


def check_lengths(
    name: str, lengths: Any, batch_shape: tuple[int, ...], limit: int, axis: str, context: str
) -> np.ndarray | None:
    if lengths is None:
        return None
    array = as_array(name, lengths)
    if array.dtype.kind not in "iu" and array.size:  # an empty list reads as float: allow it
        raise AttentionTypeError(f"{name} must hold integers; got dtype {array.dtype}")
    where = f" ({context})" if context else ""
    if array.shape != batch_shape:
        raise ShapeError(
            f"{name} must hold one length per sequence, shape {batch_shape}; "
            f"got shape {array.shape}{where}"
        )
    if array.size and array.min() < 0:
        raise AttentionValueError(
            f"{name} must be >= 0; got {array.min()} (in {reprlib.repr(array.tolist())})"
        )
    if array.size and array.max() > limit:
        raise AttentionValueError(
            f"{name} must be <= {limit}, the number of {axis} positions{where}; "
            f"got {array.max()} (in {reprlib.repr(array.tolist())})"
        )
    return array.astype(np.int64)


def _sizes(batch: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*part.indices(size))) for part, size in zip(batch, shape, strict=True))


def _block(array: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    """Cut rows ``[r0, r1)`` and columns ``[c0, c1)``, leaving broadcast (size-1) axes whole."""
    rows = slice(r0, r1) if array.shape[-2] != 1 else slice(None)
    cols = slice(c0, c1) if array.shape[-1] != 1 else slice(None)
    return array[..., rows, cols]
