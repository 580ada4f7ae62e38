"""Tiny random GGUF files, written as llama.cpp's ``convert_hf_to_gguf.py`` writes a
transformers model: its metadata keys, its tensor names, llama's query and key rows permuted
for interleaved rotary, each matrix quantized by the ``gguf`` package's own ``quantize``
(norms in float32, as llama.cpp keeps every 1-D tensor).

``write_gguf(model, path, "Q4_0")`` writes a transformers ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``; transformers' GGUF loader reads it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    """llama.cpp's name of the transformers tensor ``name``."""
    stem, kind = name.rsplit(".", 1)
    if stem in TOP:
        return f"{TOP[stem]}.{kind}"
    _, _, index, role = stem.split(".", 3)
    return f"blk.{index}.{NAMES[role]}.{kind}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of each head's rows for interleaved rotary."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


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


def write_gguf(model: Any, path: Path, quantization: str) -> None:
    """The transformers ``model`` as a GGUF file at ``path``, its matrices in
    ``quantization`` (``"F32"``, ``"F16"``, ``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``...; a K-quant's
    matrices are random blocks, :func:`random_k_quant`)."""
    import gguf

    config = model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny random {arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    kind = gguf.GGMLQuantizationType[quantization]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute(array, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute(array, config.num_key_value_heads)
        if array.ndim == 1:
            writer.add_tensor(gguf_name(name), array)
        elif quantization in K_SCALES:
            data = random_k_quant(array.shape, quantization, seed=len(name))
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=kind)
        else:
            data = gguf.quants.quantize(array, kind)
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
