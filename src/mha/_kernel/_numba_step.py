"""numba code of :mod:`mha._kernel.compiled`; importing it needs numba."""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
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


# expm1(y) for y <= 0 as exp's reduction gives it: y = t ln 2 + r, expm1(y) = 2^t (e^r - 1)
# + (2^t - 1), with e^r - 1 = r q(r) summed without the cancellation of exp(r) - 1, and
# 2^t - 1 exact; q(r) = sum r^k / (k + 1)! to degree 12 (float64) and 7 (float32).
_Q64 = _C64[:-1]  # 1/13!, ..., 1/1!
_Q32 = tuple(_f32(c) for c in _C64[-9:-1])  # 1/8!, ..., 1/1!
_TANH_LOW_64 = -80.0  # below, expm1(y) is -1 in float64 (and 2^t stays normal)
_TANH_LOW_32 = _f32(-40.0)
_ONE_32, _TWO_32 = _f32(1.0), _f32(2.0)


@njit(fastmath={"contract"}, error_model="numpy")  # (numba's own checks x / 0: no vectors)
def _tanh64(x: float) -> float:
    y = -2.0 * abs(x)
    y = _TANH_LOW_64 if y < _TANH_LOW_64 else y
    shifted = y * _LOG2E_64 + _SHIFT_64
    t = shifted - _SHIFT_64
    n = _float64_bits(shifted) - _SHIFT_BITS_64
    r = (y - t * _LN2_HI_64) - t * _LN2_LO_64
    power = _bits_to_float64((n + 1023) << 52)  # 2^t
    em = power * (r * _horner(r, _Q64)) + (power - 1.0)  # expm1(y), in (-1, 0]
    magnitude = (0.0 - em) / (2.0 + em)
    return -magnitude if x < 0.0 else magnitude  # NaN passes: it is not below 0


@njit(fastmath={"contract"}, error_model="numpy")
def _tanh32(x: Any) -> Any:
    y = _f32(-2.0) * abs(x)
    y = _TANH_LOW_32 if y < _TANH_LOW_32 else y
    shifted = y * _LOG2E_32 + _SHIFT_32
    t = shifted - _SHIFT_32
    n = _float32_bits(shifted) - _SHIFT_BITS_32
    r = (y - t * _LN2_HI_32) - t * _LN2_LO_32
    power = _bits_to_float32((n + _BIAS_32) << 23)
    em = power * (r * _horner(r, _Q32)) + (power - _ONE_32)
    magnitude = (_ZERO_32 - em) / (_TWO_32 + em)
    return -magnitude if x < _ZERO_32 else magnitude


def tanh(x: Any) -> Any:
    """``tanh`` of a float32 or float64 scalar, in its own type, written so that the
    compiler vectorises a loop of it (soft-capping in the tile walks: numba's ``math.tanh``
    calls libm one element at a time): ``sign(x) (-e) / (2 + e)`` with ``e = expm1(-2|x|)``
    from exp's reduction (above), within a few ulp of the correctly rounded value (tested
    against NumPy's). From Python this is NumPy's ``tanh``."""
    return np.tanh(x)


@overload(tanh)
def _tanh(x):  # type: ignore[no-untyped-def]  # numba compares it with the lambdas' signature
    if x == types.float32:
        return lambda x: _tanh32(x)
    if x == types.float64:
        return lambda x: _tanh64(x)
    return None


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


VECTOR_BITS = 256  # one AVX2 register: 8 float32 or 4 float64
RUNNING = 4  # vectors of running maxima, so that no comparison waits for the last
BLOCK = RUNNING * VECTOR_BITS // 32  # float32's round of :func:`_block_max`, float64's twice


