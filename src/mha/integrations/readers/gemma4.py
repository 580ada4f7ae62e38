"""The rows of Gemma 3n (``gemma3n_text``) and Gemma 4 (``gemma4_text``,
``gemma4_unified_text``), and their config classes' defaults (transformers 5.24).

Their attention is Gemma 3's with a softmax scale of 1, QK-norm weights applied as they are
(not ``1 + w``), and what :mod:`.values` reads: the values' RMSNorm without weights, and the
last ``num_kv_shared_layers`` layers attending with the keys and values of the last earlier
layer of their type (``shares_kv_with``). Gemma 4's full layers have heads of their own
width and count (``per_layer_config``, older configs' ``global_head_dim`` and
``num_global_key_value_heads``), a proportional rope over a quarter of their pairs, and with
``attention_k_eq_v`` no ``v_proj``: their values are their keys' projection. Its last layer
is full whatever ``layer_types`` says, as its config class makes it; its option of attention
without the causal mask (``use_bidirectional_attention="all"``) is refused, ``"vision"``
(bidirectional among image tokens only) is causal for text.

>>> [row.name for row in ROWS]
['gemma3n_text', 'gemma4_text', 'gemma4_unified_text']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import FULL, SLIDING, Settings, Unsupported
from .family import Family, QkNorm, unscaled
from .rope import Rope
from .values import Values, gemma4_heads
from .windows import ByLayerTypes, every_nth_full

__all__ = ["GEMMA3N_TEXT", "GEMMA4_TEXT", "GEMMA4_UNIFIED_TEXT", "ROWS"]

_GEMMA4 = {
    "hidden_size": 2304,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
}

GEMMA3N_TEXT: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "sliding_window": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "num_kv_shared_layers": 15,
}
GEMMA4_TEXT: dict[str, Any] = {
    **_GEMMA4,
    "sliding_window": 512,
    "max_position_embeddings": 131072,
    "use_bidirectional_attention": None,
}
GEMMA4_UNIFIED_TEXT: dict[str, Any] = {
    **_GEMMA4,
    "sliding_window": 1024,
    "max_position_embeddings": 262144,
    "use_bidirectional_attention": "vision",
}

_GEMMA4_ROPE = Rope(
    parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
)
"""Gemma 4's rope of each layer type where the config gives none: its full layers turn a
quarter of their pairs (``proportional``: the others by a frequency of 0)."""


@dataclass(frozen=True)
class LastLayerFull(ByLayerTypes):
    """Gemma 4's layer types: the config's ``layer_types`` (else five sliding layers to a
    full one), the last layer full whatever they say."""

    def layer_type(self, read: Settings, index: int) -> str:
        kind = super().layer_type(read, index)
        return FULL if index == read.positive("num_hidden_layers") - 1 else kind


_BIDIRECTIONAL_TEXT = Unsupported(
    "use_bidirectional_attention", "attention that is not causal", lambda value: value == "all"
)
"""Gemma 4's ``"all"``: every token attends both ways (``"vision"``: image tokens only)."""

_GEMMA4_VALUES = Values(
    norm="rms_norm_eps", keys="attention_k_eq_v", shared="num_kv_shared_layers", heads=gemma4_heads
)


def _gemma4(name: str, defaults: dict[str, Any]) -> Family:
    return Family(
        name,
        defaults,
        windows=LastLayerFull(every_nth_full(6, None)),
        rope=_GEMMA4_ROPE,
        scale=unscaled,
        qk_norm=QkNorm("head"),
        values=_GEMMA4_VALUES,
        unsupported=(_BIDIRECTIONAL_TEXT,),
    )


ROWS: tuple[Family, ...] = (
    Family(
        "gemma3n_text",
        GEMMA3N_TEXT,
        windows=ByLayerTypes(every_nth_full(5, None)),
        rope=Rope(
            per_layer_type={FULL: ("rope_theta", 1e6), SLIDING: ("rope_local_base_freq", 1e4)}
        ),
        scale=unscaled,
        qk_norm=QkNorm("head"),
        values=Values(norm="rms_norm_eps", shared="num_kv_shared_layers"),
    ),
    _gemma4("gemma4_text", GEMMA4_TEXT),
    _gemma4("gemma4_unified_text", GEMMA4_UNIFIED_TEXT),
)
"""Gemma 3n's and Gemma 4's rows of the table (:func:`~.registry.register`)."""
