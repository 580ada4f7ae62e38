"""The hybrid families whose attention has an output gate (issue 33): the joined heads times
``sigmoid(x @ W_g)`` before ``o_proj`` (:class:`mha.api.gates.OutputGate`), their other layers
(Gated DeltaNet linear attention, short convolutions) refused by their index.

* Qwen3-Next and Qwen3.5 (dense and MoE): the gate fused into ``q_proj``, each head's query
  then its gate (:class:`QueryGate`), a gate per feature; QK-norm of ``1 + weight``; a
  quarter of each head rotated by default; Qwen3.5's multimodal rope read as the rope of text
  (the same position on every axis).
* LFM3: a gate per head (``g_proj``, which transformers saves as ``gate_proj``) when
  ``use_attention_gate`` (:class:`OptionalGate`); sliding and full layers between short
  convolutions, a rope per layer type (the full layers' ``proportional``: the first
  ``partial_rotary_factor`` of the pairs rotate).
* Bailing-hybrid (Ling 3): DeepSeek's multi-head latent attention (:class:`mha.LatentAttention`)
  with a gate per head (``g_proj``), the last layer of each ``layer_group_size`` between
  Kimi Delta Attention (linear-attention) layers.

>>> [row.name for row in ROWS]
['qwen3_next', 'qwen3_5_text', 'qwen3_5_moe_text', 'lfm3', 'bailing_hybrid']
>>> from mha.integrations.readers.layouts import lay_out
>>> import numpy as np
>>> fused = QueryGate(bias=None).tensors(None, 1, 2, 2)["q_proj.weight"]  # q0 g0 q1 g1, 2 rows each
>>> {name: W.ravel().tolist() for name, W in lay_out(np.arange(8.0)[:, None], fused).items()}
{'W_q': [0.0, 1.0, 4.0, 5.0], 'W_g': [2.0, 3.0, 6.0, 7.0]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import FULL, SLIDING, Settings
from .family import Family, Gate, QkNorm
from .hybrid import CONV, LINEAR, Hybrid, from_layer_types
from .layouts import LatentProjections, Tensor
from .rope import Rope
from .windows import ByLayerTypes

__all__ = [
    "BAILING_HYBRID",
    "BAILING_LAYOUT",
    "LFM3",
    "QWEN3_5_MOE_TEXT",
    "QWEN3_5_TEXT",
    "QWEN3_NEXT",
    "ROWS",
    "OptionalGate",
    "QueryGate",
    "by_group",
    "every_interval",
    "lfm3_types",
]

_QWEN_GATED = {
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "layer_types": None,
}
QWEN3_NEXT: dict[str, Any] = {"hidden_size": 2048, **_QWEN_GATED}
QWEN3_5_TEXT: dict[str, Any] = {
    **_QWEN_GATED,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_key_value_heads": 4,
}
QWEN3_5_MOE_TEXT: dict[str, Any] = {**_QWEN_GATED, "hidden_size": 2048, "num_hidden_layers": 40}
LFM3: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "attention_bias": False,
    "norm_eps": 1e-5,
    "max_position_embeddings": 128_000,
    "sliding_window": 256,
    "layer_types": None,
    "use_attention_gate": True,
}
BAILING_HYBRID: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 42,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "attention_bias": False,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 6_000_000.0,
    "max_position_embeddings": 262144,
    "layer_types": None,
    "layer_group_size": 6,
}


@dataclass(frozen=True)
class QueryGate(Gate):
    """A gate per feature fused into the query projection: ``q_proj`` holds ``2 * head_dim``
    rows a head, its query then its gate (Qwen3-Next's ``torch.chunk`` of each head's rows),
    with their biases where the config key ``bias`` is true."""

    tensor: str = "q_proj"
    bias: str | None = "attention_bias"

    def tensors(self, read: Settings, E: int, H: int, d: int) -> dict[str, Tensor]:
        """The fused ``q_proj`` (and its bias): ``W_q`` and ``W_g``, ``d`` rows each a head."""
        tensors = {f"{self.tensor}.weight": Tensor((2 * H * d, E), (("W_q", d), ("W_g", d)), H)}
        if self.bias is not None and read.get(self.bias):
            tensors[f"{self.tensor}.bias"] = Tensor((2 * H * d,), (("b_q", d), ("b_g", d)), H)
        return tensors


@dataclass(frozen=True)
class OptionalGate(Gate):
    """A gate only where the config key ``when`` is true (LFM3's ``use_attention_gate``)."""

    when: str = "use_attention_gate"

    def settings(self, read: Settings) -> dict[str, Any]:
        return super().settings(read) if read.get(self.when) else {}

    def tensors(self, read: Settings, E: int, H: int, d: int) -> dict[str, Tensor]:
        return super().tensors(read, E, H, d) if read.get(self.when) else {}


def every_interval(read: Settings, count: int) -> list[str]:
    """Qwen3-Next's default layer types: full attention at every ``full_attention_interval``-th
    layer (4 by default: layers 3, 7, ...), Gated DeltaNet linear attention elsewhere."""
    interval = read.get("full_attention_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise read.refuse(f"full_attention_interval={interval!r} (a positive integer is needed)")
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(count)]


def lfm3_types(read: Settings, count: int) -> list[str]:
    """LFM3's default layer types: full attention at layers 2, 6, ..., sliding at 4, 8, ...,
    short convolutions elsewhere."""
    return [FULL if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else CONV for i in range(count)]


BAILING_LAYOUT = LatentProjections(o="dense", path="model.layers.{i}.attention")
"""Bailing-hybrid's own names (``attention``, ``dense``), which transformers renames to
DeepSeek's (``self_attn``, ``o_proj``) when it loads them and back when it saves."""


def by_group(read: Settings, count: int) -> list[str]:
    """Bailing-hybrid's default layer types: full attention at the last layer of each
    ``layer_group_size`` layers, Kimi Delta Attention (linear) elsewhere."""
    size = read.positive("layer_group_size")
    return [FULL if (i + 1) % size == 0 else LINEAR for i in range(count)]


_DELTANET = {LINEAR: "a Gated DeltaNet linear-attention layer"}


def _qwen_gated(name: str, defaults: dict[str, Any], title: str, text: bool) -> Family:
    """Qwen3-Next's attention (Qwen3.5's, with ``text``: its multimodal rope as the rope of
    text)."""
    return Family(
        name,
        defaults,
        rope=Rope(partial=True, fraction=0.25, text_mrope=text),
        qk_norm=QkNorm("head", offset=1.0),
        gate=QueryGate(),
        hybrid=Hybrid(title, from_layer_types(every_interval), _DELTANET),
    )


ROWS: tuple[Family, ...] = (
    _qwen_gated("qwen3_next", QWEN3_NEXT, "Qwen3-Next", text=False),
    _qwen_gated("qwen3_5_text", QWEN3_5_TEXT, "Qwen3.5", text=True),
    _qwen_gated("qwen3_5_moe_text", QWEN3_5_MOE_TEXT, "Qwen3.5-MoE", text=True),
    Family(  # a gate per head; a rope per layer type, the full layers' proportional
        "lfm3",
        LFM3,
        keys={"rms_norm_eps": "norm_eps"},
        windows=ByLayerTypes(lfm3_types),
        rope=Rope(
            theta=1_000_000.0,
            per_layer_type={FULL: (None, 1_000_000.0), SLIDING: (None, 10_000.0)},
            partial=True,
        ),
        qk_norm=QkNorm("head", eps="norm_eps"),
        gate=OptionalGate(per_head=True),  # g_proj, saved as gate_proj
        hybrid=Hybrid("LFM3", from_layer_types(lfm3_types), {CONV: "a short-convolution layer"}),
    ),
    Family(  # DeepSeek's latent attention with a sigmoid gate per head (g_proj)
        "bailing_hybrid",
        BAILING_HYBRID,
        tensors=BAILING_LAYOUT,
        rope=Rope(interleave=True),
        gate=Gate("g_proj", per_head=True),
        hybrid=Hybrid(
            "Bailing-hybrid",
            from_layer_types(by_group),
            {LINEAR: "a Kimi Delta Attention (linear-attention) layer"},
        ),
    ),
)
"""The rows of these families, registered by :mod:`.registry`."""
