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

from . import (
    alibi,
    blocksparse,
    cpmant,
    defaults,
    dory,
    gated,
    gemma4,
    hyv4,
    latentgates,
    layouts,
    mimo,
    mistral4,
    nope,
    outnorm,
    recurrent,
    rules,
    sparse,
    temperature,
)
from .alibi import Alibi
from .config import FULL, SLIDING, Unsupported
from .family import (
    ACROSS_HEADS,
    BIDIRECTIONAL,
    CLIP_QKV,
    LAYERNORM_QK,
    PER_HEAD,
    ClipQkv,
    Family,
    Gate,
    QkNorm,
    attention_multiplier,
    falcon_heads,
    multi_query,
    query_pre_attn_scalar,
    split_hidden,
    unscaled,
)
from .hybrid import (
    CONV,
    LINEAR,
    MLP,
    MOE,
    Hybrid,
    alternating,
    by_indices,
    by_pattern,
    by_period,
    cycled,
    every_fourth,
    every_layer_of,
    from_layer_types,
    listed,
)
from .layouts import (
    ALL_BIASES,
    EXAONE,
    FUSED_QKV,
    LATENT,
    NO_BIASES,
    QKV_ATTENTION_BIAS,
    QKV_BIASES,
    QKV_BIASES_BY_KEY,
    Biases,
    BiasesByKey,
    Projections,
)
from .refused import REFUSED
from .rope import (
    Rope,
    by_layer_type_entries,
    by_no_rope_layers,
    sliding_layers,
    sliding_layers_if_windowed,
    sliding_or_dense_layers,
)
from .windows import (
    COHERE2_MOE_WINDOWS,
    CWM_WINDOWS,
    EVERY_LAYER,
    FLINT_WINDOWS,
    FULL_BY_DEFAULT,
    GPT_NEO_WINDOWS,
    MODERNBERT_WINDOWS,
    QWEN2_MOE_WINDOWS,
    QWEN_EVERY_LAYER,
    QWEN_WINDOWS,
    SLIDING_IF_WINDOWED,
    SMOLLM3_WINDOWS,
    WINDOWED_FROM,
    ByLayerTypes,
    by_layer_types,
)

__all__ = ["FAMILIES", "REFUSED", "SUPPORTED", "register"]

