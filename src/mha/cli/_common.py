"""What the commands of ``mha`` share: one-line usage errors, the option types, the masking
options, and reading and writing files safely.

Every mistake a user can make on the command line ends in one line on standard error and
exit code 2; outputs are written atomically and never over an input file.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .._files import atomic_write, read_arrays, writable_problem

EXIT_USAGE = 2
DATA_KEYS = ("Q", "K", "V", "W_q", "W_k", "W_v", "W_o")
BIAS_KEYS = ("b_q", "b_k", "b_v", "b_o")
INSTALL_CLI = 'pip install ".[cli]" in the mha checkout, or pip install matplotlib rich'
TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
INPUT_ONLY = ("heads", "module", "causal", "top_left", "window", "key_lengths", "query_lengths")

# The library's keyword names, as the options a user types on the command line.
OPTIONS = {
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


def masking_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--causal", action="store_true", help="causal (look-ahead) mask")
    parser.add_argument(
        "--top-left",
        action="store_true",
        help="with --causal: align the mask top-left (j <= i) instead of bottom-right",
    )
    parser.add_argument(
        "--window",
        type=count(1),
        metavar="N",
        help="sliding window: each query sees at most N keys back",
    )
    parser.add_argument(
        "--key-lengths",
        type=lengths,
        metavar="N,N,...",
        help="valid keys per sequence; later keys are padding",
    )
    parser.add_argument(
        "--query-lengths",
        type=lengths,
        metavar="N,N,...",
        help="valid queries per sequence; later rows are padding",
    )


def count(least: int) -> Any:
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
        return OPTIONS[match.group(1)] + (" " if match.group(2) else "")

    return re.sub(r"\b(" + "|".join(OPTIONS) + r")\b(=)?", option, message)


def lengths(text: str) -> np.ndarray:
    try:
        return np.array([int(part) for part in text.split(",")], dtype=np.int64)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, got {text!r}"
        ) from None


def refuse_unknown(
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


def read_npz(path: Path) -> dict[str, np.ndarray]:
    arrays = read_arrays(path, "an .npz file of named arrays")
    if not isinstance(arrays, dict):
        raise UsageError(f"{path} holds one array; mha reads an .npz file of named arrays")
    return arrays


def listing(arrays: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{name} {array.shape}" for name, array in arrays.items()) or "nothing"


def check_output(target: Path, option: str, inputs: dict[str, Path | None]) -> None:
    """Before any work: ``target`` is writable and is none of the files named in ``inputs``
    (``{option or role: path}``)."""
    for role, source in inputs.items():
        if source is not None and same_file(target, source):
            raise UsageError(f"{option} {target} is the same file as {role}; choose another name")
    problem = writable_problem(target)
    if problem:
        raise UsageError(f"cannot write {option} {target}: {problem}")


def same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda handle: np.save(handle, array, allow_pickle=False))


def plot_format(path: Path, option: str) -> None:
    if path.suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"{option} {path}: plots are written as .png or .svg")


def needs(module: str, *requirements: str) -> Any:
    """Import an optional dependency of a command, or say how to install it."""
    for requirement in requirements:
        try:
            importlib.import_module(requirement)
        except ImportError:
            raise UsageError(
                f"this command needs {requirement}, which is not installed: {INSTALL_CLI}"
            ) from None
    return importlib.import_module(module)
