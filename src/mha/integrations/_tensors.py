"""Arrays from whatever holds them: NumPy arrays as they are, torch tensors by value, and
back: NumPy arrays as torch tensors, bfloat16 both ways bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_float_array, bfloat16_from_bits, is_bfloat16


def as_numpy(name: str, value: Any) -> np.ndarray:
    """``value`` as a real floating NumPy array; a torch tensor (any device) is copied out
    through ``.detach().cpu()``. A bfloat16 tensor becomes an ``ml_dtypes.bfloat16`` array
    of the same bits when ml_dtypes is installed, and exact float32 otherwise (every
    bfloat16 is a float32). torch is never imported."""
    if hasattr(value, "detach"):  # a torch tensor
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            value = bfloat16_from_bits(tensor.view(_torch_uint16(tensor)).numpy().view(np.uint16))
        else:
            try:
                value = tensor.numpy()
            except TypeError:  # other dtypes NumPy lacks: read them as float32
                value = tensor.float().numpy()
    return as_float_array(name, value)


def as_tensor(array: np.ndarray) -> Any:
    """A torch tensor holding a copy of ``array``; bfloat16 arrays stay bfloat16."""
    import torch

    if is_bfloat16(array.dtype):
        bits = np.ascontiguousarray(array).view(np.uint16).copy()
        return torch.from_numpy(bits).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def _torch_uint16(tensor: Any) -> Any:
    import torch

    return torch.uint16 if hasattr(torch, "uint16") else torch.int16
