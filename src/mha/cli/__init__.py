"""The ``mha`` command: ``demo``, ``run``, ``plot``, ``bench`` and ``check``.

Every mistake a user can make on the command line ends in one line on standard error and
exit code 2; outputs are written atomically and never over an input file.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .. import __version__
from .._files import UnreadableFileError, atomic_write, read_arrays, writable_problem
from .._kernel.contract import Visibility
from ..errors import AttentionError
from ..functional import multi_head_attention
from ..module import MultiHeadAttention

EXIT_USAGE = 2
DATA_KEYS = ("Q", "K", "V", "W_q", "W_k", "W_v", "W_o")
BIAS_KEYS = ("b_q", "b_k", "b_v", "b_o")
INSTALL_CLI = 'pip install ".[cli]" in the mha checkout, or pip install matplotlib rich'
TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
INPUT_ONLY = ("heads", "module", "causal", "top_left", "window", "key_lengths", "query_lengths")

# The library's keyword names, as the options a user types on the command line.
_OPTIONS = {
    "num_heads": "--heads",
    "key_lengths": "--key-lengths",
    "query_lengths": "--query-lengths",
    "query_tokens": "--tokens",
    "key_tokens": "--key-tokens",
}


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr, not the usage block."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not hasattr(args, "command"):
            parser.print_help()
            return EXIT_USAGE
        result: int = args.command(args)
        return result
    except (UsageError, UnreadableFileError) as error:
        message = str(error)
        print(message if message.startswith("mha") else f"mha: {message}", file=sys.stderr)
        return EXIT_USAGE
    except (AttentionError, ValueError) as error:  # the library's word on the user's arrays
        print(f"mha: {as_options(str(error))}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:  # a path that cannot be read or written
        where = f" {error.filename}" if error.filename else ""
        print(f"mha: cannot use{where}: {error.strerror or error}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as error:
        print(f"mha: {error.name or error} is not installed: {INSTALL_CLI}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mha: interrupted", file=sys.stderr)
        return 130


def build_parser() -> Parser:
    parser = Parser(
        prog="mha",
        description="Exact multi-head attention in NumPy: a worked example, attention on your "
        "arrays, attention maps, benchmarks and a parity check against PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"mha {__version__}")
    commands = parser.add_subparsers(title="commands", parser_class=Parser)

    demo = commands.add_parser(
        "demo", help="a small worked example, step by step, and an attention map",
        description="Self-attention on random Q = K = V of shape (1, 3, 4) with four (4, 4) "
        "weights and 2 heads: every step with its shape, then the same with a causal mask, "
        "and an attention-map PNG.",
    )  # fmt: skip
    demo.add_argument("--seed", type=_count(0), default=0, help="seed of the inputs (default 0)")
    demo.add_argument(
        "-o", "--output", type=Path, default=Path("attention_demo.png"),
        help="the attention map to write, .png or .svg (default attention_demo.png)",
    )  # fmt: skip
    demo.set_defaults(command=run_demo)

    run = commands.add_parser(
        "run", help="attention on arrays from an .npz file",
        description="Reads Q, K, V, W_q, W_k, W_v and W_o (x @ W layout) from INPUT.npz, or X "
        "with --module (a file written by MultiHeadAttention.save), and writes the output.",
    )  # fmt: skip
    run.add_argument("input", type=Path, metavar="INPUT.npz")
    run.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.npy",
                     help="where to write the output (B, L, d_out) as .npy")  # fmt: skip
    run.add_argument("--heads", type=_count(1), help="number of heads (needed without --module)")
    run.add_argument("--module", type=Path, help="a saved MultiHeadAttention to apply to X")
    _masking_arguments(run)
    run.add_argument("--weights", type=Path, metavar="W.npy", help="also write the weights")
    run.set_defaults(command=run_run)

    plot = commands.add_parser(
        "plot", help="per-head heat maps of attention weights",
        description="Plots weights saved by 'mha run --weights', or runs attention on "
        "--input first. One panel per head and their average; masked cells in hatched grey.",
    )  # fmt: skip
    source = plot.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", type=Path, metavar="W.npy", help="saved weights")
    source.add_argument("--input", type=Path, metavar="INPUT.npz", help="arrays to run first")
    plot.add_argument("--heads", type=_count(1), help="number of heads, with --input")
    plot.add_argument("--module", type=Path, help="a saved MultiHeadAttention, with --input")
    _masking_arguments(plot)
    plot.add_argument("--batch", type=_count(0), default=0,
                      help="which sequence to plot (default 0)")  # fmt: skip
    plot.add_argument("--tokens", help='query labels, for example "the cat sat"')
    plot.add_argument("--key-tokens", help="key labels when keys differ from queries")
    plot.add_argument("-o", "--output", type=Path, default=Path("attention.png"),
                      help="a .png or .svg file (default attention.png)")  # fmt: skip
    plot.set_defaults(command=run_plot)

    bench = commands.add_parser(
        "bench", help="speed and memory beside textbook NumPy and PyTorch",
        description="Runs the benchmark (minutes), prints the table and writes JSON, a "
        "markdown table and a chart of time and peak memory against sequence length.",
    )  # fmt: skip
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats and lengths")
    size.add_argument("--smoke", action="store_true", help="tiny sizes in seconds: checks set-up")
    bench.add_argument(
        "--output", type=Path, help="folder for benchmark.json, .md and .png "
        "(default benchmarks/results, or benchmarks/results-quick/-smoke)",
    )  # fmt: skip
    bench.add_argument("--readme", type=Path, help="rewrite this README's benchmark section")
    bench.set_defaults(command=run_bench)

    check = commands.add_parser(
        "check", help="compare with PyTorch on random configurations",
        description="Runs mha and torch on random configurations (every mask kind, float64 "
        "and float32) and prints the worst relative error of each. Needs torch installed.",
    )  # fmt: skip
    check.add_argument("--configs", type=_count(1), default=24, help="how many (default 24)")
    check.add_argument("--seed", type=_count(0), default=0, help="seed of the configurations")
    check.set_defaults(command=run_check)
    return parser


def _masking_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--causal", action="store_true", help="causal (look-ahead) mask")
    parser.add_argument(
        "--top-left", action="store_true",
        help="with --causal: align the mask top-left (j <= i) instead of bottom-right",
    )  # fmt: skip
    parser.add_argument("--window", type=_count(1), metavar="N",
                        help="sliding window: each query sees at most N keys back")  # fmt: skip
    parser.add_argument("--key-lengths", type=_lengths, metavar="N,N,...",
                        help="valid keys per sequence; later keys are padding")  # fmt: skip
    parser.add_argument("--query-lengths", type=_lengths, metavar="N,N,...",
                        help="valid queries per sequence; later rows are padding")  # fmt: skip


def _count(least: int) -> Any:
    """An argparse type: a whole number of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
        return value

    return parse


