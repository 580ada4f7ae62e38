"""The fuzzer's data: shapes with zero and one in every axis, dtypes (valid and not), and
the layouts an array can come in (the dtype rules and tolerances are :mod:`.rules`').

Values come from a NumPy generator seeded by a number hypothesis draws (drawing every
element through hypothesis would cost more than the call); the dtype, the layout and
every size are hypothesis's own draws, so they shrink.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .rules import STORAGE

FLOATS = [np.dtype(np.float64), np.dtype(np.float32), *STORAGE]
INTEGERS = [np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8)]
INVALID = [np.dtype(bool), np.dtype(np.complex128), np.dtype(object), np.dtype("U3")]
"""Data dtypes the contract refuses (booleans belong in ``mask=``)."""

LAYOUTS = ("contiguous", "fortran", "reversed", "strided", "transposed", "read-only",
           "broadcast", "list")  # fmt: skip

data_dtypes = st.sampled_from(FLOATS[:1] * 8 + FLOATS[1:2] * 3 + STORAGE + INTEGERS[:2])
"""The dtype of a call's data: float64 mostly (checked to 1e-12), the others often."""

layouts = st.sampled_from(list(LAYOUTS[:1]) * 6 + list(LAYOUTS[1:]))
sizes = st.sampled_from([0, 1, 1, 2, 2, 3, 3, 4, 5])
"""A small size: zero and one in every axis."""
long_sizes = st.one_of(sizes, sizes, sizes, st.integers(6, 40))
"""A sequence length: mostly small, at times long enough for many tiles."""


def pick(options: Sequence[Any]) -> st.SearchStrategy[Any]:
    """``st.sampled_from(options)``, made once for options that can be hashed (a strategy
    made anew for each draw costs hypothesis more than the call it draws)."""
    try:
        return _sampled(tuple((type(x), x) for x in options))
    except TypeError:  # arrays among the options
        return st.sampled_from(options)


@functools.cache
def _sampled(typed: tuple[tuple[type, Any], ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from([x for _, x in typed])  # typed: 1, 1.0 and True stay apart


def chance(p: float) -> st.SearchStrategy[bool]:
    """True with probability about ``p``; False is the simpler value (hypothesis shrinks to
    it, and tries it first: a test whose first draws are zeros sees the plain call)."""
    n = round(1 / p)
    return pick([False] * (n - 1) + [True])


seeds = st.integers(0, 2**32 - 1)


def drawn_rng(draw: Any, label: str = "seed") -> np.random.Generator:
    """A NumPy generator seeded by a number ``draw`` draws (the values of a call)."""
    return np.random.default_rng(draw(seeds, label=label))


def values(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any = np.float64,
           spread: float = 1.0) -> np.ndarray:  # fmt: skip
    """Normal values of ``shape`` times ``spread``, in ``dtype`` (integers: small whole
    numbers; a dtype the contract refuses: the same numbers in it)."""
    dtype = np.dtype(dtype)
    x = np.asarray(rng.standard_normal(shape) * spread)
    if dtype.kind in "iu":
        x = np.clip(np.rint(x), 0 if dtype.kind == "u" else -4, 4)
    elif dtype.kind == "b":
        x = x > 0
    return np.asarray(x).astype(dtype)  # a 0-d array stays an array


def laid_out(x: np.ndarray, layout: str, axis: int = 0) -> Any:
    """``x`` in ``layout``, holding the same numbers except ``broadcast``, which repeats
    index 0 along ``axis`` (a read-only view with a zero stride): what the call reads is
    what the reference reads, so that is no loss. ``list`` gives nested lists (only for
    float64, integers and sizes above zero; otherwise the array itself)."""
    if layout == "fortran":
        return np.asfortranarray(x)
    if layout == "reversed" and x.ndim:
        return np.flip(np.flip(x, axis).copy(), axis)  # negative strides
    if layout == "strided" and x.ndim:
        wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "transposed":
        return np.ascontiguousarray(x.T).T
    if layout == "read-only":
        x = x.copy()
        x.flags.writeable = False
        return x
    if layout == "broadcast" and x.ndim and x.shape[axis % x.ndim] > 1:
        return np.broadcast_to(np.take(x, [0], axis=axis % x.ndim), x.shape)
    if layout == "list" and x.size and (x.dtype == np.float64 or x.dtype.kind in "iu"):
        return x.tolist()
    return x


@st.composite
def data(draw: Any, rng: np.random.Generator, shape: tuple[int, ...], dtype: Any,
         spread: float = 1.0) -> Any:  # fmt: skip
    """An array of ``shape`` and ``dtype`` in a drawn layout."""
    layout = draw(layouts, label="layout")
    axis = draw(st.integers(0, 3), label="broadcast axis") if layout == "broadcast" else 0
    return laid_out(values(rng, shape, dtype, spread), layout, axis)


@st.composite
def invalid_data(draw: Any, rng: np.random.Generator, shape: tuple[int, ...]) -> Any:
    """Data the contract refuses: a refused dtype, or a ragged list."""
    if draw(st.booleans(), label="ragged") and len(shape) >= 1:
        return [[1.0, 2.0], [3.0]]
    return values(rng, shape, draw(st.sampled_from(INVALID), label="refused dtype"))
