"""The documented dtype rules (``mha._arrays``' docstring, README's "bfloat16 and
float16"): what dtype a call reads its data as, returns and computes in, and the error
allowed against the float64 reference for each."""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import ml_dtypes
except ImportError:  # the bfloat16 piece is left out, nothing else
    BFLOAT16: Any = None
else:
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

STORAGE = [np.dtype(np.float16), *([BFLOAT16] if BFLOAT16 is not None else [])]
"""Dtypes that hold data but are computed in float32 and returned in their own."""


def floated(dtype: np.dtype) -> np.dtype:
    """The dtype mha reads an array of ``dtype`` as: integers as float64."""
    return np.dtype(np.float64) if dtype.kind in "iu" else dtype


def dtype_of(x: Any) -> np.dtype:
    return floated(np.asarray(x).dtype)


def result_dtype(*arrays: Any) -> np.dtype:
    """The documented result dtype of data ``arrays`` (``None`` ones left out): integers
    read as float64, mixed floats by ``np.result_type``, bfloat16 with float16 float32."""
    dtypes = [dtype_of(x) for x in arrays if x is not None]
    if all(d == dtypes[0] for d in dtypes):
        return dtypes[0]
    try:
        return np.dtype(np.result_type(*dtypes))
    except TypeError:
        return np.dtype(np.result_type(np.float32, *(d for d in dtypes if d not in STORAGE)))


def dtypes(*arrays: Any) -> tuple[np.dtype, np.dtype]:
    """The result dtype of data ``arrays`` (:func:`result_dtype`) and its compute dtype."""
    result = result_dtype(*arrays)
    return result, compute_dtype(result)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float32 for the storage dtypes, else ``dtype``."""
    return np.dtype(np.float32) if dtype in STORAGE else np.dtype(dtype)


def tolerance(result: np.dtype, compute: np.dtype | None = None) -> float:
    """The error allowed against the float64 reference on the same inputs: float64 1e-12;
    float32 arithmetic 1e-4 (scores up to about 30: exp's argument carries 30 ulps); the
    rounding of a float16 or bfloat16 result on top."""
    compute = compute_dtype(result) if compute is None else compute
    allowed = 1e-12 if compute == np.float64 else 1e-4
    if result == np.float16:
        allowed += 2e-3
    elif BFLOAT16 is not None and result == BFLOAT16:
        allowed += 1.6e-2
    return allowed


def as_float64(x: Any) -> np.ndarray:
    """What mha reads, in float64 (the reference's input)."""
    return np.asarray(x).astype(np.float64)
