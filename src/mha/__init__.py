"""mha: exact multi-head attention as a first-class NumPy citizen.

>>> import numpy as np, mha
>>> X = np.random.default_rng(0).standard_normal((2, 4, 8))
>>> mha.MultiHeadAttention(8, 2, seed=0)(X, mask=True).shape
(2, 4, 8)
"""

# The public import paths are attributes of the package too, as they always were.
from . import cache as cache
from . import functional as functional
from . import module as module
from . import rotary as rotary
from .api.block_sparse import BlockIndexerSpec, BlockSparseAttention, BlockSparseSpec
from .api.cache import KVCache
from .api.configuration import LayerSpec
from .api.differential import DifferentialAttention, DifferentialSpec
from .api.dynamic_mask import DynamicMaskAttention, DynamicMaskSpec
from .api.function import multi_head_attention
from .api.latent import LatentAttention, LatentSpec
from .api.module import MultiHeadAttention
from .api.paged import cascade_attention, paged_attention
from .api.paged_cache import PagedKVCache
from .api.pretrained import attention_layers, from_pretrained
from .api.relative_bias import position_buckets, relative_position_bias
from .api.rotary import apply_rotary
from .api.segment_bias import SegmentBiasAttention, SegmentBiasSpec
from .api.split_heads import merge_attention, scaled_dot_product_attention
from .api.variants import alibi_slopes, symmetric_alibi
from .errors import (
    AttentionError,
    AttentionTypeError,
    AttentionValueError,
    PoolExhaustedError,
    ShapeError,
    WeightsFileError,
)

__all__ = [
    "AttentionError",
    "AttentionTypeError",
    "AttentionValueError",
    "BlockIndexerSpec",
    "BlockSparseAttention",
    "BlockSparseSpec",
    "DifferentialAttention",
    "DifferentialSpec",
    "DynamicMaskAttention",
    "DynamicMaskSpec",
    "KVCache",
    "LatentAttention",
    "LatentSpec",
    "LayerSpec",
    "MultiHeadAttention",
    "PagedKVCache",
    "PoolExhaustedError",
    "SegmentBiasAttention",
    "SegmentBiasSpec",
    "ShapeError",
    "WeightsFileError",
    "alibi_slopes",
    "apply_rotary",
    "attention_layers",
    "cascade_attention",
    "from_pretrained",
    "merge_attention",
    "multi_head_attention",
    "paged_attention",
    "position_buckets",
    "relative_position_bias",
    "scaled_dot_product_attention",
    "symmetric_alibi",
]
__version__ = "0.1.0"

# The integrations' readers and writers, registered for the layers' loaders (mha.api.formats).
from .integrations import formats as _formats  # noqa: F401
