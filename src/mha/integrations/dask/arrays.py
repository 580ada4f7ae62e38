"""The arrays :mod:`mha.dask`'s functions are given: Dask arrays (chunk sizes known) or
NumPy ones, and the small ones read when the graph is built."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._arrays import as_array, as_float_array
from ...errors import AttentionValueError

__all__ = ["import_dask", "is_dask", "known", "lazy_or_array", "small", "standin"]


def import_dask() -> Any:
    try:
        import dask.array as da
    except ImportError:
        raise ImportError(
            'mha.dask needs Dask: pip install ".[dask]" in the mha checkout, or '
            'pip install "dask[array]" distributed'
        ) from None
    return da


def is_dask(x: Any) -> bool:
    return hasattr(x, "dask") and hasattr(x, "chunks") and hasattr(x, "rechunk")


def lazy_or_array(name: str, x: Any, da: Any) -> Any:
    """A Dask array as it is (integers read as float64, lazily), anything else as the
    in-memory function reads it."""
    if not is_dask(x):
        return as_float_array(name, x)
    if known(name, x).dtype.kind in "iu":
        return x.astype(np.float64)
    return x


def known(name: str, x: Any) -> Any:
    """``x``, refused if its chunk sizes are unknown (as after boolean indexing)."""
    if any(np.isnan(size) for size in x.shape):
        raise AttentionValueError(
            f"{name} has unknown chunk sizes {x.chunks}; call {name}.compute_chunk_sizes() "
            "first (attention needs every chunk's length to plan the graph)"
        )
    return x


def standin(x: Any) -> np.ndarray:
    """A NumPy array with ``x``'s shape and dtype that takes no memory, for the checks."""
    if isinstance(x, np.ndarray):
        return x
    return np.broadcast_to(np.zeros((), x.dtype), x.shape)


def small(name: str, x: Any) -> Any:
    """Lengths and positions: one number per sequence or position, read when the graph is
    built (a Dask array is computed)."""
    if x is None:
        return None
    return as_array(name, x.compute() if is_dask(x) else x)
