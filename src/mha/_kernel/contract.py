"""The mask contract: every way of hiding keys from queries, combined with AND.

The attention scores have shape ``(*batch, H, L, S)`` (``batch`` is ``(B,)`` for the usual
batched call and ``()`` for an unbatched one). A query ``i`` may attend to a key ``j`` when
every one of these that was given allows it:

* ``mask``: a boolean array, **True = may attend**, broadcastable to ``(*batch, H, L, S)``.
  An array with the batch axes and ``(L, S)`` but no head axis (``(B, L, S)``) is accepted
  and applies to every head.
* ``causal``: ``j <= i + offset`` with ``offset = S - L`` (``causal_alignment=
  "bottom_right"``, the default: the last query sees every key), ``offset = 0``
  (``"top_left"``, PyTorch's ``is_causal``), or for each sequence ``b`` its own
  ``offset = key_lengths[b] - query_lengths[b]`` (``"bottom_right_per_sequence"``,
  FlashAttention's rule for variable lengths: each sequence's last real query sees its last
  real key). ``causal_alignment`` without a causal mask, a window, chunks, ALiBi or a query
  temperature (which read the queries' positions) is refused: it would change nothing.
* ``window``: a sliding window, ``(i + offset) - j < window`` (transformers'
  ``sliding_window``): each query sees at most ``window`` keys, itself included. A pair
  ``window=(left, right)`` bounds both sides as FlashAttention's ``window_size``: ``i +
  offset - left <= j <= i + offset + right``, ``-1`` leaving a side unbounded (``window=w``
  is ``(w - 1, -1)``; with ``causal`` the right side is 0).
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
``held_sink_tokens`` slots hold the sink tokens ``0..held_sink_tokens-1`` once a window dropped the
positions after them); a block of a call (:meth:`Visibility.block`) keeps the call's.

A query row that can see no key gets all-zero weights and a zero attention output.

>>> import numpy as np
>>> from mha._kernel.contract import MaskArrays, MaskRules, ScoreShape, Visibility
>>> rules = MaskRules.check(None, True, None, None, None, None, None)
>>> vis = Visibility.build(rules, MaskArrays(key_lengths=[2]), ScoreShape((1,), 1, 2, 3))
>>> vis.allowed()[0, 0]
array([[ True,  True, False],
       [ True,  True, False]])
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from .._arrays import (
    as_array,
    as_float_array,
    broadcasts_to,
    check_function,
    flag,
    int_at_least,
    non_negative_int,
    positive_int,
)
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .block_mask import Partial, classify
from .item import ItemVisibility, Memo, cut_block
from .team import Team

__all__ = [
    "CAUSAL_ALIGNMENTS",
    "CachedPositions",
    "MaskArrays",
    "MaskRules",
    "ScoreShape",
    "Visibility",
    "check_lengths",
    "check_variants",
    "fit_to_scores",
    "split_mask",
    "window_sides",
]

CAUSAL_ALIGNMENTS = ("bottom_right", "top_left", "bottom_right_per_sequence")

SEEN_SEQUENCES = 64
"""Sequences whose rows :meth:`Visibility.seen_fraction` counts, at most (the rest taken as
alike)."""


class ScoreShape(NamedTuple):
    """The shape of the scores: ``(*batch_shape, H, L, S)``."""

    batch_shape: tuple[int, ...]
    H: int
    L: int
    S: int


@dataclass(frozen=True)
class MaskRules:
    """What hides keys by rule rather than by an array: the causal mask and its alignment,
    the sliding window, the sink tokens beside it, the chunks and ``mask_mod``. Checked
    once by :meth:`check`; a part of a layer's spec."""

    causal: bool | None = False  # None: not given (causal over a cache, else not)
    alignment: str | None = None  # None: "bottom_right", not given
    window: int | None = None
    sink_tokens: int | None = None  # None: not given (no sink tokens)
    chunk: int | None = None
    mask_mod: Callable[..., Any] | None = None
    ahead: int | None = None  # a right window: keys visible after the query's own (None: all)

    @classmethod
    def check(
        cls,
        mask: Any,
        causal: Any,
        causal_alignment: Any,
        window: Any,
        sink_tokens: Any,
        chunk: Any,
        mask_mod: Any,
        placed: bool = False,
    ) -> MaskRules:
        """The rules of the keywords as given (``mask=True`` is the causal mask; a mask
        array is the call's own, :class:`MaskArrays`), or the error that names one.
        ``placed``: the call's scores read the queries' positions (ALiBi, a query
        temperature), which the alignment places."""
        mask_is_causal, _ = split_mask(mask)
        given = [flag("causal", causal)] if causal is not None else []
        given += [mask_is_causal] if isinstance(mask, (bool, np.bool_)) else []
        causal = any(given) if given else None  # causal=False or mask=False: not causal
        if causal_alignment is not None and (
            not isinstance(causal_alignment, str) or causal_alignment not in CAUSAL_ALIGNMENTS
        ):
            raise AttentionValueError(
                f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}; got {causal_alignment!r}"
            )
        window, ahead = window_sides(window)
        if causal_alignment is not None and not (
            causal or window or chunk or placed or ahead is not None
        ):
            raise AttentionValueError(
                f"causal_alignment={causal_alignment!r} has no effect without a causal mask "
                "(or a window, chunks, ALiBi or a query temperature, which it places too): "
                "pass causal=True (or mask=True) with it, or leave it out"
            )
        tokens, chunk = check_variants(sink_tokens, chunk, mask_mod, window)
        return cls(
            causal,
            causal_alignment,
            window,
            None if sink_tokens is None else tokens,
            chunk,
            mask_mod,
            None if causal else ahead,  # (the causal mask hides every key after the query)
        )


