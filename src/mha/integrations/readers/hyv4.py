"""The row of HY-V4: DeepSeek's multi-head latent attention whose keys a lightning indexer
picks (DSA, :mod:`mha.api.sparse`), with a sigmoid output gate per feature (``W_g (E,
H*v_head_dim)``) and a learned sink a head (``sinks``), saved as ``linear_gate`` and
``learnable_sink_param`` (transformers renames them ``gate_proj`` and ``sinks`` on loading).

Its rope pairs ``(i, i + p/2)``, in the latent attention and in the indexer, whose rotated
features are its last ``qk_rope_head_dim`` (``rotate_last``); the indexer's key LayerNorm
takes ``rms_norm_eps``. ``indexer_types`` lists each layer's indexer as ``"full"`` (its
own) or ``"shared"``: such a layer has no indexer and attends to the keys the previous layer
attended to, chosen by the last ``"full"`` layer before it from that layer's input
(transformers hands each layer's ``topk_indices`` to the next). It is read with
``shares_choice_with``, that layer's index: each call takes that layer's choice as its mask
(:mod:`mha.api.sparse`); a ``"shared"`` layer before any ``"full"`` one is refused by its
index.

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
from .layouts import LatentProjections, Tensor, whole
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
    rotated, the indexer's LayerNorm of ``rms_norm_eps`` and the sinks; a ``"shared"``
    layer has no indexer and reuses the last ``"full"`` layer's choice."""

    sinks: str = "learnable_sink_param"

    def indexer(self, read: Settings, index: int) -> IndexerSpec | None:
        """Layer ``index``'s indexer (``None`` for a ``"shared"`` layer)."""
        if self.choice_from(read, index) is not None:
            return None
        spec = super().indexer(read, index)
        if spec is None:
            return None
        return IndexerSpec(
            spec.topk,
            spec.num_heads,
            spec.head_dim,
            norm_eps=float(read.get("rms_norm_eps")),
            rotate_last=True,
        )

    def choice_from(self, read: Settings, index: int) -> int | None:
        """The last ``"full"`` layer before a ``"shared"`` layer ``index`` (``None`` for a
        ``"full"`` one); a ``"shared"`` layer without one before it is refused."""
        kinds = read.get("indexer_types")
        if not isinstance(kinds, list):
            kinds = default_indexer_types(read.positive("num_hidden_layers"))
        if index >= len(kinds) or kinds[index] == "full":
            return None
        if kinds[index] != "shared":
            raise read.refuse(
                f"{read.name('indexer_types')}[{index}]={kinds[index]!r} (an indexer is "
                "'full' or 'shared')"
            )
        chooser = next((j for j in range(index - 1, -1, -1) if kinds[j] == "full"), None)
        if chooser is None:
            raise read.refuse(
                f"{read.name('indexer_types')}[{index}]='shared' and no 'full' layer before it: "
                f"layer {index} reuses a top-k choice no earlier layer's indexer makes"
            )
        return chooser

    def tensors(self, settings: Mapping[str, Any], biased: Any) -> dict[str, Tensor]:
        """The latent attention's tensors, its indexer's and its sinks."""
        sinks = {self.sinks: whole("sinks", settings["num_heads"])}
        if settings.get("indexer") is None:  # a "shared" layer: no indexer
            return LatentProjections.tensors(self, settings, biased) | sinks
        return super().tensors(settings, biased) | sinks


ROWS: tuple[Family, ...] = (
    Family(
        "hy_v4",
        HY_V4,
        tensors=HyV4Projections(),
        gate=Gate("linear_gate"),
    ),
)
"""The row of this family, registered by :mod:`.registry`."""
