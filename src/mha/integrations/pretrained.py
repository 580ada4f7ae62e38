"""What one layer of a transformers checkpoint computes in its attention: mha's settings and
weights, read from ``config.json`` as transformers 5.24 reads it and from that layer's tensors.

:func:`layer_attention` answers ``(kind, settings, weights)``. ``kind`` is ``"attention"``
(the keywords of :class:`mha.MultiHeadAttention`) for every family but DeepSeek's multi-head
latent attention, ``"latent"`` (those of :class:`mha.LatentAttention`). The weights are in
mha's "x @ W" layout, the transposes of ``nn.Linear``'s ``(out, in)``.

Each family's config class fills in what ``config.json`` leaves out, and decides per layer:

* the sliding window: every layer (Mistral, Phi-3), none (Llama, OLMo 2), or by
  ``layer_types`` (Gemma 2, Gemma 3, gpt-oss, Qwen2 and Qwen3; their defaults: every other
  layer from the first for Gemma 2 and gpt-oss, five in six for Gemma 3, and for Qwen the
  layers from ``max_window_layers`` on, when ``use_sliding_window`` is set; without it
  Qwen's ``sliding_window`` is dropped whatever ``layer_types`` says);
* the rotary base and scaling: ``rope_parameters``, or the older ``rope_theta`` and
  ``rope_scaling``; Gemma 3 has one per layer type (``rope_local_base_freq`` for the sliding
  layers in old configs); Phi-3's ``original_max_position_embeddings`` overrides the one in
  its ``rope_parameters``;
* the softmax scale (``query_pre_attn_scalar ** -0.5`` for Gemma, DeepSeek's yarn ``mscale``
  correction), soft-capping (Gemma 2 only: Gemma 3 keeps ``attn_logit_softcapping`` in its
  config but its attention never applies it), QK-norm per head (Qwen3, Gemma 3 with
  ``1 + weight``) or across heads (OLMo 2).

Whatever mha would compute differently is refused by name: an unknown ``model_type``, an
option these readers do not map, a layer's weight that is missing, misshapen or unknown.
(``pretraining_tp``, which no family's attention reads in transformers 5.24, is ignored; an
older checkpoint's ``rotary_emb.inv_freq`` buffer is not read: the config gives it.)

>>> from mha.integrations.pretrained import SUPPORTED
>>> SUPPORTED[:4]
('llama', 'mistral', 'qwen2', 'qwen3')
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api.configuration import LayerSpec
from ..api.latent import LatentSpec
from ..api.rope_scaling import check_rope_scaling
from ..errors import AttentionTypeError, AttentionValueError, WeightsFileError
from .checkpoint import Checkpoint, tensor_prefixes

__all__ = ["FAMILIES", "SUPPORTED", "layer_attention", "read_layer"]

SLIDING, FULL = "sliding_attention", "full_attention"
_OMPE = "original_max_position_embeddings"


@dataclass(frozen=True)
class Family:
    """How one ``model_type``'s attention reads its config (transformers 5.24)."""

    name: str
    defaults: dict[str, Any]
    """The config class's defaults of the keys read here (``config.json`` may omit them)."""
    windows: str = "none"  # "none", "every" layer, by "layer_types", or "qwen"'s rule
    pattern: int = 0  # the default layer_types: sliding unless (i + 1) % pattern == 0
    biases: str = "attention_bias"  # or "qkv": q, k and v always (Qwen2), or "none"
    qk_norm: str | None = None
    norm_offset: float = 0.0
    gemma: bool = False  # query_pre_attn_scalar, bidirectional option
    softcap: bool = False
    partial_rotary: bool = False
    fused_qkv: bool = False
    sinks: bool = False
    latent: bool = False
    default_theta: float = 10000.0
    default_rope: dict[str, Any] = field(default_factory=dict)


_SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}

