# mypy: ignore-errors
# (compiled code: numba types it, and numba ships no stubs; as for its siblings in pyproject)
"""numba code of the compiled forward walk (:mod:`._numba_walk`) that reads keys and values
stored narrower than the compute dtype: bfloat16 and float16 bits, and a quantized cache's
codes (:mod:`.quantized`), read where they lie; importing it needs numba.

A stored pool is ``(bytes, table, block, scales, zeros, form)`` (:func:`.paged.stored_pool`):
the rows' bytes in blocks as a float pool's (:mod:`._numba_pool`), the quantized pools'
scales and zero points as float16 bits, and ``form = (kind, group, d, residual rows,
residual index, sealed rows)``. :func:`stage` reads rows ``[c0, c1)`` of one head back into
float32, each value with the bits of :meth:`.quantized.Quantization.dequantize`
(``code * scale``, then ``+ zero``, each rounded as NumPy rounds it; one fused multiply-add,
the product exact in float32: LLVM vector code of its own, which no fastmath flag of the
walk's reaches), so a tile read here holds the bits the NumPy walk's does.
A decoding step's few rows multiply the stored rows in place (:func:`stored_scores`,
:func:`stored_sums`: the products of :mod:`._numba_vectors`, each value read back in
registers with the same arithmetic, in the order a float32 pool's products take) where
:func:`in_place` says so: a step's 1 to 8 rows per head by blocks of up to four, rows of
whole vectors, the forms read per token and KIVI's keys per channel. A step it refuses
reads the rows back in runs of :data:`STAGE_ROWS` into a buffer that stays in L1, then
multiplies it (the products of :mod:`._numba_pool`); a tile of many rows is read back
whole into the walk's tile buffer for its GEMM (as a paged cache's scattered float tile is
copied). On the serving benchmark's step (64 sequences of 128 to 8,192 tokens, the
Zen 5 EPYC (znver5), two workers), int8's step took 31.5-34.7 ms in place
against 39.8-51.3 read back first, bfloat16's 39-41 against 51-53 (``docs/benchmarks.md``);
one to three rows per head (multi-head attention, SmolLM2's groups of three), in place too:
int8's step 0.56-0.68 of the float32 one's, against 0.86-1.01 read back.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._numba_pool import FEW_KEYS, address, flush, lines_ahead
from ._numba_vectors import BF16 as BF16_
from ._numba_vectors import (
    BLOCK_KEYS,
    BLOCK_ROWS,
    WIDE_BITS,
    accumulator,
    dots,
    float16,
    half,
    load,
    values,
)
from ._numba_vectors import E4M3 as E4M3_
from ._numba_vectors import F16 as F16_
from ._numba_vectors import FLOAT as FLOAT_
from ._numba_vectors import U4 as U4_
from ._numba_vectors import U4_CHANNELS as U4C_
from ._numba_vectors import U8 as U8_
from ._numba_vectors import U8_CHANNELS as U8C_
from .paged import (
    BFLOAT16,
    FLOAT,
    FLOAT8,
    FLOAT16,
    LANES,
    PER_CHANNEL,
    PER_CHANNEL4,
    PER_TOKEN,
    PER_TOKEN4,
)

__all__ = ["STAGE_ROWS", "flat", "in_place", "stage", "stored", "stored_scores", "stored_sums"]

STAGE_ROWS = 32
"""Rows of a decoding step's keys (or values) read back at a time: 16 KiB of float32 at
``d = 128``, which stay in L1 while the step's rows multiply them."""


AHEAD = 128
"""Positions ahead of the rows read whose rows are asked into the caches meanwhile, in whole
blocks (``AHEAD // block``, at least one): a paged cache's blocks lie apart, each head's
rows of a block a few KiB, too few for the CPU's own prefetcher to run ahead of the reads
(128 gained 30% on a decoding step of int8 codes; 256 and 512 no more, nor 64: measured
on the Zen 5 EPYC with the lines asked into L1 as well, before they were asked into L2
alone, :func:`._numba_pool._prefetch`). Not where the blocks lie in a run, nor in a
contiguous cache, one block a sequence (:func:`_prefetch_later`)."""


