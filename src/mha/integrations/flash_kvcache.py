"""FlashAttention's ``flash_attn_with_kvcache`` on NumPy arrays (:mod:`mha.flash_compat`): a
decoding step or a chunk of a prompt against an engine's own cache, contiguous or in blocks,
with its rotary tables, computed by :func:`mha.scaled_dot_product_attention` with the
semantics of :mod:`.flash_attention`.

What FlashAttention's docstring and tests define, and this follows:

* ``k_cache``, ``v_cache``: ``(batch_cache, seqlen_cache, nheads_k, headdim)``, or with
  ``block_table (batch, max_blocks)`` pools ``(num_blocks, block_size, nheads_k,
  headdim)``; sequence ``b`` reads row ``cache_batch_idx[b]`` (default ``b``) of the cache
  or of ``block_table``.
* ``cache_seqlens``: each sequence's cached tokens (an int for all); ``k``, ``v`` ``(batch,
  seqlen_new, nheads_k, headdim)``, when given, are written **into the caches, in place**,
  at positions ``cache_seqlens[b]..`` (the one argument FlashAttention changes, and so
  does this function: after the attention is computed, so a refused call changes
  nothing), and the queries attend over ``cache_seqlens[b] + seqlen_new`` keys.
* ``cache_leftpad``: keys before ``cache_leftpad[b]`` are not seen (a left-padded cache).
* ``rotary_cos``, ``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)``, with ``k`` and ``v``:
  the new keys are rotated at positions ``cache_seqlens[b] + t`` before they are written,
  and the queries at ``cache_seqlens[b] + i`` when causal or windowed, else all at
  ``cache_seqlens[b]``; ``rotary_interleaved`` pairs features ``(2i, 2i + 1)`` (GPT-J,
  FlashAttention's default) or ``(i, i + r/2)`` (GPT-NeoX) (:func:`mha.apply_rotary`'s
  ``cos=``, ``sin=``).
* Beyond FlashAttention 2, which refuses them together: ``cache_batch_idx`` with a
  ``block_table`` picks each sequence's row of the table, and ``cache_leftpad`` works with
  a paged cache too.
* ``causal``, ``window_size``, ``softcap``, ``alibi_slopes``: as
  :func:`~mha.integrations.flash_attention.flash_attn_func`, bottom-right on each
  sequence's keys; ``num_splits`` changes nothing here (the split is FlashAttention's
  scheduling).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_array, as_float_array, flag, non_negative_int
from ..api.rotary import apply_rotary
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .flash_attention import attend_heads, block_table_of, flash_options, sequences, slots

__all__ = ["flash_attn_with_kvcache"]


def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """FlashAttention's ``flash_attn_with_kvcache``: ``q (batch, seqlen, nheads, headdim)``
    over each sequence's cached keys and values (and the new ``k``, ``v``, appended to the
    caches in place); returns ``out (batch, seqlen, nheads, headdim_v)``, and with
    ``return_softmax_lse`` ``(out, softmax_lse (batch, nheads, seqlen))``. The semantics are
    the module's (:mod:`mha.integrations.flash_kvcache`).

    >>> import numpy as np
    >>> from mha.flash_compat import flash_attn_with_kvcache
    >>> rng = np.random.default_rng(0)
    >>> k_cache, v_cache = rng.standard_normal((2, 2, 16, 2, 8))   # room for 16 tokens
    >>> q, k, v = rng.standard_normal((3, 2, 1, 2, 8))             # one new token each
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=[5, 9],
    ...                               causal=True)
    >>> bool((k_cache[1, 9] == k[1, 0]).all())                       # written in place
    True
    """
    q = as_float_array("q", q)
    if q.ndim != 4:
        raise ShapeError(f"q must have shape (batch, seqlen, nheads, headdim); got shape {q.shape}")
    paged = block_table is not None
    layout = "(num_blocks, block_size, nheads_k, headdim)" if paged else (
        "(batch_cache, seqlen_cache, nheads_k, headdim)"
    )  # fmt: skip
    caches = [as_float_array(name, x) for name, x in (("k_cache", k_cache), ("v_cache", v_cache))]
    for name, x in zip(("k_cache", "v_cache"), caches, strict=True):
        if x.ndim != 4:
            raise ShapeError(f"{name} must have shape {layout}; got shape {x.shape}")
    if caches[0].shape[:3] != caches[1].shape[:3]:
        raise ShapeError(
            f"k_cache and v_cache must hold the same tokens and heads: k_cache "
            f"{caches[0].shape}, v_cache {caches[1].shape}"
        )
    batch, seqlen_q = q.shape[:2]
    non_negative_int("num_splits", num_splits)
    table = None if not paged else block_table_of(block_table)
    rows = _rows(
        "cache_batch_idx", cache_batch_idx, batch, len(caches[0] if table is None else table)
    )
    capacity = caches[0].shape[1] * (table.shape[1] if table is not None else 1)
    options = flash_options(
        0.0, causal, window_size, softcap, alibi_slopes, q, False, capacity, batch
    )
    new = _new_tokens(k, v, q, caches, rows)
    if new is not None and (caches[0] is not k_cache or caches[1] is not v_cache):
        raise AttentionTypeError(
            "k_cache and v_cache must be NumPy float arrays when k and v are given: the new "
            "tokens are written into them, in place (FlashAttention's append)"
        )
    count = 0 if new is None else new[0].shape[1]
    held = _lengths("cache_seqlens", cache_seqlens, batch, capacity, new is not None)
    if (held + count > capacity).any():
        b = int(np.argmax(held + count > capacity))
        raise ShapeError(
            f"sequence {b} holds {held[b]} tokens and gets {count} new ones: more than the "
            f"cache's room of {capacity} a sequence (k_cache {caches[0].shape})"
        )
    first = _leftpad(cache_leftpad, batch, held)
    if (rotary_cos is None) != (rotary_sin is None):
        raise AttentionValueError("rotary_cos and rotary_sin come together: give both, or neither")
    local = options["left"] is not None or options["right"] is not None
    heads_q = q.transpose(0, 2, 1, 3)  # (batch, nheads, seqlen, headdim)
    new_heads = None if new is None else [x.transpose(0, 2, 1, 3) for x in new]
    if rotary_cos is not None:
        if new_heads is None:
            raise AttentionValueError(
                "rotary_cos and rotary_sin rotate the new k and the queries: give k and v too"
            )
        tables = {"cos": rotary_cos, "sin": rotary_sin, "interleaved": rotary_interleaved}
        flag("rotary_interleaved", rotary_interleaved)
        steps = np.arange(seqlen_q) if local else np.zeros(seqlen_q, np.int64)
        heads_q = apply_rotary(heads_q, held[:, None] + steps, **tables)
        new_heads[0] = apply_rotary(new_heads[0], held[:, None] + np.arange(count), **tables)
    ends = held + count
    width = int((ends - first).max(initial=0))
    if new_heads is not None:  # the cache's dtype, as written: what the queries then read
        new_heads = [
            x.astype(pool.dtype, copy=False) for x, pool in zip(new_heads, caches, strict=True)
        ]
    new_k, new_v = (None, None) if new_heads is None else new_heads
    slots = None if new is None else _write_slots(table, rows, held, count, caches[0].shape[:2])
    keys = sequences(caches[0], table, rows, first, held, width, new_k)
    values = sequences(caches[1], table, rows, first, held, width, new_v)
    lengths = (np.full(batch, seqlen_q, np.int64), ends - first)
    results = attend_heads(
        heads_q, keys, values, lengths, softmax_scale, options, False,
        lse_only=flag("return_softmax_lse", return_softmax_lse),
    )  # fmt: skip
    if new_heads is not None and slots is not None:  # FlashAttention's append, once the
        for pool, heads in zip(caches, new_heads, strict=True):  # call has succeeded
            pool[slots] = heads.transpose(0, 2, 1, 3).reshape(-1, *pool.shape[2:])
    out = results[0].transpose(0, 2, 1, 3)
    return out if len(results) == 1 else (out, results[1])


def _rows(name: str, given: Any, batch: int, available: int) -> np.ndarray:
    """Each sequence's row of the cache (or of the block table): ``cache_batch_idx``, or
    ``0..batch-1``."""
    if given is None:
        if available < batch:
            raise ShapeError(
                f"the cache has rows for {available} sequences and q has {batch}: give "
                "cache_batch_idx, or a cache of one row per sequence"
            )
        return np.arange(batch)
    rows = as_array(name, given)
    if rows.shape != (batch,) or rows.dtype.kind not in "iu":
        raise ShapeError(
            f"{name} must be {batch} integers (one per sequence); got {rows.dtype} {rows.shape}"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= available):
        raise AttentionValueError(
            f"{name} must name rows in [0, {available}) of the cache; got {rows.tolist()}"
        )
    return rows.astype(np.int64)


def _new_tokens(
    k: Any, v: Any, q: np.ndarray, caches: list[np.ndarray], rows: np.ndarray
) -> list[np.ndarray] | None:
    """The new keys and values ``(batch, seqlen_new, nheads_k, d)``, checked against the
    caches they are written into; ``None`` when there are none."""
    if k is None and v is None:
        return None
    if k is None or v is None:
        raise AttentionValueError("k and v come together: give both new arrays, or neither")
    new = [as_float_array(name, x) for name, x in (("k", k), ("v", v))]
    for name, x, pool in zip("kv", new, caches, strict=True):
        if x.ndim != 4 or x.shape[0] != q.shape[0] or x.shape[2:] != pool.shape[2:]:
            raise ShapeError(
                f"{name} must have shape (batch, seqlen_new, nheads_k, headdim) = ({q.shape[0]}, "
                f"seqlen_new, {pool.shape[2]}, {pool.shape[3]}) to go into {name}_cache "
                f"{pool.shape}; got {x.shape}"
            )
    if new[0].shape[1] != new[1].shape[1]:
        raise ShapeError(
            f"k and v must have the same new tokens: k {new[0].shape}, v {new[1].shape}"
        )
    for name, pool in zip(("k_cache", "v_cache"), caches, strict=True):
        if not pool.flags.writeable:
            raise AttentionValueError(
                f"{name} is read-only, and k and v are written into it (FlashAttention's "
                "append, in place): pass a writable array"
            )
    if len(np.unique(rows)) != len(rows):
        raise AttentionValueError(
            f"cache_batch_idx names a row twice ({rows.tolist()}), and k and v would be "
            "written into it twice: give each sequence its own row"
        )
    return new


def _lengths(name: str, given: Any, batch: int, capacity: int, appending: bool) -> np.ndarray:
    """``cache_seqlens`` as ``(batch,)`` int64: an int for all, or one per sequence;
    without it, every sequence holds the whole cache (refused with new tokens)."""
    if given is None:
        if appending:
            raise AttentionValueError(
                "cache_seqlens is needed with k and v: it says where the new tokens go"
            )
        return np.full(batch, capacity, np.int64)
    lengths = as_array(name, given)
    if lengths.dtype.kind not in "iu":
        raise AttentionTypeError(f"{name} must hold integers; got dtype {lengths.dtype}")
    if lengths.ndim == 0:
        lengths = np.full(batch, int(lengths), np.int64)
    if lengths.shape != (batch,):
        raise ShapeError(f"{name} must be an int or {batch} integers; got shape {lengths.shape}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > capacity):
        raise AttentionValueError(
            f"{name} must lie in [0, {capacity}], the cache's room a sequence; got "
            f"{lengths.tolist()}"
        )
    return lengths.astype(np.int64)


def _leftpad(given: Any, batch: int, held: np.ndarray) -> np.ndarray:
    if given is None:
        return np.zeros(batch, np.int64)
    first = as_array("cache_leftpad", given)
    if first.shape != (batch,) or first.dtype.kind not in "iu":
        raise ShapeError(
            f"cache_leftpad must be {batch} integers (one per sequence); got {first.dtype} "
            f"{first.shape}"
        )
    if first.size and (first.min() < 0 or (first > held).any()):
        raise AttentionValueError(
            f"cache_leftpad must lie in [0, cache_seqlens[b]]; got {first.tolist()} with "
            f"cache_seqlens {held.tolist()}"
        )
    return first.astype(np.int64)


def _write_slots(
    table: np.ndarray | None,
    rows: np.ndarray,
    held: np.ndarray,
    count: int,
    pool_shape: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """Where the new tokens go, every sequence's ``count`` in order: the pool's ``(rows,
    slots)`` index arrays, checked before anything is written."""
    places = [
        slots(table, int(rows[b]), pool_shape[1], int(held[b]), int(held[b]) + count, pool_shape[0])
        for b in range(len(rows))
    ]
    if not places:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate([p[0] for p in places]), np.concatenate([p[1] for p in places])
