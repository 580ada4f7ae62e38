"""``mha.flash_compat``: FlashAttention's Python interface on NumPy arrays
(``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``), to check a
kernel against mha by changing one import.

The public path of :mod:`mha.integrations.flash_attention` and
:mod:`mha.integrations.flash_kvcache`, where the code lives.
"""

from .integrations.flash_attention import flash_attn_func, flash_attn_varlen_func
from .integrations.flash_kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
