"""The families whose attention normalises its joined heads before ``o_proj`` (issue 33):
BitNet's RMSNorm of a weight (``attn_sub_norm``), read as the output norm ``"rms"``
(:class:`mha.api.output_norm.OutputNorm`). transformers' ``BitNetAttention`` is Llama's
with that norm; its ``q_proj``, ..., ``o_proj`` are plain ``nn.Linear`` layers of float
weights. A checkpoint of packed ternary weights (BitNet's own ``quantization_config``, with
a ``weight_scale`` per projection) is refused by that key.

>>> [row.name for row in ROWS]
['bitnet']
>>> ROWS[0].output_norm
OutputNorm(kind='rms', tensor='attn_sub_norm.weight', eps='rms_norm_eps')
"""

from __future__ import annotations

from typing import Any

from .config import Unsupported, is_given
from .family import Family, OutputNorm
from .rope import Rope

__all__ = ["BITNET", "ROWS"]

BITNET: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 30,
    "num_attention_heads": 20,
    "num_key_value_heads": 5,
    "head_dim": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "quantization_config": None,
}

PACKED = Unsupported(
    "quantization_config", "BitNet's packed ternary weights with their weight_scale", is_given
)
"""A BitNet checkpoint whose projections are stored quantized."""

ROWS: tuple[Family, ...] = (
    Family(
        "bitnet",
        BITNET,
        rope=Rope(theta=500000.0),
        output_norm=OutputNorm(),
        unsupported=(PACKED,),
    ),
)
