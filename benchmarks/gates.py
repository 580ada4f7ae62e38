"""Output gates: what a gate costs beside the same layer without it (issue 33's target: a
gated call within 1.1x of the call without it).

    python benchmarks/gates.py [--quick]

Causal self-attention through ``mha.multi_head_attention``, float32, batch 1, d_model 1024,
16 heads, 1,024 tokens: plain, a gate per head (``W_g (d_model, H)``) and a gate per element
(``W_g (d_model, H*d_v)``), interleaved, medians. A gate per element is a GEMM as large as a
projection: the ratio includes it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import mha
from mha.cli.measure import environment, interleaved_medians, measured_on

E, H, L = 1024, 16, 1024


def calls() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((1, L, E)).astype(np.float32)
    W = [(rng.standard_normal((E, E)) / 32).astype(np.float32) for _ in range(4)]
    gates = {"per head": H, "per element": E}
    made = {"plain": lambda: mha.multi_head_attention(X, X, X, *W, H, causal=True)}
    for name, columns in gates.items():
        W_g = (rng.standard_normal((E, columns)) / 32).astype(np.float32)
        made[f"gate {name}"] = lambda W_g=W_g: mha.multi_head_attention(
            X, X, X, *W, H, causal=True, W_g=W_g
        )
    return made


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    repeats = 3 if "--quick" in argv else 9
    times = interleaved_medians(calls(), repeats, pause=0.0)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    try:
        import torch
    except ImportError:
        torch = None
    print(measured_on(environment(torch)))
    for name, seconds in medians.items():
        ratio = seconds / medians["plain"]
        print(f"{name:18} {seconds * 1e3:8.1f} ms  {ratio:5.3f}x plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
