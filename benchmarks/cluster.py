"""mha.dask on a two-worker LocalCluster (one thread each) against the in-memory call.

    python benchmarks/cluster.py                    # results in benchmarks/results/dask.*
    python benchmarks/cluster.py --readme docs/benchmarks.md  # and its table in docs/benchmarks.md
    python benchmarks/cluster.py --quick            # fewer repeats

1. Parallel over the batch: self-attention, B=16, L=1024, d_model=512, 8 heads, float32,
   chunked by 2 sequences (8 blocks, one task each).
2. Parallel over the sequence: self-attention, B=1, L=S=16384, d_model=512, 8 heads,
   float32, causal, chunked by 2048 positions (8 query chunks x 8 key chunks, of which the
   causal mask leaves 36), and by 1024 (16 x 16, 136 left).

The inputs are made on the cluster and persisted; the in-memory call gets the same array in
this process. Times (medians of interleaved runs, graph building included): the in-memory
call with 1 and 2 workers; mha.dask with the result kept on the cluster (``persist``, what a
pipeline does) and brought back here (``compute``, 32 MiB over local TCP). Memory: the peak
that ``tracemalloc`` sees in each worker during a run (the highest in three runs: what a
worker holds depends on where the scheduler puts tasks), against the in-memory call's peak
(inputs allocated before). Tasks: the graph's, beside the non-causal graph's.

Targets (issue 12): batch-parallel within 1.3x the in-memory two-worker time; the
sequence-parallel causal run's per-worker peak at most half the in-memory call's plus
64 MiB, and about half the non-causal run's tasks.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

import mha
import mha.dask
from mha.cli.measure import (
    environment,
    measured_on,
    peak_traced_bytes,
    readme_script,
)

D, H = 512, 8
RUNS = {
    "batch": {"shape": (16, 1024, D), "chunks": (2, 1024, D), "causal": False},
    "sequence": {"shape": (1, 16384, D), "chunks": (1, 2048, D), "causal": True},
    "sequence, finer": {"shape": (1, 16384, D), "chunks": (1, 1024, D), "causal": True},
}
DASK_BEGIN, DASK_END = "<!-- dask: begin -->", "<!-- dask: end -->"
MEMORY_RUNS = 3


def _trace_start() -> None:
    import tracemalloc

    tracemalloc.start()
    tracemalloc.reset_peak()


def _trace_stop() -> int:
    import tracemalloc

    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def _ours(key: Any) -> bool:
    """Whether a graph key is one of mha.dask's tasks."""
    return str(key).startswith(("('mha-", "mha-"))


def _count_ours(dask_scheduler: Any) -> int:
    return sum(1 for key in dask_scheduler.tasks if _ours(key))


def measure_run(client: Any, name: str, repeats: int) -> dict[str, Any]:
    import dask.array as da
    from distributed import wait

    spec = RUNS[name]
    rng = np.random.default_rng(0)
    W = [(rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32) for _ in range(4)]
    X = da.random.default_rng(1).standard_normal(spec["shape"], chunks=spec["chunks"],
                                                  dtype=np.float32)  # fmt: skip
    X = X.persist()
    wait(X)
    local = X.compute()
    causal = spec["causal"]

    def lazy(causal: bool = causal) -> Any:
        return mha.dask.multi_head_attention(X, X, X, *W, H, causal=causal)

    def forget() -> None:  # the next run computes afresh (its keys are the same)
        while client.run_on_scheduler(_count_ours):
            time.sleep(0.01)

    held: list[Any] = []
    functions = {
        "in-memory, 2 workers": lambda: mha.multi_head_attention(
            local, local, local, *W, H, causal=causal, workers=2
        ),
        "in-memory, 1 worker": lambda: mha.multi_head_attention(
            local, local, local, *W, H, causal=causal, workers=1
        ),
        "mha.dask, persist": lambda: held.append(wait(lazy().persist()) or None),
        "mha.dask, compute": lambda: lazy().compute(),
    }
    times: dict[str, list[float]] = {key: [] for key in functions}
    names = list(functions)
    for round_ in range(repeats + 1):  # the first round warms up
        for key in names[round_ % len(names) :] + names[: round_ % len(names)]:
            time.sleep(0.3)
            start = time.perf_counter()
            functions[key]()
            seconds = time.perf_counter() - start
            held.clear()
            forget()
            if round_:
                times[key].append(seconds)

    want = functions["in-memory, 2 workers"]()
    got = lazy().compute()
    forget()
    in_memory_peak, _ = peak_traced_bytes(functions["in-memory, 2 workers"])
    peaks = []  # per run, each worker's: where tasks run (and so what a worker holds) varies
    for _ in range(MEMORY_RUNS):
        client.run(_trace_start)
        result = lazy().persist()
        wait(result)
        peaks.append(sorted(client.run(_trace_stop).values()))
        del result
        forget()
    graph = dict(lazy().__dask_graph__())
    other = dict(lazy(not causal).__dask_graph__())

    def tasks(g: dict[Any, Any]) -> dict[str, int]:
        ours = [key for key in g if _ours(key)]
        kinds = {"part": 0, "merge": 0}
        for key in ours:
            for kind in kinds:
                kinds[kind] += f"-{kind}-" in str(key)
        return {"total": len(ours), **kinds}

    return {
        "shape": spec["shape"], "chunks": spec["chunks"], "causal": causal,
        "seconds": {key: float(np.median(t)) for key, t in times.items()},
        "all_seconds": times,
        "relative_error": float(np.abs(got - want).max() / np.abs(want).max()),
        "in_memory_peak": in_memory_peak, "worker_peaks": peaks,
        "tasks": tasks(graph), "tasks_other": tasks(other),
    }  # fmt: skip


