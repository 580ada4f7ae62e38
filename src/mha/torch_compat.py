"""``mha.torch_compat``: PyTorch's functional multi-head attention on NumPy arrays.

The public path of :mod:`mha.integrations.torch_functional`, where the code lives.
"""

from .integrations.torch_functional import multi_head_attention_forward

__all__ = ["multi_head_attention_forward"]
