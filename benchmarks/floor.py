"""Where the forward pass's time goes, and the floor under it on this machine's BLAS.

    python benchmarks/floor.py            # results in benchmarks/results/floor.*
    python benchmarks/floor.py --quick    # fewer repeats

Three measurements, each in one process, interleaved, medians:

1. **Passes over one tile** (one core), at the two tile sizes the kernel uses (d_k = 64):
   the compiled walk's (``walk_rows`` x 512, whose scores stay in L2) and the Python walk's
   (the default scratch's: 1437 x 512 in float32, 871 x 512 in float64): the two GEMMs,
   NumPy's four softmax passes and the compiled step that replaces them, and the same GEMMs
   in torch (its BLAS). The ratio of the GEMMs says whether NumPy's BLAS runs these tiles as
   fast as torch's (the issue's "within 5%").
2. **The floor of each shape** (S1-S4, both dtypes): mha's forward pass (the whole layer and
   the attention core) and torch's layer and SDPA, beside the GEMM floor of the core: its
   visible scores times the two GEMMs' measured time per score at the compiled walk's tile,
   shared by every core. No tiling of these GEMMs on NumPy's BLAS goes below it;
   ``floor / torch`` above a target says that nothing but a faster BLAS can reach it here.
3. The machine: CPU, instruction sets, BLAS kernel, torch's CPU capability. Where the
   environment holds OpenBLAS to a kernel (``OPENBLAS_CORETYPE``, ``OPENBLAS_L2_SIZE``), it is
   all measured again in a child process without them.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import mha
from mha._kernel import compiled, forward, runtime
from mha._kernel.team import cores
from mha.cli.bench import SHAPES, Case
from mha.cli.measure import (
    environment,
    finish_script,
    interleaved_medians,
    measured_on,
    script_parser,
)

ROOT = Path(__file__).parent.parent


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
    if torch is not None:
        tq, tk, tv, ts, t_s, t_acc = (torch.from_numpy(a) for a in (q, k, v, s0, s, acc))
        steps["q @ k^T in torch"] = lambda: torch.matmul(tq, tk.transpose(1, 2), out=t_s)
        steps["p @ v in torch"] = lambda: torch.matmul(ts, tv, out=t_acc)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            times = interleaved_medians(steps, repeats, pause=0.0)
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    copy = statistics.median(times["copy (reference)"])
    rows = []
    for name, t in times.items():
        seconds = statistics.median(t) - (copy if "step" in name or name == "exp" else 0)
        rows.append({"dtype": np.dtype(dtype).name, "walk": walk, "rows": R, "keys": w,
                     "d_k": d, "step": name, "seconds": seconds,
                     "ns_per_score": seconds / (R * w) * 1e9})  # fmt: skip
    return rows


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
    times = interleaved_medians(functions, repeats, pause=0.2)
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
        lines.append("")
    return "\n".join(lines)


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
    return finish_script(__file__, args, results, "floor", markdown)


if __name__ == "__main__":
    sys.exit(main())
