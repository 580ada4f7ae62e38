# mypy: ignore-errors
# (compiled code: numba types it, and numba ships no stubs; as for its siblings in pyproject)
"""LLVM vector code of the compiled walk's products for a decoding step's few rows: the
scores ``q . key`` of a block of rows and keys (:func:`dots`), and ``partial += p * value``
of a block of rows (:func:`accumulator`), each reading its keys or values where they lie:
in the compute dtype, or stored narrower and read back into float32 in registers as they
are multiplied (bfloat16 and float16 bits, a quantized cache's codes with a float16 scale
and zero point per token and group of channels, KIVI's keys with theirs per channel;
:mod:`.quantized`). Importing it needs numba. Nothing here checks the shapes it is given:
its callers do (:func:`._numba_stored.in_place`, :func:`._numba_pool.few_scores`).

The arithmetic of a value read back gives :meth:`.quantized.Quantization.dequantize`'s
bits (``code * scale``, then ``+ zero``, each rounded as NumPy rounds it: one fused
multiply-add, the product being exact in float32), and the products'
order is fixed here, whatever the value's form: a stored cache's step gives the bits of a
float32 cache holding the values it stands for. Read back in registers, not through a
float32 copy in L1 (whose stores and loads were as many instructions as the products'
multiply-adds), the serving benchmark's int8 step took 31.5-34.7 ms against 39.8-51.3 and
bfloat16's 39-41 against 51-53 on the Zen 5 EPYC (znver5).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_step import VECTOR_BITS

__all__ = [
    "BLOCK_KEYS",
    "BLOCK_ROWS",
    "F16C",
    "WIDE_BITS",
    "accumulator",
    "dots",
    "float16",
    "target_features",
]


FLOAT, BF16, F16, U8, U4, E4M3, U8_CHANNELS, U4_CHANNELS = -1, 0, 1, 2, 3, 4, 5, 6
"""Forms of the rows the products read: the compute dtype (``FLOAT``: float32 or float64);
bfloat16 or float16 bits; 8-bit codes, 4-bit codes (two a byte, the even channel in the low
four bits) or float8 e4m3 codes, each with a float16 scale and zero point per token and
group of channels (e4m3: the scale only); 8-bit or 4-bit codes with a scale and a zero point
per channel (KIVI's keys: the same for the rows of a group of tokens). (:mod:`._numba_stored`
numbers its read-backs as these.)"""

_E4M3 = 2.0**120
"""float8 e4m3's seven bits ``eeeemmm`` shifted into float32's exponent and mantissa read
``2^(e - 127) (1 + m/8)`` (``m/8 2^-126`` for ``e = 0``); times ``2^(127 - 7)``, exactly
e4m3's number, subnormals too."""


def target_features() -> frozenset[str]:
    """The CPU features numba compiles for (``+avx512f``, ``+f16c``, ...), as numba's JIT
    takes them: ``NUMBA_CPU_FEATURES`` where set (none under ``NUMBA_CPU_NAME=generic``,
    which sets it empty), else the host's (without AVX under ``NUMBA_ENABLE_AVX=0``), whatever
    ``NUMBA_CPU_NAME`` names (another CPU's name changes the tuning, not the features)."""
    from llvmlite import binding
    from numba.core import codegen, config

    if config.CPU_FEATURES is not None:
        features = config.CPU_FEATURES
    else:
        binding.initialize_native_target()
        features = codegen.get_host_cpu_features()
    enabled = {}  # the last of "+f" and "-f" decides, as LLVM reads the list
    for feature in features.split(","):
        if feature[:1] in "+-" and feature[1:]:
            enabled[feature[1:]] = feature[0] == "+"
    return frozenset(f"+{name}" for name, on in enabled.items() if on)


def _wide_bits() -> int:
    """512 where numba compiles for AVX-512 (32 vector registers: a block's sums stay in
    registers; 6.7 ns a value of 128 for four rows from L1, against 10.7 with 256-bit
    vectors, on the Zen 5 EPYC (znver5)), else :data:`VECTOR_BITS`."""
    return 512 if "+avx512f" in target_features() else VECTOR_BITS


