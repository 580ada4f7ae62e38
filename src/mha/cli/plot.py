"""``mha plot``: per-head heat maps of attention weights, saved or computed first (the
drawing itself is in :mod:`.plots`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from .._files import read_arrays
from ..errors import AttentionError
from ._common import (
    INPUT_ONLY,
    UsageError,
    check_output,
    count,
    masking_arguments,
    needs,
    plot_format,
)
from .run import attend


def add_parser(commands: Any) -> None:
    """``mha plot``'s options, on the subcommand parsers ``commands``."""
    plot = commands.add_parser(
        "plot",
        help="per-head heat maps of attention weights",
        description="Plots weights saved by 'mha run --weights', or runs attention on "
        "--input first. One panel per head and their average; masked cells in hatched grey.",
    )
    source = plot.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", type=Path, metavar="W.npy", help="saved weights")
    source.add_argument("--input", type=Path, metavar="INPUT.npz", help="arrays to run first")
    plot.add_argument("--heads", type=count(1), help="number of heads, with --input")
    plot.add_argument("--module", type=Path, help="a saved MultiHeadAttention, with --input")
    masking_arguments(plot)
    plot.add_argument(
        "--batch", type=count(0), default=0, help="which sequence to plot (default 0)"
    )
    plot.add_argument("--tokens", help='query labels, for example "the cat sat"')
    plot.add_argument("--key-tokens", help="key labels when keys differ from queries")
    plot.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("attention.png"),
        help="a .png or .svg file (default attention.png)",
    )
    plot.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    plotting = needs("mha.cli.plots", "matplotlib")
    check_output(
        args.output,
        "--output",
        {"--weights": args.weights, "--input": args.input, "--module": args.module},
    )
    plot_format(args.output, "--output")
    if args.weights is not None:
        for name in INPUT_ONLY:
            if getattr(args, name) is not None and getattr(args, name) is not False:
                option = "--" + name.replace("_", "-")
                raise UsageError(
                    f"{option} is used only with --input: the weights in {args.weights} are "
                    "already computed"
                )
        weights = _read_npy(args.weights)
        visible = None
        try:
            plotting.check_weights(weights, f"--weights {args.weights}")
        except AttentionError as error:
            raise UsageError(str(error)) from None
    else:
        _, weights, visible = attend(args, want_weights=True)
    if weights.ndim != 4 and args.batch != 0:
        raise UsageError(f"--batch {args.batch}, but the weights {weights.shape} hold one sequence")
    if weights.ndim == 4:  # (B, H, L, S): one sequence
        if args.batch >= weights.shape[0]:
            raise UsageError(
                f"--batch {args.batch} is out of range for {weights.shape[0]} sequences"
            )
        weights = weights[args.batch]
        visible = None if visible is None else visible[args.batch]
    tokens = args.tokens.split() if args.tokens else None
    key_tokens = args.key_tokens.split() if args.key_tokens else None
    path = plotting.plot_attention(
        weights, args.output, visible=visible, query_tokens=tokens, key_tokens=key_tokens
    )
    print(f"wrote {path}")
    return 0


def _read_npy(path: Path) -> np.ndarray:
    array = read_arrays(path, "an .npy file of attention weights")
    if isinstance(array, dict) or array.ndim not in (2, 3, 4):
        held = "named arrays" if isinstance(array, dict) else f"an array of shape {array.shape}"
        raise UsageError(
            f"--weights {path} holds {held}; it must hold weights (B, H, L, S), (H, L, S) or "
            "(L, S) as written by mha run --weights"
        )
    return array
