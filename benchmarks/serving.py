"""Serving many sequences: decoding steps over a padded cache and over a paged one.

    python benchmarks/serving.py                     # results in benchmarks/results/serving.*
    python benchmarks/serving.py --readme docs/benchmarks.md  # and its table in docs/benchmarks.md
    python benchmarks/serving.py --quick             # fewer repeats, shorter sequences

64 sequences (32 query heads, 8 key/value heads, head dim 128, float32):

1. Lengths spread evenly between 128 and 8,192 tokens. ``mha.KVCache`` must hold every
   sequence padded to the longest; ``mha.PagedKVCache`` (blocks of 16) holds the tokens
   in blocks, in float32, in bfloat16, quantized to int8, int4 and float8 e4m3 (groups of
   32), and KIVI's kivi8 and kivi4 (keys per channel over groups of 32 tokens, in blocks of
   32; a spare block for each sequence whose step fills a group: truncated back, it lies
   inside a quantized group, which the next step reopens in a copy of its block). Memory of
   each cache's buffers against the float32 bytes of the tokens actually held, the time of
   one decoding step (each sequence one new token: one
   ``scaled_dot_product_attention(..., cache=)`` call, the caches truncated back after it),
   each cache's step against the float32 paged cache's, and against its own floor: the
   bytes the step must read (every held token's codes, scales and zero points, KIVI's
   float32 residual) over this machine's memory bandwidth (``np.sum`` of 0.5 GiB on every
   core), and against the larger of that and the step's multiply-adds (``2 H d`` per held
   token, scores and values, whatever the cache holds) at this machine's float32 GEMM rate
   (NumPy's BLAS on every core, with the kernel it runs: held to an older one where the
   environment sets ``OPENBLAS_CORETYPE``, the rate is lower and this floor higher).
2. The same step with every sequence at the same length, where padding costs nothing: the
   paged cache's time against the contiguous cache's.
3. The step with 1 to 4 query rows per key/value head (8, 16, 24 and 32 query heads: a
   multi-head model's one row, a grouped-query model's few), 32 sequences of 128 to 4,096
   tokens: each paged cache's time against the float32 one's at as many rows.
4. Item 3's step at 4 rows per head with each sequence's blocks in one run (appended at
   once, as items 1 to 3 fill them) and with the sequences' blocks interleaved one block at
   a time (as sequences that grow together take them): the CPU's own prefetcher follows a
   run; the walks ask for the blocks ahead of an interleaved one.

The caches are filled directly (``PagedKVCache.append``; the KVCache's buffers written in
place), not by attending over the prompts. Medians of interleaved runs, each timed step
after 0.1 s of untimed ones (``mha.cli.measure.WARM``: on a VM, two threads run at half
speed for tens of ms after a pause). Where the environment sets
``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE``, the measurement is repeated in a child process
without them, and both are reported.
"""

from __future__ import annotations

import sys
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

BEGIN, END = "<!-- serving: begin -->", "<!-- serving: end -->"
RESULTS = Path(__file__).resolve().parent / "results"
B, H, H_KV, D, BLOCK = 64, 32, 8, 128, 16
TOKEN_BYTES = 2 * H_KV * D * 4  # a token's key and value, float32
QUANTIZED = ("bf16", "int8", "int4", "kivi8", "kivi4", "fp8")
TARGETS = {"bf16": 0.7, "int8": 0.6, "kivi8": 0.6, "int4": 0.5, "kivi4": 0.5}
"""Issue 34's targets: a step's time against the float32 paged cache's (each also within
1.3x of its own floor)."""
KIVI_BLOCK = 32  # KIVI's key groups of 32 tokens lie within blocks


def block_size(kind: str | None) -> int:
    return KIVI_BLOCK if kind is not None and kind.startswith("kivi") else BLOCK


def paged_cache(blocks: int, kind: str | None) -> mha.PagedKVCache:
    """A paged cache of ``kind``: float32 (``None``), bfloat16 (``"bf16"``), or quantized."""
    if kind == "bf16":
        import ml_dtypes

        return mha.PagedKVCache(blocks, BLOCK, H_KV, D, dtype=ml_dtypes.bfloat16)
    return mha.PagedKVCache(blocks, block_size(kind), H_KV, D, quantize=kind)


