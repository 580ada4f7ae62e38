"""Keys and values stored in 8 or 4 bits, as a cache keeps them when memory limits the
context, and read back tile by tile.

Per token (int8, int4, and KIVI's values): each token's vector of one head is cut into
groups of ``group`` channels. Per channel (KIVI's keys, ``per_channel``): each channel of
one head is cut into groups of ``group`` consecutive tokens, so that a channel far larger
than the rest (as trained models' keys have) gets a step of its own instead of setting every
token's. Either way a group keeps its smallest value ``zero`` and its step ``scale = (max -
min) / (2**bits - 1)``, both in float16, and each value the integer ``code = round((x -
zero) / scale)`` in ``[0, 2**bits - 1]``: one byte for 8 bits, half a byte for 4 (two
channels a byte, the even channel in the low four bits). The value read back is ``code *
scale + zero`` in float32, within half a step of ``x`` (plus the float16 rounding of
``scale`` and ``zero``: the bound :func:`error_bound` computes, which the tests check).
In float8 (``float8``, the cache's ``"fp8"``), each group is scaled so that its largest
magnitude is float8 e4m3's largest, 448, and each value is the nearest float8 number (one
byte); read back as ``code * scale``, within 1/16 of the value and half of float8's
smallest step. The
kernel dequantises each key tile as it reaches it (:class:`.paged.PagedKV`; the compiled
walk, :mod:`._numba_stored`, with the same arithmetic); nothing holds the whole cache in
float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FLOAT8_MAX", "Quantization"]


FLOAT8_MAX = 448.0
"""The largest finite float8 e4m3 number (``ml_dtypes.float8_e4m3fn``)."""


@dataclass(frozen=True)
class Quantization:
    bits: int  # 8 or 4
    group: int  # channels sharing a scale and a zero point (tokens, when per_channel)
    per_channel: bool = False  # groups of tokens per channel (KIVI's keys), not of channels
    float8: bool = False  # codes are float8 e4m3 numbers times the scale (no zero point)

    @property
    def levels(self) -> int:
        return int(2**self.bits - 1)

    def code_width(self, d: int) -> int:
        """Bytes of codes for ``d`` channels."""
        return d if self.bits == 8 else d // 2

    def bytes_per_vector(self, d: int) -> int:
        """Bytes one token's vector of ``d`` channels takes: codes, scales and zero points
        (per channel, a group's ``d`` scales and zero points shared by its ``group`` tokens:
        the same ``4 * d / group`` bytes a token)."""
        return self.code_width(d) + 2 * 2 * (d // self.group)

    def _grouped(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """``x (..., n, d)`` with its groups along an axis of their own, and that axis:
        ``(..., n, d / group, group)`` and -1, or per channel ``(..., n / group, group, d)``
        and -2."""
        if self.per_channel:
            n, d = x.shape[-2:]
            return x.reshape(*x.shape[:-2], n // self.group, self.group, d), -2
        return x.reshape(*x.shape[:-1], x.shape[-1] // self.group, self.group), -1

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``x (..., n, d)`` as ``(codes (..., n, code_width) uint8, scale, zero)`` with
        ``scale`` and ``zero`` float16 ``(..., n, d / group)``, or per channel ``(..., n /
        group, d)``."""
        if self.float8:
            return self._quantize_float8(x)
        groups, axis = self._grouped(x.astype(np.float32))
        low, high = groups.min(axis=axis, keepdims=True), groups.max(axis=axis, keepdims=True)
        with np.errstate(over="ignore"):
            scale = ((high - low) / np.float32(self.levels)).astype(np.float16)
        zero = low.astype(np.float16)
        step = scale.astype(np.float32)
        step[~(step > 0)] = 1  # a group of equal values: its codes are 0
        codes = np.rint((groups - zero.astype(np.float32)) / step)
        codes = np.clip(codes, 0, self.levels, out=codes).astype(np.uint8).reshape(x.shape)
        if self.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return codes, scale.squeeze(axis), zero.squeeze(axis)

    def dequantize(self, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
        """The float32 values that ``quantize``'s codes, scales and zero points stand for."""
        if self.float8:
            groups, axis = self._grouped(codes.view(_float8()).astype(np.float32))
            groups *= np.expand_dims(scale.astype(np.float32), axis)
            return groups.reshape(codes.shape)
        if self.bits == 4:
            unpacked = np.empty((*codes.shape[:-1], 2 * codes.shape[-1]), np.uint8)
            unpacked[..., 0::2], unpacked[..., 1::2] = codes & 15, codes >> 4
            codes = unpacked
        groups, axis = self._grouped(codes)
        groups = groups.astype(np.float32)
        groups *= np.expand_dims(scale.astype(np.float32), axis)
        groups += np.expand_dims(zero.astype(np.float32), axis)
        return groups.reshape(codes.shape)

    def _quantize_float8(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each group scaled so that its largest magnitude is float8's largest (the scale in
        float16), each value rounded to the nearest float8 e4m3 number; the zero points are
        zeros (the layout stays int8's)."""
        groups, axis = self._grouped(x.astype(np.float32))
        with np.errstate(over="ignore"):
            scale = (np.abs(groups).max(axis=axis) / np.float32(FLOAT8_MAX)).astype(np.float16)
        step = np.expand_dims(scale.astype(np.float32), axis)
        scaled = groups / np.where(step > 0, step, np.float32(1))
        scaled = np.clip(scaled, -FLOAT8_MAX, FLOAT8_MAX)  # a scale rounded down: no overflow
        codes = scaled.astype(_float8()).view(np.uint8).reshape(x.shape)
        return codes, scale, np.zeros_like(scale)

    def error_bound(self, x: np.ndarray) -> np.ndarray:
        """The largest error ``dequantize(quantize(x))`` may make in each group of ``x``
        (shaped as ``quantize``'s scales): half a step, the rounding of the zero point and
        ``levels`` times the rounding of the step (both to float16), and float32's rounding
        of the arithmetic (a few ulps of the group's magnitude), from the group's own
        minimum and maximum."""
        groups, axis = self._grouped(x.astype(np.float64))
        low, high = groups.min(axis=axis), groups.max(axis=axis)
        if self.float8:  # half of e4m3's step (3 mantissa bits, subnormals below 2^-6),
            largest = np.maximum(np.abs(low), np.abs(high))  # the float16 scale's rounding
            scale = (largest / FLOAT8_MAX).astype(np.float16).astype(np.float64)
            float8: np.ndarray = largest * (2.0**-4 + 2.0**-10) + scale * 2.0**-10
            return float8
        exact = (high - low) / self.levels
        step = exact.astype(np.float32).astype(np.float16).astype(np.float64)
        zero = low.astype(np.float32).astype(np.float16).astype(np.float64)
        eps = float(np.finfo(np.float32).eps)
        magnitude = np.maximum(np.abs(low), np.abs(high))
        bound: np.ndarray = (
            step / 2
            + np.abs(low - zero)
            + self.levels * np.abs(exact - step)
            + 4 * eps * (magnitude + self.levels * step)
        )
        return bound


def _float8() -> np.dtype:
    """``ml_dtypes.float8_e4m3fn`` (the ``bf16`` extra): a float8 cache needs it."""
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - checked when the cache is made
        raise ImportError(
            'a float8 cache needs ml_dtypes: pip install ".[bf16]" (or ml_dtypes)'
        ) from None
    dtype: np.dtype = np.dtype(ml_dtypes.float8_e4m3fn)
    return dtype
