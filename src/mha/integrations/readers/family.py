"""What one row of the table says about a ``model_type``'s attention (:class:`Family`), and
the values its fields take beside those of :mod:`.layouts`, :mod:`.windows`, :mod:`.rope`
and :mod:`.alibi`: the heads and their width (:data:`Heads`), QK-norm (:class:`QkNorm`),
softmax scales from config keys, and the config keys that ask for an attention feature mha
lacks (:class:`~.config.Unsupported`), refused by that feature's name.

>>> from mha.integrations.readers.layouts import NO_BIASES
>>> from mha.integrations.readers.windows import EVERY_LAYER
>>> row = Family("mistral_renamed", {"sliding_window": 4096}, biases=NO_BIASES,
...              windows=EVERY_LAYER)
>>> row.tensors.kind, row.qk_norm
('attention', None)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .alibi import Alibi
from .config import Settings, Unsupported, is_given
from .hybrid import Hybrid
from .layouts import (
    ATTENTION_BIAS,
    SEPARATE_QKV,
    Biases,
    BiasesByKey,
    LatentProjections,
    Projections,
    Tensor,
    whole,
)
from .rope import Rope
from .shared_blocks import SharedBlocks
from .values import Values
from .windows import NO_WINDOWS, Windows

__all__ = [
    "ACROSS_HEADS",
    "BIDIRECTIONAL",
    "CLIP_QKV",
    "LAYERNORM_QK",
    "PER_HEAD",
    "UNSUPPORTED",
    "ClipQkv",
    "Differential",
    "DynamicMask",
    "Family",
    "Gate",
    "Heads",
    "OutputNorm",
    "OwnWeights",
    "QkNorm",
    "SlidingLayers",
    "ValueWidth",
    "attention_multiplier",
    "falcon_heads",
    "from_config",
    "multi_query",
    "query_pre_attn_scalar",
    "split_hidden",
    "unscaled",
]

Heads = Callable[[Settings], tuple[int, int, int]]
"""A family's heads from its config: ``(query heads, key/value heads, head width)``."""


def from_config(read: Settings, head_dim: str | None = "head_dim") -> tuple[int, int, int]:
    """``num_key_value_heads`` (else one per query head) and the config key ``head_dim``
    (else, or when ``None``, the hidden size's share of a head): Llama's and most families'."""
    E, H = read.positive("hidden_size"), read.positive("num_attention_heads")
    H_kv = read.positive("num_key_value_heads", optional=True) or H
    given = read.positive(head_dim, optional=True) if head_dim else None
    return H, H_kv, given or E // H


def split_hidden(read: Settings, H_kv: int | None = None) -> tuple[int, int, int]:
    """A key and value per head (or ``H_kv``), each head ``hidden_size // heads`` wide,
    whatever else the config says (GPT-2's and the other families before GQA)."""
    E, H = read.positive("hidden_size"), read.positive("num_attention_heads")
    if E % H:
        raise read.refuse(
            f"{read.name('hidden_size')}={E} not a multiple of "
            f"{read.name('num_attention_heads')}={H} (transformers' {read.family} attention "
            "needs it)"
        )
    return H, H if H_kv is None else H_kv, E // H


def multi_query(read: Settings) -> tuple[int, int, int]:
    """One key/value head when ``multi_query`` (BigCode), else one per head."""
    return split_hidden(read, 1 if read.get("multi_query") else None)


def falcon_heads(read: Settings) -> tuple[int, int, int]:
    """Falcon's: ``num_kv_heads`` (null: one per head) in the new decoder architecture, else
    one key/value head when ``multi_query``, else one per head."""
    if read.get("new_decoder_architecture"):
        return split_hidden(read, read.positive("num_key_value_heads", optional=True))
    return multi_query(read)


