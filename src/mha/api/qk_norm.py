"""QK-norm: a norm of the projected queries and keys before rotary positions.

Qwen3 and Gemma 3 normalise each head's ``d_k`` features with one weight for every head
(``kind="head"``); StableLM and Cohere each head's with its own weights (``"each_head"``,
weights ``(H, d_k)``); OLMo 2 all ``H * d_k`` features of a token before the split into
heads (``"all"``). The norm is an RMSNorm, ``y = x / sqrt(mean(x²) + eps) * (offset + w)``
(``offset`` 0 for Qwen3 and OLMo 2, 1 for Gemma 3's ``(1 + weight)``), or with ``layer`` a
LayerNorm (Persimmon, Phi, StableLM, Cohere), ``y = (x - mean(x)) / sqrt(var(x) + eps) *
(offset + w) + b``, ``b`` the optional biases. The softmax scale multiplies the queries
after the norm.

The backward of ``x̂ = (x - μ)·r``, ``r = (mean((x - μ)²) + eps)^(-1/2)`` (``μ = 0`` for
the RMSNorm), ``y = x̂·(offset + w) + b`` is ``dw = Σ dy·x̂``, ``db = Σ dy`` and
``dx = r·(g - mean(g) - x̂·mean(g·x̂))`` with ``g = dy·(offset + w)`` (no ``mean(g)`` for the
RMSNorm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._arrays import as_float_array
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .rotary import positive_real

if TYPE_CHECKING:
    from .spec import QKNormRules

__all__ = ["KINDS", "QKNorm", "check_offset", "check_qk_norm", "rms_norm", "rms_norm_backward"]

KINDS = ("head", "all", "each_head")
"""Per head (Qwen3, Gemma 3), across all heads before the split (OLMo 2), or per head with
each head's own weights (StableLM, Cohere)."""
KIND_NAMES = (
    "'head' (each head's features: Qwen3, Gemma 3), 'all' (every head's, before the split: "
    "OLMo 2) or 'each_head' (each head's, with its own weights: StableLM, Cohere)"
)


