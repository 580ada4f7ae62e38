"""``MultiHeadAttention`` (implemented in :mod:`mha.api.module`)."""

from .api.module import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
