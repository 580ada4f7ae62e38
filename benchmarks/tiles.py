"""Tile sizes chosen by measurement: the kernel's time against its scratch budget and key
tile, on the OpenBLAS kernel this machine picks and on the older one some machines force.

    python benchmarks/tiles.py            # results in benchmarks/results/tiles.*
    python benchmarks/tiles.py --quick

For S2 (B=1, L=2048, 12 heads) and S4 (causal, L=4096, 8 heads), d_k = 64, in float32 and
float64: the attention core's forward and forward + backward for ``max_memory`` of 2, 4, 6
and 8 MiB and key tiles of 256, 512 and 1024, interleaved, medians. Then the same in a child
process with ``OPENBLAS_CORETYPE=Haswell`` (the AVX2 kernel), unless this machine's own
kernel is forced already. Only the child's environment changes.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import mha
from mha._kernel import runtime
from mha.cli.measure import (
    environment,
    interleaved_medians,
    measured_on,
    save_results,
    script_parser,
)

ROOT = Path(__file__).parent.parent
BUDGETS_MIB = [2, 4, 6, 8]
KEY_TILES = [256, 512, 1024]
SHAPES = [("S2", 1, 12, 2048, False), ("S4 causal", 1, 8, 4096, True)]


def _call(q: Any, k: Any, v: Any, g: Any, causal: bool, budget: int, key_tile: int) -> Any:
    def run() -> None:
        with runtime.DEFAULT.tuned(key_tile=key_tile):
            _, backward = mha.scaled_dot_product_attention(
                q, k, v, causal=causal, max_memory=budget, return_backward=True
            )
            backward(g)

    return run


def measure(repeats: int) -> dict[str, Any]:
    rows = []
    for (name, B, H, L, causal), dtype in itertools.product(SHAPES, (np.float32, np.float64)):
        rng = np.random.default_rng(0)
        q, k, v, g = (rng.standard_normal((B, H, L, 64)).astype(dtype) for _ in range(4))
        functions = {
            (mib, key_tile): _call(q, k, v, g, causal, mib * 2**20, key_tile)
            for mib in BUDGETS_MIB
            for key_tile in KEY_TILES
        }
        named = {f"{mib} MiB, {key_tile} keys": f for (mib, key_tile), f in functions.items()}
        times = interleaved_medians(named, repeats, pause=0.1)
        seconds = {label: statistics.median(t) for label, t in times.items()}
        best = min(seconds, key=seconds.__getitem__)
        rows.append({"shape": name, "dtype": np.dtype(dtype).name, "seconds": seconds,
                     "best": best})  # fmt: skip
        print(name, np.dtype(dtype).name, "best", best, file=sys.stderr, flush=True)
    return {"environment": environment(None), "rows": rows}


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        lines += [
            measured_on(results["environment"]),
            "",
            "Attention core, forward + backward, ms (medians of interleaved runs), by scratch "
            "budget and key tile; the default is 6 MiB and 512 keys.",
            "",
            "| shape | dtype | " + " | ".join(f"{m} MiB" for m in BUDGETS_MIB) + " | best |",
            "|---|---|" + "---:|" * len(BUDGETS_MIB) + "---|",
        ]
        for row in results["rows"]:
            for key_tile in KEY_TILES:
                cells = [row["seconds"][f"{m} MiB, {key_tile} keys"] * 1e3 for m in BUDGETS_MIB]
                best = row["best"] if key_tile == KEY_TILES[0] else ""
                lines.append(
                    f"| {row['shape']}, {key_tile} keys | {row['dtype']} | "
                    + " | ".join(f"{c:.0f}" for c in cells)
                    + f" | {best} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = script_parser(__doc__, ROOT / "benchmarks" / "results").parse_args(argv)
    results = measure(2 if args.quick else 5)
    if args.json_only:
        print(json.dumps(results))
        return 0
    runs = [results]
    if "OPENBLAS_CORETYPE" not in os.environ:  # the older kernel too, in a child
        env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell"}
        command = [sys.executable, __file__, "--json-only", *(["--quick"] if args.quick else [])]
        child = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(child.stdout))
    table = markdown(runs)
    save_results(args.output, "tiles-quick" if args.quick else "tiles", runs, table, None,
                  ("", ""))  # fmt: skip
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
