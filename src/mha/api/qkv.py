"""The q, k, v projection's weights as a layer's call multiplies by them: where the scale
goes, the heads' widths, and whether one product projects all three
(:func:`.projection.project_heads` and :mod:`.sequence_blocks` both take them from here, so
both multiply by the same matrices: the same bits)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .checks import Call, Weights, side_by_side_bias

__all__ = ["QKVWeights", "qkv_weights"]


class QKVWeights(NamedTuple):
    """What :func:`qkv_weights` works out."""

    W: tuple[np.ndarray, np.ndarray, np.ndarray]  # W_q (times the scale, unless late), W_k, W_v
    b: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]  # (b_q likewise)
    heads: list[tuple[int, int]]  # q's, k's and v's heads and their width: (H, d)
    late_scale: bool  # the scale multiplies the projected queries instead of W_q
    joined: tuple[np.ndarray, np.ndarray | None] | None  # [W_q | W_k | W_v] and its bias


def qkv_weights(call: Call, w: Weights, rows: int) -> QKVWeights:
    """The weights of ``call``'s projection of ``rows`` query rows; ``w`` holds the call's
    weights in its compute dtype.

    The scale goes where it costs least: into ``W_q`` when there are more query rows than
    input features, into the projected queries otherwise (and always after a QK-norm or a
    clamp, which precede it, and when the weights are already side by side in one array,
    which the scale would copy). For self-attention with enough rows to pay for copying the
    weights (or weights already side by side), one product by ``[W_q | W_k | W_v]``
    projects all three (``joined``)."""
    scale, H, H_kv, width = call.scale, call.H, call.H_kv, call.Q.shape[-1]
    W_q, W_k, W_v, b_q, b_k, b_v = w.W_q, w.W_k, w.W_v, w.b_q, w.b_k, w.b_v
    ordered = call.qk_norm is not None or call.spec.clip_qkv is not None
    together = w.joined() if call.self_attention else None
    late_scale = rows < width or ordered or together is not None
    if not late_scale:
        W_q, b_q = W_q * scale, None if b_q is None else b_q * scale
    heads = [(H, W_q.shape[1] // H), (H_kv, W_k.shape[1] // H_kv), (H_kv, W_v.shape[1] // H_kv)]
    joined = None
    if together is not None or (call.self_attention and rows >= width):
        W_qkv = np.concatenate([W_q, W_k, W_v], axis=1) if together is None else together
        joined = W_qkv, side_by_side_bias((b_q, W_q), (b_k, W_k), (b_v, W_v))
    return QKVWeights((W_q, W_k, W_v), (b_q, b_k, b_v), heads, late_scale, joined)
