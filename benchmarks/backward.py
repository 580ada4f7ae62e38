"""Gradients' speed and memory: mha's forward + backward beside PyTorch autograd's.

    python benchmarks/backward.py                     # results in benchmarks/results/backward.*
    python benchmarks/backward.py --readme docs/benchmarks.md  # and its table in docs/benchmarks.md
    python benchmarks/backward.py --quick             # fewer repeats, S1 and S3 only

For the forward benchmark's shapes S1-S4, in float32 and float64, one interleaved run of:
mha's ``multi_head_attention(..., return_backward=True)`` and its ``backward``; the same for
the attention core alone (``scaled_dot_product_attention`` on split heads); and torch's
``nn.MultiheadAttention`` and ``F.scaled_dot_product_attention`` forward + ``.backward()``.
Medians. Where the environment sets ``OPENBLAS_CORETYPE`` or ``OPENBLAS_L2_SIZE`` (holding
OpenBLAS to an older kernel), the same run is repeated in a child process without them. Then
the peak traced memory of a causal forward + backward at L = S = 16384
(B=1, d_model=512, 8 heads, float32), beside what the call must hold: its output, the
projected q, k, v and the gradients, plus 64 MiB.
"""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

import mha
from mha._kernel.team import cores
from mha.cli.bench import SHAPES
from mha.cli.measure import (
    check_readme,
    environment,
    finish_script,
    interleaved_medians,
    measured_on,
    script_parser,
)

ROOT = Path(__file__).parent.parent
BEGIN, END = "<!-- backward: begin -->", "<!-- backward: end -->"


def case(shape: Any, dtype: Any, torch: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    B, L, E, H = shape.B, shape.L, shape.d_model, shape.H
    X = rng.standard_normal((B, L, E)).astype(dtype)
    W = [(rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype) for _ in range(4)]
    b = [np.zeros(E, dtype) for _ in range(4)]
    grad = rng.standard_normal((B, L, E)).astype(dtype)
    q, k, v = (rng.standard_normal((B, H, L, E // H)).astype(dtype) for _ in range(3))
    grad_heads = rng.standard_normal(q.shape).astype(dtype)
    biases = dict(zip(("b_q", "b_k", "b_v", "b_o"), b, strict=True))

    def mha_forward() -> None:
        mha.multi_head_attention(X, X, X, *W, H, causal=shape.causal, **biases)

    def mha_both() -> None:
        _, backward = mha.multi_head_attention(
            X, X, X, *W, H, causal=shape.causal, return_backward=True, **biases
        )
        backward(grad)

    def core_forward() -> None:
        mha.scaled_dot_product_attention(q, k, v, causal=shape.causal)

    def core_both() -> None:
        _, backward = mha.scaled_dot_product_attention(
            q, k, v, causal=shape.causal, return_backward=True
        )
        backward(grad_heads)

    functions = {"mha": mha_both, "mha forward": mha_forward, "mha core": core_both,
                 "mha core forward": core_forward}  # fmt: skip
    if torch is not None:
        tdtype = torch.float32 if dtype == np.float32 else torch.float64
        module = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=tdtype)
        mask = None
        if shape.causal:
            mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=tdtype)
        x = torch.from_numpy(X).requires_grad_(True)
        tq, tk, tv = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))

        def torch_both() -> None:
            out = module(x, x, x, need_weights=False, attn_mask=mask, is_causal=shape.causal)[0]
            out.backward(torch.from_numpy(grad))

        def torch_core() -> None:
            out = torch.nn.functional.scaled_dot_product_attention(
                tq, tk, tv, is_causal=shape.causal
            )
            out.backward(torch.from_numpy(grad_heads))

        functions |= {"torch": torch_both, "torch core": torch_core}
    repeats = 15 if shape.L <= 128 else 9 if shape.L <= 2048 else 5  # short calls: more
    times = interleaved_medians(functions, repeats, pause=0.2)
    s = {name: float(np.median(t)) for name, t in times.items()}
    return {
        "shape": shape.name, "causal": shape.causal, "B": B, "L": L, "d_model": E, "H": H,
        "dtype": np.dtype(dtype).name, "seconds": s, "all_seconds": times,
    }  # fmt: skip


def memory(L: int = 16384) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    E, H = 512, 8
    X = rng.standard_normal((1, L, E), dtype=np.float32)
    W = [rng.standard_normal((E, E), dtype=np.float32) / float(np.sqrt(E)) for _ in range(4)]
    grad = rng.standard_normal((1, L, E), dtype=np.float32)
    tracemalloc.start()
    out, backward = mha.multi_head_attention(X, X, X, *W, H, causal=True, return_backward=True)
    grads = backward(grad)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = {"output": out.nbytes, "q, k, v": 3 * X.nbytes,
            "gradients": sum(g.nbytes for g in grads.values())}  # fmt: skip
    return {"L": L, "peak_bytes": peak, "held_bytes": held,
            "bound_bytes": sum(held.values()) + 64 * 2**20,
            "dense_probabilities_bytes": H * L * L * 4}  # fmt: skip


def markdown(runs: list[dict[str, Any]]) -> str:
    """One table per run (the second, when there is one, with OpenBLAS free to choose its
    kernel), then the memory line of the first."""
    lines = []
    for results in runs:
        lines += [
            measured_on(results["environment"])
            + "Forward + backward, ms (medians of interleaved runs); ratios below 1 favour mha.",
            "",
            "| shape | dtype | mha | torch `nn.MultiheadAttention` | mha / torch | mha backward "
            "/ forward | core: mha SDPA | core: torch SDPA | core mha / torch |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["speed"]:
            s = row["seconds"]
            name = f"{row['shape']}{' causal' if row['causal'] else ''} (B={row['B']}, L={row['L']}, d={row['d_model']}, H={row['H']})"  # noqa: E501
            backward = (s["mha"] - s["mha forward"]) / s["mha forward"]
            lines.append(
                f"| {name} | {row['dtype']} | {s['mha'] * 1e3:.0f} | {s['torch'] * 1e3:.0f} "
                f"| {s['mha'] / s['torch']:.2f} | {backward:.2f} | {s['mha core'] * 1e3:.0f} "
                f"| {s['torch core'] * 1e3:.0f} | {s['mha core'] / s['torch core']:.2f} |"
            )
        lines.append("")
    m = runs[0]["memory"]
    mib = 2**20
    held = ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in m["held_bytes"].items())
    lines += [
        f"Peak traced memory of a causal forward + backward at L = S = {m['L']:,} (B=1, "
        f"d_model=512, 8 heads, float32; inputs already allocated): "
        f"{m['peak_bytes'] / mib:.0f} MiB, beside what it must hold ({held}) plus 64 MiB = "
        f"{m['bound_bytes'] / mib:.0f} MiB. The probabilities alone would take "
        f"{m['dense_probabilities_bytes'] / 2**30:.0f} GiB.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = script_parser(__doc__, ROOT / "benchmarks" / "results", readme=True).parse_args(argv)
    if args.readme:
        check_readme(args.readme, BEGIN, END)  # before measuring anything
    try:
        import torch
    except ImportError:
        torch = None
    else:
        torch.set_num_threads(cores())
    shapes = [s for s in SHAPES if not args.quick or s.name in ("S1", "S3")]
    results = {
        "environment": environment(torch),
        "speed": [
            case(shape, dtype, torch) for dtype in (np.float32, np.float64) for shape in shapes
        ],
        "memory": memory(4096 if args.quick else 16384),
    }
    return finish_script(__file__, args, results, "backward", markdown, (BEGIN, END))


if __name__ == "__main__":
    sys.exit(main())
