"""``mha demo``: a worked example, every step of attention with its shape, then causal, and
an attention map."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..api.function import multi_head_attention
from ._common import check_output, count, needs, plot_format


def add_parser(commands: Any) -> None:
    """``mha demo``'s options, on the subcommand parsers ``commands``."""
    demo = commands.add_parser(
        "demo",
        help="a small worked example, step by step, and an attention map",
        description="Self-attention on random Q = K = V of shape (1, 3, 4) with four (4, 4) "
        "weights and 2 heads: every step with its shape, then the same with a causal mask, "
        "and an attention-map PNG.",
    )
    demo.add_argument("--seed", type=count(0), default=0, help="seed of the inputs (default 0)")
    demo.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("attention_demo.png"),
        help="the attention map to write, .png or .svg (default attention_demo.png)",
    )
    demo.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    plot_attention = needs("mha.cli.plots", "matplotlib", "rich").plot_attention
    from rich.console import Console

    plot_format(args.output, "--output")
    check_output(args.output, "--output", {})
    console = Console(highlight=False)
    rng = np.random.default_rng(args.seed)
    Q = K = V = rng.standard_normal((1, 3, 4))
    W_q, W_k, W_v, W_o = rng.standard_normal((4, 4, 4))
    H, d_k = 2, 2

    def show(step: str, array: np.ndarray) -> None:
        console.print(f"[bold]{step}[/bold]  shape {array.shape}")
        console.print(np.array2string(array, precision=4, suppress_small=True), "\n")

    console.rule(f"mha demo: a worked example (seed {args.seed})")
    console.print(
        "Self-attention: Q = K = V, of shape (B=1, L=3, d_model=4); 2 heads of width 2.\n"
    )
    show("Q = K = V", Q)
    for name, W in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o)):
        show(name, W)
    for causal in (False, True):
        console.rule(
            "causal mask: key j is hidden from query i when j > i" if causal else "no mask"
        )
        q, k, v = Q @ W_q, K @ W_k, V @ W_v
        show("1. project: q = Q @ W_q", q)
        show("   k = K @ W_k", k)
        show("   v = V @ W_v", v)
        heads = [x.reshape(1, 3, H, d_k).transpose(0, 2, 1, 3) for x in (q, k, v)]
        show("2. split into heads: q (B, H, L, d_k)", heads[0])
        scores = heads[0] @ heads[1].transpose(0, 1, 3, 2) / math.sqrt(d_k)
        if causal:
            scores = np.where(np.tril(np.ones((3, 3), dtype=bool)), scores, -np.inf)
        show("3. scores = q k^T / sqrt(d_k), per head", scores)
        exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights = exp / exp.sum(axis=-1, keepdims=True)
        show("4. weights = softmax over keys (max subtracted first)", weights)
        joined = (weights @ heads[2]).transpose(0, 2, 1, 3).reshape(1, 3, H * d_k)
        show("5. weights @ v, heads joined: (B, L, H*d_v)", joined)
        out = joined @ W_o
        show("6. output = joined @ W_o", out)
        library, library_weights = multi_head_attention(
            Q, K, V, W_q, W_k, W_v, W_o, H, causal=causal, return_weights=True
        )
        difference = float(np.abs(library - out).max())
        console.print(
            f"mha.multi_head_attention gives the same output: max difference {difference:.1e}\n"
        )
    path = plot_attention(library_weights[0], args.output, title="causal attention, 2 heads")
    console.print(f"wrote the causal attention map to [bold]{path}[/bold]")
    return 0
