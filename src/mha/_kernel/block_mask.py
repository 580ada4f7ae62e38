"""User-defined masks: a ``mask_mod`` and its block map, as FlexAttention's block mask.

``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` of head ``h`` in
sequence ``b`` may attend to key ``kv_idx``. It is called with int64 arrays that broadcast
as ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, n, 1)``, ``kv_idx (1, 1, 1, w)``
(``b`` and the positions take ``B`` rows when they differ by sequence), so that one call
covers a whole block of scores in NumPy, never one element at a time in Python.

Before the kernel runs, :func:`classify` evaluates the mask once over the scores, block
by block of ``BLOCK x BLOCK``, in slices of bounded size, and keeps one byte per block:
``EMPTY`` (the kernel skips it), ``FULL`` (the kernel does not evaluate the mask there) or
``PARTIAL`` (the NumPy walk evaluates it for that tile; the compiled walk reads the mask of
each partial block, kept from this one evaluation: :class:`Partial`). A mask that ignores
``b`` or ``h``
returns an array without those axes (size 1), and its map is kept, and computed, once for
every sequence or head: a document mask costs one evaluation, not one per head.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._arrays import broadcasts_to
from ..errors import AttentionTypeError, ShapeError
from . import runtime
from .geometry import BLOCK, EMPTY, FULL, PARTIAL
from .team import Team

__all__ = ["BLOCK", "EMPTY", "FULL", "PARTIAL", "Partial", "classify", "evaluate"]


PARTIAL_MOST = 64 * 2**20
"""The most bytes of partial blocks' masks a call keeps (4,096 blocks): beyond, none is
kept and the NumPy walk evaluates the mask tile by tile."""


class Partial(NamedTuple):
    """The masks of a block map's ``PARTIAL`` blocks, as :func:`classify` evaluated them:
    block ``(b, h, i, j)``'s is ``masks[slots[b, h, i, j]]`` (``BLOCK x BLOCK``, True = may
    attend, False past the scores' edges), ``slots`` shaped as the map."""

    slots: np.ndarray  # int32
    masks: np.ndarray  # bool (count, BLOCK, BLOCK)


def evaluate(
    mask_mod: Callable[..., Any],
    b: np.ndarray,
    h: np.ndarray,
    q_idx: np.ndarray,
    kv_idx: np.ndarray,
    shape: tuple[int, int, int, int],
) -> np.ndarray:
    """``mask_mod`` at the given index arrays: a boolean array of four axes that broadcasts
    to ``shape`` ``(B, H, n, w)``, or a named error."""
    result = np.asarray(mask_mod(b, h, q_idx, kv_idx))
    if result.dtype != np.bool_:
        raise AttentionTypeError(
            f"mask_mod must return booleans (True = may attend); it returned dtype "
            f"{result.dtype} for index arrays broadcasting to (B, H, n, w) = {shape}"
        )
    if not broadcasts_to(result.shape, shape):
        raise ShapeError(
            f"mask_mod returned shape {result.shape}, which does not broadcast to the "
            f"(B, H, n, w) = {shape} of its index arrays b {b.shape}, h {h.shape}, "
            f"q_idx {q_idx.shape}, kv_idx {kv_idx.shape}"
        )
    return result.reshape((1,) * (4 - result.ndim) + result.shape)


