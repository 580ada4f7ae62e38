"""The functional API: ``scaled_dot_product_attention``, ``multi_head_attention``,
``merge_attention`` and ``alibi_slopes`` (implemented in :mod:`mha.api.split_heads`,
:mod:`mha.api.function` and :mod:`mha.api.variants`).

Weights use the "x @ W" layout: ``W_q (d_q, H*d_k)`` maps a query of width ``d_q`` to the
``H`` heads' concatenated queries. Shapes are named as in the paper: ``B`` batch, ``H``
heads, ``L`` query positions, ``S`` key positions, ``d_k``/``d_v`` per-head widths.
"""

from .api.function import multi_head_attention
from .api.split_heads import merge_attention, scaled_dot_product_attention
from .api.variants import alibi_slopes

__all__ = [
    "alibi_slopes",
    "merge_attention",
    "multi_head_attention",
    "scaled_dot_product_attention",
]
