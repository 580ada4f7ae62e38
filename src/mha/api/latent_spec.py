"""What a :class:`mha.LatentAttention` computes besides its weights: :class:`LatentSpec`,
the constructor's keywords as one record (a reader's pair ``(spec, weights)`` builds a layer
by :meth:`mha.LatentAttention.from_spec`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LatentSpec"]


@dataclass(frozen=True)
class LatentSpec:
    """What a :class:`mha.LatentAttention` computes besides its weights, as its
    constructor's keywords name it: ``d_model``, ``num_heads``, ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``q_lora_rank`` (``None``:
    the queries projected directly), ``rope_theta``, ``rope_scaling``,
    ``rotary_interleaved``, ``norm_eps``, ``scale`` (``None``: ``1/sqrt(qk_nope_head_dim
    + qk_rope_head_dim)``), ``indexer`` (an :class:`~mha.api.sparse.IndexerSpec`: sparse
    top-k attention, DeepSeek-V3.2's; ``None``: dense), ``output_gate`` (the activation
    of a gate, ``W_g (E, H)``: Bailing-hybrid's; ``None``: none),
    ``output_gate_per_head`` (``False``: a gate per feature, ``W_g (E, H*v_head_dim)``,
    HY-V4's), ``shares_choice_with`` (the index of the layer whose indexer's choice this
    layer, without an indexer, attends with: HY-V4's ``"shared"`` layers, :mod:`.sparse`),
    ``query_temperature`` (the queries scaled by their position, Mistral 4's: the keyword
    of :func:`mha.scaled_dot_product_attention`; ``None``: none), ``rotate``
    (``False``: the ``qk_rope_head_dim`` features are not rotated, Kimi-Linear's latent
    attention without positions, NoPE; its rope settings are then not read),
    ``query_gate`` (A.X-K2's query and gate per element from the query latent beside its
    normalised form), ``window`` (a sliding window; ``None``: none) and ``rope_key_norm``
    (an RMSNorm of the shared rotary key before its rotation, ``k_pe_norm``: dots3's).
    A reader's pair ``(spec, weights)`` builds a layer by
    :meth:`LatentAttention.from_spec`.

    >>> import mha
    >>> mha.LatentSpec(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
    ...                v_head_dim=4).rope_theta
    10000.0
    """

    d_model: Any
    num_heads: Any
    kv_lora_rank: Any
    qk_nope_head_dim: Any
    qk_rope_head_dim: Any
    v_head_dim: Any
    q_lora_rank: Any = None
    rope_theta: Any = 10000.0
    rope_scaling: Any = None
    rotary_interleaved: Any = True
    norm_eps: Any = 1e-6
    scale: Any = None
    indexer: Any = None
    output_gate: Any = None
    query_temperature: Any = None
    output_gate_per_head: Any = True
    shares_choice_with: Any = None
    rotate: Any = True
    query_gate: Any = False
    window: Any = None
    rope_key_norm: Any = False

    kind = "latent"
    """What a reader's spec builds (:meth:`LatentAttention.from_spec`)."""