@dataclass(frozen=True)
class QkNorm:
    """RMSNorm of the queries and keys before the rotation: per ``"head"`` (weights of the
    head's width), across ``"all"`` heads (before the split) or per head with each head's
    weights (``"each_head"``), the weight applied as ``offset + weight``, its epsilon from
    the config key ``eps``; always, or with ``when``, where that config key is true
    (GLM-4.5's ``use_qk_norm``). ``layer``: a LayerNorm instead, with biases when
    ``bias``; ``after_rope``: after the rotation (HunYuan's). ``weighted=False``: a norm
    without weights (NanoChat's, after the rotation, with which it commutes: the rotation
    keeps each head's norm), read as weights of ones; a rope whose attention factor scales
    the rotation (``yarn``, ``longrope``) is then refused."""

    over: str = "head"
    offset: float = 0.0
    eps: str = "rms_norm_eps"
    when: str | None = None
    weighted: bool = True
    layer: bool = False
    bias: bool = False
    after_rope: bool = False

    def applies(self, read: Settings) -> bool:
        return self.when is None or bool(read.get(self.when))


PER_HEAD = QkNorm("head")
ACROSS_HEADS = QkNorm("all")

LAYERNORM_QK = QkNorm("head", eps="layer_norm_eps", when="qk_layernorm", layer=True, bias=True)
"""Phi's and Persimmon's option of LayerNorms (weights and biases shared by the heads) of
the queries and keys."""


def query_pre_attn_scalar(read: Settings) -> float:
    """Gemma's softmax scale: ``query_pre_attn_scalar ** -0.5`` (not the head width's)."""
    scale: float = float(read.get("query_pre_attn_scalar")) ** -0.5
    return scale


def unscaled(read: Settings) -> float:
    """A softmax scale of 1: the scores are the dot products (GPT-Neo's)."""
    return 1.0


def attention_multiplier(read: Settings) -> float | None:
    """Granite's softmax scale: ``attention_multiplier`` (``None``, HyperCLOVA X's default,
    is the head width's)."""
    scale = read.get("attention_multiplier")
    return None if scale is None else float(scale)


@dataclass(frozen=True)
class Gate:
    """An output gate, ``act(x @ W_g)`` times the joined heads before ``o_proj``
    (:class:`mha.api.gates.OutputGate`): the tensor ``tensor`` under the attention (an
    ``nn.Linear`` of one column a feature, or a head with ``per_head``: always, never, or as
    a function of the config says), its activation and its bias (where ``bias`` names a
    config key, when that key is true; ``head_bias``: the tensor of one bias a head, over the
    head's features, Beam's ``gate_bias``)."""

    tensor: str = "gate_proj"
    activation: str = "sigmoid"
    per_head: bool | Callable[[Settings], bool] = False
    bias: str | None = None
    head_bias: str | None = None

    def is_per_head(self, read: Settings) -> bool:
        return self.per_head(read) if callable(self.per_head) else self.per_head

    def settings(self, read: Settings) -> dict[str, Any]:
        return {"output_gate": self.activation, "output_gate_per_head": self.is_per_head(read)}

    def tensors(self, read: Settings, E: int, H: int, d: int) -> dict[str, Tensor]:
        """``W_g`` (and ``b_g``) of a layer of ``H`` heads ``d`` wide, model width ``E``."""
        columns = H if self.is_per_head(read) else H * d
        tensors = {f"{self.tensor}.weight": whole("W_g", columns, E)}
        if self.bias is not None and read.get(self.bias):
            tensors[f"{self.tensor}.bias"] = whole("b_g", columns)
        if self.head_bias is not None:  # (H,): repeated over each head's features
            tensors[self.head_bias] = whole("b_g", H)
        return tensors


