"""The key-selection stage: a choice of the keys each query attends to, made ahead of the
walk (sparse top-k attention, say; :class:`mha.api.spec.KeySelection`), joined to the
call's visibility as a mask."""

from __future__ import annotations

import numpy as np

from .._kernel.contract import Visibility, fit_to_scores
from ..errors import AttentionTypeError
from .spec import KeySelection

__all__ = ["select_keys"]


def select_keys(
    selection: KeySelection | None, q: np.ndarray, k: np.ndarray, visibility: Visibility
) -> Visibility:
    """``visibility`` with the keys ``selection`` keeps for each query (unchanged without
    one): its choice hides the rest, as a mask does, with the call's own mask."""
    if selection is None:
        return visibility
    full = (*visibility.index_shape, visibility.L, k.shape[-2])
    chosen = fit_to_scores(
        "the key selection", np.asarray(selection.select(q, k)), full, visibility.index_shape[:-1]
    )
    if chosen.dtype != np.bool_:
        raise AttentionTypeError(f"a key selection must be booleans; got {chosen.dtype}")
    mask = chosen if visibility.mask is None else visibility.mask & chosen
    return visibility.with_arrays(mask, visibility.bias)
