"""The rows of issue 33's hybrid families whose attention is read without rope or from
blocks shared across layers (transformers 5.24), with their config classes' defaults:
Kimi-Linear's DeepSeek latent attention without positions (its ``qk_rope_head_dim``
features unrotated: :class:`mha.LatentAttention`'s ``rotate=False``) between its Kimi Delta
Attention layers; Zamba's attention block shared by its attention layers and Zamba2's blocks
taken in turn, with per-layer adapters and an optional rope (:mod:`.shared_blocks`), each
reading the hidden states joined to the embeddings, between their Mamba layers. The layers
that are not attention are refused by their index (:mod:`.hybrid`).

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> read = Settings(SimpleNamespace(path="ckpt", config={"num_hidden_layers": 9}),
...                 "kimi_linear", KIMI_LINEAR)
>>> kimi_layer_types(read, 9).count("full_attention"), kimi_layer_types(read, 9)[4]
(2, 'full_attention')
>>> read = Settings(SimpleNamespace(path="ckpt", config={"num_hidden_layers": 12}),
...                 "zamba", ZAMBA)
>>> [i for i, kind in enumerate(zamba_layer_types(read, 12)) if kind == "hybrid"]
[2, 7]
"""

from __future__ import annotations

from typing import Any

from .config import FULL, Settings
from .family import Family
from .hybrid import LINEAR, Hybrid, from_layer_types
from .layouts import LATENT, NO_BIASES, Projections
from .rope import Rope
from .shared_blocks import SharedBlocks

__all__ = [
    "KIMI_LINEAR",
    "ROWS",
    "ZAMBA",
    "ZAMBA2",
    "kimi_layer_types",
    "zamba2_layer_types",
    "zamba_layer_types",
]

KIMI_LINEAR: dict[str, Any] = {
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "attention_bias": False,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "layer_types": None,
    "linear_attn_config": None,
}
ZAMBA: dict[str, Any] = {
    "hidden_size": 3712,
    "num_hidden_layers": 76,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "attention_head_dim": None,
    "attn_layer_period": 6,
    "attn_layer_offset": 4,
    "layers_block_type": None,
}
ZAMBA2: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 54,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "num_mem_blocks": 1,
    "use_shared_attention_adapter": False,
    "adapter_rank": 128,
    "use_mem_rope": False,
    "layers_block_type": None,
}

HYBRID = "hybrid"
"""Zamba's name of a layer that runs the shared attention block (before its Mamba layer)."""
KDA = "a Kimi Delta Attention (linear attention) layer"
MAMBA = "a Mamba layer"


def kimi_layer_types(read: Settings, count: int) -> list[str]:
    """Kimi-Linear's layer types where ``config.json`` gives no ``layer_types``: its
    ``linear_attn_config``'s ``full_attn_layers`` (numbered from 1, every other layer linear
    attention), else full attention at every fourth layer from layer 4."""
    given = read.get("linear_attn_config") or {}
    full = given.get("full_attn_layers") if isinstance(given, dict) else None
    if isinstance(full, list) and "kda_layers" in given:
        if not all(isinstance(i, int) and 0 < i <= count for i in full):
            raise read.refuse(
                f"linear_attn_config.full_attn_layers={full!r} (not layers 1 to {count})"
            )
        return [FULL if i + 1 in full else LINEAR for i in range(count)]
    return [FULL if i and i % 4 == 0 else LINEAR for i in range(count)]


def zamba_layer_types(read: Settings, count: int) -> list[str]:
    """Zamba's default: layer 2 runs the shared block, then every ``attn_layer_period``-th
    layer from ``attn_layer_offset`` among the rest (counted from layer 3)."""
    period, offset = read.positive("attn_layer_period"), read.get("attn_layer_offset")
    rest = [HYBRID if i % period == offset else LINEAR for i in range(count - 3)]
    return [LINEAR, LINEAR, HYBRID, *rest]


def zamba2_layer_types(read: Settings, count: int) -> list[str]:
    """Zamba2's default: its 54 layers, the shared blocks at every sixth from layer 6, then
    at layers 47 and 51."""
    return (
        [LINEAR] + ([LINEAR] * 5 + [HYBRID]) * 7 + [LINEAR] * 4 + [HYBRID] + [LINEAR] * 3
        + [HYBRID] + [LINEAR] * 2
    )  # fmt: skip


def zamba_heads(read: Settings) -> tuple[int, int, int]:
    """Zamba's: ``num_key_value_heads`` key/value heads, each ``attention_head_dim`` wide
    (null: twice the hidden size's share of a head)."""
    E, H = read.positive("hidden_size"), read.positive("num_attention_heads")
    d = read.positive("attention_head_dim", optional=True) or 2 * E // H
    return H, read.positive("num_key_value_heads"), d


def zamba2_heads(read: Settings) -> tuple[int, int, int]:
    """Zamba2's: ``num_key_value_heads`` key/value heads (null: one per head), each
    ``attention_head_dim`` wide (which its config class sets to twice the hidden size's
    share of a head, unless given)."""
    E, H = read.positive("hidden_size"), read.positive("num_attention_heads")
    d = read.positive("attention_head_dim", optional=True) or 2 * E // H
    return H, read.positive("num_key_value_heads", optional=True) or H, d


def half_head_scale(read: Settings) -> float:
    """Zamba's softmax scale: ``(head_dim / 2) ** -0.5``, for heads of the joined input."""
    heads = zamba2_heads if read.family == "zamba2" else zamba_heads
    scale: float = (heads(read)[2] / 2) ** -0.5
    return scale


def mem_rope(read: Settings, index: int, layer_type: str) -> bool:
    """Zamba2's rope, on every shared block when ``use_mem_rope``."""
    return bool(read.get("use_mem_rope"))


ROWS: tuple[Family, ...] = (
    Family(
        "kimi_linear",
        KIMI_LINEAR,
        tensors=LATENT,
        rope=Rope(applied=False),
        hybrid=Hybrid("Kimi-Linear", from_layer_types(kimi_layer_types), {LINEAR: KDA}),
    ),
    Family(
        "zamba",
        ZAMBA,
        keys={"layer_types": "layers_block_type"},
        tensors=Projections(path="model.layers.{i}.shared_transf.self_attn"),
        heads=zamba_heads,
        biases=NO_BIASES,
        rope=Rope(applied=False),
        scale=half_head_scale,
        hybrid=Hybrid(
            "Zamba", from_layer_types(zamba_layer_types), {LINEAR: MAMBA}, attention=(HYBRID,)
        ),
        shared=SharedBlocks(),
    ),
    Family(
        "zamba2",
        ZAMBA2,
        keys={"layer_types": "layers_block_type"},
        tensors=Projections(path="model.layers.{i}.shared_transformer.self_attn"),
        heads=zamba2_heads,
        biases=NO_BIASES,
        rope=Rope(rotates=mem_rope),
        scale=half_head_scale,
        hybrid=Hybrid(
            "Zamba2",
            from_layer_types(zamba2_layer_types),
            {LINEAR: "a Mamba-2 layer"},
            attention=(HYBRID,),
        ),
        shared=SharedBlocks("num_mem_blocks", "use_shared_attention_adapter"),
    ),
)
