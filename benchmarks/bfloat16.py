"""A bfloat16 KV cache against a float32 one: bytes held, the peak while decoding, the time
per token, and the error against float64 decoding, on one Llama-3-8B-sized layer.

    python benchmarks/bfloat16.py     # writes benchmarks/results/bfloat16.{json,md}

One attention layer (hidden 4096, 32 query heads, 8 key/value heads, head_dim 128, rope
theta 500000), float32 weights, a prompt of 2048 tokens then 16 tokens one at a time;
the two caches decode the same tokens, interleaved, and the medians of the step times are
compared. Memory is what tracemalloc sees allocated (NumPy's buffers), the cache's own bytes
from ``KVCache.nbytes``; a step's peak is what it allocates beyond the cache it appends to.
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import mha
from mha.cli.measure import environment, finish_script, measured_on, script_parser

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def decode(attention: Any, x: np.ndarray, dtype: Any, prompt: int) -> tuple[Any, ...]:
    """The cache after the prompt and the steps, each step's time, the outputs, the peak."""
    cache = attention.new_cache(1, capacity=x.shape[1], dtype=dtype)
    outs = [attention(x[:, :prompt], cache=cache)]
    tracemalloc.start()  # the steps' own allocations, beyond the cache they append to
    times = []
    for t in range(prompt, x.shape[1]):
        start = time.perf_counter()
        outs.append(attention(x[:, t : t + 1], cache=cache))
        times.append(time.perf_counter() - start)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return cache, times, np.concatenate(outs, axis=1), peak


def measure(quick: bool) -> dict[str, Any]:
    prompt, steps, repeats = (512, 8, 1) if quick else (2048, 16, 3)
    g = np.random.default_rng(0)
    attention = mha.MultiHeadAttention(4096, 32, num_kv_heads=8, rope_theta=5e5,
                                       dtype=np.float32, seed=0)  # fmt: skip
    wide = mha.MultiHeadAttention._from_weights(
        {n: w.astype(np.float64) for n, w in attention.weights().items() if w is not None}, 32,
        num_kv_heads=8, rope_theta=5e5,
    )  # fmt: skip
    x = g.standard_normal((1, prompt + steps, 4096)).astype(np.float32)
    oracle = wide(x.astype(np.float64), mask=True)
    scale = float(np.abs(oracle).max())
    rows: dict[str, dict[str, Any]] = {name: {"times": [], "peak": 0} for name in DTYPES}
    for _ in range(repeats):  # interleaved
        for name, dtype in DTYPES.items():
            cache, times, out, peak = decode(attention, x, dtype, prompt)
            row = rows[name]
            row["times"] += times
            row["peak"] = max(row["peak"], peak)
            row["nbytes"] = cache.nbytes
            row["error"] = float(np.abs(out.astype(np.float64) - oracle).max()) / scale
    for row in rows.values():
        row["ms_per_token"] = 1e3 * float(np.median(row.pop("times")))
    return {"environment": environment(None), "prompt": prompt, "steps": steps, "rows": rows}


def markdown(runs: list[dict[str, Any]]) -> str:
    mib = 2.0**20
    lines = []
    for results in runs:
        rows = results["rows"]
        f32, b16 = rows["float32"], rows["bfloat16"]
        lines += [
            measured_on(results["environment"]) + "One attention layer of Llama 3 8B's sizes "
            f"(hidden 4096, 32 heads, 8 key/value heads, head_dim 128, float32 weights): a "
            f"{results['prompt']}-token prompt, then {results['steps']} tokens one at a time; "
            "medians of interleaved runs; a step's memory as tracemalloc sees it.",
            "",
            "| cache | cache bytes | a step's peak beyond the cache | ms per token "
            "| error vs float64 |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {name} | {row['nbytes'] / mib:.1f} MiB | {row['peak'] / mib:.1f} MiB | "
                f"{row['ms_per_token']:.2f} | {row['error']:.1e} |"
                for name, row in rows.items()
            ),
            "",
            f"bfloat16 / float32: cache bytes {b16['nbytes'] / f32['nbytes']:.2f}, peak "
            f"{b16['peak'] / f32['peak']:.2f}, time per token "
            f"{b16['ms_per_token'] / f32['ms_per_token']:.2f}.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = script_parser(__doc__, ROOT / "benchmarks" / "results").parse_args(argv)
    return finish_script(__file__, args, measure(args.quick), "bfloat16", markdown)


if __name__ == "__main__":
    sys.exit(main())
