"""The split-head core: :func:`scaled_dot_product_attention` on heads already projected,
its cached call (a :class:`KVCache` appended to, then attended over), and
:func:`merge_attention` for results computed over disjoint key ranges.

Shapes are named as in the paper: ``H`` heads, ``L`` query positions, ``S`` key positions,
``d_k``/``d_v`` per-head widths; ``...`` is any batch axes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

import numpy as np

from .._arrays import (
    as_float_array,
    cast_result,
    resolve_scale,
    result_and_compute_dtypes,
)
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import ScoreShape, Visibility
from .._kernel.dropout import drawn
from .._kernel.forward import attend, merge_partials
from .._kernel.scores import add_sinks
from .._kernel.team import Team, workers_for
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .cache import KVCache
from .cached import attend_split_cached
from .checks import checked_heads, same
from .gradients import SplitHeadsBackward
from .paged_cache import PagedKVCache
from .plans import planned_attention
from .selection import select_keys
from .spec import Checked, SdpaKeywords, check_sdpa
from .variants import check_scores

if TYPE_CHECKING:
    from typing import Unpack

    from .signatures import Backward, Flag, MaskMod, ScoreMod, SdpaOptions

__all__ = ["attention", "merge_attention", "scaled_dot_product_attention"]


# One overload per combination of the return_* flags (the output first, then the weights,
# the log-sum-exp and backward, as asked for); the last one for flags known only at run time.
# fmt: off
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ..., return_backward: Literal[False] = ...,
    **options: Unpack[SdpaOptions],
) -> np.ndarray: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[True],
    return_lse: Literal[False] = ..., return_backward: Literal[False] = ...,
    **options: Unpack[SdpaOptions],
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[False] = ...,
    return_lse: Literal[True], return_backward: Literal[False] = ...,
    **options: Unpack[SdpaOptions],
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ..., return_backward: Literal[True],
    **options: Unpack[SdpaOptions],
) -> tuple[np.ndarray, Backward]: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[True], return_lse: Literal[True],
    return_backward: Literal[False] = ..., **options: Unpack[SdpaOptions],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[True],
    return_lse: Literal[False] = ..., return_backward: Literal[True],
    **options: Unpack[SdpaOptions],
) -> tuple[np.ndarray, np.ndarray, Backward]: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[False] = ...,
    return_lse: Literal[True], return_backward: Literal[True],
    **options: Unpack[SdpaOptions],
) -> tuple[np.ndarray, np.ndarray, Backward]: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Literal[True], return_lse: Literal[True],
    return_backward: Literal[True], **options: Unpack[SdpaOptions],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Backward]: ...
@overload
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, return_weights: Flag = ..., return_lse: Flag = ...,
    return_backward: Flag = ..., **options: Unpack[SdpaOptions],
) -> np.ndarray | tuple[Any, ...]: ...
# fmt: on


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: Flag | None = None,
    causal_alignment: str | None = None,
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    window: SupportsIndex | tuple[int, int] | None = None,
    sink_tokens: SupportsIndex | None = None,
    chunk: SupportsIndex | None = None,
    mask_mod: MaskMod | None = None,
    sinks: Any = None,
    softcap: float | None = None,
    alibi: Any = None,
    score_mod: ScoreMod | None = None,
    score_mod_grad: ScoreMod | None = None,
    query_temperature: tuple[float | str, ...] | None = None,
    scale: float | None = None,
    return_weights: Flag = False,
    return_lse: Flag = False,
    return_backward: Flag = False,
    dropout_p: float | None = None,
    generator: np.random.Generator | None = None,
    cache: KVCache | PagedKVCache | None = None,
    padding_side: str | None = None,
    max_memory: SupportsIndex | None = None,
    workers: SupportsIndex | None = None,
    lse_base: float | None = None,
) -> np.ndarray | tuple[Any, ...]:
    """Attention over already split heads: ``softmax(q k^T * scale + bias) v`` per head.

    Arguments (every mask argument combines with the others by AND; True = may attend):

    * ``q (..., H, L, d_k)``, ``k (..., H_kv, S, d_k)``, ``v (..., H_kv, S, d_v)``: queries,
      keys and values with the same batch axes. ``H_kv`` divides ``H``: with fewer key/value
      heads (grouped-query or multi-query attention) query head ``h`` uses key/value head
      ``h // (H // H_kv)``, without the keys ever being repeated. float64 in gives float64
      out; float32 is computed in float32; float16 in float32.
    * ``mask``: a boolean array, **True = may attend**, broadcastable to the scores
      ``(..., H, L, S)``; with batch axes, ``(B, L, S)`` applies to every head. ``mask=True``
      is the causal mask (as ``causal=True``). Integer or float arrays are refused: an
      additive mask of 0 and ``-inf`` goes in ``bias``.
    * ``causal``: hide key ``j`` from query ``i`` when ``j > i + (S - L)``: the last query
      sees every key ("bottom_right" alignment, what cached decoding needs).
    * ``causal_alignment``: ``"top_left"`` for ``j > i`` instead (PyTorch's ``is_causal``),
      or ``"bottom_right_per_sequence"`` for ``j > i + key_lengths[b] - query_lengths[b]``
      (each sequence's last real query sees its last real key, as FlashAttention aligns
      variable lengths); only with a causal mask or a window, which it aligns too.
    * ``key_lengths``: one integer per sequence (shape of the batch axes, or a single number
      without them): keys at index ``>= length`` are padding.
    * ``query_lengths``: likewise for query rows: padding rows see no key and get zeros.
    * ``bias``: an additive float array broadcastable like ``mask``, added to the scaled
      scores; ``-inf`` hides a key.
    * ``window``: a sliding window: query ``i`` sees key ``j`` only if
      ``(i + offset) - j < window``, ``offset`` being the causal alignment's (``S - L``, or
      0 for top-left). Tiles outside the band are skipped: time O(L·window), not O(L·S).
      A pair ``window=(left, right)`` bounds both sides, FlashAttention's ``window_size``:
      ``i + offset - left <= j <= i + offset + right``, ``-1`` leaving a side unbounded
      (``window=w`` is ``(w - 1, -1)``; with ``causal`` the right side is 0).
    * ``sink_tokens``, ``chunk``, ``mask_mod``: StreamingLLM's sink tokens beside the
      window, Llama 4's chunks and FlexAttention's mask functions, in the mask contract
      (:mod:`mha._kernel.contract`); ``sinks``, ``softcap``, ``alibi``, ``score_mod`` and
      ``score_mod_grad``: gpt-oss's sinks, Gemma 2's soft-capping, ALiBi and FlexAttention's
      score functions (:mod:`mha._kernel.scores`). docs/variants.md says how each is
      computed and written.
    * ``query_temperature``: ``(beta, floor)``, ``(beta, floor, offset)`` or ``(beta, floor,
      offset, "power")``: the scores of the query at position ``p`` (its row's, as the
      causal alignment places it: a cache's length plus its row) times ``1 + beta * log(1 +
      floor((p + offset) / floor))``, as Llama 4 (``(attn_scale, floor_scale, 1)``) and
      Ministral 3 scale their queries, or with ``"power"`` times ``(1 + (p + offset) /
      floor) ** beta``, as Beam does (``(0.1, 2048, 1, "power")``).
    * ``scale``: the factor on ``q k^T``; default ``1/sqrt(d_k)``.
    * ``return_weights``: also return the weights ``(..., H, L, S)`` (this builds the full
      score matrix, which the default path never does).
    * ``return_lse``: also return the log-sum-exp of each row's logits ``(..., H, L)``
      (``-inf`` for a row that sees no key; float32 for float16 inputs), for
      :func:`merge_attention`; ``lse_base=2`` returns it in base 2, ``log2 sum 2^(s log2
      e)`` (FlashInfer's), which ``merge_attention(base=2)`` reads.
    * ``return_backward``: also return ``backward``, a function of the output's gradient
      ``grad_out`` that returns ``{"q": dq, "k": dk, "v": dv}`` (and ``"bias"``, ``"sinks"``
      when given), each shaped like its input, in its dtype: FlashAttention-2's backward pass,
      tile by tile from the saved log-sum-exp, never building the score matrix.
    * ``dropout_p`` with ``generator`` (a ``np.random.Generator``, required with dropout):
      drop each attention weight with probability ``dropout_p`` and scale the rest by
      ``1 / (1 - dropout_p)``, in training. ``dropout_p=0.0`` turns it off, the generator
      given or not (``p if training else 0.0``); a generator without any ``dropout_p`` is
      refused. The mask depends only on one number drawn from ``generator``, not on the
      tiling; ``backward`` reuses it.
    * ``cache``: a :class:`mha.KVCache`, or a :class:`mha.PagedKVCache` (its sequences,
      in the order added, are the batch). Then ``k`` and ``v`` are the new tokens'
      ``(B, H_kv, L, d)``: they are appended to the cache after each sequence's length (only
      the first ``query_lengths[b]`` rows of sequence ``b``, when given) and ``q`` attends
      causally over everything cached, each sequence aligned to its own length, within the
      cache's window; with ``causal=False`` (or ``mask=False``) each new query sees every
      key of its sequence, the new ones after it too (refused with a window). ``mask`` and
      ``bias`` are then over positions: key ``j`` is position
      ``j``, ``S`` the longest sequence's length after the append (refused with a window's
      cache, whose slots are not positions). ``key_lengths``, ``return_weights`` and a
      top-left alignment are refused with a cache, and a refused call leaves it unchanged.
    * ``padding_side``: ``"left"`` with a cache and ``query_lengths``: each sequence's real
      new tokens are its last ``query_lengths[b]`` rows (a left-padded prompt) rather than
      its first; their outputs stay in those rows, the padding rows' are zeros.
    * ``max_memory``: bytes of scratch per worker (default 6 MiB); sets the tile sizes.
    * ``workers``: threads (default: every core when threadpoolctl is installed, else 1).
      Results are bitwise reproducible for fixed inputs, ``max_memory`` and ``workers``.

    Returns ``out (..., H, L, d_v)``, then the weights, the log-sum-exp and ``backward`` if
    asked for, in that order. A query row that sees no key gets zero weights and a zero output.

    >>> import numpy as np
    >>> from mha import scaled_dot_product_attention
    >>> q = k = np.eye(2)[None]                      # one head, two positions
    >>> v = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    >>> scaled_dot_product_attention(q, k, v, causal=True).round(3)  # e^(1/sqrt 2) = 2.028
    array([[[1.  , 0.  ],
            [0.33, 0.67]]])
    """
    keywords = SdpaKeywords(
        mask, causal, causal_alignment, key_lengths, query_lengths, bias, window, sink_tokens,
        chunk, mask_mod, sinks, softcap, alibi, score_mod, score_mod_grad, query_temperature,
        scale, return_weights, return_lse, return_backward, dropout_p, generator, cache,
        padding_side, max_memory, workers, lse_base,
    )  # fmt: skip
    checked = check_sdpa(keywords)
    result = attention(q, k, v, checked)
    if not checked.request.lse_base2:
        return result
    at = 2 if return_weights else 1  # (out, weights?, lse, backward?)
    parts = list(result)
    parts[at] = checked.request.returned_lse(parts[at])
    return tuple(parts)


def attention(q: Any, k: Any, v: Any, checked: Checked) -> np.ndarray | tuple[Any, ...]:
    """:func:`scaled_dot_product_attention` of ``q``, ``k``, ``v`` for its checked keywords:
    by a kept plan when it is a plain call (:mod:`.plans`), on a cache when it carries one
    (:mod:`.cached`), else on the kernel."""
    planned = planned_attention(q, k, v, checked)
    if planned is not None:
        return planned
    spec, given, request = checked.spec, checked.given, checked.request
    q, k, v, result_dtype, compute_dtype = checked_heads(q, k, v)
    scale = resolve_scale(spec.scale, q.shape[-1], compute_dtype)
    scores = spec.scores.fit(q.shape[-3], request.backward, q.shape[:-3])
    if given.cache is not None:
        if spec.selection is not None:
            raise AttentionValueError("a selection of keys is not available with cache= yet")
        dtypes = (result_dtype, compute_dtype)
        return attend_split_cached(q, k, v, checked, scale, scores, dtypes)
    shape = ScoreShape(q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-2])
    visibility = Visibility.build(
        spec.mask, given.arrays, shape, compute_dtype, f"q {q.shape}, k {k.shape}"
    )
    visibility = select_keys(spec.selection, q, k, visibility)
    outputs = Outputs(np.zeros((*q.shape[:-1], v.shape[-1]), dtype=compute_dtype))
    if request.weights:
        outputs.weights = np.zeros((*q.shape[:-1], k.shape[-2]), dtype=compute_dtype)
    if request.lse or request.backward:
        outputs.lse = np.full(q.shape[:-1], -np.inf, dtype=compute_dtype)
    cost = float(math.prod(q.shape[:-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    cost *= visibility.seen_fraction()  # the pairs computed: the workers follow the work
    # The seed is drawn once everything is checked, and put back if the call still fails.
    with (
        drawn(spec.dropout_p, given.generator, q.shape[-3], q.shape[-2]) as dropout,
        np.errstate(invalid="ignore", over="ignore"),
        Team(workers_for(cost, request.threads)) as team,
    ):
        visibility = visibility.classified(team)  # mask_mod's block map, kept for backward
        call = KernelCall(q, k, v, visibility, scale, scores, dropout, request.budget)
        if q.shape[-3]:  # (no query heads: nothing to compute)
            attend(call, outputs, team)
    results: list[Any] = [cast_result(outputs.out, result_dtype)]
    if outputs.weights is not None:
        results.append(cast_result(outputs.weights, result_dtype))
    if request.lse:
        results.append(outputs.lse)
    if request.backward:
        given_arrays = {"bias": given.arrays.bias, "sinks": spec.scores.sinks}
        results.append(SplitHeadsBackward(call, outputs, given_arrays, request.threads))
    return results[0] if len(results) == 1 else tuple(results)


def merge_attention(
    outputs: Any, lses: Any, sinks: Any = None, base: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Merge attention computed over disjoint key ranges into the attention over all of them.

    ``outputs`` and ``lses`` are lists: ``outputs[p] (..., L, d_v)`` and ``lses[p] (..., L)``
    are the results of
    :func:`scaled_dot_product_attention` with ``return_lse=True`` for the same queries over
    part ``p`` of the keys (split-key decoding, sequence-parallel attention). Returns the
    merged ``(out, lse)``. A part in which a row sees no key (``lse = -inf``) adds nothing;
    a row that sees no key in any part stays zero with ``lse = -inf``. ``sinks (H,)``
    (gpt-oss's logits, for lses ``(..., H, L)``) are added once to the merged softmax: give
    the parts computed without them. ``base=2`` reads and returns lses in base 2
    (``log2 sum 2^s`` of scores ``s`` in base 2, as FlashInfer keeps them); by default they
    are natural logarithms. An lse of ``+inf`` is read as ``-inf``, a part that saw no key
    (FlashAttention-2 returns ``+inf`` for an empty sequence, FlashAttention-3 ``-inf``;
    vLLM merges both so).

    >>> import numpy as np
    >>> from mha import merge_attention, scaled_dot_product_attention as sdpa
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 1, 4, 8))
    >>> left = sdpa(q, k[:, :3], v[:, :3], return_lse=True)
    >>> right = sdpa(q, k[:, 3:], v[:, 3:], return_lse=True)
    >>> out, lse = merge_attention([left[0], right[0]], [left[1], right[1]])
    >>> bool(np.allclose(out, sdpa(q, k, v), rtol=1e-14, atol=0))
    True
    """
    outs = [as_float_array(f"outputs[{p}]", x) for p, x in enumerate(_sequence("outputs", outputs))]
    logs = [as_float_array(f"lses[{p}]", x) for p, x in enumerate(_sequence("lses", lses))]
    if len(outs) != len(logs) or not outs:
        raise AttentionValueError(
            f"merge_attention needs one lse per output and at least one of each; "
            f"got {len(outs)} outputs and {len(logs)} lses"
        )
    for p, (out, lse) in enumerate(zip(outs, logs, strict=True)):
        if out.ndim < 2 or lse.shape != out.shape[:-1]:
            raise ShapeError(
                f"lses[{p}] must have the shape of outputs[{p}] without its last axis "
                f"(outputs[{p}] {out.shape}, lses[{p}] {lse.shape})"
            )
        same("outputs[0]", outs[0], f"outputs[{p}]", out, "shape {}", outs[0].shape, out.shape)
    if base not in (None, 2, 2.0) or isinstance(base, bool):
        raise AttentionValueError(f"base must be None (natural logarithms) or 2; got {base!r}")
    result_dtype, compute_dtype = result_and_compute_dtypes(*outs)
    _, lse_dtype = result_and_compute_dtypes(*outs, *logs)
    logs = [np.where(lse == np.inf, -np.inf, lse) for lse in logs]  # +inf: an empty part
    if base is not None:
        logs = [lse * np.log(2.0) for lse in logs]
    scores = None
    if sinks is not None:
        if logs[0].ndim < 2:
            raise ShapeError(
                f"sinks= needs lses with a head axis, (..., H, L); got lses[0] {logs[0].shape}"
            )
        scores = check_scores(
            sinks=sinks,
            softcap=None,
            alibi=None,
            score_mod=None,
            score_mod_grad=None,
            H=logs[0].shape[-2],
            want_backward=False,
        )
    with np.errstate(invalid="ignore", over="ignore"):
        merged, lse_merged = merge_partials(
            [out.astype(compute_dtype, copy=False) for out in outs],
            [lse.astype(lse_dtype, copy=False) for lse in logs],
        )
        if scores is not None and scores.sinks is not None:
            add_sinks(merged, lse_merged, scores.sinks)
    if base is not None:
        lse_merged = lse_merged / np.log(2.0)
    return cast_result(merged, result_dtype), lse_merged


def _sequence(name: str, value: Any) -> list[Any]:
    if isinstance(value, np.ndarray) or not isinstance(value, (list, tuple)):
        raise AttentionTypeError(f"{name} must be a list or tuple of arrays, one per key range")
    return list(value)