FAMILIES: dict[str, Family] = {}
"""The families read, by ``model_type``."""


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
        keys=rules.GPT2_KEYS,
        tensors=layouts.GPT2_LAYOUT,
        heads=split_hidden,
        biases=rules.ALWAYS,
        rope=rules.NO_ROPE,
        scale=rules.scale_attn_weights,
        scale_by_layer="scale_attn_by_inverse_layer_idx",
    ),
    Family(
        "gpt_bigcode",
        defaults.GPT_BIGCODE,
        keys=rules.GPT2_KEYS,
        tensors=layouts.BIGCODE,
        heads=multi_query,
        biases=rules.ALWAYS,
        rope=rules.NO_ROPE,
        scale=rules.scale_attn_weights,
    ),
    Family(
        "gpt_neox",
        defaults.GPT_NEOX,
        keys=rules.NEOX_ROPE_KEYS,
        tensors=layouts.GPT_NEOX,
        heads=split_hidden,
        rope=Rope(partial=True, fraction=0.25),
    ),
    Family(
        "gpt_neox_japanese",
        defaults.GPT_NEOX_JAPANESE,
        keys=rules.NEOX_ROPE_KEYS,
        tensors=layouts.GPT_NEOX_JAPANESE,
        heads=split_hidden,
        biases=Biases(roles=("o",), last=("o",)),
        rope=Rope(partial=True, fraction=1.0),
    ),
    # GPT-J and CodeGen rotate (2i, 2i + 1) pairs of the first rotary_dim features
    Family(
        "gptj",
        defaults.GPTJ,
        keys=rules.GPT2_KEYS,
        tensors=layouts.GPTJ,
        heads=split_hidden,
        biases=NO_BIASES,
        rope=rules.ROTARY_DIM,
    ),
    Family(
        "codegen",
        defaults.CODEGEN,
        keys=rules.GPT2_KEYS,
        tensors=layouts.CODEGEN,
        heads=split_hidden,
        biases=NO_BIASES,
        rope=rules.ROTARY_DIM,
    ),
    Family(
        "gpt_neo",
        defaults.GPT_NEO,
        keys=rules.GPT_NEO_KEYS,
        tensors=layouts.GPT_NEO,
        heads=split_hidden,
        biases=Biases(roles=("o",)),
        windows=GPT_NEO_WINDOWS,
        rope=rules.NO_ROPE,
        scale=unscaled,
    ),
    Family(
        "bloom",
        defaults.BLOOM,
        keys={"num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
        tensors=layouts.BLOOM,
        heads=split_hidden,
        biases=rules.ALWAYS,
        rope=rules.NO_ROPE,
        alibi=Alibi(alibi.bloom),
    ),
    Family(
        "mpt",
        defaults.MPT,
        keys=rules.MPT_KEYS,
        tensors=layouts.MPT,
        heads=split_hidden,
        biases=NO_BIASES,
        rope=rules.NO_ROPE,
        scale=rules.softmax_scale,
        alibi=Alibi(alibi.bloom),
        clip_qkv=ClipQkv("attn_config.clip_qkv", zero_is_off=True),
        unsupported=rules.MPT_UNSUPPORTED,
    ),
    Family(  # one fused Wqkv, clamped to ±clip_qkv, then rotated as Llama's
        "dbrx",
        defaults.DBRX,
        keys=rules.DBRX_KEYS,
        tensors=layouts.DBRX,
        heads=rules.dbrx_heads,
        biases=NO_BIASES,
        clip_qkv=ClipQkv("attn_config.clip_qkv"),
        unsupported=(rules.DBRX_BASE,),
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
        rope=rules.NO_ROPE,
    ),
    Family(
        "biogpt",
        defaults.BIOGPT,
        tensors=layouts.BIOGPT,
        heads=split_hidden,
        biases=rules.ALWAYS,
        rope=rules.NO_ROPE,
    ),
    Family(
        "xglm",
        defaults.XGLM,
        keys=rules.XGLM_KEYS,
        tensors=layouts.XGLM,
        heads=split_hidden,
        biases=rules.ALWAYS,
        rope=rules.NO_ROPE,
    ),
    Family(
        "openai-gpt",
        defaults.OPENAI_GPT,
        keys=rules.GPT2_KEYS,
        tensors=layouts.GPT2_LAYOUT,
        heads=split_hidden,
        biases=rules.ALWAYS,
        rope=rules.NO_ROPE,
    ),
    Family(
        "ctrl",
        defaults.CTRL,
        keys=rules.GPT2_KEYS,
        tensors=layouts.CTRL,
        heads=split_hidden,
        biases=rules.ALWAYS,
        rope=rules.NO_ROPE,
    ),
    # layers without positions (NoPE): by no_rope_layers, the full layers, the full layers
    # of a windowed model
    Family(
        "smollm3",
        defaults.SMOLLM3,
        windows=SMOLLM3_WINDOWS,
        rope=Rope(theta=2e6, rotates=by_no_rope_layers),
    ),
    Family(
        "cohere2",
        defaults.COHERE2,
        windows=by_layer_types(pattern=4),
        rope=Rope(interleave=True, rotates=sliding_layers),
    ),
    Family(
        "cohere2_moe",
        defaults.COHERE2_MOE,
        windows=COHERE2_MOE_WINDOWS,
        rope=Rope(interleave=True, rotates=sliding_or_dense_layers),
    ),
    Family(
        "exaone4",
        defaults.EXAONE4,
        biases=NO_BIASES,
        windows=by_layer_types(pattern=4),
        rope=Rope(rotates=sliding_layers_if_windowed),
        qk_norm=PER_HEAD,
    ),
    # partial rotary: interleaved (GLM), of the halves (the others)
    Family(
        "glm",
        defaults.GLM,
        biases=QKV_ATTENTION_BIAS,
        rope=Rope(partial=True, fraction=0.5, interleave=True),
    ),
    Family(
        "glm4",
        defaults.GLM4,
        biases=QKV_ATTENTION_BIAS,
        rope=Rope(partial=True, fraction=0.5, interleave=True),
    ),
    Family(
        "glm4_moe",
        defaults.GLM4_MOE,
        biases=QKV_ATTENTION_BIAS,
        rope=Rope(partial=True, fraction=0.5),
        qk_norm=QkNorm("head", when="use_qk_norm"),
        own=("use_qk_norm",),
    ),
    Family(
        "minimax_m2",
        defaults.MINIMAX_M2,
        biases=NO_BIASES,
        rope=Rope(theta=5e6, partial=True, width="rotary_dim"),
        qk_norm=ACROSS_HEADS,
        own=("use_qk_norm",),
    ),
    Family(
        "stablelm",
        defaults.STABLELM,
        head_dim=None,
        tensors=Projections(q_norm="q_layernorm.norms.{h}", k_norm="k_layernorm.norms.{h}"),
        biases=Biases("use_qkv_bias", roles=("q", "k", "v")),
        rope=Rope(partial=True, fraction=0.25),
        qk_norm=QkNorm("each_head", eps="layer_norm_eps", when="qk_layernorm", layer=True),
    ),
    Family(
        "phi",
        defaults.PHI,
        tensors=Projections(o="dense", q_norm="q_layernorm", k_norm="k_layernorm"),
        biases=ALL_BIASES,
        rope=Rope(partial=True, fraction=0.5),
        qk_norm=LAYERNORM_QK,
    ),
    Family(  # GPT-NeoX's fused layout, LayerNorms of the queries and keys by default
        "persimmon",
        defaults.PERSIMMON,
        tensors=layouts.PERSIMMON,
        heads=split_hidden,
        biases=rules.ALWAYS,
        rope=Rope(partial=True, fraction=0.5),
        qk_norm=LAYERNORM_QK,
    ),
    Family("nemotron", defaults.NEMOTRON, rope=Rope(partial=True, fraction=0.5)),
    # pairs (2i, 2i + 1) over the whole head
    Family(
        "cohere",
        defaults.COHERE,
        rope=Rope(theta=5e5, interleave=True),
        qk_norm=QkNorm("each_head", eps="layer_norm_eps", when="use_qk_norm", layer=True),
        own=("use_qk_norm",),
    ),
    # (Helium and ERNIE 4.5 rotate (2i, 2i + 1) pairs too: their rows are below)
    # families whose attention is one above under other names, defaults and config keys
    Family("qwen3_moe", defaults.QWEN3_MOE, windows=QWEN_EVERY_LAYER, qk_norm=PER_HEAD),
    Family(
        "qwen2_moe",
        defaults.QWEN2_MOE,
        biases=Biases("qkv_bias", roles=("q", "k", "v")),
        windows=QWEN2_MOE_WINDOWS,
    ),
    Family("olmoe", defaults.OLMOE, qk_norm=ACROSS_HEADS, clip_qkv=CLIP_QKV),
    Family("flex_olmo", defaults.FLEX_OLMO, rope=Rope(theta=500_000.0), qk_norm=ACROSS_HEADS),
    Family(
        "phimoe",
        defaults.PHIMOE,
        windows=EVERY_LAYER,
        rope=Rope(theta=1e6, scaled=False),  # its longrope takes short_ and long_mscale
    ),
    Family(
        "vaultgemma",
        defaults.VAULTGEMMA,
        windows=by_layer_types(pattern=2, key=None),
        scale=query_pre_attn_scalar,
        softcap="attn_logit_softcapping",
    ),
    Family("gemma", defaults.GEMMA, unsupported=(BIDIRECTIONAL,)),
    Family("olmo", defaults.OLMO, clip_qkv=CLIP_QKV),
    Family(
        "olmo3",
        defaults.OLMO3,
        windows=by_layer_types(pattern=4, key=None),
        rope=Rope(per_layer_type={FULL: ("rope_theta", 500_000.0), SLIDING: (None, 500_000.0)}),
        qk_norm=ACROSS_HEADS,
    ),
    Family(  # LlamaForCausalLM
        "internlm3", defaults.INTERNLM3, keys={"attention_bias": "qkv_bias"}
    ),
    Family(
        "seed_oss",
        defaults.SEED_OSS,
        biases=BiasesByKey({**dict.fromkeys("qkv", "attention_bias"), "o": "attention_out_bias"}),
    ),
    Family("dots1", defaults.DOTS1, windows=WINDOWED_FROM, qk_norm=PER_HEAD),
    Family(
        "apertus",
        defaults.APERTUS,
        rope=Rope(theta=12_000_000.0, parameters=defaults.APERTUS_ROPE),
        qk_norm=PER_HEAD,
    ),
    Family(
        "glm4_moe_lite",
        defaults.GLM4_MOE_LITE,
        keys={"qk_rope_head_dim": "head_dim"},
        tensors=LATENT,
        rope=Rope(interleave="rope_interleave"),
    ),
    Family("youtu", defaults.YOUTU, tensors=LATENT, rope=Rope(interleave="rope_interleave")),
    Family("granite", defaults.GRANITE, scale=attention_multiplier),
    Family("granitemoe", defaults.GRANITE, scale=attention_multiplier),
    Family("granitemoeshared", defaults.GRANITE, scale=attention_multiplier),
    Family(
        "helium",
        defaults.HELIUM,
        biases=QKV_BIASES_BY_KEY,
        rope=Rope(theta=100_000.0, interleave=True),  # (2i, 2i + 1) pairs, as DeepSeek V2
    ),
    Family("starcoder2", defaults.STARCODER2, biases=Biases("use_bias"), windows=EVERY_LAYER),
    Family("solar_open", defaults.SOLAR_OPEN, biases=QKV_BIASES_BY_KEY, rope=Rope(theta=1e6)),
    Family("hyperclovax", defaults.HYPERCLOVAX, scale=attention_multiplier),
    Family("iquestcoder", defaults.IQUESTCODER),  # LlamaForCausalLM
    Family("jais2", defaults.JAIS2),
    Family("aria_text", defaults.ARIA_TEXT),
    Family(  # Llama's attention (LlamaForCausalLM) under EXAONE 3's names
        "exaone",
        defaults.EXAONE,
        keys={"num_hidden_layers": "num_layers"},
        tensors=EXAONE,
        rope=Rope(theta=500_000.0),
    ),
    Family(
        "apertus1p5_text",
        defaults.APERTUS1P5_TEXT,
        rope=Rope(theta=12_000_000.0, parameters=defaults.APERTUS_ROPE),
        qk_norm=PER_HEAD,
    ),
    # HunYuan: QK-norm per head after the rotation (query_layernorm, key_layernorm); the
    # dense model's "dynamic" rope with alpha is its own NTK scaling
    Family(
        "hunyuan_v1_dense",
        defaults.HUNYUAN,
        tensors=rules.HUNYUAN,
        rope=Rope(scaled=False),
        qk_norm=rules.HUNYUAN_NORM,
    ),
    Family("hunyuan_v1_moe", defaults.HUNYUAN, tensors=rules.HUNYUAN, qk_norm=rules.HUNYUAN_NORM),
    Family(  # a sigmoid gate of every feature; rope on the sliding layers only
        "afmoe",
        defaults.AFMOE,
        windows=by_layer_types(pattern=4, key="global_attn_every_n_layers"),
        rope=Rope(rotates=sliding_layers),
        qk_norm=PER_HEAD,
        gate=Gate(),
    ),
    Family(  # a softplus gate per head (gating) or per feature, each layer its own heads
        "laguna",
        defaults.LAGUNA,
        windows=FULL_BY_DEFAULT,
        rope=Rope(
            per_layer_type={FULL: (None, 500_000.0), SLIDING: (None, 10_000.0)}, partial=True
        ),
        qk_norm=PER_HEAD,
        gate=Gate("g_proj", "softplus", per_head=rules.laguna_gate_per_head),
        heads_by_layer="num_attention_heads_per_layer",
    ),
    Family("hy_v3", defaults.HY_V3, rope=Rope(theta=11_158_840.0), qk_norm=PER_HEAD),
    Family(
        "ernie4_5",
        defaults.ERNIE4_5,
        biases=Biases("use_bias"),
        rope=Rope(theta=500_000.0, interleave=True),
    ),
    Family(
        "ernie4_5_moe",
        defaults.ERNIE4_5_MOE,
        biases=Biases("use_bias"),
        rope=Rope(theta=500_000.0, interleave=True),
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
    Family(
        "mellum",
        defaults.MELLUM,
        windows=FULL_BY_DEFAULT,
        rope=Rope(per_layer_type={FULL: (None, 500_000.0), SLIDING: (None, 10_000.0)}),
        qk_norm=PER_HEAD,
        unsupported=(Unsupported("rope_scaling", "an old rope_scaling, which Mellum ignores"),),
    ),
    # attentions above with other defaults, windows or rope (issue 32)
    Family(  # EXAONE 4's attention (ExaoneMoeAttention)
        "exaone_moe",
        defaults.EXAONE_MOE,
        biases=NO_BIASES,
        windows=by_layer_types(pattern=4),
        rope=Rope(rotates=sliding_layers_if_windowed),
        qk_norm=PER_HEAD,
    ),
    Family(  # EXAONE 4's attention, every fifth layer full
        "kolibri1",
        defaults.KOLIBRI1,
        biases=NO_BIASES,
        windows=by_layer_types(pattern=5, key=None),
        rope=Rope(rotates=sliding_layers_if_windowed),
        qk_norm=PER_HEAD,
    ),
    Family(  # Qwen3-MoE's attention with gpt-oss's sinks, rope on the sliding layers only
        "flint",
        defaults.FLINT,
        tensors=Projections(sinks="softmax_offset"),  # as saved; transformers loads "sinks"
        windows=FLINT_WINDOWS,
        rope=Rope(rotates=sliding_layers),
        qk_norm=PER_HEAD,
        sinks=True,
    ),
    # Granite's with sinks, the first of every four layers full, a base per layer
    Family(
        "granite_swa",
        defaults.GRANITE_SWA,
        windows=CWM_WINDOWS,
        rope=Rope(per_layer_theta="layer_rope_theta"),
        scale=attention_multiplier,
        sinks=True,
    ),
    Family(
        "granitemoe_swa",
        defaults.GRANITEMOE_SWA,
        windows=CWM_WINDOWS,
        rope=Rope(per_layer_theta="layer_rope_theta"),
        scale=attention_multiplier,
        sinks=True,
    ),
    Family(  # GLM-4.5's attention (Glm4MoeForCausalLM), rotary over the whole head
        "sarvam_moe",
        defaults.SARVAM_MOE,
        keys={"attention_bias": "use_qkv_bias"},
        tensors=layouts.SARVAM_MOE,
        biases=QKV_ATTENTION_BIAS,
        rope=Rope(theta=8_000_000.0, partial=True, fraction=1.0),
        qk_norm=QkNorm("head", when="use_qk_norm"),
        own=("use_qk_norm",),
    ),
    # DeepSeek's latent attention: V3's (Sarvam's old deepseek_yarn is yarn), MiniCPM3's
    # rotating the halves
    Family(
        "sarvam_mla",
        defaults.SARVAM_MLA,
        tensors=LATENT,
        rope=Rope(interleave="rope_interleave", aliases={"deepseek_yarn": "yarn"}),
    ),
    Family("axk1", defaults.AXK1, tensors=LATENT, rope=Rope(interleave="rope_interleave")),
    Family("minicpm3", defaults.MINICPM3, tensors=LATENT),
    Family(  # two latent attentions per decoder layer, read as layers 2i and 2i + 1
        "longcat_flash",
        defaults.LONGCAT_FLASH,
        keys={"num_hidden_layers": "num_layers"},
        tensors=layouts.LONGCAT_FLASH,
        rope=Rope(theta=10_000_000.0, interleave=True),
    ),
    Family(  # Cohere 2's attention rotating the halves, a rope per layer type (null: none)
        "cohere_compass_text",
        defaults.COHERE_COMPASS_TEXT,
        windows=FULL_BY_DEFAULT,
        rope=Rope(rotates=by_layer_type_entries, text_mrope=True),
    ),
    # Qwen3's attention rotating by the negated angles, then normalising (without weights,
    # which commutes with the rotation)
    Family(
        "nanochat",
        defaults.NANOCHAT,
        rope=Rope(negated=True),
        qk_norm=QkNorm("head", weighted=False),
    ),
    # hybrid models: the attention layers between Mamba, linear-attention or convolution layers
    # (each refused by its index); Falcon-H1's attention beside a Mamba mixer in every layer
    Family(
        "granitemoehybrid",
        defaults.GRANITEMOEHYBRID,
        keys={"layer_types": "layers_block_type"},
        rope=Rope(rotates=rules.rope_position_embedding),
        scale=attention_multiplier,
        hybrid=Hybrid(
            "Granite-MoE-hybrid", from_layer_types(every_layer_of(LINEAR)), {LINEAR: rules.MAMBA2}
        ),
    ),
    Family("falcon_h1", defaults.FALCON_H1, scale=rules.key_multiplier),
    Family(
        "jamba",
        defaults.JAMBA,
        biases=NO_BIASES,
        rope=rules.NO_ROPE,
        hybrid=Hybrid(
            "Jamba",
            by_period("attn_layer_period", "attn_layer_offset"),
            {LINEAR: rules.MAMBA},
            keys=("attn_layer_period", "attn_layer_offset"),
        ),
    ),
    Family(
        "nemotron_h",
        defaults.NEMOTRON_H,
        keys={"layer_types": "layers_block_type"},
        tensors=Projections(path="backbone.layers.{i}.mixer"),
        biases=NO_BIASES,
        rope=rules.NO_ROPE,
        hybrid=Hybrid(
            "Nemotron-H",
            from_layer_types(listed(LINEAR, MOE, FULL, MLP)),
            {LINEAR: rules.MAMBA2, MOE: "a mixture-of-experts MLP layer", MLP: "an MLP layer"},
            sources=(
                ("hybrid_override_pattern", by_pattern("hybrid_override_pattern", rules.PATTERN)),
            ),
            counts=True,
        ),
    ),
    Family(
        "bamba",
        defaults.BAMBA,
        rope=Rope(partial=True, fraction=0.5),
        hybrid=Hybrid(
            "Bamba",
            by_indices("attn_layer_indices"),
            {LINEAR: rules.MAMBA2},
            keys=("attn_layer_indices",),
        ),
    ),
    Family(
        "lfm2",
        defaults.LFM2,
        tensors=Projections(o="out_proj", q_norm="q_layernorm", k_norm="k_layernorm"),
        biases=NO_BIASES,
        rope=Rope(theta=1e6),
        qk_norm=QkNorm("head", eps="norm_eps"),
        hybrid=Hybrid(
            "LFM2",
            from_layer_types(by_indices("full_attn_idxs", otherwise=CONV, unset=FULL)),
            {CONV: "a short-convolution layer"},
        ),
    ),
    Family(
        "lfm2_moe",
        defaults.LFM2_MOE,
        tensors=Projections(o="out_proj", q_norm="q_layernorm", k_norm="k_layernorm"),
        biases=NO_BIASES,
        rope=Rope(theta=1e6),
        qk_norm=QkNorm("head", eps="norm_eps"),
        hybrid=Hybrid("LFM2-MoE", from_layer_types(), {CONV: "a short-convolution layer"}),
    ),
    Family(
        "olmo_hybrid",
        defaults.OLMO_HYBRID,
        rope=Rope(rotates=rules.rope_unless_null),
        qk_norm=ACROSS_HEADS,
        hybrid=Hybrid(
            "OLMo-hybrid",
            from_layer_types(every_fourth),
            {LINEAR: "a Gated DeltaNet linear-attention layer"},
        ),
    ),
    Family(
        "lara_mini",
        defaults.LARA_MINI,
        windows=ByLayerTypes(rules.lara_mini_types),
        rope=Rope(rotates=sliding_layers),
        qk_norm=PER_HEAD,
        hybrid=Hybrid(
            "Lara-mini",
            from_layer_types(rules.lara_mini_types),
            {LINEAR: "a Gated DeltaNet linear-attention layer"},
        ),
    ),
    Family(
        "recurrent_gemma",
        defaults.RECURRENT_GEMMA,
        keys={"sliding_window": "attention_window_size"},
        tensors=Projections(path="model.layers.{i}.temporal_block"),
        biases=Biases("attention_bias", always=("o",)),
        windows=EVERY_LAYER,
        rope=Rope(partial=True, fraction=0.5),
        hybrid=Hybrid(
            "RecurrentGemma",
            cycled("block_types", {"recurrent": LINEAR, "attention": SLIDING}),
            {LINEAR: "an RG-LRU recurrent layer (Griffin)"},
            keys=("block_types",),
        ),
    ),
    Family(
        "minimax",
        defaults.MINIMAX,
        biases=NO_BIASES,
        windows=EVERY_LAYER,
        rope=Rope(theta=1e6),
        hybrid=Hybrid(
            "MiniMax",
            from_layer_types(alternating(FULL, LINEAR)),
            {LINEAR: "a lightning (linear) attention layer"},
        ),
    ),
)
# the rows of the topic modules, in the order they came
TOPICS = (temperature, sparse, gated, mimo, gemma4, mistral4, outnorm, hyv4, nope,
          latentgates, blocksparse, recurrent, dory, cpmant)  # fmt: skip
for topic in TOPICS:
    register(*topic.ROWS)

SUPPORTED = tuple(FAMILIES)
"""The families of the table as mha defines it (before any :func:`register`)."""