def _reader(form: int):  # type: ignore[no-untyped-def]
    """An intrinsic ``read(source, target, n, group, scales, zeros, check) -> finite``:
    ``n`` values (a multiple of :data:`.paged.LANES` and of ``group``) of ``form`` (one of
    :mod:`._numba_vectors`' forms, read by its :func:`values`) at address ``source`` read
    back into float32 at address ``target``, a vector at a time (numba's own loops stayed
    scalar: 0.25 ns a value; these, 16 lanes, 0.06). Codes become ``code * step
    + low`` (the bits of NumPy's ``*=`` then ``+=``), float8 ``e4m3 * step``: per
    token, each ``group`` values with the float16 ``step`` and ``low`` at ``scales[j]`` and
    ``zeros[j]`` in turn (a run of rows: their groups one after another); per channel, rows
    of ``group`` values, value ``e`` of each with ``scales[e]`` and ``zeros[e]``.
    ``finite``: whether every value read back is (``x - x`` is not NaN), when ``check``
    (values: :func:`stage`'s caller), else ``True``."""

    @intrinsic
    def read(typingctx, source, target, n, group, scales, zeros, check):  # type: ignore[no-untyped-def]  # pragma: no cover
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            i16, i64 = ir.IntType(16), ir.IntType(64)
            real = ir.FloatType()
            floats = ir.VectorType(real, LANES)
            source_, target_, count, size, scales_, zeros_, check_ = args
            out = builder.inttoptr(target_, real.as_pointer())
            flags = ir.VectorType(ir.IntType(1), LANES)
            seen = cgutils.alloca_once_value(builder, ir.Constant(flags, [0] * LANES))

            def constant(value):  # type: ignore[no-untyped-def]
                return ir.Constant(i64, value)

            def store(value, e, checking):  # type: ignore[no-untyped-def]
                at = builder.bitcast(builder.gep(out, [e]), floats.as_pointer())
                builder.store(value, at, align=4)
                if checking:
                    difference = builder.fsub(value, value)  # NaN for an infinity or a NaN
                    odd = builder.fcmp_unordered("uno", difference, difference)
                    builder.store(builder.or_(builder.load(seen), odd), seen)

            def every(start, stop):  # type: ignore[no-untyped-def]
                return cgutils.for_range_slice(builder, start, stop, constant(LANES), i64)

            def read_back(e, step, low):  # type: ignore[no-untyped-def]
                return values(builder, form, source_, e, LANES, step, low)

            def emit(checking):  # type: ignore[no-untyped-def]
                if form in (U8_, U4_, E4M3_):  # per token: a step (and a zero) per group
                    groups = builder.sdiv(count, size)
                    with cgutils.for_range(builder, groups) as loop:
                        j = loop.index
                        step, low = (
                            half(builder, scales_, j, LANES),
                            half(builder, zeros_, j, LANES),
                        )
                        first = builder.mul(j, size)
                        with every(first, builder.add(first, size)) as (e, _):
                            store(read_back(e, step, low), e, checking)
                elif form in (U8C_, U4C_):  # rows of ``group`` values, each its own
                    with cgutils.for_range(builder, builder.sdiv(count, size)) as loop:
                        first = builder.mul(loop.index, size)
                        with every(constant(0), size) as (e, _):
                            twice = builder.mul(e, constant(2))
                            step, low = (float16(builder, load(builder, at, twice, i16, LANES))
                                         for at in (scales_, zeros_))  # fmt: skip
                            at = builder.add(first, e)
                            store(read_back(at, step, low), at, checking)
                else:
                    with every(constant(0), count) as (e, _):
                        store(read_back(e, None, None), e, checking)

            with builder.if_else(check_) as (checked, unchecked):
                with checked:
                    emit(True)
                with unchecked:
                    emit(False)
            odd = builder.bitcast(builder.load(seen), ir.IntType(LANES))
            return builder.icmp_unsigned("==", odd, ir.Constant(ir.IntType(LANES), 0))

        i64_ = types.int64
        return types.boolean(i64_, i64_, i64_, i64_, i64_, i64_, types.boolean), codegen

    return read