@dataclass(frozen=True)
class OutputNorm:
    """A norm of the joined heads over all their features before ``o_proj``
    (:class:`mha.api.output_norm.OutputNorm`): ``"rms"``, an RMSNorm of the weight
    ``tensor`` under the attention (BitNet's ``attn_sub_norm``), or ``"l2"`` without
    weights (Dory's); its epsilon from the config key ``eps``, or ``eps`` itself (a number)."""

    kind: str = "rms"
    tensor: str | None = "attn_sub_norm.weight"
    eps: str | float = "rms_norm_eps"

    def settings(self, read: Settings) -> dict[str, Any]:
        eps = float(read.get(self.eps)) if isinstance(self.eps, str) else self.eps
        return {"output_norm": self.kind, "output_norm_eps": eps}

    def tensors(self, width: int) -> dict[str, Tensor]:
        """``o_norm`` of the joined heads ``width`` features wide (none for ``"l2"``)."""
        return {} if self.tensor is None else {self.tensor: whole("o_norm", width)}


class OwnWeights(Protocol):
    """Tensors of a family's own under its attention, folded into mha's weights (Dory's nGPT
    scales)."""

    def tensors(self, read: Settings, settings: dict[str, Any]) -> dict[str, Tensor]: ...

    def folded(
        self, read: Settings, settings: dict[str, Any], weights: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]: ...


BIDIRECTIONAL = Unsupported("use_bidirectional_attention", "attention that is not causal")
"""Gemma's option of attention without the causal mask."""


@dataclass(frozen=True)
class ClipQkv:
    """The clamp of the projections to ``[-c, c]`` (``clip_qkv=``), ``c`` from the config
    key ``key``: ``null`` for none; ``0`` for none where the family tests the value's truth
    (``zero_is_off``: MPT's ``if self.clip_qkv``), else refused (a clamp to zero)."""

    key: str = "clip_qkv"
    zero_is_off: bool = False

    def bound(self, read: Settings) -> float | None:
        value = read.get(self.key)
        if value is None or (self.zero_is_off and value == 0 and not isinstance(value, str)):
            return None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not 0 < value < float("inf"):
            raise read.refuse(
                f"{read.name(self.key)}={value!r} (the projections clamped to a bound that is "
                "not a positive number)"
            )
        return float(value)


CLIP_QKV = ClipQkv()
"""OLMo's, OLMoE's and DBRX's clamp of the projections to ``[-clip_qkv, clip_qkv]``."""


@dataclass(frozen=True)
class ValueWidth:
    """Values of their own head width, the config key ``width`` (MiMo-V2-Flash's
    ``v_head_dim``, narrower than its keys), multiplied after their projection by the config
    key ``scale`` (null: 1), which the reader folds into ``W_v`` and ``b_v``."""

    width: str = "v_head_dim"
    scale: str | None = None

    def factor(self, read: Settings) -> float:
        value = read.get(self.scale) if self.scale else None
        if value is None or self.scale is None:
            return 1.0
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not abs(value) < float("inf"):
            raise read.refuse(f"{read.name(self.scale)}={value!r} (values scaled by no number)")
        return float(value)


@dataclass(frozen=True)
class SlidingLayers:
    """What a family's sliding layers have beyond a window (MiMo-V2-Flash's): ``kv_heads``
    times the key/value heads of its full layers, and learned sinks when ``sinks``."""

    kv_heads: int = 1
    sinks: bool = False