@dataclass(frozen=True)
class QKNorm:
    """A checked QK-norm: its kind, the two weights as given, epsilon, the offset, whether it
    is a LayerNorm and its biases (``None`` where absent)."""

    kind: str
    q_norm: np.ndarray
    k_norm: np.ndarray
    eps: float
    offset: float
    layer: bool = False
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    after_rope: bool = False  # HunYuan's: after the rotation, not before it

    def weights(self, which: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The weight and the bias of ``which`` (``"q"`` or ``"k"``)."""
        return (self.q_norm, self.q_bias) if which == "q" else (self.k_norm, self.k_bias)

    def apply(self, x: np.ndarray, which: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``y`` for rows ``x (..., n)`` of ``which`` (a head's features ``(*B, heads, L,
        d_k)``, or a token's), with what the backward needs: ``x̂`` and ``r (..., 1)``."""
        weight, bias = self.weights(which)
        gain = self._shaped(self.gain(weight, x.dtype))
        if not self.layer:
            return rms_norm(x, gain, self.eps)
        centred = x - np.mean(x, axis=-1, keepdims=True)
        r = 1.0 / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        normed = centred * r
        y = normed * gain
        if bias is not None:
            y += self._shaped(bias.astype(x.dtype, copy=False))
        return y, normed, r

    def backward(
        self, dy: np.ndarray, normed: np.ndarray, r: np.ndarray, which: str
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The gradient of the rows ``x`` and those of ``which``'s weight and bias, by
        parameter name (``q_norm``, ``q_norm_bias``, ...), from the output's ``dy``."""
        weight, bias = self.weights(which)
        g = dy * self._shaped(self.gain(weight, dy.dtype))
        inner = g - normed * np.mean(g * normed, axis=-1, keepdims=True)
        if self.layer:
            inner -= np.mean(g, axis=-1, keepdims=True)
        name = f"{which}_norm"
        grads = {name: self._sum(dy * normed, weight.shape)}
        if bias is not None:
            grads[f"{name}_bias"] = self._sum(dy, bias.shape)
        return r * inner, grads

    def gain(self, weight: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """``offset + w`` in ``dtype``."""
        gain: np.ndarray = weight.astype(dtype, copy=False)
        return gain + self.offset if self.offset else gain

    def _shaped(self, w: np.ndarray) -> np.ndarray:
        """A weight ``(heads, d_k)`` of ``"each_head"`` as ``(heads, 1, d_k)``: over the
        rows of its head."""
        return w[:, None, :] if w.ndim == 2 else w

    def _sum(self, rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``rows (..., n)`` summed to a weight's ``shape``: over every row, or for
        ``"each_head"`` over every row of each head (``(*B, heads, L, d_k)``)."""
        if len(shape) == 2:
            per_head: np.ndarray = np.moveaxis(rows, -3, 0).reshape(shape[0], -1, shape[1])
            by_head: np.ndarray = per_head.sum(axis=1)
            return by_head
        summed: np.ndarray = rows.reshape(-1, rows.shape[-1]).sum(axis=0)
        return summed


def check_qk_norm(
    rules: QKNormRules, weights: tuple[Any, Any, Any, Any], sizes: tuple[int, int, int]
) -> QKNorm | None:
    """The QK-norm of a call with ``sizes = (H, H_kv, d_k)``: ``H`` query heads and ``H_kv``
    key heads ``d_k`` wide, ``weights = (q_norm, k_norm, q_bias, k_bias)`` as given and
    ``rules`` (its kind, epsilon, offset, ``layer``: a LayerNorm, with the biases (of the
    weights' shapes) when given; ``after_rope``: after the rotation, HunYuan's); ``None``
    when neither weight is given."""
    q_norm, k_norm, q_bias, k_bias = weights
    kind, eps, offset, layer, after_rope = rules
    H, H_kv, d_k = sizes
    if q_norm is None and k_norm is None:
        options = (("qk_norm", kind), ("qk_norm_eps", eps), ("qk_norm_offset", offset),
                   ("qk_layernorm", layer or None), ("q_norm_bias", q_bias),
                   ("k_norm_bias", k_bias), ("qk_norm_after_rope", after_rope or None))  # fmt: skip
        given = [name for name, value in options if value is not None]
        if given:
            raise AttentionValueError(
                f"{', '.join(given)} has no effect without the weights q_norm= and k_norm="
            )
        return None
    if q_norm is None or k_norm is None:
        raise AttentionValueError("q_norm and k_norm go together: give both weights")
    if (q_bias is None) != (k_bias is None):
        raise AttentionValueError("q_norm_bias and k_norm_bias go together: give both biases")
    if q_bias is not None and not layer:
        raise AttentionValueError(
            "q_norm_bias and k_norm_bias are a LayerNorm's biases: give qk_layernorm=True too"
        )
    kind = "head" if kind is None else kind
    if kind not in KINDS:
        raise AttentionValueError(f"qk_norm must be {KIND_NAMES}; got {kind!r}")
    arrays: list[np.ndarray | None] = []
    for name, given, heads in (
        ("q_norm", q_norm, H),
        ("k_norm", k_norm, H_kv),
        ("q_norm_bias", q_bias, H),
        ("k_norm_bias", k_bias, H_kv),
    ):
        if given is None:
            arrays.append(None)
            continue
        weight = as_float_array(name, given)
        shape = {"head": (d_k,), "all": (heads * d_k,), "each_head": (heads, d_k)}[kind]
        if weight.shape != shape:
            where = {"head": "(d_k,)", "all": "(heads*d_k,)", "each_head": "(heads, d_k)"}[kind]
            raise ShapeError(
                f"{name} must have shape {shape} = {where} for qk_norm={kind!r} with {heads} "
                f"heads of width {d_k}; got {weight.shape}"
            )
        arrays.append(weight)
    eps = 1e-6 if eps is None else positive_real("qk_norm_eps", eps)
    offset = 0.0 if offset is None else check_offset(offset)
    q, k, qb, kb = arrays
    assert q is not None and k is not None
    return QKNorm(kind, q, k, eps, offset, layer, qb, kb, after_rope)


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