_READ_BF16, _READ_F16, _READ_U8, _READ_U4, _READ_E4M3 = (
    _reader(form) for form in (BF16_, F16_, U8_, U4_, E4M3_)
)
_READ_U8_CHANNELS, _READ_U4_CHANNELS, _READ_F32 = (_reader(form) for form in (U8C_, U4C_, FLOAT_))


@njit(boundscheck=False, nogil=True, inline="always")
def stored(pool):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether ``pool`` is stored narrower than the compute dtype (read back into it, first
    by :func:`stage` or in registers by :func:`stored_scores` and :func:`stored_sums`)."""
    return pool[5][0] != FLOAT


def flat(pool):  # type: ignore[no-untyped-def]  # pragma: no cover
    """A stored ``pool`` as :func:`stage` reads it: integers only (addresses, byte strides
    and sizes), so that passing it to :func:`stage` counts no references, and one
    compiled :func:`stage` serves every walk; ``None`` for a float pool (whose walk then
    compiles no :func:`stage`: the float walks never read back)."""


@overload(flat, jit_options={"boundscheck": False, "nogil": True})
def _flat_for(pool):  # type: ignore[no-untyped-def]  # pragma: no cover
    if pool.types[0].dtype != types.uint8:
        return lambda pool: None
    return _flat


def _flat(pool):  # type: ignore[no-untyped-def]  # pragma: no cover
    data, table, block, scales, zeros, form = pool
    residual, held, sealed = form[3], form[4], form[5]
    return (
        (address(data, 0), data.strides[0], data.strides[1], data.strides[2], data.shape[3]),
        (address(table, 0), table.strides[0], table.strides[1], block),
        (address(scales, 0), scales.strides[0], scales.strides[1], scales.strides[2],
         scales.shape[3]),
        (address(zeros, 0), zeros.strides[0], zeros.strides[1], zeros.strides[2]),
        (address(residual, 0), residual.strides[0], residual.strides[1], residual.strides[2]),
        (address(held, 0), address(sealed, 0), form[0], form[1], form[2]),
    )  # fmt: skip


def stage(pool, b, g, c0, c1, target, ld, stop, check):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Sequence ``b``'s rows ``[c0, c1)`` of head ``g`` read back into float32 from the
    stored ``pool`` (:func:`flat`'s) at address ``target``, ``ld`` floats apart; whether
    every value read back is finite. In :func:`_reader`'s vector code (its arithmetic
    alone: no fastmath flag reaches it): per token and bfloat16 or float16, each run of
    rows in one block at once (their bytes, scales and zero points lie one after another),
    per channel each group of tokens. The same rows of the block :data:`AHEAD` positions on
    (before ``stop``) are asked into the caches meanwhile, unless the blocks lie in a run
    (:func:`_prefetch_later`)."""


@overload(stage, jit_options={"boundscheck": False, "nogil": True})
def _stage_for(pool, b, g, c0, c1, target, ld, stop, check):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(pool, types.NoneType):
        return lambda pool, b, g, c0, c1, target, ld, stop, check: True
    return _stage


def _stage(pool, b, g, c0, c1, target, ld, stop, check):  # type: ignore[no-untyped-def]  # pragma: no cover
    (_, _, d1, _, width), (table, t0, t1, block) = pool[0], pool[1]
    s1, scale_width = pool[2][2], pool[2][4]
    sealed, kind, group, d = pool[5][1], pool[5][2], pool[5][3], pool[5][4]
    channels = kind in (PER_CHANNEL, PER_CHANNEL4)
    runs = (
        ld == d
        and d1 == width
        and (channels or kind in (BFLOAT16, FLOAT16) or s1 == 2 * scale_width)
    )  # a run's rows (and per token, scales and zero points) one after another
    row = table + b * t0  # the sequence's block table (int64, t1 bytes apart)
    j, off, ahead = _blocks(pool, c0)
    finite = True
    c = c0
    while c < c1:
        blk = _int(row + t1 * j)
        end = min(c1, c - off + block) if runs else c + 1
        if runs and channels and off < _int(sealed + 8 * blk):  # one group of tokens
            end = min(end, c - off % group + group)
        _prefetch_later(pool, row, g, j, blk, off, end - c, ahead, c == c0, stop)
        finite &= _read_rows(pool, blk, off, g, end - c, target + 4 * (c - c0) * ld, check)
        j, off = _next(j, off + end - c, block)
        c = end
    return finite