def window_sides(window: Any) -> tuple[int | None, int | None]:
    """``window=`` as the keys a query sees before its own, itself included (``None``:
    every one), and after it (``None``: every one): an int ``w`` is ``(w, None)``, a pair
    ``(left, right)`` FlashAttention's ``window_size`` (``-1`` unbounded): ``(left + 1,
    right)``."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)):
        return positive_int("window", window), None
    if len(window) != 2:
        raise AttentionTypeError(
            f"window must be a positive int or a pair (left, right) of ints >= -1 "
            f"(FlashAttention's window_size, -1 unbounded); got {window!r}"
        )
    left, right = (
        int_at_least(f"window's {side}", value, -1, "an integer >= -1 (-1: unbounded)")
        for side, value in zip(("left", "right"), window, strict=True)
    )
    return (None if left < 0 else left + 1), (None if right < 0 else right)


@dataclass(frozen=True)
class MaskArrays:
    """What hides keys by a call's own arrays, as given (checked against the scores by
    :meth:`Visibility.build`): the boolean ``mask`` (an array, not ``True``), the additive
    ``bias``, and the lengths of the keys and of the queries."""

    mask: Any = None
    bias: Any = None
    key_lengths: Any = None
    query_lengths: Any = None

    @classmethod
    def of(cls, mask: Any, bias: Any, key_lengths: Any, query_lengths: Any) -> MaskArrays:
        """The arrays of the keywords as given (``mask=True`` and ``False`` are rules)."""
        return cls(split_mask(mask)[1], bias, key_lengths, query_lengths)


@dataclass(frozen=True)
class CachedPositions:
    """Where a KV cache's rows and keys sit: each sequence's alignment ``offsets``, the
    position of its row 0 (``query_index``) and of key slot 0 (``key_index``), and the
    leading ``held_sink_tokens`` slots that hold positions ``0..held_sink_tokens-1``."""

    offsets: np.ndarray | None = None
    query_index: np.ndarray | None = None
    key_index: np.ndarray | None = None
    held_sink_tokens: int = 0


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
    offsets: np.ndarray | None = None  # per sequence, overriding causal_offset (a KV cache's,
    # or each sequence's own lengths': causal_alignment="bottom_right_per_sequence")
    sink_tokens: int = 0
    chunk: int | None = None
    mask_mod: Callable[..., Any] | None = None
    blocks: np.ndarray | None = None  # mask_mod's block map, from classified()
    partial: Partial | None = None  # its partial blocks' masks (None: too many to keep)
    query_index: np.ndarray | None = None  # per sequence: mask_mod's q_idx of row 0
    key_index: np.ndarray | None = None  # per sequence: the position of key slot 0
    held_sink_tokens: int = 0  # leading key slots that hold positions 0.. (a cache's sink tokens)
    sequences: np.ndarray | None = None  # per sequence: mask_mod's b (a block's, the call's)
    ahead: int = 0  # with causal: keys visible after the query's own (a right window)
    memo: Memo | None = field(default=None, compare=False, repr=False)  # from classified()

    @classmethod
    def build(
        cls,
        rules: MaskRules,
        given: MaskArrays,
        shape: ScoreShape,
        dtype: Any = np.float64,
        context: str = "",
        cached: CachedPositions | None = None,
    ) -> Visibility:
        """The visibility of scores of ``shape``: the call's ``rules`` (checked), and its
        arrays (``given``) checked against the shape and kept as views. ``context`` (such
        as "Q (2, 5, 8), K (2, 6, 8)") is added to length errors. ``cached`` (internal, for
        a KV cache) gives each sequence its own alignment offset ``i + offset`` for the
        causal mask and the window, and its positions."""
        batch_shape, H, L, S = shape
        full = (*batch_shape, H, L, S)
        offset = 0 if rules.alignment == "top_left" else S - L
        mask_array = None
        if given.mask is not None:
            mask_array = fit_to_scores("mask", given.mask, full, batch_shape)
        bias_array = None
        hides = False
        if given.bias is not None:
            bias_array = as_float_array("bias", given.bias)
            bias_array = fit_to_scores("bias", bias_array, full, batch_shape)
            with np.errstate(over="ignore"):
                bias_array = bias_array.astype(dtype, copy=False)
            hides = bool(np.isneginf(bias_array).any())
        lengths = (
            check_lengths("key_lengths", given.key_lengths, batch_shape, S, "key", context),
            check_lengths("query_lengths", given.query_lengths, batch_shape, L, "query", context),
        )
        cached = cached or CachedPositions()
        offsets = cached.offsets
        if rules.alignment == "bottom_right_per_sequence":  # (a cache's call refuses it)
            key_ends = np.full(batch_shape, S, np.int64) if lengths[0] is None else lengths[0]
            offsets = key_ends - (L if lengths[1] is None else lengths[1])
        return cls(
            index_shape=(*batch_shape, H),
            L=L,
            S=S,
            mask=mask_array,
            bias=bias_array,
            causal_offset=offset,
            key_lengths=lengths[0],
            query_lengths=lengths[1],
            bias_hides_keys=hides,
            causal=bool(rules.causal) or rules.ahead is not None,
            window=rules.window,
            ahead=0 if rules.causal or rules.ahead is None else rules.ahead,
            offsets=offsets,
            sink_tokens=rules.sink_tokens or 0,
            chunk=rules.chunk,
            mask_mod=rules.mask_mod,
            query_index=cached.query_index,
            key_index=cached.key_index,
            held_sink_tokens=cached.held_sink_tokens,
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
            k = np.where(keys < self.held_sink_tokens, keys, keys + self.key_index.reshape(-1, 1))
        b = np.arange(count) if self.sequences is None else self.sequences.reshape(-1)
        blocks, partial = classify(self.mask_mod, b, self.index_shape[-1], q, k, team)
        return replace(self, blocks=blocks, partial=partial, memo=Memo())

    def query_positions(self) -> np.ndarray:
        """Each query row's position, aligned with the keys' (what
        :meth:`ItemVisibility.query_positions` gives each item): int64 ``(*batch, 1, L)``."""
        batch = self.index_shape[:-1]
        start = np.full(batch, self.causal_offset, np.int64)
        if self.offsets is not None:
            start = np.broadcast_to(self.offsets, batch).astype(np.int64)
        if self.key_index is not None:
            start = start + np.broadcast_to(self.key_index, batch)
        return start[..., None, None] + np.arange(self.L, dtype=np.int64)

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
            held_sink_tokens=self.held_sink_tokens,
            sequence=sequence,
            memo=self.memo,
            alike=self._heads_alike(),
            heads=heads,
            ahead=self.ahead,
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
        if self.held_sink_tokens or self.key_index is not None:
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
            return cut_block(array[index], r0, r1, c0, c1)

        return Visibility(
            index_shape=(*sizes, self.index_shape[-1]),
            L=r1 - r0,
            S=c1 - c0,
            mask=part(self.mask),
            bias=part(self.bias),
            causal_offset=self.causal_offset + r0 - c0,
            offsets=None if self.offsets is None else self.offsets[batch] + (r0 - c0),
            key_lengths=cut(self.key_lengths, c0, c1),
            query_lengths=cut(self.query_lengths, r0, r1),
            bias_hides_keys=self.bias_hides_keys,
            causal=self.causal,
            window=self.window,
            ahead=self.ahead,
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

    def seen_fraction(self) -> float:
        """About what share of the ``L x S`` pairs the lengths, the causal mask, the window
        and the chunks leave to be computed (1.0 when no rule hides keys): the call's work,
        from which its workers are chosen (:func:`.team.workers_for`). Counted row by row,
        as :meth:`item` places them, for the first ``SEEN_SEQUENCES`` sequences (fewer
        when ``L`` is long; the rest taken as alike; a mask, bias or ``mask_mod`` may hide
        more, and sink tokens are not counted)."""
        L, S = self.L, self.S
        batch = self.index_shape[:-1]
        count = int(np.prod(batch)) if batch else 1
        rules = self.causal or self.window is not None or self.chunk is not None
        lengths = self.key_lengths is not None or self.query_lengths is not None
        if L * S * count == 0 or not (rules or lengths):
            return 1.0
        take = max(1, min(count, SEEN_SEQUENCES, 2**20 // L))

        def per_sequence(values: np.ndarray | None, default: int) -> np.ndarray:
            if values is None:
                return np.full((take, 1), default, np.int64)
            return np.broadcast_to(values, batch).reshape(-1)[:take, None].astype(np.int64)

        offsets = per_sequence(self.offsets, self.causal_offset)
        key_index = per_sequence(self.key_index, 0)
        rows = np.arange(L, dtype=np.int64)[None]
        start = np.zeros((take, L), np.int64)
        stop = np.broadcast_to(per_sequence(self.key_lengths, S), (take, L))
        band = offsets + self.ahead  # (a right window moves the causal bound, as item's)
        if self.causal:
            stop = np.minimum(stop, rows + 1 + band)
        if self.window is not None:
            start = np.maximum(start, rows + band - (self.window + self.ahead) + 1)
        if self.chunk is not None:
            first = (rows + offsets + key_index) // self.chunk * self.chunk - key_index
            start, stop = np.maximum(start, first), np.minimum(stop, first + self.chunk)
        widths = np.clip(stop - start, 0, None) * (rows < per_sequence(self.query_lengths, L))
        return float(widths.sum()) / (take * L * S)

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


def _select(array: np.ndarray | None, batch: tuple[int, ...], heads: slice) -> np.ndarray | None:
    """The ``(G or 1, L or 1, S or 1)`` part of a full-rank array for one batch index."""
    if array is None:
        return None
    index: tuple[Any, ...] = tuple(
        0 if size == 1 else i for size, i in zip(array.shape, batch, strict=False)
    )
    picked: np.ndarray = array[(*index, heads if array.shape[-3] != 1 else slice(None))]
    return picked


def check_variants(
    sink_tokens: Any, chunk: Any, mask_mod: Any, window: int | None
) -> tuple[int, int | None]:
    """The variants' part of the contract, checked: ``(sink_tokens, chunk)`` (0 and
    ``None`` when not given); ``window`` is the call's, already checked."""
    tokens = 0 if sink_tokens is None else non_negative_int("sink_tokens", sink_tokens)
    if tokens and window is None:
        raise AttentionValueError(
            f"sink_tokens={sink_tokens} keeps the first keys visible beside a sliding window's "
            "left side, but no window= bounds it (none given, or a left side of -1): give "
            "window= too, or leave sink_tokens out"
        )
    if mask_mod is not None:
        check_function("mask_mod", mask_mod, "(b, h, q_idx, kv_idx) -> bool array", 4)
    return tokens, None if chunk is None else positive_int("chunk", chunk)


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
