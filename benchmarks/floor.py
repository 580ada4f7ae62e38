"""Where the forward pass's time goes, and the floor under it on this machine's BLAS.

    python benchmarks/floor.py            # results in benchmarks/results/floor.* (and
                                          # floor-<cpu>.*: one table per CPU)
    python benchmarks/floor.py --quick    # fewer repeats

Three measurements, each in one process, interleaved, medians:

1. **Passes over one tile** (one core), at the two tile sizes the kernel uses (d_k = 64):
   the compiled walk's (``walk_rows`` x 512, whose scores stay in L2) and the Python walk's
   (the default scratch's: 1437 x 512 in float32, 871 x 512 in float64): the two GEMMs,
   NumPy's four softmax passes and the compiled step that replaces them, and the same GEMMs
   in torch (its BLAS). The ratio of the GEMMs says whether NumPy's BLAS runs these tiles as
   fast as torch's (the issue's "within 5%"). Torch's ``matmul`` pays its dispatcher on
   every call; so both BLASes are also called at their own entry points through ctypes,
   alike (:func:`direct_gemms`): NumPy's OpenBLAS where mha's compiled walk calls it, and
   torch's BLAS (MKL's ``sgemm_``, which ``libtorch_cpu`` exports and torch's CPU kernels,
   its SDPA's among them, call), with a 1 x 1 x 1 product through each for what a call
   costs beside its work.
2. **The floor of each shape** (S1-S4, both dtypes): mha's forward pass (the whole layer and
   the attention core) and torch's layer and SDPA, each timed call after untimed ones for
   ``WARM`` seconds as in the README's speed table, beside the GEMM floor of the core: its
   visible scores times the two GEMMs' measured time per score at the compiled walk's tile,
   shared by every core. No tiling of these GEMMs on NumPy's BLAS goes below it;
   ``floor / torch`` above a target says that nothing but a faster BLAS can reach it here;
   the same floor with torch's BLAS at its entry point says what the BLAS alone accounts
   for (issue 35's "where a row misses because of the BLAS, the GEMM floor beside it").
3. The machine: CPU, instruction sets, BLAS kernel, torch's CPU capability. Where the
   environment holds OpenBLAS to a kernel (``OPENBLAS_CORETYPE``, ``OPENBLAS_L2_SIZE``), it is
   all measured again in a child process without them.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import mha
from mha._kernel import blas, compiled, forward, runtime
from mha._kernel.team import cores
from mha.cli.bench import SHAPES, Case
from mha.cli.measure import (
    WARM,
    environment,
    finish_script,
    interleaved_medians,
    keep_per_cpu,
    measured_on,
    script_parser,
)

ROOT = Path(__file__).parent.parent


Gemm = Callable[..., None]
"""``gemm(transb, M, N, K, A, lda, B, ldb, C, ldc)``: the row-major ``C = A op(B)`` (``op``
the transpose when ``transb``) of the matrices at the addresses ``A``, ``B``, ``C``."""


def direct_gemms(torch: Any, dtype: Any) -> dict[str, Gemm]:
    """Each BLAS's GEMM for ``dtype`` at its own C entry point, through ctypes: NumPy's
    OpenBLAS by its 64-bit CBLAS (the function mha's compiled walk calls) and torch's BLAS
    by the Fortran ``sgemm_``/``dgemm_`` its ``libtorch_cpu`` exports (MKL's in the x86
    wheels; what ``cpublas::gemm`` and so torch's SDPA call). The same kind of Python and
    ctypes call for both, none of torch's dispatcher (what a call costs beside its work, a
    1 x 1 x 1 product timed as the tiles' are, is in the table). Either is left out where it
    cannot be found."""
    letter = "s" if np.dtype(dtype) == np.float32 else "d"
    real = ctypes.c_float if letter == "s" else ctypes.c_double
    found: dict[str, Gemm] = {}
    addresses = blas.gemm_addresses()
    if addresses is not None:
        i32, i64, p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        cblas = ctypes.CFUNCTYPE(None, i32, i32, i32, i64, i64, i64, real, p, i64, p, i64,
                                 real, p, i64)(addresses[np.dtype(dtype).name])  # fmt: skip

        def openblas(transb: bool, M: int, N: int, K: int, A: int, lda: int, B: int,
                     ldb: int, C: int, ldc: int) -> None:  # fmt: skip
            cblas(101, 111, 112 if transb else 111, M, N, K, 1.0, A, lda, B, ldb, 0.0, C, ldc)

        found["OpenBLAS"] = openblas
    fortran = _torchs_function(torch, f"{letter}gemm_")
    if fortran is not None:
        fortran.argtypes, fortran.restype = [ctypes.c_void_p] * 13, None
        by = ctypes.byref
        kept: dict[tuple[Any, ...], list[Any]] = {}  # (the arguments' ctypes, made once)

        def torchs(transb: bool, M: int, N: int, K: int, A: int, lda: int, B: int,
                   ldb: int, C: int, ldc: int) -> None:  # fmt: skip
            # column-major C^T = op(B)^T A^T: the row-major C = A op(B)
            key = (transb, M, N, K, lda, ldb, ldc)
            if key not in kept:
                i32 = ctypes.c_int32
                values: list[Any] = [ctypes.c_char(b"T" if transb else b"N"), ctypes.c_char(b"N"),
                                     i32(N), i32(M), i32(K), real(1.0), i32(ldb), i32(lda),
                                     real(0.0), i32(ldc)]  # fmt: skip
                kept[key] = [values, [by(x) for x in values]]
            a = kept[key][1]
            fortran(a[0], a[1], a[2], a[3], a[4], a[5], B, a[6], A, a[7], a[8], C, a[9])

        mkl = torch.backends.mkl.is_available()
        found["torch's MKL" if mkl else "torch's BLAS"] = torchs
    return found


def passes(torch: Any, repeats: int) -> list[dict[str, Any]]:
    """ns per score of each step on one tile, one core, at both walks' tile sizes."""
    return [
        row
        for dtype in (np.float32, np.float64)
        for walk in ("compiled walk", "Python walk")
        for row in _tile(dtype, torch, repeats, walk)
    ]


def _tile(dtype: Any, torch: Any, repeats: int, walk: str) -> list[dict[str, Any]]:
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    d = 64
    tiles = forward.plan_tiles(4096, 4096, 1, d, d, np.dtype(dtype).itemsize,
                               forward.DEFAULT_MAX_MEMORY)  # fmt: skip
    R, w = tiles.rows, tiles.cols
    if walk == "compiled walk":
        R = min(R, runtime.DEFAULT.thresholds.walk_rows)
    q = rng.standard_normal((1, R, d)).astype(dtype)
    k, v = (rng.standard_normal((1, w, d)).astype(dtype) for _ in range(2))
    s0 = (q @ k.transpose(0, 2, 1)) / 8.0
    s, acc = np.empty_like(s0), np.empty((1, R, d), dtype)
    state = [np.zeros((1, R), dtype) for _ in range(5)]

    def fresh() -> np.ndarray:
        np.copyto(s, s0)
        return s

    steps = {
        "q @ k^T (GEMM)": lambda: np.matmul(q, k.transpose(0, 2, 1), out=s),
        "p @ v (GEMM)": lambda: np.matmul(s0, v, out=acc),
        "copy (reference)": fresh,
        "max": lambda: s0.max(axis=-1),
        "subtract": lambda: np.subtract(s0, state[0][..., None], out=s),
        "exp": lambda: np.exp(fresh(), out=s),
        "sum": lambda: s0.sum(axis=-1),
        "NumPy softmax step (4 passes)": lambda: forward._softmax_step(fresh(), None, *state, True),
    }
    if compiled.available():
        band = compiled.full_band(R, w)
        steps["compiled softmax step"] = lambda: compiled.softmax_step(
            fresh(), band, *state[:2], *state[3:], True
        )
    at = {name: a.ctypes.data for name, a in (("q", q), ("k", k), ("v", v), ("s0", s0),
                                               ("s", s), ("acc", acc))}  # fmt: skip
    one = np.ones(3, dtype)  # (a 1 x 1 x 1 product: what a call costs beside its work)
    for name, gemm in direct_gemms(torch, dtype).items():
        steps[f"q @ k^T, {name} at its entry"] = lambda g=gemm: g(
            True, R, w, d, at["q"], d, at["k"], d, at["s"], w
        )
        steps[f"p @ v, {name} at its entry"] = lambda g=gemm: g(
            False, R, d, w, at["s0"], w, at["v"], d, at["acc"], d
        )
        steps[f"a 1 x 1 x 1 call, {name}"] = lambda g=gemm: g(
            False, 1, 1, 1, one.ctypes.data, 1, one.ctypes.data, 1, one[2:].ctypes.data, 1
        )
    if torch is not None:
        tq, tk, tv, ts, t_s, t_acc = (torch.from_numpy(a) for a in (q, k, v, s0, s, acc))
        steps["q @ k^T in torch"] = lambda: torch.matmul(tq, tk.transpose(1, 2), out=t_s)
        steps["p @ v in torch"] = lambda: torch.matmul(ts, tv, out=t_acc)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            times = interleaved_medians(steps, repeats, pause=0.0)
            blas_threads = torch_blas_threads(torch)  # (torch's MKL: threadpoolctl sees none)
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    copy = statistics.median(times["copy (reference)"])
    rows = []
    for name, t in times.items():
        seconds = statistics.median(t) - (copy if "step" in name or name == "exp" else 0)
        rows.append({"dtype": np.dtype(dtype).name, "walk": walk, "rows": R, "keys": w,
                     "d_k": d, "step": name, "seconds": seconds,
                     "ns_per_score": seconds / (R * w) * 1e9,
                     "torch_blas_threads": blas_threads})  # fmt: skip
    return rows


def torch_blas_threads(torch: Any) -> int | None:
    """The threads torch's MKL would use on this thread now (``mkl_get_max_threads``, which
    ``libtorch_cpu`` exports), or ``None`` where it cannot be asked."""
    ask = _torchs_function(torch, "mkl_get_max_threads")
    if ask is None:
        return None
    ask.restype = ctypes.c_int
    return int(ask())


def _torchs_function(torch: Any, name: str) -> Any:
    """The C function ``name`` that torch's ``libtorch_cpu`` exports (its BLAS's among
    them), or ``None`` (no torch, no such library or function)."""
    if torch is None:
        return None
    libraries = sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
    try:
        return getattr(ctypes.CDLL(str(libraries[0])), name)
    except (IndexError, OSError, AttributeError):
        return None


def shapes(torch: Any, repeats: int, tile: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        _shape(s, dtype, torch, repeats, tile) for dtype in (np.float32, np.float64) for s in SHAPES
    ]


def _shape(shape: Any, dtype: Any, torch: Any, repeats: int, tile: list[dict[str, Any]]) -> dict:
    case = Case(shape, dtype, torch)
    functions = {"mha": case.mha, "mha core": case.mha_core}
    if torch is not None:
        functions["torch"] = case.torch_mha
        functions["torch (fast path off)"] = lambda: case.torch_mha(fast_path=False)
        functions["torch core"] = case.torch_core
    times = interleaved_medians(functions, repeats, pause=0.2, warm=WARM)  # (as the speed table)
    s = {name: statistics.median(t) for name, t in times.items()}
    if torch is not None:
        s["torch"] = min(s["torch"], s.pop("torch (fast path off)"))
    gemm = sum(  # the two GEMMs' seconds per score on one core, at the compiled walk's tile
        r["ns_per_score"] * 1e-9 for r in tile
        if r["dtype"] == np.dtype(dtype).name and r["walk"] == "compiled walk"
        and r["step"] in ("q @ k^T (GEMM)", "p @ v (GEMM)")
    )  # fmt: skip
    pairs = shape.L * (shape.L + 1) / 2 if shape.causal else shape.L * shape.L
    scores = shape.B * shape.H * pairs
    s["floor core"] = gemm * scores / cores()
    s["floor"] = s["mha"] - s["mha core"] + s["floor core"]  # the projections as measured
    for r in tile:  # the same floor by each BLAS called at its entry point (direct_gemms)
        if r["dtype"] == np.dtype(dtype).name and r["walk"] == "compiled walk":
            name = r["step"].partition(", ")[2]
            if name.endswith(" at its entry"):
                key = f"floor core, {name}"
                s[key] = s.get(key, 0.0) + r["ns_per_score"] * 1e-9 * scores / cores()
    row = {"shape": shape.name, "causal": shape.causal, "B": shape.B, "L": shape.L,
           "d_model": shape.d_model, "H": shape.H, "dtype": np.dtype(dtype).name,
           "seconds": s, "all_seconds": times}  # fmt: skip
    ms = {name: round(t * 1e3, 1) for name, t in s.items()}
    print(shape.name, row["dtype"], ms, file=sys.stderr, flush=True)
    return row


def markdown(runs: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    for results in runs:
        lines += [
            measured_on(results["environment"]),
            "",
            "Passes over one tile of scores (d_k = 64, one core), ns per score:",
            "",
            "| dtype | walk | tile | step | ns per score |",
            "|---|---|---|---|---:|",
        ]
        for row in results["passes"]:
            lines.append(f"| {row['dtype']} | {row['walk']} | {row['rows']} x {row['keys']} "
                         f"| {row['step']} | {row['ns_per_score']:.2f} |")  # fmt: skip
        lines += ["", "NumPy's tile GEMMs against torch's (time ratio; 1.05 is 5% slower):", ""]
        for dtype in ("float32", "float64"):
            for walk in ("compiled walk", "Python walk"):
                t = {r["step"]: r["ns_per_score"] for r in results["passes"]
                     if r["dtype"] == dtype and r["walk"] == walk}  # fmt: skip
                if "q @ k^T in torch" in t:
                    lines.append(
                        f"- {dtype}, {walk}'s tile: q @ k^T "
                        f"{t['q @ k^T (GEMM)'] / t['q @ k^T in torch']:.2f}, p @ v "
                        f"{t['p @ v (GEMM)'] / t['p @ v in torch']:.2f}"
                    )
                ours, theirs = "OpenBLAS at its entry", _torchs(t)
                if theirs is not None and f"q @ k^T, {ours}" in t:
                    both = (t[f"q @ k^T, {ours}"] + t[f"p @ v, {ours}"]) / (
                        t[f"q @ k^T, {theirs}"] + t[f"p @ v, {theirs}"]
                    )
                    threads = next(r["torch_blas_threads"] for r in results["passes"]
                                   if r["dtype"] == dtype)  # fmt: skip
                    name = theirs.removesuffix(" at its entry")
                    lines.append(
                        f"- {dtype}, {walk}'s tile, each BLAS at its entry (NumPy's OpenBLAS "
                        f"against {name}, on {threads} thread(s)): q @ k^T "
                        f"{t[f'q @ k^T, {ours}'] / t[f'q @ k^T, {theirs}']:.3f}, p @ v "
                        f"{t[f'p @ v, {ours}'] / t[f'p @ v, {theirs}']:.3f}, both {both:.3f}; "
                        f"a 1 x 1 x 1 product, timed as these are (once a round, after the "
                        f"other steps): {_call_us(results, dtype, walk, 'OpenBLAS')} and "
                        f"{_call_us(results, dtype, walk, name)} µs"
                    )
        lines += [
            "",
            'Forward pass, ms (medians of interleaved runs). "floor": the core\'s visible '
            "scores times the two GEMMs' time per score at the compiled walk's tile, on every "
            "core (with the layer's projections as measured).",
            "",
            "| shape | dtype | mha | floor | torch | mha / torch | floor / torch | core: mha "
            "| core: floor | core: torch SDPA | core mha / torch | core floor / torch |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["shapes"]:
            s = row["seconds"]
            name = f"{row['shape']}{' causal' if row['causal'] else ''}"
            if "torch" not in s:
                continue
            lines.append(
                f"| {name} | {row['dtype']} | {s['mha'] * 1e3:.1f} | {s['floor'] * 1e3:.1f} "
                f"| {s['torch'] * 1e3:.1f} | {s['mha'] / s['torch']:.2f} "
                f"| {s['floor'] / s['torch']:.2f} | {s['mha core'] * 1e3:.1f} "
                f"| {s['floor core'] * 1e3:.1f} | {s['torch core'] * 1e3:.1f} "
                f"| {s['mha core'] / s['torch core']:.2f} "
                f"| {s['floor core'] / s['torch core']:.2f} |"
            )
        lines += _by_blas(results["shapes"])
        lines.append("")
    return "\n".join(lines)


def _call_us(results: dict[str, Any], dtype: str, walk: str, name: str) -> str:
    """A 1 x 1 x 1 product's call by ``name``'s wrapper, in µs (what each tile product's
    time holds beside its work)."""
    step = f"a 1 x 1 x 1 call, {name}"
    found = [r["seconds"] for r in results["passes"]
             if r["dtype"] == dtype and r["walk"] == walk and r["step"] == step]  # fmt: skip
    return f"{found[0] * 1e6:.1f}" if found else "?"


def _torchs(t: dict[str, Any]) -> str | None:
    """The name torch's BLAS at its entry point has among ``t``'s keys, if any."""
    return next((k.partition(", ")[2] for k in t if k.startswith("q @ k^T, torch's")), None)


def _by_blas(shapes: list[dict[str, Any]]) -> list[str]:
    """The core's GEMM floor with each BLAS at its entry point, against torch's SDPA."""
    rows = [r for r in shapes if "torch core" in r["seconds"]]
    theirs = next((k for r in rows for k in r["seconds"] if k.startswith("floor core, torch's")),
                  None)  # fmt: skip
    ours = "floor core, OpenBLAS at its entry"
    if theirs is None or not rows or ours not in rows[0]["seconds"]:
        return []
    name = theirs.partition(", ")[2].removesuffix(" at its entry")
    lines = [
        "",
        "The core's GEMM floor with each BLAS called at its entry point, against torch's "
        "SDPA: extrapolated from the compiled walk's 256 x 512 tile (the two products' time "
        "per score there on one core, times the shape's visible scores, shared by every core; "
        "S3's tiles are 128 x 128 and S4's diagonal ones partly hidden, which it does not "
        f"measure). {name} is what torch's kernels call:",
        "",
        "| shape | dtype | core: mha / torch SDPA | floor, OpenBLAS / torch SDPA | floor, "
        f"{name} / torch SDPA |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        s = row["seconds"]
        shape = f"{row['shape']}{' causal' if row['causal'] else ''}"
        lines.append(
            f"| {shape} | {row['dtype']} | {s['mha core'] / s['torch core']:.3f} "
            f"| {s[ours] / s['torch core']:.3f} | {s[theirs] / s['torch core']:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = script_parser(__doc__, ROOT / "benchmarks" / "results").parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    else:
        torch.set_num_threads(cores())
    mha.scaled_dot_product_attention(*np.ones((3, 1, 8, 4), np.float32))  # compile first
    mha.scaled_dot_product_attention(*np.ones((3, 1, 8, 4)))
    started = time.perf_counter()
    tile = passes(torch, 5 if args.quick else 15)
    results = {
        "environment": environment(torch),
        "compile_seconds": compiled.compile_seconds(),
        "passes": tile,
        "shapes": shapes(torch, 3 if args.quick else 7, tile),
        "seconds": 0.0,
    }
    results["seconds"] = time.perf_counter() - started
    status = finish_script(__file__, args, results, "floor", markdown)
    if status == 0 and not args.json_only and not args.quick:
        keep_per_cpu(args.output, "floor")  # one table per CPU
    return status


if __name__ == "__main__":
    sys.exit(main())