def measure(quick: bool) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    try:
        import torch
    except ImportError:
        torch = None
    results: dict[str, Any] = {"environment": environment(torch)}
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster, Client(cluster) as client:  # fmt: skip
        for name in RUNS:
            results[name] = measure_run(client, name, 3 if quick else 7)
    return results


def markdown(runs: list[dict[str, Any]]) -> str:
    mib = 2**20
    lines = []
    for results in runs:
        lines += [
            measured_on(results["environment"])
            + "A `LocalCluster` of 2 worker processes with 1 thread each; self-attention, "
            "d_model=512, 8 heads, float32; medians of interleaved runs, graph building "
            "included.",
            "",
            "| run | tasks (parts) | in-memory, 1 worker | in-memory, 2 workers | mha.dask, "
            "persist | mha.dask, compute | persist / in-memory 2 workers | peak per worker "
            "| in-memory peak | error |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in RUNS:
            r = results[name]
            s = r["seconds"]
            B, L, _ = r["shape"]
            what = (f"B={B} L={L}, by {r['chunks'][0]} sequences" if name == "batch" else
                    f"B={B} L=S={L} causal, by {r['chunks'][1]:,} positions")  # fmt: skip
            lines.append(
                f"| {what} | {r['tasks']['total']} ({r['tasks']['part']}) "
                f"| {s['in-memory, 1 worker']:.3f} s | {s['in-memory, 2 workers']:.3f} s "
                f"| {s['mha.dask, persist']:.3f} s | {s['mha.dask, compute']:.3f} s "
                f"| {s['mha.dask, persist'] / s['in-memory, 2 workers']:.2f} "
                f"| {_worst(r) / mib:.0f} MiB | {r['in_memory_peak'] / mib:.0f} MiB "
                f"| {r['relative_error']:.1e} |"
            )
        batch = results["batch"]["seconds"]
        lines += [
            "",
            f"Targets: batch-parallel persist / in-memory 2 workers "
            f"{batch['mha.dask, persist'] / batch['in-memory, 2 workers']:.2f} (at most 1.3).",
        ]
        for name in ("sequence", "sequence, finer"):
            seq = results[name]
            causal, full = seq["tasks"], seq["tasks_other"]
            bound = seq["in_memory_peak"] / 2 + 64 * mib
            attention = (causal["part"] + causal["merge"], full["part"] + full["merge"])
            lines.append(
                f"Sequence-parallel by {seq['chunks'][1]:,}: peak per worker "
                f"{_worst(seq) / mib:.0f} MiB (each worker's, in {MEMORY_RUNS} runs: "
                f"{', '.join(f'{p / mib:.0f}' for run in seq['worker_peaks'] for p in run)}) "
                f"against half the in-memory peak "
                f"plus 64 MiB = {bound / mib:.0f} MiB; causal tasks {causal['total']} against "
                f"{full['total']} without the mask ({causal['total'] / full['total']:.2f}), "
                f"attention parts and merges {attention[0]} against {attention[1]} "
                f"({attention[0] / attention[1]:.2f})."
            )
        lines.append("")
    return "\n".join(lines)


def _worst(run: dict[str, Any]) -> int:
    """The highest peak of any worker in any of the memory runs."""
    return max(max(peaks) for peaks in run["worker_peaks"])


def main(argv: list[str] | None = None) -> int:
    return readme_script(argv, __doc__, __file__, measure, "dask", markdown, (DASK_BEGIN, DASK_END))


if __name__ == "__main__":
    sys.exit(main())
