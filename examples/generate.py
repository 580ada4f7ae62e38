"""Whole decoder-only language models in NumPy, with mha's attention and KV cache, greedily:
a short script on top of :mod:`mha.models` (``mha generate`` on the command line).

It reads a directory written by transformers' ``save_pretrained`` (``config.json`` and
``model.safetensors``, or the shards of ``model.safetensors.index.json``; bfloat16 or
float32) or a llama.cpp GGUF file, one layer's tensors at a time. Each layer's attention is
``mha.MultiHeadAttention.from_pretrained(path, layer=i)`` (``mha.LatentAttention`` for
DeepSeek-V3); the rest of each family's decoder layer is in :mod:`mha.models.decoder` (the
families: :data:`mha.models.FAMILIES`). A config it cannot compute exactly is refused,
naming the setting, never approximated.

    python examples/generate.py MODEL 1 2 3 --new-tokens 20 [--dtype float64]
                                [--cache paged|int8|int4|kivi8|kivi4]
    python examples/generate.py MODEL --text "What is the capital of France?" --chat

prints the new token ids (text with ``--text``, which needs ``pip install 'mha[models]'``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mha.models import CACHES, Decoder, UnsupportedModelError, attention_layer, load

__all__ = ["CACHES", "Decoder", "UnsupportedModelError", "attention_layer", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, with every mistake in one line on standard error (exit code 2)."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a save_pretrained directory or a .gguf file")
    parser.add_argument("prompt", type=int, nargs="*", help="prompt token ids")
    parser.add_argument("--text", help="a text prompt instead of ids")
    parser.add_argument("--chat", action="store_true", help="--text in the chat template")
    parser.add_argument("--new-tokens", type=int, default=20, help="how many (default 20)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="the compute dtype (default float32)",
    )
    parser.add_argument("--cache", choices=CACHES, default="contiguous",
                        help="the KV cache: contiguous (default), paged, int8, int4, kivi8 "
                             "or kivi4")  # fmt: skip
    args = parser.parse_intermixed_args(argv)
    if args.new_tokens < 0:
        parser.error(f"--new-tokens must be 0 or more; got {args.new_tokens}")
    if (args.text is None) == (not args.prompt):
        parser.error("give prompt token ids or --text, one of them")
    try:
        if args.text is None:
            decoder = Decoder(args.model, dtype=args.dtype, cache=args.cache)
            tokens, _ = decoder.generate(args.prompt, args.new_tokens)
            print(" ".join(map(str, tokens)))
            return 0
        model = load(args.model, dtype=args.dtype, cache=args.cache)
        for piece in model.stream(args.text, args.new_tokens, chat=args.chat):
            print(piece, end="", flush=True)
        print()
    except (ValueError, OSError, ImportError) as error:  # a model it cannot compute or read
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
