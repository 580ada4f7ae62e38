"""Serving many sequences: decoding steps over a padded cache and over a paged one.

    python benchmarks/serving.py                     # results in benchmarks/results/serving.*
    python benchmarks/serving.py --readme docs/benchmarks.md  # and its table in docs/benchmarks.md
    python benchmarks/serving.py --quick             # fewer repeats, shorter sequences

64 sequences (32 query heads, 8 key/value heads, head dim 128, float32):

1. Lengths spread evenly between 128 and 8,192 tokens. ``mha.KVCache`` must hold every
   sequence padded to the longest; ``mha.PagedKVCache`` (blocks of 16) holds the tokens
   in blocks, in float32 and quantized to int8 and int4 (groups of 32), and KIVI's kivi8
   and kivi4 (keys per channel over groups of 32 tokens, in blocks of 32; a spare block
   for each sequence whose step fills a group: truncated back, it lies inside a quantized
   group, which the next step reopens in a copy of its block). Memory of each
   cache's buffers against the float32 bytes of the tokens actually held, and the time of
   one decoding step (each sequence one new token: one
   ``scaled_dot_product_attention(..., cache=)`` call, the caches truncated back after it).
2. The same step with every sequence at the same length, where padding costs nothing: the
   paged cache's time against the contiguous cache's.

The caches are filled directly (``PagedKVCache.append``; the KVCache's buffers written in
place), not by attending over the prompts. Medians of interleaved runs. Where the environment sets
``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE``, the measurement is repeated in a child process
without them, and both are reported.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import mha
from mha.cli.measure import (
    environment,
    interleaved_medians,
    measured_on,
    readme_script,
)

BEGIN, END = "<!-- serving: begin -->", "<!-- serving: end -->"
B, H, H_KV, D, BLOCK = 64, 32, 8, 128, 16
TOKEN_BYTES = 2 * H_KV * D * 4  # a token's key and value, float32
QUANTIZED = ("int8", "int4", "kivi8", "kivi4")
KIVI_BLOCK = 32  # KIVI's key groups of 32 tokens lie within blocks


def block_size(kind: str | None) -> int:
    return KIVI_BLOCK if kind is not None and kind.startswith("kivi") else BLOCK


def caches(lengths: np.ndarray, rng: np.random.Generator, quantized: tuple[str, ...] = ()
           ) -> tuple[mha.KVCache, list[mha.PagedKVCache]]:  # fmt: skip
    """A KVCache and PagedKVCaches (float32, then each of ``quantized``) holding the same
    random keys and values."""
    longest = int(lengths.max())
    contiguous = mha.KVCache(B, H_KV, D, capacity=longest + 1, dtype=np.float32)
    paged = []
    for kind in (None, *quantized):
        size = block_size(kind)
        blocks = int(sum(-(-(int(n) + 1) // size) for n in lengths))  # room for the next token
        spare = sum(int((n + 1) % size == 0) for n in lengths) if size == KIVI_BLOCK else 0
        paged.append(mha.PagedKVCache(blocks + spare, size, H_KV, D, quantize=kind))
    for b, n in enumerate(lengths):
        k, v = (rng.standard_normal((H_KV, int(n), D), dtype=np.float32) for _ in range(2))
        for cache in paged:
            cache.add(b)
            cache.append(b, k, v)
        contiguous._k[b, :, :n], contiguous._v[b, :, :n] = k, v  # in place, without attending
        contiguous._lengths[b] = n
    return contiguous, paged


def step_functions(contiguous: mha.KVCache, paged: list[mha.PagedKVCache],
                   rng: np.random.Generator) -> dict[str, Any]:  # fmt: skip
    q = rng.standard_normal((B, H, 1, D), dtype=np.float32)
    k, v = (rng.standard_normal((B, H_KV, 1, D), dtype=np.float32) for _ in range(2))
    before = contiguous.lengths.copy()

    def step_contiguous() -> None:
        mha.scaled_dot_product_attention(q, k, v, cache=contiguous)
        contiguous.truncate(before)

    def stepper(cache: mha.PagedKVCache) -> Any:
        def step_paged() -> None:
            mha.scaled_dot_product_attention(q, k, v, cache=cache)
            for b, n in enumerate(before):
                cache.truncate(b, int(n))

        return step_paged

    steps = {"KVCache": step_contiguous, "PagedKVCache": stepper(paged[0])}
    for cache, name in zip(paged[1:], QUANTIZED, strict=False):
        steps[f"PagedKVCache {name}"] = stepper(cache)
    return steps


def measure(quick: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    longest, repeats = (2048, 3) if quick else (8192, 7)
    spread = np.linspace(128, longest, B).astype(np.int64)
    results: dict[str, Any] = {"environment": environment(None), "longest": longest}
    contiguous, paged = caches(spread, rng, QUANTIZED)
    times = interleaved_medians(step_functions(contiguous, paged, rng), repeats, pause=0.1)
    held = int(spread.sum()) * TOKEN_BYTES
    sizes = {"KVCache": contiguous.nbytes, "PagedKVCache": paged[0].nbytes}
    sizes.update({f"PagedKVCache {name}": cache.nbytes
                  for name, cache in zip(QUANTIZED, paged[1:], strict=True)})  # fmt: skip
    results["spread"] = {
        "tokens": int(spread.sum()), "token_bytes": held, "bytes": sizes,
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "all_seconds": times,
    }  # fmt: skip
    del contiguous, paged
    equal = np.full(B, longest // 4, np.int64)
    contiguous, paged = caches(equal, rng)
    functions = step_functions(contiguous, paged, rng)
    times = interleaved_medians(functions, repeats, pause=0.1)
    results["equal"] = {
        "length": int(equal[0]),
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "all_seconds": times,
    }  # fmt: skip
    return results


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        spread, equal = results["spread"], results["equal"]
        held = spread["token_bytes"]
        lines += [
            measured_on(results["environment"])
            + f"{B} sequences, {H} query heads, {H_KV} key/value heads, head dim {D}, float32; "
            f"one decoding step (one new token each), medians of interleaved runs.",
            "",
            "| cache | lengths | memory | memory / the tokens held in float32 | ms per step |",
            "|---|---|---:|---:|---:|",
        ]
        rows = [
            ("KVCache", "`KVCache`, padded to the longest"),
            ("PagedKVCache", f"`PagedKVCache`, blocks of {BLOCK}"),
        ]
        rows += [(f"PagedKVCache {name}", f"`PagedKVCache(quantize=\"{name}\")`, groups of 32"
                  + ("" if block_size(name) == BLOCK else f", blocks of {block_size(name)}"))
                 for name in QUANTIZED if f"PagedKVCache {name}" in spread["bytes"]]  # fmt: skip
        for name, label in rows:
            memory = spread["bytes"][name]
            lines.append(
                f"| {label} | 128 to {results['longest']:,} | "
                f"{memory / 2**30:.2f} GiB | {memory / held:.2f} | "
                f"{spread['seconds'][name] * 1e3:.1f} |"
            )
        e = equal["seconds"]
        lines += [
            "",
            f"Tokens held: {spread['tokens']:,} ({held / 2**30:.2f} GiB). Every sequence at "
            f"{equal['length']:,} tokens: `PagedKVCache` {e['PagedKVCache'] * 1e3:.1f} ms, "
            f"`KVCache` {e['KVCache'] * 1e3:.1f} ms per step (paged / contiguous "
            f"{e['PagedKVCache'] / e['KVCache']:.2f}).",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return readme_script(argv, __doc__, __file__, measure, "serving", markdown, (BEGIN, END))


if __name__ == "__main__":
    sys.exit(main())
