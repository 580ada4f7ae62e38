"""NumPy's own BLAS, for compiled code: the addresses of its ``cblas_sgemm`` and
``cblas_dgemm``.

The compiled tile walks (:mod:`.compiled`) call the GEMM functions of the very library
NumPy's ``matmul`` calls, so a tile's products round as NumPy's do, run on the same kernel
(OpenBLAS picks one per CPU), and obey the same thread limit (:mod:`.team` holds it to one
thread through threadpoolctl). numba's own ``np.dot`` would need SciPy and call SciPy's
copy of OpenBLAS instead: another library, another thread setting.

The library is the one threadpoolctl finds loaded by NumPy. NumPy's wheels on PyPI bundle
OpenBLAS built with 64-bit integers and ``scipy_`` names (``scipy_cblas_sgemm64_``); an
OpenBLAS with the ``64_`` suffix (``cblas_sgemm64_``) is used as well. Any other BLAS
(32-bit integers, Accelerate, MKL under other names) gives ``None``, and the kernel runs
its NumPy walk.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["gemm_addresses", "thread_setting"]

_GEMM_NAMES = ("scipy_cblas_{}gemm64_", "cblas_{}gemm64_")
_THREAD_NAMES = (
    "scipy_openblas_{}_num_threads64_",
    "openblas_{}_num_threads64_",
    "openblas_{}_num_threads",
)


@functools.cache
def _numpys_blas() -> ctypes.CDLL | None:
    """The BLAS library NumPy loaded, as threadpoolctl finds it (``None`` without it)."""
    try:
        import numpy as np  # noqa: F401  (loads the BLAS threadpoolctl is to find)
        from threadpoolctl import threadpool_info  # type: ignore[import-untyped]
    except ImportError:
        return None
    found = [library for library in threadpool_info() if library.get("user_api") == "blas"]
    found.sort(key=lambda library: "numpy" not in library.get("filepath", ""))  # NumPy's first
    for library in found:
        try:
            return ctypes.CDLL(library["filepath"])
        except OSError:
            continue
    return None


@functools.cache
def gemm_addresses() -> dict[str, int] | None:
    """``{"float32": address, "float64": address}`` of NumPy's BLAS's 64-bit-integer CBLAS
    ``sgemm`` and ``dgemm``, or ``None`` when they cannot be found."""
    return _addresses(_GEMM_NAMES)


def _addresses(names: tuple[str, ...]) -> dict[str, int] | None:
    handle = _numpys_blas()
    for name in names if handle is not None else ():
        try:
            found = {
                dtype: ctypes.cast(getattr(handle, name.format(letter)), ctypes.c_void_p).value
                for dtype, letter in (("float32", "s"), ("float64", "d"))
            }
        except AttributeError:
            continue
        if all(found.values()):
            return {dtype: int(address) for dtype, address in found.items() if address}
    return None


@functools.cache
def thread_setting() -> tuple[Any, Any] | None:
    """``(get, set)``: OpenBLAS's own functions reading and setting the number of threads of
    NumPy's BLAS, or ``None`` (another BLAS, or threadpoolctl missing). A call costs a
    microsecond, where threadpoolctl's ``limit`` and its restoring cost tens (it looks
    through every library loaded each time)."""
    handle = _numpys_blas()
    for name in _THREAD_NAMES if handle is not None else ():
        try:
            get, set_ = getattr(handle, name.format("get")), getattr(handle, name.format("set"))
        except AttributeError:
            continue
        get.restype, get.argtypes = ctypes.c_int, []
        set_.restype, set_.argtypes = None, [ctypes.c_int]
        return get, set_
    return None
