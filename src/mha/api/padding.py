"""Left-padded prompts for a cache: ``padding_side="left"`` (transformers' tokenizers pad
on the left for generation) says that each sequence's real tokens are its last
``query_lengths[b]`` rows rather than its first. The calls move them to the front, append
and attend as for right padding, and move the outputs back: the padding rows are never
appended and their outputs are zeros, wherever they were.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._kernel.contract import MaskArrays
from ..errors import AttentionValueError

__all__ = ["check_padding_side", "to_front", "to_left"]


def check_padding_side(padding_side: Any, cache: Any, arrays: MaskArrays) -> bool:
    """Whether the padding rows come first (``"left"``); ``None`` and ``"right"``: last."""
    if padding_side is None or padding_side == "right":
        return False
    if padding_side != "left":
        raise AttentionValueError(f"padding_side must be 'left' or 'right'; got {padding_side!r}")
    if cache is None:
        raise AttentionValueError(
            "padding_side='left' says which rows of a prompt appended to a cache are padding; "
            "without cache=, give the lengths of right-padded inputs or a mask"
        )
    if arrays.bias is not None or arrays.mask is not None:
        raise AttentionValueError(
            "padding_side='left' cannot be combined with a mask= or bias= array (their rows "
            "would be the padded layout's): move each prompt's tokens first and give "
            "query_lengths, with the mask or bias in that order"
        )
    return True


def to_front(x: np.ndarray, counts: np.ndarray, axis: int) -> np.ndarray:
    """``x (B, ...)`` with each sequence's last ``counts[b]`` rows along ``axis`` (counted
    from the end) moved to its front (a copy; ``x`` as it is when nothing moves)."""
    return _rolled(x, counts, axis, -1)


def to_left(x: np.ndarray, counts: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of :func:`to_front`: each sequence's first ``counts[b]`` rows last."""
    return _rolled(x, counts, axis, 1)


def _rolled(x: np.ndarray, counts: np.ndarray, axis: int, sign: int) -> np.ndarray:
    L = x.shape[axis]
    shifts = L - np.asarray(counts)
    if not shifts.any():
        return x
    out = np.empty_like(x)
    for b, shift in enumerate(shifts):
        out[b] = np.roll(x[b], sign * int(shift), axis=axis)
    return out
