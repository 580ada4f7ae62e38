# mypy: disable-error-code="no-any-return"
"""What Gemma 3n's and Gemma 4's decoders compute beyond Gemma 3's sandwich of norms, in
NumPy, written from ``modeling_gemma3n.py`` and ``modeling_gemma4.py`` in transformers 5.24
(a family's :class:`.families.Stages` says which it has):

* per-layer inputs (both, where ``hidden_size_per_layer_input`` is set): each token's row of
  ``embed_tokens_per_layer`` times ``sqrt(P)``, plus the RMS-normed projection of its
  embedding times ``hidden_size ** -0.5``, times ``2 ** -0.5``, ``P`` features for each layer;
  each layer ends with ``x + norm(projection(act(gate(x)) * p))`` of its own ``p``;
* layer scalars (Gemma 4): each layer's output times its ``layer_scalar``;
* Gemma 4's mixture of experts beside its MLP (``enable_moe_block``): :func:`gemma4_moe`;
* AltUp and LAuReL (Gemma 3n): the residual stream is ``altup_num_inputs`` streams, the
  first the embeddings and the others their projections rescaled to the same RMS; each
  layer predicts every stream from all of them (coefficients routed by the active stream),
  runs the active prediction through its attention and MLP with a low-rank LAuReL branch
  beside the attention, corrects every stream by the innovation, and adds the per-layer
  input's stage to the streams but the active one; the streams' unembedding projections,
  rescaled, are averaged before the final norm.

Every RMSNorm here is Gemma 3n's and Gemma 4's (:func:`.layers.scaled_rms_norm`: the weight
as it is, in float32).

>>> streams = spread(np.ones((1, 1, 4)), [2.0 * np.eye(4)])  # the second at the first's RMS
>>> streams.shape, merge(streams, [np.eye(4)])
((2, 1, 1, 4), array([[[1., 1., 1., 1.]]]))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import numpy as np

from .layers import (
    GATE_UP_DOWN,
    Function,
    Tensors,
    UnsupportedModelError,
    linear,
    mixture,
    scaled_rms_norm,
    top_k,
    weightless_rms_norm,
)

__all__ = [
    "AltUp",
    "GemmaLayer",
    "PerLayerInputs",
    "altup_layer",
    "gemma4_moe",
    "merge",
    "sparse_mlp",
    "spread",
]

Norm = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""An RMSNorm of the model's epsilon: ``norm(x, weight)``."""


def _rms(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True))


# ---------------------------------------------------------------- per-layer inputs


class PerLayerInputs:
    """Each layer's input of Gemma 3n's and Gemma 4's per-layer embeddings: ``(B, L,
    layers, P)`` for token ids ``(B, L)`` and their scaled embeddings ``(B, L, D)``.
    ``clamp``: ids outside ``embed_tokens_per_layer`` read its row 0 (Gemma 3n's)."""

    def __init__(self, weights: dict[str, np.ndarray], count: int, eps: float, clamp: bool) -> None:
        self.table = weights["model.embed_tokens_per_layer.weight"]
        self.projection = weights["model.per_layer_model_projection.weight"].T
        self.norm = weights["model.per_layer_projection_norm.weight"]
        self.count, self.eps, self.clamp = count, eps, clamp
        dtype = self.table.dtype.type
        self.width = self.table.shape[1] // count
        self.table_scale = dtype(math.sqrt(self.width))
        self.projection_scale = dtype(self.projection.shape[0] ** -0.5)
        self.input_scale = dtype(2.0**-0.5)

    NAMES = (
        "model.embed_tokens_per_layer.weight",
        "model.per_layer_model_projection.weight",
        "model.per_layer_projection_norm.weight",
    )

    def __call__(self, ids: np.ndarray, x: np.ndarray) -> np.ndarray:
        B, L = ids.shape
        if self.clamp:
            ids = np.where((ids >= 0) & (ids < len(self.table)), ids, 0)
        elif ids.size and int(ids.max()) >= len(self.table):
            raise UnsupportedModelError(
                f"token id {int(ids.max())} has no row in embed_tokens_per_layer, whose "
                f"{len(self.table)} rows (vocab_size_per_layer_input) Gemma 4 reads for "
                "every token"
            )
        tokens = (self.table[ids] * self.table_scale).reshape(B, L, self.count, self.width)
        projected = (x @ self.projection) * self.projection_scale
        projected = projected.reshape(B, L, self.count, self.width)
        projected = scaled_rms_norm(projected, self.norm, None, self.eps)
        return (projected + tokens) * self.input_scale


def per_layer_stage(tensors: Tensors, act: Function, norm: Norm) -> Callable[..., np.ndarray]:
    """A layer's last stage with its per-layer input ``p (B, L, P)``:
    ``norm(projection(act(gate(h)) * p))``, the caller adding it where the family does."""
    gate, projection = (
        linear(tensors, "per_layer_input_gate"),
        linear(tensors, "per_layer_projection"),
    )
    weight = tensors.take("post_per_layer_input_norm.weight")
    return lambda h, p: norm(projection(act(gate(h)) * p), weight)


