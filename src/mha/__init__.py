"""mha: exact multi-head attention as a first-class NumPy citizen.

>>> import numpy as np, mha
>>> X = np.random.default_rng(0).standard_normal((2, 4, 8))
>>> mha.MultiHeadAttention(8, 2, seed=0)(X, mask=True).shape
(2, 4, 8)
"""

from .cache import KVCache
from .errors import (
    AttentionError,
    AttentionTypeError,
    AttentionValueError,
    ShapeError,
    WeightsFileError,
)
from .functional import merge_attention, multi_head_attention, scaled_dot_product_attention
from .module import MultiHeadAttention
from .rotary import apply_rotary

__all__ = [
    "AttentionError",
    "AttentionTypeError",
    "AttentionValueError",
    "KVCache",
    "MultiHeadAttention",
    "ShapeError",
    "WeightsFileError",
    "apply_rotary",
    "merge_attention",
    "multi_head_attention",
    "scaled_dot_product_attention",
]
__version__ = "0.1.0"
