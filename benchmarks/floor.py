"""Where the forward pass's time goes, and the floor under it on this machine's BLAS.

    python benchmarks/floor.py            # results in benchmarks/results/floor.*
    python benchmarks/floor.py --quick    # fewer repeats

Three measurements, each in one process, interleaved, medians:

1. **Passes over one tile** (one core): every step the kernel makes on a tile of scores of
   the default scratch's size (d_k = 64: 1437 x 512 in float32, 872 x 512 in float64): the
   two GEMMs,
   NumPy's four softmax passes and the compiled step that replaces them, and the same GEMMs
   in torch (its BLAS) for comparison.
2. **The floor of each shape** (S1-S4, both dtypes): mha's forward pass (the whole layer and
   the attention core), the same with the softmax step made free (the kernel's GEMMs, copies
   and Python alone: no implementation on NumPy's BLAS and this tiling goes below it), and
   torch's layer and SDPA. ``floor / torch`` above a target says that no change to the
   softmax can reach it here.
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
from mha._kernel import compiled, forward
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
    """ns per score of each step on one tile, one core."""
    return [row for dtype in (np.float32, np.float64) for row in _tile(dtype, torch, repeats)]


def _tile(dtype: Any, torch: Any, repeats: int) -> list[dict[str, Any]]:
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    d = 64
    tiles = forward.plan_tiles(4096, 4096, 1, d, d, np.dtype(dtype).itemsize,
                               forward.DEFAULT_MAX_MEMORY)  # fmt: skip
    R, w = tiles.rows, tiles.cols
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
        rows.append({"dtype": np.dtype(dtype).name, "rows": R, "keys": w, "d_k": d,
                     "step": name, "seconds": seconds,
                     "ns_per_score": seconds / (R * w) * 1e9})  # fmt: skip
    return rows


def _free_softmax(s: np.ndarray, band: Any, m: np.ndarray, ref: np.ndarray, total: np.ndarray,
                  alpha: np.ndarray, first: bool) -> None:  # fmt: skip
    """The softmax step at no cost: what the rest of the kernel takes without it."""
    if first:
        m.fill(0.0)
        total.fill(1.0)
    alpha.fill(1.0)


def _without_softmax(function: Any) -> Any:
    """``function`` run with the kernel's softmax step made free."""
    available, step = compiled.available, compiled.softmax_step

    def run() -> Any:
        compiled.available = lambda: True  # type: ignore[assignment]
        compiled.softmax_step = _free_softmax  # type: ignore[assignment]
        try:
            return function()
        finally:
            compiled.available, compiled.softmax_step = available, step

    return run


def shapes(torch: Any, repeats: int) -> list[dict[str, Any]]:
    return [_shape(s, dtype, torch, repeats) for dtype in (np.float32, np.float64) for s in SHAPES]


def _shape(shape: Any, dtype: Any, torch: Any, repeats: int) -> dict[str, Any]:
    case = Case(shape, dtype, torch)
    functions = {"mha": case.mha, "mha core": case.mha_core,
                 "floor": _without_softmax(case.mha),
                 "floor core": _without_softmax(case.mha_core)}  # fmt: skip
    if torch is not None:
        functions["torch"] = case.torch_mha
        functions["torch (fast path off)"] = lambda: case.torch_mha(fast_path=False)
        functions["torch core"] = case.torch_core
    times = interleaved_medians(functions, repeats, pause=0.2)
    s = {name: statistics.median(t) for name, t in times.items()}
    if torch is not None:
        s["torch"] = min(s["torch"], s.pop("torch (fast path off)"))
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
            "| dtype | tile | step | ns per score |",
            "|---|---|---|---:|",
        ]
        for row in results["passes"]:
            lines.append(f"| {row['dtype']} | {row['rows']} x {row['keys']} | {row['step']} "
                         f"| {row['ns_per_score']:.2f} |")  # fmt: skip
        lines += [
            "",
            'Forward pass, ms (medians of interleaved runs). "floor": mha with its softmax step '
            "made free (its GEMMs, copies and Python alone).",
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
    results = {
        "environment": environment(torch),
        "compile_seconds": compiled.compile_seconds(),
        "passes": passes(torch, 5 if args.quick else 15),
        "shapes": shapes(torch, 3 if args.quick else 7),
        "seconds": 0.0,
    }
    results["seconds"] = time.perf_counter() - started
    return finish_script(__file__, args, results, "floor", markdown)


if __name__ == "__main__":
    sys.exit(main())
