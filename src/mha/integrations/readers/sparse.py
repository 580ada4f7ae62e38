"""The rows of sparse top-k attention: DeepSeek's multi-head latent attention whose keys a
lightning indexer picks (DSA, :mod:`mha.api.sparse`), in DeepSeek-V3.2 and GLM-MoE-DSA.

The indexer's settings are ``index_topk``, ``index_n_heads`` and ``index_head_dim``; its
tensors sit under the attention's ``indexer.`` (``wq_b``, ``wk``, ``k_norm`` weight and
bias, ``weights_proj``). DeepSeek-V3.2's indexer rotates its first ``qk_rope_head_dim``
features in pairs ``(i, i + p/2)``, GLM-MoE-DSA's in pairs ``(2i, 2i + 1)``; GLM-MoE-DSA's
``"shared"`` layers (``indexer_types``) reuse the previous layer's choice, which one layer
read alone does not have: they are refused by their index.

>>> [row.name for row in ROWS]
['deepseek_v32', 'glm_moe_dsa']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...api.sparse import IndexerSpec
from .config import Settings
from .defaults import MLA
from .family import Family
from .layouts import LatentProjections, Tensor, whole
from .rope import Rope

__all__ = ["DEEPSEEK_V32", "GLM_MOE_DSA", "ROWS", "IndexedLatentProjections"]

_INDEXER = {"index_topk": 2048, "index_head_dim": 128}
DEEPSEEK_V32: dict[str, Any] = {
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    **MLA,
    "max_position_embeddings": 163840,
    **_INDEXER,
    "index_n_heads": 64,
}
GLM_MOE_DSA: dict[str, Any] = {
    **DEEPSEEK_V32,
    "hidden_size": 6144,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "max_position_embeddings": 202752,
    "index_n_heads": 32,
    "indexer_types": None,
}


@dataclass(frozen=True)
class IndexedLatentProjections(LatentProjections):
    """DeepSeek's latent attention modules with an indexer under ``indexer``: its rope's
    pairs (``interleaved``), and the config key listing each layer's indexer as
    ``"full"`` or ``"shared"`` (``shared_key``; ``None``: every layer has its own)."""

    indexer_path: str = "indexer"
    interleaved: bool = False
    shared_key: str | None = None

    def indexer(self, read: Settings, index: int) -> IndexerSpec | None:
        """Layer ``index``'s indexer, from ``index_topk``, ``index_n_heads`` and
        ``index_head_dim``; a layer that reuses another's choice is refused."""
        if read.positive("q_lora_rank", optional=True) is None:
            raise read.refuse(
                f"{read.name('q_lora_rank')}=null (its indexer's queries come from the query "
                "latent)"
            )
        kinds = _indexer_types(read, self.shared_key) if self.shared_key else None
        if kinds is not None and index < len(kinds) and kinds[index] != "full":
            raise read.refuse(
                f"{read.name(self.shared_key or '')}[{index}]={kinds[index]!r}: layer {index} "
                "reuses the top-k keys an earlier layer's indexer chose (cross-layer top-k "
                "sharing), which one layer read alone does not have"
            )
        return IndexerSpec(
            read.positive("index_topk"),
            read.positive("index_n_heads"),
            read.positive("index_head_dim"),
            self.interleaved,
        )

    def tensors(self, settings: Mapping[str, Any], biased: Any) -> dict[str, Tensor]:
        """The latent attention's tensors and its indexer's."""
        tensors = super().tensors(settings, biased)
        spec = settings["indexer"]
        n, d, E = spec.num_heads, spec.head_dim, settings["d_model"]
        at = self.indexer_path
        return tensors | {
            f"{at}.wq_b.weight": whole("W_index_q", n * d, settings["q_lora_rank"]),
            f"{at}.wk.weight": whole("W_index_k", d, E),
            f"{at}.k_norm.weight": whole("index_k_norm", d),
            f"{at}.k_norm.bias": whole("b_index_k_norm", d),
            f"{at}.weights_proj.weight": whole("W_index_weights", n, E),
        }


def _indexer_types(read: Settings, key: str) -> list[Any]:
    """Each layer's indexer kind: ``key``'s list, else GLM-MoE-DSA's config class's
    pattern (``index_topk_pattern``, else ``index_topk_freq`` from
    ``index_skip_topk_offset``)."""
    kinds = read.get(key)
    if isinstance(kinds, list):
        return kinds
    pattern = read.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        return [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(read.get("index_topk_freq", 1), 1), read.get("index_skip_topk_offset", 2)
    layers = read.positive("num_hidden_layers")
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


ROWS: tuple[Family, ...] = (
    # the latent attention always rotates (2i, 2i + 1) pairs; the indexers differ
    Family(
        "deepseek_v32",
        DEEPSEEK_V32,
        tensors=IndexedLatentProjections(),
        rope=Rope(interleave=True),
    ),
    Family(
        "glm_moe_dsa",
        GLM_MOE_DSA,
        tensors=IndexedLatentProjections(interleaved=True, shared_key="indexer_types"),
        rope=Rope(interleave=True),
    ),
)
