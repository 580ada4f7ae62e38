"""The mask contract: every way of hiding keys from queries, combined with AND.

The attention scores have shape ``(*batch, H, L, S)`` (``batch`` is ``(B,)`` for the usual
batched call and ``()`` for an unbatched one). A query ``i`` may attend to a key ``j`` when
every one of these that was given allows it:

* ``mask``: a boolean array, **True = may attend**, broadcastable to ``(*batch, H, L, S)``.
  An array with the batch axes and ``(L, S)`` but no head axis (``(B, L, S)``) is accepted
  and applies to every head.
* ``causal``: ``j <= i + (S - L)`` ("bottom_right", the last query sees every key) or
  ``j <= i`` ("top_left", PyTorch's ``is_causal``).
* ``key_lengths``: integers of the batch shape; keys at index ``>= length`` are padding.
* ``query_lengths``: integers of the batch shape; query rows at index ``>= length`` are
  padding, see no key, and get zero output.
* ``bias``: an additive float array broadcastable like ``mask``; ``-inf`` hides a key.

A query row that can see no key gets all-zero weights and a zero output.

>>> import numpy as np
>>> from mha.masks import Visibility
>>> vis = Visibility.build(batch_shape=(1,), H=1, L=2, S=3, causal=True, key_lengths=[2])
>>> vis.allowed()[0, 0]
array([[ True,  True, False],
       [ True,  True, False]])
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np

from ._arrays import as_array, as_float_array
from .errors import AttentionTypeError, AttentionValueError, ShapeError

__all__ = ["CAUSAL_ALIGNMENTS", "Visibility"]

CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


@dataclass(frozen=True)
class Visibility:
    """Which keys each query may see, kept as its parts so any block can be cut from it.

    ``allowed(rows, cols)`` gives the combined boolean for a block of queries and keys,
    broadcastable to ``(*batch, H, rows, cols)``, without building the full-size mask when
    the caller asks for a block. ``None`` means everything in the block is visible.
    """

    L: int
    S: int
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    causal_offset: int | None = None
    key_lengths: np.ndarray | None = None
    query_lengths: np.ndarray | None = None
    bias_hides_keys: bool = False

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
        causal_alignment: Any = "bottom_right",
        key_lengths: Any = None,
        query_lengths: Any = None,
        bias: Any = None,
        dtype: Any = np.float64,
    ) -> Visibility:
        """Check every masking argument against the scores' shape and keep the parts."""
        full = (*batch_shape, H, L, S)
        mask_is_causal, mask_array = _split_mask(mask)
        causal = _flag("causal", causal) or mask_is_causal
        if causal_alignment not in CAUSAL_ALIGNMENTS:
            raise AttentionValueError(
                f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}; got {causal_alignment!r}"
            )
        offset = None
        if causal:
            offset = S - L if causal_alignment == "bottom_right" else 0
        if mask_array is not None:
            mask_array = _fit_to_scores("mask", mask_array, full, batch_shape)
        bias_array = None
        hides = False
        if bias is not None:
            bias_array = as_float_array("bias", bias)
            bias_array = _fit_to_scores("bias", bias_array, full, batch_shape)
            with np.errstate(over="ignore"):
                bias_array = bias_array.astype(dtype, copy=False)
            hides = bool(np.isneginf(bias_array).any())
        return cls(
            L=L,
            S=S,
            mask=mask_array,
            bias=bias_array,
            causal_offset=offset,
            key_lengths=_lengths("key_lengths", key_lengths, batch_shape, S, "key"),
            query_lengths=_lengths("query_lengths", query_lengths, batch_shape, L, "query"),
            bias_hides_keys=hides,
        )

    def allowed(self, rows: slice | None = None, cols: slice | None = None) -> np.ndarray | None:
        """The AND of every part over a block of queries ``rows`` and keys ``cols``."""
        rows = rows or slice(0, self.L)
        cols = cols or slice(0, self.S)
        i = np.arange(rows.start, rows.stop)[:, None]
        j = np.arange(cols.start, cols.stop)[None, :]
        parts = []
        if self.causal_offset is not None:
            parts.append(j <= i + self.causal_offset)
        if self.key_lengths is not None:
            parts.append(j < self.key_lengths[..., None, None, None])
        if self.query_lengths is not None:
            parts.append(i < self.query_lengths[..., None, None, None])
        if self.mask is not None:
            parts.append(_block(self.mask, rows, cols))
        if self.bias_hides_keys and self.bias is not None:
            parts.append(~np.isneginf(_block(self.bias, rows, cols)))
        if not parts:
            return None
        return reduce(np.logical_and, parts)

    def bias_block(self, rows: slice | None = None, cols: slice | None = None) -> np.ndarray | None:
        """The additive bias over a block, or ``None``."""
        if self.bias is None:
            return None
        return _block(self.bias, rows or slice(0, self.L), cols or slice(0, self.S))


def _split_mask(mask: Any) -> tuple[bool, np.ndarray | None]:
    """``mask=True``/``False`` is the causal flag; an array is a visibility mask."""
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
    if array.ndim == 0:
        return bool(array), None
    return False, array


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise AttentionTypeError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def _describe(full: tuple[int, ...], batch_shape: tuple[int, ...]) -> str:
    names = {0: "(H, L, S)", 1: "(B, H, L, S)"}.get(len(batch_shape), "(batch..., H, L, S)")
    return f"{names} = {full}"


def _fit_to_scores(
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
    if array.ndim < 2:  # (S,) or a scalar: give it the (L, S) axes that blocks are cut from
        array = array.reshape((1,) * (2 - array.ndim) + array.shape)
    return array


def _lengths(
    name: str, lengths: Any, batch_shape: tuple[int, ...], limit: int, axis: str
) -> np.ndarray | None:
    if lengths is None:
        return None
    array = as_array(name, lengths)
    if array.dtype.kind not in "iu":
        raise AttentionTypeError(f"{name} must hold integers; got dtype {array.dtype}")
    if array.shape != batch_shape:
        raise ShapeError(
            f"{name} must hold one length per sequence, shape {batch_shape}; "
            f"got shape {array.shape}"
        )
    array = array.astype(np.int64)
    if array.size and array.min() < 0:
        raise AttentionValueError(f"{name} must be >= 0; got {array.min()} (in {array.tolist()})")
    if array.size and array.max() > limit:
        raise AttentionValueError(
            f"{name} must be <= {limit}, the number of {axis} positions; "
            f"got {array.max()} (in {array.tolist()})"
        )
    return array


def _block(array: np.ndarray, rows: slice, cols: slice) -> np.ndarray:
    """Cut a block of query rows and key columns, leaving broadcast (size-1) axes whole."""
    row_index = rows if array.shape[-2] != 1 else slice(None)
    col_index = cols if array.shape[-1] != 1 else slice(None)
    return array[..., row_index, col_index]
