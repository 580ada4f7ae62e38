"""Sparse top-k attention (DeepSeek-V3.2's): a decoding step over 32k cached keys of which
each query attends to 2,048, beside a dense step over 2,048 cached keys, and the indexer's
own cost (issue 33's target: the sparse step within 1.5x of the dense one, plus the
indexer's cost).

    python benchmarks/sparse.py            # results in benchmarks/results/sparse.*
    python benchmarks/sparse.py --quick    # fewer repeats

One :class:`mha.LatentAttention` layer with DeepSeek-V3.2's attention widths (kv_lora_rank
512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536; an indexer
of 64 heads of 128, index_topk 2048) and 16 heads (a tensor-parallel shard of its 128),
d_model 2048, float32, 4 sequences. Its cache is filled to 32,768 tokens (random latents and
indexer keys, written once; each timed step is rolled back by ``truncate``). Timed,
interleaved, medians:

1. ``sparse``: a decoding step (one token per sequence) of the layer with its indexer over
   the 32k cached tokens: the indexer's choice, then the attention over the chosen keys.
2. ``sparse, masked walk``: the same step walked over all 32k keys with the others masked
   (the reference path the gathered walk replaced).
3. ``dense 2048``: the same layer without an indexer, a step over 2,048 cached tokens.
4. ``indexer``: the indexer alone: its scores of the 4 queries against the 32k keys and the
   top-k choice (``mha.api.sparse.index_scores``, ``mha.api.topk.top_k``).
5. ``sparse, choice given``: the sparse step with the indexer's choice made once, before
   the timing: the layer's work but the indexer's, measured rather than the difference of
   two noisy medians. The target compares it with the dense step.

A chunk of 16 tokens per sequence (chunked prefill) is timed the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

import mha
from mha.api.qk_norm import rms_norm
from mha.api.sparse import IndexerSpec, index_scores
from mha.api.topk import top_k
from mha.cli.measure import (
    environment,
    finish_script,
    interleaved_medians,
    measured_on,
    script_parser,
)

B, E, H, S, TOPK = 4, 2048, 16, 32768, 2048
WIDTHS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
          "v_head_dim": 128, "q_lora_rank": 1536}  # fmt: skip
INDEXER = IndexerSpec(topk=TOPK, num_heads=64, head_dim=128)
TARGET = 1.5


def _filled(layer: mha.LatentAttention, tokens: int, rng: np.random.Generator) -> Any:
    """A cache of ``layer`` holding ``tokens`` random tokens per sequence."""
    cache = layer.new_cache(B, capacity=tokens + 32, dtype=np.float32)
    width = WIDTHS["kv_lora_rank"] + WIDTHS["qk_rope_head_dim"]
    latents = rng.standard_normal((B, 1, tokens, width), dtype=np.float32)
    counts = np.full(B, tokens, np.int64)
    cache._append(latents, latents[..., : WIDTHS["kv_lora_rank"]], counts)
    if layer.indexer is not None:
        keys = rng.standard_normal((B, 1, tokens, INDEXER.head_dim), dtype=np.float32)
        cache._index._append(keys, keys, counts)
        cache._index._commit(counts)
    cache._commit(counts)
    return cache


def _step(layer: mha.LatentAttention, cache: Any, x: np.ndarray) -> Callable[[], Any]:
    length = int(cache.lengths[0])

    def run() -> Any:
        out = layer(x, cache=cache)
        cache.truncate(length)
        return out

    return run


def _masked(step: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with mock.patch("mha.api.latent_math.walks_chosen", return_value=False):
            return step()

    return run


def _choice_given(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` with its indexer's choice made on the first call and given to every call
    after it (the indexer's keys, scores and top-k not computed again)."""
    from mha.api import latent_math
    from mha.api.sparse import Choice

    real, made = latent_math.choose_keys, {}

    def chosen(plan: Any, spec: Any, x: Any, q_low: Any, W: Any, at: Any, attention: Any) -> Any:
        if "mask" not in made:
            made["mask"] = real(plan, spec, x, q_low, W, at, attention).attention["mask"]
        return Choice({**attention, "mask": made["mask"], "causal": None}, lambda: None)

    def run() -> Any:
        with mock.patch("mha.api.latent_math.choose_keys", chosen):
            return step()

    return run


