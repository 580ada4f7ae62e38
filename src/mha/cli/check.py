"""``mha check``: mha against PyTorch on random configurations, for a user's own machine.

The oracle is torch's own computation: its matmuls for the projections and
``F.scaled_dot_product_attention`` with a boolean mask built here from ``torch.tril`` and
``arange`` comparisons. A query row that sees no key is compared with the contract's answer,
a zero attention output, since torch gives NaN or zeros there depending on the path.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..api.projection import multi_head_attention
from ._common import TORCH_CPU, count, needs

TOLERANCE = {"float64": 1e-12, "float32": 2e-5}


def compare(torch: Any, count: int, seed: int) -> Iterator[dict[str, Any]]:
    """One row per random configuration: its shape, masks and worst relative errors."""
    for index in range(count):
        rng = np.random.default_rng([seed, index])
        B, H = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        L, S, d = int(rng.integers(1, 33)), int(rng.integers(1, 33)), int(rng.integers(1, 17))
        E = H * d
        X = rng.standard_normal((B, L, E))
        M = rng.standard_normal((B, S, E))
        W = [rng.standard_normal((E, E)) / math.sqrt(E) for _ in range(4)]
        keywords: dict[str, Any] = {}
        if rng.random() < 0.5:
            keywords["causal"] = True
        if rng.random() < 0.5:
            keywords["key_lengths"] = rng.integers(0, S + 1, size=B)
        if rng.random() < 0.5:
            keywords["mask"] = rng.random((B, L, S)) < 0.8
        errors = {}
        for dtype in ("float64", "float32"):
            arrays = [a.astype(dtype) for a in (X, M, M, *W)]
            Q, K, V, W_q, W_k, W_v, W_o = arrays
            ours = multi_head_attention(Q, K, V, W_q, W_k, W_v, W_o, H, **keywords)
            expected = _torch_attention(torch, [a.astype(np.float64) for a in arrays], H, keywords)
            scale = float(np.abs(expected).max()) or 1.0
            errors[dtype] = float(np.abs(ours - expected).max()) / scale
        yield {
            "seed": index,
            "shape": f"({B}, {H}, {L}, {S}, {d})",
            "masks": ", ".join(sorted(keywords)) or "none",
            **errors,
            "ok": all(errors[k] <= TOLERANCE[k] for k in TOLERANCE),
        }


def _torch_attention(torch: Any, arrays: list[np.ndarray], H: int, kw: dict[str, Any]) -> Any:
    X, K, V, W_q, W_k, W_v, W_o = (torch.from_numpy(a) for a in arrays)
    B, L, E = X.shape
    S = K.shape[1]

    def heads(x: Any) -> Any:
        return x.reshape(x.shape[0], x.shape[1], H, E // H).transpose(1, 2)

    allowed = torch.ones(B, 1, L, S, dtype=torch.bool)
    if kw.get("causal"):
        allowed = allowed & torch.tril(torch.ones(L, S, dtype=torch.bool), diagonal=S - L)
    if "key_lengths" in kw:
        lengths = torch.as_tensor(kw["key_lengths"])
        allowed = allowed & (torch.arange(S) < lengths[:, None])[:, None, None, :]
    if "mask" in kw:
        allowed = allowed & torch.from_numpy(kw["mask"])[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        heads(X @ W_q), heads(K @ W_k), heads(V @ W_v), attn_mask=allowed
    )
    out = torch.where(allowed.any(dim=-1, keepdim=True), out, 0.0)
    return (out.transpose(1, 2).reshape(B, L, E) @ W_o).numpy()


def add_parser(commands: Any) -> None:
    """``mha check``'s options, on the subcommand parsers ``commands``."""
    check = commands.add_parser(
        "check", help="compare with PyTorch on random configurations",
        description="Runs mha and torch on random configurations (every mask kind, float64 "
        "and float32) and prints the worst relative error of each. Needs torch installed.",
    )  # fmt: skip
    check.add_argument("--configs", type=count(1), default=24, help="how many (default 24)")
    check.add_argument("--seed", type=count(0), default=0, help="seed of the configurations")
    check.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    needs("rich", "rich")
    try:
        import torch
    except ImportError:
        print("mha check: torch is not installed, so there is nothing to compare against. "
              f"Install its CPU build with: {TORCH_CPU}", file=sys.stderr)  # fmt: skip
        return 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mha against torch {torch.__version__}: worst relative error")
    for column in ("config", "shape (B, H, L, S, d)", "masks", "float64", "float32", "ok"):
        table.add_column(column)
    failures = 0
    for row in compare(torch, args.configs, args.seed):
        failures += not row["ok"]
        table.add_row(str(row["seed"]), row["shape"], row["masks"], f"{row['float64']:.1e}",
                      f"{row['float32']:.1e}", "yes" if row["ok"] else "NO")  # fmt: skip
    Console().print(table)
    print(f"{args.configs - failures} of {args.configs} configurations within 1e-12 (float64) "
          "and 2e-5 (float32)")  # fmt: skip
    return 1 if failures else 0
