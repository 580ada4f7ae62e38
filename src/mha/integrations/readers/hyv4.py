"""The row of HY-V4: DeepSeek's multi-head latent attention whose keys a lightning indexer
picks (DSA, :mod:`mha.api.sparse`), with a sigmoid output gate per feature (``W_g (E,
H*v_head_dim)``) and a learned sink a head (``sinks``), saved as ``linear_gate`` and
``learnable_sink_param`` (transformers renames them ``gate_proj`` and ``sinks`` on loading).

Its rope pairs ``(i, i + p/2)``, in the latent attention and in the indexer, whose rotated
features are its last ``qk_rope_head_dim`` (``rotate_last``); the indexer's key LayerNorm
takes ``rms_norm_eps``. ``indexer_types`` lists each layer's indexer as ``"full"`` (its
own) or ``"shared"``: such a layer reuses the keys the previous layer attended to, chosen by
the last ``"full"`` layer before it from that layer's input, which one layer read alone
does not have: it is refused by its index.

>>> [row.name for row in ROWS]
['hy_v4']
>>> default_indexer_types(5)
['full', 'full', 'shared', 'shared', 'shared']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...api.sparse import IndexerSpec
from .config import Settings
from .defaults import MLA
from .family import Family, Gate
from .layouts import Tensor, whole
from .sparse import IndexedLatentProjections

__all__ = ["HY_V4", "ROWS", "HyV4Projections", "default_indexer_types"]

HY_V4: dict[str, Any] = {
    "hidden_size": 2816,
    "num_hidden_layers": 34,
    "num_attention_heads": 32,
    **MLA,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 16,
    "indexer_types": None,
}
"""HYV4Config's defaults (its rope: the default, of base 10000)."""


def default_indexer_types(layers: int) -> list[str]:
    """HYV4Config's ``indexer_types`` when null: layer 0 and every fourth from layer 1
    ``"full"``, the others ``"shared"``."""
    return ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)]


@dataclass(frozen=True)
class HyV4Projections(IndexedLatentProjections):
    """HY-V4's latent attention modules: DeepSeek-V3.2's with its indexer's last features
    rotated, the indexer's LayerNorm of ``rms_norm_eps``, the sinks, and ``"shared"``
    layers refused."""

    sinks: str = "learnable_sink_param"

    def indexer(self, read: Settings, index: int) -> IndexerSpec:
        """Layer ``index``'s indexer; a layer that reuses another's choice is refused."""
        kinds = read.get("indexer_types")
        if not isinstance(kinds, list):
            kinds = default_indexer_types(read.positive("num_hidden_layers"))
        if index < len(kinds) and kinds[index] != "full":
            raise read.refuse(
                f"{read.name('indexer_types')}[{index}]={kinds[index]!r}: layer {index} "
                "reuses the top-k keys an earlier layer's indexer chose from that layer's "
                "input (cross-layer top-k sharing), which one layer read alone does not have"
            )
        spec = super().indexer(read, index)
        return IndexerSpec(
            spec.topk,
            spec.num_heads,
            spec.head_dim,
            norm_eps=float(read.get("rms_norm_eps")),
            rotate_last=True,
        )

    def tensors(self, settings: Mapping[str, Any], biased: Any) -> dict[str, Tensor]:
        """The latent attention's tensors, its indexer's and its sinks."""
        sinks = whole("sinks", settings["num_heads"])
        return super().tensors(settings, biased) | {self.sinks: sinks}


ROWS: tuple[Family, ...] = (
    Family(
        "hy_v4",
        HY_V4,
        tensors=HyV4Projections(),
        gate=Gate("linear_gate"),
    ),
)
"""The row of this family, registered by :mod:`.registry`."""