FAMILIES = {family.name: family for family in (
    Family("llama", {**_SHAPE, "num_key_value_heads": None, "head_dim": None,
                     "attention_bias": False, "max_position_embeddings": 2048}),
    Family("mistral", {**_SHAPE, "num_key_value_heads": 8, "head_dim": None,
                       "sliding_window": 4096, "max_position_embeddings": 131072},
           windows="every", biases="none"),
    Family("qwen2", {**_SHAPE, "num_key_value_heads": 32, "use_sliding_window": False,
                     "sliding_window": 4096, "max_window_layers": 28,
                     "max_position_embeddings": 32768}, windows="qwen", biases="qkv"),
    Family("qwen3", {**_SHAPE, "num_key_value_heads": 32, "head_dim": 128,
                     "attention_bias": False, "use_sliding_window": False,
                     "sliding_window": 4096, "max_window_layers": 28, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 32768}, windows="qwen", qk_norm="head"),
    Family("gemma2", {"hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
                      "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False,
                      "query_pre_attn_scalar": 256, "sliding_window": 4096,
                      "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None,
                      "max_position_embeddings": 8192},
           windows="layer_types", pattern=2, gemma=True, softcap=True),
    Family("gemma3_text", {"hidden_size": 2304, "num_hidden_layers": 26,
                           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                           "attention_bias": False, "query_pre_attn_scalar": 256,
                           "sliding_window": 4096, "use_bidirectional_attention": False,
                           "rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
           windows="layer_types", pattern=6, qk_norm="head", norm_offset=1.0, gemma=True),
    Family("olmo2", {**_SHAPE, "num_key_value_heads": None, "attention_bias": False,
                     "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}, qk_norm="all"),
    Family("phi3", {"hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": None, "sliding_window": None,
                    "max_position_embeddings": 4096, _OMPE: 4096},
           windows="every", biases="none", partial_rotary=True, fused_qkv=True),
    Family("gpt_oss", {"hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                       "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
                       "sliding_window": 128, "max_position_embeddings": 131072},
           windows="layer_types", pattern=2, sinks=True, default_theta=150000.0,
           default_rope={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, _OMPE: 4096}),
    Family("deepseek_v2", {**_SHAPE, "attention_bias": False, "q_lora_rank": 1536,
                           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                           "v_head_dim": 128, "max_position_embeddings": 2048}, latent=True),
    Family("deepseek_v3", {"hidden_size": 7168, "num_hidden_layers": 61,
                           "num_attention_heads": 128, "attention_bias": False,
                           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                           "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
                           "max_position_embeddings": 4096}, latent=True),
)}  # fmt: skip
"""The families read, by ``model_type``, with their config classes' defaults."""

SUPPORTED = tuple(FAMILIES)

REFUSED = {
    "llama4": "Llama 4's attention (chunked layers, layers without rope, L2 QK-norm, "
    "temperature tuning) is not supported",
    "llama4_text": "Llama 4's attention (chunked layers, layers without rope, L2 QK-norm, "
    "temperature tuning) is not supported",
    "gemma3": "this is the multimodal Gemma 3; mha reads the text model's checkpoints "
    "(Gemma3ForCausalLM, model_type gemma3_text)",
    "qwen2_vl": "Qwen2-VL's multimodal rope (mrope) is not supported",
    "qwen2_5_vl": "Qwen2.5-VL's multimodal rope (mrope) is not supported",
}
"""Families refused with a reason beyond "not supported"."""

_LEGACY_LAYER_TYPES = {"attention": FULL}  # transformers' remap_legacy_layer_types
_IGNORED = ("rotary_emb.inv_freq",)  # older checkpoints' buffer, recomputed from the config


def read_layer(
    path: Any, layer: Any, dtype: Any = None
) -> tuple[LayerSpec | LatentSpec, dict[str, np.ndarray]]:
    """Layer ``layer``'s attention of the transformers checkpoint at ``path`` as the pair
    ``(spec, weights)`` that :meth:`mha.MultiHeadAttention.from_spec` (a
    :class:`~mha.LayerSpec`) or :meth:`mha.LatentAttention.from_spec` (a
    :class:`~mha.LatentSpec`) builds the layer from."""
    kind, settings, weights = layer_attention(Checkpoint(path), layer, dtype)
    spec = LatentSpec(**settings) if kind == "latent" else LayerSpec(**settings)
    return spec, weights


def layer_attention(
    checkpoint: Checkpoint, layer: Any, dtype: Any = None
) -> tuple[str, dict[str, Any], dict[str, np.ndarray]]:
    """What layer ``layer`` of ``checkpoint`` computes in its attention, as ``(kind,
    settings, weights)``, reading that layer's attention tensors and no others (cast to
    ``dtype`` when given). ``kind`` is ``"attention"`` or ``"latent"`` (DeepSeek's MLA); see
    the module's docstring for the settings each family sets."""
    config = checkpoint.config
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        reason = "config.json names no model_type"
        if isinstance(model_type, str):
            reason = REFUSED.get(model_type, "it is not supported")
        raise AttentionValueError(
            f"{checkpoint.path}: model_type {model_type!r}: {reason}; the model types mha "
            f"reads are {', '.join(SUPPORTED)}"
        )
    read = Settings(checkpoint, family)
    count = read.positive("num_hidden_layers")
    index = _layer_index(layer, count, checkpoint)
    prefix = _attention_prefix(checkpoint, index)
    if family.latent:
        settings, shapes = _latent(read)
        kind = "latent"
    else:
        settings, shapes = _attention(read, index)
        kind = "attention"
    _check_rope(read, settings, index)
    names = {f"{prefix}{name}": name for name in shapes}
    _check_names(checkpoint, prefix, names, read)
    arrays = checkpoint.read(names, dtype=dtype)
    weights: dict[str, np.ndarray] = {}
    for key, name in names.items():
        array = arrays[key]
        if array.shape != shapes[name]:
            raise WeightsFileError(
                f"{checkpoint.path}: {key} has shape {array.shape}, but the config "
                f"({read.summary()}) calls for {shapes[name]}"
            )
        weights.update(_layout(name, array, settings, kind))
    return kind, settings, weights


class Settings:
    """A config's values as the family's config class reads them: ``config.json``'s, else
    the class's defaults."""

    def __init__(self, checkpoint: Checkpoint, family: Family) -> None:
        self.config, self.family, self.path = checkpoint.config, family, checkpoint.path
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        self.read.append(key)
        if key in self.config:
            return self.config[key]
        return self.family.defaults.get(key, default)

    def positive(self, key: str, optional: bool = False) -> Any:
        """A positive integer (or, when ``optional``, ``None``)."""
        value = self.get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            needed = "a positive integer or null" if optional else "a positive integer"
            raise AttentionValueError(
                f"{self.path}: config.json has {key}={value!r}; {needed} is needed"
            )
        return value

    def summary(self) -> str:
        keys = dict.fromkeys(key for key in self.read if key in self.config)
        return ", ".join(f"{key}={self.config[key]!r}" for key in keys)

    def refuse(self, what: str) -> AttentionValueError:
        return AttentionValueError(
            f"{self.path}: {self.family.name} with {what}: mha would compute something else, "
            "so it is refused"
        )


def _attention(read: Settings, index: int) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The settings and the tensor shapes of layer ``index`` of a multi-head attention."""
    family = read.family
    E, H = read.positive("hidden_size"), read.positive("num_attention_heads")
    H_kv = read.positive("num_key_value_heads", optional=True) or H
    d = read.positive("head_dim", optional=True) or E // H
    if family.gemma and read.get("use_bidirectional_attention"):
        raise read.refuse("use_bidirectional_attention=True (attention that is not causal)")
    if read.get("attention_chunk_size") is not None:
        raise read.refuse(f"attention_chunk_size={read.get('attention_chunk_size')}")
    if read.get("use_qk_norm"):
        raise read.refuse("use_qk_norm=True")
    layer_type = _layer_type(read, index)
    rope = _rope(read, layer_type)
    if rope.get("mrope_section") is not None:
        raise read.refuse(f"a multimodal rope (mrope_section={rope['mrope_section']})")
    factor = rope.get("partial_rotary_factor")
    rotary_dim = None
    if factor is not None and factor != 1.0:
        if not family.partial_rotary:
            raise read.refuse(
                f"partial_rotary_factor={factor}, which transformers' {family.name} attention "
                "ignores or cannot apply"
            )
        rotary_dim = int(d * factor)
        rotary_dim = None if rotary_dim == d else rotary_dim
    rope_type = rope.get("rope_type", "default")
    settings: dict[str, Any] = {
        "num_heads": H, "num_kv_heads": H_kv, "head_dim": d,
        "rope_theta": float(rope["rope_theta"]), "rotary_dim": rotary_dim,
        "rotary_interleaved": False,
        "rope_scaling": None if rope_type == "default" else {
            **rope, "max_position_embeddings": read.get("max_position_embeddings")},
        "window": _window(read, layer_type), "chunk": None,
        "softcap": read.get("attn_logit_softcapping") if family.softcap else None,
        "scale": float(read.get("query_pre_attn_scalar")) ** -0.5 if family.gemma else None,
        "qk_norm": family.qk_norm,
        "qk_norm_eps": float(read.get("rms_norm_eps")) if family.qk_norm else None,
        "qk_norm_offset": family.norm_offset if family.qk_norm else None,
    }  # fmt: skip
    q, kv = H * d, H_kv * d
    shapes: dict[str, tuple[int, ...]] = {"o_proj.weight": (E, q)}
    if family.fused_qkv:
        shapes["qkv_proj.weight"] = (q + 2 * kv, E)
    else:
        shapes |= {"q_proj.weight": (q, E), "k_proj.weight": (kv, E), "v_proj.weight": (kv, E)}
    biased = {"qkv": "qkv", "none": ""}.get(family.biases)
    if biased is None:  # attention_bias: all four or none
        biased = "qkvo" if read.get("attention_bias") else ""
    widths = {"q": q, "k": kv, "v": kv, "o": E}
    shapes |= {f"{name}_proj.bias": (widths[name],) for name in biased}
    if family.qk_norm:
        per_head = family.qk_norm == "head"
        shapes |= {"q_norm.weight": (d if per_head else q,),
                   "k_norm.weight": (d if per_head else kv,)}  # fmt: skip
    if family.sinks:
        shapes["sinks"] = (H,)
    return settings, shapes


def _latent(read: Settings) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The settings and tensor shapes of DeepSeek's multi-head latent attention."""
    E, H = read.positive("hidden_size"), read.positive("num_attention_heads")
    q_rank = read.positive("q_lora_rank", optional=True)
    rank, nope, rope_dim, v = (read.positive(key) for key in (
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))  # fmt: skip
    kv_heads = read.config.get("num_key_value_heads")
    if kv_heads not in (None, H):  # transformers' latent attention expands a key per head
        raise read.refuse(f"num_key_value_heads={kv_heads} != num_attention_heads={H}")
    rope = _rope(read, None)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise read.refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    rope_type = rope.get("rope_type", "default")
    scale = (nope + rope_dim) ** (-0.5)  # DeepseekV3Attention's, with yarn_apply_mscale
    if rope_type != "default" and rope.get("mscale_all_dim", 0):
        mscale = _yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * mscale * mscale
    settings: dict[str, Any] = {
        "d_model": E, "num_heads": H, "q_lora_rank": q_rank, "kv_lora_rank": rank,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope_dim, "v_head_dim": v,
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": None if rope_type == "default" else {
            **rope, "max_position_embeddings": read.get("max_position_embeddings")},
        # DeepSeek V2 rotates (2i, 2i + 1) pairs as complex numbers; V3 as rope_interleave says
        "rotary_interleaved": read.family.name == "deepseek_v2" or bool(
            read.get("rope_interleave", True)),
        "norm_eps": 1e-6,  # q_a_ and kv_a_layernorm: RMSNorm's default, not rms_norm_eps
        "scale": scale,
    }  # fmt: skip
    head = H * (nope + rope_dim)
    shapes: dict[str, tuple[int, ...]] = {
        "kv_a_proj_with_mqa.weight": (rank + rope_dim, E), "kv_a_layernorm.weight": (rank,),
        "kv_b_proj.weight": (H * (nope + v), rank), "o_proj.weight": (E, H * v),
    }  # fmt: skip
    if q_rank is None:
        shapes["q_proj.weight"] = (head, E)
    else:
        shapes |= {"q_a_proj.weight": (q_rank, E), "q_a_layernorm.weight": (q_rank,),
                   "q_b_proj.weight": (head, q_rank)}  # fmt: skip
    if read.get("attention_bias"):
        shapes |= {"kv_a_proj_with_mqa.bias": (rank + rope_dim,), "o_proj.bias": (E,)}
        if q_rank is not None:
            shapes["q_a_proj.bias"] = (q_rank,)
    return settings, shapes


def _check_rope(read: Settings, settings: dict[str, Any], index: int) -> None:
    """The layer's rope scaling checked as the layer will check it, with messages that name
    the checkpoint and the config key it came from."""
    scaling = settings.get("rope_scaling")
    if scaling is None:
        return
    rotated = settings.get("qk_rope_head_dim") or settings.get("rotary_dim") or settings["head_dim"]
    given = [key for key in ("rope_scaling", "rope_parameters") if read.config.get(key)]
    key = given[0] if given else f"rope_parameters (the {read.family.name} defaults)"
    check_rope_scaling(scaling, rotated, f"{read.path}: config.json's {key}, layer {index}")


def _yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's ``yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


_NAMES = {"q_proj.weight": "W_q", "k_proj.weight": "W_k", "v_proj.weight": "W_v",
          "o_proj.weight": "W_o", "q_proj.bias": "b_q", "k_proj.bias": "b_k",
          "v_proj.bias": "b_v", "o_proj.bias": "b_o", "q_norm.weight": "q_norm",
          "k_norm.weight": "k_norm", "sinks": "sinks", "q_a_proj.weight": "W_q_a",
          "q_a_proj.bias": "b_q_a", "q_a_layernorm.weight": "q_a_norm",
          "q_b_proj.weight": "W_q_b", "kv_a_proj_with_mqa.weight": "W_kv_a",
          "kv_a_proj_with_mqa.bias": "b_kv_a", "kv_a_layernorm.weight": "kv_a_norm",
          "kv_b_proj.weight": "W_kv_b"}  # fmt: skip
"""transformers' tensor names under a layer's attention, and mha's."""


def _layout(
    name: str, array: np.ndarray, settings: dict[str, Any], kind: str
) -> dict[str, np.ndarray]:
    """mha's weights from one tensor: matrices transposed to "x @ W", Phi-3's fused
    ``qkv_proj`` split into the three."""
    if name == "qkv_proj.weight":
        q = settings["num_heads"] * settings["head_dim"]
        kv = settings["num_kv_heads"] * settings["head_dim"]
        W = array.T
        return {"W_q": W[:, :q], "W_k": W[:, q : q + kv], "W_v": W[:, q + kv :]}
    return {_NAMES[name]: array.T if array.ndim == 2 else array}


def _layer_index(layer: Any, count: int, checkpoint: Checkpoint) -> int:
    if isinstance(layer, (bool, np.bool_)):
        raise AttentionTypeError(f"layer must be an integer; got {layer!r}")
    try:
        index = operator.index(layer)
    except TypeError:
        raise AttentionTypeError(
            f"layer must be an integer; got {layer!r} of type {type(layer).__name__}"
        ) from None
    if not 0 <= index < count:
        raise AttentionValueError(
            f"layer={index} is out of range: {checkpoint.path} has {count} layers, 0 to {count - 1}"
        )
    return index


def _attention_prefix(checkpoint: Checkpoint, index: int) -> str:
    """Where layer ``index``'s attention weights are: under ``model.`` for a causal LM's
    checkpoint, at the top for a bare model's."""
    candidates = (f"model.layers.{index}.self_attn.", f"layers.{index}.self_attn.")
    keys = list(checkpoint)
    for prefix in candidates:
        if any(key.startswith(prefix) for key in keys):
            return prefix
    raise WeightsFileError(
        f"{checkpoint.path} has no attention weights of layer {index} under "
        f"{' or '.join(candidates)}; it holds {len(keys)} tensors under {tensor_prefixes(keys)}"
    )


def _check_names(
    checkpoint: Checkpoint, prefix: str, names: dict[str, str], read: Settings
) -> None:
    """Every tensor under ``prefix`` is one the config calls for, and all of those are there."""
    present = {key for key in checkpoint if key.startswith(prefix)}
    unknown = sorted(key[len(prefix) :] for key in present - set(names)
                     if key[len(prefix) :] not in _IGNORED)  # fmt: skip
    if unknown:
        raise WeightsFileError(
            f"{checkpoint.path}: the attention at {prefix!r} has weights that "
            f"{read.family.name}'s attention with this config ({read.summary()}) does not "
            f"have: {', '.join(unknown)}; loading it without them would compute another model"
        )
    missing = sorted(name for key, name in names.items() if key not in present)
    if missing:
        raise WeightsFileError(
            f"{checkpoint.path}: the attention at {prefix!r} lacks {', '.join(missing)}, "
            f"which {read.family.name}'s attention with this config ({read.summary()}) has"
        )


def _layer_type(read: Settings, index: int) -> str:
    """Whether layer ``index`` slides, as the family's config class decides."""
    family = read.family
    if family.windows == "none":
        if read.get("sliding_window") is not None:
            raise read.refuse(
                f"sliding_window={read.get('sliding_window')}, which transformers' "
                f"{family.name} mask ignores while its DynamicCache keeps only that many "
                "positions"
            )
        return FULL
    if family.windows == "every":
        return SLIDING
    types = read.get("layer_types")
    count = read.positive("num_hidden_layers")
    if types is None:
        if family.windows == "qwen":
            start = read.get("max_window_layers")
            slides = _qwen_window(read) is not None
            types = [SLIDING if slides and i >= start else FULL for i in range(count)]
        else:
            pattern = read.get("sliding_window_pattern", family.pattern)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(count)]
    if not isinstance(types, list) or len(types) != count:
        raise AttentionValueError(
            f"{read.path}: config.json's layer_types must list one type for each of its "
            f"{count} layers; got {types!r}"
        )
    kind = _LEGACY_LAYER_TYPES.get(types[index], types[index])
    if kind not in (SLIDING, FULL):
        raise read.refuse(f"layer {index} of type {kind!r} (mha reads {SLIDING} and {FULL})")
    return str(kind)


def _window(read: Settings, layer_type: str) -> int | None:
    if layer_type != SLIDING:
        return None
    window = _qwen_window(read) if read.family.windows == "qwen" else read.get("sliding_window")
    return None if window is None else int(window)


def _qwen_window(read: Settings) -> Any:
    """Qwen2's and Qwen3's ``sliding_window``: dropped unless ``use_sliding_window``."""
    return read.get("sliding_window") if read.get("use_sliding_window") else None


def _rope(read: Settings, layer_type: str | None) -> dict[str, Any]:
    """The layer's rope parameters as transformers standardises them
    (``convert_rope_params_to_dict`` and ``standardize_rope_params``)."""
    config, family = read.config, read.family
    given = config.get("rope_scaling") or config.get("rope_parameters")
    parameters = copy.deepcopy(given) if given is not None else None
    if family.name == "gemma3_text":
        parameters = _gemma3_rope(read, parameters)
    if parameters is None:
        parameters = copy.deepcopy(family.default_rope)
    if not isinstance(parameters, dict):
        raise AttentionValueError(
            f"{read.path}: config.json's rope_parameters must be a JSON object; got {given!r}"
        )
    nested = layer_type is not None and isinstance(parameters.get(layer_type), dict)
    rope = parameters[layer_type] if nested else parameters
    rope.setdefault("rope_theta", config.get("rope_theta", family.default_theta))
    factor = config.get("partial_rotary_factor")
    if family.name == "phi3":
        factor = config.get("partial_rotary_factor", 1.0)
    if factor is not None:
        rope.setdefault("partial_rotary_factor", factor)
    theta = rope["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise AttentionValueError(
            f"{read.path}: config.json's rope_theta must be a positive number; got {theta!r}"
        )
    rope.setdefault("rope_type", rope.get("type", "default"))  # old configs' name
    if family.name == "phi3" and rope["rope_type"] in ("su", "yarn"):
        rope["rope_type"] = "longrope"  # Phi-3's old names
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        if not nested and (_OMPE in config or _OMPE in family.defaults):
            rope[_OMPE] = read.get(_OMPE)  # Phi-3's takes precedence over rope_parameters'
        else:
            rope.setdefault(_OMPE, read.get("max_position_embeddings"))
    return dict(rope)


def _gemma3_rope(read: Settings, parameters: Any) -> dict[str, Any]:
    """Gemma 3's rope: one set per layer type, the sliding layers' base ``10000`` (or the
    old ``rope_local_base_freq``), the full layers' ``1e6`` (or ``rope_theta``)."""
    config = read.config
    scaling = config.get("rope_scaling")
    if scaling is not None:  # old configs: rope_scaling is the full layers' scaling
        parameters = copy.deepcopy(config.get("rope_parameters"))
    if not isinstance(parameters, dict):
        parameters = {}
    nested = {SLIDING: parameters.get(SLIDING), FULL: parameters.get(FULL)}
    for kind, theta in ((FULL, config.get("rope_theta", 1_000_000.0)),
                        (SLIDING, config.get("rope_local_base_freq", 10_000.0))):  # fmt: skip
        entry = nested[kind] if isinstance(nested[kind], dict) else {"rope_type": "default"}
        if kind == FULL and scaling is not None:
            entry.update(scaling)
        entry.setdefault("rope_theta", theta)
        nested[kind] = entry
    return nested
