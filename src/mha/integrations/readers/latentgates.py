"""The latent attentions with an output gate beside sparse top-k attention (issue 33):
DeepSeek's multi-head latent attention (:class:`mha.LatentAttention`) whose keys a
lightning indexer picks (DSA, :mod:`.sparse`), its joined heads gated before ``o_proj``.

* A.X-K2: ``q_gate_proj`` (saved as ``q_b_proj``) reads the query latent after and before
  its RMSNorm, ``[norm(a), a]``, and gives each head's query then its sigmoid gate, one a
  feature (:attr:`.LatentProjections.query_gate`); the indexer reads ``norm(a)``.
* dots3 (its text model, ``dots3_note_text``): a sigmoid gate per head (``g_proj``, from
  ``x``); the query and latent norms' outputs times ``sqrt(hidden_size / rank)`` (read into
  their weights, as LongCat-Flash's); the shared rotary key RMS-normalised before its
  rotation (``k_rope_only_layernorm``); every norm's epsilon ``rms_norm_eps``. Its
  ``indexed_attention`` layers have GLM-MoE-DSA's indexer, its ``sliding_attention``
  layers a sliding window (``sliding_window``) and their own sizes
  (``per_layer_config``, else the ``swa_*`` keys) and rope (:class:`Dots3Projections`).

>>> [row.name for row in ROWS]
['axk2', 'dots3_note_text']
>>> dots3_layer_types(5, None, None)
['indexed_attention', 'indexed_attention', 'sliding_attention', 'sliding_attention', \
'sliding_attention']
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .config import FULL, SLIDING, Settings
from .family import Family, Gate
from .layouts import Tensor, whole
from .rope import Rope
from .sparse import DEEPSEEK_V32, IndexedLatentProjections

__all__ = ["AXK2", "DOTS3_NOTE_TEXT", "ROWS", "Dots3Projections", "dots3_layer_types"]

INDEXED = "indexed_attention"

AXK2: dict[str, Any] = {
    **DEEPSEEK_V32,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 128,
    "q_lora_rank": 384,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "qk_nope_head_dim": 64,
    "max_position_embeddings": 131072,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 16,
}

DOTS3_NOTE_TEXT: dict[str, Any] = {
    **DEEPSEEK_V32,
    "hidden_size": 5120,
    "num_hidden_layers": 46,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "head_dim": 256,
    "q_lora_rank": 1024,
    "max_position_embeddings": 524288,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
    "index_n_heads": 64,
}
_SLIDING_SIZES = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1024,
    "kv_lora_rank": 1024,
    "head_dim": 256,
    "qk_nope_head_dim": 192,
    "v_head_dim": 128,
}
"""The sizes of dots3's sliding layers when ``config.json`` has no ``per_layer_config``: the
``swa_*`` keys, else these (the config class's)."""


def dots3_layer_types(count: int, use_dsa: Any, use_sliding_window: Any) -> list[str]:
    """The config class's layer types without ``layer_types``: layers 0, 1, 5, 9, ...
    indexed (full when ``use_dsa`` is false), the others sliding (unless
    ``use_sliding_window`` is false)."""
    full = FULL if use_dsa is False else INDEXED
    return [
        full if use_sliding_window is False or i < 2 or i % 4 == 1 else SLIDING
        for i in range(count)
    ]


def _layer_type(read: Settings, index: int) -> str:
    types = read.get("layer_types")
    if not isinstance(types, list):
        count = read.positive("num_hidden_layers")
        types = dots3_layer_types(count, read.get("use_dsa"), read.get("use_sliding_window"))
    if index >= len(types) or types[index] not in (FULL, SLIDING, INDEXED):
        raise read.refuse(f"layer_types={types!r} (layer {index}'s type is not one it has)")
    return str(types[index])


@dataclass(frozen=True)
class Dots3Projections(IndexedLatentProjections):
    """dots3's latent attention: DeepSeek's with the rotary key's norm
    (``k_rope_only_layernorm``), GLM-MoE-DSA's indexer on the ``indexed_attention`` layers
    alone, a sliding window and sizes of their own on the ``sliding_attention`` ones."""

    k_pe_norm: str = "k_rope_only_layernorm"

    def layer(self, read: Settings, index: int) -> Settings:
        """Layer ``index``'s config: ``per_layer_config``'s sizes over the model's (a
        sliding layer's from the ``swa_*`` keys without it), and its layer type's rope."""
        kind = _layer_type(read, index)
        per_layer = read.get("per_layer_config")
        if isinstance(per_layer, dict):
            own = per_layer.get(str(index), per_layer.get(index)) or {}
        elif kind == SLIDING:
            own = {key: read.get(f"swa_{key}", value) for key, value in _SLIDING_SIZES.items()}
            own["qk_rope_head_dim"] = read.get(
                "swa_qk_rope_head_dim", own["head_dim"] - own["qk_nope_head_dim"]
            )
        else:
            own = {}
        layer = copy.copy(read)
        layer.config = {**read.config, **own, "rope_parameters": _layer_rope(read, kind)}
        layer.config.pop("rope_scaling", None)
        return layer

    def settings(self, read: Settings, index: int) -> dict[str, Any]:
        """The norms' epsilon, the rotary key's norm, the softmax scale without yarn's
        correction, a sliding layer's window."""
        nope, rope = read.positive("qk_nope_head_dim"), read.positive("qk_rope_head_dim")
        settings = {
            "norm_eps": float(read.get("rms_norm_eps")),
            "rope_key_norm": True,
            "scale": (nope + rope) ** -0.5,
        }
        if _layer_type(read, index) == SLIDING:
            window = read.get("sliding_window", None)
            settings["window"] = 512 if window is None else read.positive("sliding_window")
        return settings

    def indexer(self, read: Settings, index: int) -> Any:
        return super().indexer(read, index) if _layer_type(read, index) == INDEXED else None

    def tensors(self, settings: Any, biased: Any) -> dict[str, Tensor]:
        """The latent attention's tensors, the rotary key's norm, an indexed layer's
        indexer's."""
        if settings.get("indexer") is None:
            tensors = super(IndexedLatentProjections, self).tensors(settings, biased)
        else:
            tensors = super().tensors(settings, biased)
        rope = settings["qk_rope_head_dim"]
        return tensors | {f"{self.k_pe_norm}.weight": whole("k_pe_norm", rope)}


def _layer_rope(read: Settings, kind: str) -> dict[str, Any]:
    """The rope of a layer of type ``kind``: ``rope_parameters``' entry of its type (as the
    config class nests it), else the config class's default base for that type
    (``swa_rope_theta`` for the sliding layers, ``rope_theta`` for the others); its
    ``partial_rotary_factor`` (``qk_rope_head_dim / head_dim``, as the config class sets it)
    left out: the rotated width is ``qk_rope_head_dim``."""
    given = read.given("rope_parameters") or read.given("rope_scaling")
    if isinstance(given, dict) and isinstance(given.get(kind), dict):
        rope = dict(given[kind])
    elif isinstance(given, dict) and "rope_type" in given:
        rope = dict(given)
    else:
        theta = read.get("swa_rope_theta", 50_000.0) if kind == SLIDING else None
        rope = {"rope_type": "default", "rope_theta": theta or read.get("rope_theta", 8e7)}
    rope.pop("partial_rotary_factor", None)
    return rope


ROWS: tuple[Family, ...] = (
    Family(  # DeepSeek-V3.2's indexer; the query and its gate fused in q_gate_proj
        "axk2",
        AXK2,
        tensors=IndexedLatentProjections(query_gate=True),
        rope=Rope(interleave=True),
    ),
    Family(  # a gate per head; per layer type: GLM-MoE-DSA's indexer, or a window
        "dots3_note_text",
        DOTS3_NOTE_TEXT,
        tensors=Dots3Projections(interleaved=True, lora_scaled=True),
        rope=Rope(theta=80_000_000.0, interleave=True),
        gate=Gate("g_proj", per_head=True),
    ),
)
"""The rows of these families, registered by :mod:`.registry`."""
