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

__all__ = ["LLAMA_PROJECTIONS", "UNSUPPORTED", "weights_from_gpt2", "weights_from_llama"]

LLAMA_PROJECTIONS = {
    "q_proj": ("W_q", "b_q"),
    "k_proj": ("W_k", "b_k"),
    "v_proj": ("W_v", "b_v"),
    "o_proj": ("W_o", "b_o"),
}

UNSUPPORTED = {
    "q_norm": "QK-norm, as in Qwen3, Gemma 3 and OLMo 2: load the checkpoint with "
    "MultiHeadAttention.from_pretrained, which reads it",
    "k_norm": "QK-norm, as in Qwen3, Gemma 3 and OLMo 2: load the checkpoint with "
    "MultiHeadAttention.from_pretrained, which reads it",
    "lora": "a LoRA adapter: merge it into the base weights first, as peft's merge_and_unload",
}
"""Weights that some Llama-style attention modules hold and mha's layout does not (yet), by
a part of their name (``from_pretrained`` reads QK-norm from a whole checkpoint)."""


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
        ("c_attn_bias", b, (3 * E,)),
        ("c_proj_weight", W_o, (E, E)),
        ("c_proj_bias", b_o, (E,)),
    ):
        if array.shape != shape:
            raise ShapeError(
                f"{name} must have shape {shape} to match c_attn_weight {W.shape}; "
                f"got {array.shape}"
            )
    weights: dict[str, np.ndarray | None] = {
        "W_q": W[:, :E],
        "W_k": W[:, E : 2 * E],
        "W_v": W[:, 2 * E :],
        "W_o": W_o,
        "b_q": b[:E],
        "b_k": b[E : 2 * E],
        "b_v": b[2 * E :],
        "b_o": b_o,
    }
    return weights


def weights_from_llama(
    state: Any, prefix: str, num_heads: int, num_kv_heads: int, head_dim: int | None
) -> dict[str, np.ndarray | None]:
    """mha's weights from a Llama-style attention's state dict (NumPy arrays or torch
    tensors, ``(out, in)`` as ``nn.Linear`` stores them): ``{prefix}q_proj.weight``,
    ``k_proj``, ``v_proj``, ``o_proj``, and their ``.bias`` where present (as in Qwen2).
    gpt-oss's ``{prefix}sinks`` (one logit per head) is read as the module's ``sinks``.
    Every key under ``prefix`` must be one of those (or the ``rotary_emb.inv_freq`` buffer
    of older checkpoints, which transformers recomputes from the config too): weights of
    another computation (QK-norm) are refused by name. Keys outside the prefix are
    not read; a prefix that names no attention module is refused with the ones it holds."""
    if not hasattr(state, "keys") or not hasattr(state, "__getitem__"):
        raise AttentionTypeError(
            f"from_llama takes a state dict (a mapping of names to arrays or tensors); "
            f"got {type(state).__name__}"
        )
    if not isinstance(prefix, str):
        raise AttentionTypeError(f"prefix must be a string; got {prefix!r}")
    keys = [key for key in state if isinstance(key, str)]
    weight = f"{prefix}q_proj.weight"
    if weight not in state:
        raise AttentionValueError(_prefix_problem(keys, prefix))
    ours = {key for key in keys if key.startswith(prefix)}
    known = {
        f"{prefix}{layer}.{part}" for layer in LLAMA_PROJECTIONS for part in ("weight", "bias")
    }
    known.add(f"{prefix}rotary_emb.inv_freq")  # older checkpoints' buffer: derived, not read
    known.add(f"{prefix}sinks")
    unknown = sorted(key[len(prefix) :] for key in ours - known)  # the module's, all of them
    if unknown:
        said = ", ".join(f"{key} ({_why(key)})" if _why(key) else key for key in unknown)
        raise AttentionValueError(
            f"the attention at {prefix!r} has weights mha's Llama layout does not support: "
            f"{said}; loading it without them would compute another model"
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
    shapes = {
        "q_proj": (inner, hidden),
        "k_proj": (kv_inner, hidden),
        "v_proj": (kv_inner, hidden),
        "o_proj": (hidden, inner),
    }
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
    key = f"{prefix}sinks"
    if key in state:  # gpt-oss: one learned logit per query head
        sinks = as_numpy(key, state[key])
        if sinks.shape != (num_heads,):
            raise ShapeError(f"state dict: {key} has shape {sinks.shape}; expected ({num_heads},)")
        weights["sinks"] = sinks
    return weights


def _prefix_problem(keys: list[str], prefix: str) -> str:
    """What to change when ``{prefix}q_proj.weight`` is missing: a missing dot, or the
    prefixes under which the state dict does hold attention modules."""
    weight = f"{prefix}q_proj.weight"
    if f"{prefix}.q_proj.weight" in keys:
        return (
            f"state dict has no {weight!r}, but it has {prefix + '.q_proj.weight'!r}: "
            f"give prefix={prefix + '.'!r} (a prefix ends with a dot)"
        )
    found = sorted({key[: -len("q_proj.weight")] for key in keys if key.endswith("q_proj.weight")})
    if found:
        listed = ", ".join(repr(p) for p in found[:3]) + (", ..." if len(found) > 3 else "")
        return (
            f"state dict has no {weight!r}; it holds {len(found)} attention module"
            f"{'s' if len(found) > 1 else ''} under {listed}: give one of those as prefix="
        )
    return (
        f"state dict has no {weight!r} and no q_proj.weight under any prefix ({len(keys)} "
        "keys): is it a Llama-style model's? The prefix is the attention module's, such as "
        "'model.layers.0.self_attn.'"
    )


def _why(key: str) -> str | None:
    """What the unsupported weight ``key`` is, when its name says."""
    parts = [part.split("_")[0] if part.startswith("lora_") else part for part in key.split(".")]
    return next((UNSUPPORTED[part] for part in parts if part in UNSUPPORTED), None)
