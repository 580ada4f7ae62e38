"""The table: one row (:class:`~.family.Family`) per ``model_type`` mha reads, as vLLM's
model registry maps an architecture to the class that runs it. A family that differs from
another by names and defaults is one more row; one that computes something new is one small
function (a window rule, a scale) and a row that names it. Rows registered later
(:func:`register`) are read the same way.

>>> SUPPORTED[:4]
('llama', 'mistral', 'qwen2', 'qwen3')
>>> FAMILIES["phi3"].tensors.qkv, FAMILIES["phi3"].rope.aliases["su"]
('qkv_proj', 'longrope')
>>> FAMILIES["bloom"].tensors.path, FAMILIES["bloom"].tensors.fusion
('transformer.h.{i}.self_attention', 'per_kv_head')
"""

from __future__ import annotations

from typing import Any

from ...errors import AttentionValueError
from . import alibi, defaults, layouts
from .alibi import Alibi
from .config import FULL, SLIDING, Settings, Unsupported
from .family import (
    ACROSS_HEADS,
    BIDIRECTIONAL,
    PER_HEAD,
    Family,
    QkNorm,
    falcon_heads,
    multi_query,
    query_pre_attn_scalar,
    split_hidden,
    unscaled,
)
from .layouts import FUSED_QKV, LATENT, NO_BIASES, QKV_BIASES, Biases
from .rope import Rope
from .windows import (
    CWM_WINDOWS,
    EVERY_LAYER,
    GPT_NEO_WINDOWS,
    MODERNBERT_WINDOWS,
    QWEN_WINDOWS,
    SLIDING_IF_WINDOWED,
    by_layer_types,
)

__all__ = ["FAMILIES", "REFUSED", "SUPPORTED", "family_of", "register"]

FAMILIES: dict[str, Family] = {}
"""The families read, by ``model_type``."""

_GPT2_KEYS = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
              "num_hidden_layers": "n_layer", "max_position_embeddings": "n_positions"}  # fmt: skip
_GPT_NEO_KEYS = {"num_attention_heads": "num_heads", "num_hidden_layers": "num_layers",
                 "layer_types": "attention_layers"}  # fmt: skip
_NEOX_ROPE_KEYS = {"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"}
_MPT_KEYS = {"num_attention_heads": "n_heads", "hidden_size": "d_model",
             "num_hidden_layers": "n_layers"}  # fmt: skip
_XGLM_KEYS = {"num_attention_heads": "attention_heads", "hidden_size": "d_model",
              "num_hidden_layers": "num_layers"}  # fmt: skip
ALWAYS = Biases()
"""Every projection biased (GPT-2's ``Conv1D``, BLOOM's, BioGPT's)."""
NO_ROPE = Rope(applied=False)
MPT_UNSUPPORTED = (
    Unsupported("attn_config.clip_qkv", "queries, keys and values clamped"),
    # transformers' MPT builds its ALiBi without them: slopes of alibi_bias_max=8, always
    Unsupported(
        "attn_config.alibi_bias_max",
        "ALiBi slopes of another alibi_bias_max, which transformers' MPT ignores (it takes 8)",
        lambda value: value != 8,
    ),
    Unsupported(
        "attn_config.alibi",
        "no ALiBi, which transformers' MPT applies all the same",
        lambda value: not value,
    ),
)
_ROTARY_DIM = Rope(interleave=True, dim_key="rotary_dim")


def softmax_scale(read: Settings) -> float | None:
    """MPT's ``attn_config.softmax_scale`` (``None``: ``1/sqrt(head_dim)``)."""
    scale = read.get("attn_config.softmax_scale")
    return None if scale is None else float(scale)


def scale_attn_weights(read: Settings) -> float | None:
    """GPT-2's: ``1/sqrt(head_dim)``, or 1 without ``scale_attn_weights``."""
    return None if read.get("scale_attn_weights") else 1.0


def register(*families: Family) -> None:
    """Adds rows to the table (a later row of the same ``model_type`` replaces the first)."""
    FAMILIES.update((family.name, family) for family in families)


