"""Output norms: the joined heads ``(*B, L, H*d_v)`` normalised over all their features
before ``W_o``, an RMSNorm with a weight ``o_norm (H*d_v,)`` (``"rms"``: BitNet's
``attn_sub_norm``) or the L2 norm without weights (``"l2"``: nGPT's, Dory's), ``eps`` added
to the mean square (RMSNorm) or to the sum of squares (L2). The norm is the spec's output
stage (:class:`~mha.api.spec.OutputStage`), after an output gate where the layer has both
(:class:`Stages`), with its gradient beside it.

>>> import numpy as np
>>> norm = OutputNorm.check(("l2", 0.0), None, 2)
>>> norm.forward(np.array([[3.0, 4.0]]), np.zeros((1, 1)))[0]
array([[0.6, 0.8]])
>>> rms = OutputNorm.check(("rms", 0.0), np.array([1.0, 2.0]), 2)
>>> rms.forward(np.array([[3.0, 4.0]]), np.zeros((1, 1)))[0] ** 2 @ [1.0, 0.25]
array([2.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import as_float_array
from ..errors import AttentionValueError, ShapeError
from .rotary import positive_real

__all__ = ["OUTPUT_NORMS", "OutputNorm", "Stages", "check_output_norm"]

OUTPUT_NORMS = ("rms", "l2")
"""The output norms: an RMSNorm with a weight, the L2 norm without weights."""

DEFAULT_EPS = 1e-6
"""Epsilon where none is given (BitNet's ``rms_norm_eps`` and Dory's ``DoryL2Norm``)."""


def check_output_norm(kind: Any, eps: Any) -> tuple[str, float] | None:
    """``output_norm`` and ``output_norm_eps`` checked: ``None`` (no norm, and no epsilon), or
    the norm and its epsilon (default :data:`DEFAULT_EPS`; zero is allowed)."""
    if kind is None:
        if eps is not None:
            raise AttentionValueError("output_norm_eps needs output_norm= ('rms' or 'l2')")
        return None
    if not (isinstance(kind, str) and kind in OUTPUT_NORMS):
        raise AttentionValueError(
            f"output_norm must be None, {' or '.join(map(repr, OUTPUT_NORMS))}; got {kind!r}"
        )
    if eps is None:
        return kind, DEFAULT_EPS
    if isinstance(eps, (int, float, np.integer, np.floating)) and float(eps) == 0.0:
        return kind, 0.0
    return kind, positive_real("output_norm_eps", eps)


@dataclass(frozen=True, eq=False)
class OutputNorm:
    """The joined heads ``x (*B, L, N)`` times ``(sum(x**2) / m + eps) ** -0.5`` (and the
    weight ``o_norm (N,)`` for an RMSNorm): ``m = N`` for an RMSNorm, ``1`` for L2."""

    kind: str
    eps: float
    o_norm: np.ndarray | None

    @classmethod
    def check(cls, norm: tuple[str, float], o_norm: Any, width: int) -> OutputNorm:
        """The norm ``(kind, eps)`` of the joined heads ``width`` features wide, with its
        weight ``o_norm (width,)``: needed for ``"rms"``, refused for ``"l2"``."""
        kind, eps = norm
        if kind == "l2":
            if o_norm is not None:
                raise AttentionValueError("o_norm: output_norm='l2' has no weights")
            return cls(kind, eps, None)
        if o_norm is None:
            raise AttentionValueError(f"output_norm='rms' needs its weight o_norm ({width},)")
        w = as_float_array("o_norm", o_norm)
        if w.shape != (width,):
            raise ShapeError(
                f"o_norm must have shape (H*d_v,) = ({width},), one weight a joined "
                f"feature; got shape {w.shape}"
            )
        return cls(kind, eps, w)

    uses_matmul = False

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The norm's weights, by parameter name (``backward`` gives their gradients)."""
        return {} if self.o_norm is None else {"o_norm": self.o_norm}

    def _mean(self, n: int) -> int:
        return n if self.kind == "rms" else 1

    def forward(self, joined: np.ndarray, inputs: np.ndarray) -> tuple[np.ndarray, Any]:
        """``joined`` normalised, and what the backward reads: the normalised rows and
        their factors."""
        m = self._mean(joined.shape[-1])
        squares = np.einsum("...i,...i->...", joined, joined)[..., None]
        r = 1.0 / np.sqrt(squares / m + self.eps)
        u = joined * r
        w = None if self.o_norm is None else self.o_norm.astype(joined.dtype, copy=False)
        return (u if w is None else u * w), (u, r)

    def backward(
        self, d_out: np.ndarray, saved: Any
    ) -> tuple[np.ndarray, None, dict[str, np.ndarray]]:
        """The gradients of the joined heads and of ``o_norm``:
        ``r (g - u * sum(g * u) / m)``, ``g`` the gradient of ``u``."""
        u, r = saved
        grads: dict[str, np.ndarray] = {}
        g = d_out
        if self.o_norm is not None:
            rows = (d_out * u).reshape(-1, u.shape[-1])
            grads["o_norm"] = rows.sum(axis=0)
            g = d_out * self.o_norm.astype(d_out.dtype, copy=False)
        m = self._mean(u.shape[-1])
        along = np.einsum("...i,...i->...", g, u)[..., None] / m
        return r * (g - u * along), None, grads


@dataclass(frozen=True, eq=False)
class Stages:
    """Two output stages one after the other (an output gate, then an output norm)."""

    first: Any
    then: Any

    @property
    def uses_matmul(self) -> bool:
        return bool(getattr(self.first, "uses_matmul", False))

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return {**self.first.weights, **self.then.weights}

    def forward(
        self, joined: np.ndarray, inputs: np.ndarray, *product: Any
    ) -> tuple[np.ndarray, Any]:
        staged, first = self.first.forward(joined, inputs, *product)
        out, then = self.then.forward(staged, inputs)
        return out, (first, then)

    def backward(
        self, d_out: np.ndarray, saved: Any
    ) -> tuple[np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
        first, then = saved
        d_staged, d_late, late = self.then.backward(d_out, then)
        d_joined, d_early, early = self.first.backward(d_staged, first)
        d_inputs = d_early if d_late is None else d_late if d_early is None else d_early + d_late
        return d_joined, d_inputs, {**early, **late}
