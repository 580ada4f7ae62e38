"""The projection layer: :func:`multi_head_attention` projects the inputs into heads,
rotates them (rotary positions), appends torch's extra keys, runs the split-head core on the
kernel (or on a cache), joins the heads and applies the output projection.

Weights use the "x @ W" layout: ``W_q (d_q, H*d_k)`` maps a query of width ``d_q`` to the
``H`` heads' concatenated queries. Shapes are named as in the paper: ``B`` batch, ``H``
heads, ``L`` query positions, ``S`` key positions, ``d_k``/``d_v`` per-head widths.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

import numpy as np

from .._arrays import cast_result
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import MaskArrays, MaskRules, ScoreShape, Visibility
from .._kernel.dropout import Dropout, drawn
from .._kernel.forward import attend
from .._kernel.team import Team, workers_for
from .cache import KVCache
from .cached import CachedCall, attend_cached
from .checks import (
    Call,
    LayerArrays,
    LayerWeights,
    Weights,
    check_layer,
)
from .clip import clip
from .gradients import Forward, ProjectedBackward, join_heads, split_heads
from .padding import to_front, to_left
from .paged_cache import PagedKVCache
from .qk_norm import QKNorm
from .qkv import qkv_weights
from .rotary import rotate, rotation
from .selection import select_keys
from .sequence_blocks import blocks_for
from .spec import MhaKeywords, check_mha
from .v_norm import v_norm

if TYPE_CHECKING:
    from typing import Unpack

    from .signatures import Backward, Flag, MaskMod, MhaOptions, ScoreMod

__all__ = [
    "append_keys",
    "compute",
    "layer_sizes",
    "layer_workers",
    "multi_head_attention",
    "project_heads",
]


# One overload per combination of the return_* flags; the last for flags known at run time.
# fmt: off
@overload
def multi_head_attention(
    Q: Any, K: Any, V: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, num_heads: SupportsIndex, *,
    return_weights: Literal[False] = ..., return_backward: Literal[False] = ...,
    **options: Unpack[MhaOptions],
) -> np.ndarray: ...
@overload
def multi_head_attention(
    Q: Any, K: Any, V: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, num_heads: SupportsIndex, *,
    return_weights: Literal[True], return_backward: Literal[False] = ...,
    **options: Unpack[MhaOptions],
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def multi_head_attention(
    Q: Any, K: Any, V: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, num_heads: SupportsIndex, *,
    return_weights: Literal[False] = ..., return_backward: Literal[True],
    **options: Unpack[MhaOptions],
) -> tuple[np.ndarray, Backward]: ...
@overload
def multi_head_attention(
    Q: Any, K: Any, V: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, num_heads: SupportsIndex, *,
    return_weights: Literal[True], return_backward: Literal[True],
    **options: Unpack[MhaOptions],
) -> tuple[np.ndarray, np.ndarray, Backward]: ...
@overload
def multi_head_attention(
    Q: Any, K: Any, V: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, num_heads: SupportsIndex, *,
    return_weights: Flag = ..., return_backward: Flag = ..., **options: Unpack[MhaOptions],
) -> np.ndarray | tuple[Any, ...]: ...
# fmt: on


def multi_head_attention(
    Q: Any,
    K: Any,
    V: Any,
    W_q: Any,
    W_k: Any,
    W_v: Any,
    W_o: Any,
    num_heads: SupportsIndex,
    *,
    mask: Any = None,
    causal: Flag | None = None,
    causal_alignment: str | None = None,
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    b_q: Any = None,
    b_k: Any = None,
    b_v: Any = None,
    b_o: Any = None,
    scale: float | None = None,
    return_weights: Flag = False,
    max_memory: SupportsIndex | None = None,
    workers: SupportsIndex | None = None,
    bias_k: Any = None,
    bias_v: Any = None,
    add_zero_attn: Flag = False,
    num_kv_heads: SupportsIndex | None = None,
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
    rope_theta: float | None = None,
    rotary_dim: SupportsIndex | None = None,
    rotary_interleaved: Flag = False,
    rope_scaling: dict[str, Any] | None = None,
    positions: Any = None,
    q_norm: Any = None,
    k_norm: Any = None,
    qk_norm: str | None = None,
    qk_norm_eps: float | None = None,
    qk_norm_offset: float | None = None,
    qk_layernorm: Flag = False,
    qk_norm_after_rope: Flag = False,
    q_norm_bias: Any = None,
    k_norm_bias: Any = None,
    W_g: Any = None,
    b_g: Any = None,
    output_gate: str | None = None,
    clip_qkv: float | None = None,
    v_norm: float | None = None,
    q_scale: Any = None,
    o_norm: Any = None,
    output_norm: str | None = None,
    output_norm_eps: float | None = None,
    cache: KVCache | PagedKVCache | None = None,
    padding_side: str | None = None,
    return_backward: Flag = False,
    dropout_p: float | None = None,
    generator: np.random.Generator | None = None,
) -> np.ndarray | tuple[Any, ...]:
    """Multi-head attention (Vaswani et al., 2017) with "x @ W" weights.

    Projects, splits the width evenly across ``num_heads`` heads, runs
    :func:`scaled_dot_product_attention` per head, joins the heads and applies ``W_o``.

    * ``Q (B, L, d_q)``, ``K (B, S, d_kin)``, ``V (B, S, d_vin)``: queries, keys and values,
      or unbatched ``(L, d)``. When ``Q``, ``K`` and ``V`` are one array, one GEMM
      projects all three.
    * ``W_q (d_q, H*d_k)``, ``W_k (d_kin, H*d_k)``, ``W_v (d_vin, H*d_v)``,
      ``W_o (H*d_v, d_out)``: the projections, applied as ``x @ W``. PyTorch stores the
      transpose: see :meth:`MultiHeadAttention.from_torch`.
    * ``num_heads``: ``H``; it must divide the columns of ``W_q`` and ``W_v``.
    * ``mask``: a boolean array, **True = may attend**, broadcastable to the scores
      ``(B, H, L, S)``; ``(L, S)`` and ``(B, L, S)`` apply to every head. ``mask=True`` is
      the causal mask. Integer or float arrays are refused (an additive mask goes in
      ``bias``). Every mask argument combines with the others by AND.
    * ``causal``: hide key ``j`` from query ``i`` when ``j > i + (S - L)`` (the last query
      sees every key); for ``L == S`` the usual lower triangle.
    * ``causal_alignment``: ``"top_left"`` for ``j > i`` instead (PyTorch's
      ``is_causal``), or ``"bottom_right_per_sequence"``: each sequence aligned on its own
      lengths, its last real query seeing its last real key (FlashAttention's rule for
      variable lengths); only with a causal mask or a window.
    * ``key_lengths``: ``(B,)`` integers (one number for unbatched input): keys at index
      ``>= length`` are padding.
    * ``query_lengths``: ``(B,)`` integers: rows at index ``>= length`` are padding; their
      attention output is zero, so their final output is ``b_o`` (zero without it).
    * ``bias``: an additive float array broadcastable like ``mask``; ``-inf`` hides a key.
    * ``b_q``, ``b_k``, ``b_v``, ``b_o``: biases added after their projections.
    * ``scale``: the factor on ``q k^T``; default ``1/sqrt(d_k)``.
    * ``return_weights``: also return the per-head weights ``(B, H, L, S)``.
    * ``max_memory``, ``workers``: scratch bytes per worker and threads, as in
      :func:`scaled_dot_product_attention`; they never change results beyond rounding.
    * ``num_kv_heads``: ``H_kv`` key/value heads for grouped-query (or, with 1, multi-query)
      attention; ``W_k`` and ``W_v`` are then ``H_kv*d_k`` and ``H_kv*d_v`` wide, and query
      head ``h`` uses key/value head ``h // (H // H_kv)``. Default ``num_heads``.
    * ``window``: a sliding window (transformers' ``sliding_window``): query ``i`` sees key
      ``j`` only if ``(i + offset) - j < window``, ``offset`` the causal alignment's; or
      ``window=(left, right)``, FlashAttention's ``window_size`` on both sides, as in
      :func:`scaled_dot_product_attention`.
    * ``sink_tokens``, ``chunk``, ``mask_mod``, ``sinks``, ``softcap``, ``alibi``,
      ``score_mod``, ``score_mod_grad``, ``query_temperature``: the variants of today's
      models, as in :func:`scaled_dot_product_attention` (docs/variants.md); ``backward``
      then has a ``sinks`` gradient too.
    * ``rope_theta``: rotate q and k after projection with rotary position embeddings of
      this base (:func:`mha.apply_rotary`), at ``positions`` (``(L,)`` or ``(B, L)``;
      default ``0..S-1`` for keys, the last ``L`` of them for queries) or at the cache's
      positions. ``rotary_dim``, ``rotary_interleaved`` and ``rope_scaling`` are
      :func:`mha.apply_rotary`'s ``rotary_dim``, ``interleaved`` and ``scaling`` (transformers'
      ``rope_parameters``: ``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``).
    * ``q_norm`` and ``k_norm``: QK-norm, an RMSNorm of the projected queries and keys
      before the rotation, with these weights: ``qk_norm="head"`` (default) normalises each
      head's ``d_k`` features (Qwen3, Gemma 3; weights ``(d_k,)``), ``"all"`` a token's
      ``H*d_k`` (or ``H_kv*d_k``) features before the split (OLMo 2). ``qk_norm_eps``
      (default 1e-6) and ``qk_norm_offset`` (1.0 for Gemma's ``(1 + weight)``; default 0).
      ``qk_norm="each_head"`` normalises each head's features with its own weights ``(H,
      d_k)`` and ``(H_kv, d_k)`` (StableLM, Cohere). ``qk_layernorm=True``: a LayerNorm (the
      mean subtracted) instead, with the biases ``q_norm_bias`` and ``k_norm_bias`` (shaped
      like the weights) when given (Persimmon, Phi). ``qk_norm_after_rope=True``: the norm
      after the rotation, not before it (HunYuan). The scale multiplies the normalised
      queries; ``backward`` has the weights' (and biases') gradients.
    * ``W_g`` (with ``b_g``): an output gate, the joined heads times ``act(Q @ W_g + b_g)``
      before ``W_o`` (Qwen3-Next, Qwen3.5, LFM3, Laguna): per element with ``W_g (d_q,
      H*d_v)``, per head with ``W_g (d_q, H)``; ``output_gate`` is ``act``, ``"sigmoid"``
      (default) or ``"softplus"``. ``backward`` has the gradients of both.
    * ``clip_qkv``: the projected queries, keys and values clamped to ``[-clip_qkv,
      clip_qkv]`` (DBRX, OLMo, OLMoE, MPT), after the QK-norm and before the rotation and
      the scale; the gradients pass where a value was inside.
    * ``v_norm``: the epsilon of an RMSNorm without weights of each value head (Gemma 3n,
      Gemma 4), after the projection (and before the cache: it holds the normalised
      values); ``None`` for none.
    * ``q_scale (H*d_k,)``: each query head's features times their factor after the
      rotation and the scale (Dory's nGPT ``sqk``); ``backward`` has its gradient.
    * ``output_norm``: a norm of the joined heads over all their ``H*d_v`` features before
      ``W_o`` (after the output gate), ``"rms"`` (an RMSNorm with the weight ``o_norm
      (H*d_v,)``: BitNet) or ``"l2"`` (the L2 norm, no weights: Dory's nGPT attention);
      ``output_norm_eps`` is added to the mean square (the sum of squares for ``"l2"``),
      ``1e-6`` by default. ``backward`` has the gradient of ``o_norm``.
    * ``return_backward``: also return ``backward``, a function of the output's gradient
      that returns the gradients of every input and weight given, keyed by parameter name
      (``Q``, ``K``, ``V``, ``W_q``, ..., ``b_o``, ``bias_k``, ``bias_v``, ``bias``), each
      shaped like it, in its dtype. With ``Q is K is V`` the three are still separate (their
      sum is the shared input's gradient).
    * ``dropout_p`` and ``generator``: dropout on the attention weights, as in
      :func:`scaled_dot_product_attention` (``dropout_p=0.0`` turns it off, a generator
      given or not).
    * ``cache``: a :class:`mha.KVCache` or :class:`mha.PagedKVCache`: ``Q``, ``K``, ``V``
      are the next tokens ``(B, L, d)`` of each sequence (with ``query_lengths``, only the
      first ``query_lengths[b]`` rows of sequence ``b`` are real). Their keys and values are
      appended and the queries attend causally (unless ``causal=False`` or ``mask=False``)
      over everything cached, as in
      :func:`scaled_dot_product_attention` (a ``mask`` or ``bias`` is over positions).
      ``padding_side="left"``: the real rows are each sequence's last ``query_lengths[b]``
      (a left-padded prompt); their outputs stay there.
    * ``bias_k (H*d_k,)`` with ``bias_v (H*d_v,)``, and ``add_zero_attn``: PyTorch's extra
      keys, a learned key/value pair and a zero key/value pair appended after the
      projections (in that order), visible to every query whatever the masks say, which
      refer to the ``S`` given keys. The weights then have ``S`` plus one column per extra
      key.

    Returns ``(B, L, d_out)`` (``(L, d_out)`` unbatched) in the inputs' dtype, then the
    weights and ``backward`` if asked for, in that order. Any size may be zero (no
    sequences, no queries, no keys): queries that see no key get a zero attention output,
    and gradients are zeros of the right shapes.

    >>> import numpy as np
    >>> from mha import multi_head_attention
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((1, 3, 4))
    >>> W_q, W_k, W_v, W_o = rng.standard_normal((4, 4, 4))
    >>> out, weights = multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, 2, causal=True,
    ...                                     return_weights=True)
    >>> out.shape, out.dtype, weights.shape
    ((1, 3, 4), dtype('float64'), (1, 2, 3, 3))
    >>> weights[0, 0, 0]                             # the first query sees only itself
    array([1., 0., 0.])
    >>> weights.sum(axis=-1)                         # every row of weights sums to 1
    array([[[1., 1., 1.],
            [1., 1., 1.]]])
    """
    keywords = MhaKeywords(
        mask, causal, causal_alignment, key_lengths, query_lengths, bias, scale, return_weights,
        max_memory, workers, add_zero_attn, num_kv_heads, window, sink_tokens, chunk, mask_mod,
        sinks, softcap, alibi, score_mod, score_mod_grad, query_temperature, rope_theta, rotary_dim,
        rotary_interleaved, rope_scaling, positions, qk_norm, qk_norm_eps, qk_norm_offset, cache,
        padding_side, return_backward, dropout_p, generator, output_gate, clip_qkv, qk_layernorm,
        qk_norm_after_rope, v_norm, output_norm, output_norm_eps,
    )  # fmt: skip
    weights = LayerWeights(
        W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, bias_k, bias_v, q_norm, k_norm, W_g, b_g,
        q_norm_bias, k_norm_bias, o_norm, q_scale,
    )  # fmt: skip
    call = check_layer(LayerArrays(Q, K, V), weights, num_heads, check_mha(keywords))
    return compute(call)


def compute(call: Call) -> np.ndarray | tuple[Any, ...]:
    """A call checked by :func:`check_layer`, computed: the output, then the weights and
    ``backward`` if asked for."""
    if call.given.left_padded:  # each sequence's real rows first, as for right padding
        call = _real_rows_first(call)
    H, L, S = call.H, call.L, call.S
    dtype, given, request = call.compute_dtype, call.weights, call.request
    w = given.in_dtype(dtype)
    visibility = call.visibility
    if visibility is not None and call.extra:
        visibility = with_extra_keys(visibility, call.extra, dtype)
    # Everything is checked: the dropout's seed may be drawn.
    drop_p = call.spec.dropout_p

    workers = request.threads
    if workers is None:  # the default for the call's multiply-adds
        keys = S if call.cache is None else int(call.cache.lengths.max(initial=0)) + L
        workers = layer_workers(layer_sizes(call), keys)
    blocks = blocks_for(call, workers)  # many sequences: a block of them at a time
    if blocks is not None:
        with np.errstate(invalid="ignore", over="ignore"), Team(workers) as team:
            by_blocks = blocks(call, w, team)
        if by_blocks is not None:
            return cast_result(by_blocks, call.result_dtype)
    with (  # the seed drawn once everything is checked, put back if the call still fails
        drawn(drop_p, call.given.generator, H, L) if drop_p else _NO_DROPOUT as dropout,
        np.errstate(invalid="ignore", over="ignore"),
        Team(workers) as team,
    ):
        saved: dict[str, list[np.ndarray]] = {}  # the QK-norm's, for the backward
        q, k, v = project_heads(call, w, team, saved if request.backward else None)
        if call.extra:
            k = append_keys(k, w.bias_k, call.spec.add_zero_attn, call.H_kv)
            v = append_keys(v, w.bias_v, call.spec.add_zero_attn, call.H_kv)
        if visibility is not None:
            visibility = select_keys(call.spec.selection, q, k, visibility.classified(team))
        joined, outputs, kernel = _attend(call, (q, k, v), visibility, dropout, team)
        staged, stage_state = joined, None
        if call.spec.output is not None:  # a change between the heads and W_o
            output = call.spec.output
            shared = getattr(output, "uses_matmul", False)  # and may overwrite the heads
            product: tuple[Any, ...] = (team, not request.backward) if shared else ()
            staged, stage_state = output.forward(joined, call.Q, *product)
        out = team.matmul(staged, w.W_o, w.b_o)
    if call.given.left_padded:
        assert call.counts is not None
        out = to_left(out, call.counts, axis=-2)
    results: list[Any] = [cast_result(out, call.result_dtype)]
    if outputs is not None and outputs.weights is not None:
        results.append(cast_result(outputs.weights, call.result_dtype))
    if request.backward:
        assert outputs is not None and outputs.lse is not None and visibility is not None
        stage = (staged, stage_state)
        assert kernel is not None
        forward = Forward(kernel, joined, outputs.lse, saved, stage)
        results.append(ProjectedBackward(call, forward))
    return results[0] if len(results) == 1 else tuple(results)


_NO_DROPOUT = contextlib.nullcontext()
"""A call's dropout when it has none (``drawn``'s ``None``, without its generator's
microseconds)."""


def layer_workers(sizes: tuple[Any, ...], keys: int) -> int:
    """The default workers of a layer's call of ``sizes`` (:func:`layer_sizes`) whose
    queries attend over ``keys`` keys: :func:`workers_for` its multiply-adds, the
    projections' and the attention's."""
    sequences, L, S, W_q, W_kv, W_o, H, width = sizes
    cost = float(sequences) * (L * W_q + S * W_kv + L * W_o + H * L * keys * width)
    return workers_for(cost, None)


def layer_sizes(call: Call) -> tuple[Any, ...]:
    """What :func:`layer_workers` reads of a call."""
    w = call.weights
    return (
        math.prod(call.B), call.L, call.S, w.W_q.size, w.W_k.size + w.W_v.size, w.W_o.size,
        call.H, call.d_k + call.d_v,
    )  # fmt: skip


def _attend(
    call: Call,
    heads: tuple[np.ndarray, np.ndarray, np.ndarray],
    visibility: Visibility | None,
    dropout: Dropout | None,
    team: Team,
) -> tuple[np.ndarray, Outputs | None, KernelCall | None]:
    """The joined heads ``(*B, L, H*d_v)`` of the projected ``heads`` (q, k, v): over the
    given keys within ``visibility``, or on the call's cache (``visibility`` ``None``); and
    the kernel's outputs and call (``None`` for a cache's call)."""
    q, k, v = heads
    H, B, L, request = call.H, call.B, call.L, call.request
    if visibility is None:  # the cache's call
        assert call.append is not None
        cached = CachedCall(q, k, v, call.append, 1.0, call.scores, request)
        return join_heads(attend_cached(cached, team)[0]), None, None
    joined = np.zeros((*B, L, H * call.d_v), dtype=call.compute_dtype)  # (*B, L, H*d_v)
    outputs = Outputs(split_heads(joined, H))
    if request.weights:
        outputs.weights = np.zeros((*B, H, L, call.S + call.extra), dtype=call.compute_dtype)
    if request.backward:
        outputs.lse = np.full((*B, H, L), -np.inf, dtype=call.compute_dtype)
    kernel = KernelCall(q, k, v, visibility, 1.0, call.scores, dropout, request.budget)
    attend(kernel, outputs, team)
    return joined, outputs, kernel


def _real_rows_first(call: Call) -> Call:
    """A left-padded cached call with each sequence's real rows first (:func:`to_front`)."""
    assert call.counts is not None
    Q = to_front(call.Q, call.counts, axis=-2)
    K = Q if call.K is call.Q else to_front(call.K, call.counts, axis=-2)
    V = Q if call.V is call.Q else K if call.V is call.K else to_front(call.V, call.counts, -2)
    return replace(call, Q=Q, K=K, V=V)