WIDE_BITS = _wide_bits()
"""Bits of the products' vectors (:func:`_wide_bits`)."""

F16C = {"+f16c", "+avx"} <= target_features()
"""Whether numba compiles for a CPU with F16C (and the AVX its instructions need):
:func:`float16` converts with it."""

BLOCK_ROWS = 4
"""Rows of the products' register blocks: a grouped-query step's 4 query heads per
key/value head, or 8 as two blocks."""

BLOCK_KEYS = 4 if WIDE_BITS == 512 else 2
"""Keys of :func:`dots`'s register block: its ``BLOCK_ROWS * BLOCK_KEYS`` sums, the rows
and the keys' vectors stay in registers (32 of AVX-512's, 16 of AVX2's)."""


def float16(builder: Any, bits: Any) -> Any:
    """float16 ``bits`` (a vector of i16) as float32: F16C's conversion where numba compiles
    for it, else in integer operations: the exponent and mantissa shifted into float32's,
    times 2^112 (normal and subnormal numbers, exactly), infinities and NaNs given float32's
    exponent, then the sign. (LLVM's own conversion calls a library function where the CPU
    lacks F16C, which numba's JIT does not link.)"""
    lanes = bits.type.count
    i32, real = ir.IntType(32), ir.FloatType()
    floats, ints = ir.VectorType(real, lanes), ir.VectorType(i32, lanes)
    if F16C:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), floats)

    def splat(value: Any, kind: Any = i32) -> Any:
        return ir.Constant(ir.VectorType(kind, lanes), [value] * lanes)

    x = builder.zext(bits, ints)
    sign = builder.shl(builder.and_(x, splat(0x8000)), splat(16))
    rest = builder.shl(builder.and_(x, splat(0x7FFF)), splat(13))
    number = builder.fmul(builder.bitcast(rest, floats), splat(2.0**112, real))
    special = builder.or_(rest, splat(0x7F800000))  # infinity, NaN
    odd = builder.icmp_unsigned(">=", rest, splat(0x7C00 << 13))
    value = builder.select(odd, special, builder.bitcast(number, ints))
    return builder.bitcast(builder.or_(value, sign), floats)


def load(builder: Any, address: Any, offset: Any, kind: Any, lanes: int) -> Any:
    """``lanes`` values of ``kind`` at byte ``offset`` from ``address`` (i64 each)."""
    i8 = ir.IntType(8)
    at = builder.gep(builder.inttoptr(address, i8.as_pointer()), [offset])
    vector = ir.VectorType(kind, lanes)
    return builder.load(builder.bitcast(at, vector.as_pointer()), align=1)


