"""The projection layer as one function: :func:`multi_head_attention`, its keywords checked
(:func:`.checks.check_layer`) and computed (:func:`.projection.compute`).

A plain self-attention call (no keyword but ``mask=None`` or ``True``, ``causal`` as a
``bool`` and ``workers``, the projections and their biases the only weights, every array a
NumPy array) is kept per signature of shapes and dtypes from its second call
(:class:`.layer_plan.FunctionPlan`): a model's loop, a training step or a benchmark calling
the function again and again with arrays of the same shapes then skips the checks and the
planning, which depend only on those, and computes as a layer's kept plan does: the same
functions in the same order, the same bits.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

import numpy as np

from .checks import LayerArrays, LayerWeights, check_layer
from .layer_plan import function_signature, keep_function_plan, kept_function_plan
from .projection import compute
from .spec import MhaKeywords, check_mha

if TYPE_CHECKING:
    from typing import Unpack

    from .cache import KVCache
    from .paged_cache import PagedKVCache
    from .signatures import Backward, Flag, MaskMod, MhaOptions, ScoreMod

__all__ = ["multi_head_attention"]


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
    signature = None
    if Q is K is V and _plain(keywords, weights):  # a call kept per signature, when kept
        signature = function_signature(Q, weights, num_heads, mask, causal, workers)
    if signature is not None:
        kept = kept_function_plan(signature)
        if kept is not None:
            out = kept(Q, weights)
            if out is not None:
                return out
    call = check_layer(LayerArrays(Q, K, V), weights, num_heads, check_mha(keywords))
    result = compute(call)
    if signature is not None:
        keep_function_plan(signature, kept, call, (Q, weights), mask, workers)
    return result


_DEFAULTS = MhaKeywords()


def _plain(keywords: MhaKeywords, weights: LayerWeights) -> bool:
    """Whether a call gives at most ``mask`` (``None`` or ``True``), ``causal`` (``None``
    or a ``bool``) and ``workers`` (``None`` or an ``int``) of the keywords, and no weights
    but the projections and their biases: a call :mod:`.layer_plan` may keep per
    signature."""
    workers, causal = keywords.workers, keywords.causal
    return (
        (keywords.mask is None or keywords.mask is True)
        and (causal is None or type(causal) is bool)
        and (workers is None or type(workers) is int)
        and all(map(operator.is_, keywords[2:9], _DEFAULTS[2:9]))  # (causal_alignment, ...)
        and all(map(operator.is_, keywords[10:], _DEFAULTS[10:]))  # (after workers)
        and all(x is None for x in weights[8:])  # (bias_k, ..., q_scale)
    )
