"""Output gates: the joined heads times ``act(x @ W_g + b_g)`` before ``W_o``, ``x`` the
layer's query input (Qwen3-Next and Qwen3.5, AFMoE, LFM3, Laguna, Bailing's hybrid). A gate
is per element (``W_g (d_q, H*d_v)``: one gate a feature) or per head (``W_g (d_q, H)``: one
a head, over its ``d_v`` features), its activation ``"sigmoid"`` or ``"softplus"``; it is
the spec's output stage (:class:`~mha.api.spec.OutputStage`), with its gradient beside it.

>>> import numpy as np
>>> gate = OutputGate.check("sigmoid", np.zeros((4, 2)), None, 2, 3, 4)
>>> staged, _ = gate.forward(np.ones((1, 5, 6)), np.ones((1, 5, 4)))
>>> staged[0, 0]                                  # sigmoid(0) = 1/2, per head
array([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import as_float_array
from ..errors import AttentionValueError, ShapeError

__all__ = ["ACTIVATIONS", "OutputGate", "check_gate_activation"]

ACTIVATIONS = ("sigmoid", "softplus")
"""The gates' activations."""


def check_gate_activation(activation: Any) -> str | None:
    """``output_gate`` checked: ``None`` (a gate's default, sigmoid, when it has weights)
    or one of :data:`ACTIVATIONS`."""
    if activation is None or (isinstance(activation, str) and activation in ACTIVATIONS):
        return activation
    raise AttentionValueError(
        f"output_gate must be one of {', '.join(map(repr, ACTIVATIONS))}; got {activation!r}"
    )


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` as ``(1 + tanh(z / 2)) / 2``: no overflow either way."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _activation(kind: str, z: np.ndarray) -> np.ndarray:
    """The gate ``act(z)``; a sigmoid is computed in ``z``'s own memory (the logits, which
    only the gate holds), as ``_sigmoid`` computes it, step for step."""
    if kind == "sigmoid":
        z *= 0.5
        np.tanh(z, out=z)
        z += 1.0
        z *= 0.5
        return z
    softplus: np.ndarray = np.logaddexp(0.0, z).astype(z.dtype, copy=False)
    return softplus


def _slope(kind: str, g: np.ndarray, z: np.ndarray | None) -> np.ndarray:
    """The derivative of the gate ``g = act(z)``: ``g (1 - g)`` for a sigmoid, ``sigmoid(z)``
    for softplus."""
    if kind == "sigmoid":
        return g * (1.0 - g)
    assert z is not None
    return _sigmoid(z)


@dataclass(frozen=True, eq=False)
class OutputGate:
    """An output gate: ``act(x @ W_g + b_g)`` times the joined heads ``(*B, L, H*d_v)``, per
    element or, when ``W_g`` has one column a head, per head."""

    activation: str
    W_g: np.ndarray
    b_g: np.ndarray | None
    heads: int
    d_v: int

    @classmethod
    def check(cls, activation: Any, W_g: Any, b_g: Any, H: int, d_v: int, d_q: int) -> OutputGate:
        """The gate of ``W_g (d_q, H*d_v or H)`` and ``b_g`` (one value a column), checked
        against the layer's heads ``H`` of width ``d_v`` and its query input's width."""
        kind = check_gate_activation(activation) or "sigmoid"
        W = as_float_array("W_g", W_g)
        if W.ndim != 2 or W.shape[0] != d_q or W.shape[1] not in (H * d_v, H):
            raise ShapeError(
                f"W_g must be (d_q, H*d_v) = ({d_q}, {H * d_v}) for a gate per element, or "
                f"(d_q, H) = ({d_q}, {H}) for a gate per head; got shape {W.shape}"
            )
        b = None
        if b_g is not None:
            b = as_float_array("b_g", b_g)
            if b.shape != (W.shape[1],):
                raise ShapeError(
                    f"b_g must have shape ({W.shape[1]},) to match the columns of W_g "
                    f"{W.shape}; got shape {b.shape}"
                )
        return cls(kind, W, b, H, d_v)

    uses_matmul = True  # the logits' product made by the layer's thread team

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The gate's weights, by parameter name (``backward`` gives their gradients)."""
        return {"W_g": self.W_g} if self.b_g is None else {"W_g": self.W_g, "b_g": self.b_g}

    @property
    def per_head(self) -> bool:
        return self.W_g.shape[1] == self.heads and self.d_v != 1

    def _logits(self, inputs: np.ndarray, dtype: np.dtype, team: Any = None) -> np.ndarray:
        x, W = inputs.astype(dtype, copy=False), self.W_g.astype(dtype, copy=False)
        b = None if self.b_g is None else self.b_g.astype(dtype, copy=False)
        if team is not None:
            by_team: np.ndarray = team.matmul(x, W, b)
            return by_team
        z: np.ndarray = x @ W
        if b is not None:
            z += b
        return z

    def _gated(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """``x (*B, L, H*d_v)`` times the gate: a gate per head over each head's ``d_v``
        features (broadcast, never spread into a copy)."""
        if not self.per_head:
            gated: np.ndarray = x * g
            return gated
        by_head: np.ndarray = x.reshape(*x.shape[:-1], self.heads, self.d_v) * g[..., None]
        return by_head.reshape(x.shape)

    def forward(
        self, joined: np.ndarray, inputs: np.ndarray, team: Any = None, overwrite: bool = False
    ) -> tuple[np.ndarray, Any]:
        """``joined`` gated by the gate of ``inputs (*B, L, d_q)``, and what the backward
        reads: the joined heads, the gate, the logits (softplus's derivative reads them)
        and the inputs; the derivative itself is computed by the backward alone.
        ``team``: the layer's thread team (:class:`mha._kernel.team.Team`), which makes the
        logits; ``overwrite``: the gated heads may take ``joined``'s memory (a call without
        a backward, which would read it)."""
        if team is not None and self.activation == "sigmoid":
            return self._fused(joined, inputs, team, overwrite)
        z = self._logits(inputs, joined.dtype, team)
        kept = None if self.activation == "sigmoid" else z
        g = _activation(self.activation, z)
        return self._gated(joined, g), (joined, g, kept, inputs)

    def _fused(
        self, joined: np.ndarray, inputs: np.ndarray, team: Any, overwrite: bool
    ) -> tuple[Any, Any]:
        """:meth:`forward`'s sigmoid gate by the layer's thread team: each worker turns its
        block of logits into the gate and gates its rows of the joined heads while the
        block is in cache (the same operations, row by row, as the unfused path). When it
        may overwrite them, in place, and the gate is not kept: a layer of 4,096 tokens and
        512 features took 1.03-1.15x the time of the layer without the gate so, 1.18-1.29x
        through a new array and the whole gate (AMD EPYC, 2 cores: the W_o product after
        it ran at half speed, reading new pages)."""
        rows_in = joined.reshape(math.prod(joined.shape[:-1]), joined.shape[-1])  # any may be 0
        in_place = overwrite and joined.flags.c_contiguous
        gated = joined if in_place else np.empty_like(joined)
        rows_out = gated.reshape(rows_in.shape)

        def then(rows: slice, z: np.ndarray) -> None:
            g = _activation("sigmoid", z)
            if self.per_head:
                rows_out[rows] = self._gated(rows_in[rows], g)
            else:
                np.multiply(rows_in[rows], g, out=rows_out[rows])

        x, W = inputs.astype(joined.dtype, copy=False), self.W_g.astype(joined.dtype, copy=False)
        b = None if self.b_g is None else self.b_g.astype(joined.dtype, copy=False)
        if in_place:  # no backward: the gate is not kept
            team.each_product(x, W, b, then)
            return gated, None
        g = team.matmul(x, W, b, then=then)
        return gated, (joined, g, None, inputs)

    def backward(
        self, d_out: np.ndarray, saved: Any
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The gradients of the joined heads, of the inputs and of ``W_g`` (and ``b_g``)."""
        joined, g, z, inputs = saved
        slope = _slope(self.activation, g, z)
        dtype = d_out.dtype
        d_gate = d_out * joined
        if self.per_head:  # a head's gate multiplied each of its d_v features
            d_gate = d_gate.reshape(*d_gate.shape[:-1], self.heads, self.d_v).sum(axis=-1)
        d_logits = d_gate * slope
        n = math.prod(d_logits.shape[:-1])  # (explicit: any size may be zero)
        rows = inputs.astype(dtype, copy=False).reshape(n, inputs.shape[-1])
        by_row = d_logits.reshape(n, d_logits.shape[-1])
        grads = {"W_g": rows.T @ by_row}
        if self.b_g is not None:
            grads["b_g"] = by_row.sum(axis=0)
        d_inputs = d_logits @ self.W_g.astype(dtype, copy=False).T
        return self._gated(d_out, g), d_inputs, grads
