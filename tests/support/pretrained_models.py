"""Tiny random transformers models of each family mha reads, saved as real checkpoints.

Each family's model is built once per test session with transformers 5.24, its weights drawn
so that every part of the attention matters (``initializer_range`` 0.2, nonzero biases,
random QK-norm weights, gpt-oss sinks and Doge's ``A``), cast to bfloat16 and written by
``save_pretrained`` in shards of 20 KB, so that a checkpoint has many shards and an index, as
big models do. :func:`saved` returns the folder; :func:`transformers_model` loads it back in
float64 for the oracle comparisons (its weights are the bfloat16 values, exactly).

The settings exercise what each family's attention does differently: Llama 3's rope scaling
past ``original_max_position_embeddings`` (16 here), Qwen2's sliding layers from
``max_window_layers``, QK-norm per head (Qwen3, Gemma 3) or across heads (OLMo 2), Gemma's
``query_pre_attn_scalar`` and soft-capping and local rope base, Phi-3's fused projection with
longrope and partial rotary, gpt-oss's sinks and yarn, DeepSeek V3's latent attention;
and the rows that rename an attention the table already reads (Ministral, Mixtral, Arcee, and
the families after them), each with the setting it reads under its own name or default:
biases from ``qkv_bias``, ``use_bias`` or ``attention_out_bias``, Qwen-MoE's and dots.llm1's
and CWM's sliding layers, Granite's ``attention_multiplier``, Helium's and ERNIE 4.5's
interleaved rotary, OLMo 3's rope base per layer type, EXAONE 3's tensor names; layers
without rope (SmolLM3, Cohere 2 and its MoE, EXAONE 4), partial rotary (GLM, GLM-4.5,
MiniMax-M2, StableLM, Phi, Nemotron) and interleaved pairs (GLM, Cohere); and the older
layouts (GPT-2 and GPT-1's Conv1D, fused projections in blocks per head or per key/value
head, BigCode's and Falcon's multi-query and grouped heads, GPT-NeoX's partial and GPT-J's
interleaved partial rotary, GPT-Neo's unscaled local layers, BLOOM's, MPT's and Falcon's
ALiBi of six heads, OPT's, BioGPT's, XGLM's and CTRL's biases without rope), whose configs
keep COMMON's ``num_key_value_heads`` where the family ignores it; sinks beside windows
(Flint, GraniteSWA), a rope base per layer (GraniteSWA) or per layer type, none for one
(Cohere Compass), NanoChat's rotation by the negated angles and LongCat-Flash's two latent
attentions per decoder layer; and the hybrid models
(:data:`HYBRIDS`), whose layer 1 is not attention (Mamba, Mamba-2, a short convolution,
lightning or Gated DeltaNet linear attention, an RG-LRU recurrence) between attention layers
0 and 2 that read what each family's attention does differently (Granite's
``attention_multiplier`` and optional rope, Falcon-H1's ``key_multiplier`` in every layer,
Jamba's and Nemotron-H's NoPE, Bamba's partial rotary, LFM2's QK-norm, MiniMax's window,
OLMo-hybrid's null rope, RecurrentGemma's local attention and its output bias). Each
family's attention module is where the reader's row says (:func:`attention_path`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import inspect
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SHARD_SIZE = "20KB"
LONG = 16
"""``original_max_position_embeddings`` of the scaled rope families: test sequences go past it."""

_SAVED: dict[str, Path] = {}
_ROOT: list[Path] = []

COMMON = {"hidden_size": 48, "intermediate_size": 32, "num_hidden_layers": 3, "vocab_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
          "max_position_embeddings": 64, "initializer_range": 0.2, "pad_token_id": None,
          "bos_token_id": None, "eos_token_id": None}  # fmt: skip
ROPE = {"rope_type": "default", "rope_theta": 500.0}
SLIDING, FULL = "sliding_attention", "full_attention"
DEEPSEEK = {
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "mscale": 1.0,
                        "mscale_all_dim": 0.8, "beta_fast": 8.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": LONG},
    "head_dim": None, "num_key_value_heads": 4, "q_lora_rank": 20, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 16,
    "first_k_dense_replace": 1, "n_shared_experts": 1, "rms_norm_eps": 1e-5,
    "experts_implementation": "eager",
}  # fmt: skip

LATENT_SIZES = ("rope_parameters", "head_dim", "num_key_value_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "rms_norm_eps")  # fmt: skip
"""DeepSeek's latent attention of :data:`DEEPSEEK`, without its experts."""

HYBRID_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 24, "mamba_n_groups": 1}
"""Mamba heads that divide the expanded width (2 * 48)."""
ABSENT = "absent"
"""A key of ``COMMON`` left out of a family's config."""
OLDER = {"head_dim": ABSENT, "rope_parameters": ABSENT}
"""The families without rope, or with their own keys for it."""
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "experts_implementation": "eager"}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": LONG}  # fmt: skip

GATED_DELTANET = {"linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "linear_key_head_dim": 8, "linear_value_head_dim": 8}  # fmt: skip
"""Gated DeltaNet layers of the hidden size 48 (Qwen3-Next's, Qwen3.5's)."""
QWEN3_5_ROPE = {**ROPE, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1],
                "mrope_interleaved": True}  # fmt: skip
