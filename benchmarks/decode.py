"""Decoding speed: one token against a long KV cache, and a whole generation.

    python benchmarks/decode.py                    # results in benchmarks/results/decode.*
    python benchmarks/decode.py --readme README.md # and the README's decoding table
    python benchmarks/decode.py --quick            # fewer repeats and lengths

1. One decoding step (B=1, 32 query heads, 8 key/value heads, head_dim 128, float32)
   against S cached keys: mha's ``scaled_dot_product_attention`` with every core and with one
   worker, with ``window=4096``, and PyTorch's ``F.scaled_dot_product_attention(...,
   enable_gqa=True)`` on the same tensors; beside the memory floor, the bytes of K and V
   divided by this machine's bandwidth (a large ``np.sum``, on one thread and on every
   core). Medians of interleaved runs.
2. The example decoder (``examples/generate.py``) against transformers' ``generate`` on
   the same random Llama-style model: a 64-token prompt and 256 generated tokens.

Where the environment sets ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` (which hold OpenBLAS
to an older kernel), the measurement is repeated in a child process without them, and both
are reported.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import mha
from mha._kernel.team import cores
from mha.cli.measure import (
    WARM,
    bandwidth,
    environment,
    interleaved_medians,
    measured_on,
    readme_script,
)

ROOT = Path(__file__).parent.parent
H, H_KV, D = 32, 8, 128
LENGTHS = [1024, 4096, 16384, 32768]
WINDOW = 4096
DECODE_BEGIN, DECODE_END = "<!-- decode: begin -->", "<!-- decode: end -->"


CONSECUTIVE = 8


def steady_steps(steps: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Seconds per step of each of ``steps``, in steady state: in each round, in turn
    (the order rotating), each runs steps untimed for ``WARM`` seconds (``CONSECUTIVE`` at
    least), then ``CONSECUTIVE`` timed ones, as a decoding loop runs them back to back. The
    rounds are 0.3 s apart, so that torch's OpenMP threads, which spin after its steps, have
    stopped before the next implementation's turn. (With no pause, the rotation put mha's
    two-worker run right after torch's in three rounds of four, and its median came out 35%
    above the same call's with ``window=4096``; with a pause and no untimed steps, every run
    began with cold threads and caches, which cost torch's steps twice what they cost back
    to back. With 8 untimed steps, two threads had not yet reached full speed at 4,096 keys:
    on the README's virtual machine, for some tens of milliseconds after a pause two threads
    each ran at about half speed (a 2-worker layer call's every phase took one worker's
    time), so 16 steps of 1.6 ms fell within it: 2.83 ms a step on two workers against 2.28
    on one; after 60 untimed steps 0.92 against 1.66, and 0.95 against 1.69 with no pause.)"""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            time.sleep(0.3)
            warm, untimed = time.perf_counter(), 0
            while untimed < CONSECUTIVE or time.perf_counter() - warm < WARM:
                steps[name]()
                untimed += 1
            start = time.perf_counter()
            for _ in range(CONSECUTIVE):
                steps[name]()
            times[name].append((time.perf_counter() - start) / CONSECUTIVE)
    return times


