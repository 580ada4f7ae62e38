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
        "--input first, or a whole model's layer (--model, --layer) over the tokens of --text. "
        "One panel per head and their average; masked cells in hatched grey.",
    )
    source = plot.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", type=Path, metavar="W.npy", help="saved weights")
    source.add_argument("--input", type=Path, metavar="INPUT.npz", help="arrays to run first")
    source.add_argument(
        "--model", type=Path, help="a whole model (a save_pretrained folder or a .gguf file)"
    )
    plot.add_argument("--text", help="with --model: the text whose tokens are attended")
    plot.add_argument(
        "--layer", type=count(0), default=0, help="with --model: which layer (default 0)"
    )
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
    if args.model is not None:
        if args.text is None:
            raise UsageError("--model needs --text, the text whose tokens are attended")
        weights, labels = model_weights(args.model, args.text, args.layer)
        path = plotting.plot_attention(weights, args.output, query_tokens=labels)
        print(f"wrote {path}")
        return 0
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


def model_weights(path: Path, text: str, layer: int) -> tuple[np.ndarray, list[str]]:
    """Layer ``layer``'s attention weights ``(H, L, L)`` in the model at ``path`` over the
    tokens of ``text``, causal, and each token's string (spaces shown as ``·``, newlines
    as ``↵``)."""
    from ..models import load

    model = load(path, dtype=np.float64)  # rows that sum to 1 as the plot checks them
    decoder = model.decoder
    if not 0 <= layer < len(decoder.layers):
        raise UsageError(f"--layer {layer}: the model has layers 0 to {len(decoder.layers) - 1}")
    if model.tokenizer is None:
        raise UsageError(f"{path} has no tokenizer: --text cannot be tokenized")
    ids = model.tokenizer.encode(text)
    h, attention = decoder.attention_input(np.array([ids]), layer)
    _, weights = attention(h, mask=True, return_weights=True)
    labels = [model.tokenizer.decode([token]).replace(" ", "·").replace("\n", "↵") for token in ids]
    return np.asarray(weights[0], dtype=np.float64), labels
