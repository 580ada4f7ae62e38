"""``paged_attention``: attention over keys and values in a pool of fixed-size blocks, in the
layout serving engines keep them (vLLM's FlashAttention backend, ``flash_attn_with_kvcache``),
so that an engine's state can be checked against mha directly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .._arrays import (
    as_array,
    as_float_array,
    cast_result,
    flag,
    non_negative_int,
    resolve_scale,
    result_and_compute_dtypes,
)
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import CachedPositions, MaskArrays, MaskRules, ScoreShape, Visibility
from .._kernel.forward import attend
from .._kernel.paged import PagedKV
from .._kernel.team import Team, workers_for
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .checks import kv_heads
from .spec import AttentionSpec, Request, ScoreRules
from .split_heads import merge_attention

__all__ = ["cascade_attention", "check_cu_seqlens", "padded_rows", "paged_attention"]


def paged_attention(
    q: Any,
    key_cache: Any,
    value_cache: Any,
    block_table: Any,
    seq_lens: Any,
    *,
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    alibi: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    cu_seqlens_q: Any = None,
    return_lse: bool = False,
    max_memory: int | None = None,
    workers: int | None = None,
    lse_base: float | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Attention of each sequence's new queries over its cached keys and values, which lie
    in blocks of a pool, as ``flash_attn_with_kvcache(q, k_cache, v_cache,
    cache_seqlens=seq_lens, block_table=block_table, causal=causal)`` computes it.

    * ``q (num_seqs, L, H, d_k)``: each sequence's ``L`` newest tokens' queries (the
      FlashAttention layout: heads after positions).
    * ``key_cache (num_blocks, block_size, H_kv, d_k)``, ``value_cache (num_blocks,
      block_size, H_kv, d_v)``: the pools (vLLM's FlashAttention layout); ``H_kv`` divides
      ``H`` (query head ``h`` reads key/value head ``h // (H // H_kv)``). float64,
      float32, float16 or bfloat16: the narrow ones are read in float32, tile by tile.
    * ``block_table (num_seqs, max_blocks)``: integers; sequence ``b``'s position ``j``
      lies in block ``block_table[b, j // block_size]``, row ``j % block_size``. Entries
      past a sequence's last block are never read (any value); the others must name a
      block of the pool. Blocks may be shared by several sequences and lie in any order.
    * ``seq_lens (num_seqs,)``: each sequence's cached tokens, the new ones included
      (``cache_seqlens``); its queries are its last ``L`` positions.
    * ``causal``: query ``i`` sees key ``j`` only if ``j <= i + seq_lens[b] - L``
      (bottom-right, as FlashAttention aligns it); ``window``: and only if ``i +
      seq_lens[b] - L - j < window`` (with ``causal``, FlashAttention's
      ``window_size=(window - 1, 0)``; without, keys after a query stay visible), or
      ``window=(left, right)``, FlashAttention's ``window_size`` itself.
    * ``scale`` (default ``1/sqrt(d_k)``), ``softcap`` (Gemma 2's ``softcap *
      tanh(s / softcap)``), ``sinks (H,)`` (gpt-oss's per-head logits), ``alibi`` (``True``,
      slopes ``(H,)`` or each sequence's ``(num_seqs, H)``: ``-slope * (i + seq_lens[b] - L -
      j)``; ``mha.symmetric_alibi(slopes)``: of the distance's size), ``mask_mod`` and
      ``score_mod`` (FlexAttention's functions, their ``q_idx`` and ``kv_idx`` the tokens'
      positions in their sequence), as in :func:`mha.scaled_dot_product_attention`.
    * ``cu_seqlens_q (num_seqs + 1,)``: each sequence's own number of new queries, packed
      one sequence after another as vLLM and FlashAttention's varlen calls keep them: ``q
      (total_q, H, d_k)``, sequence ``b``'s rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``,
      its last ``L_b`` positions. The output is packed the same way, ``(total_q, H,
      d_v)``, and the log-sum-exp ``(H, total_q)`` (FlashAttention's varlen layout).
    * ``return_lse``: also return each row's log-sum-exp ``(num_seqs, H, L)``, as
      FlashAttention's ``softmax_lse``; in base 2 with ``lse_base=2`` (FlashInfer's).
    * ``max_memory``, ``workers``: the kernel's scratch per worker and its threads, as in
      :func:`mha.scaled_dot_product_attention`.

    Returns ``out (num_seqs, L, H, d_v)`` in the inputs' dtype (mha's rule: float32 is
    computed in float32, float16 and bfloat16 in float32 and returned in their own),
    computed from the blocks where they lie: each key tile is gathered from the blocks it
    spans as the kernel reaches it, never the whole sequence. A row that sees no key
    (``seq_lens[b] = 0``, or a causal row before the first key) is zero, with ``lse =
    -inf``.

    >>> import numpy as np, mha
    >>> rng = np.random.default_rng(0)
    >>> pool_k, pool_v = rng.standard_normal((2, 8, 4, 2, 16))   # 8 blocks of 4 tokens
    >>> table = np.array([[5, 2, 7], [1, 0, 0]])                 # two sequences' blocks
    >>> q = rng.standard_normal((2, 1, 4, 16))                   # one new token, 4 heads
    >>> out = mha.paged_attention(q, pool_k, pool_v, table, seq_lens=[10, 3])
    >>> k = pool_k[[5, 2, 7]].reshape(12, 2, 16)[:10]            # sequence 0's keys, gathered
    >>> v = pool_v[[5, 2, 7]].reshape(12, 2, 16)[:10]
    >>> dense = mha.scaled_dot_product_attention(
    ...     q[:1].transpose(0, 2, 1, 3), k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None])
    >>> bool(np.allclose(out[:1], dense.transpose(0, 2, 1, 3), rtol=1e-13, atol=0))
    True
    """
    rules = MaskRules.check(None, causal, None, window, None, None, mask_mod)
    spec = AttentionSpec(rules, ScoreRules(sinks, softcap, alibi, score_mod), scale)
    request = Request.check(False, return_lse, False, max_memory, workers, lse_base)
    pools, tables = (key_cache, value_cache), (block_table, seq_lens)
    if cu_seqlens_q is None:
        result = _paged(q, pools, tables, spec, request)
    else:
        result = _packed(q, cu_seqlens_q, pools, tables, spec, request)
    if request.lse_base2:
        out, lse = result
        return out, request.returned_lse(lse)
    return result


