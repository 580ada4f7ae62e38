"""QK-norm: an RMSNorm of the projected queries and keys before rotary positions.

Qwen3 and Gemma 3 normalise each head's ``d_k`` features (``kind="head"``); OLMo 2 all
``H * d_k`` features of a token before the split into heads (``kind="all"``). The norm is
``y = x / sqrt(mean(x²) + eps) * (offset + w)``: ``offset`` 0 for Qwen3 and OLMo 2, 1 for
Gemma 3's ``(1 + weight)``. The softmax scale multiplies the queries after the norm.

The backward of ``x̂ = x·r``, ``r = (mean(x²) + eps)^(-1/2)``, ``y = x̂·(offset + w)`` is
``dw = Σ dy·x̂`` and ``dx = r·(g - x̂·mean(g·x̂))`` with ``g = dy·(offset + w)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import as_float_array
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .rotary import positive_real

__all__ = ["KINDS", "QKNorm", "check_offset", "check_qk_norm", "rms_norm", "rms_norm_backward"]

KINDS = ("head", "all")
"""Per head (Qwen3, Gemma 3), or across all heads before the split (OLMo 2)."""


@dataclass(frozen=True)
class QKNorm:
    """A checked QK-norm: its kind, the two weights as given, epsilon and the offset."""

    kind: str
    q_norm: np.ndarray
    k_norm: np.ndarray
    eps: float
    offset: float

    def apply(self, x: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``y`` for rows ``x (..., n)`` (a head's features, or a token's), with what the
        backward needs: ``x̂`` and ``r (..., 1)``."""
        return rms_norm(x, self.gain(weight, x.dtype), self.eps)

    def backward(
        self, dy: np.ndarray, normed: np.ndarray, r: np.ndarray, weight: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The gradients of the rows ``x`` and of the weight, from the output's ``dy``."""
        return rms_norm_backward(dy, normed, r, self.gain(weight, dy.dtype))

    def gain(self, weight: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """``offset + w`` in ``dtype``."""
        gain: np.ndarray = weight.astype(dtype, copy=False)
        return gain + self.offset if self.offset else gain


def check_qk_norm(
    q_norm: Any, k_norm: Any, kind: Any, eps: Any, offset: Any, *, H: int, H_kv: int, d_k: int
) -> QKNorm | None:
    """The QK-norm of a call with ``H`` query heads and ``H_kv`` key heads ``d_k`` wide,
    or ``None`` when neither weight is given."""
    if q_norm is None and k_norm is None:
        options = (("qk_norm", kind), ("qk_norm_eps", eps), ("qk_norm_offset", offset))
        given = [name for name, value in options if value is not None]
        if given:
            raise AttentionValueError(
                f"{', '.join(given)} has no effect without the weights q_norm= and k_norm="
            )
        return None
    if q_norm is None or k_norm is None:
        raise AttentionValueError("q_norm and k_norm go together: give both weights")
    kind = "head" if kind is None else kind
    if kind not in KINDS:
        raise AttentionValueError(
            f"qk_norm must be 'head' (each head's features: Qwen3, Gemma 3) or 'all' (every "
            f"head's, before the split: OLMo 2); got {kind!r}"
        )
    weights = []
    for name, given, heads in (("q_norm", q_norm, H), ("k_norm", k_norm, H_kv)):
        weight = as_float_array(name, given)
        width = d_k if kind == "head" else heads * d_k
        if weight.shape != (width,):
            where = "d_k" if kind == "head" else f"{'H' if name == 'q_norm' else 'H_kv'}*d_k"
            raise ShapeError(
                f"{name} must have shape ({width},) = ({where},) for qk_norm={kind!r} with "
                f"{heads} heads of width {d_k}; got {weight.shape}"
            )
        weights.append(weight)
    eps = 1e-6 if eps is None else positive_real("qk_norm_eps", eps)
    offset = 0.0 if offset is None else check_offset(offset)
    return QKNorm(kind, weights[0], weights[1], eps, offset)


def check_offset(offset: Any) -> float:
    """``qk_norm_offset`` as a float: a finite real number (1.0 for Gemma's ``1 + w``)."""
    real = isinstance(offset, (int, float, np.integer, np.floating))
    if isinstance(offset, (bool, np.bool_)) or not real or not np.isfinite(float(offset)):
        raise AttentionTypeError(f"qk_norm_offset must be a finite real number; got {offset!r}")
    return float(offset)


def rms_norm(
    x: np.ndarray, gain: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The RMSNorm of the last axis, ``gain * x / sqrt(mean(x²) + eps)``, in ``x``'s dtype:
    ``(y, x̂, r)``, the last two for :func:`rms_norm_backward` (QK-norm's and the latent
    attention's norms alike)."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = x * r
    return normed * gain, normed, r


def rms_norm_backward(
    dy: np.ndarray, normed: np.ndarray, r: np.ndarray, gain: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gradients of :func:`rms_norm`'s rows and of its gain, from the output's ``dy``."""
    g = dy * gain
    dx = r * (g - normed * np.mean(g * normed, axis=-1, keepdims=True))
    return dx, (dy * normed).reshape(-1, dy.shape[-1]).sum(axis=0)
