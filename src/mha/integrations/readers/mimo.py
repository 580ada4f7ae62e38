"""The rows of issue 33's families whose attention differs from Llama's in its values or
its scores (transformers 5.24), with their config classes' defaults: MiMo-V2-Flash's values
narrower than its keys and scaled, twice the key/value heads and sinks in its sliding
layers, and a partial rope of its own base per layer type; DiffLlama's differential
attention (:class:`mha.DifferentialAttention`).

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> read = Settings(SimpleNamespace(path="ckpt", config={"num_hidden_layers": 7}),
...                 "mimo_v2_flash", MIMO_V2_FLASH)
>>> [MIMO_V2_FLASH_WINDOWS.layer_type(read, i)[:4] for i in range(7)]
['full', 'slid', 'slid', 'slid', 'slid', 'full', 'slid']
>>> MIMO_V2_FLASH_WINDOWS.size(read)
129
"""

from __future__ import annotations

from typing import Any

from .config import FULL, SLIDING, Settings
from .family import Differential, Family, SlidingLayers, ValueWidth
from .layouts import QKV_ATTENTION_BIAS, Projections
from .rope import Rope
from .windows import ByLayerTypes

__all__ = ["DIFFLLAMA", "MIMO_V2_FLASH", "MIMO_V2_FLASH_WINDOWS", "ROWS"]

MIMO_V2_FLASH: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 48,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 192,
    "v_head_dim": 128,
    "attention_bias": False,
    "sliding_window": 129,
    "layer_types": None,
    "attention_value_scale": 0.707,
    "max_position_embeddings": 131072,
}


DIFFLLAMA: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
}


def mimo_layer_types(read: Settings, count: int) -> list[str]:
    """MiMo-V2-Flash's default: the first layer and every sixth full, the others sliding."""
    return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(count)]


def mimo_window(read: Settings) -> Any:
    """MiMo-V2-Flash's window: ``sliding_window_size`` previous positions and the query's
    own when the config gives that key (its config class's), else ``sliding_window``."""
    size = read.given("sliding_window_size")
    if size is None:
        return read.get("sliding_window")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise read.refuse(f"sliding_window_size={size!r} (a window of no whole positions)")
    return size + 1


MIMO_V2_FLASH_WINDOWS = ByLayerTypes(mimo_layer_types, size=mimo_window)

ROWS: tuple[Family, ...] = (
    Family(  # values 128 wide beside keys of 192, scaled; sinks in the sliding layers
        "mimo_v2_flash",
        MIMO_V2_FLASH,
        tensors=Projections(sinks="attention_sink_bias"),  # as saved; transformers: "sinks"
        biases=QKV_ATTENTION_BIAS,
        windows=MIMO_V2_FLASH_WINDOWS,
        rope=Rope(
            per_layer_type={FULL: (None, 5_000_000.0), SLIDING: (None, 10_000.0)},
            partial=True,
            fraction=0.334,
        ),
        value_width=ValueWidth(scale="attention_value_scale"),
        sliding=SlidingLayers(kv_heads=2, sinks=True),
    ),
    # two softmaxes (heads i and i + H/2) weighted by lambda, a group norm: DiffLlama's
    Family("diffllama", DIFFLLAMA, differential=Differential()),
)
"""The rows :mod:`.registry` registers."""