def gemm_rate(n: int = 2048, repeats: int = 5) -> float:
    """Floating-point operations per second of a float32 ``n x n`` GEMM (NumPy's BLAS, on
    as many threads as it takes: every core)."""
    a = np.ones((n, n), np.float32)
    a @ a
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times))


def bytes_read(cache: mha.PagedKVCache, tokens: int) -> int:
    """The bytes a step reads from ``cache`` holding ``tokens``: each token's keys and
    values as stored, and KIVI's unfilled groups of keys in float32."""
    residual = cache._keys.residual
    held = 0 if residual is None else sum(r.nbytes for r in residual.rows.values())
    return cache.bytes_per_token * tokens + held


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
        paged.append(paged_cache(blocks + spare, kind))
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

    steps = {"KVCache": step_contiguous, "PagedKVCache": stepper(paged[0], q, k, v, before)}
    for cache, name in zip(paged[1:], QUANTIZED, strict=False):
        steps[f"PagedKVCache {name}"] = stepper(cache, q, k, v, before)
    return steps


def stepper(cache: mha.PagedKVCache, q: np.ndarray, k: np.ndarray, v: np.ndarray,
            before: np.ndarray) -> Any:  # fmt: skip
    """One decoding step over ``cache``, truncated back to ``before`` after it."""

    def step_paged() -> None:
        mha.scaled_dot_product_attention(q, k, v, cache=cache)
        for b, n in enumerate(before):
            cache.truncate(b, int(n))

    return step_paged


ROWS = (1, 2, 3, 4)
"""Query rows per key/value head of item 3."""


