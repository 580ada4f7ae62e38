"""``mha run``: attention on arrays from an ``.npz`` file, and the call that ``mha plot
--input`` shares."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from .._kernel.contract import MaskArrays, MaskRules, ScoreShape, Visibility
from ..api.function import multi_head_attention
from ..api.module import MultiHeadAttention
from ._common import (
    BIAS_KEYS,
    DATA_KEYS,
    OPTIONS,
    UsageError,
    check_output,
    count,
    listing,
    masking_arguments,
    read_npz,
    refuse_unknown,
    save_npy,
)


def add_parser(commands: Any) -> None:
    """``mha run``'s options, on the subcommand parsers ``commands``."""
    run = commands.add_parser(
        "run",
        help="attention on arrays from an .npz file",
        description="Reads Q, K, V, W_q, W_k, W_v and W_o (x @ W layout) from INPUT.npz, or X "
        "with --module (a file written by MultiHeadAttention.save), and writes the output.",
    )
    run.add_argument("input", type=Path, metavar="INPUT.npz")
    run.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="OUT.npy",
        help="where to write the output (B, L, d_out) as .npy",
    )
    run.add_argument("--heads", type=count(1), help="number of heads (needed without --module)")
    run.add_argument("--module", type=Path, help="a saved MultiHeadAttention to apply to X")
    masking_arguments(run)
    run.add_argument("--weights", type=Path, metavar="W.npy", help="also write the weights")
    run.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    inputs = {"the input": args.input, "--module": args.module}
    check_output(args.output, "--output", inputs)
    if args.weights is not None:
        check_output(args.weights, "--weights", {**inputs, "--output": args.output})
    out, weights, _ = attend(args, want_weights=args.weights is not None)
    save_npy(args.output, out)
    if args.weights is not None:
        save_npy(args.weights, weights)
    also = f" and {args.weights} {weights.shape}" if args.weights is not None else ""
    print(f"wrote {args.output} {out.shape} {out.dtype}{also}")
    return 0


def attend(args: argparse.Namespace, want_weights: bool) -> tuple[np.ndarray, Any, Any]:
    """Attention on the arrays of ``args.input``, as ``mha run`` and ``mha plot`` read it:
    ``(out, weights or None, visible or None)``, ``visible`` being where the masks let each
    query see each key, shaped like the weights."""
    arrays = read_npz(args.input)
    for name, array in arrays.items():
        if array.dtype.kind == "b":  # the library's message would point to a mask= keyword
            raise UsageError(
                f"{name} in {args.input} holds booleans ({name} {array.shape}); mha run reads "
                "real numbers (float16, float32 or float64) in every array and takes its masks "
                "as options: --causal, --window, --key-lengths, --query-lengths"
            )
    module = _module(args, arrays) if args.module is not None else None
    if module is None:
        _check_arrays(args, arrays)
    heads = args.heads if module is None else module.num_heads
    Q = arrays["X"] if module is not None else arrays["Q"]
    keywords = _keywords(args, module, np.shape(Q), want_weights)
    if module is not None:
        result = module(arrays["X"], **keywords)
    else:
        keywords.update({name: arrays[name] for name in BIAS_KEYS if name in arrays})
        Q, K, V, W_q, W_k, W_v, W_o = (arrays[key] for key in DATA_KEYS)
        result = multi_head_attention(Q, K, V, W_q, W_k, W_v, W_o, heads, **keywords)
    out, weights = result if want_weights else (result, None)
    visible = None
    if weights is not None:
        K = arrays["X"] if module is not None else arrays["K"]
        window = args.window if module is None else module.window
        visible = _visible(weights, keywords, (np.shape(Q), np.shape(K), heads), window)
    return out, weights, visible


def _module(args: argparse.Namespace, arrays: dict[str, np.ndarray]) -> MultiHeadAttention:
    """The saved module of ``--module``, for the input's ``X`` alone."""
    refuse_unknown(args.input, arrays, ("X",), "with --module")
    if "X" not in arrays:
        raise UsageError(f"{args.input} has no 'X' to give --module (it holds {listing(arrays)})")
    module = MultiHeadAttention.load(args.module)
    if args.heads is not None and args.heads != module.num_heads:
        raise UsageError(f"--heads {args.heads} but {args.module} has {module.num_heads} heads")
    if args.window is not None:
        raise UsageError(
            f"--window is for arrays given with their weights; {args.module} records its "
            f"own window ({module.window})"
        )
    return module


