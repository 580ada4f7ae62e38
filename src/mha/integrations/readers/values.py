"""What Gemma 3n's and Gemma 4's attention does with its keys and values beyond Llama's
(:class:`Values`, a row's ``values``): an RMSNorm without weights of each value head
(``v_norm=``), values that are the keys' projection (Gemma 4's ``attention_k_eq_v``: its full
layers have no ``v_proj``, read as ``W_v = W_k``, normalised as values, not as keys), heads of
another width and count in some layers (Gemma 4's ``per_layer_config``), and layers that
compute no keys and values and attend with an earlier layer's (``num_kv_shared_layers``:
``shares_kv_with=``, that layer's ``k_proj``, ``v_proj`` and ``k_norm`` read beside the
layer's own).

>>> Values(norm="rms_norm_eps").borrowed
('k_proj.', 'v_proj.', 'k_norm.')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import AttentionValueError
from .config import FULL, Settings

__all__ = ["Values", "gemma4_heads"]

LayerHeads = Callable[[Settings, int, str, tuple[int, int, int]], tuple[int, int, int]]
"""Layer ``i``'s heads (of its type), from the config and the family's heads."""


@dataclass(frozen=True)
class Values:
    """The values' norm (its epsilon's config key), the config key that makes the full
    layers' values their keys' projection, the config key of the number of last layers that
    share an earlier layer's keys and values, and each layer's heads (:data:`LayerHeads`)."""

    norm: str | None = None
    keys: str | None = None
    shared: str | None = None
    heads: LayerHeads | None = None
    borrowed: tuple[str, ...] = ("k_proj.", "v_proj.", "k_norm.")
    """The tensors a sharing layer reads from the layer it shares with (its own has none)."""

    def layer_heads(
        self, read: Settings, index: int, layer_type: str, heads: tuple[int, int, int]
    ) -> tuple[int, int, int]:
        return heads if self.heads is None else self.heads(read, index, layer_type, heads)

    def keys_are_values(self, read: Settings, layer_type: str) -> bool:
        """Whether this layer's values are its keys' projection (Gemma 4's full layers)."""
        return self.keys is not None and bool(read.get(self.keys)) and layer_type == FULL

    def source(self, read: Settings, index: int, types: list[str]) -> int | None:
        """The layer whose keys and values layer ``index`` attends with (of ``types``, each
        layer's type), as transformers' ``kv_sharing_modes``: the last layer of its type
        before the shared ones; ``None`` for a layer with its own."""
        count = 0 if self.shared is None else read.get(self.shared) or 0
        layers = len(types)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= layers:
            raise AttentionValueError(
                f"{read.path}: config.json has {read.name(str(self.shared))}={count!r}; a "
                f"number of its {layers} layers is needed"
            )
        first = layers - count
        if index < first:
            return None
        earlier = [j for j in range(first) if types[j] == types[index]]
        if not earlier:
            raise AttentionValueError(
                f"{read.path}: layer {index} attends with an earlier {types[index]} layer's "
                f"keys and values ({read.name(str(self.shared))}={count}), but no layer "
                f"before layer {first} is a {types[index]} layer"
            )
        return earlier[-1]

    def settings(self, read: Settings, source: int | None) -> dict[str, Any]:
        """The layer's ``v_norm`` and ``shares_kv_with``."""
        eps = float(read.get(self.norm)) if self.norm else None
        return {"v_norm": eps, "shares_kv_with": source}


_ATTENTION_KEYS = ("num_attention_heads", "sliding_window", "rope_parameters", "attention_bias",
                   "rms_norm_eps", "attention_k_eq_v", "layer_types")  # fmt: skip
"""Keys of Gemma 4's ``per_layer_config`` that would change a layer's attention beyond its
heads: refused by name."""


def gemma4_heads(
    read: Settings, index: int, layer_type: str, heads: tuple[int, int, int]
) -> tuple[int, int, int]:
    """Gemma 4's heads of layer ``index``: its ``per_layer_config`` entry's ``head_dim`` and
    ``num_key_value_heads``; without one (an older config), as its config class fills it
    in: the full layers' ``global_head_dim`` (512 by default) and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    H, H_kv, d = heads
    overrides = read.get("per_layer_config")
    if overrides is None:
        if layer_type != FULL:
            return heads
        wide = {"head_dim": read.given("global_head_dim", 512)}
        shared = read.given("num_global_key_value_heads") if read.get("attention_k_eq_v") else None
        overrides = {str(index): wide | ({} if shared is None else {"num_key_value_heads": shared})}
    entry: Any = None
    if isinstance(overrides, dict):
        entry = overrides.get(str(index), overrides.get(index))
        if entry is None:
            return heads
    sizes = [entry.get(key, 1) for key in ("head_dim", "num_key_value_heads")] if isinstance(
        entry, dict) else [None]  # fmt: skip
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise AttentionValueError(
            f"{read.path}: config.json's heads of layer {index} ({overrides!r}) must be "
            "positive numbers: per_layer_config's (or global_head_dim and "
            "num_global_key_value_heads) head_dim and num_key_value_heads"
        )
    refused = sorted(set(entry) & set(_ATTENTION_KEYS))
    if refused:
        raise read.refuse(f"per_layer_config[{index}] overriding {', '.join(refused)}")
    return H, entry.get("num_key_value_heads", H_kv), entry.get("head_dim", d)
