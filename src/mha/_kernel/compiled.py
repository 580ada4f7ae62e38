"""The forward tile's softmax step compiled with numba (the optional ``fast`` extra).

NumPy makes four passes over each tile of scores for the online softmax: the row maximum,
the subtraction, ``exp`` and the row sum, each reading (and two writing) a tile larger than
a core's L2 cache. :func:`softmax_step` does them in one sweep per row, while the row is in
L1, with an exponential of its own that the compiler vectorises (numba's ``math.exp`` calls
libm one element at a time unless Intel's SVML is present, which pip's llvmlite lacks; this
is what PyTorch's CPU kernels do with Sleef).

The exponential: ``x = n ln 2 + r`` with ``|r| <= ln 2 / 2`` (Cody and Waite's two-part
``ln 2``, so ``r`` is exact), ``exp(r)`` by its Taylor polynomial (degree 13 in float64,
7 in float32: truncation below half an ulp), and ``2^n`` built in the exponent bits. Within
1 ulp of the correctly rounded value for ``x <= 0`` down to the smallest normal result;
what would be subnormal (``x < -708`` in float64, ``-87`` in float32) is 0, a weight below
``1e-307`` of the row's largest. ``exp(-inf) = 0`` and NaN stays NaN. Arguments here are
``s - max <= 0``.

Without numba the kernel runs its NumPy passes: same results up to rounding, tested against
each other and against PyTorch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

__all__ = ["available", "compile_seconds", "full_band", "softmax_step"]

_KERNELS: Any = None
_COMPILE_SECONDS: dict[str, float] = {}
_FAILED = False


def available() -> bool:
    """Whether the compiled steps can run: numba imports and ``MHA_COMPILED`` is not ``0``."""
    global _KERNELS, _FAILED
    if _KERNELS is not None:
        return True
    if _FAILED or os.environ.get("MHA_COMPILED", "1") == "0":
        return False
    try:
        from . import _numba_step
    except ImportError:  # numba (or llvmlite) is not installed
        _FAILED = True
        return False
    _KERNELS = _numba_step
    return True


def full_band(R: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Row bounds ``[lo, hi)`` that hide nothing in a tile of ``R`` rows by ``w`` keys."""
    return np.zeros(R, np.int64), np.full(R, w, np.int64)


def softmax_step(
    s: np.ndarray,
    band: tuple[np.ndarray, np.ndarray],
    m: np.ndarray,
    ref: np.ndarray,
    total: np.ndarray,
    alpha: np.ndarray,
    first: bool,
    alibi: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """One key tile of the online softmax for scores ``s (G, R, w)``, in place. Row ``i``
    sees the keys ``band[0][i] <= j < band[1][i]`` (other hidden pairs already ``-inf``).
    ``m`` is the running maximum, ``ref`` the maximum used for exp (0 while a row has seen
    no key), ``total`` the running sum, all ``(G, R)``; ``s`` becomes ``exp(s - ref)``
    (0 outside the band) and ``alpha`` the factor by which earlier tiles' sums and
    accumulators are rescaled (0 for rows that saw no key before). ``first``: no earlier
    tile. ``alibi = (slope (G, R), base (R,))`` adds ALiBi's ``slope * (j - base)`` to the
    visible scores first, ``base`` being each row's query position less the tile's first
    key position (int64)."""
    if alibi is None:
        alibi = np.empty((1, 0), s.dtype), np.empty(0, np.int64)
    _run("step", s, *band, m, ref, total, alpha, first, *alibi)


def _run(name: str, *args: Any) -> None:
    kernel = getattr(_KERNELS, name)
    key = f"{name} {args[0].dtype.name}"
    if key not in _COMPILE_SECONDS:  # the first call compiles (or loads numba's disk cache)
        start = time.perf_counter()
        kernel(*args)
        _COMPILE_SECONDS[key] = time.perf_counter() - start
        return
    kernel(*args)


def compile_seconds() -> dict[str, float]:
    """Seconds the first call of each kernel and dtype took to compile or to load from
    numba's cache (on disk beside this file, or numba's user cache directory)."""
    return dict(_COMPILE_SECONDS)
