"""Tiny random GGUF files, written as llama.cpp's ``convert_hf_to_gguf.py`` writes a
transformers model: its metadata keys, its tensor names (gguf's own ``TensorNameMap``, as the
converter maps them), what the converter does to the tensors (llama's query and key rows
permuted for interleaved rotary, Gemma's and Nemotron's norm weights plus 1, GPT-2's Conv1D
weights transposed, BLOOM's fused rows regrouped, the tied head written as a copy of the
embeddings where it writes one), each matrix quantized by the ``gguf`` package's own
``quantize`` (norms and biases in float32, as llama.cpp keeps every 1-D tensor).

``write_gguf(model, path, "Q4_0")`` writes a transformers ``LlamaForCausalLM`` (or
Mistral's, Qwen2's, Qwen3's, Qwen2-MoE's, Qwen3-MoE's, Phi-3's, Gemma 2's, Gemma 3's,
Nemotron's, StableLM's, StarCoder2's, GPT-2's, BLOOM's, Falcon-7B's, LFM2's, MiniMax-M2's);
transformers' GGUF loader reads it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

ARCH = {
    "mistral": "llama",
    "gemma3_text": "gemma3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "minimax_m2": "minimax-m2",
}
"""``general.architecture`` where it is not the ``model_type``: llama.cpp writes Mistral as
Llama (``general.name`` tells transformers), Gemma 3's text model as ``gemma3``, the
Qwen-MoEs without the underscore."""

PLUS_ONE = ("gemma2", "gemma3_text", "nemotron")
TRANSPOSED = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # GPT-2's Conv1D weights


def gguf_name(name: str, arch: str, layers: int) -> str:
    """llama.cpp's name of the transformers tensor ``name``, by gguf's own map (BLOOM's
    converter first drops the ``transformer.`` prefix)."""
    import gguf

    kind = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(kind, layers)
    stem, suffix = name.rsplit(".", 1)
    mapped = names.get_name(stem) or names.get_name(stem.removeprefix("transformer."))
    if mapped is None:
        raise ValueError(f"gguf names no tensor {name} of {arch}")
    return f"{mapped}.{suffix}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of each head's rows for interleaved rotary."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def bloom_qkv(weights: np.ndarray, heads: int) -> np.ndarray:
    """BLOOM's converter's regrouping of the fused rows (per head: query, key, value) as all
    the queries, then the keys, then the values."""
    w = weights.reshape(heads, 3, weights.shape[0] // heads // 3, *weights.shape[1:])
    return w.swapaxes(0, 1).reshape(weights.shape)


K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Where each K-quant block keeps its float16 scales (``d``, and ``dmin`` where it has one)."""


