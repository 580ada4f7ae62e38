"""What each family's config class (transformers 5.24) fills in for the keys the readers
(and mha.models' decoders: activations, final soft-capping) read, when ``config.json`` (or a
GGUF file's metadata) leaves them out: one dict per ``model_type``, a row's
``defaults``. tests/test_checkpoint.py checks each value against the class's own."""

from __future__ import annotations

from typing import Any

_OMPE = "original_max_position_embeddings"
_SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
_GEMMA = {
    "hidden_size": 2304,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
_QWEN = {
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "max_position_embeddings": 32768,
}
MLA = {
    "attention_bias": False,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}

LLAMA: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
    "max_position_embeddings": 2048,
}
MISTRAL: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 8,
    "head_dim": None,
    "sliding_window": 4096,
    "max_position_embeddings": 131072,
}
QWEN2: dict[str, Any] = {**_SHAPE, "num_key_value_heads": 32, **_QWEN}
QWEN3: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "attention_bias": False,
    **_QWEN,
    "rms_norm_eps": 1e-6,
}
GEMMA2: dict[str, Any] = {
    **_GEMMA,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": None,
    "max_position_embeddings": 8192,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": 30.0,
}
GEMMA3_TEXT: dict[str, Any] = {
    **_GEMMA,
    "use_bidirectional_attention": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
}
OLMO2: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
}
PHI3: dict[str, Any] = {
    "hidden_size": 3072,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "sliding_window": None,
    "max_position_embeddings": 4096,
    _OMPE: 4096,
}
GPT_OSS: dict[str, Any] = {
    "hidden_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
}
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    _OMPE: 4096,
}
"""gpt-oss's ``rope_parameters`` when the config gives none."""
DEEPSEEK_V2: dict[str, Any] = {**_SHAPE, **MLA, "max_position_embeddings": 2048}
DEEPSEEK_V3: dict[str, Any] = {
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    **MLA,
    "rope_interleave": True,
    "max_position_embeddings": 4096,
}
MINISTRAL: dict[str, Any] = {**MISTRAL}
MIXTRAL: dict[str, Any] = {**MISTRAL, "sliding_window": None}
ARCEE: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
    "max_position_embeddings": 4096,
}
_GPT2_SHAPE = {"n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024}
GPT2: dict[str, Any] = {
    **_GPT2_SHAPE,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "activation_function": "gelu_new",
}
GPT_BIGCODE: dict[str, Any] = {**_GPT2_SHAPE, "scale_attn_weights": True, "multi_query": True}
GPT_NEOX: dict[str, Any] = {
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "num_hidden_layers": 44,
    "max_position_embeddings": 2048,
    "attention_bias": True,
}
GPTJ: dict[str, Any] = {
    "n_embd": 4096,
    "n_head": 16,
    "n_layer": 28,
    "n_positions": 2048,
    "rotary_dim": 64,
}
CODEGEN: dict[str, Any] = {**GPTJ}
GPT_NEO: dict[str, Any] = {
    "hidden_size": 2048,
    "num_heads": 16,
    "num_layers": 24,
    "max_position_embeddings": 2048,
    "window_size": 256,
    "attention_types": None,
}
BLOOM: dict[str, Any] = {"hidden_size": 64, "n_head": 8, "n_layer": 2}
MPT: dict[str, Any] = {
    "d_model": 2048,
    "n_heads": 16,
    "n_layers": 24,
    "attn_config.alibi": True,
    "attn_config.alibi_bias_max": 8,
    "attn_config.clip_qkv": None,
    "attn_config.softmax_scale": None,
}
"""MPT's; ``attn_config.*`` are the keys of its ``attn_config`` (``MptAttentionConfig``)."""
DBRX: dict[str, Any] = {
    "d_model": 2048,
    "n_heads": 16,
    "n_layers": 24,
    "max_seq_len": 2048,
    "attn_config.kv_n_heads": 1,
    "attn_config.clip_qkv": None,
}
"""DBRX's; ``attn_config.*`` are the keys of its ``attn_config`` (``DbrxAttentionConfig``)."""
FALCON: dict[str, Any] = {
    "hidden_size": 4544,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "num_kv_heads": None,
    "alibi": False,
    "new_decoder_architecture": False,
    "multi_query": True,
    "bias": False,
    "max_position_embeddings": 2048,
    "layer_norm_epsilon": 1e-5,
    "activation": "gelu",
}
OPT: dict[str, Any] = {
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "enable_bias": True,
}
BIOGPT: dict[str, Any] = {"hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 24}
XGLM: dict[str, Any] = {"d_model": 1024, "attention_heads": 16, "num_layers": 24}
CTRL: dict[str, Any] = {"n_embd": 1280, "n_head": 16, "n_layer": 48, "n_positions": 256}
QWEN3_MOE: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
}
QWEN2_MOE: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "qkv_bias": True,
    **_QWEN,
    "layer_types": None,
}
_OLMO = {"num_key_value_heads": None, "attention_bias": False, "max_position_embeddings": 4096}
OLMOE: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    **_OLMO,
    "rms_norm_eps": 1e-5,
    "clip_qkv": None,
}
FLEX_OLMO: dict[str, Any] = {**_SHAPE, **_OLMO, "rms_norm_eps": 1e-6}
PHIMOE: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 8,
    "attention_bias": False,
    "sliding_window": None,
    "max_position_embeddings": 131072,
}
VAULTGEMMA: dict[str, Any] = {
    **_GEMMA,
    "attn_logit_softcapping": 50.0,
    "layer_types": None,
    "max_position_embeddings": 8192,
}
GEMMA: dict[str, Any] = {
    "hidden_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "attention_bias": False,
    "use_bidirectional_attention": None,
    "max_position_embeddings": 8192,
}
OLMO: dict[str, Any] = {**_SHAPE, **_OLMO, "max_position_embeddings": 2048, "clip_qkv": None}
OLMO3: dict[str, Any] = {
    **_SHAPE,
    **_OLMO,
    "max_position_embeddings": 2048,
    "sliding_window": 4096,
    "layer_types": None,
    "rms_norm_eps": 1e-5,
}
INTERNLM3: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "attention_bias": False,
    "max_position_embeddings": 32768,
}
SEED_OSS: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 64,
    "num_attention_heads": 80,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": True,
    "attention_out_bias": False,
    "max_position_embeddings": 524288,
}
DOTS1: dict[str, Any] = {
    "hidden_size": 4608,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "attention_bias": False,
    "sliding_window": 4096,
    "max_window_layers": 62,
    "layer_types": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
APERTUS: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 65536,
}
APERTUS_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 12_000_000.0,
    "factor": 8.0,
    _OMPE: 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