@intrinsic
def _block_max(typingctx, x, whole):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The largest of ``x[:whole]`` (``x`` contiguous, ``whole`` a multiple of
    :data:`BLOCK`; ``-inf`` when 0), NaN passed over as in ``v if v > top else top``.

    Written as LLVM vector code: numba's loops of running maxima stay scalar (the vectorisers
    pass over ``select``-based maxima of floats; measured: 0.2 ns per float32 element, where a
    vector takes 0.03)."""
    dtype = x.dtype

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        real = context.get_value_type(dtype)
        lanes = VECTOR_BITS // dtype.bitwidth
        vector = ir.VectorType(real, lanes)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        stop = context.cast(builder, args[1], signature.args[1], types.intp)
        index = context.get_value_type(types.intp)
        lowest = ir.Constant(vector, [ir.Constant(real, float("-inf"))] * lanes)
        running = [cgutils.alloca_once_value(builder, lowest) for _ in range(RUNNING)]

        def larger(a: Any, b: Any) -> Any:
            return builder.select(builder.fcmp_ordered(">", a, b), a, b)

        step, size = ir.Constant(index, lanes * RUNNING), dtype.bitwidth // 8
        with cgutils.for_range_slice(builder, ir.Constant(index, 0), stop, step) as (at, _):
            for r, top in enumerate(running):
                here = builder.gep(data, [builder.add(at, ir.Constant(index, r * lanes))])
                value = builder.load(builder.bitcast(here, vector.as_pointer()), align=size)
                builder.store(larger(value, builder.load(top)), top)
        tops = [builder.load(top) for top in running]
        while len(tops) > 1:
            tops = [larger(a, b) for a, b in zip(tops[::2], tops[1::2], strict=True)]
        result = builder.extract_element(tops[0], ir.Constant(ir.IntType(32), 0))
        for lane in range(1, lanes):
            element = builder.extract_element(tops[0], ir.Constant(ir.IntType(32), lane))
            result = larger(element, result)
        return result

    return dtype(x, whole), codegen


@njit(boundscheck=False, nogil=True)
def row_max(x):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The largest of ``x`` (``-inf`` when empty; NaN is passed over)."""
    n = x.shape[0]
    whole = n - n % BLOCK if x.strides[0] == x.itemsize else 0
    top = _block_max(x, whole)
    for j in range(whole, n):
        top = x[j] if x[j] > top else top
    return top


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def change_row(visible, rate, at, biased, cap):  # type: ignore[no-untyped-def]  # pragma: no cover
    """A row's visible scores changed in the order the kernel's transforms take
    (:mod:`.scores`): soft-capped when ``cap`` is not 0 (``cap tanh(s / cap)``), then
    ALiBi's ``rate * (j + at)`` added to key ``j`` when ``biased``."""
    if cap != 0.0:
        cap_, inverse = visible.dtype.type(cap), visible.dtype.type(1.0 / cap)
        for j in range(visible.shape[0]):
            visible[j] = cap_ * tanh(visible[j] * inverse)
    if biased:
        for j in range(visible.shape[0]):
            visible[j] += rate * visible.dtype.type(j + at)


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def row_step(row, a, b, seen, ref_old, total_old, first, rate, at, biased):  # type: ignore[no-untyped-def]  # pragma: no cover
    """One row of :func:`step`: ``row`` (its keys ``[a, b)`` visible) with ALiBi's bias
    added (:func:`change_row`), then :func:`row_softmax`."""
    if biased:
        change_row(row[a:b], rate, at, biased, 0.0)
    return row_softmax(row, a, b, seen, ref_old, total_old, first)


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
def row_softmax(row, a, b, seen, ref_old, total_old, first):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The online softmax's step of one row: ``row`` (its keys ``[a, b)`` visible, hidden
    ones among them already ``-inf``) becomes ``exp(row - ref)``, 0 outside the band;
    returns the new maximum, ``ref``, sum and rescaling factor."""
    zero = row.dtype.type(0)
    minus_inf = row.dtype.type(-np.inf)
    if first:
        seen = minus_inf
    top = row_max(row[a:b])
    new = top if top > seen else seen
    new_ref = new if new != minus_inf else zero
    # The pairs outside the band become -inf, as a mask's, and one sweep over the whole row
    # takes exp and the sum: its rounding is then the same whether the band or a mask hid
    # them (and the sweep has no test per pair: 0.55 ns per float32 pair, 0.78 with one).
    row[:a] = minus_inf
    row[b:] = minus_inf
    row_sum = zero
    for j in range(row.shape[0]):
        e = exp(row[j] - new_ref)
        row[j] = e
        row_sum += e
    if first:
        return new, new_ref, row_sum, zero
    factor = zero if seen == minus_inf else exp(ref_old - new_ref)
    return new, new_ref, total_old * factor + row_sum, factor


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, cache=True, nogil=True)
def step(s, lo, hi, m, ref, total, alpha, first, slope, base):  # type: ignore[no-untyped-def]  # pragma: no cover
    G, R, _ = s.shape
    biased = slope.shape[1] > 0
    for g in range(G):
        for i in range(R):
            a, b = lo[i], max(lo[i], hi[i])
            rate = slope[g, i] if biased else s.dtype.type(0)
            at = a - base[i] if biased else 0
            new, new_ref, row_total, factor = row_step(
                s[g, i], a, b, m[g, i], ref[g, i], total[g, i], first, rate, at, biased
            )
            if not first:
                alpha[g, i] = factor
            total[g, i] = row_total
            m[g, i] = new
            ref[g, i] = new_ref
