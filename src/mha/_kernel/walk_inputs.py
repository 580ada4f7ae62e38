"""What the compiled walks take of a call besides its arrays: the band of keys each query
sees (:func:`band_of`), the variants they compute themselves (:func:`variants_of`), and the
rows of their tiles where queries see narrow runs of keys (:func:`narrow_rows`)."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .call import KernelCall
from .contract import Visibility
from .geometry import BLOCK, EMPTY, NO_WINDOW

__all__ = ["BAND_ROWS", "band_of", "narrow_rows", "no_variants", "variants_of"]


def band_of(
    visibility: Visibility, batch_shape: tuple[int, ...], L: int, S: int
) -> tuple[bool, int, np.ndarray, np.ndarray, np.ndarray]:
    """The band as the compiled walks take it, for ``L`` queries and ``S`` keys: ``(causal,
    window, offsets, key_end, query_end)``, the window :data:`.geometry.NO_WINDOW` when
    there is none, each sequence's alignment offset, key length and query length as int64
    ``(B,)``."""
    B = math.prod(batch_shape)

    def per_sequence(values: np.ndarray | None, default: int) -> np.ndarray:
        if values is None:
            return np.full(B, default, np.int64)
        if np.shape(values) != batch_shape:  # (broadcast_to costs microseconds: not when equal)
            values = np.broadcast_to(values, batch_shape)
        return np.asarray(values).reshape(B).astype(np.int64)

    ahead = visibility.ahead  # a right window: the causal bound moved, the window widened
    window = NO_WINDOW if visibility.window is None else int(visibility.window) + ahead
    offsets = per_sequence(visibility.offsets, visibility.causal_offset)
    return (
        bool(visibility.causal),
        window,
        offsets + ahead if ahead else offsets,
        per_sequence(visibility.key_lengths, S),
        per_sequence(visibility.query_lengths, L),
    )


def variants_of(call: KernelCall, batch_shape: tuple[int, ...]) -> tuple[Any, ...]:
    """The variants the compiled walks compute themselves, as they take them
    (:func:`._numba_walk.forward`): ``(chunk, q_base, k_base, slopes, cap, blocks, index,
    masks)``: the chunk (0: none), each sequence's position of query row 0 and of key
    slot 0 (int64 ``(B,)``), ALiBi's slopes ``(1 or B, H)`` (in the call's dtype, as the
    NumPy walk adds them; size 0: none), soft-capping's cap (0.0: none), and a
    ``mask_mod``'s block map with its partial blocks' masks (size 0: none)."""
    visibility, scores, dtype = call.visibility, call.scores, call.q.dtype
    B = math.prod(batch_shape)
    chunk, slopes, cap = visibility.chunk or 0, None, 0.0
    if scores is not None and scores.transforms:
        cap = scores.softcap or 0.0
        if scores.alibi is not None:
            slopes = _slopes_of(scores.alibi, visibility, batch_shape).astype(dtype)
    if not chunk and not cap and slopes is None and visibility.blocks is None:
        return no_variants(B, dtype)
    if slopes is None:
        slopes = np.empty((0, 0), dtype)
    offsets = np.broadcast_to(
        visibility.causal_offset if visibility.offsets is None else visibility.offsets,
        batch_shape,
    )
    k_base = np.zeros(batch_shape, np.int64)
    if visibility.key_index is not None:
        k_base = k_base + np.broadcast_to(visibility.key_index, batch_shape).astype(np.int64)
    k_base = k_base.reshape(B)
    q_base = np.asarray(offsets, np.int64).reshape(B) + k_base
    blocks, index, masks = _NO_MAP
    if visibility.blocks is not None:
        assert visibility.partial is not None  # (else the walks refuse the call)
        blocks, (index, masks) = visibility.blocks, visibility.partial
        if blocks.shape[0] > 1:  # per sequence: the call's flat batch order
            blocks, index = (
                blocks.reshape(B, *blocks.shape[-3:]),
                index.reshape(B, *index.shape[-3:]),
            )
    return (chunk, q_base, k_base, slopes, float(cap), blocks, index, masks)


def _slopes_of(
    slopes: np.ndarray, visibility: Visibility, batch_shape: tuple[int, ...]
) -> np.ndarray:
    """ALiBi's slopes ``(H,)`` or per sequence ``(sequences, H)`` as the walks take them:
    ``(1 or B, H)`` float64, sequence ``b``'s of the call's flat batch order."""
    if slopes.ndim == 1:  # (copies: the walks' signature takes writeable arrays)
        return np.array(slopes, np.float64)[None]
    B = math.prod(batch_shape)
    if visibility.sequences is not None:  # a block of a call: its sequences' own
        return np.array(slopes[np.asarray(visibility.sequences).reshape(B)], np.float64)
    return np.array(slopes, np.float64).reshape(B, -1)


_NO_MAP = (
    np.empty((0, 0, 0, 0), np.int8),
    np.empty((0, 0, 0, 0), np.int32),
    np.empty((0, 0, 0), bool),
)


@functools.lru_cache(maxsize=64)
def no_variants(B: int, dtype: np.dtype) -> tuple[Any, ...]:
    """The variants of a call without any: no chunk, slopes, cap or map."""
    zeros = np.zeros(B, np.int64)  # (read only by the walks)
    return (0, zeros, zeros, np.empty((0, 0), dtype), 0.0, *_NO_MAP)


BAND_ROWS = 128
"""Rows of the walks' tiles where each query sees a narrow run of keys (a window, chunks, a
mask_mod's map): a tile of rows computes every key some row of it sees, so the backward's
512 rows of a window of 512 computed 1,023 keys each (twice the visible pairs) and a chunk's
512 rows its whole square, the forward's 256 rows 1.5 times the visible pairs; 128 rows
compute 1.25 times. Measured (L = 4,096, 8 heads, float32, on the Zen 5 EPYC): the
backward of a window of 512 took 0.33 of plain causal's backward against 0.47, the forward
42.6 ms against 46.0 (plain causal's own tiles stay at 256 rows: 130.7 ms at 128 against
124.9)."""


def narrow_rows(visibility: Visibility) -> int:
    """The most rows of a walk's tiles for this visibility: :data:`BAND_ROWS` where its
    queries see narrow runs of keys (a window or chunks narrower than the keys, or a
    ``mask_mod``'s map whose rows of blocks each see at most half of them: the backward's
    document mask took 0.22 of plain causal's backward against 0.29; a causal mask written
    as a mask_mod, whose last rows see every key, ran 6% slower so)."""
    S, blocks = visibility.S, visibility.blocks
    narrow = any(size is not None and size < S for size in (visibility.window, visibility.chunk))
    if not narrow and blocks is not None and blocks.size:
        seen = int(np.count_nonzero(blocks != EMPTY, axis=-1).max()) * BLOCK
        narrow = 2 * seen <= S
    return BAND_ROWS if narrow else 2**62