def classify(
    mask_mod: Callable[..., Any],
    sequences: np.ndarray,
    H: int,
    q_positions: np.ndarray,
    k_positions: np.ndarray,
    team: Team | None = None,
) -> tuple[np.ndarray, Partial | None]:
    """The block map ``(B or 1, H or 1, ceil(L / BLOCK), ceil(S / BLOCK))`` of ``EMPTY``,
    ``PARTIAL`` and ``FULL`` for the sequences numbered ``sequences (B,)`` (the mask's
    ``b``), of ``H`` heads, whose rows have the mask's query indices ``q_positions (B or
    1, L)`` and whose keys have ``k_positions (B or 1, S)``, and the masks of its partial
    blocks (``None`` beyond :data:`PARTIAL_MOST` bytes). The slices of rows are shared among
    ``team``'s workers."""
    L, S = q_positions.shape[-1], k_positions.shape[-1]
    batch = len(sequences)
    b = np.asarray(sequences, np.int64).reshape(-1, 1, 1, 1)
    h = np.arange(H, dtype=np.int64).reshape(1, -1, 1, 1)
    rows, cols = -(-L // BLOCK), -(-S // BLOCK)
    if L == 0 or S == 0 or batch == 0 or H == 0:  # nothing to see (and no slice to size)
        empty = np.zeros((1, 1, rows, cols), np.int8)
        return empty, Partial(empty.astype(np.int32), np.zeros((0, BLOCK, BLOCK), bool))
    probe = evaluate(
        mask_mod,
        b,
        h,
        q_positions[:, None, :1, None],
        k_positions[:, None, None, :1],
        (batch, H, 1, 1),
    )
    B_, H_ = probe.shape[0], probe.shape[1]  # 1 where the mask ignores the sequence or head
    blocks = np.empty((B_, H_, rows, cols), np.int8)
    at_once = runtime.DEFAULT.thresholds.evaluated_at_once  # pairs a call: ~4 MiB of bools
    width = min(S, max(BLOCK, at_once // (B_ * H_ * BLOCK) // BLOCK * BLOCK))
    height = max(BLOCK, at_once // (B_ * H_ * width) // BLOCK * BLOCK)
    slices = [
        (r0, min(r0 + height, L), c0, min(c0 + width, S))
        for r0 in range(0, L, height)
        for c0 in range(0, S, width)
    ]

    found: list[tuple[tuple[np.ndarray, ...], np.ndarray]] = []  # each slice's partial blocks
    kept = [0]  # their bytes so far
    lock = threading.Lock()

    def make_worker() -> Callable[[tuple[int, int, int, int]], None]:
        def run(piece: tuple[int, int, int, int]) -> None:
            r0, r1, c0, c1 = piece
            shape = (B_, H_, r1 - r0, c1 - c0)
            allowed = evaluate(
                mask_mod,
                b[:B_],
                h[:, :H_],
                q_positions[:, None, r0:r1, None],
                k_positions[:, None, None, c0:c1],
                shape,
            )
            counts = _block_counts(np.broadcast_to(allowed, shape))
            sizes = np.outer(_block_sizes(r1 - r0), _block_sizes(c1 - c0))
            cell = np.where(counts == 0, EMPTY, np.where(counts == sizes, FULL, PARTIAL))
            at = (r0 // BLOCK, c0 // BLOCK)
            blocks[:, :, at[0] : -(-r1 // BLOCK), at[1] : -(-c1 // BLOCK)] = cell
            where = np.nonzero(cell == PARTIAL)
            if not len(where[0]):
                return
            with lock:
                kept[0] += len(where[0]) * BLOCK * BLOCK
                if kept[0] > PARTIAL_MOST:
                    return
            masks = _blocks_of(np.broadcast_to(allowed, shape))[where]
            with lock:
                found.append(((where[0], where[1], where[2] + at[0], where[3] + at[1]), masks))

        return run

    (team or Team(1)).run(slices, make_worker)
    if kept[0] > PARTIAL_MOST:
        return blocks, None
    index = np.zeros(blocks.shape, np.int32)
    count = 0
    for where, masks in found:
        index[where] = np.arange(count, count + len(masks), dtype=np.int32)
        count += len(masks)
    masks = np.concatenate([m for _, m in found]) if found else np.zeros((0, BLOCK, BLOCK), bool)
    return blocks, Partial(index, masks)


def _blocks_of(allowed: np.ndarray) -> np.ndarray:
    """``allowed (B, H, n, w)`` as its ``BLOCK x BLOCK`` blocks ``(B, H, rows, cols, BLOCK,
    BLOCK)``, edges padded with False."""
    B, H, n, w = allowed.shape
    rows, cols = -(-n // BLOCK), -(-w // BLOCK)
    padded = np.zeros((B, H, rows * BLOCK, cols * BLOCK), bool)
    padded[:, :, :n, :w] = allowed
    return padded.reshape(B, H, rows, BLOCK, cols, BLOCK).transpose(0, 1, 2, 4, 3, 5)


def _block_counts(allowed: np.ndarray) -> np.ndarray:
    """How many pairs of each ``BLOCK x BLOCK`` block of ``allowed (B, H, n, w)`` are True:
    rows summed first (as bytes, at most ``BLOCK``), then keys; edges padded with False."""
    B, H, n, w = allowed.shape
    rows, cols = -(-n // BLOCK), -(-w // BLOCK)
    bytes_ = allowed.view(np.uint8)
    if n % BLOCK or w % BLOCK:
        bytes_ = np.pad(bytes_, ((0, 0), (0, 0), (0, rows * BLOCK - n), (0, cols * BLOCK - w)))
    per_column = bytes_.reshape(B, H, rows, BLOCK, cols * BLOCK).sum(axis=3, dtype=np.uint8)
    counts: np.ndarray = per_column.reshape(B, H, rows, cols, BLOCK).sum(axis=4, dtype=np.int32)
    return counts


def _block_sizes(n: int) -> np.ndarray:
    """The sizes of the blocks that cut ``n`` positions."""
    sizes = np.full(-(-n // BLOCK), BLOCK, np.int64)
    if n % BLOCK:
        sizes[-1] = n % BLOCK
    return sizes