def _check_arrays(args: argparse.Namespace, arrays: dict[str, np.ndarray]) -> None:
    """The input holds the function's arrays, and ``--heads`` is given."""
    refuse_unknown(args.input, arrays, DATA_KEYS + BIAS_KEYS, "")
    missing = [key for key in DATA_KEYS if key not in arrays]
    if missing:
        raise UsageError(
            f"{args.input} has no {', '.join(repr(k) for k in missing)} "
            f"(it holds {listing(arrays)}); it needs {', '.join(DATA_KEYS)}, "
            "or X with --module"
        )
    if args.heads is None:
        raise UsageError("--heads is required unless --module gives a saved module")
    W_q = arrays["W_q"]
    if W_q.ndim == 2 and W_q.shape[1] == 0:
        raise UsageError(
            f"W_q in {args.input} has no columns (W_q {W_q.shape}): each head needs "
            "queries and keys at least 1 wide"
        )


def _keywords(
    args: argparse.Namespace, module: Any, shape: tuple[int, ...], want_weights: bool
) -> dict[str, Any]:
    """The options as the function's keywords, for queries of ``shape``."""
    if args.top_left and not (args.causal or args.window):
        raise UsageError("--top-left aligns the causal mask: use it with --causal or --window")
    keywords: dict[str, Any] = {"causal": args.causal, "return_weights": want_weights}
    if args.window is not None:
        keywords["window"] = args.window
    if args.top_left:
        keywords["causal_alignment"] = "top_left"
    for name in ("key_lengths", "query_lengths"):
        keywords[name] = _lengths_for(getattr(args, name), name, shape)
    return keywords


def _visible(
    weights: np.ndarray, keywords: dict[str, Any], shapes: tuple[Any, Any, int], window: Any
) -> np.ndarray:
    """Where the masks let each query see each key, shaped like ``weights``: ``shapes`` are
    the queries', the keys' and the head count."""
    shape, key_shape, heads = shapes
    rules = MaskRules.check(
        None, keywords["causal"], keywords.get("causal_alignment"), window, None, None, None
    )
    lengths = MaskArrays(
        key_lengths=keywords["key_lengths"], query_lengths=keywords["query_lengths"]
    )
    scores = ScoreShape(shape[:-2], heads, shape[-2], key_shape[-2])
    allowed = Visibility.build(rules, lengths, scores).allowed()
    extra = weights.shape[-1] - allowed.shape[-1]  # the module's bias_k / zero key
    rows = np.ones(shape[-2], dtype=bool)  # every query row sees the extra keys ...
    if keywords["query_lengths"] is not None:  # ... unless it is padding
        rows = np.arange(shape[-2]) < np.asarray(keywords["query_lengths"])[..., None]
    extra_columns = np.broadcast_to(rows[..., None, :, None], (*allowed.shape[:-1], extra))
    return np.concatenate([allowed, extra_columns], axis=-1)


def _lengths_for(lengths: np.ndarray | None, name: str, shape: tuple[int, ...]) -> Any:
    """``--key-lengths``/``--query-lengths`` as the library takes them: one length per
    sequence, or a single number for unbatched ``(L, d)`` inputs."""
    if lengths is None:
        return None
    option = OPTIONS[name]
    given = f"{len(lengths)} length{'s' if len(lengths) != 1 else ''}"
    if len(shape) == 2:
        if len(lengths) != 1:
            raise UsageError(
                f"{option} gives {given} but the inputs are one unbatched sequence "
                f"(shape {shape}): give one length"
            )
        return int(lengths[0])
    if len(shape) == 3 and len(lengths) != shape[0]:
        raise UsageError(
            f"{option} gives {given} but the inputs hold {shape[0]} sequences "
            f"(shape {shape}): give one length per sequence"
        )
    return lengths
