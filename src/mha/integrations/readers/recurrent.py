"""Two families of issue 33 with attention of their own: HRM's recurrent stacks and Doge's
dynamic mask attention.

* HRM (``hrm_text``): two stacks of ``num_layers_per_stack`` layers, L and H; each of
  ``H_cycles`` cycles runs the L stack ``L_cycles`` times, then the H stack once, and each run
  of each layer has a cache slot of its own. ``num_hidden_layers`` counts those slots
  (``num_layers_per_stack * H_cycles * (L_cycles + 1)``), and ``layer=i`` is slot ``i``: the
  attention of the stack's layer that runs in it (:func:`~.layouts.stack_slot`), with its
  cache. Its attention: as many key/value heads as heads (whatever the config says), a
  sigmoid gate of every feature before ``o_proj``, the default rope, no biases (a config
  with ``attention_bias`` is refused). Its checkpoints keep the gate, the queries, the keys
  and the values in one ``attn.gqkv_proj`` (:class:`FusedGate`), which transformers splits
  into ``self_attn``'s ``gate_proj``, ``q_proj``, ``k_proj`` and ``v_proj`` on loading. The
  prefix-LM mask (``prefix_lm``, instruction tokens attending bidirectionally) applies only
  where ``token_type_ids`` are given; without them the attention is causal, as mha's.
* Doge (``doge``): dynamic mask attention (:class:`mha.DynamicMaskAttention`): a bias of each
  key/value head and key, ``exp(A * softplus(dt_proj(v)))``, added to the scores, each
  query's ``keep_window_size`` keys of the largest bias kept; QK-norm per head, grouped
  key/value heads, biases by ``attention_bias`` (``dt_proj``'s too). Its ``sliding_window``
  is refused (the top-k is computed over the causal keys alone).

>>> [row.name for row in ROWS]
['hrm_text', 'doge']
>>> ROWS[0].tensors.path
'model.{stack}_module.layers.{i}.attn'
>>> from mha.integrations.readers.layouts import lay_out
>>> import numpy as np
>>> fused = FusedGate().tensors(None, 1, 1, 2)["gqkv_proj.weight"]  # g q k v, 2 rows each
>>> {name: W.ravel().tolist() for name, W in lay_out(np.arange(8.0)[:, None], fused).items()}
{'W_g': [0.0, 1.0], 'W_q': [2.0, 3.0], 'W_k': [4.0, 5.0], 'W_v': [6.0, 7.0]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import FULL, Settings, Unsupported
from .family import PER_HEAD, DynamicMask, Family, Gate
from .layouts import Projections, Tensor

__all__ = [
    "DOGE",
    "HRM_LAYOUT",
    "HRM_TEXT",
    "ROWS",
    "FusedGate",
    "NoDynamicWindow",
    "hrm_heads",
    "hrm_slots",
]

HRM_TEXT: dict[str, Any] = {
    "hidden_size": 1536,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "H_cycles": 2,
    "L_cycles": 3,
    "num_layers_per_stack": None,
}
"""HrmTextConfig's defaults (its ``num_hidden_layers``: the slots, once the class has set
``num_layers_per_stack``)."""

DOGE: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 32,
    "num_attention_heads": 8,
    "num_key_value_heads": None,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "sliding_window": None,
    "keep_window_size": 2048,
}
"""DogeConfig's defaults."""

HRM_LAYOUT = Projections(qkv="gqkv_proj", path="model.{stack}_module.layers.{i}.attn")
"""HRM's saved names in its two stacks: slot ``i``'s attention is in the L or the H stack
(:func:`~.layouts.module_path`), its projections fused (:class:`FusedGate`)."""


@dataclass(frozen=True)
class FusedGate(Gate):
    """A gate of every feature fused with the projections: ``gqkv_proj`` holds the gate's,
    the queries', the keys' and the values' rows one after the other, ``H * d`` each (a key
    and value per head)."""

    tensor: str = "gqkv_proj"

    def tensors(self, read: Settings, E: int, H: int, d: int) -> dict[str, Tensor]:
        parts = tuple((f"W_{p}", H * d) for p in "gqkv")
        return {f"{self.tensor}.weight": Tensor((4 * H * d, E), parts)}


@dataclass(frozen=True)
class NoDynamicWindow:
    """Doge's layers: full; a ``sliding_window`` (transformers' sliding mask under the dynamic
    mask) is refused."""

    def layer_type(self, read: Settings, index: int) -> str:
        window = read.get("sliding_window")
        if window is not None:
            raise read.refuse(
                f"sliding_window={window} (a window under Doge's dynamic mask, whose top-k "
                "mha computes over every causal key)"
            )
        return FULL

    def size(self, read: Settings) -> Any:
        return None


def hrm_heads(read: Settings) -> tuple[int, int, int]:
    """HRM's heads: a key and value per head (``num_key_value_heads`` is not read), each
    ``head_dim`` wide."""
    H = read.positive("num_attention_heads")
    return H, H, read.positive("head_dim")


def hrm_slots(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Checks that ``num_hidden_layers`` counts the slots of the stacks the config gives (an
    older config without ``num_layers_per_stack`` counts a stack's layers in it, which
    transformers multiplies on loading); changes no setting."""
    per_stack = read.get("num_layers_per_stack")
    if per_stack is None:
        raise read.refuse(
            "no num_layers_per_stack (an older config whose num_hidden_layers counts a stack's "
            "layers, not the cache slots of its recurrent stacks, which layer= numbers)"
        )
    keys = ("num_layers_per_stack", "H_cycles", "L_cycles")
    per_stack, high, low = (read.positive(key) for key in keys)
    slots = per_stack * high * (low + 1)
    if read.positive("num_hidden_layers") != slots:
        raise read.refuse(
            f"num_hidden_layers={read.get('num_hidden_layers')} for {slots} cache slots "
            f"(num_layers_per_stack={per_stack} * H_cycles={high} * (L_cycles={low} + 1))"
        )
    return {}


ROWS: tuple[Family, ...] = (
    Family(  # recurrent stacks, a cache slot a run; a sigmoid gate of every feature
        "hrm_text",
        HRM_TEXT,
        tensors=HRM_LAYOUT,
        heads=hrm_heads,
        gate=FusedGate(),
        by_layer=hrm_slots,
        unsupported=(Unsupported("attention_bias", "biases beside HRM's fused gqkv_proj"),),
    ),
    Family(  # a bias of each key from the values, the top keep_window_size keys kept
        "doge",
        DOGE,
        qk_norm=PER_HEAD,
        windows=NoDynamicWindow(),
        dynamic_mask=DynamicMask(),
    ),
)
"""The rows of these families, registered by :mod:`.registry`."""