"""Apertus's ``rope_parameters`` when the config gives none."""
GLM4_MOE_LITE: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    **MLA,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "rope_interleave": True,
    "max_position_embeddings": 202752,
}
YOUTU: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    **MLA,
    "rope_interleave": True,
    "max_position_embeddings": 131072,
}
GRANITE: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": None,
    "attention_bias": False,
    "attention_multiplier": 1.0,
    "max_position_embeddings": 2048,
}
HELIUM: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 24,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "head_dim": 128,
    "attention_bias": False,
    "max_position_embeddings": 4096,
}
STARCODER2: dict[str, Any] = {
    "hidden_size": 3072,
    "num_hidden_layers": 30,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "use_bias": True,
    "sliding_window": None,
    "max_position_embeddings": 4096,
    "hidden_act": "gelu_pytorch_tanh",
}
SOLAR_OPEN: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 48,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "max_position_embeddings": 131072,
}
HYPERCLOVAX: dict[str, Any] = {
    **LLAMA,
    "attention_multiplier": None,
}
IQUESTCODER: dict[str, Any] = {
    "hidden_size": 5120,
    "num_hidden_layers": 80,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "max_position_embeddings": 131072,
}
JAIS2: dict[str, Any] = {
    "hidden_size": 3328,
    "num_hidden_layers": 32,
    "num_attention_heads": 26,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": True,
    "max_position_embeddings": 8192,
}
MINISTRAL3: dict[str, Any] = {
    **_SHAPE,
    "num_hidden_layers": 34,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": None,
    "max_position_embeddings": 262144,
}
MINISTRAL3_ROPE: dict[str, Any] = {
    "type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    _OMPE: 16384,
    "max_position_embeddings": 262144,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
"""Ministral 3's ``rope_parameters`` when the config gives none (its ``llama_4_scaling_beta``:
the query temperature, :mod:`.temperature`)."""
ARIA_TEXT: dict[str, Any] = {**LLAMA}
EXAONE: dict[str, Any] = {**LLAMA, "num_key_value_heads": 8, "max_position_embeddings": 4096}
APERTUS1P5_TEXT: dict[str, Any] = {**APERTUS}
AFMOE: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": None,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 16384,
    "sliding_window": 1024,
    "layer_types": None,
    "global_attn_every_n_layers": 4,
}
LAGUNA: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "sliding_window": 512,
    "layer_types": None,
    "gating": True,
    "num_attention_heads_per_layer": None,
}
HUNYUAN: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
}
"""HunYuan's (dense and MoE alike)."""
HY_V3: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
}
ERNIE4_5: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 18,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "use_bias": False,
    "max_position_embeddings": 131072,
}
ERNIE4_5_MOE: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 28,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "use_bias": False,
    "max_position_embeddings": 131072,
}
CWM: dict[str, Any] = {
    "hidden_size": 6144,
    "num_hidden_layers": 64,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": 8192,
    "layer_types": None,
    "max_position_embeddings": 131072,
}
CWM_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    _OMPE: 8192,
}
"""CWM's ``rope_parameters`` when the config gives none."""
MODERNBERT_DECODER: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 22,
    "num_attention_heads": 12,
    "attention_bias": False,
    "local_attention": 128,
    "max_position_embeddings": 8192,
}
OPENAI_GPT: dict[str, Any] = {"n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 512}
GPT_NEOX_JAPANESE: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
}
MELLUM: dict[str, Any] = {
    "hidden_size": 2304,
    "num_hidden_layers": 28,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "attention_bias": False,
    "sliding_window": 1024,
    "layer_types": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
}
SMOLLM3: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "attention_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "layer_types": None,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "max_position_embeddings": 32768,
}
_COHERE = {
    "hidden_size": 8192,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": None,
    "attention_bias": False,
    "max_position_embeddings": 8192,
}
COHERE: dict[str, Any] = {**_COHERE, "use_qk_norm": False, "layer_norm_eps": 1e-5}
COHERE2: dict[str, Any] = {**_COHERE, "sliding_window": 4096, "layer_types": None}
COHERE2_MOE: dict[str, Any] = {
    **COHERE2,
    "head_dim": 128,
    "sliding_window_pattern": 4,
    "mlp_layer_types": None,
    "prefix_dense_sliding_window_pattern": 1,
}
EXAONE4: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-5,
    "sliding_window": 4096,
    "sliding_window_pattern": 4,
    "layer_types": None,
    "max_position_embeddings": 2048,
}
GLM: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "attention_bias": True,
    "max_position_embeddings": 131072,
}
GLM4: dict[str, Any] = {**GLM}
GLM4_MOE: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "attention_bias": False,
    "use_qk_norm": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
}
MINIMAX_M2: dict[str, Any] = {
    "hidden_size": 3072,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 196608,
}
STABLELM: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "use_qkv_bias": False,
    "qk_layernorm": False,
    "layer_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
}
PHI: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "qk_layernorm": False,
    "layer_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
}
PERSIMMON: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "qk_layernorm": True,
    "layer_norm_eps": 1e-5,
    "max_position_embeddings": 16384,
}
NEMOTRON: dict[str, Any] = {
    "hidden_size": 6144,
    "num_hidden_layers": 32,
    "num_attention_heads": 48,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
    "max_position_embeddings": 4096,
    "hidden_act": "relu2",
}
EXAONE_MOE: dict[str, Any] = {**EXAONE4}
KOLIBRI1: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 50,
    "num_attention_heads": 48,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "sliding_window": 513,
    "layer_types": None,
    "max_position_embeddings": 262144,
}
FLINT: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 49,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "sliding_window": 513,
    "layer_types": None,
    "max_position_embeddings": 262144,
}
_GRANITE_SWA = {"sliding_window": 128, "layer_types": None, "layer_rope_theta": None}
GRANITE_SWA: dict[str, Any] = {
    **GRANITE,
    "hidden_size": 2560,
    "num_hidden_layers": 24,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "max_position_embeddings": 8192,
    **_GRANITE_SWA,
}
GRANITEMOE_SWA: dict[str, Any] = {**GRANITE, **_GRANITE_SWA}
SARVAM_MOE: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 19,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "attention_bias": False,
    "use_qk_norm": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
}
SARVAM_MLA: dict[str, Any] = {
    **DEEPSEEK_V3,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 64,
    "q_lora_rank": None,
}
AXK1: dict[str, Any] = {
    **DEEPSEEK_V3,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "max_position_embeddings": 32768,
}
MINICPM3: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 62,
    "num_attention_heads": 40,
    "attention_bias": False,
    "q_lora_rank": 768,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": None,
    "max_position_embeddings": 32768,
}
NANOCHAT: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "num_key_value_heads": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
COHERE_COMPASS_TEXT: dict[str, Any] = {**COHERE2}
LONGCAT_FLASH: dict[str, Any] = {
    "hidden_size": 6144,
    "num_layers": 28,
    "num_attention_heads": 64,
    "attention_bias": False,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 131072,
}