register(
    Family("llama", defaults.LLAMA),
    Family("mistral", defaults.MISTRAL, biases=NO_BIASES, windows=EVERY_LAYER),
    Family("qwen2", defaults.QWEN2, biases=QKV_BIASES, windows=QWEN_WINDOWS),
    Family("qwen3", defaults.QWEN3, windows=QWEN_WINDOWS, qk_norm=PER_HEAD),
    Family(
        "gemma2",
        defaults.GEMMA2,
        windows=by_layer_types(pattern=2),
        scale=query_pre_attn_scalar,
        softcap="attn_logit_softcapping",
        unsupported=(BIDIRECTIONAL,),
    ),
    Family(
        "gemma3_text",
        defaults.GEMMA3_TEXT,
        windows=by_layer_types(pattern=6),
        rope=Rope(
            per_layer_type={FULL: ("rope_theta", 1e6), SLIDING: ("rope_local_base_freq", 1e4)}
        ),
        scale=query_pre_attn_scalar,
        qk_norm=QkNorm("head", offset=1.0),
        unsupported=(BIDIRECTIONAL,),
    ),
    Family("olmo2", defaults.OLMO2, qk_norm=ACROSS_HEADS),
    Family(
        "phi3",
        defaults.PHI3,
        tensors=FUSED_QKV,
        biases=NO_BIASES,
        windows=EVERY_LAYER,
        rope=Rope(partial=True, fraction=1.0, aliases={"su": "longrope", "yarn": "longrope"}),
    ),
    Family(
        "gpt_oss",
        defaults.GPT_OSS,
        windows=by_layer_types(pattern=2),
        rope=Rope(theta=150_000.0, parameters=defaults.GPT_OSS_ROPE),
        sinks=True,
    ),
    # DeepSeek V2 rotates (2i, 2i + 1) pairs as complex numbers; V3 as rope_interleave says
    Family("deepseek_v2", defaults.DEEPSEEK_V2, tensors=LATENT, rope=Rope(interleave=True)),
    Family(
        "deepseek_v3", defaults.DEEPSEEK_V3, tensors=LATENT, rope=Rope(interleave="rope_interleave")
    ),
    # Mistral's attention under other names: by layer_types, or a window that may be null
    Family("ministral", defaults.MINISTRAL, biases=NO_BIASES, windows=SLIDING_IF_WINDOWED),
    Family(
        "mixtral", defaults.MIXTRAL, biases=NO_BIASES, windows=EVERY_LAYER, rope=Rope(theta=1e6)
    ),
    Family("arcee", defaults.ARCEE),  # Llama's attention (its MLP differs)
    # Older layouts: fused or renamed projections, no rope (positions outside the attention,
    # or ALiBi), the heads the hidden size's share
    Family(
        "gpt2",
        defaults.GPT2,
        keys=_GPT2_KEYS,
        tensors=layouts.GPT2_LAYOUT,
        heads=split_hidden,
        biases=ALWAYS,
        rope=NO_ROPE,
        scale=scale_attn_weights,
        scale_by_layer="scale_attn_by_inverse_layer_idx",
    ),
    Family(
        "gpt_bigcode",
        defaults.GPT_BIGCODE,
        keys=_GPT2_KEYS,
        tensors=layouts.BIGCODE,
        heads=multi_query,
        biases=ALWAYS,
        rope=NO_ROPE,
        scale=scale_attn_weights,
    ),
    Family(
        "gpt_neox",
        defaults.GPT_NEOX,
        keys=_NEOX_ROPE_KEYS,
        tensors=layouts.GPT_NEOX,
        heads=split_hidden,
        rope=Rope(partial=True, fraction=0.25),
    ),
    Family(
        "gpt_neox_japanese",
        defaults.GPT_NEOX_JAPANESE,
        keys=_NEOX_ROPE_KEYS,
        tensors=layouts.GPT_NEOX_JAPANESE,
        heads=split_hidden,
        biases=Biases(roles=("o",), last=("o",)),
        rope=Rope(partial=True, fraction=1.0),
    ),
    # GPT-J and CodeGen rotate (2i, 2i + 1) pairs of the first rotary_dim features
    Family(
        "gptj",
        defaults.GPTJ,
        keys=_GPT2_KEYS,
        tensors=layouts.GPTJ,
        heads=split_hidden,
        biases=NO_BIASES,
        rope=_ROTARY_DIM,
    ),
    Family(
        "codegen",
        defaults.CODEGEN,
        keys=_GPT2_KEYS,
        tensors=layouts.CODEGEN,
        heads=split_hidden,
        biases=NO_BIASES,
        rope=_ROTARY_DIM,
    ),
    Family(
        "gpt_neo",
        defaults.GPT_NEO,
        keys=_GPT_NEO_KEYS,
        tensors=layouts.GPT_NEO,
        heads=split_hidden,
        biases=Biases(roles=("o",)),
        windows=GPT_NEO_WINDOWS,
        rope=NO_ROPE,
        scale=unscaled,
    ),
    Family(
        "bloom",
        defaults.BLOOM,
        keys={"num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
        tensors=layouts.BLOOM,
        heads=split_hidden,
        biases=ALWAYS,
        rope=NO_ROPE,
        alibi=Alibi(alibi.bloom),
    ),
    Family(
        "mpt",
        defaults.MPT,
        keys=_MPT_KEYS,
        tensors=layouts.MPT,
        heads=split_hidden,
        biases=NO_BIASES,
        rope=NO_ROPE,
        scale=softmax_scale,
        alibi=Alibi(alibi.bloom),
        unsupported=MPT_UNSUPPORTED,
    ),
    Family(
        "falcon",
        defaults.FALCON,
        keys={"num_key_value_heads": "num_kv_heads"},
        tensors=layouts.FALCON,
        heads=falcon_heads,
        biases=Biases("bias"),
        alibi=Alibi(alibi.falcon, key="alibi"),
    ),
    Family(
        "opt",
        defaults.OPT,
        tensors=layouts.OPT,
        heads=split_hidden,
        biases=Biases("enable_bias"),
        rope=NO_ROPE,
    ),
    Family(
        "biogpt",
        defaults.BIOGPT,
        tensors=layouts.BIOGPT,
        heads=split_hidden,
        biases=ALWAYS,
        rope=NO_ROPE,
    ),
    Family(
        "xglm",
        defaults.XGLM,
        keys=_XGLM_KEYS,
        tensors=layouts.XGLM,
        heads=split_hidden,
        biases=ALWAYS,
        rope=NO_ROPE,
    ),
    Family(
        "openai-gpt",
        defaults.OPENAI_GPT,
        keys=_GPT2_KEYS,
        tensors=layouts.GPT2_LAYOUT,
        heads=split_hidden,
        biases=ALWAYS,
        rope=NO_ROPE,
    ),
    Family(
        "ctrl",
        defaults.CTRL,
        keys=_GPT2_KEYS,
        tensors=layouts.CTRL,
        heads=split_hidden,
        biases=ALWAYS,
        rope=NO_ROPE,
    ),
    # Llama's attention under EXAONE 3's names; CWM's, with sliding layers
    Family(
        "exaone",
        defaults.EXAONE,
        keys={"num_hidden_layers": "num_layers"},
        tensors=layouts.EXAONE,
        rope=Rope(theta=500_000.0),
    ),
    Family(
        "cwm",
        defaults.CWM,
        biases=NO_BIASES,
        windows=CWM_WINDOWS,
        rope=Rope(theta=1e6, parameters=defaults.CWM_ROPE),
    ),
    Family(
        "modernbert-decoder",
        defaults.MODERNBERT_DECODER,
        tensors=layouts.MODERNBERT_DECODER,
        heads=split_hidden,
        windows=MODERNBERT_WINDOWS,
        rope=Rope(
            per_layer_type={
                FULL: ("global_rope_theta", 160_000.0),
                SLIDING: ("local_rope_theta", 10_000.0),
            }
        ),
    ),
)

SUPPORTED = tuple(FAMILIES)
"""The families of the table as mha defines it (before any :func:`register`)."""

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


def family_of(config: dict[str, Any], path: Any) -> Family:
    """The row of ``config``'s ``model_type``, or a refusal that names it and the reason."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None:
        return family
    reason = "config.json names no model_type"
    if isinstance(model_type, str):
        reason = REFUSED.get(model_type, "it is not supported")
    raise AttentionValueError(
        f"{path}: model_type {model_type!r}: {reason}; the model types mha reads are "
        f"{', '.join(FAMILIES)}"
    )