class GemmaLayer:
    """A Gemma 3n or Gemma 4 layer's own stages: its per-layer input's (``None``: the
    model has none), its ``layer_scalar`` (``None``: Gemma 3n), its AltUp and LAuReL
    (``None``: Gemma 4)."""

    def __init__(
        self,
        tensors: Tensors,
        act: Function,
        norm: Norm,
        per_layer: bool,
        scalar: bool,
        altup: dict[str, Any] | None,
    ) -> None:
        self.per_layer = per_layer_stage(tensors, act, norm) if per_layer else None
        self.scalar = tensors.take("layer_scalar") if scalar else None
        self.altup = None if altup is None else AltUp(tensors, norm, **altup)
        self.laurel = None if altup is None else laurel(tensors, norm)

    def finish(self, x: np.ndarray, p: np.ndarray | None) -> np.ndarray:
        """Gemma 4's end of a layer: ``x`` plus its per-layer input's stage, times its
        scalar."""
        if self.per_layer is not None:
            x = x + self.per_layer(x, p)
        return x if self.scalar is None else x * self.scalar


def gemma4_moe(
    tensors: Tensors, act: Function, dense: Function, before: Any, norm: Norm, eps: float, k: int
) -> Function:
    """Gemma 4's MLP with its mixture of experts beside it (``enable_moe_block``), a
    function of the residual stream ``x``: the MLP's output normed
    (``post_feedforward_layernorm_1``) plus the mixture's (``post_feedforward_layernorm_2``),
    the MLP reading ``x`` through ``pre_feedforward_layernorm`` (its weight ``before``), the
    experts through ``pre_feedforward_layernorm_2``. The router reads ``x`` through an
    RMSNorm without weights, times its ``scale`` and ``hidden_size ** -0.5``; a softmax in
    float32 over its logits chooses the ``top_k_experts`` most probable experts, their
    probabilities renormalised and times each one's ``per_expert_scale``. Each expert is
    ``down(act(gate(h)) * up(h))``, gate and up one projection ``(2I, D)``."""
    after_dense, before_experts, after_experts = (
        tensors.take(f"{name}.weight")
        for name in (
            "post_feedforward_layernorm_1",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_2",
        )
    )
    router = tensors.take("router.proj.weight").T
    router_scale, per_expert = tensors.take("router.scale"), tensors.take("router.per_expert_scale")
    gate_up, down = tensors.take("experts.gate_up_proj"), tensors.take("experts.down_proj")
    root = router.dtype.type(router.shape[0] ** -0.5)

    def expert(e: int) -> Function:
        def run(h: np.ndarray) -> np.ndarray:
            gate, up = np.split(h @ gate_up[e].T, 2, axis=-1)
            return (act(gate) * up) @ down[e].T

        return run

    experts = [expert(e) for e in range(len(gate_up))]

    def mlp(x: np.ndarray) -> np.ndarray:
        flat = x.reshape(-1, x.shape[-1])
        logits = ((weightless_rms_norm(flat, None, None, eps) * router_scale) * root) @ router
        logits = logits.astype(np.float32)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        chosen = top_k(probs, k)
        weights = np.take_along_axis(probs, chosen, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True) * per_expert[chosen]
        mixed = mixture(experts, norm(flat, before_experts), chosen, weights)
        return norm(dense(norm(x, before)), after_dense) + norm(
            mixed.reshape(x.shape), after_experts
        )

    return mlp


# ---------------------------------------------------------------- AltUp and LAuReL


def laurel(tensors: Tensors, norm: Norm) -> Function:
    """Gemma 3n's LAuReL (learned augmented residual): ``h + norm(right(left(h)))``, a
    rank-``laurel_rank`` branch."""
    left, right = linear(tensors, "laurel.linear_left"), linear(tensors, "laurel.linear_right")
    weight = tensors.take("laurel.post_laurel_norm.weight")
    return lambda h: h + norm(right(left(h)), weight)