# hybrid families: the attention layers between Mamba, linear-attention or convolution layers
GRANITEMOEHYBRID: dict[str, Any] = {
    **GRANITE,
    "position_embedding_type": None,
    "layer_types": None,
}
FALCON_H1: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 8,
    "attention_bias": False,
    "key_multiplier": 1.0,
    "max_position_embeddings": 8192,
}
JAMBA: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "max_position_embeddings": 262144,
}
NEMOTRON_H: dict[str, Any] = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": None,
    "layers_block_type": None,
    "max_position_embeddings": 4096,
}
BAMBA: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 8,
    "attention_bias": False,
    "attn_layer_indices": None,
    "max_position_embeddings": 262144,
}
_LFM2 = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "norm_eps": 1e-5, "layer_types": None, "max_position_embeddings": 128000}  # fmt: skip
LFM2: dict[str, Any] = {"hidden_size": 2560, **_LFM2, "full_attn_idxs": None}
LFM2_MOE: dict[str, Any] = {"hidden_size": 2048, **_LFM2}
MINIMAX: dict[str, Any] = {
    **_SHAPE,
    "num_key_value_heads": 8,
    "head_dim": None,
    "sliding_window": None,
    "layer_types": None,
    "max_position_embeddings": 131072,
}
OLMO_HYBRID: dict[str, Any] = {
    "hidden_size": 3840,
    "num_hidden_layers": 32,
    "num_attention_heads": 30,
    "num_key_value_heads": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "layer_types": None,
    "max_position_embeddings": 65536,
}
LARA_MINI: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 34,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "layer_types": None,
    "max_position_embeddings": 131072,
}
RECURRENT_GEMMA: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 26,
    "num_attention_heads": 10,
    "num_key_value_heads": None,
    "attention_bias": False,
    "attention_window_size": 2048,
    "block_types": ("recurrent", "recurrent", "attention"),
}
