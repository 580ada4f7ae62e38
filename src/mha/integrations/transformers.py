"""Hugging Face transformers' attention layouts: GPT-2's fused Conv1D weights.

These functions work on dicts of mha's weight names (``W_q``, ..., ``b_o``), which
``MultiHeadAttention`` builds itself from; transformers itself is never imported.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_float_array
from ..errors import ShapeError

__all__ = ["weights_from_gpt2"]


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