def _packed(
    q: Any,
    cu_seqlens_q: Any,
    pools: tuple[Any, Any],
    tables: tuple[Any, Any],
    spec: AttentionSpec,
    request: Request,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """:func:`paged_attention` of packed queries ``q (total_q, H, d_k)``, sequence ``b``'s
    at ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``: padded to ``(num_seqs, max L_b, H, d_k)``,
    each sequence's real rows first and aligned on its own count, then packed back."""
    q = as_float_array("q", q)
    if q.ndim != 3:
        raise ShapeError(
            f"q must have shape (total_q, H, d_k) with cu_seqlens_q; got shape {q.shape}"
        )
    starts = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, len(q))
    padded, counts, rows = padded_rows(q, starts)
    result = _paged(padded, pools, tables, spec, request, counts)
    if not request.lse:
        packed: np.ndarray = np.asarray(result)[rows]
        return packed
    out, lse = result
    return out[rows], np.ascontiguousarray(lse.transpose(1, 0, 2)[:, rows])


def _paged(
    q: Any,
    pools: tuple[Any, Any],
    tables: tuple[Any, Any],
    spec: AttentionSpec,
    request: Request,
    counts: np.ndarray | None = None,
    positions: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """:func:`paged_attention` of ``q`` over the ``pools`` (keys, values) through the
    ``tables`` (block table, lengths), for its checked spec and request; ``counts``: each
    sequence's real query rows (the first ``counts[b]``, its last positions), all ``L``
    without; ``positions``: each sequence's ``(first query's position, first key's
    position)`` when they are not its last rows and 0 (a cascade's parts), the causal mask
    then comparing positions."""
    q, key_cache, value_cache, shapes = _operands(q, *pools)
    B, L, H, d_k = q.shape
    num_blocks, block_size = key_cache.shape[:2]
    source = "q's first axis" if counts is None else "the sequences of cu_seqlens_q"
    table, lengths = _table_and_lengths(*tables, B, num_blocks, block_size, source)
    result_dtype, compute_dtype = result_and_compute_dtypes(q, key_cache, value_cache)
    scale = resolve_scale(spec.scale, d_k, compute_dtype)
    scores = spec.scores.fit(H, want_backward=False, batch_shape=(B,))
    S = max(int(lengths.max(initial=0)), 1)
    first = lengths - (L if counts is None else counts)  # each sequence's first new position
    cached = CachedPositions(first, first, np.zeros(B, np.int64))
    if positions is not None:  # the band's offsets in slots: positions less the first key's
        cached = CachedPositions(positions[0] - positions[1], positions[0], positions[1])
    shape = ScoreShape((B,), H, L, S)
    given = MaskArrays(key_lengths=lengths, query_lengths=counts)
    visibility = Visibility.build(spec.mask, given, shape, compute_dtype, shapes, cached)
    queries = q.transpose(0, 2, 1, 3)  # (B, H, L, d_k): a view
    outputs = Outputs(np.zeros((B, H, L, value_cache.shape[-1]), compute_dtype))
    if request.lse:
        outputs.lse = np.full((B, H, L), -np.inf, compute_dtype)
    cost = float(B * H * L) * S * (d_k + value_cache.shape[-1])
    with (
        np.errstate(invalid="ignore", over="ignore"),
        Team(workers_for(cost, request.threads)) as team,
    ):
        keys, values = PagedKV(key_cache, table, S), PagedKV(value_cache, table, S)
        call = KernelCall(queries, keys, values, visibility, scale, scores, budget=request.budget)
        attend(call, outputs, team)
    result = cast_result(outputs.out.transpose(0, 2, 1, 3), result_dtype)
    if request.lse:
        assert outputs.lse is not None
        return result, outputs.lse
    return result


def _operands(
    q: Any, key_cache: Any, value_cache: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """The queries and the two pools as float arrays of fitting shapes, and their shapes
    as messages quote them."""
    q = as_float_array("q", q)
    key_cache, value_cache = _pool("key_cache", key_cache), _pool("value_cache", value_cache)
    for name, array in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if array.ndim != 4:
            layout = "(num_seqs, L, H, d_k)" if name == "q" else "(num_blocks, block_size, H_kv, d)"
            raise ShapeError(f"{name} must have shape {layout}; got shape {array.shape}")
    shapes = f"q {q.shape}, key_cache {key_cache.shape}, value_cache {value_cache.shape}"
    if key_cache.shape[:3] != value_cache.shape[:3]:
        raise ShapeError(
            f"key_cache and value_cache must share (num_blocks, block_size, H_kv) ({shapes})"
        )
    if q.shape[-1] != key_cache.shape[-1]:
        raise ShapeError(f"q and key_cache must have the same head width d_k ({shapes})")
    H, H_kv = q.shape[2], key_cache.shape[2]
    if H_kv == 0 or H % H_kv:
        kv_heads(H, H_kv, shapes)
    return q, key_cache, value_cache, shapes


def _pool(name: str, pool: Any) -> np.ndarray:
    """A pool of keys or values, which must hold floats: integers in a pool are a quantized
    cache's codes (``PagedKVCache(quantize=...).key_cache``), never keys."""
    array = as_array(name, pool)
    if array.dtype.kind in "iu":
        raise AttentionTypeError(
            f"{name} holds integers ({array.dtype}, shape {array.shape}); paged_attention "
            "reads float pools. A quantized PagedKVCache's pools are its codes, not its keys "
            "and values: pass the cache itself as cache= to scaled_dot_product_attention, "
            "or read a sequence back with cache.dequantized(seq_id)"
        )
    return as_float_array(name, array)


def _table_and_lengths(
    block_table: Any,
    seq_lens: Any,
    B: int,
    num_blocks: int,
    block_size: int,
    source: str = "q's first axis",
) -> tuple[np.ndarray, np.ndarray]:
    """The block table and the lengths as int64 arrays, checked: every block a sequence
    reads names a block of the pool (``source``: where the ``B`` sequences were counted)."""
    table = as_array("block_table", block_table)
    lengths = as_array("seq_lens", seq_lens)
    for name, array, shape, ndim in (
        ("block_table", table, "(num_seqs, max_blocks)", 2),
        ("seq_lens", lengths, "(num_seqs,)", 1),
    ):
        if array.dtype.kind not in "iu" and array.size:  # an empty list reads as float
            raise AttentionTypeError(f"{name} must hold integers; got dtype {array.dtype}")
        if array.ndim != ndim or array.shape[0] != B:
            raise ShapeError(
                f"{name} must have shape {shape} with num_seqs = {B} ({source}); got "
                f"shape {array.shape}"
            )
    table, lengths = table.astype(np.int64), lengths.astype(np.int64)
    most = table.shape[1] * block_size
    if lengths.size and (lengths.min() < 0 or lengths.max() > most):
        raise AttentionValueError(
            f"seq_lens must lie in [0, {most}] (max_blocks {table.shape[1]} x block_size "
            f"{block_size}); got {lengths.tolist()}"
        )
    used = np.arange(table.shape[1]) < -(-lengths[:, None] // block_size)  # blocks read
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise AttentionValueError(
            f"block_table[{b}, {j}] = {int(table[b, j])} is not a block of the pool (0 to "
            f"{num_blocks - 1}); sequence {b} reads it (seq_lens[{b}] = {int(lengths[b])})"
        )
    return table, lengths


def cascade_attention(
    q: Any,
    key_cache: Any,
    value_cache: Any,
    prefix_blocks: Any,
    prefix_len: int,
    block_table: Any,
    seq_lens: Any,
    *,
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    alibi: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    cu_seqlens_q: Any = None,
    return_lse: bool = False,
    max_memory: int | None = None,
    workers: int | None = None,
    lse_base: float | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """:func:`paged_attention` for sequences that share a prefix (a system prompt, the
    samples of one prompt), with the prefix's attention computed once for all of them.

    Every sequence holds the same first ``prefix_len`` positions, in the blocks
    ``prefix_blocks`` (in order), then its own: ``block_table`` and ``seq_lens`` describe
    each sequence's own positions alone (its length is ``prefix_len + seq_lens[b]``).
    ``q``, ``key_cache`` and ``value_cache`` are as :func:`paged_attention` takes them. The
    queries of every sequence attend to the prefix in one call (the prefix's keys and
    values read once, for all their rows, rather than once per sequence), each sequence's
    queries to its own keys, and the two are merged by their log-sum-exps (cascade
    attention, FlashInfer's name): equal to :func:`paged_attention` over the whole
    sequences up to rounding. ``causal`` hides a sequence's own later keys as there (the
    new queries come after the prefix, which they all see: ``seq_lens >= L``).

    ``window``, ``softcap``, ``sinks``, ``alibi``, ``mask_mod``, ``score_mod`` and
    ``cu_seqlens_q`` (a different number of queries per sequence, packed) are
    :func:`paged_attention`'s, at the tokens' positions in the whole sequence (the prefix's
    ``0..prefix_len-1``, then each sequence's own); the sinks are added once, where the two
    parts merge. With a window, ALiBi, a ``mask_mod`` or a ``score_mod`` each query's
    prefix part depends on its position, and the prefix is read once per sequence (still
    one call); ``scale``, ``return_lse`` (``(num_seqs, H, L)``, or ``(H, total_q)``
    packed), ``lse_base``, ``max_memory`` and ``workers`` are :func:`paged_attention`'s.

    >>> import numpy as np, mha
    >>> rng = np.random.default_rng(0)
    >>> pool_k, pool_v = rng.standard_normal((2, 8, 4, 1, 16))
    >>> q = rng.standard_normal((2, 1, 2, 16))
    >>> own = np.array([[3], [6]])                       # each sequence's own block
    >>> out = mha.cascade_attention(q, pool_k, pool_v, [0, 5], 8, own, seq_lens=[2, 4])
    >>> whole = mha.paged_attention(q, pool_k, pool_v, [[0, 5, 3], [0, 5, 6]], [10, 12])
    >>> bool(np.allclose(out, whole, rtol=1e-13, atol=0))
    True
    """
    q = as_float_array("q", q)
    packed = cu_seqlens_q is not None
    if q.ndim != (3 if packed else 4):
        layout = "(total_q, H, d_k) with cu_seqlens_q" if packed else "(num_seqs, L, H, d_k)"
        raise ShapeError(f"q must have shape {layout}; got shape {q.shape}")
    pool = _pool("key_cache", key_cache)
    if pool.ndim != 4:
        raise ShapeError(
            f"key_cache must have shape (num_blocks, block_size, H_kv, d); got shape {pool.shape}"
        )
    prefix = _prefix(prefix_blocks, prefix_len, *pool.shape[:2])
    n = int(prefix_len)
    asked = Request.check(False, return_lse, False, max_memory, workers, lse_base)
    if packed:
        starts = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, len(q))
        queries, counts, rows = padded_rows(q, starts)
    else:
        queries, counts, rows = q, np.full(q.shape[0], q.shape[1], np.int64), None
    B, L, H, d_k = queries.shape
    own = as_array("seq_lens", seq_lens)
    if own.dtype.kind not in "iu" and own.size:
        raise AttentionTypeError(f"seq_lens must hold integers; got dtype {own.dtype}")
    if own.shape != (B,):
        raise ShapeError(f"seq_lens must have shape (num_seqs,) = ({B},); got shape {own.shape}")
    if flag("causal", causal) and (own < counts).any():
        raise AttentionValueError(
            f"causal cascade_attention needs each sequence's own positions to hold its new "
            f"queries (seq_lens >= L, its number of queries: {counts.tolist()}), since every "
            f"query sees the whole prefix; got seq_lens {own.tolist()}: use paged_attention "
            "over the whole sequences"
        )
    pools = (key_cache, value_cache)
    request = Request.check(False, True, False, max_memory, workers)
    rules = MaskRules.check(None, causal, None, window, None, None, mask_mod)
    scores = ScoreRules(None, softcap, alibi, score_mod)
    spec = AttentionSpec(rules, scores, scale)
    with_sinks = ScoreRules(sinks).fit(H, want_backward=False) if sinks is not None else None
    sink_logits = None if with_sinks is None else with_sinks.sinks
    heads_first = (0, 2, 1, 3)  # (B, H, L, d), as merge_attention takes them
    starts = n + own - counts  # each sequence's first query's position
    if window is None and alibi is None and mask_mod is None and score_mod is None:
        # the prefix's part is the same function of every query: one call of all the rows
        shared_spec = replace(spec, mask=MaskRules.check(None, False, None, None, None, None, None))
        everything = queries[rows] if packed else queries.reshape(B * L, H, d_k)
        shared, shared_lse = _paged(everything[None], pools, (prefix[None], [n]), shared_spec,
                                    request)  # fmt: skip
        d_v = shared.shape[-1]  # (named: a reshape cannot infer it when there are no rows)
        shared_out = np.zeros((B, L, H, d_v), shared.dtype)
        shared_log = np.full((B, H, L), -np.inf, shared_lse.dtype)
        if packed:
            shared_out[rows], shared_log.transpose(0, 2, 1)[rows] = shared[0], shared_lse[0].T
        else:
            shared_out[:] = shared.reshape(B, L, H, d_v)
            shared_log[:] = shared_lse.reshape(H, B, L).transpose(1, 0, 2)
    else:  # at each sequence's own positions, the prefix in every row of the table
        table = np.broadcast_to(prefix, (B, prefix.size))
        at = (starts, np.zeros(B, np.int64))
        shared_out, shared_log = _paged(queries, pools, (table, np.full(B, n)), spec, request,
                                        counts, at)  # fmt: skip
    at = (starts, np.full(B, n, np.int64))  # the own keys sit after the prefix
    own_out, own_lse = _paged(queries, pools, (block_table, own), spec, request, counts, at)
    out, lse = merge_attention(
        [shared_out.transpose(heads_first), own_out.transpose(heads_first)],
        [shared_log, own_lse],
        sinks=sink_logits,  # added once, to the merged softmax
    )
    result = out.transpose(heads_first)
    if packed:
        result, lse = result[rows], np.ascontiguousarray(lse.transpose(1, 0, 2)[:, rows])
    return (result, asked.returned_lse(lse)) if asked.lse else result


def check_cu_seqlens(name: str, given: Any, total: int | None) -> np.ndarray:
    """Cumulative sequence lengths ``(num_seqs + 1,)`` (vLLM's and FlashAttention's
    ``cu_seqlens``), checked: integers from 0, never decreasing, ending at ``total`` (the
    packed rows; ``None``: any end)."""
    starts = as_array(name, given)
    if starts.ndim != 1 or not starts.size:
        raise ShapeError(f"{name} must have shape (num_seqs + 1,); got shape {starts.shape}")
    if starts.dtype.kind not in "iu":
        raise AttentionTypeError(f"{name} must hold integers; got dtype {starts.dtype}")
    starts = starts.astype(np.int64)
    if starts[0] != 0 or (np.diff(starts) < 0).any():
        raise AttentionValueError(
            f"{name} must start at 0 and never decrease; got {starts.tolist()}"
        )
    if total is not None and starts[-1] != total:
        raise ShapeError(
            f"{name} must end at the packed rows' count {total}; got {starts.tolist()}"
        )
    return starts


def padded_rows(
    x: np.ndarray, starts: np.ndarray, width: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed ``x (total, ...)``, sequence ``b``'s rows at ``starts[b]:starts[b + 1]``
    (:func:`check_cu_seqlens`), as ``(num_seqs, width, ...)`` (``width``: the longest by
    default), each sequence's rows first and zeros after; with each sequence's count and
    where its real rows are (``(num_seqs, width)`` booleans, in packed order)."""
    counts = np.diff(starts)
    width = int(counts.max(initial=0)) if width is None else width
    padded = np.zeros((len(counts), width, *x.shape[1:]), x.dtype)
    rows = np.arange(width) < counts[:, None]
    padded[rows] = x[starts[0] : starts[-1]]
    return padded, counts, rows


def _prefix(blocks: Any, length: Any, num_blocks: int, block_size: int) -> np.ndarray:
    """``prefix_blocks`` as int64, checked with ``prefix_len`` under their own names: a
    length the blocks hold, and blocks of the pool where the prefix lies."""
    prefix = as_array("prefix_blocks", blocks)
    if prefix.ndim != 1:
        raise ShapeError(f"prefix_blocks must be one row of block ids; got shape {prefix.shape}")
    if prefix.dtype.kind not in "iu" and prefix.size:  # an empty list reads as float
        raise AttentionTypeError(f"prefix_blocks must hold integers; got dtype {prefix.dtype}")
    prefix = prefix.astype(np.int64)
    n = non_negative_int("prefix_len", length)
    most = prefix.size * block_size
    if n > most:
        raise AttentionValueError(
            f"prefix_len={n} but prefix_blocks holds {prefix.size} blocks of block_size "
            f"{block_size}, {most} positions at most"
        )
    used = prefix[: -(-n // block_size)]
    bad = np.flatnonzero((used < 0) | (used >= num_blocks))
    if bad.size:
        j = int(bad[0])
        raise AttentionValueError(
            f"prefix_blocks[{j}] = {int(used[j])} is not a block of the pool (0 to "
            f"{num_blocks - 1}); the prefix of prefix_len={n} reads it"
        )
    return prefix
