"""What each family's config class (transformers 5.24) fills in for the keys the readers
read, when ``config.json`` leaves them out: one dict per ``model_type``, a row's
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
_MLA = {
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
}
GEMMA3_TEXT: dict[str, Any] = {
    **_GEMMA,
    "use_bidirectional_attention": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
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
DEEPSEEK_V2: dict[str, Any] = {**_SHAPE, **_MLA, "max_position_embeddings": 2048}
DEEPSEEK_V3: dict[str, Any] = {
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    **_MLA,
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
EXAONE: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "attention_bias": False,
    "max_position_embeddings": 4096,
}
CWM: dict[str, Any] = {
    "hidden_size": 6144,
    "num_hidden_layers": 64,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": 8192,
    "max_position_embeddings": 131072,
}
CWM_ROPE: dict[str, Any] = {
    "rope_theta": 1e6,
    "rope_type": "llama3",
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
