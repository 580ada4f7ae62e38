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
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._arrays import as_array, as_float_array, flag, positive_int
from ..errors import AttentionTypeError, AttentionValueError, ShapeError

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
        offsets: np.ndarray | None = None,
        dtype: Any = np.float64,
        context: str = "",
    ) -> Visibility:
        """Check every masking argument against the scores' shape and keep the parts.

        ``context`` (such as "Q (2, 5, 8), K (2, 6, 8)") is added to length errors.
        ``offsets`` (internal, for the KV cache) gives each sequence its own alignment
        offset ``i + offset`` for the causal mask and the window."""
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
        )

    def item(self, batch: tuple[int, ...], heads: slice) -> ItemVisibility:
        """The parts that apply to one batch index and a run of its heads."""
        offset = self.causal_offset if self.offsets is None else int(self.offsets[batch])
        return ItemVisibility(
            key_end=self.S if self.key_lengths is None else int(self.key_lengths[batch]),
            query_end=self.L if self.query_lengths is None else int(self.query_lengths[batch]),
            offset=offset,
            causal=self.causal,
            window=self.window,
            mask=_select(self.mask, batch, heads),
            bias=_select(self.bias, batch, heads),
            bias_hides_keys=self.bias_hides_keys,
        )

    def block(self, batch: tuple[slice, ...], rows: slice, cols: slice) -> Visibility:
        """The visibility of one block of the scores: the batch indices ``batch`` (one slice
        per batch axis, every head), query rows ``rows`` and keys ``cols`` (slices with
        start and stop), as a call over just those queries and keys would see it. The
        causal mask and the window keep their alignment, lengths count from the block's
        first row and key, and a mask or bias is cut (:meth:`with_arrays` gives a block its
        own instead)."""
        r0, r1, c0, c1 = rows.start, rows.stop, cols.start, cols.stop

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
            index_shape=(*_sizes(batch, self.index_shape[:-1]), self.index_shape[-1]),
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
            offsets=None if self.offsets is None else self.offsets[batch] + r0 - c0,
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
            if rows > 0 and item.key_stop(0, rows) > item.key_start(0, rows):
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
    ``(G or 1, L or 1, S or 1)`` for the run of ``G`` heads.
    """

    key_end: int
    query_end: int
    offset: int  # query i is aligned with key i + offset (causal mask and window)
    causal: bool
    window: int | None
    mask: np.ndarray | None  # True = may attend
    bias: np.ndarray | None
    bias_hides_keys: bool

    def key_stop(self, r0: int, r1: int) -> int:
        """One past the last key that any query in rows ``[r0, r1)`` may see."""
        stop = self.key_end
        if self.causal:
            stop = min(stop, r1 + self.offset)
        return max(stop, 0)

    def key_start(self, r0: int, r1: int) -> int:
        """The first key that any query in rows ``[r0, r1)`` may see (the window's edge)."""
        if self.window is None:
            return 0
        return max(0, r0 + self.offset - self.window + 1)

    def bias_block(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray | None:
        return None if self.bias is None else _block(self.bias, r0, r1, c0, c1)

    def rows_seeing(self, r0: int, r1: int, c0: int, c1: int) -> tuple[int, int]:
        """The run ``[a, b)`` of rows of ``[r0, r1)`` that the causal mask and the window let
        see some key of ``[c0, c1)``: rows before it see only earlier keys, rows after it only
        later ones. ``a == b`` when no row does."""
        a, b = r0, r1
        if self.causal:
            a = max(a, c0 - self.offset)
        if self.window is not None:
            b = min(b, c1 - 1 - self.offset + self.window)
        return a, max(a, b)

    def band(self, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray] | None:
        """For each row of ``[r0, r1)``, the keys ``[lo, hi)`` of the block ``[c0, c1)`` (as
        offsets from ``c0``) that the causal mask and the window leave visible, as two int64
        arrays; ``None`` when they hide nothing in the block."""
        crosses_diagonal = self.causal and c1 - 1 > r0 + self.offset
        crosses_edge = self.window is not None and c0 <= r1 - 1 + self.offset - self.window
        if not (crosses_diagonal or crosses_edge):
            return None
        rows = np.arange(r0 + self.offset - c0, r1 + self.offset - c0)  # aligned key, from c0
        w = c1 - c0
        lo = np.zeros(r1 - r0, np.int64)
        hi = np.full(r1 - r0, w, np.int64)
        if crosses_diagonal:
            hi = np.clip(rows + 1, 0, w)
        if crosses_edge and self.window is not None:
            lo = np.clip(rows - self.window + 1, 0, w)
        return lo, hi

    def hidden(self, r0: int, r1: int, c0: int, c1: int, band: bool = True) -> np.ndarray | None:
        """Boolean ``(G or 1, r1 - r0, c1 - c0)``: True where the causal mask, the window,
        the boolean mask or a ``-inf`` bias hides the key; ``None`` when nothing in the
        block is hidden. Padding is not included: the kernel's loops stop at it. With
        ``band=False``, the causal mask and the window are left to :meth:`band`."""
        hidden = None
        offset = self.offset
        if band and self.causal and c1 - 1 > r0 + offset:  # the block crosses the diagonal
            hidden = np.arange(c0, c1)[None, :] > np.arange(r0 + offset, r1 + offset)[:, None]
        if band and self.window is not None and c0 <= r1 - 1 + offset - self.window:
            below = np.arange(c0, c1)[None, :] <= np.arange(r0, r1)[:, None] + (
                offset - self.window
            )
            hidden = below if hidden is None else hidden | below
        if self.mask is not None:
            hidden = _or(hidden, ~_block(self.mask, r0, r1, c0, c1))
        if self.bias_hides_keys and self.bias is not None:
            hidden = _or(hidden, np.isneginf(_block(self.bias, r0, r1, c0, c1)))
        return hidden


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
    fits = array.ndim <= len(full)
    if fits:
        try:
            fits = np.broadcast_shapes(array.shape, full) == full
        except ValueError:
            fits = False
    if not fits:
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