def as_options(message: str) -> str:
    """A library message with its keyword names turned into the options typed here."""

    def option(match: re.Match[str]) -> str:
        return _OPTIONS[match.group(1)] + (" " if match.group(2) else "")

    return re.sub(r"\b(" + "|".join(_OPTIONS) + r")\b(=)?", option, message)


def _lengths(text: str) -> np.ndarray:
    try:
        return np.array([int(part) for part in text.split(",")], dtype=np.int64)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, got {text!r}"
        ) from None


# ----------------------------------------------------------------------------- mha run


def run_run(args: argparse.Namespace) -> int:
    inputs = {"the input": args.input, "--module": args.module}
    _check_output(args.output, "--output", inputs)
    if args.weights is not None:
        _check_output(args.weights, "--weights", {**inputs, "--output": args.output})
    out, weights, _ = _attend(args, want_weights=args.weights is not None)
    _save_npy(args.output, out)
    if args.weights is not None:
        _save_npy(args.weights, weights)
    also = f" and {args.weights} {weights.shape}" if args.weights is not None else ""
    print(f"wrote {args.output} {out.shape} {out.dtype}{also}")
    return 0


def _attend(args: argparse.Namespace, want_weights: bool) -> tuple[np.ndarray, Any, Any]:
    """Attention on the arrays of ``args.input``, as ``mha run`` and ``mha plot`` read it:
    ``(out, weights or None, visible or None)``, ``visible`` being where the masks let each
    query see each key, shaped like the weights."""
    arrays = _read_npz(args.input)
    module = None
    if args.module is not None:
        _refuse_unknown(args.input, arrays, ("X",), "with --module")
        if "X" not in arrays:
            raise UsageError(
                f"{args.input} has no 'X' to give --module (it holds {_listing(arrays)})"
            )
        module = MultiHeadAttention.load(args.module)
        if args.heads is not None and args.heads != module.num_heads:
            raise UsageError(f"--heads {args.heads} but {args.module} has {module.num_heads} heads")
        Q = K = arrays["X"]
        heads = module.num_heads
    else:
        _refuse_unknown(args.input, arrays, DATA_KEYS + BIAS_KEYS, "")
        missing = [key for key in DATA_KEYS if key not in arrays]
        if missing:
            raise UsageError(
                f"{args.input} has no {', '.join(repr(k) for k in missing)} "
                f"(it holds {_listing(arrays)}); it needs {', '.join(DATA_KEYS)}, "
                "or X with --module"
            )
        if args.heads is None:
            raise UsageError("--heads is required unless --module gives a saved module")
        Q, K, W_q = arrays["Q"], arrays["K"], arrays["W_q"]
        if W_q.ndim == 2 and W_q.shape[1] == 0:
            raise UsageError(
                f"W_q in {args.input} has no columns (W_q {W_q.shape}): each head needs "
                "queries and keys at least 1 wide"
            )
        heads = args.heads
    if args.top_left and not (args.causal or args.window):
        raise UsageError("--top-left aligns the causal mask: use it with --causal or --window")
    keywords: dict[str, Any] = {"causal": args.causal, "return_weights": want_weights}
    if args.window is not None:
        if module is not None:
            raise UsageError(
                f"--window is for arrays given with their weights; {args.module} records its "
                f"own window ({module.window})"
            )
        keywords["window"] = args.window
    if args.top_left:
        keywords["causal_alignment"] = "top_left"
    for name in ("key_lengths", "query_lengths"):
        keywords[name] = _lengths_for(getattr(args, name), name, np.shape(Q))
    if module is not None:
        result = module(arrays["X"], **keywords)
    else:
        for name in BIAS_KEYS:
            if name in arrays:
                keywords[name] = arrays[name]
        Q, K, V, W_q, W_k, W_v, W_o = (arrays[key] for key in DATA_KEYS)
        result = multi_head_attention(Q, K, V, W_q, W_k, W_v, W_o, heads, **keywords)
    out, weights = result if want_weights else (result, None)
    visible = None
    if weights is not None:
        shape = np.shape(Q)
        allowed = Visibility.build(
            batch_shape=shape[:-2], H=heads, L=shape[-2], S=np.shape(K)[-2],
            causal=args.causal, causal_alignment=keywords.get("causal_alignment"),
            window=args.window if module is None else module.window,
            key_lengths=keywords["key_lengths"], query_lengths=keywords["query_lengths"],
        ).allowed()  # fmt: skip
        extra = weights.shape[-1] - allowed.shape[-1]  # the module's bias_k / zero key
        rows = np.ones(shape[-2], dtype=bool)  # every query row sees the extra keys ...
        if keywords["query_lengths"] is not None:  # ... unless it is padding
            rows = np.arange(shape[-2]) < np.asarray(keywords["query_lengths"])[..., None]
        extra_columns = np.broadcast_to(rows[..., None, :, None], (*allowed.shape[:-1], extra))
        visible = np.concatenate([allowed, extra_columns], axis=-1)
    return out, weights, visible


