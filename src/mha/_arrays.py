"""Turning what the caller gave into arrays, and the dtype policy.

float64 in gives float64 out. Lists and integer arrays become float64. float32 is computed
in float32. The storage dtypes float16 and bfloat16 (``ml_dtypes.bfloat16``, which NumPy
lacks; mha never needs ml_dtypes itself, an array of that dtype brings it) are computed in
float32, tile by tile, and returned in their own dtype. Mixed float inputs follow
``np.result_type`` (bfloat16 with float16 gives float32). Complex, object, string and
boolean data are refused.
"""

from __future__ import annotations

import inspect
import math
import operator
import reprlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import AttentionTypeError, AttentionValueError, ShapeError


def as_float_array(name: str, x: Any) -> np.ndarray:
    """``x`` as a real floating array (never a copy of a float array, never modified)."""
    array = as_array(name, x)
    kind = array.dtype.kind
    if kind == "f" or is_bfloat16(array.dtype):
        return array
    if kind in "iu":
        return array.astype(np.float64)
    if kind == "b":
        raise AttentionTypeError(
            f"{name} has boolean dtype; attention data must be real numbers "
            "(bfloat16, float16, float32 or float64). A boolean array belongs in mask="
        )
    hint = ""
    if kind == "V" and array.dtype.itemsize == 2:  # how NumPy files keep ml_dtypes' bfloat16
        hint = (
            ": 2-byte raw data, as .npy files keep bfloat16 (they cannot name it); view "
            "it as ml_dtypes.bfloat16, or save float32"
        )
    raise AttentionTypeError(
        f"{name} has dtype {array.dtype}; attention data must be real numbers "
        f"(bfloat16, float16, float32 or float64; integers are read as float64){hint}"
    )


def as_array(name: str, x: Any) -> np.ndarray:
    """``np.asarray(x)``, with a failure (a ragged list, say) reported under ``name``."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as error:
        raise AttentionTypeError(f"{name} could not be read as an array: {error}") from None


def cast_result(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``array`` in the dtype returned to the caller (float16 results overflow to inf)."""
    if array.dtype == dtype:
        return array
    with np.errstate(over="ignore"):
        return array.astype(dtype, copy=False)


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is ``ml_dtypes.bfloat16`` (known by name: ml_dtypes is not imported)."""
    return dtype.kind == "V" and dtype.name == "bfloat16"


def bfloat16_from_bits(bits: np.ndarray, float32: bool = False) -> np.ndarray:
    """bfloat16 numbers from their 16 bits: as ``ml_dtypes.bfloat16`` where ml_dtypes is
    installed (unless ``float32``), else as float32, exactly (a bfloat16 is a float32's top
    16 bits)."""
    if not float32:
        try:
            import ml_dtypes
        except ImportError:
            pass
        else:
            held: np.ndarray = bits.astype("=u2", copy=False).view(ml_dtypes.bfloat16)
            return held
    wide: np.ndarray = (bits.astype(np.uint32) << 16).view(np.float32)
    return wide


def is_storage_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one that holds data but is computed in float32 (float16, bfloat16)."""
    return dtype == np.float16 or is_bfloat16(dtype)


def compute_dtype_of(dtype: np.dtype) -> np.dtype:
    """The dtype the arithmetic on data of ``dtype`` runs in: float32 for the storage dtypes."""
    if isinstance(dtype, np.dtype) and dtype.kind == "f" and dtype.itemsize >= 4:
        return dtype  # float32 and wider: as it is
    return np.dtype(np.float32) if is_storage_dtype(np.dtype(dtype)) else np.dtype(dtype)


def result_and_compute_dtypes(*arrays: np.ndarray | None) -> tuple[np.dtype, np.dtype]:
    """The dtype returned to the caller and the dtype the arithmetic runs in."""
    dtypes = [a.dtype for a in arrays if a is not None]
    if dtypes and dtypes[0].isnative and all(d == dtypes[0] for d in dtypes):  # no promotion
        return dtypes[0], compute_dtype_of(dtypes[0])
    try:
        result = np.result_type(*dtypes)
    except TypeError:  # bfloat16 with float16: no common storage dtype
        result = np.result_type(np.float32, *(d for d in dtypes if not is_storage_dtype(d)))
    return result, compute_dtype_of(result)


def broadcasts_to(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` broadcasts to ``full`` (with no more axes)."""
    if len(shape) > len(full):
        return False
    try:
        return np.broadcast_shapes(shape, full) == full
    except ValueError:
        return False


def check_rank(name: str, array: np.ndarray, layout: str, ranks: tuple[int, ...]) -> None:
    if array.ndim not in ranks:
        raise ShapeError(f"{name} must have shape {layout}; got shape {array.shape}")


def positive_int(name: str, value: Any) -> int:
    """A positive Python int from an int-like value (bools and floats are refused)."""
    return _whole(name, value, 1, "a positive integer")


def non_negative_int(name: str, value: Any) -> int:
    """A Python int ``>= 0`` from an int-like value (bools and floats are refused)."""
    return _whole(name, value, 0, "a non-negative integer")


def int_at_least(name: str, value: Any, least: int, what: str) -> int:
    """A Python int ``>= least`` from an int-like value (bools and floats are refused);
    ``what`` says what was wanted in the message."""
    return _whole(name, value, least, what)


def _whole(name: str, value: Any, least: int, what: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise AttentionTypeError(f"{name} must be {what}; got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise AttentionTypeError(
            f"{name} must be {what}; got {value!r} of type {type(value).__name__}"
        ) from None
    if number < least:
        raise AttentionValueError(f"{name} must be {what}; got {number}")
    return number


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise AttentionTypeError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def resolve_scale(scale: Any, d_k: int, dtype: np.dtype, source: str = "q") -> float:
    """The softmax scale as a Python float: ``1/sqrt(d_k)`` unless the caller gave one.

    A Python float keeps float32 work in float32 (NumPy 2 promotes ``np.float64`` scalars).
    """
    if scale is None:
        if d_k == 0:
            raise AttentionValueError(
                f"the query/key head width d_k is 0 ({source}), so the default scale "
                "1/sqrt(d_k) is undefined; pass scale= explicitly"
            )
        return 1.0 / math.sqrt(d_k)  # correctly rounded, as np.sqrt
    real = isinstance(scale, (int, float, np.integer, np.floating))
    if isinstance(scale, (bool, np.bool_)) or not real:
        raise AttentionTypeError(f"scale must be a positive real number; got {scale!r}")
    try:
        value = float(scale)
    except OverflowError:
        value = float("inf")
    if not (0.0 < value <= float(np.finfo(dtype).max)):
        raise AttentionValueError(
            f"scale must be a positive number that {np.dtype(dtype).name} can hold; "
            f"got {reprlib.repr(scale)}"
        )
    return value


def check_function(name: str, function: Any, form: str, arity: int) -> Callable[..., Any]:
    """``function``, a callable that takes ``arity`` positional arguments (as ``form``
    names them, "(b, h, q_idx, kv_idx) -> bool", say); anything else is refused here,
    before the kernel calls it. A callable whose signature Python cannot read passes."""
    if not callable(function):
        raise AttentionTypeError(
            f"{name} must be a function {form}; got {reprlib.repr(function)} of type "
            f"{type(function).__name__}"
        )
    checked: Callable[..., Any] = function
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or extension without one: called as given
        return checked
    try:
        signature.bind(*range(arity))
    except TypeError as error:
        raise AttentionTypeError(
            f"{name} must take {arity} positional arguments {form}; "
            f"{getattr(function, '__name__', name)}{signature} cannot ({error})"
        ) from None
    return checked