"""Qwen3.5's multimodal rope over the 3 rotated pairs of its heads (text: one position)."""

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"attention_bias": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": LONG}}),
    # layers from max_window_layers on slide
    "qwen2": ("Qwen2", {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 5,
                        "max_window_layers": 2}),
    "qwen3": ("Qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1,
                        "attention_bias": True, "rms_norm_eps": 1e-5}),
    "mistral": ("Mistral", {"sliding_window": 7}),
    "gemma2": ("Gemma2", {"query_pre_attn_scalar": 20, "attn_logit_softcapping": 2.5,
                          "final_logit_softcapping": 4.0, "sliding_window": 5,
                          "layer_types": [SLIDING, FULL, SLIDING]}),
    "gemma3": ("Gemma3Text", {"query_pre_attn_scalar": 18, "sliding_window": 5,
                              "layer_types": [SLIDING, FULL, SLIDING], "rope_parameters": {
                                  SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                                  FULL: {"rope_type": "default", "rope_theta": 3000.0}}}),
    # OLMo 2 and Phi-3 have no head_dim: hidden_size // heads = 12
    "olmo2": ("Olmo2", {"head_dim": None, "attention_bias": True}),
    "phi3": ("Phi3", {"head_dim": None, "original_max_position_embeddings": LONG,
                      "sliding_window": 9, "rope_parameters": {  # rotary over 8 of 12 features
                          "rope_type": "longrope", "rope_theta": 500.0,
                          "partial_rotary_factor": 2 / 3, "short_factor": [1.0, 1.5, 2.0, 1.2],
                          "long_factor": [3.0, 5.0, 8.0, 13.0]}}),
    "gpt_oss": ("GptOss", {"sliding_window": 5, "num_local_experts": 4, "num_experts_per_tok": 2,
                           "experts_implementation": "eager", "rope_parameters": {
                               "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                               "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": LONG}}),
    "deepseek_v3": ("DeepseekV3", DEEPSEEK),
    "deepseek_v3_mha": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": None, "attention_bias": True,
                                       "rope_interleave": False}),
    # DeepSeek V2: the same latent attention, its rotary always on (2i, 2i + 1) pairs
    "deepseek_v2": ("DeepseekV2", {**DEEPSEEK, "n_group": None, "topk_group": None}),
    # rows that rename a family's attention: Mistral's by layer_types, Mistral's with
    # experts, Llama's (with yarn) beside another MLP
    "ministral": ("Ministral", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING]}),
    "mixtral": ("Mixtral", {"sliding_window": 6, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "experts_implementation": "eager"}),
    "arcee": ("Arcee", {"attention_bias": True, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
        "original_max_position_embeddings": LONG}}),
    # rows that rename an attention above under other names, defaults and config keys
    "qwen3_moe": ("Qwen3Moe", {"use_sliding_window": True, "sliding_window": 6,
                               "attention_bias": True, "rms_norm_eps": 1e-5, **MOE}),
    "qwen2_moe": ("Qwen2Moe", {"use_sliding_window": True, "sliding_window": 5,
                               "max_window_layers": 2, "shared_expert_intermediate_size": 16,
                               **MOE}),  # layers 0 sliding, 1 and 2 full
    "olmoe": ("Olmoe", {"attention_bias": True, "clip_qkv": 0.9, **MOE}),
    "flex_olmo": ("FlexOlmo", {**MOE}),
    "phimoe": ("Phimoe", {"sliding_window": 6, "attention_bias": True, **MOE}),
    "vaultgemma": ("VaultGemma", {"query_pre_attn_scalar": 20, "attn_logit_softcapping": 2.5,
                                  "sliding_window": 5}),
    "gemma": ("Gemma", {"attention_bias": True}),
    "olmo": ("Olmo", {"attention_bias": True, "clip_qkv": 1.5}),
    "olmo3": ("Olmo3", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                                            FULL: {"rope_type": "default", "rope_theta": 3000.0}}}),
    "internlm3": ("InternLM3", {"attention_bias": True, "mlp_bias": True}),  # equal, it checks
    "seed_oss": ("SeedOss", {"attention_bias": False, "attention_out_bias": True}),
    "dots1": ("Dots1", {"sliding_window": 5, "max_window_layers": 1, "n_routed_experts": 4,
                        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                        "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                        "n_shared_experts": 1, "experts_implementation": "eager"}),
    "apertus": ("Apertus", {"attention_bias": True, "rope_parameters": LLAMA3}),
    "glm4_moe_lite": ("Glm4MoeLite", {**DEEPSEEK,
                                      "mlp_layer_types": ["dense", "sparse", "sparse"]}),
    "youtu": ("Youtu", {**DEEPSEEK, "rope_interleave": False, "attention_bias": True}),
    "granite": ("Granite", {"attention_multiplier": 0.2, "attention_bias": True}),
    "granitemoe": ("GraniteMoe", {"attention_multiplier": 0.3, **MOE}),
    "granitemoeshared": ("GraniteMoeShared", {"attention_multiplier": 0.4,
                                              "shared_intermediate_size": 16, **MOE}),
    "helium": ("Helium", {"attention_bias": True}),
    "starcoder2": ("Starcoder2", {"sliding_window": 6, "use_bias": True}),
    "solar_open": ("SolarOpen", {"attention_bias": True, "n_routed_experts": 4,
                                 "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                                 "moe_intermediate_size": 16, "n_shared_experts": 1,
                                 "experts_implementation": "eager"}),
    "hyperclovax": ("HyperCLOVAX", {"attention_multiplier": 0.25}),
    "iquestcoder": ("IQuestCoder", {"attention_bias": True}),
    "jais2": ("Jais2", {}),  # attention_bias: True by default
    "ministral3": ("Ministral3", {"sliding_window": 6, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 8.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.0,
        "original_max_position_embeddings": LONG}}),
    "aria_text": ("AriaText", {"attention_bias": True, "moe_num_experts": 4, "moe_topk": 2,
                               "moe_num_shared_experts": 1, "experts_implementation": "eager"}),
    "exaone": ("Exaone", {"attention_bias": True}),
    "apertus1p5_text": ("Apertus1p5Text", {"attention_bias": True, "rope_parameters": LLAMA3}),
    "hy_v3": ("HYV3", {"attention_bias": True, "rms_norm_eps": 1e-5, **MOE,
                       "num_shared_experts": 1, "mlp_layer_types": ["dense", "sparse", "sparse"]}),
    # issue 32's rows: EXAONE 4's attention (EXAONE-MoE, Kolibri), Qwen3-MoE's with sinks and
    # rope on the sliding layers alone (Flint), Granite's with sinks, windows and a base per
    # layer (layer 1 without rope), GLM-4.5's over whole heads (Sarvam-MoE, its own names)
    "exaone_moe": ("ExaoneMoe", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                                 "rms_norm_eps": 1e-5, **MOE, "first_k_dense_replace": 1}),
    "kolibri1": ("Kolibri1", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                              **MOE, "shared_expert_intermediate_size": 16}),
    "flint": ("Flint", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                        "attention_bias": True, **MOE, "shared_expert_intermediate_size": 16,
                        "mlp_only_layers": [0]}),
    "granite_swa": ("GraniteSWA", {"attention_multiplier": 0.2, "attention_bias": True,
                                   "sliding_window": 5, "layer_rope_theta": [500.0, 0, 900.0]}),
    "granitemoe_swa": ("GraniteMoeSWA", {"attention_multiplier": 0.3, "sliding_window": 5,
                                         "shared_intermediate_size": 16, **MOE}),
    "sarvam_moe": ("SarvamMoE", {"attention_bias": True, "n_routed_experts": 4,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                 "experts_implementation": "eager"}),
    # DeepSeek V3's latent attention (Sarvam-MLA: no query projection by default; A.X K1),
    # MiniCPM3's rotating the halves, its values hidden_size // heads wide
    "sarvam_mla": ("SarvamMLA", {**DEEPSEEK, "q_lora_rank": ABSENT}),
    "axk1": ("AXK1", {**DEEPSEEK, "first_k_dense_replace": ABSENT, "attention_bias": True}),
    "minicpm3": ("MiniCPM3", {**DEEPSEEK, "v_head_dim": ABSENT, "attention_bias": True,
                              "n_routed_experts": ABSENT, "num_experts_per_tok": ABSENT,
                              "n_group": ABSENT, "topk_group": ABSENT,
                              "moe_intermediate_size": ABSENT, "first_k_dense_replace": ABSENT,
                              "n_shared_experts": ABSENT, "experts_implementation": ABSENT}),
    # Cohere Compass's text model: a rope per layer type (a multimodal one: of text
    # positions, the plain rope), none on its sliding layers
    "cohere_compass_text": ("CohereCompassText", {
        "sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING], "attention_bias": True,
        "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 3000.0,
                                   "mrope_section": [2, 2, 2]}, SLIDING: None}}),
    # LongCat-Flash: two latent attentions per decoder layer (four layers), its query and
    # latent scaled by sqrt(hidden_size / rank)
    "longcat_flash": ("LongcatFlash", {
        **DEEPSEEK, "num_hidden_layers": ABSENT, "num_layers": 2, "head_dim": 8,
        "n_routed_experts": 4, "moe_topk": 2, "zero_expert_num": 1,
        "expert_ffn_hidden_size": 16, "ffn_hidden_size": 32, "intermediate_size": ABSENT,
        "num_experts_per_tok": ABSENT, "n_group": ABSENT, "topk_group": ABSENT,
        "moe_intermediate_size": ABSENT, "first_k_dense_replace": ABSENT,
        "n_shared_experts": ABSENT, "attention_bias": True}),
    # NanoChat: rotation by the negated angles, then a QK-norm without weights
    "nanochat": ("NanoChat", {"head_dim": ABSENT, "attention_bias": True}),
    # layers without rope (NoPE): layer 1 by no_rope_layers (sliding, by the default
    # layer_types), the full layer of Cohere 2 and EXAONE 4 (rope on the sliding ones)
    "smollm3": ("SmolLM3", {"no_rope_layers": [1, 0, 1], "use_sliding_window": True,
                            "sliding_window": 5, "attention_bias": True}),
    "cohere2": ("Cohere2", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                            "attention_bias": True}),
    # Cohere 2 MoE: the dense layer 0 full with rope, layer 1 sliding, layer 2 full without
    "cohere2_moe": ("Cohere2Moe", {"sliding_window": 5, "first_k_dense_replace": 1,
                                   "sliding_window_pattern": 2, "attention_bias": True,
                                   "num_experts": 4, "num_experts_per_tok": 2,
                                   "experts_implementation": "eager"}),
    "exaone4": ("Exaone4", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                            "rms_norm_eps": 1e-5}),
    # partial rotary: interleaved pairs over half of each head (GLM's default fraction),
    # the halves of 8 of 12 features (MiniMax-M2's rotary_dim), of a quarter of StableLM's
    # heads of 24 (its head_dim is hidden_size // heads whatever the config says)
    "glm": ("Glm", {}),
    "glm4": ("Glm4", {}),
    "glm4_moe": ("Glm4Moe", {"use_qk_norm": True, "attention_bias": True, "n_routed_experts": 4,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                             "first_k_dense_replace": 1, "experts_implementation": "eager"}),
    "minimax_m2": ("MiniMaxM2", {"rotary_dim": 8, "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "experts_implementation": "eager"}),
    "stablelm": ("StableLm", {"num_attention_heads": 2, "head_dim": None, "use_qkv_bias": True,
                              "qk_layernorm": True, "layer_norm_eps": 1e-3}),
    "phi": ("Phi", {"qk_layernorm": True, "layer_norm_eps": 1e-3}),
    # AFMoE: a sigmoid output gate (gate_proj), rope on the sliding layers only
    "afmoe": ("Afmoe", {"sliding_window": 5, "global_attn_every_n_layers": 2,
                        "num_dense_layers": 1, "num_shared_experts": 1, **MOE}),
    # Laguna: a softplus gate per head, each layer its own heads, a rope per layer type
    "laguna": ("Laguna", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                          "num_attention_heads_per_layer": [4, 6, 2],
                          "shared_expert_intermediate_size": 16, **MOE,
                          "rope_parameters": {
                              FULL: {"rope_type": "default", "rope_theta": 3000.0,
                                     "partial_rotary_factor": 0.5},
                              SLIDING: {"rope_type": "default", "rope_theta": 100.0}}}),
    "laguna_per_element": ("Laguna", {"gating": False, "num_hidden_layers": 1, "rope_parameters": {
        FULL: {"rope_type": "default", "rope_theta": 3000.0}}}),
    # HunYuan: QK-norm per head after the rotation
    "hunyuan_v1_dense": ("HunYuanDenseV1", {"attention_bias": True}),
    "hunyuan_v1_moe": ("HunYuanMoEV1", {"num_experts": 4, "moe_topk": 2,
                                        "experts_implementation": "eager"}),
    # Persimmon: GPT-NeoX's fused layout with LayerNorms of the queries and keys
    "persimmon": ("Persimmon", {"head_dim": None, "layer_norm_eps": 1e-3}),
    "nemotron": ("Nemotron", {"attention_bias": True}),
    # interleaved pairs over the whole head
    "cohere": ("Cohere", {"attention_bias": True, "use_qk_norm": True, "layer_norm_eps": 1e-3}),
    "ernie4_5": ("Ernie4_5", {"use_bias": True}),
    "ernie4_5_moe": ("Ernie4_5_Moe", {"use_bias": True, "moe_num_experts": 4, "moe_k": 2,
                                      "moe_intermediate_size": 16, "moe_num_shared_experts": 1,
                                      "experts_implementation": "eager"}),
    "cwm": ("Cwm", {"sliding_window": 5, "rope_parameters": LLAMA3,  # layer 0 full
                    "bos_token_id": 0}),
    "mellum": ("Mellum", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING], **MOE,
                          "rope_parameters": {
                              SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                              FULL: {"rope_type": "default", "rope_theta": 3000.0}}}),
    # older layouts: fused or renamed projections (their num_key_value_heads and head_dim,
    # which these families ignore, stay in config.json), no rope or ALiBi
    "gpt2": ("GPT2", {**OLDER, "scale_attn_by_inverse_layer_idx": True}),
    "gpt_bigcode": ("GPTBigCode", OLDER),  # multi-query: one key/value head
    "gpt_bigcode_mha": ("GPTBigCode", {**OLDER, "multi_query": False}),
    "gpt_neox": ("GPTNeoX", {"head_dim": ABSENT, "attention_bias": True, "rope_parameters": {
        "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}),
    # GPT-NeoX-Japanese: the output bias of the last layer alone
    "gpt_neox_japanese": ("GPTNeoXJapanese", {"head_dim": ABSENT, "rope_parameters": {
        "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}),
    "gptj": ("GPTJ", {**OLDER, "rotary_dim": 8}),
    "codegen": ("CodeGen", {**OLDER, "rotary_dim": 8}),
    "gpt_neo": ("GPTNeo", {**OLDER, "window_size": 5,
                           "attention_types": [[["global", "local"], 1], [["local"], 1]]}),
    "bloom": ("Bloom", {**OLDER, "num_attention_heads": 6}),  # ALiBi of 6 heads
    "mpt": ("Mpt", {**OLDER, "num_attention_heads": 6, "max_seq_len": 64,
                    "attn_config": {"softmax_scale": 0.2, "clip_qkv": 1.5}}),
    # DBRX: one Wqkv, clamped, grouped key/value heads of attn_config, Llama's rotary
    "dbrx": ("Dbrx", {"head_dim": ABSENT, "hidden_size": ABSENT, "d_model": 48,
                      "attn_config": {"kv_n_heads": 2, "clip_qkv": 1.5, "rope_theta": 500.0},
                      "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4,
                                     "moe_top_k": 2}}),
    "falcon": ("Falcon", {"head_dim": ABSENT, "new_decoder_architecture": True,
                          "num_kv_heads": 2, "bias": True}),
    "falcon_alibi": ("Falcon", {**OLDER, "alibi": True, "multi_query": False, "bias": True,
                                "num_attention_heads": 6}),
    "opt": ("OPT", {**OLDER, "word_embed_proj_dim": 48, "ffn_dim": 32}),
    "biogpt": ("BioGpt", OLDER),
    "xglm": ("XGLM", {**OLDER, "ffn_dim": 32}),
    "ctrl": ("CTRL", {**OLDER, "dff": 32}),
    "openai-gpt": ("OpenAIGPT", OLDER),  # no cache: decoding against each prefix's last token
    "modernbert-decoder": ("ModernBertDecoder", {
        "head_dim": ABSENT, "local_attention": 10, "attention_bias": True, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                            FULL: {"rope_type": "default", "rope_theta": 3000.0}}}),
    # hybrid models: the attention layers (0 and 2) between Mamba or convolution layers,
    # each refused by its index; Falcon-H1's attention beside a Mamba mixer in every layer
    "granitemoehybrid": ("GraniteMoeHybrid", {
        **HYBRID_MAMBA, "layer_types": [FULL, "linear_attention", FULL],
        "attention_multiplier": 0.3, "position_embedding_type": "rope", "attention_bias": True,
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 16,
        "experts_implementation": "eager"}),
    "falcon_h1": ("FalconH1", {"key_multiplier": 0.4, "attention_bias": True}),
    "jamba": ("Jamba", {"attn_layer_period": 2, "attn_layer_offset": 0, "num_experts": 4,
                        "use_mamba_kernels": False, "experts_implementation": "eager"}),
    "nemotron_h": ("NemotronH", {
        "layers_block_type": [FULL, "linear_attention", FULL], "mamba_num_heads": 4,
        "mamba_head_dim": 24, "n_groups": 1, "num_hidden_layers": ABSENT}),
    "bamba": ("Bamba", {**HYBRID_MAMBA, "attn_layer_indices": [0, 2], "attention_bias": True}),
    "lfm2": ("Lfm2", {"full_attn_idxs": [0, 2]}),
    # OLMo-hybrid without rope, as released (rope_theta null)
    "olmo_hybrid": ("OlmoHybrid", {"layer_types": [FULL, "linear_attention", FULL],
                                   "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": None}}),
    # Lara-mini: a sliding layer with rope, a full one without; RecurrentGemma's local
    # attention (partial rotary, an output bias always) between its RG-LRU layers
    "lara_mini": ("LaraMini", {"layer_types": [SLIDING, "linear_attention", FULL],
                               "sliding_window": 5, "attention_bias": True,
                               "rms_norm_eps": 1e-5, **MOE}),
    "recurrent_gemma": ("RecurrentGemma", {"block_types": ["attention", "recurrent"],
                                           "attention_window_size": 6, "head_dim": ABSENT,
                                           "num_key_value_heads": 1}),
    "minimax": ("MiniMax", {"layer_types": [FULL, "linear_attention", FULL],
                            "sliding_window": 6, "block_size": 8, **MOE}),
    "lfm2_moe": ("Lfm2Moe", {"layer_types": [FULL, "conv", FULL], "num_experts": 4,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                             "num_dense_layers": 1, "experts_implementation": "eager"}),
    # position-dependent query temperatures: Llama 4's chunked rope layers with its L2
    # QK-norm and its layer without rope (1) with attn_temperature_tuning past floor_scale
    # (4); Ministral 3's llama_4_scaling_beta past original_max_position_embeddings
    "llama4_text": ("Llama4Text", {"no_rope_layers": [1, 0, 1], "attention_chunk_size": 8,
                                   "floor_scale": 4, "attn_scale": 0.5, "use_qk_norm": True,
                                   "intermediate_size_mlp": 32, "num_local_experts": 2,
                                   "experts_implementation": "eager"}),
    "ministral3_scaled": ("Ministral3", {"sliding_window": 6, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 8.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5,
        "original_max_position_embeddings": 6}}),
    # Beam: sliding layers with rope, a full one without whose queries grow by the power
    # law; QK-norm per head, a sigmoid gate per feature with a bias a head (gate_bias)
    "beam": ("Beam", {"layer_types": [SLIDING, FULL, SLIDING], "sliding_window": 5,
                      "attention_bias": True, "rope_parameters": {
                          SLIDING: {"rope_type": "default", "rope_theta": 500.0}, FULL: None}}),
    # sparse top-k attention: each query attends to the 4 keys its indexer picks
    "deepseek_v32": ("DeepseekV32", {**DEEPSEEK, "index_topk": 4, "index_n_heads": 3,
                                     "index_head_dim": 12}),
    "glm_moe_dsa": ("GlmMoeDsa", {**DEEPSEEK, "index_topk": 5, "index_n_heads": 2,
                                  "index_head_dim": 10}),
    # Mistral 4: DeepSeek's latent attention, its queries scaled past position 6
    "mistral4": ("Mistral4", {**DEEPSEEK, "rope_parameters": {
        **DEEPSEEK["rope_parameters"], "llama_4_scaling_beta": 0.5,
        "original_max_position_embeddings": 6, "partial_rotary_factor": 0.5}}),
    # the gated hybrids (issue 33): Qwen3-Next's gate fused into q_proj (biased), half of each
    # head rotated, QK-norm of 1 + weight, Qwen3.5's multimodal rope as text's, between Gated
    # DeltaNet layers; LFM3's gate per head, a proportional rope on its full layers
    "qwen3_next": ("Qwen3Next", {"layer_types": [FULL, "linear_attention", FULL],
                                 "attention_bias": True, **GATED_DELTANET, **MOE,
                                 "shared_expert_intermediate_size": 16, "rope_parameters": {
                                     **ROPE, "partial_rotary_factor": 0.5}}),
    "qwen3_5_text": ("Qwen3_5Text", {"layer_types": [FULL, "linear_attention", FULL],
                                     **GATED_DELTANET, "rope_parameters": QWEN3_5_ROPE}),
    "qwen3_5_moe_text": ("Qwen3_5MoeText", {"layer_types": [FULL, "linear_attention", FULL],
                                            **GATED_DELTANET, **MOE,
                                            "rope_parameters": QWEN3_5_ROPE,
                                            "shared_expert_intermediate_size": 16}),
    "lfm3": ("Lfm3", {"layer_types": [FULL, "conv", SLIDING], "sliding_window": 5,
                      "norm_eps": 1e-5, "rope_parameters": {
                          SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                          FULL: {"rope_type": "proportional", "rope_theta": 3000.0,
                                 "partial_rotary_factor": 0.5}}}),
    # Bailing-hybrid: DeepSeek's latent attention (yarn, biases) with a gate per head, its
    # layer 1 Kimi Delta Attention
    "bailing_hybrid": ("BailingHybrid", {
        **{key: DEEPSEEK[key] for key in LATENT_SIZES}, "attention_bias": True,
        "layer_types": [FULL, "linear_attention", FULL], "mlp_layer_types": ["dense"] * 3}),
    # MiMo-V2-Flash: values 8 wide beside keys of 12, scaled; in the sliding layers twice
    # the key/value heads and sinks; a partial rope of its own base per layer type
    "mimo_v2_flash": ("MiMoV2Flash", {
        "v_head_dim": 8, "attention_value_scale": 1.7, "sliding_window": 5,
        "layer_types": [SLIDING, FULL, SLIDING], "attention_bias": True, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "experts_implementation": "eager",
        "rope_parameters": {
            FULL: {"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 0.334},
            SLIDING: {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}}}),
    # DiffLlama: differential attention, 4 pairs of heads over 4 key/value heads (two
    # halves of 2: each query head's values two of them joined)
    "diffllama": ("DiffLlama", {"num_attention_heads": 8, "num_key_value_heads": 4,
                                "attention_bias": True, "rms_norm_eps": 1e-2}),
    # the values' norm; layer 2 attends with layer 0's keys and values (KV sharing)
    "gemma3n": ("Gemma3nText", {"sliding_window": 5, "layer_types": [SLIDING, FULL, SLIDING],
                                "num_kv_shared_layers": 1, "laurel_rank": 8,
                                "hidden_size_per_layer_input": 8,
                                "vocab_size_per_layer_input": 64, "rope_parameters": {
                                    SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                                    FULL: {"rope_type": "default", "rope_theta": 3000.0}}}),
    # full layers of wider heads, one key/value head, values that are the keys' projection
    # and a proportional rope; layer 2 attends with layer 1's keys and values
    "gemma4": ("Gemma4Text", {"sliding_window": 5, "layer_types": [SLIDING, FULL, FULL],
                              "num_kv_shared_layers": 1, "attention_k_eq_v": True,
                              "global_head_dim": 16, "num_global_key_value_heads": 1,
                              "hidden_size_per_layer_input": 8,
                              "vocab_size_per_layer_input": 64, "rope_parameters": {
                                  SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                                  FULL: {"rope_type": "proportional", "rope_theta": 3000.0,
                                         "partial_rotary_factor": 0.5}}}),
    "gemma4_unified": ("Gemma4UnifiedText", {"sliding_window": 5, "global_head_dim": 8,
                                             "layer_types": [SLIDING, SLIDING, FULL],
                                             "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 100.0},
        FULL: {"rope_type": "proportional", "rope_theta": 3000.0,
               "partial_rotary_factor": 0.25}}}),
    # BitNet: an RMSNorm of the joined heads before o_proj, of a large epsilon
    "bitnet": ("BitNet", {"rms_norm_eps": 0.3}),
    # HY-V4: sparse top-k attention (4 keys of 3 indexer heads, their last 8 features
    # rotated, its LayerNorm of rms_norm_eps; layer 1 reusing layer 0's choice), a sigmoid
    # gate per feature, a sink a head, yarn and biases
    "hy_v4": ("HYV4", {**{key: DEEPSEEK[key] for key in LATENT_SIZES}, "attention_bias": True,
                       "index_topk": 4, "index_n_heads": 3, "index_head_dim": 12,
                       "indexer_types": ["full", "shared", "full"],
                       "mlp_layer_types": ["dense"] * 3,
                       "hc_mult": 2, "rms_norm_eps": 2.0}),
    # Kimi-Linear's latent attention without rope between its KDA layers; Zamba's attention
    # block shared by layers 0 and 2 (grouped heads of attention_head_dim), Zamba2's two
    # blocks in turn (layers 0 and 3 share one) with per-layer adapters and a rope, each
    # reading the hidden states joined to the embeddings (96 wide)
    "kimi_linear": ("KimiLinear", {
        "head_dim": ABSENT, "rope_parameters": ABSENT, "num_key_value_heads": 4,
        "layer_types": [FULL, "linear_attention", FULL], "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 10, "linear_head_dim": 12,
        "linear_num_heads": 4, **MOE, "num_experts_per_tok": ABSENT,
        "num_experts_per_token": 2}),
    "zamba": ("Zamba", {"rope_parameters": ABSENT, "n_mamba_heads": 2,
                        "layers_block_type": ["hybrid", "linear_attention", "hybrid"]}),
    "zamba2": ("Zamba2", {"head_dim": ABSENT, "num_key_value_heads": 4, "num_hidden_layers": 4,
                          "layers_block_type": ["hybrid", "linear_attention", "hybrid", "hybrid"],
                          "n_mamba_heads": 4, "num_mem_blocks": 2, "adapter_rank": 8,
                          "use_shared_attention_adapter": True, "use_mem_rope": True}),
    # A.X-K2: DeepSeek-V3.2's indexer (top 4), the query and a sigmoid gate per feature
    # fused in q_gate_proj, both reading the query latent after and before its norm
    "axk2": ("AXK2", {**DEEPSEEK, "index_topk": 4, "index_n_heads": 3, "index_head_dim": 12,
                      "gated_norm_rank": 4}),
    # dots3: a gate per head; layers 0 and 1 GLM-MoE-DSA's indexer (top 4), layer 2 a
    # window of 5 and its own sizes (2 heads, ranks 12 and 8, half the rope)
    "dots3_note_text": ("Dots3NoteText", {
        **{key: DEEPSEEK[key] for key in LATENT_SIZES if key != "rope_parameters"},
        "head_dim": 16, "rope_parameters": ABSENT, "rope_theta": 500.0, "swa_rope_theta": 100.0,
        "index_topk": 4, "index_n_heads": 3, "index_head_dim": 12, "sliding_window": 5,
        "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 12,
        "swa_kv_lora_rank": 8, "swa_head_dim": 12, "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 6, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_experts_intermediate_size": 16,
        "experts_implementation": "eager"}),
    # block-sparse top-k attention: MiniMax-M3's sparse layers 0 and 2 keep, per group of
    # heads, 3 blocks of 4 keys of the 6 (2 of them local), its layer 1 dense; half rotated
    "minimax_m3_vl_text": ("MiniMaxM3VLText", {
        "layer_types": ["minimax_m3_sparse", FULL, "minimax_m3_sparse"], "index_n_heads": 2,
        "index_head_dim": 10, "index_block_size": 4, "index_topk_blocks": 3,
        "index_local_blocks": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "dense_intermediate_size": 32, "shared_intermediate_size": 16,
        "experts_implementation": "eager",
        "rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}),
    # Qwen4-Exp's QSA: each query keeps 2 blocks of 3 averaged keys beside its tail, in its
    # indexed layers 0 and 2 (Qwen3.5's gated attention), layer 1 Gated DeltaNet
    "qwen4_exp_text": ("Qwen4ExpText", {
        "layer_types": ["indexed_attention", "linear_attention", "indexed_attention"],
        **GATED_DELTANET, **MOE, "shared_expert_intermediate_size": 16, "hc_count": 2,
        "hc_lowrank": 8, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 12,
        "indexer_budget": 6, "indexer_compress_ratio": 3, "rope_parameters": QWEN3_5_ROPE}),
    # recurrent stacks of 2 layers, 2 H cycles of 1 L cycle: 8 cache slots (L0 L1 H0 H1 twice)
    "hrm_text": ("HrmText", {"num_hidden_layers": 2, "H_cycles": 2, "L_cycles": 1}),
    # the dynamic mask's top 6 keys of each query's (of 24 positions), every bias; 24 tokens
    # that do not repeat (equal biases: which of them torch.topk keeps is unspecified)
    "doge": ("Doge", {"keep_window_size": 6, "attention_bias": True, "vocab_size": 1000}),
    # nGPT's attention (biases, a window of 6); its recurrent layer 1 run in 3 loops: 5 cache
    # slots (layers 0 1 2, then layer 1's later loops), each layer type's base
    "dory": ("Dory", {"n_input_layers": 1, "n_output_layers": 1, "n_recurrent_loops": 3,
                      "layer_types": [SLIDING, SLIDING, FULL], "sliding_window": 6,
                      "attention_bias": True,
                      "rope_parameters": {SLIDING: ROPE, FULL: {**ROPE, "rope_theta": 5000.0}}}),
    # not causal, a bias by segment: 16 buckets of distances to 40 (logarithmic past 4), its
    # 3 segments (prompt 0, text 2) over 4 prompt tokens and the text
    "cpmant": ("CpmAnt", {"dim_head": 12, "dim_ff": 32, "position_bias_num_buckets": 16,
                          "position_bias_max_distance": 40, "segment_types": 3,
                          "prompt_types": 3, "prompt_length": 4, "init_std": 0.3}),
}  # fmt: skip
"""Each family's config class's name (``{name}Config``; the model is the causal LM
transformers maps its ``model_type`` to, ``Gemma3ForCausalLM`` for Gemma 3's text config,
``LlamaForCausalLM`` for InternLM 3's) and what its config changes from ``COMMON``."""

FAMILIES = tuple(MODELS)
"""The checkpoints :func:`saved` builds; ``deepseek_v3_mha`` is DeepSeek V3 without the
query's low-rank projection (``q_lora_rank=None``), with biases and halves rotary."""
BLOCK_SPARSE = ("minimax_m3_vl_text", "qwen4_exp_text")
"""The checkpoints of block-sparse attention (``BlockSparseAttention`` in their sparse layers,
read by ``mha.from_pretrained``)."""

DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v3_mha")
LATENT_FAMILIES = (*DEEPSEEK_FAMILIES, "glm4_moe_lite", "youtu", "sarvam_mla", "axk1", "minicpm3",
                   "longcat_flash", "deepseek_v32", "glm_moe_dsa",
                   "bailing_hybrid", "mistral4", "hy_v4", "kimi_linear", "axk2",
                   "dots3_note_text")  # fmt: skip
"""The checkpoints of DeepSeek's multi-head latent attention (``LatentAttention``)."""
OTHER_LAYOUTS = ("gpt2", "gpt_bigcode", "gpt_bigcode_mha", "gpt_neox", "gpt_neox_japanese",
                 "gptj", "codegen", "gpt_neo", "bloom", "mpt", "dbrx", "persimmon", "falcon",
                 "falcon_alibi", "opt", "biogpt", "xglm", "ctrl", "openai-gpt",
                 "modernbert-decoder", "diffllama", "hrm_text", "doge", "dory",
                 "cpmant")  # fmt: skip
"""The families whose attention modules are not Llama's (DiffLlama's: differential; HRM's,
in its two stacks, each run in several cache slots; Doge's, with its dynamic mask;
CPM-Ant's, with its bias by segment)."""
HYBRIDS = ("granitemoehybrid", "falcon_h1", "jamba", "nemotron_h", "bamba", "lfm2", "lfm2_moe",
           "minimax", "olmo_hybrid", "lara_mini", "recurrent_gemma", "qwen3_next", "qwen3_5_text",
           "qwen3_5_moe_text", "lfm3", "bailing_hybrid", "kimi_linear", "zamba", "zamba2",
           "qwen4_exp_text")  # fmt: skip
"""The hybrid models: attention layers between Mamba or convolution layers (Falcon-H1's
beside a Mamba mixer in each layer)."""
JOINED = ("zamba", "zamba2")
"""The families whose attention reads the hidden states joined to the embeddings, twice the
hidden size wide (``qdim``)."""
GEMMA_VALUES = ("gemma3n", "gemma4", "gemma4_unified")
"""Gemma 3n's and Gemma 4's: layers without keys and values of their own (KV sharing), keys
as values, heads of each layer's own width (their layers' settings and weights are checked
against transformers' modules in test_gemma4.py)."""
LLAMA_LAYOUT = tuple(
    family for family in FAMILIES if family not in OTHER_LAYOUTS + HYBRIDS + GEMMA_VALUES
)
"""The families whose attention is Llama's module in every layer, ``model.layers[i].self_attn``,
with its attributes (``scaling``, ``head_dim``, ``q_proj``, ...)."""


def _settings(family: str) -> tuple[str, str, dict[str, Any]]:
    """The config class, the model class and the config's settings of ``family``."""
    if family not in MODELS:
        raise KeyError(f"no tiny model of family {family!r}; the families are {FAMILIES}")
    import transformers

    name, changes = MODELS[family]
    # a copy: config classes complete rope_parameters in place (GLM's partial_rotary_factor)
    settings = copy.deepcopy({**COMMON, "rope_parameters": ROPE, **changes})
    for key in [key for key in ("head_dim",) if settings[key] is None]:
        del settings[key]
    for key in [key for key, value in settings.items() if value is ABSENT]:
        del settings[key]
    model_type = getattr(transformers, f"{name}Config").model_type
    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    # Mistral 4's causal LM is outside transformers' (5.24) causal-LM mapping
    return f"{name}Config", causal.get(model_type, f"{name}ForCausalLM"), settings


def build(family: str, seed: int = 0) -> Any:
    """A random float32 ``ForCausalLM`` of ``family``, in evaluation mode, with every
    attention weight nonzero and away from its initial value."""
    import torch
    import transformers

    config_name, model_name, settings = _settings(family)
    config = getattr(transformers, config_name)(
        **settings, attn_implementation=_implementation(family)
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        parameters = [p for module in attention_modules(model) for p in module.named_parameters()]
        for name, parameter in parameters:
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
            elif "norm" in name:  # QK-norm weights: ones (zeros for Gemma's 1 + w) at first
                parameter.normal_(1.0 if "gemma" not in family else 0.0, 0.3)
            elif name.endswith("sinks"):
                parameter.normal_(0.0, 1.5)
            elif name == "A":  # Doge's dynamic mask: zeros (a bias of one) at first
                parameter.normal_(0.0, 1.0)
            elif name in ("sqk", "s_gate"):  # Dory's nGPT scales: constants at first
                parameter.mul_(1.0 + 0.3 * torch.randn_like(parameter))
    return model


def attention_modules(model: Any) -> list[Any]:
    """Each attention layer's attention module in ``model`` (a hybrid's attention layers
    alone), where the reader's row of its ``model_type`` says it is."""
    from mha.integrations.readers.layouts import module_path
    from support.transformers_oracle import attention_layers

    path, config = attention_path(model), model.config.to_dict()
    return [model.get_submodule(module_path(path, i, config)) for i in attention_layers(model)]


def attention_path(model: Any) -> str:
    """The module path of layer ``{i}``'s attention in ``model``: the readers' layout's
    (Nemotron-H's ``backbone.`` loaded as ``model.``), but Llama's where transformers loads
    a family's own tensor names into Llama's modules (EXAONE 3, Sarvam-MoE)."""
    from mha.integrations import readers
    from support.transformers_oracle import attention_layers

    path = str(readers.FAMILIES[model.config.model_type].tensors.path)
    path = path.replace("backbone.", "model.")  # Nemotron-H's saved names, loaded renamed
    for candidate in (path, path.removesuffix(".attn") + ".self_attn"):  # HRM's, loaded
        try:
            first = attention_layers(model)[0]
            model.get_submodule(candidate.format(i=first, j=0, stack="L", looped=0))
        except AttributeError:
            continue
        return candidate
    return "model.layers.{i}.self_attn"


EAGER = ("gemma2", "gpt_oss", "vaultgemma", "gpt_neo", "bloom", "mpt", "xglm", "openai-gpt",
         "gpt_neox_japanese", "flint", "granite_swa", "granitemoe_swa",
         "mimo_v2_flash", "hy_v4", "cpmant")  # fmt: skip
"""The families whose attention is eager only (Gemma 2's and VaultGemma's soft-capping,
gpt-oss's, Flint's, GraniteSWA's and HY-V4's sinks, the older families' own attention code)."""


def _implementation(family: str) -> str:
    """SDPA where the family has it (the eager attention takes its softmax in float32)."""
    return "eager" if family in EAGER else "sdpa"


def saved(family: str) -> Path:
    """The folder of ``family``'s checkpoint: bfloat16 weights in several safetensors shards
    with their index, and ``config.json``; built on the first call of a session."""
    if family not in _SAVED:
        import torch

        folder = _root() / family
        with _quiet():
            model = build(family).to(torch.bfloat16)
            model.save_pretrained(folder, max_shard_size=SHARD_SIZE)
        shards = sorted(folder.glob("model-*.safetensors"))
        if len(shards) < 2 or not (folder / "model.safetensors.index.json").is_file():
            raise RuntimeError(
                f"{family}: save_pretrained wrote {len(shards)} shard(s), not several"
            )
        _SAVED[family] = folder
    return _SAVED[family]


@functools.cache
def captured(family: str, batch: int, length: int, vocab: int | None = None) -> Any:
    """``(model, keywords)``: the float64 transformers model of ``family`` (its rotary in
    float64) and, for each layer, the keywords its ``self_attn`` got in a forward over
    ``batch`` sequences of ``length`` token ids drawn (seed 0) below ``vocab`` (default: the
    config's vocabulary); ``None`` for a layer without one."""
    import torch

    from support.rope_oracle import float64_rotary
    from support.transformers_oracle import attention_keywords

    model = transformers_model(family)
    float64_rotary(model)
    below = model.config.vocab_size if vocab is None else vocab
    ids = torch.randint(0, below, (batch, length), generator=torch.Generator().manual_seed(0))
    return model, attention_keywords(model, ids)


def transformers_model(family: str, folder: Path | None = None) -> Any:
    """``family``'s saved checkpoint (or the one in ``folder``, a variant of it) loaded by
    transformers in float64, for oracles, as ``AutoModelForCausalLM`` loads it (EXAONE 3's
    config class with Llama's model)."""
    import torch
    import transformers

    _, model_name, settings = _settings(family)
    model_class = transformers.AutoModelForCausalLM
    if model_name == "Mistral4ForCausalLM":  # outside the causal-LM mapping (transformers 5.24)
        model_class = transformers.Mistral4ForCausalLM
    folder = saved(family) if folder is None else folder
    # the experts' grouped matrix products take no float64: their loop does
    experts = {"experts_implementation": "eager"} if "experts_implementation" in settings else {}
    with _quiet():
        model = model_class.from_pretrained(
            folder, dtype=torch.float64, attn_implementation=_implementation(family), **experts
        )
    float64_parameters(model)
    return model.eval()


def float64_parameters(model: Any) -> None:
    """The parameters a module makes float32 whatever the model's dtype (HunYuan-MoE's
    router, ``wg``) in float64 too, as the rest of the oracle's model."""
    import torch

    for parameter in model.parameters():
        if parameter.dtype == torch.float32:
            parameter.data = parameter.data.double()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers without its progress bars and its advice on the tiny configs (token ids
    outside the vocabulary, longrope's factor)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()


def _root() -> Path:
    if not _ROOT:
        root = Path(tempfile.mkdtemp(prefix="mha-pretrained-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _ROOT.append(root)
    return _ROOT[0]


def decoding_calls(model: Any, B: int, L: int, prefill: int) -> dict[int, list[Any]]:
    """Each attention layer's calls in ``model`` (float64, its rotary made float64 first), by
    layer index (a hybrid model's attention layers alone), ``(input, output)`` as NumPy: a
    whole sequence of ``L`` tokens for each of ``B``, then a prefill of ``prefill`` tokens
    and each decoding step with transformers' cache (:func:`drive`)."""
    from support.transformers_oracle import AttentionRecorder

    recorder = AttentionRecorder(model, attention_path(model))
    try:
        drive(model, B, L, prefill, recorder.calls)
    finally:
        recorder.close()
    return dict(zip(recorder.layers, recorder.calls, strict=True))


OWN_CACHES = {"minimax": "MiniMaxCache"}
"""The families whose model takes a cache of its own class (in its modeling module), not
transformers' DynamicCache."""


def new_cache(model: Any) -> Any:
    """An empty cache of ``model``: its family's own (:data:`OWN_CACHES`), else a
    DynamicCache of its config (a hybrid's: per layer type)."""
    import sys

    import transformers

    own = OWN_CACHES.get(model.config.model_type)
    if own is not None:
        return getattr(sys.modules[type(model).__module__], own)()
    return transformers.DynamicCache(config=model.config)


WHOLE_IDS = ("cpmant",)
"""The families whose model takes each decoding step's whole token ids (CPM-Ant's, which
prepends its prompt and cuts the cached positions off)."""

POSITIONS_GIVEN = ("bamba",)
"""The families whose model numbers a step's positions from 0 whatever its cache holds
(``BambaModel``: ``arange`` of the input's length): their decoding steps are given their
``position_ids``, as ``generate`` gives them."""


def token_ids(vocab_size: int, B: int, L: int) -> Any:
    """The token ids :func:`drive` runs: ``(B, L)`` integers, seeded."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (B, L), generator=generator).numpy()


def drive(model: Any, B: int, L: int, prefill: int, calls: Any) -> None:
    """Run ``model`` (float64) on random tokens while hooks record each layer's attention
    calls into ``calls`` (a list per layer): a whole sequence of ``L`` tokens for each of
    ``B``, then a prefill of ``prefill`` tokens and each decoding step with transformers'
    cache (:func:`new_cache`; the steps' positions given where the model would not count them:
    :data:`POSITIONS_GIVEN`). A model without a cache (GPT-1) computes each step as the last
    token of its prefix, which a causal attention computes the same: its steps' calls are
    cut to that token."""
    import torch

    from support.rope_oracle import float64_torch

    ids = torch.tensor(token_ids(model.config.vocab_size, B, L))
    cached = "cache" in inspect.signature(model.forward).parameters
    with torch.no_grad(), float64_torch():
        model(ids)
        if cached:
            cache = new_cache(model)
            model(ids[:, :prefill], cache=cache, use_cache=True)
            for t in range(prefill, L):
                positions = {}
                if model.config.model_type in POSITIONS_GIVEN:
                    positions = {"position_ids": torch.arange(t, t + 1)[None]}
                start = 0 if model.config.model_type in WHOLE_IDS else t
                model(ids[:, start : t + 1], cache=cache, use_cache=True, **positions)
        else:
            for t in range(prefill, L + 1):
                model(ids[:, :t])
    if not cached:  # each step: the last token of its prefix
        for layer_calls in calls:
            layer_calls[2:] = [(x[:, -1:], out[:, -1:]) for x, out in layer_calls[2:]]


def changed(read: Any, change: dict[str, Any]) -> Any:
    """``layer_attention`` (given as ``read``) with the settings in ``change`` replaced, and
    the weights it names as ``None`` dropped: what a comparison must then catch."""

    def layer_attention(checkpoint: Any, layer: int, dtype: Any = None) -> Any:
        kind, settings, weights = read(checkpoint, layer, dtype)
        weights = {name: W for name, W in weights.items() if name not in change}
        settings = {**settings, **{k: v for k, v in change.items() if k in settings}}
        return kind, settings, weights

    return layer_attention