class AltUp:
    """A layer's AltUp (alternating updates) over ``n`` streams ``(n, B, L, D)``: the
    active stream ``active``, routed coefficients that predict each stream from all of
    them and correct each by the active one's innovation, and a scale of the corrected
    active stream (``correct_scale``)."""

    def __init__(
        self, tensors: Tensors, norm: Norm, n: int, active: int, correct_scale: bool, D: int
    ) -> None:
        self.n, self.active, self.norm = n, active, norm
        self.router = tensors.take("altup.modality_router.weight").T
        self.router_norm = tensors.take("altup.router_norm.weight")
        self.prediction = tensors.take("altup.prediction_coefs.weight").T
        self.correction = tensors.take("altup.correction_coefs.weight").T
        output_scale = tensors.take("altup.correct_output_scale")
        self.output_scale = output_scale if correct_scale else None
        self.router_scale = self.router.dtype.type(1.0 / D)

    def modalities(self, x: np.ndarray) -> np.ndarray:
        """``tanh(router(norm(x) / D))``, the tanh in float32."""
        routed = (self.norm(x, self.router_norm) * self.router_scale) @ self.router
        return np.tanh(routed.astype(np.float32)).astype(x.dtype)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Each stream plus the routed mixture of all of them."""
        modalities = self.modalities(x[self.active])
        coefficients = (modalities @ self.prediction).reshape(
            *modalities.shape[:-1], self.n, self.n
        )
        mixed = np.matmul(x.transpose(1, 2, 3, 0), coefficients.transpose(0, 1, 3, 2))
        return mixed.transpose(3, 0, 1, 2) + x

    def correct(self, predictions: np.ndarray, activated: np.ndarray) -> np.ndarray:
        """Each prediction plus the active stream's innovation times its routed
        coefficient plus one."""
        modalities = self.modalities(activated)
        innovation = activated - predictions[self.active]
        coefficients = (modalities @ self.correction + 1.0).transpose(2, 0, 1)[..., None]
        return innovation[None] * coefficients + predictions


def _rescaled(projected: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``projected`` times ``target / rms(projected)``, its mean square at least 1e-5."""
    magnitude = np.sqrt(np.maximum(np.mean(np.square(projected), axis=-1, keepdims=True), 1e-5))
    return projected * target / magnitude


def spread(x: np.ndarray, projections: list[np.ndarray]) -> np.ndarray:
    """Gemma 3n's streams ``(n, B, L, D)`` of embeddings ``x``: ``x``, then each
    ``altup_projections`` of it at ``x``'s RMS."""
    target = _rms(x)
    return np.stack([x, *(_rescaled(x @ W.T, target) for W in projections)])


def merge(x: np.ndarray, projections: list[np.ndarray]) -> np.ndarray:
    """The mean of the first stream and each other's ``altup_unembed_projections`` at the
    first one's RMS."""
    target = _rms(x[0])
    streams = [x[0], *(_rescaled(h @ W.T, target) for h, W in zip(x[1:], projections, strict=True))]
    return np.mean(np.stack(streams), axis=0)


def altup_layer(
    layer: Any,
    x: np.ndarray,
    attention: Function,
    norm: Norm,
    p: np.ndarray,
) -> np.ndarray:
    """Gemma 3n's decoder layer on streams ``x (n, B, L, D)``, its per-layer input ``p``:
    the active prediction through the attention (with LAuReL beside it, the sum over
    ``sqrt(2)``) and the MLP, each in its sandwich of norms, then the correction and the
    per-layer input's stage added to the streams but the active one."""
    stages: GemmaLayer = layer.stages
    altup, laurel, per_layer = stages.altup, stages.laurel, stages.per_layer
    assert altup is not None and laurel is not None and per_layer is not None  # Gemma 3n's
    before_attention, after_attention, before_mlp, after_mlp = (
        weights[0] for weights in layer.norms
    )
    predictions = altup.predict(x)
    active = predictions[altup.active]
    h = norm(active, before_attention)
    attended = active + norm(attention(h), after_attention)
    h = (attended + laurel(h)) / h.dtype.type(math.sqrt(2.0))
    h = h + norm(layer.mlp(norm(h, before_mlp)), after_mlp)
    corrected = altup.correct(predictions, h)
    first = corrected[altup.active]
    if altup.output_scale is not None:
        first = first * altup.output_scale
    corrected[1:] += per_layer(first, p)
    return corrected


def sparse_gate(gate: np.ndarray, multiplier: Any) -> np.ndarray:
    """Gemma 3n's activation sparsity: ``relu(g - (mean(g) + std(g) * multiplier))`` per
    token, ``multiplier`` the standard normal's quantile of the layer's sparsity."""
    mean = gate.mean(axis=-1, keepdims=True)
    std = gate.std(axis=-1, keepdims=True)
    return np.maximum(gate - (mean + std * multiplier), 0)


def sparse_mlp(tensors: Tensors, act: Function, sparsity: float) -> Function:
    """Gemma 3n's MLP of a layer with ``activation_sparsity_pattern`` ``sparsity > 0``:
    its gate's values below the token's mean plus ``icdf(sparsity)`` standard deviations
    cut to zero (:func:`sparse_gate`) before the activation; the quantile float32's, as
    torch computes it."""
    gate, up, down = (linear(tensors, f"mlp.{name}") for name in GATE_UP_DOWN)
    multiplier = float(np.float32(NormalDist().inv_cdf(float(np.float32(sparsity)))))
    return lambda h: down(act(sparse_gate(gate(h), h.dtype.type(multiplier))) * up(h))