@njit(boundscheck=False, nogil=True, inline="always")
def _read_rows(pool, blk, off, g, rows, target, check):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Rows ``[off, off + rows)`` of head ``g`` in block ``blk`` of the stored ``pool``
    (:func:`flat`'s), read back into float32 at address ``target``; whether all are finite.
    Per channel rows of one group of tokens, or of the unfilled one (KIVI's keys: from the
    residual)."""
    data, d0, d1, d2, _ = pool[0]
    scales, s0, s1, s2, _ = pool[2]
    zeros, z0, z1, z2 = pool[3]
    held, sealed, kind, group, d = pool[5]
    source = data + blk * d0 + off * d1 + g * d2
    n = rows * d
    if kind == BFLOAT16:
        return _READ_BF16(source, target, n, d, source, source, check)
    if kind == FLOAT16:
        return _READ_F16(source, target, n, d, source, source, check)
    if kind in (PER_CHANNEL, PER_CHANNEL4):
        first = _int(sealed + 8 * blk)
        if off >= first and _int(held + 8 * blk) >= 0:  # the unfilled group, in float32
            residual, r0, r1, r2 = pool[4]
            recent = residual + _int(held + 8 * blk) * r0 + g * r1 + (off - first) * r2
            return _READ_F32(recent, target, n, d, recent, recent, check)
        t = off // group
        step, low = scales + blk * s0 + t * s1 + g * s2, zeros + blk * z0 + t * z1 + g * z2
        if kind == PER_CHANNEL:
            return _READ_U8_CHANNELS(source, target, n, d, step, low, check)
        return _READ_U4_CHANNELS(source, target, n, d, step, low, check)
    step, low = scales + blk * s0 + off * s1 + g * s2, zeros + blk * z0 + off * z1 + g * z2
    if kind == FLOAT8:
        return _READ_E4M3(source, target, n, group, step, low, check)
    if kind == PER_TOKEN4:
        return _READ_U4(source, target, n, group, step, low, check)
    return _READ_U8(source, target, n, group, step, low, check)


@intrinsic
def _int(typingctx, at):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The int64 at address ``at``."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i64 = ir.IntType(64)
        return builder.load(builder.inttoptr(args[0], i64.as_pointer()), align=8)

    return types.int64(types.int64), codegen


@njit(boundscheck=False, nogil=True, inline="always")
def _blocks(pool, c0):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Where position ``c0`` lies: its block's index in the sequence's table and its offset
    in the block, and the blocks to prefetch ahead (:data:`AHEAD`). The walks below go on
    from there block by block with no division (but KIVI's keys' groups of tokens within a
    block, by ``group``): a division's latency lies on the path to a block's first reads (a
    trial that added two divisions a block, to decide whether to prefetch, took a bfloat16
    decoding step from 14.4 to 17.4 ms; shifts in their place, 14.6)."""
    block = pool[1][3]
    return c0 // block, c0 % block, max(1, AHEAD // block)


@njit(boundscheck=False, nogil=True, inline="always")
def _next(j, off, block):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Block ``j`` and offset ``off`` (at most ``block``) as the next row's."""
    return (j + 1, 0) if off == block else (j, off)


@njit(boundscheck=False, nogil=True, inline="always")
def _prefetch_later(pool, row, g, j, blk, off, n, ahead, first, stop):  # type: ignore[no-untyped-def]  # pragma: no cover
    """While rows ``[off, off + n)`` of the sequence's block ``j`` (``row``: its block
    table; ``blk``: the block's index in the pool) of head ``g`` are read, ask for the same
    rows of block ``j + ahead`` (those before position ``stop``) to be read into the caches,
    with all of that block's scales and zero points where the rows begin a block or the
    walk (``first``; a head's lie together, ``min(s0, block * s1)`` bytes). Not the rows
    where the blocks lie in a run: each head's rows one after another within a block and
    from block to block, and block ``j + ahead`` the ``ahead``-th after block ``j`` in the
    pool (the ends alone are compared; the blocks between almost always follow too). The
    CPU's own prefetcher follows such a run, and asking as well, a burst of requests for
    lines already on their way, slowed it. A decoding step at 4 rows per head over 32
    sequences of 128 to 4,096 tokens, each in one run, on the Zen 5 EPYC
    (znver5), before -> after this test and :func:`_blocks` (four rounds): bfloat16 11.1 ->
    8.5 ms, int8 9.9 -> 8.9 (float32 17.8 -> 17.6); with the sequences' blocks interleaved
    two at a time, every block asked for as before: bfloat16 15.0 -> 14.9, int8 14.0 -> 14.0."""
    (data, d0, d1, d2, width), (_, _, t1, block) = pool[0], pool[1]
    scales, s0, s1, s2, _ = pool[2]
    zeros, z0, z1, z2 = pool[3]
    kind = pool[5][2]
    at = (j + ahead) * block + off
    if at < stop:
        later = _int(row + t1 * (j + ahead))
        run = d1 == width and d0 == block * d1 and later == blk + ahead
        if not run:
            lines_ahead(data + later * d0 + off * d1 + g * d2, min(n, stop - at) * d1)
        if kind not in (BFLOAT16, FLOAT16) and (off == 0 or first):
            lines_ahead(scales + later * s0 + g * s2, min(s0, block * s1))
            lines_ahead(zeros + later * z0 + g * z2, min(z0, block * z1))


# Products on the stored rows themselves, read back in registers (:mod:`._numba_vectors`)

_BLOCK_BF16, _BLOCK_F16, _BLOCK_U8, _BLOCK_U4, _BLOCK_E4M3 = (
    dots(form, BLOCK_KEYS) for form in (BF16_, F16_, U8_, U4_, E4M3_)
)
_ONE_BF16, _ONE_F16, _ONE_U8, _ONE_U4, _ONE_E4M3 = (
    dots(form, 1) for form in (BF16_, F16_, U8_, U4_, E4M3_)
)
_BLOCK_U8C, _BLOCK_U4C, _BLOCK_F32 = (dots(form, BLOCK_KEYS) for form in (U8C_, U4C_, FLOAT_))
_ONE_U8C, _ONE_U4C, _ONE_F32 = (dots(form, 1) for form in (U8C_, U4C_, FLOAT_))
_SUMS_BF16, _SUMS_F16, _MORE_BF16, _MORE_F16 = (
    accumulator(form, block_rows=2, wide=8 if WIDE_BITS == 512 else 4, checked=checked)
    for checked, form in ((True, BF16_), (True, F16_), (False, BF16_), (False, F16_))
)
_SUMS_U8, _SUMS_U4, _SUMS_E4M3 = (accumulator(form) for form in (U8_, U4_, E4M3_))
_LANES = WIDE_BITS // 32


def in_place(pool, keys):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether a decoding step's rows (1 to 8) multiply the stored ``pool``'s rows
    (:func:`flat`'s; ``None``: a float pool) in place (:func:`stored_scores`,
    :func:`stored_sums`: blocks of up to :data:`.BLOCK_ROWS` rows): rows of whole vectors,
    a form read per token, or per channel for the ``keys`` (KIVI's). Else they are read
    back first (:func:`stage`)."""


@overload(in_place, jit_options={"boundscheck": False, "nogil": True})
def _in_place_for(pool, keys):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(pool, types.NoneType):
        return lambda pool, keys: False

    def in_place_(pool, keys):  # type: ignore[no-untyped-def]
        kind, group, d = pool[5][2], pool[5][3], pool[5][4]
        per_token = kind in (BFLOAT16, FLOAT16, PER_TOKEN, PER_TOKEN4, FLOAT8)
        per_channel = keys and kind in (PER_CHANNEL, PER_CHANNEL4)
        grouped = kind in (BFLOAT16, FLOAT16) or per_channel or group % _LANES == 0
        read = (per_token or per_channel) and grouped
        return read and d % _LANES == 0

    return in_place_


def stored_scores(pool, b, g, c0, c1, stacked, i0, rows, s):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``s[i, c - c0] = stacked[i0 + i] . key_c`` for sequence ``b``'s keys ``[c0, c1)`` of
    head ``g`` in the stored ``pool`` (:func:`flat`'s, :func:`in_place`), read back in
    registers as they are multiplied, block by block (per channel, group of tokens by group;
    a block's unfilled group from the residual, in float32): the products' order and
    rounding of a float32 pool's (:func:`._numba_pool.few_scores`)."""


@overload(stored_scores, jit_options={"boundscheck": False, "nogil": True})
def _stored_scores_for(pool, b, g, c0, c1, stacked, i0, rows, s):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(pool, types.NoneType):
        return lambda pool, b, g, c0, c1, stacked, i0, rows, s: None
    return _stored_scores


def _stored_scores(pool, b, g, c0, c1, stacked, i0, rows, s):  # type: ignore[no-untyped-def]  # pragma: no cover
    (data, d0, d1, d2, _), (table, t0, t1, block) = pool[0], pool[1]
    scales, s0, s1, s2, _ = pool[2]
    zeros, z0, z1, z2 = pool[3]
    residual, r0, r1, r2 = pool[4]
    held, sealed, kind, group = pool[5][0], pool[5][1], pool[5][2], pool[5][3]
    channels = kind in (PER_CHANNEL, PER_CHANNEL4)
    row = table + b * t0
    j, off, ahead = _blocks(pool, c0)
    c = c0
    while c < c1:
        blk = _int(row + t1 * j)
        end = min(c1, c - off + block)
        _prefetch_later(pool, row, g, j, blk, off, end - c, ahead, c == c0, c1)
        form, source, stride = kind, data + blk * d0 + off * d1 + g * d2, d1
        step, low = scales + blk * s0 + off * s1 + g * s2, zeros + blk * z0 + off * z1 + g * z2
        if channels:
            first = _int(sealed + 8 * blk)
            if off >= first and _int(held + 8 * blk) >= 0:  # the unfilled group, in float32
                form, stride = FLOAT, r2
                source = residual + _int(held + 8 * blk) * r0 + g * r1 + (off - first) * r2
            else:  # one group of tokens, its scales and zero points those of each row
                end = min(end, c - off % group + group)
                t = off // group
                step, low = scales + blk * s0 + t * s1 + g * s2, zeros + blk * z0 + t * z1 + g * z2
        n, where = end - c, (source, stride, step, low, s1, group)
        for i in range(0, rows, BLOCK_ROWS):
            count = min(BLOCK_ROWS, rows - i)
            k = 0
            while k + BLOCK_KEYS <= n:
                _dots(form, True, where, k, stacked, i0 + i, s, i, c - c0 + k, count)
                k += BLOCK_KEYS
            while k < n:
                _dots(form, False, where, k, stacked, i0 + i, s, i, c - c0 + k, count)
                k += 1
        j, off = _next(j, off + n, block)
        c = end


@njit(boundscheck=False, nogil=True, inline="always")
def _dots(kind, block, where, k, stacked, j, s, i, col, count):  # type: ignore[no-untyped-def]  # pragma: no cover
    """:func:`._numba_vectors.dots` of ``kind``'s form, a block of keys or one, by ``count``
    rows; ``where = (rows, row bytes, scales, zeros, scale row bytes, group)``."""
    args = (*where, k, stacked, j, s, i, col, count)  # (per channel: scale row bytes unread)
    if kind == BFLOAT16:
        if block:
            _BLOCK_BF16(*args)
        else:
            _ONE_BF16(*args)
    elif kind == FLOAT16:
        if block:
            _BLOCK_F16(*args)
        else:
            _ONE_F16(*args)
    elif kind == PER_TOKEN4:
        if block:
            _BLOCK_U4(*args)
        else:
            _ONE_U4(*args)
    elif kind == PER_CHANNEL:
        if block:
            _BLOCK_U8C(*args)
        else:
            _ONE_U8C(*args)
    elif kind == PER_CHANNEL4:
        if block:
            _BLOCK_U4C(*args)
        else:
            _ONE_U4C(*args)
    elif kind == FLOAT:  # (KIVI's unfilled group, float32)
        if block:
            _BLOCK_F32(*args)
        else:
            _ONE_F32(*args)
    elif kind == FLOAT8:
        if block:
            _BLOCK_E4M3(*args)
        else:
            _ONE_E4M3(*args)
    elif block:
        _BLOCK_U8(*args)
    else:
        _ONE_U8(*args)


def stored_sums(pool, b, g, c0, c1, s, acc, i0, rows, partial):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``acc[i0 + i] += sum_c s[i, c - c0] * value_c`` for sequence ``b``'s values ``[c0,
    c1)`` of head ``g`` in the stored ``pool`` (:func:`flat`'s, :func:`in_place`), read back
    in registers as they are multiplied: through ``partial`` (zero at the tile's start,
    ``[c0, c1)``), added to ``acc`` every ``FEW_KEYS`` positions of the tile and at its end,
    as :func:`._numba_pool.few_accumulate` sums a float32 pool's. Whether every value read
    back is finite."""


@overload(stored_sums, jit_options={"boundscheck": False, "nogil": True})
def _stored_sums_for(pool, b, g, c0, c1, s, acc, i0, rows, partial):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(pool, types.NoneType):
        return lambda pool, b, g, c0, c1, s, acc, i0, rows, partial: True
    return _stored_sums


def _stored_sums(pool, b, g, c0, c1, s, acc, i0, rows, partial):  # type: ignore[no-untyped-def]  # pragma: no cover
    (data, d0, d1, d2, _), (table, t0, t1, block) = pool[0], pool[1]
    scales, s0, s1, s2, _ = pool[2]
    zeros, z0, z1, z2 = pool[3]
    kind, group = pool[5][2], pool[5][3]
    row = table + b * t0
    j, off, ahead = _blocks(pool, c0)
    finite = True
    flush_at = c0 + FEW_KEYS
    c = c0
    while c < c1:
        blk = _int(row + t1 * j)
        end = min(c1, c - off + block, flush_at)
        _prefetch_later(pool, row, g, j, blk, off, end - c, ahead, c == c0, c1)
        source = data + blk * d0 + off * d1 + g * d2
        step = scales + blk * s0 + off * s1 + g * s2
        low = zeros + blk * z0 + off * z1 + g * z2
        at, n = c - c0, end - c
        for i in range(0, rows, BLOCK_ROWS):
            count = min(BLOCK_ROWS, rows - i)
            finite &= _sums(kind, source, d1, step, low, s1, group, n, s[i:], at, partial, i, count)
            if end in (flush_at, c1):
                flush(acc, partial, i0, i, i + count)
        if end == flush_at:
            flush_at += FEW_KEYS
        j, off = _next(j, off + n, block)
        c = end
    return finite


@njit(boundscheck=False, nogil=True, inline="always")
def _sums(kind, source, d1, step, low, s1, group, n, s, at, partial, i, count):  # type: ignore[no-untyped-def]  # pragma: no cover
    """:func:`._numba_vectors.accumulator` of ``kind``'s form over ``n`` rows from ``source``,
    by ``count`` rows."""
    if kind in (BFLOAT16, FLOAT16):  # two rows at a time, each value's whole row at once
        first_rows = min(count, 2)
        if kind == BFLOAT16:
            first = _SUMS_BF16(
                source, d1, step, low, s1, group, 0, n, s, at, partial, i, first_rows
            )
        else:
            first = _SUMS_F16(source, d1, step, low, s1, group, 0, n, s, at, partial, i, first_rows)
        if count <= 2:
            return first
        more, j = (source, d1, step, low, s1, group, 0, n, s[2:], at, partial, i + 2), count - 2
        if kind == BFLOAT16:
            return first & _MORE_BF16(*more, j)
        return first & _MORE_F16(*more, j)
    if kind == PER_TOKEN4:
        return _SUMS_U4(source, d1, step, low, s1, group, 0, n, s, at, partial, i, count)
    if kind == FLOAT8:
        return _SUMS_E4M3(source, d1, step, low, s1, group, 0, n, s, at, partial, i, count)
    return _SUMS_U8(source, d1, step, low, s1, group, 0, n, s, at, partial, i, count)