def _lengths_for(lengths: np.ndarray | None, name: str, shape: tuple[int, ...]) -> Any:
    """``--key-lengths``/``--query-lengths`` as the library takes them: one length per
    sequence, or a single number for unbatched ``(L, d)`` inputs."""
    if lengths is None:
        return None
    option = _OPTIONS[name]
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


def _refuse_unknown(
    path: Path, arrays: dict[str, np.ndarray], known: Sequence[str], how: str
) -> None:
    """An entry mha would not use is a mistake (a misspelt bias, say): never ignore it."""
    for name in arrays:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(
                f"{path} has an entry {name!r} that mha run {how + ' ' if how else ''}does not "
                f"use (it reads {', '.join(known)}){hint}"
            )


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    arrays = read_arrays(path, "an .npz file of named arrays")
    if not isinstance(arrays, dict):
        raise UsageError(f"{path} holds one array; mha reads an .npz file of named arrays")
    return arrays


def _listing(arrays: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{name} {array.shape}" for name, array in arrays.items()) or "nothing"


def _check_output(target: Path, option: str, inputs: dict[str, Path | None]) -> None:
    """Before any work: ``target`` is writable and is none of the files named in ``inputs``
    (``{option or role: path}``)."""
    for role, source in inputs.items():
        if source is not None and _same_file(target, source):
            raise UsageError(f"{option} {target} is the same file as {role}; choose another name")
    problem = writable_problem(target)
    if problem:
        raise UsageError(f"cannot write {option} {target}: {problem}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def _save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda handle: np.save(handle, array, allow_pickle=False))


def _plot_format(path: Path, option: str) -> None:
    if path.suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"{option} {path}: plots are written as .png or .svg")


# ----------------------------------------------------------------------------- mha plot


def run_plot(args: argparse.Namespace) -> int:
    plotting = _needs("mha.cli.plots", "matplotlib")
    _check_output(
        args.output, "--output",
        {"--weights": args.weights, "--input": args.input, "--module": args.module},
    )  # fmt: skip
    _plot_format(args.output, "--output")
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
        _, weights, visible = _attend(args, want_weights=True)
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
    path = plotting.plot_attention(weights, args.output, visible=visible, query_tokens=tokens,
                                   key_tokens=key_tokens)  # fmt: skip
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


def _needs(module: str, *requirements: str) -> Any:
    """Import an optional dependency of a command, or say how to install it."""
    for requirement in requirements:
        try:
            importlib.import_module(requirement)
        except ImportError:
            raise UsageError(
                f"this command needs {requirement}, which is not installed: {INSTALL_CLI}"
            ) from None
    return importlib.import_module(module)


# ----------------------------------------------------------------------------- mha demo


def run_demo(args: argparse.Namespace) -> int:
    plot_attention = _needs("mha.cli.plots", "matplotlib", "rich").plot_attention
    from rich.console import Console

    _plot_format(args.output, "--output")
    _check_output(args.output, "--output", {})
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
        console.rule("causal mask: key j is hidden from query i when j > i" if causal else
                     "no mask")  # fmt: skip
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
        console.print(f"mha.multi_head_attention gives the same output: max difference "
                      f"{difference:.1e}\n")  # fmt: skip
    path = plot_attention(library_weights[0], args.output, title="causal attention, 2 heads")
    console.print(f"wrote the causal attention map to [bold]{path}[/bold]")
    return 0


# ----------------------------------------------------------------------------- mha bench


def run_bench(args: argparse.Namespace) -> int:
    bench = _needs("mha.cli.bench", "matplotlib", "rich")
    from rich.console import Console
    from rich.progress import Progress

    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    output = args.output or bench.default_output(size)
    problem = writable_problem(output, folder=True)
    if problem:
        raise UsageError(f"cannot write --output {output}: {problem}")
    if args.readme is not None:
        if size != "full":
            raise UsageError(f"--readme takes a full run's results only; drop --{size}")
        bench.check_readme(args.readme)
        problem = writable_problem(args.readme)
        if problem:
            raise UsageError(f"cannot rewrite --readme {args.readme}: {problem}")
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as progress:
        chosen = bench.plan(size)
        task = progress.add_task("benchmark", total=bench.steps(chosen))

        def log(line: str) -> None:
            progress.console.print(line)
            progress.advance(task)

        child = [f"--{size}"] if size != "full" else []
        results = bench.run(chosen, output, args.readme, log, child)
    print(bench.markdown(results))
    chart = output / "benchmark.png"
    bench.chart(results, chart)
    print(f"wrote {output / 'benchmark.json'}, {output / 'benchmark.md'} and {chart}")
    return 0


# ----------------------------------------------------------------------------- mha check


def run_check(args: argparse.Namespace) -> int:
    _needs("rich", "rich")
    try:
        import torch
    except ImportError:
        print("mha check: torch is not installed, so there is nothing to compare against. "
              f"Install its CPU build with: {TORCH_CPU}", file=sys.stderr)  # fmt: skip
        return 1
    from rich.console import Console
    from rich.table import Table

    from .check import compare

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


def entry() -> None:
    """The console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    entry()
