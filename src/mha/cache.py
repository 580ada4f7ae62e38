"""``KVCache`` (implemented in :mod:`mha.api.cache`)."""

from .api.cache import KVCache

__all__ = ["KVCache"]