@dataclass(frozen=True)
class Differential:
    """DiffLlama's differential attention (:class:`mha.DifferentialAttention`): heads ``i``
    and ``i + H/2`` subtracted, weighted by ``lambda`` (the vectors ``lambda_q1``,
    ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` under the attention), each result normalised
    (epsilon: the config key ``eps``) and times ``1 - lambda_init``, ``0.8 - 0.6 * exp(-0.3 *
    i)`` in layer ``i``. A query head's values are its key/value head's two halves' joined:
    the value heads ``c mod n`` and ``n + c mod n`` of ``n = H_kv / 2``, read into ``W_v``
    (``2 * head_dim`` a head)."""

    eps: str = "rms_norm_eps"
    names: tuple[str, ...] = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")

    def settings(self, read: Settings, index: int, heads: tuple[int, int, int]) -> dict[str, Any]:
        H, H_kv, d = heads
        if H % 2 or H_kv % 2:
            raise read.refuse(
                f"{H} heads and {H_kv} key/value heads (its attention pairs both halves: even "
                "numbers are needed)"
            )
        lambda_init = 0.8 - 0.6 * math.exp(-0.3 * index)
        eps = float(read.get(self.eps))
        return {"v_head_dim": 2 * d, "lambda_init": lambda_init, "differential_eps": eps}

    def tensors(self, d: int) -> dict[str, Tensor]:
        return {name: whole(name, d) for name in self.names}

    def columns(self, H_kv: int, d: int) -> np.ndarray:
        """The columns of ``W_v`` (and ``b_v``) that make the ``2d``-wide values."""
        n = H_kv // 2
        heads = [(c % n, n + c % n) for c in range(H_kv)]
        return np.array([h * d + j for pair in heads for h in pair for j in range(d)])


@dataclass(frozen=True)
class DynamicMask:
    """Doge's dynamic mask attention (:class:`mha.DynamicMaskAttention`): a bias of each
    key/value head and key, ``exp(A * softplus(dt_proj(v)))``, added to the scores, and each
    query's config key ``keep`` keys of the largest bias kept; ``dt_proj`` biased where the
    config key ``bias`` is true."""

    keep: str = "keep_window_size"
    bias: str = "attention_bias"

    def settings(self, read: Settings) -> dict[str, Any]:
        return {"keep_window_size": read.positive(self.keep)}

    def tensors(self, read: Settings, H_kv: int, d: int) -> dict[str, Tensor]:
        tensors = {"dt_proj.weight": whole("W_dt", H_kv, H_kv * d), "A": whole("A", H_kv)}
        if read.get(self.bias):
            tensors["dt_proj.bias"] = whole("b_dt", H_kv)
        return tensors


UNSUPPORTED = (
    Unsupported("attention_chunk_size", "chunked attention", is_given),
    Unsupported("use_qk_norm", "Llama 4's L2 QK-norm"),
)
"""Keys refused in every multi-head family's config, after the family's own."""


