"""The entry points' keyword options as ``TypedDict``s, for the overloads that give each
combination of ``return_*`` flags its own return type.

A type checker then sees ``np.ndarray`` for a plain call and the documented tuple (in the
order output, weights, log-sum-exp, backward) for the others; a misspelt keyword is still an
error, since ``**options: Unpack[...]`` accepts only these names. Nothing here runs: the
functions themselves take these keywords one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, SupportsIndex, TypedDict

import numpy as np

from .cache import KVCache
from .paged_cache import PagedKVCache

__all__ = ["Backward", "Flag", "ForwardOptions", "MaskMod", "MhaOptions", "ScoreMod", "SdpaOptions"]

Backward = Callable[[Any], dict[str, np.ndarray]]
"""``backward(grad_out)``: the gradients by name, each shaped like what it is the gradient of."""

Flag = bool | np.bool_
"""A switch: Python's or NumPy's bool (an int is refused at run time)."""

MaskMod = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], Any]
"""``mask_mod(b, h, q_idx, kv_idx) -> bool array`` of broadcastable int64 index arrays."""

ScoreMod = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], Any]
"""``score_mod(score, b, h, q_idx, kv_idx) -> score`` (and its derivative, same signature)."""


class _Keywords(TypedDict, total=False):
    causal: Flag | None
    causal_alignment: str | None
    key_lengths: Any
    query_lengths: Any
    bias: Any
    window: SupportsIndex | tuple[int, int] | None
    mask_mod: MaskMod | None
    score_mod: ScoreMod | None
    score_mod_grad: ScoreMod | None
    scale: float | None
    dropout_p: float | None
    generator: np.random.Generator | None
    cache: KVCache | PagedKVCache | None
    padding_side: str | None
    max_memory: SupportsIndex | None
    workers: SupportsIndex | None


class SdpaOptions(_Keywords, total=False):
    """:func:`mha.scaled_dot_product_attention`'s keywords besides the ``return_*`` flags."""

    mask: Any
    sink_tokens: SupportsIndex | None
    chunk: SupportsIndex | None
    sinks: Any
    softcap: float | None
    alibi: Any
    query_temperature: tuple[float | str, ...] | None
    lse_base: float | None


class MhaOptions(_Keywords, total=False):
    """:func:`mha.multi_head_attention`'s keywords besides the ``return_*`` flags."""

    mask: Any
    b_q: Any
    b_k: Any
    b_v: Any
    b_o: Any
    bias_k: Any
    bias_v: Any
    add_zero_attn: Flag
    num_kv_heads: SupportsIndex | None
    rope_theta: float | None
    rotary_dim: SupportsIndex | None
    rotary_interleaved: Flag
    rope_scaling: dict[str, Any] | None
    positions: Any
    sink_tokens: SupportsIndex | None
    chunk: SupportsIndex | None
    sinks: Any
    softcap: float | None
    alibi: Any
    query_temperature: tuple[float | str, ...] | None
    q_norm: Any
    k_norm: Any
    qk_norm: str | None
    qk_norm_eps: float | None
    qk_norm_offset: float | None
    qk_layernorm: Flag
    qk_norm_after_rope: Flag
    q_norm_bias: Any
    k_norm_bias: Any
    W_g: Any
    b_g: Any
    output_gate: str | None
    clip_qkv: float | None
    v_norm: float | None
    q_scale: Any
    o_norm: Any
    output_norm: str | None
    output_norm_eps: float | None


class ForwardOptions(_Keywords, total=False):
    """``MultiHeadAttention.forward``'s keywords besides the mask (its second positional
    argument) and the ``return_*`` flags."""

    key: Any
    value: Any
    positions: Any
