"""The kernel's compiled code (numba, the optional ``fast`` extra): the tile walks and the
softmax step.

**The tile walks.** :func:`forward_walk` and :func:`backward_walk` run whole work items, every
key tile of them, without returning to Python: the GEMMs are NumPy's own BLAS's
``cblas_?gemm``, called through its address (:mod:`.blas`), and the rest is compiled loops
(:mod:`._numba_walk`; a decoding step's few rows: its products too, reading each key and
value once, :mod:`._numba_pool`). The keys and values are arrays or a paged cache's blocks.
Their arguments come grouped as numba tuples (:func:`_signatures`): the work, the operands
(the keys and the values each a pool of blocks), the outputs, the band, the sizes and the
scratch. They take the calls whose hidden keys a band can say (the causal mask, the window,
the lengths, a cache's alignment: :mod:`.geometry`), chunks, a ``mask_mod`` through its
block map (the masks of its partial blocks kept from one evaluation), and soft-capping and
ALiBi computed in their score loop (sinks are added after, as everywhere), in float32 or
float64, at every size (:func:`.walk.choose` picks them): with them a call costs tens of
microseconds of Python, not a few per tile. The forward also reads keys and values stored
narrower under float32 queries (bfloat16, float16, a quantized cache's codes: its
signature for their bytes, :func:`stored_forward_walk`, :mod:`._numba_stored`). Every other
call (boolean masks, bias, sink tokens, symmetric ALiBi, ``score_mod``, dropout, returned
weights, float16 and bfloat16 queries) walks its tiles in Python,
with the softmax step below; so do the few work items where a key some rows cannot see
holds a non-finite value (``0 * inf`` would be NaN in a GEMM). Each walk is compiled for
one signature per dtype on first use (cached on disk by numba: the first call in a process
loads it, a fraction of a second).

**A layer's small call.** :func:`layer_project` (:func:`layer_project_apart` by three
products) and :func:`layer_output`, a layer's q, k, v projection into heads and its output
product (:mod:`._numba_layer`), are compiled as the
walks are, without fastmath: NumPy's products and operations, bit for bit.

**The softmax step.** NumPy makes four passes over each tile of scores for the online
softmax: the row maximum, the subtraction, ``exp`` and the row sum, each reading (and two
writing) a tile larger than a core's L2 cache. :func:`softmax_step` does them in one sweep
per row, while the row is in L1, with an exponential of its own that the compiler
vectorises (numba's ``math.exp`` calls libm one element at a time unless Intel's SVML is
present, which pip's llvmlite lacks; this is what PyTorch's CPU kernels do with Sleef).

The exponential: ``x = n ln 2 + r`` with ``|r| <= ln 2 / 2`` (Cody and Waite's two-part
``ln 2``, so ``r`` is exact), ``exp(r)`` by its Taylor polynomial (degree 13 in float64,
7 in float32: truncation below half an ulp), and ``2^n`` built in the exponent bits. Within
1 ulp of the correctly rounded value for ``x <= 0`` down to the smallest normal result;
what would be subnormal (``x < -708`` in float64, ``-87`` in float32) is 0, a weight below
``1e-307`` of the row's largest. ``exp(-inf) = 0`` and NaN stays NaN. Arguments here are
``s - max <= 0``.

Without numba the kernel walks its tiles in Python with NumPy's passes: same results up to
rounding, tested against each other and against PyTorch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import blas, runtime

__all__ = [
    "available",
    "backward_walk",
    "compile_seconds",
    "forward_walk",
    "full_band",
    "job_wait",
    "layer_output",
    "layer_project",
    "layer_project_apart",
    "plan_walk",
    "softmax_step",
    "stored_forward_walk",
    "walk_available",
]

_STATE = runtime.DEFAULT.compiled  # what is compiled, owned by the runtime
_READY = _STATE.ready  # each walk with its GEMM's address: a decoding step's one lookup


def available() -> bool:
    """Whether the compiled steps can run: numba imports and ``MHA_COMPILED`` is not ``0``."""
    if _STATE.steps is not None:
        return True
    if _STATE.failed or os.environ.get("MHA_COMPILED", "1") == "0":
        return False
    try:
        from . import _numba_step
    except ImportError:  # numba (or llvmlite) is not installed
        _STATE.failed = True
        return False
    _STATE.steps = _numba_step
    return True


def walk_available() -> bool:
    """Whether the compiled tile walks can run: :func:`available`, and NumPy's BLAS offers
    its GEMMs to compiled code (:mod:`.blas`)."""
    if not available():
        return False
    if _STATE.walks is not None:
        return True
    if blas.gemm_addresses() is None:
        return False
    from . import _numba_walk

    _STATE.walks = _numba_walk
    return True


def job_wait() -> Callable[[np.ndarray, int], bool] | None:
    """A helper thread's wait for its next job, awake (``None`` where the compiled code
    cannot run): ``wait(signal, seen)`` watches ``signal[0]`` without the GIL for up to
    ``thresholds.helper_wait_us`` microseconds and says whether it changed from ``seen``.
    A helper asleep on a queue took 13-120 us to wake for each job (more after a pause):
    a 512-token pass of SmolLM2 hands its helper about 360 jobs, and its caller waited for
    the helper 3% of the pass. Watching for the next job 1 ms after each, the pass took
    850 ms against 921, and 963 against 1,021 in another run (interleaved, medians of 12,
    on the Zen 5 EPYC); a helper left without work sleeps after that millisecond.
    The reads per microsecond are measured once (the wait counts reads: compiled code has
    no clock)."""
    if _STATE.wait is None:
        if not available():
            return None
        from ._numba_wait import wait

        signal = np.zeros(1, np.int64)
        wait(signal, 0, 1)  # compiled (or loaded from numba's cache)
        rounds, per_us = 1 << 20, 0.0
        for _ in range(3):  # the fastest: a wait at least as long as asked
            start = time.perf_counter()
            wait(signal, 0, rounds)  # (the signal unchanged: every round read)
            per_us = max(per_us, rounds / max((time.perf_counter() - start) * 1e6, 1.0))
        _STATE.wait = (wait, per_us)
    wait, per_us = _STATE.wait

    def waited(signal: np.ndarray, seen: int) -> bool:
        rounds = int(runtime.DEFAULT.thresholds.helper_wait_us * per_us)
        return rounds > 0 and bool(wait(signal, seen, rounds))

    return waited


def _walk(name: str, dtype: np.dtype, stored: bool = False) -> Any:
    """The compiled walk ``name`` for ``dtype``, compiled (or loaded from numba's cache) for
    one signature on first use: every array in any layout, the scratch contiguous; the keys
    and values ``stored`` narrower (their bytes: :mod:`._numba_stored`) or as they are."""
    key = (name, dtype.name, stored)
    with _STATE.lock:
        if key not in _STATE.functions:
            _STATE.functions[key] = _compile_walk(name, dtype, stored)
    return _STATE.functions[key]


def _compile_walk(name: str, dtype: np.dtype, stored: bool) -> Any:
    from numba import njit

    signature = _signatures(dtype, stored)[name]
    options: dict[str, Any] = {"boundscheck": False, "nogil": True}
    if name in _LAYER:  # NumPy's bits: no operation fused or reordered
        from . import _numba_layer

        source = getattr(_numba_layer, name)
    else:
        options["fastmath"] = {"reassoc", "contract"}
        source = getattr(_STATE.walks, name)
    start = time.perf_counter()
    function = njit([signature], cache=True, **options)(source)
    read = " stored" if stored else ""
    _STATE.seconds[f"walk {name} {dtype.name}{read}"] = time.perf_counter() - start
    return function


def _signatures(dtype: np.dtype, stored: bool = False) -> dict[str, Any]:
    """The walks' signatures for ``dtype``: every array in any layout, the scratch contiguous,
    grouped in tuples as :mod:`._numba_walk` takes them; the forward's keys and values as
    their bytes when ``stored`` (:func:`.paged.stored_pool`), else arrays of ``dtype``."""
    from numba import types

    Tuple: Any = types.Tuple  # (numba ships no types: mypy sees this one as untyped)
    real = types.float32 if dtype == np.float32 else types.float64
    a = {n: types.Array(real, n, "A") for n in (3, 4)}  # outputs, in any layout
    r = {n: types.Array(real, n, "A", readonly=True) for n in (3, 4)}  # inputs
    c = {n: types.Array(real, n, "C") for n in (1, 2)}  # scratch
    a3c = types.Array(real, 3, "C")  # a layer's joined heads
    i64, f64 = types.int64, types.float64
    index, table = types.Array(i64, 1, "A"), types.Array(i64, 2, "A")
    counter, flags = types.Array(i64, 1, "C"), types.Array(types.boolean, 1, "C")
    work = Tuple((table, counter, flags))  # the tasks, the next one, those left undone
    band = Tuple((types.boolean, i64, index, index, index))  # causal, window, per sequence
    variants = Tuple(
        (
            i64,  # the chunk (0: none)
            index,  # each sequence's position of row 0, of key 0
            index,
            types.Array(real, 2, "A"),  # ALiBi's slopes (1 or B, H)
            f64,  # soft-capping's cap (0: none)
            types.Array(types.int8, 4, "A"),  # a mask_mod's block map
            types.Array(types.int32, 4, "A"),  # its partial blocks' masks
            types.Array(types.boolean, 3, "A"),
        )
    )
    bits = types.Array(types.uint16, 4, "A", readonly=True)  # float16 as bits: none in numba
    residual = types.Array(types.float32, 4, "A", readonly=True)  # KIVI's unfilled groups
    form = Tuple((i64, i64, i64, residual, index, index))  # kind, group, d, rows, at, sealed
    data = types.Array(types.uint8, 4, "A", readonly=True) if stored else r[4]
    pool = Tuple((data, table, i64, bits, bits, form))  # data, table, block, scales, zeros
    forward_scratch = (c[2], c[1], c[2], c[2], c[1], c[1], c[1], c[2], c[2], c[2])
    given = {n: types.Array(real, n, "C", readonly=True) for n in (1, 2)}  # x, weights, bias
    heads = Tuple((types.Array(real, 4, "C"),) * 3)  # q, k, v
    backward_scratch = (c[2], c[2], c[1], c[1], c[2], c[2], c[2], c[2])
    return {
        "plan": table(i64, i64, i64, i64, band, variants, i64),
        "forward": types.void(
            i64,  # the GEMM's address
            work,
            Tuple((r[4], pool, pool)),  # q, keys, values
            Tuple((a[4], a[3], a[4], a[3])),  # out, lse, the split keys' out and lse
            band,
            variants,
            Tuple((f64, i64, i64, i64)),  # scale, cols, flip_below, chunk
            Tuple(forward_scratch),
        ),
        "project": types.void(
            i64, given[2], given[2], given[1], types.boolean, real, heads, a3c, c[2]
        ),
        "project_apart": types.void(
            i64, given[2], *(given[2],) * 3, *(given[1],) * 3, types.boolean, real, heads, a3c, c[2]
        ),
        "output": types.void(i64, given[2], given[2], given[1], c[2]),
        "backward": types.void(
            i64,
            work,
            Tuple((r[4], r[4], r[4], r[4], r[3], r[4])),  # q, k, v, out, lse, grad_out
            Tuple((a[4], a[4], a[4])),  # dq, dk, dv
            band,
            variants,
            Tuple((f64, f64, i64, i64)),  # scale, dq_scale, rows, cols
            Tuple(backward_scratch),
        ),
    }


def forward_walk(dtype: np.dtype, *args: Any) -> None:
    """:func:`mha._kernel._numba_walk.forward` for ``dtype``, with NumPy's GEMM."""
    _run_walk("forward", dtype, args)


def stored_forward_walk(dtype: np.dtype, *args: Any) -> None:
    """:func:`forward_walk` of keys and values stored narrower, as their bytes
    (:func:`.paged.stored_pool`; ``dtype`` float32)."""
    _run_walk("forward", dtype, args, True)


def layer_project(dtype: np.dtype, *args: Any) -> None:
    """:func:`mha._kernel._numba_layer.project` for ``dtype``, with NumPy's GEMM: a layer's
    small planned call's projection into heads (:mod:`mha.api.layer_plan`)."""
    _run_walk("project", dtype, args)


def layer_project_apart(dtype: np.dtype, *args: Any) -> None:
    """:func:`mha._kernel._numba_layer.project_apart` for ``dtype``, with NumPy's GEMM: that
    projection by three products, of separate ``W_q``, ``W_k`` and ``W_v``."""
    _run_walk("project_apart", dtype, args)


def layer_output(dtype: np.dtype, *args: Any) -> None:
    """:func:`mha._kernel._numba_layer.output` for ``dtype``, with NumPy's GEMM: that call's
    output product."""
    _run_walk("output", dtype, args)


_LAYER = ("project", "project_apart", "output")
"""The compiled functions of :mod:`._numba_layer` (compiled without fastmath)."""


def backward_walk(dtype: np.dtype, *args: Any) -> None:
    """:func:`mha._kernel._numba_walk.backward` for ``dtype``, with NumPy's GEMM."""
    _run_walk("backward", dtype, args)


def plan_walk(dtype: np.dtype, *args: Any) -> np.ndarray:
    """:func:`mha._kernel._numba_walk.plan`: the forward walk's tasks, longest first, for a
    call of ``dtype`` (whose variants hold ALiBi's slopes in it)."""
    function = _READY.get(("plan", dtype))
    if function is None:
        function = _READY["plan", dtype] = (_walk("plan", dtype), ())
    table: np.ndarray = function[0](*args)
    return table


def _run_walk(name: str, dtype: np.dtype, args: tuple[Any, ...], stored: bool = False) -> None:
    """Call the walk ``name`` for ``dtype``. The first call goes through numba's dispatcher,
    which checks every argument against the one signature compiled (:func:`_signatures`);
    the next ones call that signature's compiled entry point directly, a microsecond and a
    half less per call (the dispatcher types the nested tuples afresh each time). The
    arguments are built the same way on every call (:mod:`.walk`): the same tuples, arrays
    of the same ranks, the dtype the walk is chosen for (an array of another dtype is
    refused by the entry point too)."""
    ready = _READY.get((name, dtype, stored))  # a decoding step's call: one lookup
    if ready is None:
        gemm = blas.gemm_addresses()
        assert gemm is not None
        function, addresses = _walk(name, dtype, stored), (gemm[dtype.name],)
        function(*addresses, *args)  # checked by the dispatcher
        (signature,) = function.signatures
        _READY[name, dtype, stored] = (function.overloads[signature].entry_point, addresses)
        return
    function, addresses = ready
    function(*addresses, *args)


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
    kernel = getattr(_STATE.steps, name)
    key = f"{name} {args[0].dtype.name}"
    if key not in _STATE.seconds:  # the first call compiles (or loads numba's disk cache)
        start = time.perf_counter()
        kernel(*args)
        _STATE.seconds[key] = time.perf_counter() - start
        return
    kernel(*args)


def compile_seconds() -> dict[str, float]:
    """Seconds the first call of each kernel and dtype took to compile or to load from
    numba's cache (on disk beside this file, or numba's user cache directory)."""
    return dict(_STATE.seconds)