@dataclass(frozen=True)
class Family:
    """One row of the table: how a ``model_type``'s attention reads its config and its
    tensors (transformers 5.24). Every field but the first two has the value most families
    take (Llama's), so that a row names only what its family does differently."""

    name: str
    """The ``model_type`` of ``config.json``."""
    defaults: Mapping[str, Any]
    """The config class's defaults of the keys read (``config.json`` may omit them)."""
    keys: Mapping[str, str] = field(default_factory=dict)
    """The family's names of the config keys read, where they are not transformers' common
    ones (its config class's ``attribute_map``: ``{"num_attention_heads": "n_head"}``)."""
    head_dim: str | None = "head_dim"
    """The config key of the head width, else ``hidden_size // num_attention_heads``
    (``None``: always that, whatever the config says, as StableLM's attention takes it)."""
    tensors: Projections | LatentProjections = SEPARATE_QKV
    """Which tensors hold Q, K, V and O (:mod:`.layouts`); :data:`~.layouts.LATENT` for
    DeepSeek's multi-head latent attention (the layer is a :class:`mha.LatentAttention`)."""
    heads: Heads = from_config
    """The heads and their width (multi-head families; :func:`from_config` reads the width
    from :attr:`head_dim`)."""
    biases: Biases | BiasesByKey = ATTENTION_BIAS
    windows: Windows = NO_WINDOWS
    """Which layers slide and how far (:mod:`.windows`; multi-head families)."""
    rope: Rope = field(default_factory=Rope)
    scale: Callable[[Settings], float | None] | None = None
    """The softmax scale (``None``: the attention's own, ``1/sqrt(head_dim)``)."""
    scale_by_layer: str | None = None
    """The config key that, when true, divides layer ``i``'s scale by ``i + 1`` (GPT-2's
    ``scale_attn_by_inverse_layer_idx``)."""
    alibi: Alibi | None = None
    """ALiBi's slopes, and the config key that turns it on (the rope then off)."""
    softcap: str | None = None
    """The config key of the scores' soft-cap (Gemma 2's ``attn_logit_softcapping``)."""
    qk_norm: QkNorm | None = None
    gate: Gate | None = None
    """The output gate (AFMoE's ``gate_proj``), when the attention has one."""
    output_norm: OutputNorm | None = None
    """The norm of the joined heads before ``o_proj`` (BitNet's ``attn_sub_norm``)."""
    heads_by_layer: str | None = None
    """The config key of the list of each layer's query heads, where layers differ
    (Laguna's ``num_attention_heads_per_layer``; null: :attr:`heads`' for every layer)."""
    clip_qkv: ClipQkv | None = None
    """The config key of the projections' clamp (OLMo's ``clip_qkv``), when it has one."""
    sinks: bool = False
    """One learned logit per head that takes part in the softmax (gpt-oss)."""
    differential: Differential | None = None
    """DiffLlama's differential attention (the layer a :class:`mha.DifferentialAttention`)."""
    dynamic_mask: DynamicMask | None = None
    """Doge's dynamic mask attention (the layer a :class:`mha.DynamicMaskAttention`)."""
    value_width: ValueWidth | None = None
    """The values' own head width and scale, where they differ from the keys' (MiMo-V2-Flash)."""
    sliding: SlidingLayers | None = None
    """More key/value heads and sinks in the sliding layers alone (MiMo-V2-Flash)."""
    values: Values | None = None
    """The values' norm, values that are the keys' projection, heads of each layer and
    layers that share an earlier layer's keys and values (Gemma 3n, Gemma 4: :mod:`.values`)."""
    unsupported: tuple[Unsupported, ...] = ()
    """The family's config keys that ask for what mha does not compute (checked before
    :data:`UNSUPPORTED`)."""

    hybrid: Hybrid | None = None
    """Which layers are attention in a hybrid family (:mod:`.hybrid`); the others are
    refused by their index and what they compute (``None``: every layer is attention)."""

    shared: SharedBlocks | None = None
    """Attention blocks shared by the attention layers, read from the layer that keeps each
    block, with each layer's adapters folded in (Zamba's, Zamba2's: :mod:`.shared_blocks`)."""

    own_weights: OwnWeights | None = None
    """Tensors of the family's own, folded into the weights (Dory's ``sqk`` and ``s_gate``)."""

    slots: Callable[[Settings], int] | None = None
    """The attention layers as ``layer=`` numbers them, where ``num_hidden_layers`` does not
    count them: Dory's cache slots, the looped layers once a loop."""

    by_layer: Callable[[Settings, int, dict[str, Any]], dict[str, Any]] | None = None
    """The family's own settings of layer ``index``, given those read so far, which they
    replace (Llama 4's chunks and QK-norm on its rope layers, its query temperature on the
    others; Ministral 3's and Beam's query temperature: :mod:`.temperature`)."""

    own: tuple[str, ...] = ()
    """Keys of :data:`UNSUPPORTED` that mean something else in this family, read as its row
    says (GLM-4.5's ``use_qk_norm``, its RMSNorm QK-norm) or ignored as its attention
    ignores them (MiniMax-M2's, whose QK-norm is always on), not refused."""

    def heads_of(self, read: Settings) -> tuple[int, int, int]:
        """The heads and their width in ``read``'s config: :attr:`heads`'s, the width from
        :attr:`head_dim` where that is :func:`from_config`."""
        return from_config(read, self.head_dim) if self.heads is from_config else self.heads(read)

    def refused(self) -> tuple[Unsupported, ...]:
        """The options refused in this family's config: its own, then those of
        :data:`UNSUPPORTED` but for its :attr:`own` keys."""
        return (*self.unsupported, *(u for u in UNSUPPORTED if u.key not in self.own))