def decode_step(torch: Any, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for S in lengths:
        q = rng.standard_normal((1, H, 1, D), dtype=np.float32)
        k, v = (rng.standard_normal((1, H_KV, S, D), dtype=np.float32) for _ in range(2))
        steps = {
            "mha": lambda q=q, k=k, v=v: mha.scaled_dot_product_attention(q, k, v),
            "mha, 1 worker": lambda q=q, k=k, v=v: mha.scaled_dot_product_attention(
                q, k, v, workers=1
            ),
            f"mha, window={WINDOW}": lambda q=q, k=k, v=v: mha.scaled_dot_product_attention(
                q, k, v, causal=True, window=WINDOW
            ),
        }
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            steps["torch"] = lambda tq=tq, tk=tk, tv=tv: (
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
            )
        times = steady_steps(steps, repeats)
        rows.append({
            "S": S, "kv_bytes": k.nbytes + v.nbytes,
            "seconds": {name: float(np.median(t)) for name, t in times.items()},
            "all_seconds": times,
        })  # fmt: skip
    return rows


def readme_model(torch: Any, transformers: Any) -> Any:
    """The README's random Llama-style model (``tests/test_generate.py`` takes it from
    here): hidden 512, 4 layers, 8 heads, 2 key/value heads, vocabulary 8000, drawn at
    ``initializer_range=0.3`` from seed 0."""
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=8000, max_position_embeddings=1024,
        initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def generation(torch: Any, transformers: Any, prompt_length: int, new_tokens: int) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    from generate import Decoder

    model = readme_model(torch, transformers)
    prompt = np.random.default_rng(0).integers(0, 8000, prompt_length).tolist()
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        decoder = Decoder(directory)

    runs: dict[str, list[Any]] = {"mha": [], "transformers": []}

    def ours() -> None:
        runs["mha"].append(decoder.generate(prompt, new_tokens))

    def theirs() -> None:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        runs["transformers"].append(list(out[0, prompt_length:].tolist()))

    times = interleaved_medians({"mha": ours, "transformers": theirs}, 3, pause=0.2)
    result: dict[str, Any] = {
        "prompt": prompt_length, "new_tokens": new_tokens,
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
    }  # fmt: skip
    # Every run's tokens, compared; where the first pair differs, how close the two best
    # logits were there (a near tie, which float32 rounding can tip, or a real difference).
    first = next(
        (i for i, (a, b) in enumerate(zip(runs["mha"][0][0], runs["transformers"][0],
                                           strict=True)) if a != b), None,
    )  # fmt: skip
    result["same_tokens"] = (
        first is None
        and all(run[0] == runs["mha"][0][0] for run in runs["mha"])
        and all(run == runs["transformers"][0] for run in runs["transformers"])
    )
    if first is not None:
        best = np.sort(runs["mha"][0][1][first])[-2:]
        result["first_difference"] = {"step": first, "top_two_logits": best.tolist()}
    return result


def measure(quick: bool) -> dict[str, Any]:
    try:
        import torch
        import transformers
    except ImportError:
        torch = transformers = None
    else:
        torch.set_num_threads(cores())
    threads = cores()
    results: dict[str, Any] = {
        "environment": environment(torch),
        "bandwidth": {"1 thread": bandwidth(1), f"{threads} threads": bandwidth(threads)},
        "decode": decode_step(torch, LENGTHS[:3] if quick else LENGTHS, 5 if quick else 15),
    }
    if torch is not None:
        results["generation"] = generation(torch, transformers, 64, 64 if quick else 256)
    return results


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        bw = results["bandwidth"]
        best = max(bw.values())
        lines += [
            measured_on(results["environment"])
            + "Memory bandwidth from `np.sum`: "
            + ", ".join(f"{v / 1e9:.1f} GB/s on {k}" for k, v in bw.items())
            + "; the floor uses the larger. One token, B=1, 32 query heads, 8 key/value "
            "heads, head_dim 128, float32; medians of interleaved runs 0.3 s apart, each of 8 "
            f"consecutive steps timed after untimed ones for {WARM:g} s (8 at least), ms per "
            "token.",
            "",
            "| cached keys S | mha | mha, 1 worker | torch SDPA (GQA) | floor | mha / torch "
            f"| mha / floor | 2 workers vs 1 | mha, window={WINDOW} |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["decode"]:
            s = row["seconds"]
            floor = row["kv_bytes"] / best
            torch_ms = f"{s['torch'] * 1e3:.2f}" if "torch" in s else "n/a"
            vs_torch = f"{s['mha'] / s['torch']:.2f}" if "torch" in s else "n/a"
            lines.append(
                f"| {row['S']:,} | {s['mha'] * 1e3:.2f} | {s['mha, 1 worker'] * 1e3:.2f} "
                f"| {torch_ms} | {floor * 1e3:.2f} | {vs_torch} | {s['mha'] / floor:.2f} "
                f"| {s['mha, 1 worker'] / s['mha']:.2f}x | {s[f'mha, window={WINDOW}'] * 1e3:.2f} |"
            )
        if "generation" in results:
            g = results["generation"]
            s = g["seconds"]
            lines += [
                "",
                f"Whole generation with `examples/generate.py` (a random Llama-style model: "
                f"hidden 512, 4 layers, 8 heads, 2 key/value heads, vocabulary 8000, float32), "
                f"a {g['prompt']}-token prompt and {g['new_tokens']} greedy tokens: mha "
                f"{s['mha']:.2f} s, transformers `generate` {s['transformers']:.2f} s "
                f"(mha / transformers {s['mha'] / s['transformers']:.2f}); the same tokens in "
                f"every run: {'yes' if g['same_tokens'] else 'NO'}"
                + (
                    f", first different at step {g['first_difference']['step']}, where mha's "
                    f"two best logits were {g['first_difference']['top_two_logits']}"
                    if "first_difference" in g
                    else ""
                )
                + ".",
            ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return readme_script(
        argv,
        __doc__,
        __file__,
        measure,
        "decode",
        markdown,
        (DECODE_BEGIN, DECODE_END),
        per_cpu=True,
    )


if __name__ == "__main__":
    sys.exit(main())
