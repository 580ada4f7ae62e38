"""The caches of a :class:`mha.LatentAttention` layer: its latent, contiguous (the values a
view of the keys) or paged."""

from __future__ import annotations

from typing import Any

from ..errors import AttentionValueError
from .cache import KVCache
from .paged_cache import PagedKVCache
from .sparse import SparseKVCache

__all__ = ["latent_cache", "latent_paged_cache"]


def latent_cache(layer: Any, batch_size: int, capacity: int, dtype: Any) -> KVCache:
    """:meth:`mha.LatentAttention.new_cache`: ``kv_lora_rank + qk_rope_head_dim`` numbers a
    token, the values its first ``kv_lora_rank`` (a view); with an indexer its keys too."""
    shape = (batch_size, 1, layer.kv_lora_rank + layer.qk_rope_head_dim)
    keywords: dict[str, Any] = {
        "value_dim": layer.kv_lora_rank,
        "values_in_keys": True,
        "capacity": capacity,
        "dtype": layer.dtype if dtype is None else dtype,
    }
    if layer.indexer is not None:
        return SparseKVCache(*shape, index_head_dim=layer.indexer.head_dim, **keywords)
    return KVCache(*shape, **keywords)


def latent_paged_cache(
    layer: Any, num_blocks: int, block_size: int, dtype: Any, options: dict[str, Any]
) -> PagedKVCache:
    """:meth:`mha.LatentAttention.new_paged_cache`: the latent and its rotary key in the key
    pool, the latent again in the value pool (a paged cache keeps them apart)."""
    if layer.indexer is not None:
        raise AttentionValueError(
            "new_paged_cache: this layer's indexer keeps its keys in new_cache()'s cache"
        )
    width = layer.kv_lora_rank + layer.qk_rope_head_dim
    stored = layer.dtype if dtype is None else dtype
    return PagedKVCache(
        num_blocks, block_size, 1, width, value_dim=layer.kv_lora_rank, dtype=stored, **options
    )
