"""Attention variants: what sinks, ALiBi, soft-capping, a query temperature, document masks,
chunks and windows cost beside plain causal attention, and what the ``mask_mod``/``score_mod``
forms cost beside the built-in keywords.

    python benchmarks/variants.py                    # results in benchmarks/results/variants.*
    python benchmarks/variants.py --readme docs/benchmarks.md  # and its table in docs/benchmarks.md
    python benchmarks/variants.py --quick            # fewer repeats

Causal self-attention, B=1, 8 heads, head dim 64, float32, L=4096, with mha's
``scaled_dot_product_attention`` on every core. Every call is timed in one set of interleaved
runs, so the ratios compare like with like. The calls come back to back, as a model's layers
do: these calls use no BLAS threads of their own (the workers run BLAS on one thread each),
so nothing spins between them, and a pause before each call (the other benchmarks' 0.3 s)
measured every call 20-50 ms slower on a 2-core VM as its clock came back up, which
penalises the short calls most:

1. Each variant, as a ratio to plain causal attention (``causal=True``); the same call on one
   worker (``workers=1``), as what two workers gain over one; and the variant's backward
   pass (``backward(grad)`` of a call with ``return_backward=True``) as a ratio to plain
   causal attention's backward, beside its forward's ratio.
2. Each ``mask_mod`` or ``score_mod`` form beside the built-in keyword it spells out, after
   checking that the two give the same output.
3. The variants of the whole layer (``multi_head_attention``, d_model = 8 x 64 = 512, its
   four projections): an output gate per element (``W_g (512, 512)``: a GEMM as large as a
   projection) and per head (``W_g (512, 8)``), as a ratio to the same layer without it;
   and the per-element gate's floor: the plain layer followed by the gate's GEMM alone;
   timed in a set of their own, 41 rounds (``LAYER_REPEATS``).

Where the environment sets ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` (which hold OpenBLAS
to an older kernel), the measurement is repeated in a child process without them, and both
are reported. Besides ``variants.json`` and ``.md``, the results are written under the CPU's
name and microarchitecture (``variants-amd-epyc-znver5.md``): one table per CPU, each kept
when another CPU runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import mha
from mha.cli.measure import (
    environment,
    interleaved_medians,
    measured_on,
    readme_script,
)

B, H, L, D = 1, 8, 4096, 64
DOCUMENT, WINDOW, CHUNK, CAP = 512, 512, 512, 50.0
VARIANTS_BEGIN, VARIANTS_END = "<!-- variants: begin -->", "<!-- variants: end -->"

DOC = np.repeat(np.arange(L // DOCUMENT), DOCUMENT)  # document id of each packed position
SLOPES = mha.alibi_slopes(H).astype(np.float32)


def document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (DOC[q] == DOC[kv]) & (q >= kv)


def causal_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q >= kv


def sliding_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q >= kv) & (q - kv < WINDOW)


def chunk_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q >= kv) & (q // CHUNK == kv // CHUNK)


def alibi_score(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return s + SLOPES[h] * (kv - q).astype(np.float32)


def softcap_score(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    cap = np.float32(CAP)  # keeps the scores float32
    return cap * np.tanh(s / cap)


def variants(sinks: np.ndarray) -> list[tuple[str, str, dict[str, Any], float | None]]:
    """(name, keywords as shown, keywords, target ratio to plain causal) of every row."""
    return [
        ("plain causal", "causal=True", {"causal": True}, None),
        ("sinks", "causal=True, sinks=(8,) normal", {"causal": True, "sinks": sinks}, 1.10),
        ("ALiBi", "causal=True, alibi=True", {"causal": True, "alibi": True}, 1.10),
        ("soft-capping", "causal=True, softcap=50.0", {"causal": True, "softcap": CAP}, 1.15),
        ("query temperature", "causal=True, query_temperature=(0.1, 512, 1)",
         {"causal": True, "query_temperature": (0.1, 512.0, 1)}, 1.1),
        (f"document mask, {L // DOCUMENT} x {DOCUMENT}",
         "mask_mod=(doc[q]==doc[kv]) & (q>=kv)", {"mask_mod": document_causal}, 0.3),
        (f"chunked {CHUNK}", f"causal=True, chunk={CHUNK}", {"causal": True, "chunk": CHUNK}, 0.25),
        (f"sliding window {WINDOW}", f"causal=True, window={WINDOW}",
         {"causal": True, "window": WINDOW}, 0.35),
    ]  # fmt: skip


TWO_WORKERS = 1.8
"""What two workers must gain over one, for every row (the variants' target)."""
BACKWARD_SLACK = 1.2
"""A variant's backward ratio (to plain causal's backward) within this factor of its
forward's ratio."""


# (form, keywords as shown, keywords, the built-in variant it spells out, target)
FORMS: list[tuple[str, str, dict[str, Any], str, float | None]] = [
    ("causal as mask_mod", "mask_mod=q>=kv", {"mask_mod": causal_mask}, "plain causal", 1.5),
    (f"sliding window {WINDOW} as mask_mod", f"mask_mod=(q>=kv) & (q-kv<{WINDOW})",
     {"mask_mod": sliding_mask}, f"sliding window {WINDOW}", 1.5),
    (f"chunk {CHUNK} as mask_mod", f"mask_mod=(q>=kv) & (q//{CHUNK}==kv//{CHUNK})",
     {"mask_mod": chunk_mask}, f"chunked {CHUNK}", 1.5),
    ("ALiBi as score_mod", "causal=True, score_mod=s + slopes[h]*(kv-q)",
     {"causal": True, "score_mod": alibi_score}, "ALiBi", 1.5),
    ("soft-capping as score_mod", "causal=True, score_mod=50*tanh(s/50)",
     {"causal": True, "score_mod": softcap_score}, "soft-capping", 1.5),
]  # fmt: skip


# (name, keywords as shown, the gate's columns or None, target ratio to the plain layer)
LAYERS: list[tuple[str, str, int | None, float | None]] = [
    ("plain causal layer", "causal=True", None, None),
    ("gate per element", "causal=True, W_g (512, 512)", H * D, 1.1),
    ("gate per head", "causal=True, W_g (512, 8)", H, 1.1),
    ("plain layer, then X @ W_g alone", "causal=True; X @ W_g (512, 512)", -H * D, None),
]
"""The last row is the per-element gate's floor: the plain layer and the gate's GEMM (as
large as a projection) alone, without the gate's sigmoid and product."""
LAYER_REPEATS = 41
"""The layer rows are timed apart, 41 times each: a gate adds 5-10% to a layer of 200 ms,
and one layer call of 15 here ran from 185 to 383 ms on the shared 2-core machine (a median
of 15 moved the per-element gate's ratio from 1.03x to 1.29x between runs)."""


def _layer(X: Any, weights: list[Any], W_g: Any) -> Callable[[], Any]:
    def run() -> Any:
        return mha.multi_head_attention(X, X, X, *weights, H, causal=True, W_g=W_g)

    return run


def _layer_then_product(X: Any, weights: list[Any], W_g: Any) -> Callable[[], Any]:
    def run() -> Any:
        return mha.multi_head_attention(X, X, X, *weights, H, causal=True), X @ W_g

    return run


def _attention(q: Any, k: Any, v: Any, keywords: dict[str, Any]) -> Callable[[], Any]:
    def run() -> Any:
        return mha.scaled_dot_product_attention(q, k, v, **keywords)

    return run


def _backward(q: Any, k: Any, v: Any, keywords: dict[str, Any]) -> Callable[[], Any]:
    """The backward pass of one call (made once, outside the timing)."""
    _, backward = mha.scaled_dot_product_attention(q, k, v, **keywords, return_backward=True)
    grad = np.random.default_rng(1).standard_normal(q.shape, dtype=np.float32)

    def run() -> Any:
        return backward(grad)

    return run


def _meets(ratio: float, target: float | None) -> bool | None:
    return None if target is None else bool(ratio <= target)


def measure(quick: bool) -> dict[str, Any]:
    torch: Any
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))
    rows = variants(rng.standard_normal(H).astype(np.float32))
    keywords = {name: kw for name, _, kw, _ in rows}
    functions = {name: _attention(q, k, v, kw) for name, kw in keywords.items()}
    for name, kw in keywords.items():
        functions[f"{name}, one worker"] = _attention(q, k, v, kw | {"workers": 1})
        functions[f"{name}, backward"] = _backward(q, k, v, kw)
    same = {}
    for form, _, kw, builtin, _ in FORMS:
        functions[form] = _attention(q, k, v, kw)
        ours, theirs = functions[form](), functions[builtin]()
        same[form] = {
            "same_result": bool(np.allclose(ours, theirs, rtol=1e-4, atol=1e-5)),
            "max_abs_difference": float(np.max(np.abs(ours - theirs))),
            "dtype": str(ours.dtype),
        }
    X = rng.standard_normal((B, L, H * D), dtype=np.float32)
    weights = [(rng.standard_normal((H * D, H * D)) / (H * D) ** 0.5).astype(np.float32)
               for _ in range(4)]  # fmt: skip
    layers = {}
    for name, _, columns, _ in LAYERS:
        size = None if columns is None else abs(columns)
        W_g = None if size is None else rng.standard_normal((H * D, size), dtype=np.float32)
        made = _layer_then_product if columns is not None and columns < 0 else _layer
        layers[name] = made(X, weights, None if W_g is None else W_g / (H * D) ** 0.5)
    repeats, layer_repeats = (3, 3) if quick else (15, LAYER_REPEATS)
    times = interleaved_medians(functions, repeats, pause=0.0)
    times.update(interleaved_medians(layers, layer_repeats, pause=0.0))
    seconds = {name: float(np.median(t)) for name, t in times.items()}
    base, layer = seconds["plain causal"], seconds[LAYERS[0][0]]
    base_backward = seconds["plain causal, backward"]

    def variant(name: str, shown: str, target: float | None) -> dict[str, Any]:
        ratio, one = seconds[name] / base, seconds[f"{name}, one worker"]
        backward = seconds[f"{name}, backward"]
        backward_ratio = backward / base_backward
        return {
            "name": name, "keywords": shown, "seconds": seconds[name],
            "all_seconds": times[name], "ratio": ratio, "target": target,
            "meets_target": _meets(ratio, target),
            "one_worker_seconds": one, "two_workers_gain": one / seconds[name],
            "meets_two_workers": bool(one / seconds[name] >= TWO_WORKERS),
            "backward_seconds": backward, "backward_ratio": backward_ratio,
            "meets_backward": bool(backward_ratio <= BACKWARD_SLACK * ratio),
        }  # fmt: skip

    return {
        "environment": environment(torch),
        "shape": {"B": B, "H": H, "L": L, "D": D, "dtype": "float32"},
        "repeats": repeats,
        "layer_repeats": layer_repeats,
        "variants": [variant(name, shown, target) for name, shown, _, target in rows],
        "forms": [
            {"name": form, "keywords": shown, "builtin": builtin, "seconds": seconds[form],
             "all_seconds": times[form], "builtin_seconds": seconds[builtin],
             "ratio": seconds[form] / seconds[builtin], "target": target,
             "meets_target": _meets(seconds[form] / seconds[builtin], target), **same[form]}
            for form, shown, _, builtin, target in FORMS
        ],
        "layers": [
            {"name": name, "keywords": shown, "seconds": seconds[name],
             "all_seconds": times[name], "ratio": seconds[name] / layer, "target": target,
             "meets_target": _meets(seconds[name] / layer, target)}
            for name, shown, _, target in LAYERS
        ],
    }  # fmt: skip


