"""The families whose queries are scaled by their position (``query_temperature=``): Llama 4
(``llama4_text``: chunked layers with an L2 QK-norm after the rotation, and layers without
rope whose queries take ``attn_temperature_tuning``'s temperature), Ministral 3
(``llama_4_scaling_beta`` in its rope parameters) and Beam (its layers without rope take a
query scale ``(1 + (position + 1) / 2048) ** 0.1``): their rows, their config classes'
defaults (transformers 5.24), and each layer's temperature as the row's
:attr:`~.family.Family.by_layer` reads it.

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> checkpoint = SimpleNamespace(path="ckpt", config={"num_hidden_layers": 4, "floor_scale": 4})
>>> read = Settings(checkpoint, "llama4_text", LLAMA4_TEXT)
>>> [llama4_layer(read, i, {})["query_temperature"] for i in (2, 3)]
[None, (0.1, 4.0, 1.0)]
"""

from __future__ import annotations

from typing import Any

from . import defaults
from .config import FULL, SLIDING, Settings
from .family import PER_HEAD, Family, Gate, QkNorm
from .layouts import NO_BIASES
from .rope import Rope, by_layer_type_entries, by_no_rope_layers, rope_parameters
from .windows import EVERY_LAYER, ByLayerTypes

__all__ = [
    "BEAM",
    "LLAMA4_TEXT",
    "ROWS",
    "beam_layer",
    "beam_layer_types",
    "llama4_layer",
    "ministral3_layer",
    "scaling_beta",
]

LLAMA4_TEXT: dict[str, Any] = {
    "hidden_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "use_qk_norm": True,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "layer_types": None,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "max_position_embeddings": 131072,
}
BEAM: dict[str, Any] = {
    "hidden_size": 5120,
    "num_hidden_layers": 52,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "layer_types": None,
    "max_position_embeddings": 8192,
}
BEAM_ROPE: dict[str, Any] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: None,
}
"""Beam's ``rope_parameters`` when the config gives none: its sliding layers rotate, its full
ones have no positions."""

_CHUNKED = "chunked_attention"
_LLAMA4_NORM = QkNorm("head", when="use_qk_norm", weighted=False, after_rope=True)
_NO_NORM = {
    "qk_norm": None,
    "qk_norm_eps": None,
    "qk_norm_offset": None,
    "qk_norm_after_rope": False,
}
_MINISTRAL3_ROPE = Rope(parameters=defaults.MINISTRAL3_ROPE, apart=("llama_4_scaling_beta",))


def llama4_layer(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's layer ``index``: a layer that rotates (``no_rope_layers``) is chunked by
    ``attention_chunk_size`` where its type (``layer_types``, by default every rope layer
    when there is a chunk size) is ``chunked_attention``, and keeps the QK-norm; a layer
    without rope has no QK-norm and, with ``attn_temperature_tuning``, the temperature
    ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``."""
    rotates = by_no_rope_layers(read, index, FULL)
    count = read.positive("num_hidden_layers")
    size = read.get("attention_chunk_size")
    types = read.get("layer_types")
    if types is None:
        flags = [by_no_rope_layers(read, i, FULL) for i in range(count)]
        types = [_CHUNKED if flag and size is not None else FULL for flag in flags]
    kinds = types if isinstance(types, list) else [None]
    if len(kinds) != count or any(kind not in (_CHUNKED, FULL) for kind in kinds):
        raise read.refuse(
            f"layer_types={types!r} (transformers' Llama 4 masks one {FULL} or {_CHUNKED} "
            "layer type for each layer)"
        )
    chunk = read.positive("attention_chunk_size") if types[index] == _CHUNKED else None
    if rotates:
        return {"chunk": chunk, "query_temperature": None}
    temperature = None
    if read.get("attn_temperature_tuning"):
        scale, floor = read.get("attn_scale"), read.positive("floor_scale")
        temperature = (_number(read, "attn_scale", scale), float(floor), 1.0)
    return {"chunk": chunk, "query_temperature": temperature, **_NO_NORM}


def ministral3_layer(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Ministral 3's query temperature (:func:`scaling_beta`)."""
    return scaling_beta(read, _MINISTRAL3_ROPE)


def scaling_beta(read: Settings, rope_row: Rope) -> dict[str, Any]:
    """The query temperature ``1 + beta * log(1 + floor(p / m))`` at position ``p`` of
    Ministral 3 and Mistral 4: ``beta`` the rope parameters' ``llama_4_scaling_beta`` (0:
    none), ``m`` their ``original_max_position_embeddings``, which transformers' attention
    needs."""
    rope = rope_parameters(read, rope_row, None)
    beta = rope.get("llama_4_scaling_beta")
    if beta is None:
        raise read.refuse(
            f"rope_parameters without llama_4_scaling_beta (transformers' {read.family} "
            "attention scales its queries by it: it needs one, 0 for none)"
        )
    beta = _number(read, "rope_parameters['llama_4_scaling_beta']", beta)
    if beta == 0:
        return {"query_temperature": None}
    length = rope.get("original_max_position_embeddings")
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not length > 0:
        raise read.refuse(
            f"rope_parameters['llama_4_scaling_beta']={beta!r} and original_max_position_"
            f"embeddings={length!r} (Llama 4's query scale growing with the position needs a "
            "positive length to divide the positions by)"
        )
    return {"query_temperature": (beta, float(length), 0.0)}


def beam_layer_types(read: Settings, count: int) -> list[str]:
    """Beam's default ``layer_types``: every sixth layer full, and the last, the others
    sliding."""
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(count)]
    return [*types[:-1], FULL]


BEAM_TEMPERATURE = (0.1, 2048.0, 1.0, "power")
"""Beam's scalable softmax: ``(1 + (p + 1) / 2048) ** 0.1`` (``compute_attention_scaling``)."""


def beam_layer(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Beam's layer ``index``: a layer without rope takes its query scale."""
    return {"query_temperature": None if settings["rope_theta"] else BEAM_TEMPERATURE}


def _number(read: Settings, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise read.refuse(f"{key}={value!r} (a query temperature that is not a number)")
    return float(value)


ROWS: tuple[Family, ...] = (
    Family(
        "llama4_text",
        LLAMA4_TEXT,
        rope=Rope(theta=500_000.0, interleave=True, rotates=by_no_rope_layers),
        qk_norm=_LLAMA4_NORM,
        by_layer=llama4_layer,
        own=("attention_chunk_size", "use_qk_norm"),
    ),
    Family(
        "ministral3",
        defaults.MINISTRAL3,
        biases=NO_BIASES,
        windows=EVERY_LAYER,
        rope=_MINISTRAL3_ROPE,
        by_layer=ministral3_layer,
    ),
    Family(
        "beam",
        BEAM,
        windows=ByLayerTypes(beam_layer_types),
        rope=Rope(parameters=BEAM_ROPE, rotates=by_layer_type_entries),
        qk_norm=PER_HEAD,
        gate=Gate(head_bias="gate_bias"),
        by_layer=beam_layer,
    ),
)