def project_heads(
    call: Call, w: Weights, team: Team, saved: dict[str, list[np.ndarray]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The projected ``q (*B, H, L, d_k)`` (already times the scale), ``k``, ``v``, rotated
    at the call's positions when it has rotary embeddings; ``w`` holds the call's weights in
    its compute dtype.

    Where the scale goes, and whether one GEMM against ``[W_q | W_k | W_v]`` projects all
    three: :func:`.qkv.qkv_weights`. With QK-norm (or ``clip_qkv``) the scale multiplies
    the normalised (clamped) queries, and ``saved`` (when given) receives what the norm's
    backward needs under ``"q"`` and ``"k"``, and where the clamp let each of q, k, v through
    under ``"clip"``.
    """
    dtype, scale, H = call.compute_dtype, call.scale, call.H
    Q = call.Q.astype(dtype, copy=False)
    norm, c = call.qk_norm, call.spec.clip_qkv
    weights = qkv_weights(call, w, math.prod(Q.shape[:-1]))
    # a late scale multiplies the queries as they are copied into heads when nothing comes
    # between (the same bits as after, without a pass over them)
    copy_scale = weights.late_scale and norm is None and c is None
    times = scale if copy_scale else None
    if weights.joined is not None:
        q, k, v = team.matmul_heads(Q, *weights.joined, weights.heads, times)
    else:
        K, V = call.K.astype(dtype, copy=False), call.V.astype(dtype, copy=False)
        q, k, v = (
            team.matmul_heads(x, W, b, [part], factor)[0]
            for x, W, b, part, factor in zip(
                (Q, K, V), weights.W, weights.b, weights.heads, (times, None, None), strict=True
            )
        )
    after = norm is not None and norm.after_rope  # HunYuan's: the norm after the rotation
    if norm is not None and not after:
        q, k = normalise(norm, q, k, saved)
    if call.spec.v_norm is not None:  # Gemma 3n, Gemma 4: each value head's RMSNorm
        v, *v_saved = v_norm(v, call.spec.v_norm)
        if saved is not None:
            saved["v"] = v_saved
    if c is not None:  # DBRX, OLMo, OLMoE: clamped after the norm
        (q, q_in), (k, k_in), (v, v_in) = clip(q, c), clip(k, c), clip(v, c)
        if saved is not None:
            saved["clip"] = [q_in, k_in, v_in]
    if weights.late_scale and not after and not copy_scale:
        q *= scale  # a buffer of this call's own: the norm's or the clamp's
    if call.rotary is not None:  # the queries' rotation for keys at the same positions too
        turn = rotation(q.shape, call.q_positions, q.dtype, **call.rotary)
        q = rotate(q, turn)
        same = call.k_positions is call.q_positions and (
            k.ndim,
            k.shape[0],
            k.shape[-2:],
            k.dtype,
        ) == (q.ndim, q.shape[0], q.shape[-2:], q.dtype)  # (the angles broadcast over the heads)
        k = rotate(k, turn if same else rotation(k.shape, call.k_positions, k.dtype, **call.rotary))
    if norm is not None and after:
        q, k = normalise(norm, q, k, saved)
        q *= scale
    if call.q_scale is not None:  # Dory's: each query feature's factor, after the rotation
        if saved is not None:
            saved["q_scale"] = [q]
        q = q * call.q_scale.astype(q.dtype, copy=False).reshape(H, 1, -1)
    return q, k, v


def normalise(
    norm: QKNorm, q: np.ndarray, k: np.ndarray, saved: dict[str, list[np.ndarray]] | None
) -> tuple[np.ndarray, np.ndarray]:
    """The heads ``q (*B, H, L, d_k)`` and ``k`` through the QK-norm, what its backward
    needs into ``saved`` (when given) under ``"q"`` and ``"k"``."""
    H, H_kv = q.shape[-3], k.shape[-3]
    if norm.kind == "all":  # OLMo 2: a token's features, every head's
        (q, *q_saved), (k, *k_saved) = (norm.apply(join_heads(q), "q"),
                                        norm.apply(join_heads(k), "k"))  # fmt: skip
        q, k = split_heads(q, H), split_heads(k, H_kv)
    else:  # Qwen3, Gemma 3, StableLM, Cohere, HunYuan: each head's features
        (q, *q_saved), (k, *k_saved) = norm.apply(q, "q"), norm.apply(k, "k")
    if saved is not None:
        saved["q"], saved["k"] = q_saved, k_saved
    return q, k


def with_extra_keys(visibility: Visibility, extra: int, dtype: np.dtype) -> Visibility:
    """The visibility over ``S + extra`` keys: the extra keys are seen by every query."""
    allowed = visibility.allowed()  # (*B, H, L, S), query padding included
    rows = np.ones(allowed.shape[-2], dtype=bool)
    if visibility.query_lengths is not None:
        rows = np.arange(visibility.L) < visibility.query_lengths[..., None]
    seen = np.broadcast_to(rows[..., None, :, None], (*allowed.shape[:-1], extra))
    bias = None
    if visibility.bias is not None:
        bias = np.broadcast_to(visibility.bias, allowed.shape)
        bias = np.concatenate([bias, np.zeros((*allowed.shape[:-1], extra), dtype)], axis=-1)
    arrays = MaskArrays(np.concatenate([allowed, seen], axis=-1), bias)
    shape = ScoreShape(
        visibility.index_shape[:-1], visibility.index_shape[-1], visibility.L, visibility.S + extra
    )
    return Visibility.build(MaskRules(), arrays, shape, dtype)


def append_keys(x: np.ndarray, bias: np.ndarray | None, zero: bool, H: int) -> np.ndarray:
    """``x (*B, H, S, d)`` with the learned row ``bias (H*d,)`` and a zero row appended."""
    rows = [x]
    lead = x.shape[:-2]
    if bias is not None:
        rows.append(np.broadcast_to(bias.reshape(H, 1, x.shape[-1]), (*lead, 1, x.shape[-1])))
    if zero:
        rows.append(np.zeros((*lead, 1, x.shape[-1]), dtype=x.dtype))
    return np.concatenate(rows, axis=-2)