def _indexer(layer: mha.LatentAttention, cache: Any, x: np.ndarray) -> Callable[[], Any]:
    """The indexer's scores of ``x``'s tokens against the cache's keys, and its choice."""
    W = {name: w for name, w in layer.weights().items() if w is not None}
    q_low = rms_norm(x @ W["W_q_a"], W["q_a_norm"], layer.norm_eps)[0]
    plan, L = layer._plan(), x.shape[1]
    at = int(cache.lengths[0]) + np.arange(L)
    keys = cache._index._attended(int(cache.lengths[0]))[0]
    visible = np.arange(keys.shape[-2]) <= at[:, None]

    def run() -> Any:
        scores = index_scores(plan, INDEXER, q_low, x, W, at, keys)
        return top_k(np.where(visible, scores, -np.inf), TOPK)

    return run


def measure(quick: bool) -> dict[str, Any]:
    torch: Any
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    sparse = mha.LatentAttention(E, H, indexer=INDEXER, dtype=np.float32, seed=0, **WIDTHS)
    dense = mha.LatentAttention.from_spec(
        mha.LatentSpec(**{**sparse.spec.__dict__, "indexer": None}), sparse.parameters()
    )
    long, short = _filled(sparse, S, rng), _filled(dense, TOPK, rng)
    rows = {}
    for L in (1, 16):
        x = rng.standard_normal((B, L, E), dtype=np.float32)
        step = _step(sparse, long, x)
        rows[f"sparse, L={L}"] = step
        rows[f"sparse masked walk, L={L}"] = _masked(step)
        rows[f"sparse, choice given, L={L}"] = _choice_given(step)
        rows[f"dense {TOPK}, L={L}"] = _step(dense, short, x)
        rows[f"indexer, L={L}"] = _indexer(sparse, long, x)
    repeats = 3 if quick else 9
    times = interleaved_medians(rows, repeats, pause=0.0)
    seconds = {name: float(np.median(t)) for name, t in times.items()}
    results = []
    for L in (1, 16):
        sparse_s, dense_s = seconds[f"sparse, L={L}"], seconds[f"dense {TOPK}, L={L}"]
        indexer_s = seconds[f"indexer, L={L}"]
        given_s = seconds[f"sparse, choice given, L={L}"]
        results.append({
            "queries_per_sequence": L,
            "sparse_seconds": sparse_s,
            "masked_walk_seconds": seconds[f"sparse masked walk, L={L}"],
            "dense_seconds": dense_s,
            "indexer_seconds": indexer_s,
            "ratio_to_dense": sparse_s / dense_s,
            "ratio_without_indexer": (sparse_s - indexer_s) / dense_s,
            "choice_given_seconds": given_s,
            "ratio_choice_given": given_s / dense_s,
            "target": TARGET,
            "meets_target": bool(given_s <= TARGET * dense_s),
            "all_seconds": {name: t for name, t in times.items() if name.endswith(f"L={L}")},
        })  # fmt: skip
    return {
        "environment": environment(torch),
        "shape": {
            **{"B": B, "d_model": E, "H": H, "cached": S, "topk": TOPK, **WIDTHS},
            **{"index_heads": INDEXER.num_heads, "index_head_dim": INDEXER.head_dim},
            "dtype": "float32",
        },
        "repeats": repeats,
        "rows": results,
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        lines += [
            measured_on(results["environment"])
            + f"One LatentAttention layer (DeepSeek-V3.2's widths, {H} heads, d_model {E}), "
            f"float32, {B} sequences, {S:,} cached tokens, top-k {TOPK}; medians of "
            f"{results['repeats']} interleaved runs.",
            "",
            "| queries per sequence | sparse ms | masked walk ms | dense 2048 ms | indexer ms "
            "| sparse / dense | (sparse - indexer) / dense | choice given ms "
            "| choice given / dense | target | meets |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|:---:|",
        ]
        for row in results["rows"]:
            lines.append(
                f"| {row['queries_per_sequence']} | {row['sparse_seconds'] * 1e3:.1f} "
                f"| {row['masked_walk_seconds'] * 1e3:.1f} | {row['dense_seconds'] * 1e3:.1f} "
                f"| {row['indexer_seconds'] * 1e3:.1f} | {row['ratio_to_dense']:.2f}x "
                f"| {row['ratio_without_indexer']:.2f}x "
                f"| {row['choice_given_seconds'] * 1e3:.1f} | {row['ratio_choice_given']:.2f}x "
                f"| <= {TARGET}x "
                f"| {'yes' if row['meets_target'] else 'NO'} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    output = Path(__file__).resolve().parent / "results"
    args = script_parser(__doc__ or "", output).parse_args(argv)
    return finish_script(__file__, args, measure(args.quick), "sparse", markdown)


if __name__ == "__main__":
    sys.exit(main())
