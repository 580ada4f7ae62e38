"""Hugging Face transformers' attention layouts: GPT-2's fused Conv1D weights, and the
``q_proj``/``k_proj``/``v_proj``/``o_proj`` linear layers of Llama, Mistral, Qwen2 and
their relatives.

These functions work on dicts of mha's weight names (``W_q``, ..., ``b_o``), which
``MultiHeadAttention`` builds itself from; transformers itself is never imported.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_float_array
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from ._tensors import as_numpy

__all__ = ["LLAMA_PROJECTIONS", "weights_from_gpt2", "weights_from_llama"]

LLAMA_PROJECTIONS = {"q_proj": ("W_q", "b_q"), "k_proj": ("W_k", "b_k"),
                     "v_proj": ("W_v", "b_v"), "o_proj": ("W_o", "b_o")}  # fmt: skip


def weights_from_gpt2(
    c_attn_weight: Any, c_attn_bias: Any, c_proj_weight: Any, c_proj_bias: Any
) -> dict[str, np.ndarray | None]:
    """mha's weights from GPT-2's fused Conv1D ``c_attn`` and ``c_proj`` ("x @ W" already)."""
    W = as_float_array("c_attn_weight", c_attn_weight)
    if W.ndim != 2 or W.shape[1] != 3 * W.shape[0]:
        raise ShapeError(f"c_attn_weight must have shape (E, 3E); got {W.shape}")
    E = W.shape[0]
    b = as_float_array("c_attn_bias", c_attn_bias)
    W_o = as_float_array("c_proj_weight", c_proj_weight)
    b_o = as_float_array("c_proj_bias", c_proj_bias)
    for name, array, shape in (
        ("c_attn_bias", b, (3 * E,)), ("c_proj_weight", W_o, (E, E)), ("c_proj_bias", b_o, (E,)),
    ):  # fmt: skip
        if array.shape != shape:
            raise ShapeError(
                f"{name} must have shape {shape} to match c_attn_weight {W.shape}; "
                f"got {array.shape}"
            )
    weights: dict[str, np.ndarray | None] = {
        "W_q": W[:, :E], "W_k": W[:, E : 2 * E], "W_v": W[:, 2 * E :], "W_o": W_o,
        "b_q": b[:E], "b_k": b[E : 2 * E], "b_v": b[2 * E :], "b_o": b_o,
    }  # fmt: skip
    return weights


def weights_from_llama(
    state: Any, prefix: str, num_heads: int, num_kv_heads: int, head_dim: int | None
) -> dict[str, np.ndarray | None]:
    """mha's weights from a Llama-style attention's state dict (NumPy arrays or torch
    tensors, ``(out, in)`` as ``nn.Linear`` stores them): ``{prefix}q_proj.weight``,
    ``k_proj``, ``v_proj``, ``o_proj``, and their ``.bias`` where present (as in Qwen2).
    Every key under ``prefix`` must be one of those; keys outside it are not read."""
    if not hasattr(state, "keys") or not hasattr(state, "__getitem__"):
        raise AttentionTypeError(
            f"from_llama takes a state dict (a mapping of names to arrays or tensors); "
            f"got {type(state).__name__}"
        )
    if not isinstance(prefix, str):
        raise AttentionTypeError(f"prefix must be a string; got {prefix!r}")
    ours = {key for key in state if isinstance(key, str) and key.startswith(prefix)}
    known = {
        f"{prefix}{layer}.{part}" for layer in LLAMA_PROJECTIONS for part in ("weight", "bias")
    }
    unknown = sorted(ours - known)
    if unknown:
        raise AttentionValueError(
            f"state dict has keys under {prefix!r} that a Llama attention does not: {unknown} "
            "(their computation would be left out); give the prefix of the attention module"
        )
    weight = f"{prefix}q_proj.weight"
    if weight not in state:
        raise AttentionValueError(
            f"state dict has no {weight!r} (it has {len(ours)} keys under {prefix!r}); the "
            "prefix is the attention module's, e.g. 'model.layers.0.self_attn.'"
        )
    hidden = as_numpy(weight, state[weight]).shape[-1]
    if head_dim is None:  # the config's default: hidden_size // num_attention_heads
        head_dim = hidden // num_heads
        if head_dim == 0:
            raise AttentionValueError(
                f"num_heads={num_heads} is more than the hidden size {hidden} of "
                f"{weight!r}; give head_dim= if the heads are wider than hidden // num_heads"
            )
    inner, kv_inner = num_heads * head_dim, num_kv_heads * head_dim
    shapes = {"q_proj": (inner, hidden), "k_proj": (kv_inner, hidden),
              "v_proj": (kv_inner, hidden), "o_proj": (hidden, inner)}  # fmt: skip
    weights: dict[str, np.ndarray | None] = {}
    for layer, (W_name, b_name) in LLAMA_PROJECTIONS.items():
        key = f"{prefix}{layer}.weight"
        if key not in state:
            raise AttentionValueError(f"state dict has no {key!r} of shape {shapes[layer]}")
        W = as_numpy(key, state[key])
        if W.shape != shapes[layer]:
            raise ShapeError(
                f"state dict: {key} has shape {W.shape}; expected {shapes[layer]} for "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim} and "
                f"hidden size {hidden}"
            )
        weights[W_name] = W.T
        key = f"{prefix}{layer}.bias"
        if key in state:
            b = as_numpy(key, state[key])
            if b.shape != (shapes[layer][0],):
                raise ShapeError(
                    f"state dict: {key} has shape {b.shape}; expected ({shapes[layer][0]},)"
                )
            weights[b_name] = b
    return weights
