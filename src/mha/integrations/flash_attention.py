"""FlashAttention's Python interface on NumPy arrays (:mod:`mha.flash_compat`):
``flash_attn_func`` and ``flash_attn_varlen_func``, their parameters, order, defaults and
semantics, computed by :func:`mha.scaled_dot_product_attention`, so that an engine author
can diff a kernel's output against mha's by changing one import.

The semantics, as FlashAttention 2 defines them (its ``flash_attn_interface`` docstrings and
the reference its tests compare against):

* Layout ``(batch, seqlen, nheads, headdim)`` (``(total, nheads, headdim)`` packed for the
  varlen function); ``nheads_k`` divides ``nheads`` (grouped-query attention).
* ``causal``: bottom-right aligned, each sequence on its own lengths: query ``i`` of a
  sequence of ``sq`` queries and ``sk`` keys sees key ``j <= i + sk - sq``.
* ``window_size=(left, right)``: query ``i`` sees key ``j`` only if ``i + sk - sq - left <=
  j <= i + sk - sq + right``; ``-1`` leaves that side unbounded. ``causal`` sets ``right``
  to 0.
* ``softcap > 0``: each scaled score becomes ``softcap * tanh(s / softcap)``.
* ``alibi_slopes (nheads,)`` or ``(batch, nheads)``: ``-slope * |i + sk - sq - j|`` added
  to the (soft-capped) score; for a causal call without a left window FlashAttention adds
  ``slope * j`` instead (the same weights), and its log-sum-exp is returned so, larger by
  ``slope * (i + sk - sq)``.
* A window side of ``seqlen_k`` or more is unbounded, as FlashAttention reads it.
* A query that sees no key gets a zero output and a log-sum-exp of ``+inf``, as
  FlashAttention 2 writes it (:func:`mha.merge_attention` reads both ``+inf`` and ``-inf``
  so).

Where it differs, by necessity: ``dropout_p`` must be 0 (FlashAttention's random mask
cannot be reproduced; mha's own dropout is :func:`mha.scaled_dot_product_attention`'s
``dropout_p`` with a generator); ``deterministic`` changes nothing (mha is deterministic);
``return_attn_probs`` returns the attention probabilities themselves as the third value
(FlashAttention's ``S_dmask``, meant for its tests); the log-sum-exp is in the inputs'
compute dtype (float64 for float64 inputs; FlashAttention's is float32). Any float dtype is
taken, as everywhere in mha.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_array, as_float_array, flag, int_at_least, non_negative_int
from ..api.paged import check_cu_seqlens, padded_rows
from ..api.split_heads import scaled_dot_product_attention
from ..api.variants import symmetric_alibi
from ..errors import AttentionTypeError, AttentionValueError, ShapeError

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """FlashAttention's ``flash_attn_func``: ``q (batch, seqlen_q, nheads, headdim)``, ``k
    (batch, seqlen_k, nheads_k, headdim)``, ``v (batch, seqlen_k, nheads_k, headdim_v)``;
    returns ``out (batch, seqlen_q, nheads, headdim_v)``, and with ``return_attn_probs``
    ``(out, softmax_lse (batch, nheads, seqlen_q), probabilities (batch, nheads, seqlen_q,
    seqlen_k))``. The semantics are the module's (:mod:`mha.flash_compat`).

    >>> import numpy as np
    >>> from mha.flash_compat import flash_attn_func
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 5, 4, 8))
    >>> out = flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
    >>> out.shape
    (2, 5, 4, 8)
    """
    q, k, v = _operands(q, k, v, 4, "(batch, seqlen, nheads, headdim)")
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ShapeError(
            f"q, k and v must have the same batch: q {q.shape}, k {k.shape}, v {v.shape}"
        )
    lengths = (np.full(batch, seqlen_q, np.int64), np.full(batch, seqlen_k, np.int64))
    options = flash_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, q, deterministic, seqlen_k, batch
    )
    results = attend_heads(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        lengths, softmax_scale, options, flag("return_attn_probs", return_attn_probs),
    )  # fmt: skip
    out = results[0].transpose(0, 2, 1, 3)
    return out if len(results) == 1 else (out, *results[1:])


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
) -> Any:
    """FlashAttention's ``flash_attn_varlen_func``: sequences packed one after another,
    ``q (total_q, nheads, headdim)``, ``k (total_k, nheads_k, headdim)``, ``v (total_k,
    nheads_k, headdim_v)``, sequence ``b``'s queries at ``cu_seqlens_q[b]:cu_seqlens_q[b +
    1]`` and its keys at ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` (``(batch + 1,)``
    integers from 0); ``max_seqlen_q``, ``max_seqlen_k`` at least the longest. With
    ``block_table (batch, max_blocks)``, ``k`` and ``v`` are pools of blocks ``(num_blocks,
    block_size, nheads_k, headdim)`` and sequence ``b``'s key ``j`` lies in block
    ``block_table[b, j // block_size]`` (its length still ``cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]``). Returns ``out (total_q, nheads, headdim_v)``, and with
    ``return_attn_probs`` ``(out, softmax_lse (nheads, total_q), probabilities (batch,
    nheads, max_seqlen_q, max_seqlen_k))``, each sequence causal on its own lengths.

    >>> import numpy as np
    >>> from mha.flash_compat import flash_attn_varlen_func
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 7, 2, 8))   # sequences of 3 and 4 tokens
    >>> cu = np.array([0, 3, 7])
    >>> flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True).shape
    (7, 2, 8)
    """
    paged = block_table is not None
    layout = "(num_blocks, block_size, nheads_k, headdim)" if paged else "(total, nheads, headdim)"
    q = as_float_array("q", q)
    if q.ndim != 3:
        raise ShapeError(f"q must have shape (total_q, nheads, headdim); got shape {q.shape}")
    k, v = (as_float_array(name, x) for name, x in (("k", k), ("v", v)))
    for name, x in (("k", k), ("v", v)):
        if x.ndim != (4 if paged else 3):
            raise ShapeError(f"{name} must have shape {layout}; got shape {x.shape}")
    starts_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, len(q))
    starts_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None if paged else len(k))
    if len(starts_q) != len(starts_k):
        raise ShapeError(
            f"cu_seqlens_q and cu_seqlens_k must have one entry per sequence and one more: "
            f"got {len(starts_q)} and {len(starts_k)}"
        )
    lengths = (np.diff(starts_q), np.diff(starts_k))
    for name, given, found in (
        ("max_seqlen_q", max_seqlen_q, lengths[0]),
        ("max_seqlen_k", max_seqlen_k, lengths[1]),
    ):
        longest = int(found.max(initial=0))
        if non_negative_int(name, given) < longest:
            raise AttentionValueError(
                f"{name}={given} is less than the longest sequence's {longest} "
                f"({name[-1]} lengths {found.tolist()})"
            )
    batch = len(lengths[0])
    if k.shape[:-1] != v.shape[:-1]:
        raise ShapeError(f"k and v must hold the same tokens and heads: k {k.shape}, v {v.shape}")
    if paged:
        table = _paged_table(block_table, lengths[1], k.shape[1])
        everyone, start = np.arange(batch), np.zeros(batch, np.int64)
        keys, values = (
            sequences(pool, table, everyone, start, lengths[1], max_seqlen_k, None)
            for pool in (k, v)
        )
    else:
        keys, values = (
            padded_rows(x, starts_k, max_seqlen_k)[0].transpose(0, 2, 1, 3) for x in (k, v)
        )
    queries, _, rows = padded_rows(q, starts_q, max_seqlen_q)
    queries = queries.transpose(0, 2, 1, 3)  # (batch, nheads, max_seqlen_q, headdim)
    options = flash_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, q, deterministic,
        int(max_seqlen_k), batch,
    )  # fmt: skip
    results = attend_heads(
        queries, keys, values, lengths, softmax_scale, options,
        flag("return_attn_probs", return_attn_probs),
    )  # fmt: skip
    out = results[0].transpose(0, 2, 1, 3)[rows]  # (total_q, nheads, headdim_v), packed
    if len(results) == 1:
        return out
    lse = results[1].transpose(0, 2, 1)[rows].T  # (nheads, total_q)
    return out, np.ascontiguousarray(lse), results[2]


def _paged_table(block_table: Any, lengths: np.ndarray, block_size: int) -> np.ndarray:
    """A varlen call's ``block_table``, checked against its sequences' key lengths."""
    table = block_table_of(block_table)
    if len(table) != len(lengths):
        raise ShapeError(
            f"block_table must have one row per sequence ({len(lengths)}); got {table.shape}"
        )
    for b, length in enumerate(lengths):
        used = -(-int(length) // block_size)
        if used > table.shape[1]:
            raise ShapeError(
                f"sequence {b}'s {length} keys need {used} blocks of {block_size}; block_table "
                f"has {table.shape[1]} per sequence"
            )
    return table


def _operands(q: Any, k: Any, v: Any, ndim: int, layout: str) -> tuple[np.ndarray, ...]:
    arrays = tuple(as_float_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    for name, x in zip("qkv", arrays, strict=True):
        if x.ndim != ndim:
            raise ShapeError(f"{name} must have shape {layout}; got shape {x.shape}")
    return arrays


def block_table_of(block_table: Any) -> np.ndarray:
    """``block_table`` as int64 ``(batch, max_blocks)``, checked."""
    table = as_array("block_table", block_table)
    if table.ndim != 2 or table.dtype.kind not in "iu":
        raise ShapeError(
            f"block_table must be integers of shape (batch, max_blocks); got {table.dtype} "
            f"{table.shape}"
        )
    return table.astype(np.int64)


def slots(
    table: np.ndarray | None, row: int, block_size: int, start: int, stop: int, blocks: int
) -> tuple[Any, Any]:
    """Where positions ``start..stop-1`` of the sequence of cache row ``row`` lie: the
    pool's ``(rows, slots)`` index arrays."""
    positions = np.arange(start, stop)
    if table is None:
        return np.full(len(positions), row), positions
    named = table[row, positions // block_size]
    if named.size and (named.min() < 0 or named.max() >= blocks):
        raise AttentionValueError(
            f"block_table[{row}] names blocks outside the pool of {blocks}: "
            f"{np.unique(named).tolist()}"
        )
    return named, positions % block_size


def sequences(
    pool: np.ndarray,
    table: np.ndarray | None,
    rows: np.ndarray,
    first: np.ndarray,
    held: np.ndarray,
    width: int,
    new: np.ndarray | None,
) -> np.ndarray:
    """Each sequence's keys (or values) from ``first[b]``, heads first ``(batch, H_kv,
    width, d)``: its cached ``first[b]..held[b]-1``, then ``new[b]`` (heads first)."""
    batch = len(rows)
    out = np.zeros((batch, pool.shape[2], width, pool.shape[3]), pool.dtype)
    for b in range(batch):
        index = slots(table, int(rows[b]), pool.shape[1], int(first[b]), int(held[b]), len(pool))
        cached = int(held[b] - first[b])
        out[b, :, :cached] = pool[index].transpose(1, 0, 2)
        if new is not None:
            out[b, :, cached : cached + new.shape[2]] = new[b]
    return out


def flash_options(
    dropout_p: Any,
    causal: Any,
    window_size: Any,
    softcap: Any,
    alibi_slopes: Any,
    q: np.ndarray,
    deterministic: Any,
    seqlen_k: int,
    batch: int,
) -> dict[str, Any]:
    """The checked FlashAttention options of queries ``q (..., nheads, headdim)`` of
    ``batch`` sequences over keys of at most ``seqlen_k``: the window's two sides (``None``
    unbounded; a side of ``seqlen_k`` or more is unbounded, and ``right`` 0 when causal, as
    FlashAttention sets them), ``softcap`` (``None`` off), the slopes ``(H,)`` or ``(batch,
    H)``, and whether FlashAttention computes this call as causal (``is_causal``: no left
    side, a right side of 0), which changes how its ALiBi shifts the log-sum-exp."""
    flag("deterministic", deterministic)
    if not isinstance(dropout_p, (int, float, np.floating, np.integer)) or dropout_p != 0:
        raise AttentionValueError(
            f"dropout_p must be 0 here; got {dropout_p!r}: FlashAttention's random dropout "
            "mask cannot be reproduced (mha's own dropout is scaled_dot_product_attention's "
            "dropout_p with a generator)"
        )
    causal = flag("causal", causal)
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__"):
        raise AttentionTypeError(
            f"window_size must be a pair of integers (left, right), -1 for unbounded; got "
            f"{window_size!r}"
        )
    if len(window_size) != 2:
        raise AttentionTypeError(
            f"window_size must be a pair of integers (left, right); got {window_size!r}"
        )
    left, right = (
        int_at_least(f"window_size's {side}", value, -1, "an integer >= -1 (-1: unbounded)")
        for side, value in zip(("left", "right"), window_size, strict=True)
    )
    left = -1 if left >= seqlen_k else left  # (FlashAttention's own reading)
    right = -1 if right >= seqlen_k else right
    if causal:
        right = 0  # (as FlashAttention sets it)
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(
        softcap, (int, float, np.integer, np.floating)
    ):
        raise AttentionTypeError(f"softcap must be a number >= 0 (0 turns it off); got {softcap!r}")
    cap = float(softcap)
    if cap < 0 or cap != cap:
        raise AttentionValueError(f"softcap must be >= 0 (0 turns it off); got {softcap!r}")
    H = q.shape[-2]
    slopes = None
    if alibi_slopes is not None:
        slopes = as_float_array("alibi_slopes", alibi_slopes).astype(np.float64)
        if not (slopes.shape == (H,) or slopes.shape == (batch, H)):
            raise ShapeError(
                f"alibi_slopes must have shape (nheads,) or (batch, nheads) = ({H},) or "
                f"({batch}, {H}); got {slopes.shape}"
            )
        if not np.isfinite(slopes).all():
            raise AttentionValueError(f"alibi_slopes must be finite; got {slopes!r}")
    return {
        "left": None if left < 0 else left,
        "right": None if right < 0 else right,
        "softcap": cap or None,
        "slopes": slopes,
        "is_causal": left < 0 and right == 0,
    }


def attend_heads(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    lengths: tuple[np.ndarray, np.ndarray],
    scale: Any,
    options: dict[str, Any],
    probabilities: bool,
    lse_only: bool = False,
) -> tuple[np.ndarray, ...]:
    """Heads-first ``q (B, H, Lq, d)``, ``k``, ``v`` (``(B, H_kv, Lk, d)``) of sequences of
    ``lengths`` (queries, keys), each aligned on its own lengths, with the checked
    :func:`flash_options`: ``(out,)``; with ``probabilities`` ``(out, lse, weights)``, with
    ``lse_only`` ``(out, lse)``; the lse ``+inf`` where a row sees no key."""
    query_lengths, key_lengths = lengths
    left, right, slopes = options["left"], options["right"], options["slopes"]
    keywords: dict[str, Any] = {
        "key_lengths": key_lengths,
        "query_lengths": query_lengths,
        "scale": scale,
        "softcap": options["softcap"],
    }
    if left is not None or right is not None:  # the window's sides (right 0: causal)
        keywords["window"] = (-1 if left is None else left, -1 if right is None else right)
    if left is not None or right is not None or slopes is not None:  # (ALiBi's positions too)
        keywords["causal_alignment"] = "bottom_right_per_sequence"
    if slopes is not None:  # FlashAttention's ALiBi: the distance on both sides
        keywords["alibi"] = symmetric_alibi(slopes)
    if not probabilities and not lse_only:
        return (scaled_dot_product_attention(q, k, v, **keywords),)
    if lse_only:
        out, lse = scaled_dot_product_attention(q, k, v, return_lse=True, **keywords)
        return out, _as_flash_lse(lse, lengths, options)
    out, weights, lse = scaled_dot_product_attention(
        q, k, v, return_weights=True, return_lse=True, **keywords
    )
    return out, _as_flash_lse(lse, lengths, options), weights


def _as_flash_lse(
    lse: np.ndarray, lengths: tuple[np.ndarray, np.ndarray], options: dict[str, Any]
) -> np.ndarray:
    """mha's log-sum-exp ``(B, H, L)`` as FlashAttention 2 returns it: ``+inf`` where a row
    sees no key, and, for a causal call with ALiBi, of the scores with ``slope_h * j`` added
    (its ALiBi there, the same weights as ``-slope_h * (i + sk - sq - j)``: larger by
    ``slope_h * (i + sk - sq)``)."""
    slopes = options["slopes"]
    if slopes is not None and options["is_causal"]:
        query_lengths, key_lengths = lengths
        positions = np.arange(lse.shape[-1]) + (key_lengths - query_lengths)[:, None]  # (B, L)
        per_sequence = np.broadcast_to(slopes, (len(positions), lse.shape[-2]))  # (B, H)
        lse = lse + per_sequence[:, :, None] * positions[:, None, :]
    return np.where(np.isneginf(lse), np.inf, lse)
