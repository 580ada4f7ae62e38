"""numba code of :mod:`mha._kernel.compiled`; importing it needs numba."""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


def _bitcast(source: Any, target: Any, llvm_target: Any) -> Any:
    """A compiled function that reads a value's bits as another type of the same width."""

    @intrinsic
    def cast(typingctx: Any, x: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], llvm_target)

        return target(source), codegen

    return cast


_bits_to_float32 = _bitcast(types.int32, types.float32, ir.FloatType())
_float32_bits = _bitcast(types.float32, types.int32, ir.IntType(32))
_bits_to_float64 = _bitcast(types.int64, types.float64, ir.DoubleType())
_float64_bits = _bitcast(types.float64, types.int64, ir.IntType(64))


# float64: x = t ln2 + r, t = round(x / ln 2) by adding 1.5 * 2^52 (the integer lands in the
# low bits), ln 2 in two parts (Cody and Waite), exp(r) by Taylor to degree 13.
_LOG2E_64 = 1.4426950408889634
_LN2_HI_64 = 6.93147180369123816490e-01
_LN2_LO_64 = 1.90821492927058770002e-10
_SHIFT_64 = 6755399441055744.0
_SHIFT_BITS_64 = 0x4338000000000000
_LOW_64 = -708.0  # below, exp(x) would be subnormal: 0
_C64 = tuple(  # 1/13!, 1/12!, ..., 1/1!, 1/0!
    1.0 / float(np.prod(np.arange(1, k + 1))) for k in range(13, -1, -1)
)


@njit(fastmath={"contract"})
def _horner(r: Any, coefficients: Any) -> Any:
    """The polynomial with ``coefficients`` (highest degree first) at ``r``."""
    p = coefficients[0]
    for c in coefficients[1:]:
        p = p * r + c
    return p


@njit(fastmath={"contract"})
def _exp64(x: float) -> float:
    xc = _LOW_64 if x < _LOW_64 else x  # NaN passes: a comparison with NaN is false
    shifted = xc * _LOG2E_64 + _SHIFT_64
    t = shifted - _SHIFT_64
    n = _float64_bits(shifted) - _SHIFT_BITS_64
    r = (xc - t * _LN2_HI_64) - t * _LN2_LO_64
    p = _horner(r, _C64)
    y = p * _bits_to_float64((n + 1023) << 52)
    return 0.0 if x < _LOW_64 else y


_f32 = np.float32
_LOG2E_32 = _f32(1.44269504088896341)
_LN2_HI_32 = _f32(0.693359375)
_LN2_LO_32 = _f32(-2.12194440e-4)
_SHIFT_32 = _f32(12582912.0)  # 1.5 * 2^23
_SHIFT_BITS_32 = np.int32(0x4B400000)
_LOW_32 = _f32(-87.0)
_ZERO_32 = _f32(0.0)
_BIAS_32 = np.int32(127)
_C32 = tuple(_f32(c) for c in _C64[-8:])  # degree 7


@njit(fastmath={"contract"})
def _exp32(x: Any) -> Any:
    xc = _LOW_32 if x < _LOW_32 else x
    shifted = xc * _LOG2E_32 + _SHIFT_32
    t = shifted - _SHIFT_32
    n = _float32_bits(shifted) - _SHIFT_BITS_32
    r = (xc - t * _LN2_HI_32) - t * _LN2_LO_32
    p = _horner(r, _C32)
    y = p * _bits_to_float32((n + _BIAS_32) << 23)
    return _ZERO_32 if x < _LOW_32 else y


def exp(x: Any) -> Any:
    """``exp`` of a float32 or float64 scalar, in its own type. Compiled code calls the
    implementations below (chosen by type); from Python this is NumPy's ``exp``."""
    return np.exp(x)


@overload(exp)
def _exp(x):  # type: ignore[no-untyped-def]  # numba compares it with the lambdas' signature
    if x == types.float32:
        return lambda x: _exp32(x)
    if x == types.float64:
        return lambda x: _exp64(x)
    return None


LANES = 16  # partial maxima kept apart so that the compiler vectorises the row's maximum


# Each row's band is taken as a slice first: loops from 0 over a slice vectorise, loops
# between two bounds read from arrays do not (measured: 8 times slower).


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, cache=True, nogil=True)
def step(s, lo, hi, m, ref, total, alpha, first, slope, base):  # type: ignore[no-untyped-def]  # pragma: no cover
    G, R, _ = s.shape
    zero = s.dtype.type(0)
    minus_inf = s.dtype.type(-np.inf)
    lanes = np.empty(LANES, dtype=s.dtype)
    biased = slope.shape[1] > 0
    for g in range(G):
        for i in range(R):
            row = s[g, i]
            a, b = lo[i], max(lo[i], hi[i])
            seen = minus_inf if first else m[g, i]
            visible = row[a:b]
            width = visible.shape[0]
            whole = width - width % LANES
            lanes[:] = minus_inf
            if biased:  # ALiBi, added in the maximum's sweep: slope * (j - query position)
                rate, at = slope[g, i], a - base[i]
                for j in range(0, whole, LANES):
                    for lane in range(LANES):
                        x = visible[j + lane] + rate * s.dtype.type(j + lane + at)
                        visible[j + lane] = x
                        lanes[lane] = x if x > lanes[lane] else lanes[lane]
                for j in range(whole, width):
                    visible[j] += rate * s.dtype.type(j + at)
            else:
                for j in range(0, whole, LANES):
                    for lane in range(LANES):
                        x = visible[j + lane]
                        lanes[lane] = x if x > lanes[lane] else lanes[lane]
            top = minus_inf
            for lane in range(LANES):
                top = lanes[lane] if lanes[lane] > top else top
            for j in range(whole, width):
                top = visible[j] if visible[j] > top else top
            new = top if top > seen else seen
            new_ref = new if new != minus_inf else zero
            for j in range(width):
                visible[j] = exp(visible[j] - new_ref)
            row[:a] = zero
            row[b:] = zero
            row_sum = zero  # over the whole row, so that the sum's rounding does not depend
            for j in range(row.shape[0]):  # on whether the band or a mask hid the pairs
                row_sum += row[j]
            if first:
                total[g, i] = row_sum
            else:
                factor = zero if seen == minus_inf else exp(ref[g, i] - new_ref)
                alpha[g, i] = factor
                total[g, i] = total[g, i] * factor + row_sum
            m[g, i] = new
            ref[g, i] = new_ref
