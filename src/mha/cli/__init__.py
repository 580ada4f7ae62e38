"""The ``mha`` command: ``demo``, ``run``, ``plot``, ``bench``, ``check`` and ``generate``, one
module each.

Every mistake a user can make on the command line ends in one line on standard error and
exit code 2; outputs are written atomically and never over an input file.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .. import __version__
from .._files import UnreadableFileError
from ..errors import AttentionError
from ._common import EXIT_USAGE, INSTALL_CLI, Parser, UsageError, as_options

__all__ = ["build_parser", "entry", "main"]


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
    # Imported here, not when the package is: ``python -m mha.cli.bench`` then runs a module
    # that nothing imported before it.
    from . import bench, check, demo, generate, plot, run

    for command in (demo, run, plot, bench, check, generate):
        command.add_parser(commands)
    return parser


def entry() -> None:
    """The console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    entry()
