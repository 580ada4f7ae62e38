"""What a layer of a family computes, from its row and its config: mha's settings (the
keywords of :class:`mha.LayerSpec` or :class:`mha.LatentSpec`) and the tensors they call
for (:class:`~.layouts.Tensor`, by transformers' names under the layer's attention).

Nothing here names a family: each difference between families is a field of the row."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import AttentionValueError
from .blocksparse import indexer_tensors
from .config import SLIDING, Settings
from .family import Family
from .layouts import LatentProjections, Projections, Tensor
from .rope import (
    check_refused,
    layer_theta,
    partial_rotary,
    rope_parameters,
    rope_scaling,
    rotary_dim,
    yarn_mscale,
)

__all__ = ["completed", "describe", "latent", "multi_head", "rotary"]

Described = tuple[str, dict[str, Any], dict[str, Tensor]]
"""A layer's kind (``"attention"`` or ``"latent"``), settings and tensors."""


def describe(family: Family, read: Settings, index: int) -> Described:
    """Layer ``index``'s kind, settings and tensors, as the row's layout says."""
    layout = family.tensors
    if isinstance(layout, LatentProjections):
        return latent(family, layout, read, index)
    return multi_head(family, layout, read, index)


def multi_head(family: Family, layout: Projections, read: Settings, index: int) -> Described:
    """The settings and tensors of layer ``index`` of a multi-head attention."""
    E = read.positive("hidden_size")
    H, H_kv, d = heads = family.heads_of(read)
    if family.heads_by_layer is not None:
        H, H_kv, d = heads = (_layer_heads(family.heads_by_layer, read, index, H), H_kv, d)
    layer_type = family.windows.layer_type(read, index)
    if family.values is not None:  # Gemma 4's heads of each layer (by its type)
        H, H_kv, d = heads = family.values.layer_heads(read, index, layer_type, heads)
    own = family.sliding if layer_type == SLIDING else None
    if own is not None:
        H, H_kv, d = heads = (H, H_kv * own.kv_heads, d)
    if not layout.grouped(heads):
        raise read.refuse(f"{H} heads of {d} features, which its {layout.qkv} cannot split")
    for option in family.refused():
        option.check(read)
    alibi = family.alibi.slopes(read, H, d) if family.alibi and family.alibi.on(read) else None
    window = family.windows.size(read) if layer_type == SLIDING else None
    norm = family.qk_norm if family.qk_norm and family.qk_norm.applies(read) else None
    settings: dict[str, Any] = {
        "num_heads": H,
        "num_kv_heads": H_kv,
        "head_dim": d,
        **rotary(family, read, index, layer_type, d, alibi is not None),
        "window": None if window is None else int(window),
        "chunk": None,
        "softcap": read.get(family.softcap) if family.softcap else None,
        "scale": _scale(family, read, index, d),
        "qk_norm": norm.over if norm else None,
        "qk_norm_eps": float(read.get(norm.eps)) if norm else None,
        "qk_norm_offset": norm.offset if norm else None,
        "clip_qkv": family.clip_qkv.bound(read) if family.clip_qkv else None,
        "qk_layernorm": bool(norm and norm.layer),
        "qk_norm_after_rope": bool(norm and norm.after_rope),
        **(family.gate.settings(read) if family.gate else {}),
        **(family.output_norm.settings(read) if family.output_norm else {}),
    }
    if family.by_layer is not None:
        settings |= family.by_layer(read, index, settings)
    d_v = read.positive(family.value_width.width) if family.value_width else None
    if d_v is not None:
        settings["v_head_dim"] = d_v
    if alibi is not None:  # the rope is then off
        settings["alibi"] = alibi
    if family.values is not None:  # Gemma 3n's and Gemma 4's v_norm and KV sharing
        count = read.positive("num_hidden_layers")
        types = [family.windows.layer_type(read, j) for j in range(count)]
        settings |= family.values.settings(read, family.values.source(read, index, types))
    scaled = (settings["rope_scaling"] or {}).get("rope_type")
    if norm and not norm.weighted and scaled in ("yarn", "longrope"):
        raise read.refuse(
            f"rope_type {scaled!r}, whose attention factor scales the rotated queries and keys "
            f"before {read.family}'s QK-norm divides it out (mha normalises before the rotation)"
        )
    biased = family.biases.carried(read, "qkvo", index)
    stored_norm = settings["qk_norm"] if norm and norm.weighted else None
    norm_biases = bool(norm and norm.bias)
    sinks = family.sinks or bool(own and own.sinks)
    tensors = layout.tensors(E, heads, biased, stored_norm, sinks, norm_biases, d_v)
    if family.gate is not None:
        tensors |= family.gate.tensors(read, E, H, d)
    if family.output_norm is not None:
        tensors |= family.output_norm.tensors(H * (d_v or d))
    if family.own_weights is not None:
        tensors |= family.own_weights.tensors(read, settings)
    if family.values is not None and family.values.keys_are_values(read, layer_type):
        tensors = {name: t for name, t in tensors.items() if not name.startswith("v_proj.")}
    if family.differential is not None:
        settings |= family.differential.settings(read, index, heads)
        return "differential", settings, tensors | family.differential.tensors(d)
    if settings.get("block_indexer") is not None:  # block-sparse attention (blocksparse.py)
        return "block_sparse", settings, tensors | indexer_tensors(settings["block_indexer"], E)
    if family.dynamic_mask is not None:  # Doge's: a bias of each key from the values
        settings |= family.dynamic_mask.settings(read)
        return "dynamic_mask", settings, tensors | family.dynamic_mask.tensors(read, H_kv, d)
    return layout.kind, settings, tensors