def _target(target: float | None) -> str:
    return "—" if target is None else f"<= {target:g}x"


def _meets_text(meets: bool | None) -> str:
    return "—" if meets is None else ("yes" if meets else "NO")


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        builtin = {row["name"]: row["keywords"] for row in results["variants"]}
        lines += [
            measured_on(results["environment"])
            + f"B=1, 8 heads, head dim 64, float32, L={L}; medians of {results['repeats']} "
            "interleaved runs, back to back, default workers.",
            "",
            "| variant | keywords | ms | / plain causal | target | meets target "
            f"| one worker ms | two / one (>= {TWO_WORKERS:g}x) | backward ms "
            f"| backward / plain's | within {BACKWARD_SLACK:g}x of the forward's |",
            "|:---|:---|---:|---:|:---:|:---:|---:|---:|---:|---:|:---:|",
        ]
        for row in results["variants"]:
            gain, backward = row.get("two_workers_gain"), row.get("backward_ratio")
            lines.append(
                f"| {row['name']} | `{row['keywords']}` | {row['seconds'] * 1e3:.1f} "
                f"| {row['ratio']:.2f}x | {_target(row['target'])} "
                f"| {_meets_text(row['meets_target'])} "
                + (
                    "| — | — | — | — | — |"
                    if gain is None or backward is None
                    else f"| {row['one_worker_seconds'] * 1e3:.1f} | {gain:.2f}x"
                    f"{'' if row['meets_two_workers'] else ' (NO)'} "
                    f"| {row['backward_seconds'] * 1e3:.1f} | {backward:.2f}x "
                    f"| {_meets_text(row['meets_backward'])} |"
                )
            )
        lines += [
            "",
            "`mask_mod` / `score_mod` forms beside the built-in keywords they spell out "
            "(same result: `np.allclose` at rtol 1e-4, atol 1e-5, float32):",
            "",
            "| form | mha keywords | ms | built-in ms | / built-in | target | meets "
            "| same result |",
            "|:---|:---|---:|---:|---:|:---:|:---:|:---:|",
        ]
        for row in results["forms"]:
            lines.append(
                f"| {row['name']} | `{row['keywords']}` vs `{builtin[row['builtin']]}` "
                f"| {row['seconds'] * 1e3:.1f} | {row['builtin_seconds'] * 1e3:.1f} "
                f"| {row['ratio']:.2f}x | {_target(row['target'])} "
                f"| {_meets_text(row['meets_target'])} "
                f"| {'yes' if row['same_result'] else 'NO'} |"
            )
        lines += [
            "",
            "The whole layer (`multi_head_attention`, d_model 512, its four projections; "
            f"medians of {results.get('layer_repeats', results['repeats'])} interleaved runs "
            "of these four rows):",
            "",
            "| layer | keywords | ms | / plain layer | target | meets target |",
            "|:---|:---|---:|---:|:---:|:---:|",
        ]
        for row in results.get("layers", []):
            lines.append(
                f"| {row['name']} | `{row['keywords']}` | {row['seconds'] * 1e3:.1f} "
                f"| {row['ratio']:.2f}x | {_target(row['target'])} "
                f"| {_meets_text(row['meets_target'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return readme_script(
        argv,
        __doc__,
        __file__,
        measure,
        "variants",
        markdown,
        (VARIANTS_BEGIN, VARIANTS_END),
        per_cpu=True,
    )


if __name__ == "__main__":
    sys.exit(main())
