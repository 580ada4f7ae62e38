"""Arrays from whatever holds them: NumPy arrays as they are, torch tensors by value."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_float_array


def as_numpy(name: str, value: Any) -> np.ndarray:
    """``value`` as a real floating NumPy array; a torch tensor (any device, bfloat16 too,
    read as float32) is copied out through ``.detach().cpu()``. torch is never imported."""
    if hasattr(value, "detach"):  # a torch tensor
        tensor = value.detach().cpu()
        try:
            value = tensor.numpy()
        except TypeError:  # bfloat16 and other dtypes NumPy lacks: read them as float32
            value = tensor.float().numpy()
    return as_float_array(name, value)
