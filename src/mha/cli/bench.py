"""Speed and memory, measured: mha beside the textbook NumPy version and PyTorch.

    python -m mha.cli.bench                         # everything, results under benchmarks/results
    python -m mha.cli.bench --quick                 # fewer repeats, no 32768-token memory run
    python -m mha.cli.bench --smoke                 # tiny sizes in seconds: checks the set-up

Speed: each shape runs every implementation in one process, interleaved (the order rotates
every round), and reports medians, GFLOP/s (useful FLOPs: projections plus the visible
query-key pairs), the share of this machine's square-matmul rate, and ratios. Memory: the
peak traced by ``tracemalloc`` during one call, inputs already allocated, beside the size
of the dense score matrix. torch and threadpoolctl are used when installed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._files import writable_problem
from .._kernel import compiled
from .._kernel.team import cores
from ..api.function import multi_head_attention
from ..api.split_heads import scaled_dot_product_attention
from ._common import UsageError, needs
from .measure import (
    WARM,
    check_readme,
    environment,
    interleaved_medians,
    keep_per_cpu,
    machine_memory,
    matmul_ceiling,
    measured_on,
    peak_traced_bytes,
    runs_with_free_blas,
    splice,
    write,
)


@dataclass(frozen=True)
class Shape:
    name: str
    B: int
    L: int
    d_model: int
    H: int
    causal: bool

    def flops(self) -> float:
        """Useful multiply-adds x 2: four projections and the visible query-key pairs."""
        pairs = self.L * (self.L + 1) / 2 if self.causal else self.L * self.L
        d_k = self.d_model // self.H
        return 8.0 * self.B * self.L * self.d_model**2 + 4.0 * self.B * self.H * pairs * d_k


SHAPES = [
    Shape("S1", B=8, L=512, d_model=512, H=8, causal=False),
    Shape("S2", B=1, L=2048, d_model=768, H=12, causal=False),
    Shape("S3", B=32, L=128, d_model=256, H=4, causal=False),
    Shape("S4", B=1, L=4096, d_model=512, H=8, causal=True),
]
MEMORY_LENGTHS = [1024, 4096, 16384, 32768]
TEXTBOOK_MEMORY_LENGTHS = [1024, 2048, 4096]
SWEEP_LENGTHS = [256, 512, 1024, 2048, 4096]  # causal, B=1, d_model=512, 8 heads, float32
EXTRAPOLATE_FROM = 1024
"""The longest textbook run must reach this length before a memory limit is extrapolated."""
BEGIN, END = "<!-- benchmark: begin -->", "<!-- benchmark: end -->"


@dataclass(frozen=True)
class Plan:
    """What a benchmark run measures."""

    shapes: list[Shape]
    sweep: list[int]  # causal lengths timed for the chart
    memory: list[int]  # lengths at which mha's peak memory is traced
    textbook_memory: list[int]  # lengths at which the textbook version's is traced
    repeats: int
    pause: float  # seconds between timed calls
    size: str  # what made it: plan(size)
    warm: float = 0.0  # seconds of untimed calls before each timed one (measure.WARM)

    def arguments(self) -> list[str]:
        """The command-line arguments that make this plan (for the free-BLAS child)."""
        return [
            *([f"--{self.size}"] if self.size != "full" else []),
            "--repeats",
            str(self.repeats),
        ]


def plan(size: str, repeats: int = 7) -> Plan:
    """``full`` (the README's numbers), ``quick`` or ``smoke`` (seconds, for set-up checks)."""
    if size == "smoke":
        tiny = [
            Shape("tiny", B=2, L=64, d_model=32, H=4, causal=False),
            Shape("tiny", B=1, L=128, d_model=32, H=4, causal=True),
        ]
        return Plan(tiny, [64, 128], [128, 256], [128, 256], repeats=1, pause=0.0, size=size)
    if size == "quick":
        return Plan(
            SHAPES,
            SWEEP_LENGTHS,
            [n for n in MEMORY_LENGTHS if n <= 16384],
            TEXTBOOK_MEMORY_LENGTHS,
            repeats=3,
            pause=0.3,
            size=size,
            warm=WARM,
        )
    return Plan(
        SHAPES, SWEEP_LENGTHS, MEMORY_LENGTHS, TEXTBOOK_MEMORY_LENGTHS, repeats, 0.3, "full", WARM
    )


def textbook_attention(
    X: np.ndarray, W: list[np.ndarray], b: list[np.ndarray], H: int, causal: bool
) -> np.ndarray:
    """Multi-head attention as the specification's hints describe it: materialised scores."""
    B, L, E = X.shape
    d_k = E // H

    def heads(x: np.ndarray) -> np.ndarray:
        return x.reshape(B, L, H, d_k).transpose(0, 2, 1, 3)

    q, k, v = heads(X @ W[0] + b[0]), heads(X @ W[1] + b[1]), heads(X @ W[2] + b[2])
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d_k)
    if causal:
        scores = np.where(np.triu(np.ones((L, L), dtype=bool), k=1), -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    joined = (weights @ v).transpose(0, 2, 1, 3).reshape(B, L, E)
    out: np.ndarray = joined @ W[3] + b[3]
    return out


class Case:
    """One shape in one dtype: the same inputs and weights for every implementation."""

    def __init__(self, shape: Shape, dtype: Any, torch: Any) -> None:
        rng = np.random.default_rng(0)
        E = shape.d_model
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.X = rng.standard_normal((shape.B, shape.L, E)).astype(dtype)
        bound = math.sqrt(6 / (4 * E))
        self.W = [rng.uniform(-bound, bound, (E, E)).astype(dtype) for _ in range(4)]
        self.b = [rng.uniform(-0.1, 0.1, E).astype(dtype) for _ in range(4)]
        self.torch, self.module = torch, None
        if torch is not None:
            tdtype = {np.float64: torch.float64, np.float32: torch.float32}[self.dtype.type]
            module = torch.nn.MultiheadAttention(E, shape.H, batch_first=True, dtype=tdtype)
            with torch.no_grad():
                module.in_proj_weight.copy_(torch.from_numpy(np.concatenate(self.W[:3], 1).T))
                module.in_proj_bias.copy_(torch.from_numpy(np.concatenate(self.b[:3])))
                module.out_proj.weight.copy_(torch.from_numpy(self.W[3].T))
                module.out_proj.bias.copy_(torch.from_numpy(self.b[3]))
            self.module = module.eval()
            self.X_torch = torch.from_numpy(self.X)
            L = shape.L
            self.torch_mask = (
                torch.triu(torch.ones(L, L, dtype=torch.bool), 1) if shape.causal else None
            )
        # The attention core alone, on split heads (B, H, L, d_k).
        heads = (shape.B, shape.H, shape.L, E // shape.H)
        self.heads = [rng.standard_normal(heads).astype(dtype) for _ in range(3)]
        self.heads_torch = None if torch is None else [torch.from_numpy(a) for a in self.heads]

    def mha(self) -> np.ndarray:
        (W_q, W_k, W_v, W_o), (b_q, b_k, b_v, b_o) = self.W, self.b
        out: np.ndarray = multi_head_attention(
            self.X,
            self.X,
            self.X,
            W_q,
            W_k,
            W_v,
            W_o,
            self.shape.H,
            causal=self.shape.causal,
            b_q=b_q,
            b_k=b_k,
            b_v=b_v,
            b_o=b_o,
        )
        return out

    def mha_core(self) -> np.ndarray:
        out: np.ndarray = scaled_dot_product_attention(*self.heads, causal=self.shape.causal)
        return out

    def torch_core(self) -> np.ndarray:
        assert self.heads_torch is not None
        with self.torch.inference_mode():
            out = self.torch.nn.functional.scaled_dot_product_attention(
                *self.heads_torch, is_causal=self.shape.causal
            )
        result: np.ndarray = out.numpy()
        return result

    def textbook(self) -> np.ndarray:
        return textbook_attention(self.X, self.W, self.b, self.shape.H, self.shape.causal)

    def torch_mha(self, fast_path: bool = True) -> np.ndarray:
        """``nn.MultiheadAttention`` in inference, ``need_weights=False``. With its native
        fast path on, a causal mask is applied as a materialised mask; with it off, the
        ``is_causal`` hint reaches SDPA's causal kernel. The benchmark times both."""
        assert self.module is not None
        torch = self.torch
        before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(fast_path)
        try:
            with torch.inference_mode():
                out = self.module(
                    self.X_torch,
                    self.X_torch,
                    self.X_torch,
                    attn_mask=self.torch_mask,
                    need_weights=False,
                    is_causal=self.shape.causal,
                )[0]
        finally:
            torch.backends.mha.set_fastpath_enabled(before)
        result: np.ndarray = out.numpy()
        return result

    def implementations(self, core: bool = False) -> dict[str, Callable[[], np.ndarray]]:
        found: dict[str, Callable[[], np.ndarray]] = {"mha": self.mha, "textbook": self.textbook}
        if self.module is not None:
            found["torch"] = self.torch_mha
            found["torch (fast path off)"] = lambda: self.torch_mha(fast_path=False)
        if core:
            found["mha core"] = self.mha_core
            if self.heads_torch is not None:
                found["torch core"] = self.torch_core
        return found


def speed(plan: Plan, torch: Any, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for dtype in (np.float64, np.float32):
        ceiling = matmul_ceiling(dtype, repeats=max(1, plan.repeats))
        for shape in plan.shapes:
            case = Case(shape, dtype, torch)
            functions = case.implementations(core=True)
            reference = functions["torch" if "torch" in functions else "textbook"]()
            ours = case.mha()
            error = float(np.abs(ours - reference).max() / np.abs(reference).max())
            times = interleaved_medians(functions, plan.repeats, plan.pause, plan.warm)
            medians = _best_torch({name: statistics.median(t) for name, t in times.items()})
            layer = {name: s for name, s in medians.items() if "core" not in name}
            row: dict[str, Any] = {
                "shape": shape.name,
                "dtype": np.dtype(dtype).name,
                "B": shape.B,
                "L": shape.L,
                "d_model": shape.d_model,
                "H": shape.H,
                "causal": shape.causal,
                "gflop": shape.flops() / 1e9,
                "matmul_gflops": ceiling,
                "seconds": medians,
                "all_seconds": times,
                "gflops": {n: shape.flops() / s / 1e9 for n, s in layer.items()},
                "mha_vs_textbook": medians["mha"] / medians["textbook"],
                "relative_error_vs_reference": error,
                "warm_seconds": plan.warm,
            }
            if "torch" in medians:
                row["mha_vs_torch"] = medians["mha"] / medians["torch"]
                row["core_vs_torch"] = medians["mha core"] / medians["torch core"]
            rows.append(row)
            log(_speed_line(row))
    return rows


def _best_torch(medians: dict[str, float]) -> dict[str, float]:
    """Keep both torch timings, and call the faster one "torch"."""
    if "torch" in medians:
        medians["torch (fast path on)"] = medians["torch"]
        medians["torch"] = min(medians["torch"], medians["torch (fast path off)"])
    return medians


def sweep(plan: Plan, torch: Any, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Seconds per causal call against sequence length, every implementation interleaved."""
    rows = []
    for L in plan.sweep:
        case = Case(Shape(f"L={L}", B=1, L=L, d_model=512, H=8, causal=True), np.float32, torch)
        times = interleaved_medians(case.implementations(), plan.repeats, plan.pause, plan.warm)
        seconds = _best_torch({n: statistics.median(t) for n, t in times.items()})
        row: dict[str, Any] = {"L": L, "seconds": seconds}
        rows.append(row)
        log(f"L={L}: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in row["seconds"].items()))
    return rows


def memory(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    """Causal self-attention, B=1, d_model=512, 8 heads, float32, at growing lengths."""
    E, H, itemsize = 512, 8, 4
    rows = []
    lengths = sorted(set(plan.memory) | set(plan.textbook_memory))  # mha at every length
    for L in lengths:
        shape = Shape(f"L={L}", B=1, L=L, d_model=E, H=H, causal=True)
        case = Case(shape, np.float32, None)
        row: dict[str, Any] = {
            "L": L,
            "dense_scores_bytes": H * L * L * itemsize,
            "qkv_and_output_bytes": 4 * L * E * itemsize,
        }
        row["mha_peak_bytes"], row["mha_seconds"] = peak_traced_bytes(case.mha)
        if L in plan.textbook_memory:
            row["textbook_peak_bytes"], row["textbook_seconds"] = peak_traced_bytes(case.textbook)
        rows.append(row)
        log(_memory_line(row))
    textbook = [(r["L"], r["textbook_peak_bytes"]) for r in rows if "textbook_peak_bytes" in r]
    per_square = max(peak / L**2 for L, peak in textbook)  # bytes per L^2, largest seen
    total = machine_memory()
    results: dict[str, Any] = {
        "rows": rows,
        "machine_memory_bytes": total,
        "textbook_bytes_per_L2": per_square,
    }
    # Below this length the textbook peak is mostly fixed costs, not the L^2 scores: no
    # memory limit is extrapolated from such runs (the smoke run's).
    if max(L for L, _ in textbook) >= EXTRAPOLATE_FROM:
        results["textbook_out_of_memory_at_L"] = int(math.sqrt(total / per_square))
    return results


def markdown(results: dict[str, Any]) -> str:
    """The tables the README quotes: speed as measured, speed again with OpenBLAS free to
    choose its kernel when this environment held it, then memory."""
    lines = _speed_table(results["environment"], results["speed"])
    if "free_blas" in results:
        lines += [
            "",
            *_speed_table(results["free_blas"]["environment"], results["free_blas"]["speed"]),
        ]
    lines += _memory_lines(results)
    return "\n".join(lines) + "\n"


def _speed_table(env: dict[str, Any], speed_rows: list[dict[str, Any]]) -> list[str]:
    warm = speed_rows[0].get("warm_seconds", 0.0) if speed_rows else 0.0
    lines = [
        measured_on(env)
        + "Medians of interleaved runs"
        + (f", each timed call after untimed ones for {warm:g} s" if warm else "")
        + "; ratios below 1 mean mha is faster.",
        "",
        "| shape | dtype | mha ms | torch ms | textbook ms | mha GFLOP/s | % of matmul "
        "| mha / torch | core: mha / torch SDPA | mha / textbook | floor / textbook |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in speed_rows:
        s, g = row["seconds"], row["gflops"]
        torch_ms = f"{s['torch'] * 1e3:.1f}" if "torch" in s else "n/a"
        vs_torch = f"{row['mha_vs_torch']:.2f}" if "mha_vs_torch" in row else "n/a"
        core = f"{row['core_vs_torch']:.2f}" if "core_vs_torch" in row else "n/a"
        lines.append(
            f"| {row['shape']}{' causal' if row['causal'] else ''} (B={row['B']}, L={row['L']}, "
            f"d={row['d_model']}, H={row['H']}) | {row['dtype']} | {s['mha'] * 1e3:.1f} "
            f"| {torch_ms} | {s['textbook'] * 1e3:.1f} | {g['mha']:.0f} "
            f"| {100 * g['mha'] / row['matmul_gflops']:.0f}% | {vs_torch} | {core} "
            f"| {row['mha_vs_textbook']:.2f} | {_floor(row) / s['textbook']:.2f} |"
        )
    return lines


def _memory_lines(results: dict[str, Any]) -> list[str]:
    mem = results["memory"]
    measured = max(r["L"] for r in mem["rows"] if "textbook_peak_bytes" in r)
    lines = [
        "",
        '"floor" is the time the FLOPs would take at this machine\'s square-matmul rate: '
        "no implementation on this BLAS gets below it, so floor / textbook is the best "
        "mha / textbook ratio possible in that run.",
        "",
        "Peak traced memory of one causal call (B=1, d_model=512, 8 heads, float32), inputs "
        "already allocated:",
        "",
        "| L = S | mha peak | q, k, v + output | dense scores alone | textbook peak |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in mem["rows"]:
        textbook = "not run (its scores alone are too large)"
        if "textbook_peak_bytes" in row:
            textbook = _mib(row["textbook_peak_bytes"])
        mha_peak = (
            _mib(row["mha_peak_bytes"]) if "mha_peak_bytes" in row else "not run"
        )  # older runs
        lines.append(
            f"| {row['L']} | {mha_peak} | {_mib(row['qkv_and_output_bytes'])} "
            f"| {_mib(row['dense_scores_bytes'])} | {textbook} |"
        )
    if "textbook_out_of_memory_at_L" not in mem:
        return [
            *lines,
            "",
            f"(Too short to extrapolate the textbook version's memory limit "
            f"from: that needs runs up to L = {EXTRAPOLATE_FROM}.)",
        ]
    lines += [
        "",
        f"The textbook version's peak grows as {mem['textbook_bytes_per_L2']:.0f} bytes x L^2 "
        f"here (measured up to L = {measured}), so it would run out of "
        f"this machine's {mem['machine_memory_bytes'] / 2**30:.1f} GiB at about L = "
        f"{mem['textbook_out_of_memory_at_L']:,}.",
    ]
    return lines


def steps(plan: Plan) -> int:
    """How many lines :func:`run` logs, for a progress bar."""
    lengths = set(plan.memory) | set(plan.textbook_memory)
    return 2 * len(plan.shapes) + len(plan.sweep) + len(lengths)


def run(
    plan: Plan,
    output: Path,
    readme: Path | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Measure everything, write ``benchmark.json`` and ``benchmark.md`` under ``output``
    (and the README's section; a full run's also under this CPU's name,
    :func:`.measure.keep_per_cpu`), and return the results. When this environment holds
    OpenBLAS to a kernel, ``python -m mha.cli.bench --json-only`` measures the speed table
    of the same plan again with OpenBLAS free to choose (see :func:`runs_with_free_blas`)."""
    torch: Any
    try:
        import torch
    except ImportError:
        torch = None
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(cores())
    try:
        results = {
            "environment": environment(torch),
            "speed": speed(plan, torch, log),
            "sweep": sweep(plan, torch, log),
            "memory": memory(plan, log),
        }
    finally:
        if torch is not None:  # the caller's process, as it was
            torch.set_num_threads(threads)
    results["compile_seconds"] = compiled.compile_seconds()
    command = [sys.executable, "-m", "mha.cli.bench", "--json-only", *plan.arguments()]
    runs = runs_with_free_blas(command, results)
    if len(runs) > 1:
        log("measured again with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset")
        results["free_blas"] = runs[1]
    table = markdown(results)
    output.mkdir(parents=True, exist_ok=True)
    write(output / "benchmark.json", json.dumps(results, indent=2) + "\n")
    write(output / "benchmark.md", table)
    if readme:
        splice(readme, table, BEGIN, END)
    if plan.size == "full":  # one table per CPU (mha bench and python -m mha.cli.bench alike)
        keep_per_cpu(output, "benchmark")
    return results


def speed_only(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    """The environment and the speed table, nothing else."""
    try:
        import torch
    except ImportError:
        return {"environment": environment(None), "speed": speed(plan, None, log)}
    torch.set_num_threads(cores())
    return {"environment": environment(torch), "speed": speed(plan, torch, log)}


def chart(results: dict[str, Any], path: Path) -> Path:
    """Time and peak memory against sequence length: mha beside textbook NumPy and torch."""
    from .plots import _save

    return _save(chart_figure(results), path, dpi=100)


def chart_figure(results: dict[str, Any]) -> Any:
    """:func:`chart`'s matplotlib figure."""
    from .plots import _matplotlib

    matplotlib = _matplotlib()
    figure = matplotlib.figure.Figure(figsize=(10, 4), layout="constrained")
    left, right = figure.subplots(1, 2)
    styles = {"mha": "o-", "textbook": "s--", "torch": "^:"}
    for name, style in styles.items():
        points = [(r["L"], r["seconds"][name]) for r in results["sweep"] if name in r["seconds"]]
        if points:
            left.plot(*zip(*points, strict=True), style, label=name)
    left.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length L = S",
        ylabel="seconds per call",
        title="causal, d_model 512, 8 heads, float32",
    )
    rows = results["memory"]["rows"]
    for key, label, style in (
        ("mha_peak_bytes", "mha", "o-"),
        ("textbook_peak_bytes", "textbook", "s--"),
    ):
        points = [(r["L"], r[key] / 2**20) for r in rows if key in r]
        right.plot(*zip(*points, strict=True), style, label=label)
    lengths = [r["L"] for r in rows]
    right.plot(
        lengths, [r["dense_scores_bytes"] / 2**20 for r in rows], "k:", label="dense scores alone"
    )
    right.axhline(
        results["memory"]["machine_memory_bytes"] / 2**20,
        color="red",
        linewidth=0.8,
        label="this machine's memory",
    )
    right.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length L = S",
        ylabel="peak traced MiB",
        title="peak memory of one call",
    )
    for ax, ticks in ((left, [r["L"] for r in results["sweep"]]), (right, lengths)):
        ax.set_xticks(ticks, labels=[str(L) for L in ticks])
        _labelled_log_axis(ax, matplotlib)
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    return figure


def _labelled_log_axis(ax: Any, matplotlib: Any) -> None:
    """A log y axis with labelled ticks at 1, 2 and 5 times each power of ten, its limits
    widened to the nearest of them, so that a range within one decade (a smoke run's) still
    shows numbers."""
    low, high = (float(v) for v in ax.get_ylim())
    decades = range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
    steps = [m * 10.0**e for e in decades for m in (1, 2, 5)]
    ax.set_ylim(max(v for v in steps if v <= low), min(v for v in steps if v >= high))
    ticker = matplotlib.ticker
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mha.cli.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per implementation")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="3 repeats, lengths up to 16384")
    sizes.add_argument("--smoke", action="store_true", help="tiny sizes: checks the set-up")
    parser.add_argument("--output", type=Path, help="default: benchmarks/results[-quick|-smoke]")
    parser.add_argument("--readme", type=Path, help="rewrite this README's benchmark section")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib)")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.json_only:  # the speed table alone, as JSON (the free-BLAS child of run)
        print(json.dumps(speed_only(plan(size, args.repeats), log)))
        return 0
    output = args.output or default_output(size)
    if args.readme:
        check_readme(args.readme, BEGIN, END)
    results = run(plan(size, args.repeats), output, args.readme, log)
    if not args.no_chart:
        chart(results, output / "benchmark.png")
    print(markdown(results))
    return 0


def _floor(row: dict[str, Any]) -> float:
    """Seconds the shape's FLOPs take at the square-matmul rate."""
    return float(row["gflop"]) / float(row["matmul_gflops"])


def _speed_line(row: dict[str, Any]) -> str:
    ms = ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in row["seconds"].items())
    vs = f"{row['mha_vs_torch']:.2f}" if "mha_vs_torch" in row else "n/a"
    textbook = row["mha_vs_textbook"]
    return f"{row['shape']} {row['dtype']}: {ms}; mha/torch {vs}, mha/textbook {textbook:.2f}"


def _memory_line(row: dict[str, Any]) -> str:
    parts = [f"{key} {_mib(value)}" for key, value in row.items() if key.endswith("_bytes")]
    return f"L={row['L']}: " + ", ".join(parts)


def _mib(n: float) -> str:
    """Bytes as GiB, MiB or KiB, never a small size shown as 0."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 10 * 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def default_output(size: str) -> Path:
    """Where a run writes: the README's results only come from full runs."""
    return Path("benchmarks/results" if size == "full" else f"benchmarks/results-{size}")


# ----------------------------------------------------------------------------- mha bench


def add_parser(commands: Any) -> None:
    """``mha bench``'s options, on the subcommand parsers ``commands``."""
    bench = commands.add_parser(
        "bench",
        help="speed and memory beside textbook NumPy and PyTorch",
        description="Runs the benchmark (minutes), prints the table and writes JSON, a "
        "markdown table and a chart of time and peak memory against sequence length.",
    )
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats and lengths")
    size.add_argument("--smoke", action="store_true", help="tiny sizes in seconds: checks set-up")
    bench.add_argument(
        "-o",
        "--output",
        type=Path,
        help="folder for benchmark.json, .md and .png "
        "(default benchmarks/results, or benchmarks/results-quick/-smoke)",
    )
    bench.add_argument("--readme", type=Path, help="rewrite this README's benchmark section")
    bench.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    """``mha bench``: measure with a progress bar, then print and write the results."""
    needs("matplotlib", "rich")
    from rich.console import Console
    from rich.progress import Progress

    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    output = args.output or default_output(size)
    problem = writable_problem(output, folder=True)
    if problem:
        raise UsageError(f"cannot write --output {output}: {problem}")
    if args.readme is not None:
        if size != "full":
            raise UsageError(f"--readme takes a full run's results only; drop --{size}")
        check_readme(args.readme, BEGIN, END)
        problem = writable_problem(args.readme)
        if problem:
            raise UsageError(f"cannot rewrite --readme {args.readme}: {problem}")
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as progress:
        chosen = plan(size)
        task = progress.add_task("benchmark", total=steps(chosen))

        def log(line: str) -> None:
            progress.console.print(line)
            progress.advance(task)

        results = run(chosen, output, args.readme, log)
    print(markdown(results))
    picture = chart(results, output / "benchmark.png")
    kept = " (and under this CPU's name)" if size == "full" else ""
    print(f"wrote {output / 'benchmark.json'}, {output / 'benchmark.md'}{kept} and {picture}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