def filled(lengths: np.ndarray, rng: np.random.Generator, interleaved: bool = False
           ) -> list[mha.PagedKVCache]:  # fmt: skip
    """Paged caches (float32, then each of :data:`QUANTIZED`) holding the same random keys
    and values: each sequence appended at once, or ``interleaved``, a block of each sequence
    in turn."""
    paged = []
    for kind in (None, *QUANTIZED):
        size = block_size(kind)
        blocks = int(sum(-(-(int(n) + 1) // size) for n in lengths)) + len(lengths)
        paged.append(paged_cache(blocks, kind))
    rows = [[rng.standard_normal((H_KV, int(n), D), dtype=np.float32) for _ in "kv"]
            for n in lengths]  # fmt: skip
    for cache in paged:
        size = cache.block_size
        for b in range(len(lengths)):
            cache.add(b)
        if not interleaved:
            for b, (k, v) in enumerate(rows):
                cache.append(b, k, v)
            continue
        for start in range(0, int(lengths.max()), size):
            for b, (k, v) in enumerate(rows):
                if start < lengths[b]:
                    cache.append(b, k[:, start : start + size], v[:, start : start + size])
    return paged


def rows_per_head(lengths: np.ndarray, rng: np.random.Generator, repeats: int
                  ) -> dict[str, float]:  # fmt: skip
    """Item 3: ``"kind rows"`` -> seconds per step (``"float32 1"``, ``"int8 3"``, ...)."""
    paged = filled(lengths, rng)
    functions = {}
    for rows in ROWS:
        q = rng.standard_normal((len(lengths), H_KV * rows, 1, D), dtype=np.float32)
        k, v = (rng.standard_normal((len(lengths), H_KV, 1, D), dtype=np.float32)
                for _ in range(2))  # fmt: skip
        for name, cache in zip(("float32", *QUANTIZED), paged, strict=True):
            functions[f"{name} {rows}"] = stepper(cache, q, k, v, lengths)
    times = interleaved_medians(functions, repeats, pause=0.1, warm=WARM)
    return {name: float(np.median(t)) for name, t in times.items()}


LAYOUTS = ("in one run", "interleaved")
"""Item 4's layouts of a sequence's blocks."""


def layouts(lengths: np.ndarray, rng: np.random.Generator, repeats: int
            ) -> dict[str, float]:  # fmt: skip
    """Item 4: ``"kind layout"`` -> seconds per step at 4 rows per head."""
    q = rng.standard_normal((len(lengths), H_KV * 4, 1, D), dtype=np.float32)
    k, v = (rng.standard_normal((len(lengths), H_KV, 1, D), dtype=np.float32)
            for _ in range(2))  # fmt: skip
    functions = {}
    for layout in LAYOUTS:
        paged = filled(lengths, rng, interleaved=layout == "interleaved")
        for name, cache in zip(("float32", *QUANTIZED), paged, strict=True):
            functions[f"{name} {layout}"] = stepper(cache, q, k, v, lengths)
    times = interleaved_medians(functions, repeats, pause=0.1, warm=WARM)
    return {name: float(np.median(t)) for name, t in times.items()}


def measure(quick: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    longest, repeats = (2048, 3) if quick else (8192, 7)
    spread = np.linspace(128, longest, B).astype(np.int64)
    results: dict[str, Any] = {"environment": environment(None), "longest": longest}
    results["bandwidth"] = {"1 thread": bandwidth(1), f"{cores()} threads": bandwidth(cores())}
    results["gemm_flops"] = gemm_rate()
    contiguous, paged = caches(spread, rng, QUANTIZED)
    times = interleaved_medians(
        step_functions(contiguous, paged, rng), repeats, pause=0.1, warm=WARM
    )
    tokens = int(spread.sum())
    held = tokens * TOKEN_BYTES
    sizes = {"KVCache": contiguous.nbytes, "PagedKVCache": paged[0].nbytes}
    sizes.update({f"PagedKVCache {name}": cache.nbytes
                  for name, cache in zip(QUANTIZED, paged[1:], strict=True)})  # fmt: skip
    read = {"KVCache": held, "PagedKVCache": bytes_read(paged[0], tokens)}
    read.update({f"PagedKVCache {name}": bytes_read(cache, tokens)
                 for name, cache in zip(QUANTIZED, paged[1:], strict=True)})  # fmt: skip
    results["spread"] = {
        "tokens": tokens, "token_bytes": held, "bytes": sizes, "bytes_read": read,
        "flops": 4 * H * D * tokens,
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "all_seconds": times,
    }  # fmt: skip
    del contiguous, paged
    equal = np.full(B, longest // 4, np.int64)
    contiguous, paged = caches(equal, rng)
    functions = step_functions(contiguous, paged, rng)
    times = interleaved_medians(functions, repeats, pause=0.1, warm=WARM)
    results["equal"] = {
        "length": int(equal[0]),
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "all_seconds": times,
    }  # fmt: skip
    del contiguous, paged
    lengths = np.linspace(128, longest // 2, 32).astype(np.int64)
    results["rows"] = {
        "longest": int(lengths.max()), "sequences": len(lengths),
        "seconds": rows_per_head(lengths, rng, repeats),
    }  # fmt: skip
    results["layouts"] = {
        "longest": int(lengths.max()), "sequences": len(lengths),
        "seconds": layouts(lengths, rng, repeats),
    }  # fmt: skip
    return results


def label(kind: str) -> str:
    if kind == "bf16":
        return f"`PagedKVCache(dtype=bfloat16)`, blocks of {BLOCK}"
    blocks = "" if block_size(kind) == BLOCK else f", blocks of {block_size(kind)}"
    return f'`PagedKVCache(quantize="{kind}")`, groups of 32{blocks}'


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        spread, equal = results["spread"], results["equal"]
        held, seconds = spread["token_bytes"], spread["seconds"]
        bandwidths = results.get("bandwidth", {})
        bandwidth_ = max(bandwidths.values()) if bandwidths else None
        rate = results.get("gemm_flops")
        compute = spread["flops"] / rate if rate and "flops" in spread else None
        lines += [
            measured_on(results["environment"])
            + f"{B} sequences, {H} query heads, {H_KV} key/value heads, head dim {D}, float32; "
            f"one decoding step (one new token each), medians of interleaved runs, each "
            f"timed step after {WARM:g} s of untimed ones."
            + ("" if not bandwidths else " Memory bandwidth from `np.sum`: "
               + ", ".join(f"{v / 1e9:.1f} GB/s on {k}" for k, v in bandwidths.items())
               + "; the floor is the bytes a step reads at the larger.")
            + ("" if not compute else f" The step's {spread['flops'] / 1e9:.2f} GFLOP of "
               f"multiply-adds (scores and values, every cache alike) take {compute * 1e3:.1f} "
               f"ms at this machine's float32 GEMM rate ({results['gemm_flops'] / 1e9:.0f} "
               "GFLOP/s, NumPy's BLAS on every core): the last column is against the larger "
               "floor."),
            "",
            "| cache | lengths | memory | memory / the tokens held in float32 | ms per step "
            "| / float32 paged (target) | floor ms | / floor | / larger floor |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]  # fmt: skip
        rows = [
            ("KVCache", "`KVCache`, padded to the longest"),
            ("PagedKVCache", f"`PagedKVCache`, blocks of {BLOCK}"),
        ]
        rows += [(f"PagedKVCache {name}", label(name))
                 for name in QUANTIZED if f"PagedKVCache {name}" in spread["bytes"]]  # fmt: skip
        for name, text in rows:
            memory, step = spread["bytes"][name], seconds[name]
            kind = name.removeprefix("PagedKVCache").strip()
            target = f" (<= {TARGETS[kind]})" if kind in TARGETS else ""
            ratio = f"{step / seconds['PagedKVCache']:.2f}{target}"
            read = spread.get("bytes_read", {}).get(name)
            floor = read / bandwidth_ if read is not None and bandwidth_ else None
            floors = "— | —" if floor is None else f"{floor * 1e3:.1f} | {step / floor:.2f}"
            larger = max(floor or 0.0, compute or 0.0)
            floors += " | —" if not larger else f" | {step / larger:.2f}"
            lines.append(
                f"| {text} | 128 to {results['longest']:,} | "
                f"{memory / 2**30:.2f} GiB | {memory / held:.2f} | "
                f"{step * 1e3:.1f} | {ratio} | {floors} |"
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
        if "rows" in results:
            lines += rows_table(results["rows"])
        if "layouts" in results:
            lines += layouts_table(results["layouts"])
    return "\n".join(lines)


def rows_table(rows: dict[str, Any]) -> list[str]:
    """Item 3's table: ms per step, and against the float32 paged cache's."""
    title = (
        f"Query rows per key/value head: {rows['sequences']} sequences of 128 to "
        f"{rows['longest']:,} tokens, {H_KV} key/value heads, paged; ms per step (against "
        "float32 paged at as many rows)."
    )
    return kinds_table(title, "rows per head", ROWS, rows["seconds"])


def layouts_table(layouts: dict[str, Any]) -> list[str]:
    """Item 4's table: ms per step, and against the float32 paged cache's of its layout."""
    title = (
        "Each sequence's blocks in one run or interleaved with the others', a block at a "
        f"time: {layouts['sequences']} sequences of 128 to {layouts['longest']:,} tokens, 4 "
        "query rows per key/value head; ms per step (against float32 paged of the layout)."
    )
    return kinds_table(title, "blocks", LAYOUTS, layouts["seconds"])


def kinds_table(title: str, header: str, cases: Any, seconds: dict[str, float]) -> list[str]:
    """A row per case, a column per cache kind: ``seconds["kind case"]`` in ms, and in
    brackets against ``"float32 case"``."""
    kinds = [kind for kind in ("float32", *QUANTIZED) if f"{kind} {cases[0]}" in seconds]
    lines = [title, "", f"| {header} | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for case in cases:
        base = seconds[f"float32 {case}"]
        cells = [f"{seconds[f'{kind} {case}'] * 1e3:.1f}"
                 + ("" if kind == "float32" else f" ({seconds[f'{kind} {case}'] / base:.2f})")
                 for kind in kinds]  # fmt: skip
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    return readme_script(
        argv, __doc__, __file__, measure, "serving", markdown, (BEGIN, END), per_cpu=True
    )


if __name__ == "__main__":
    sys.exit(main())
