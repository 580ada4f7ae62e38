"""``mha generate``: a whole model (a ``save_pretrained`` folder or a llama.cpp GGUF file)
answers a prompt, greedily, its text streamed as it is generated (:mod:`mha.models`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ._common import UsageError, count


def add_parser(commands: Any) -> None:
    """``mha generate``'s options, on the subcommand parsers ``commands``."""
    generate = commands.add_parser(
        "generate",
        help="a whole language model answers a prompt, streamed",
        description="Reads a model (a folder written by transformers' save_pretrained, or a "
        "llama.cpp .gguf file) and its tokenizer, and continues --prompt greedily with mha's "
        "attention, printing the text as it comes, then the prompt's time and the tokens per "
        "second on standard error. Needs pip install 'mha[models]' for GGUF files, tokenizers "
        "and chat templates.",
    )
    generate.add_argument("--model", type=Path, required=True, help="a folder or a .gguf file")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt's text")
    prompt.add_argument(
        "--prompt-ids", type=count(0), nargs="+", metavar="ID", help="the prompt's token ids"
    )
    generate.add_argument(
        "--chat", action="store_true", help="the prompt as a user's message, in the chat template"
    )
    generate.add_argument(
        "--ids", action="store_true", help="print the new token ids, one line, not the text"
    )
    generate.add_argument(
        "--max-new-tokens", type=count(0), default=64, help="at most this many (default 64)"
    )
    generate.add_argument(
        "--no-stop", action="store_true", help="go on past the end-of-sequence token"
    )
    generate.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32",
        help="the compute dtype (default float32)",
    )  # fmt: skip
    generate.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    from ..models import load

    if args.chat and args.prompt is None:
        raise UsageError("mha generate: --chat takes a text --prompt, not --prompt-ids")
    model = load(args.model, dtype=args.dtype)
    prompt = args.prompt if args.prompt is not None else list(args.prompt_ids)
    new = model.ids(prompt, args.max_new_tokens, chat=args.chat, stop=not args.no_stop)
    if args.ids or model.tokenizer is None:
        print(" ".join(str(token) for token in new), flush=True)
    else:
        for piece in model.tokenizer.stream(new):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    timing = model.timing
    print(
        f"prompt: {timing.prompt_tokens} tokens in {timing.prompt_seconds:.2f} s; "
        f"{timing.new_tokens} new tokens, {timing.tokens_per_second:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0