def random_k_quant(shape: tuple[int, ...], quantization: str, seed: int) -> np.ndarray:
    """Random blocks of a K-quant type (which gguf cannot quantize to) for a matrix of
    ``shape``: random bytes, each block's float16 scales set to small random numbers."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quantization]]
    rng = np.random.default_rng(seed)
    rows, cols = shape
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in K_SCALES[quantization]:
        scales = rng.uniform(0.001, 0.02, (rows, cols // block)).astype(np.float16)
        data[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


def add_metadata(writer: Any, config: Any) -> None:
    """The ``{arch}.`` keys llama.cpp's converter writes for the model's config."""
    import gguf

    kind = config.model_type
    if kind in ("gpt2", "bloom"):
        writer.add_block_count(config.n_layer)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(4 * config.hidden_size)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(float(config.layer_norm_epsilon))
        if kind == "gpt2":
            writer.add_context_length(config.n_positions)
        else:
            writer.add_context_length(config.hidden_size)  # BLOOM's config gives none
            writer.add_head_count_kv(config.n_head)
            writer.add_vocab_size(config.vocab_size)
        return
    if kind == "falcon":
        writer.add_context_length(2048)  # its converter's: Falcon's config gives none
        writer.add_tensor_data_layout("jploski")
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(4 * config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(1 if config.multi_query else config.num_kv_heads)
        writer.add_layer_norm_eps(float(config.layer_norm_epsilon))
        return
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if kind == "lfm2":  # its converter's: the key and value heads per layer, none in a conv
        kv = config.num_key_value_heads
        writer.add_head_count_kv([kv if t == "full_attention" else 0 for t in config.layer_types])
        writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
        writer.add_vocab_size(config.vocab_size)
        writer.add_shortconv_l_cache(config.conv_L_cache)
        writer.add_layer_norm_rms_eps(float(config.norm_eps))
        return
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)
    if kind == "stablelm":  # its converter writes no freq_base
        writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
        writer.add_parallel_residual(config.use_parallel_residual)
        writer.add_layer_norm_eps(float(config.layer_norm_eps))
        return
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if kind == "starcoder2":
        writer.add_layer_norm_eps(float(config.norm_epsilon))
        return
    if kind == "nemotron":
        writer.add_layer_norm_rms_eps(float(config.norm_eps))
        writer.add_layer_norm_eps(float(config.norm_eps))
        writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
        writer.add_vocab_size(config.vocab_size)
        return
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if kind in ("llama", "mistral", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if kind == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    if kind == "minimax_m2":
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_rope_dimension_count(config.rotary_dim)  # partial rotary
    if kind in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if kind in ("qwen3", "qwen3_moe", "minimax_m2", "gemma2", "gemma3_text"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if kind in ("gemma2", "gemma3_text"):
        writer.add_sliding_window(config.sliding_window)
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def converted(name: str, array: np.ndarray, config: Any) -> np.ndarray:
    """What llama.cpp's converter does to the transformers tensor ``name``."""
    kind = config.model_type
    if kind in ("llama", "mistral") and name.endswith("q_proj.weight"):
        return permute(array, config.num_attention_heads)
    if kind in ("llama", "mistral") and name.endswith("k_proj.weight"):
        return permute(array, config.num_key_value_heads)
    if kind in PLUS_ONE and name.endswith("norm.weight"):
        return array + np.float32(1.0)
    if kind == "gpt2" and name.endswith(TRANSPOSED):
        return np.ascontiguousarray(array.T)
    if kind == "bloom" and "query_key_value" in name:
        return bloom_qkv(array, config.n_head)
    if kind == "lfm2" and name.endswith("conv.conv.weight"):
        return array[:, 0]  # (channels, width): llama.cpp's convolution takes it 2-D
    return array


def write_gguf(model: Any, path: Path, quantization: str) -> None:
    """The transformers ``model`` as a GGUF file at ``path``, its matrices in
    ``quantization`` (``"F32"``, ``"F16"``, ``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``...; a K-quant's
    matrices are random blocks, :func:`random_k_quant`)."""
    import gguf

    config = model.config
    kind = config.model_type
    arch = ARCH.get(kind, kind)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("mistral" if kind == "mistral" else f"tiny random {kind}")
    add_metadata(writer, config)
    writer.add_token_list([f"<{i}>" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    layers = config.num_hidden_layers
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):  # (experts, 2 * width, hidden)
            gate, up = np.split(array, 2, axis=1)
            index = name.split(".")[2]
            tensors[f"blk.{index}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate)
            tensors[f"blk.{index}.ffn_up_exps.weight"] = np.ascontiguousarray(up)
        elif name.endswith("mlp.experts.down_proj"):
            tensors[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = array
        elif name.endswith("mlp.e_score_correction_bias"):
            tensors[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = array
        elif name.endswith("shared_expert_gate.weight"):  # llama.cpp's is a vector
            tensors[gguf_name(name, arch, layers)] = array[0]
        else:
            tensors[gguf_name(name, arch, layers)] = converted(name, array, config)
    if kind in ("gpt2", "bloom"):  # their converters write the tied head as a copy
        tensors["output.weight"] = tensors["token_embd.weight"]
    qtype = gguf.GGMLQuantizationType[quantization]
    for name, array in tensors.items():
        if array.ndim == 1 or array.shape[-1] % 32:  # not whole blocks: kept in F32
            writer.add_tensor(name, array)
        elif quantization in K_SCALES:
            data = random_k_quant(array.shape, quantization, seed=len(name))
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