def completed(
    family: Family, settings: dict[str, Any], weights: dict[str, np.ndarray], read: Settings
) -> dict[str, np.ndarray]:
    """The layer's ``weights`` with what its family computes without tensors of its own:
    QK-norm weights of ones for a norm without weights, the latent norms' weights times
    LongCat-Flash's scales (:attr:`.LatentProjections.lora_scaled`), a gate's bias of one
    value a head over the head's features (:attr:`.Gate.head_bias`), and each head's halves
    swapped in the query and key projections for a rotation by the negated angles
    (:attr:`.Rope.negated`), the values' projection times their scale
    (:attr:`.Family.value_width`), and each query head's two value heads joined
    (:attr:`.Family.differential`)."""
    if family.differential is not None:  # each query head's two value heads, joined
        columns = family.differential.columns(settings["num_kv_heads"], settings["head_dim"])
        weights |= {name: weights[name][..., columns] for name in ("W_v", "b_v") if name in weights}
    s = family.value_width.factor(read) if family.value_width else 1.0
    for name in ("W_v", "b_v") if s != 1.0 else ():
        if weights.get(name) is not None:
            x = weights[name]
            weights[name] = (x.astype(np.float64) * s).astype(x.dtype)
    if settings.get("qk_norm") and not (family.qk_norm and family.qk_norm.weighted):
        d = settings["head_dim"]
        widths = {"q": d, "k": d}
        if settings["qk_norm"] == "all":
            widths = {"q": settings["num_heads"] * d, "k": settings["num_kv_heads"] * d}
        dtype = weights["W_q"].dtype
        weights |= {f"{p}_norm": np.ones(width, dtype) for p, width in widths.items()}
    gate = family.gate
    if gate is not None and gate.head_bias and not settings["output_gate_per_head"]:
        weights["b_g"] = np.repeat(weights["b_g"], settings["head_dim"])  # Beam's gate_bias
    if family.values is not None and "W_v" not in weights:  # Gemma 4's values: the keys'
        weights["W_v"] = weights["W_k"].copy()
        if weights.get("b_k") is not None:
            weights["b_v"] = weights["b_k"].copy()
    if isinstance(family.tensors, LatentProjections) and family.tensors.lora_scaled:
        E = settings["d_model"]
        weights["q_a_norm"] = weights["q_a_norm"] * (E / settings["q_lora_rank"]) ** 0.5
        weights["kv_a_norm"] = weights["kv_a_norm"] * (E / settings["kv_lora_rank"]) ** 0.5
    if family.rope.negated and settings.get("rope_theta") is not None:
        half = settings["head_dim"] // 2
        for name in ("W_q", "W_k", "b_q", "b_k"):
            if weights.get(name) is not None:
                x = weights[name]
                heads = x.reshape(*x.shape[:-1], -1, 2, half)
                weights[name] = heads[..., ::-1, :].reshape(x.shape)
    if family.own_weights is not None:  # Dory's scales, folded into the weights
        weights = family.own_weights.folded(read, settings, weights)
    return weights


def _layer_heads(key: str, read: Settings, index: int, H: int) -> int:
    """Layer ``index``'s query heads from the config key ``key``'s list (``H``: none)."""
    counts = read.get(key)
    if counts is None:
        return H
    count = counts[index] if isinstance(counts, list) and index < len(counts) else None
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise AttentionValueError(
            f"{read.path}: config.json has {read.name(key)}={counts!r}; a list of a positive "
            f"number of heads for each of its layers is needed (layer {index})"
        )
    return count


