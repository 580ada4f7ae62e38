"""Mistral 4 (``mistral4``): DeepSeek-V3's multi-head latent attention (:class:`mha.LatentSpec`)
whose queries are scaled by their position, Llama 4's ``1 + beta * log(1 + floor(p / m))``
(``llama_4_scaling_beta`` and ``original_max_position_embeddings`` in its rope parameters,
as Ministral 3's): its row and its config class's defaults (transformers 5.24). Its rope
parameters carry ``partial_rotary_factor``, the rotated share of a head, which the latent
attention's ``qk_rope_head_dim`` already is.

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> checkpoint = SimpleNamespace(path="ckpt", config={"num_hidden_layers": 4})
>>> mistral4_layer(Settings(checkpoint, "mistral4", MISTRAL4), 0, {})
{'query_temperature': (0.1, 8192.0, 0.0)}
"""

from __future__ import annotations

from typing import Any

from . import defaults
from .config import Settings
from .family import Family
from .layouts import LATENT
from .rope import Rope
from .temperature import scaling_beta

__all__ = ["MISTRAL4", "MISTRAL4_ROPE", "ROWS", "mistral4_layer"]

MISTRAL4_ROPE: dict[str, Any] = {
    "type": "yarn",
    "rope_theta": 10000.0,
    "factor": 128.0,
    "original_max_position_embeddings": 8192,
    "max_position_embeddings": 1048576,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
    "partial_rotary_factor": 0.5,
}
"""Mistral 4's ``rope_parameters`` when the config gives none (``partial_rotary_factor``:
``qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim)``)."""
MISTRAL4: dict[str, Any] = {
    **defaults.MLA,
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 256,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
    "max_position_embeddings": 1048576,
}

_ROPE = Rope(
    parameters=MISTRAL4_ROPE,
    interleave="rope_interleave",
    apart=("llama_4_scaling_beta", "max_position_embeddings"),
)


def mistral4_layer(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Mistral 4's query temperature: Ministral 3's (:func:`.temperature.scaling_beta`)."""
    return scaling_beta(read, _ROPE)


ROWS: tuple[Family, ...] = (
    Family("mistral4", MISTRAL4, tensors=LATENT, rope=_ROPE, by_layer=mistral4_layer),
)
