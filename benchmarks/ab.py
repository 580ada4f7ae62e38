"""Two versions of mha timed against each other, interleaved: before and after a change.

    python benchmarks/ab.py BEFORE_SRC AFTER_SRC [--rounds 15] [--only REGEX] [--clock cpu]
                            [-o results.json]

Each version runs in a process of its own (``PYTHONPATH`` set to its ``src`` folder); the
parent asks both, in turn (which first alternates by round), to time the same case, round
after round, so that both see the same machine at the same moments; each case's figure is
the median of its rounds, and the table gives after / before. The cases are those of the
README's tables: small calls (the per-call cost), the core and the layer at the benchmark's
shapes, decoding steps, the backward, the variants, a paged decoding step. Both processes
hold BLAS and the workers alike; the environment (``OPENBLAS_CORETYPE``...) is the caller's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import numpy as np


def cases() -> dict[str, Any]:
    """Each case: a function of no arguments (its inputs made once), and its repeats."""
    import mha

    rng = np.random.default_rng(0)
    made: dict[str, Any] = {}

    def heads(B: int, H: int, L: int, S: int, d: int, dtype: Any, H_kv: int | None = None):
        H_kv = H_kv or H
        return (rng.standard_normal((B, H, L, d)).astype(dtype),
                rng.standard_normal((B, H_kv, S, d)).astype(dtype),
                rng.standard_normal((B, H_kv, S, d)).astype(dtype))  # fmt: skip

    sdpa, function = mha.scaled_dot_product_attention, mha.multi_head_attention
    for dtype in (np.float32, np.float64):
        name = np.dtype(dtype).name
        x = rng.standard_normal((1, 16, 64)).astype(dtype)
        layer = mha.MultiHeadAttention(64, 4, seed=0, dtype=dtype)
        made[f"small layer {name}"] = (lambda layer=layer, x=x: layer(x), 200)
        made[f"small layer causal {name}"] = (lambda layer=layer, x=x: layer(x, True), 200)
        w = [(rng.standard_normal((64, 64)) / 8).astype(dtype) for _ in range(4)]
        made[f"small function {name}"] = (lambda x=x, w=w: function(x, x, x, *w, 4), 200)
        made[f"small layer step {name}"] = (_step(layer, rng, 64, dtype), 200)
        q, k, v = heads(1, 4, 16, 16, 16, dtype)
        made[f"small core {name}"] = (lambda q=q, k=k, v=v: sdpa(q, k, v), 300)
        tiny = heads(1, 1, 1, 1, 1, dtype)
        made[f"smallest core {name}"] = (lambda t=tiny: sdpa(*t), 300)
        for label, (B, L, E, H) in {"S1": (8, 512, 512, 8), "S3": (32, 128, 256, 4)}.items():
            X = rng.standard_normal((B, L, E)).astype(dtype)
            W = [(rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype) for _ in range(4)]
            made[f"{label} layer {name}"] = (
                lambda X=X, W=W, H=H: mha.multi_head_attention(X, X, X, *W, H, causal=True),
                3,
            )
            q, k, v = heads(B, H, L, L, E // H, dtype)
            made[f"{label} core causal {name}"] = (
                lambda q=q, k=k, v=v: sdpa(q, k, v, causal=True), 3)  # fmt: skip

            def backward(q=q, k=k, v=v):
                out, back = sdpa(q, k, v, causal=True, return_backward=True)
                back(out)

            made[f"{label} fwd+bwd {name}"] = (backward, 1)
    smollm2 = mha.MultiHeadAttention(576, 9, num_kv_heads=3, rope_theta=1e5, seed=0,
                                     dtype=np.float32)  # fmt: skip
    made["SmolLM2 layer step float32"] = (_step(smollm2, rng, 576, np.float32), 100)
    for S in (1024, 4096):
        q, k, v = heads(1, 32, 1, S, 128, np.float32, H_kv=8)
        made[f"decode {S} keys"] = (lambda q=q, k=k, v=v: sdpa(q, k, v), 30)
    q, k, v = heads(1, 8, 2048, 2048, 64, np.float32)
    for label, keywords in {
        "plain causal": {"causal": True}, "alibi": {"causal": True, "alibi": True},
        "softcap": {"causal": True, "softcap": 50.0}, "chunk": {"causal": True, "chunk": 512},
        "window": {"causal": True, "window": 512},
        "mask_mod causal": {"mask_mod": lambda b, h, i, j: i >= j},
    }.items():  # fmt: skip
        made[f"variant {label}"] = (lambda q=q, k=k, v=v, kw=keywords: sdpa(q, k, v, **kw), 1)
    cache = mha.PagedKVCache(512, 16, 8, 128)
    for s in range(8):
        cache.add(s)
        key = rng.standard_normal((1, 8, 1024, 128)).astype(np.float32)
        cache.append(s, key[0], key[0])
    q = rng.standard_normal((8, 1, 32, 128)).astype(np.float32)
    table, lengths = cache.block_table(), cache.lengths
    made["paged decode 8 x 1024"] = (
        lambda: mha.paged_attention(q, cache.key_cache, cache.value_cache, table, lengths),
        20,
    )
    return made


def _step(layer: Any, rng: Any, width: int, dtype: Any) -> Any:
    """A decoding step of ``layer`` over a cache of 64 tokens, truncated back after it."""
    cache = layer.new_cache(1, capacity=128)
    layer(rng.standard_normal((1, 64, width)).astype(dtype), cache=cache)
    token = rng.standard_normal((1, 1, width)).astype(dtype)

    def step() -> None:
        layer(token, cache=cache)
        cache.truncate(64)

    return step


def serve() -> None:
    """A worker: read a case's name, time it, write the seconds per call."""
    only = re.compile(os.environ.get("MHA_AB_ONLY", ""))
    clock = time.process_time if os.environ.get("MHA_AB_CLOCK") == "cpu" else time.perf_counter
    made = {name: case for name, case in cases().items() if only.search(name)}
    for function, _ in made.values():  # warm every case (compile, plan)
        function()
    print(json.dumps(sorted(made)), flush=True)
    for line in sys.stdin:
        name = line.strip()
        function, repeats = made[name]
        start = clock()
        for _ in range(repeats):
            function()
        print(json.dumps((clock() - start) / repeats), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", default="", help="the cases whose names match (a regex)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or the CPU time of the process (all its threads): steadier on a "
        "machine others share, since time spent waiting for a core is not counted",
    )
    parser.add_argument("-o", "--output")
    args = parser.parse_args(argv)
    workers = []
    for src in (args.before, args.after):
        env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "MHA_AB_ONLY": args.only,
               "MHA_AB_CLOCK": args.clock}  # fmt: skip
        workers.append(subprocess.Popen(
            [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env,
        ))  # fmt: skip
    listed = [json.loads(w.stdout.readline()) for w in workers]  # type: ignore[union-attr]
    names = listed[0]  # (both versions list the same cases)
    times: dict[str, list[list[float]]] = {name: [[], []] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            order = list(enumerate(workers))  # before first in even rounds, after in odd ones
            for side, worker in order if round_ % 2 == 0 else order[::-1]:
                worker.stdin.write(name + "\n")  # type: ignore[union-attr]
                worker.stdin.flush()  # type: ignore[union-attr]
                times[name][side].append(json.loads(worker.stdout.readline()))  # type: ignore[union-attr]
    for worker in workers:
        worker.stdin.close()  # type: ignore[union-attr]
        worker.wait()
    rows = {name: [float(np.median(t)) for t in sides] for name, sides in times.items()}
    print(f"{'case':32} {'before':>12} {'after':>12} {'after/before':>13}")
    for name, (before, after) in rows.items():
        print(f"{name:32} {before * 1e6:10.1f}us {after * 1e6:10.1f}us {after / before:13.3f}")
    ratios = [after / before for before, after in rows.values()]
    print(f"geometric mean of after/before: {float(np.exp(np.mean(np.log(ratios)))):.3f}")
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"rounds": args.rounds, "clock": args.clock, "cases": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        sys.exit(main())