def rotary(
    family: Family, read: Settings, index: int, layer_type: str, d: int, alibi: bool = False
) -> dict[str, Any]:
    """The rotary settings of layer ``index`` (of type ``layer_type``, heads ``d`` wide): its
    base, rotated width, pairs and scaling, or none of them on a layer without positions (or
    with ``alibi``'s, or in a family whose attention rotates nothing)."""
    per_layer = family.rope.per_layer_theta
    theta = layer_theta(read, per_layer, index) if per_layer else None
    rotates = family.rope.applied and family.rope.rotates(read, index, layer_type)
    if alibi or not rotates or theta == 0.0:
        return {
            "rope_theta": None,
            "rotary_dim": None,
            "rotary_interleaved": False,
            "rope_scaling": None,
        }
    rope = rope_parameters(read, family.rope, layer_type)
    if theta is not None:
        rope["rope_theta"] = theta
    if family.rope.text_mrope:  # text positions: the same on every axis of the sections
        rope = {key: value for key, value in rope.items() if not key.startswith("mrope_")}
    if rope.get("mrope_section") is not None:
        raise read.refuse(f"a multimodal rope (mrope_section={rope['mrope_section']})")
    rope = check_refused(read, family.rope, rope)
    if family.rope.dim_key is not None:
        rotated = rotary_dim(read, family.rope.dim_key, d)
    else:
        rotated = partial_rotary(read, family.rope, rope, d)
    return {
        "rope_theta": float(rope["rope_theta"]),
        "rotary_dim": rotated,
        "rotary_interleaved": family.rope.interleaved(read),
        "rope_scaling": rope_scaling(read, rope),
    }


def _scale(family: Family, read: Settings, index: int, d: int) -> float | None:
    """The softmax scale of layer ``index`` (``None``: ``1/sqrt(d)``)."""
    scale = family.scale(read) if family.scale else None
    if family.scale_by_layer and read.get(family.scale_by_layer):
        return (d**-0.5 if scale is None else scale) / float(index + 1)
    return scale


def latent(family: Family, layout: LatentProjections, read: Settings, index: int) -> Described:
    """The settings and tensors of DeepSeek's multi-head latent attention."""
    read = layout.layer(read, index)
    E, H = read.positive("hidden_size"), read.positive("num_attention_heads")
    q_rank = read.positive("q_lora_rank", optional=True)
    rank, nope, rope_dim = (
        read.positive(key) for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
    )
    # a null v_head_dim is the hidden size's share of a head (MiniCPM3's config class)
    v = read.positive("v_head_dim", optional=True) or E // H
    kv_heads = read.given("num_key_value_heads")
    if kv_heads not in (None, H):  # transformers' latent attention expands a key per head
        raise read.refuse(f"num_key_value_heads={kv_heads} != num_attention_heads={H}")
    rope: dict[str, Any] = {"rope_theta": 10000.0, "rope_type": "default"}  # none: no rotation
    if family.rope.applied:
        rope = check_refused(read, family.rope, rope_parameters(read, family.rope, None))
    factor = rope.get("partial_rotary_factor")
    mla_share = factor is not None and int((nope + rope_dim) * factor) == rope_dim  # Mistral 4
    if not mla_share and partial_rotary(read, family.rope, rope, rope_dim) is not None:
        raise read.refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if mla_share:  # the rotated share is qk_rope_head_dim itself
        rope = {key: value for key, value in rope.items() if key != "partial_rotary_factor"}
    scale = (nope + rope_dim) ** (-0.5)  # DeepseekV3Attention's, with yarn_apply_mscale
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim", 0):
        mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * mscale * mscale
    settings: dict[str, Any] = {
        "d_model": E,
        "num_heads": H,
        "q_lora_rank": q_rank,
        "kv_lora_rank": rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v,
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": rope_scaling(read, rope),
        "rotary_interleaved": family.rope.interleaved(read),
        "norm_eps": 1e-6,  # q_a_ and kv_a_layernorm: RMSNorm's default, not rms_norm_eps
        "scale": scale,
    }
    if not family.rope.applied:  # Kimi-Linear's: the rope features unrotated (NoPE)
        settings |= {"rotate": False, "rotary_interleaved": False, "rope_scaling": None}
    if layout.query_gate and q_rank is not None:  # A.X-K2's query and gate, fused
        settings |= {"query_gate": True, "output_gate": "sigmoid"}
    settings |= layout.settings(read, index)
    indexer = layout.indexer(read, index)
    if indexer is not None:  # sparse top-k attention
        settings["indexer"] = indexer
    chooser = layout.choice_from(read, index)
    if chooser is not None:  # another layer's choice of keys
        settings["shares_choice_with"] = chooser
    biased = family.biases.carried(read, layout.biasable(settings))
    tensors = layout.tensors(settings, biased)
    if family.gate is not None:  # a gate per head (Bailing-hybrid's) or feature (HY-V4's)
        settings["output_gate"] = family.gate.activation
        settings["output_gate_per_head"] = family.gate.is_per_head(read)
        tensors |= family.gate.tensors(read, E, H, v)
    if family.by_layer is not None:  # a query temperature (Mistral 4's)
        settings |= family.by_layer(read, index, settings)
    return layout.kind, settings, tensors