def half(builder: Any, address: Any, j: Any, lanes: int) -> Any:
    """The float16 at ``address`` (i64) plus ``j`` halves, as float32 in ``lanes`` lanes."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    at = builder.gep(builder.inttoptr(address, i16.as_pointer()), [j])
    undefined = ir.Constant(ir.VectorType(i16, lanes), ir.Undefined)
    one = builder.insert_element(undefined, builder.load(at, align=2), ir.Constant(i32, 0))
    zero = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
    return float16(builder, builder.shuffle_vector(one, undefined, zero))


def _lane(builder: Any, x: Any, lane: int, lanes: int) -> Any:
    """Lane ``lane`` of vector ``x`` in ``lanes`` lanes."""
    mask = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [lane] * lanes)
    return builder.shuffle_vector(x, ir.Constant(x.type, ir.Undefined), mask)


def values(builder: Any, form: int, row: Any, e: Any, lanes: int, step: Any, low: Any) -> Any:
    """Values ``[e, e + lanes)`` of the row at address ``row`` (i64) of ``form`` read back
    into float32 (``FLOAT``: float32 as they lie); codes become ``code * step + low`` (the
    bits of NumPy's ``*=`` then ``+=``, in one fused multiply-add), float8 ``e4m3 * step``."""
    i8, i16, i32, i64 = (ir.IntType(bits) for bits in (8, 16, 32, 64))
    real = ir.FloatType()
    floats = ir.VectorType(real, lanes)

    def splat(kind: Any, value: Any, count: int = lanes) -> Any:
        return ir.Constant(ir.VectorType(kind, count), [value] * count)

    if form == FLOAT:
        return load(builder, row, builder.mul(e, ir.Constant(i64, 4)), real, lanes)
    if form in (BF16, F16):
        bits = load(builder, row, builder.mul(e, ir.Constant(i64, 2)), i16, lanes)
        if form == F16:
            return float16(builder, bits)
        wide = builder.shl(builder.zext(bits, ir.VectorType(i32, lanes)), splat(i32, 16))
        return builder.bitcast(wide, floats)
    if form == E4M3:
        x = builder.zext(load(builder, row, e, i8, lanes), ir.VectorType(i32, lanes))
        magnitude = builder.and_(x, splat(i32, 127))
        sign = builder.shl(builder.and_(x, splat(i32, 128)), splat(i32, 24))
        bits = builder.or_(sign, builder.shl(magnitude, splat(i32, 20)))
        value = builder.fmul(builder.bitcast(bits, floats), splat(real, _E4M3))
        nan = builder.icmp_unsigned("==", magnitude, splat(i32, 127))
        value = builder.select(nan, splat(real, float("nan")), value)
        return builder.fmul(value, step)
    if form in (U8, U8_CHANNELS):
        codes = builder.uitofp(load(builder, row, e, i8, lanes), floats)
    else:  # U4, U4_CHANNELS
        packed = load(builder, row, builder.sdiv(e, ir.Constant(i64, 2)), i8, lanes // 2)
        lo = builder.and_(packed, splat(i8, 15, lanes // 2))
        hi = builder.lshr(packed, splat(i8, 4, lanes // 2))
        order = [k // 2 + (lanes // 2) * (k % 2) for k in range(lanes)]
        pairs = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, lanes), order))
        codes = builder.uitofp(pairs, floats)
    # ``code * step`` is exact in float32 (8 bits by float16's 11), so rounding it and then
    # the sum, as NumPy does, gives the one rounding of a fused multiply-add: the same bits
    return builder.call(_fmuladd(builder, floats, 32), [codes, step, low])


def _source(context: Any, builder: Any, signature: Any, args: Any) -> list[Any]:
    """A products' arguments as i64 (``None`` for its arrays); the first six ``(rows, row
    bytes, scales, zeros, scale row bytes, group)``: the first row's address and the bytes
    between rows; a quantized form's first scale and zero point (float16 bits), the bytes
    between rows' scales and the channels per group (ignored by the other forms)."""
    return [
        None if isinstance(kind, types.Array)
        else context.cast(builder, value, kind, types.int64)
        for value, kind in zip(args, signature.args, strict=True)
    ]  # fmt: skip


def _fmuladd(builder: Any, vector: Any, bits: int) -> Any:
    """``llvm.fmuladd`` of ``vector`` (float32 or float64 lanes, ``bits`` each): fused
    where the CPU has FMA, as contraction compiles ``a += p * x``."""
    kind = "f32" if bits == 32 else "f64"
    name = f"llvm.fmuladd.v{vector.count}{kind}"
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector, [vector] * 3), name
    )


def _quantized(form: int) -> bool:
    """Whether ``form`` has a scale per token and group of channels."""
    return form in (U8, U4, E4M3)


def _channels(form: int) -> bool:
    """Whether ``form`` has a scale per channel, the same for every row read at once."""
    return form in (U8_CHANNELS, U4_CHANNELS)


def _hsums(builder: Any, vectors: list[Any]) -> list[tuple[Any, int]]:
    """The sum of each of ``vectors``' lanes: ``(vector, lane)`` where it lies. Each in the
    same fixed order whatever the number of vectors: the first half of its lanes added to
    the second until one is left; the halves of two vectors' sums are added in one vector
    (15 shuffled additions for 16 vectors, not 60)."""
    i32 = ir.IntType(32)
    lanes = vectors[0].type.count
    packed = [(vector, [k]) for k, vector in enumerate(vectors)]  # groups of ``size`` lanes
    size = lanes
    while size > 1:
        half_, joined = size // 2, []
        for at in range(0, len(packed), 2):
            a, owners_a = packed[at]
            b, owners_b = packed[at + 1] if at + 1 < len(packed) else packed[at]
            lo, hi = [], []
            for side in (0, 1):
                for slot in range(lanes // size):
                    first = side * lanes + slot * size
                    lo += range(first, first + half_)
                    hi += range(first + half_, first + size)
            masks = [ir.Constant(ir.VectorType(i32, lanes), m) for m in (lo, hi)]
            sum_ = builder.fadd(*(builder.shuffle_vector(a, b, m) for m in masks))
            joined.append((sum_, owners_a + owners_b))
        packed, size = joined, half_
    where: dict[int, tuple[Any, int]] = {}
    for vector, owners in packed:
        for lane, owner in enumerate(owners):
            where.setdefault(owner, (vector, lane))
    return [where[k] for k in range(len(vectors))]


def dots(form: int, keys: int):  # type: ignore[no-untyped-def]
    """An intrinsic ``dots(rows, row_bytes, scales, zeros, scale_row_bytes, group, c,
    stacked, i0, s, i, col, count)``: ``s[i + r, col + k] = stacked[i0 + r] . key_(c + k)``
    for ``count`` rows ``r`` (1 to :data:`BLOCK_ROWS`) and ``keys`` keys ``k``, key ``c``
    the row at ``rows + c * row_bytes`` (:func:`_source`) of ``form``, read back in
    registers (:func:`values`; per channel, every key's scales and zero points those at
    ``scales`` and ``zeros``). Each sum: vector partial sums over the features in order,
    one ``llvm.fmuladd`` a vector (fused where the CPU has FMA), then :func:`_hsums`: the
    same order for every block of rows and keys and every form, so a row's sums are the
    same bits whatever the block it is computed in. ``stacked``'s width a multiple of the
    vectors (and of ``group``, a multiple of them, for a form per token)."""

    @intrinsic
    def products(
        typingctx, rows, row_bytes, scales, zeros, scale_bytes, group, c,
        stacked, i0, s, i, col, count
    ):  # type: ignore[no-untyped-def]  # pragma: no cover  # fmt: skip
        dtype = stacked.dtype

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            real = context.get_value_type(dtype)
            lanes = WIDE_BITS // dtype.bitwidth
            vector = ir.VectorType(real, lanes)
            index = ir.IntType(64)
            item = ir.Constant(index, dtype.bitwidth // 8)

            def const(value: int) -> Any:
                return ir.Constant(index, value)

            ints = _source(context, builder, signature, args)
            source, row_bytes_, scales_, zeros_, scale_bytes_, group_ = ints[:6]
            c_, i0_, i_, col_, count_ = ints[6], ints[8], ints[10], ints[11], ints[12]
            queries = context.make_array(signature.args[7])(context, builder, args[7])
            out = context.make_array(signature.args[9])(context, builder, args[9])
            q_ld = builder.sdiv(builder.extract_value(queries.strides, 0), item)
            s_ld = builder.sdiv(builder.extract_value(out.strides, 0), item)
            width = builder.extract_value(queries.shape, 1)
            fma = _fmuladd(builder, vector, dtype.bitwidth)

            def emit(block_rows: int) -> None:
                """The products of ``block_rows`` rows, their sums in registers."""
                sums = [[cgutils.alloca_once_value(builder, ir.Constant(vector, None))
                         for _ in range(keys)] for _ in range(block_rows)]  # fmt: skip
                key_rows = [builder.add(source, builder.mul(builder.add(c_, const(k)), row_bytes_))
                            for k in range(keys)]  # fmt: skip
                span = group_ if _quantized(form) else width  # features per scale
                with cgutils.for_range_slice(builder, const(0), width, span, index) as (g0, j):
                    steps, lows = [None] * keys, [None] * keys
                    if _quantized(form):  # (group j: the loop's count, not a division)
                        for k in range(keys):
                            at = builder.mul(builder.add(c_, const(k)), scale_bytes_)
                            steps[k] = half(builder, builder.add(scales_, at), j, lanes)
                            lows[k] = half(builder, builder.add(zeros_, at), j, lanes)
                    end = builder.add(g0, span)
                    with cgutils.for_range_slice(builder, g0, end, const(lanes), index) as (e, _):
                        if _channels(form):  # the keys' scales and zero points: the same rows
                            i16 = ir.IntType(16)
                            bits = [load(builder, at, builder.mul(e, const(2)), i16, lanes)
                                    for at in (scales_, zeros_)]  # fmt: skip
                            steps = [float16(builder, bits[0])] * keys
                            lows = [float16(builder, bits[1])] * keys
                        qs = []
                        for r in range(block_rows):
                            at = builder.add(builder.mul(builder.add(i0_, const(r)), q_ld), e)
                            pointer = builder.bitcast(
                                builder.gep(queries.data, [at]), vector.as_pointer()
                            )
                            qs.append(builder.load(pointer, align=dtype.bitwidth // 8))
                        for k in range(keys):
                            if form == FLOAT:
                                bytes_ = builder.mul(e, item)
                                x = load(builder, key_rows[k], bytes_, real, lanes)
                            else:
                                x = values(builder, form, key_rows[k], e, lanes, steps[k], lows[k])
                            for r in range(block_rows):
                                slot = sums[r][k]
                                builder.store(
                                    builder.call(fma, [qs[r], x, builder.load(slot)]), slot
                                )
                flat = [builder.load(sums[r][k]) for r in range(block_rows) for k in range(keys)]
                totals = _hsums(builder, flat)
                i32 = ir.IntType(32)
                whole = len({id(sum_) for sum_, _ in totals}) == 1
                for r in range(block_rows):
                    at = builder.add(builder.mul(builder.add(i_, const(r)), s_ld), col_)
                    if whole and keys > 1:  # a row's sums stored at once
                        sum_ = totals[0][0]
                        lanes_ = [totals[r * keys + k][1] for k in range(keys)]
                        mask = ir.Constant(ir.VectorType(i32, keys), lanes_)
                        row = builder.shuffle_vector(
                            sum_, ir.Constant(sum_.type, ir.Undefined), mask
                        )
                        pointer = builder.bitcast(
                            builder.gep(out.data, [at]), row.type.as_pointer()
                        )
                        builder.store(row, pointer, align=dtype.bitwidth // 8)
                        continue
                    for k in range(keys):
                        sum_, lane = totals[r * keys + k]
                        total = builder.extract_element(sum_, ir.Constant(i32, lane))
                        builder.store(total, builder.gep(out.data, [builder.add(at, const(k))]))

            _cases(builder, count_, range(BLOCK_ROWS, 0, -1), emit)
            return context.get_dummy_value()

        signature = types.void(
            rows, row_bytes, scales, zeros, scale_bytes, group, c, stacked, i0, s, i, col, count
        )
        return signature, codegen

    return products


def _cases(builder: Any, value: Any, counts: Any, emit: Any) -> None:
    """``emit(n)`` for the ``n`` of ``counts`` that ``value`` (i64) equals, the last
    where none does (the callers' counts are 1 to :data:`BLOCK_ROWS`, the last 1): code
    specialized to each, chosen at run time."""
    *tests, last = counts
    if not tests:
        emit(last)
        return
    here = builder.icmp_signed("==", value, ir.Constant(value.type, tests[0]))
    with builder.if_else(here) as (then, otherwise):
        with then:
            emit(tests[0])
        with otherwise:
            _cases(builder, value, [*tests[1:], last], emit)


def accumulator(
    form: int,
    bits: int = WIDE_BITS,
    block_rows: int = BLOCK_ROWS,
    wide: int = 0,
    checked: bool = True,
):  # type: ignore[no-untyped-def]
    """An intrinsic ``accumulate(rows, row_bytes, scales, zeros, scale_row_bytes, group,
    c0, c1, s, at, partial, i, count) -> finite``: ``partial[i + r, d] += s[r, at + c] *
    value_c[d]`` for ``count`` rows ``r`` (1 to ``block_rows``), every ``d`` and ``c`` from
    ``c0`` to ``c1`` in order, value ``c`` the row at ``rows + c * row_bytes``
    (:func:`_source`) of ``form``, read back in registers (:func:`values`); ``partial``'s
    width a multiple of the vectors of ``bits`` (and ``group`` of them), ``s`` and
    ``partial`` with contiguous rows.
    ``finite``: whether every value read back is (a quantized form's: its scales and zero
    points, with which no code's value overflows; ``True`` for ``FLOAT``, which the walk
    checks apart, and where not ``checked``: the values' second pass, whose first checked).

    For each ``wide`` vectors of features (four where the CPU has 32 registers, two where 16,
    then fewer for the rest), the block's partial sums stay in registers while the values go
    by, each ``llvm.fmuladd`` (fused where the CPU has FMA), the order and rounding of ``a +=
    p * x`` compiled with contraction, whatever ``wide`` and ``block_rows`` (numba's loop
    kept the sums in memory: a load and a store per multiply-add, 0.36 ms for 4 rows of 8
    heads of 1,024 values of 128, float32, against 0.19 here). Two rows of whole rows of
    values (``wide = 8``) read each value as one stream: bfloat16's values summed in 0.74 of
    the time of four rows of half rows; codes, read back twice so, in 1.4 times it. A
    quantized form's scales and zero points of a value's groups in a chunk are read back
    at once where each span of vectors is a group (one load and conversion for up to four
    groups; a group at a time, int8's sums of four rows took 8.8 ns a row of 128 values from
    L2, against 8.1)."""

    @intrinsic
    def accumulate(
        typingctx, rows, row_bytes, scales, zeros, scale_bytes, group, c0,
        c1, s, at, partial, i, count
    ):  # type: ignore[no-untyped-def]  # pragma: no cover  # fmt: skip
        dtype = partial.dtype

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            real = context.get_value_type(dtype)
            lanes = bits // dtype.bitwidth
            vector = ir.VectorType(real, lanes)
            index = ir.IntType(64)
            align = dtype.bitwidth // 8
            item = ir.Constant(index, align)

            def const(value: int) -> Any:
                return ir.Constant(index, value)

            ints = _source(context, builder, signature, args)
            source, row_bytes_, scales_, zeros_, scale_bytes_, group_ = ints[:6]
            c0_, c1_, at_, i_, count_ = ints[6], ints[7], ints[9], ints[11], ints[12]
            scores = context.make_array(signature.args[8])(context, builder, args[8])
            sums = context.make_array(signature.args[10])(context, builder, args[10])
            s_ld = builder.sdiv(builder.extract_value(scores.strides, 0), item)
            p_ld = builder.sdiv(builder.extract_value(sums.strides, 0), item)
            width = builder.extract_value(sums.shape, 1)
            fma = _fmuladd(builder, vector, dtype.bitwidth)
            zero32 = ir.Constant(ir.IntType(32), 0)
            splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
            # a quantized form's scales and zero points read back: x - x added up (NaN where
            # one was not finite), one sum for each number of groups read at once
            seen = {groups: cgutils.alloca_once_value(
                        builder, ir.Constant(ir.VectorType(ir.FloatType(), groups), None))
                    for groups in (1, 2, 4, 8)}  # fmt: skip
            # stored bits: their exponent (float8: all but the sign), the largest so far
            narrow, top = (ir.IntType(8), 0x7F) if form == E4M3 else (ir.IntType(16), 0)
            top = top or (0x7F80 if form == BF16 else 0x7C00)
            bits_ = ir.VectorType(narrow, lanes)
            largest = [cgutils.alloca_once_value(builder, ir.Constant(bits_, None))
                       for _ in range(2)]  # fmt: skip

            def scales_of(c: Any, j0: Any, groups: int) -> list[Any]:
                """Row ``c``'s scales and zero points of ``groups`` groups from group ``j0``
                read back at once, and checked (no code's value overflows finite ones;
                float8: the scale alone)."""
                scale_row = builder.mul(c, scale_bytes_)
                found = [float16(builder, load(builder, builder.add(base, scale_row),
                                               builder.mul(j0, const(2)), ir.IntType(16), groups))
                         for base in (scales_, zeros_)]  # fmt: skip
                odd = [builder.fsub(x, x) for x in found[: 1 if form == E4M3 else 2]]
                odd = odd[0] if len(odd) == 1 else builder.fadd(*odd)
                builder.store(builder.fadd(builder.load(seen[groups]), odd), seen[groups])
                return found

            def check_bits(row: Any, e: Any, h: int) -> None:
                # a value is not finite where its exponent bits are all set (float8: NaN)
                width = narrow.width // 8
                raw = load(builder, row, builder.mul(e, const(width)), narrow, lanes)
                masked = builder.and_(raw, ir.Constant(bits_, [top] * lanes))
                slot = largest[h % 2]  # (two chains: few registers held)
                older = builder.load(slot)
                higher = builder.icmp_unsigned(">", masked, older)
                builder.store(builder.select(higher, masked, older), slot)

            def vector_at(base: Any, offset: Any) -> Any:
                return builder.bitcast(builder.gep(base, [offset]), vector.as_pointer())

            vectors = wide or (4 if bits == 512 else 2)  # vectors of a row of sums
            held: list[list[Any]] = []  # a block's rows of sums (:func:`emit`'s)

            def accumulate_rows(d0: Any, count: int, span: int, run: bool = False) -> None:
                """The values ``[c0, c1)``'s ``count`` vectors from feature ``d0``, each
                ``span`` of them under one scale (a quantized form's group); ``run``:
                each span a group, the groups' scales read back at once."""
                firsts = [builder.add(d0, const(h * lanes)) for h in range(count)]
                groups = [builder.sdiv(e, group_) if _quantized(form) and h % span == 0 else None
                          for h, e in enumerate(firsts)]  # fmt: skip
                with cgutils.for_range_slice(builder, c0_, c1_, const(1), index) as (c, _):
                    row = builder.add(source, builder.mul(c, row_bytes_))
                    xs, step_, low = [], None, None
                    if _quantized(form) and run:  # the groups' scales at once
                        found = scales_of(c, groups[0], count // span)
                    for h, e in enumerate(firsts):
                        if _quantized(form) and h % span == 0:
                            if not run:
                                found = scales_of(c, groups[h], 1)
                            at = h // span if run else 0
                            step_, low = (_lane(builder, x, at, lanes) for x in found)
                        if form == FLOAT:
                            xs.append(load(builder, row, builder.mul(e, item), real, lanes))
                        else:
                            xs.append(values(builder, form, row, e, lanes, step_, low))
                            if form in (BF16, F16, E4M3) and checked:
                                check_bits(row, e, h)
                    for r, slots in enumerate(held):
                        here = builder.add(builder.mul(const(r), s_ld), builder.add(at_, c))
                        p = builder.load(builder.gep(scores.data, [here]), align=align)
                        p = builder.insert_element(ir.Constant(vector, ir.Undefined), p, zero32)
                        p = builder.shuffle_vector(p, ir.Constant(vector, ir.Undefined), splat)
                        for x, slot in zip(xs, slots[:count], strict=True):
                            builder.store(builder.call(fma, [p, x, builder.load(slot)]), slot)

            def chunk(d0: Any, count: int) -> None:
                """Features ``[d0, d0 + count vectors)``: the sums loaded, the values added,
                the sums stored (and checked)."""
                rows_ = [builder.mul(builder.add(i_, const(r)), p_ld) for r in range(len(held))]
                for r, slots in enumerate(held):
                    for h, slot in enumerate(slots[:count]):
                        at_d = builder.add(builder.add(rows_[r], d0), const(h * lanes))
                        builder.store(builder.load(vector_at(sums.data, at_d), align=align), slot)
                spans = [k for k in (4, 2) if k <= count] if _quantized(form) else []

                def runs(span: int) -> None:
                    # the span's groups one after another where a group is a span (or the
                    # chunk one span: one group), else each span's scale read apart
                    if span == count:
                        accumulate_rows(d0, count, span, run=True)
                        return
                    whole = builder.icmp_signed("==", group_, const(span * lanes))
                    with builder.if_else(whole) as (yes, no):
                        with yes:
                            accumulate_rows(d0, count, span, run=True)
                        with no:
                            accumulate_rows(d0, count, span)

                def by_span(spans: list[int]) -> None:
                    # vectors under one scale: the most the group's width holds
                    if not spans:
                        if _quantized(form):
                            runs(1)
                        else:
                            accumulate_rows(d0, count, 1)
                        return
                    whole = builder.srem(group_, const(spans[0] * lanes))
                    with builder.if_else(builder.icmp_signed("==", whole, const(0))) as (
                        yes,
                        no,
                    ):
                        with yes:
                            runs(spans[0])
                        with no:
                            by_span(spans[1:])

                by_span(spans)
                for r, slots in enumerate(held):
                    for h, slot in enumerate(slots[:count]):
                        at_d = builder.add(builder.add(rows_[r], d0), const(h * lanes))
                        builder.store(builder.load(slot), vector_at(sums.data, at_d), align=align)

            def emit(block_rows: int) -> None:
                """The sums of ``block_rows`` rows: chunks of ``vectors``, then of fewer
                (four, two, one) for the rest of the row."""
                held[:] = [[cgutils.alloca_once(builder, vector) for _ in range(vectors)]
                           for _ in range(block_rows)]  # fmt: skip
                start = const(0)
                for count in sorted({vectors, min(vectors, 4), min(vectors, 2), 1}, reverse=True):
                    step = const(count * lanes)
                    end = builder.add(
                        start, builder.mul(builder.sdiv(builder.sub(width, start), step), step)
                    )
                    with cgutils.for_range_slice(builder, start, end, step, index) as (d0, _):
                        chunk(d0, count)
                    start = end

            _cases(builder, count_, range(block_rows, 0, -1), emit)
            tops = ir.Constant(bits_, [top] * lanes)
            flags = [builder.icmp_unsigned("==", builder.load(slot), tops) for slot in largest]
            odd = builder.bitcast(builder.or_(*flags), ir.IntType(lanes))
            fine = builder.icmp_unsigned("==", odd, ir.Constant(ir.IntType(lanes), 0))
            for groups, slot in seen.items():
                sums_ = builder.load(slot)
                total = builder.extract_element(sums_, zero32)
                for lane in range(1, groups):
                    lane_ = builder.extract_element(sums_, ir.Constant(ir.IntType(32), lane))
                    total = builder.fadd(total, lane_)
                fine = builder.and_(fine, builder.fcmp_ordered("ord", total, total))
            return fine

        signature = types.boolean(
            rows, row_bytes, scales, zeros, scale_bytes, group, c0, c1, s, at, partial, i, count
        )
        return signature, codegen

    return accumulate
