"""Small calls: what one call costs when there is little to compute.

    python benchmarks/calls.py                     # results in benchmarks/results/calls.*
    python benchmarks/calls.py --readme docs/benchmarks.md  # and its table in docs/benchmarks.md
    python benchmarks/calls.py --quick             # fewer repeats

The calls a small model or a generation loop makes thousands of times, each timed as a run
of consecutive calls (medians of interleaved runs), float32 and float64:

1. A layer of B=1, L=16, d_model=64, 4 heads: ``MultiHeadAttention`` (no bias, as
   ``nn.MultiheadAttention(bias=False)``) and ``multi_head_attention``, causal and not,
   beside torch's ``nn.MultiheadAttention`` under ``torch.no_grad()`` (on as many threads
   as cores, and on one: the ratio is to the faster).
2. The attention core on those heads, ``scaled_dot_product_attention`` (B=1, 4 heads,
   L=16, head dim 16), beside ``F.scaled_dot_product_attention``.
3. A decoding step of that layer with a KV cache of 64 tokens (``MultiHeadAttention`` with
   ``new_cache``), the cache truncated back after each step.
4. The fixed cost: the smallest call (B=1, L=S=1, one head of width 1) of the core.

Then where a call's microseconds go (float32, the same calls): each stage's functions timed
inside the call, exclusive of the stages they call (``checks``: the arguments' checks and,
for a kept plan or step, its own; ``planning``: the mask contract's band, the tiles, the
compiled walk's table and its choice of arrays; ``projections``; ``the walk``: the compiled
code; ``cache``: a decoding step's append, snapshot and commit; ``output``: the output's
product and cast; ``team``: entering and leaving the thread team, with its BLAS limit), the
rest (Python between them, allocations) the call's whole time, measured without the
timers, less theirs. A layer's first call is the general path (checked, planned); a call
again takes the layer's kept plan (``mha/api/layer_plan.py``; a small one on one worker: its
compiled projection, walk and output, ``SmallCall``), a call of ``multi_head_attention``
again its plan kept per signature of shapes and dtypes (``FunctionPlan``, the same file), a
decoding step the layer's kept step (``mha/api/decoding.py``). Beside it, what handing
work to a helper thread costs: a team of two workers running two empty tasks, against one
worker running them.

Where the environment sets ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE``, the measurement is
repeated in a child process without them, and both are reported.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

import mha
from mha._kernel.team import cores
from mha.cli.measure import (
    environment,
    interleaved_medians,
    measured_on,
    readme_script,
)

BEGIN, END = "<!-- calls: begin -->", "<!-- calls: end -->"
B, L, E, H = 1, 16, 64, 4
CONSECUTIVE = 50
TARGET = 2.0  # the issue's: a small layer's call within 2x torch's
STAGES = ("checks", "planning", "projections", "the walk", "cache", "output", "team")


def _consecutive(call: Any, count: int = CONSECUTIVE) -> Any:
    def run() -> None:
        for _ in range(count):
            call()

    return run


def cases(dtype: Any, torch: Any) -> dict[str, dict[str, Any]]:
    """Name -> {"mha": call, "torch": call or None} for one dtype."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((B, L, E)).astype(dtype)
    layer = mha.MultiHeadAttention(E, H, dtype=dtype, seed=0)
    W = [getattr(layer, name) for name in ("W_q", "W_k", "W_v", "W_o")]
    q, k, v = (rng.standard_normal((B, H, L, E // H)).astype(dtype) for _ in range(3))
    tiny = rng.standard_normal((1, 1, 1, 1)).astype(dtype)
    cache = layer.new_cache(batch_size=B, capacity=128)
    layer(X[:, :L], cache=cache)
    prompt = cache.lengths.copy()
    token = X[:, :1]

    def decode() -> None:
        layer(token, cache=cache)
        cache.truncate(prompt)

    found: dict[str, dict[str, Any]] = {
        "layer": {"mha": lambda: layer(X)},
        "layer, causal": {"mha": lambda: layer(X, mask=True)},
        "function": {"mha": lambda: mha.multi_head_attention(X, X, X, *W, H)},
        "core": {"mha": lambda: mha.scaled_dot_product_attention(q, k, v)},
        "core, causal": {"mha": lambda: mha.scaled_dot_product_attention(q, k, v, causal=True)},
        "decode step, 64 cached": {"mha": decode},
        "smallest core call": {"mha": lambda: mha.scaled_dot_product_attention(tiny, tiny, tiny)},
    }
    if torch is not None:
        module = torch.nn.MultiheadAttention(E, H, bias=False, batch_first=True, dtype=getattr(
            torch, np.dtype(dtype).name)).eval()  # fmt: skip
        module.load_state_dict(layer.to_torch_state_dict(tensors=True))
        tX = torch.from_numpy(X)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=tX.dtype)
        tq, tk, tv, ttiny = (torch.from_numpy(a) for a in (q, k, v, tiny))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def torch_layer(mask: Any = None) -> None:
            with torch.no_grad():
                module(tX, tX, tX, need_weights=False, attn_mask=mask, is_causal=mask is not None)

        def torch_core(causal_core: bool = False) -> None:
            with torch.no_grad():
                sdpa(tq, tk, tv, is_causal=causal_core)

        def torch_tiny() -> None:
            with torch.no_grad():
                sdpa(ttiny, ttiny, ttiny)

        found["layer"]["torch"] = torch_layer
        found["layer, causal"]["torch"] = lambda: torch_layer(causal)
        found["function"]["torch"] = torch_layer
        found["core"]["torch"] = torch_core
        found["core, causal"]["torch"] = lambda: torch_core(True)
        found["smallest core call"]["torch"] = torch_tiny
    return found


class _Stages:
    """Timers put around the functions of each stage (:data:`STAGES`) for one breakdown:
    each call's time goes to its stage, less that of the timed calls inside it. A GEMM of
    the team outside the projections' functions (a decoding step's projection, the output's
    product) is a projection but for the last of a call, which is the output."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[int] = []
        self.products: list[int] = []
        self.undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, stage: str) -> None:
        real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if stage == "product" and self.stack:  # (within a stage: that stage's)
                return real(*args, **kwargs)
            start = time.perf_counter_ns()
            self.stack.append(0)
            try:
                return real(*args, **kwargs)
            finally:
                inner = self.stack.pop()
                spent = time.perf_counter_ns() - start
                if stage == "product":
                    self.products.append(spent - inner)
                else:
                    self.totals[stage] += spent - inner
                if self.stack:
                    self.stack[-1] += spent

        self.undo.append((owner, name, real))
        setattr(owner, name, timed)

    def end_call(self) -> None:
        """File the call's products: the last is the output's."""
        if self.products:
            self.totals["output"] += self.products[-1]
            self.totals["projections"] += sum(self.products[:-1])
        self.products = []

    def remove(self) -> None:
        for owner, name, real in reversed(self.undo):
            setattr(owner, name, real)


def _timed_stages() -> _Stages:
    from mha._kernel import compiled, forward, team, walk
    from mha.api import (
        cache,
        cached,
        decoding,
        function,
        kept_state,
        layer_plan,
        module,
        projection,
    )

    stages = _Stages()
    for owner, name, stage in [
        (module, "checked_layer", "checks"), (module, "check_mha", "checks"),
        (kept_state.LayerState, "holds", "checks"), (function, "check_layer", "checks"),
        (function, "check_mha", "checks"), (function, "function_signature", "checks"),
        (walk, "forward_walkable", "planning"), (walk, "walk_views", "planning"),
        (walk.ForwardPlan, "__init__", "planning"), (forward, "call_tiles", "planning"),
        (layer_plan, "call_tiles", "planning"),
        (walk, "band_of", "planning"), (forward.walk_inputs, "band_of", "planning"),
        (compiled, "plan_walk", "planning"), (cached, "plain_visibility", "planning"),
        (cached, "plain_band", "planning"), (forward, "plan_tiles", "planning"),
        (projection, "project_heads", "projections"),
        (layer_plan, "project_heads", "projections"), (layer_plan, "qkv_weights", "projections"),
        (compiled, "layer_project", "projections"), (compiled, "layer_output", "output"),
        (compiled, "forward_walk", "the walk"), (compiled, "stored_forward_walk", "the walk"),
        (cache.KVCache, "_append", "cache"), (cache.KVCache, "_commit", "cache"),
        (cache.KVCache, "_snapshot", "cache"),
        (team.Team, "matmul", "product"),
        (module, "cast_result", "output"), (projection, "cast_result", "output"),
        (layer_plan, "cast_result", "output"), (decoding, "cast_result", "output"),
        (team.Team, "__enter__", "team"), (team.Team, "__exit__", "team"),
    ]:  # fmt: skip
        if hasattr(owner, name):
            stages.wrap(owner, name, stage)
    return stages


def breakdown(quick: bool) -> dict[str, Any]:
    """Where a float32 call's microseconds go (the module's docstring): per case, the
    whole call's median time and each stage's mean time inside it."""
    from mha._kernel.team import Team
    from mha.api import module

    found = cases(np.float32, None)
    layer_call = general_layer = found["layer"]["mha"]

    def unplanned() -> None:  # the general path: the layer's plan forgotten first
        kept = module.kept_plan
        module.kept_plan = lambda layer: None
        try:
            general_layer()
        finally:
            module.kept_plan = kept

    chosen = {
        "layer, general path": unplanned,
        "layer, kept plan": layer_call,
        "function, kept plan": found["function"]["mha"],
        "core, kept plan": found["core"]["mha"],
        "decode step, 64 cached": found["decode step, 64 cached"]["mha"],
    }
    repeats, count = (5, 200) if quick else (15, 1000)
    whole = interleaved_medians({n: _consecutive(c, count) for n, c in chosen.items()}, repeats)
    rows = []
    for name, call in chosen.items():
        for _ in range(50):
            call()
        stages = _timed_stages()
        try:
            for _ in range(count):
                call()
                stages.end_call()
        finally:
            stages.remove()
        per_call = {stage: stages.totals[stage] / count / 1e3 for stage in STAGES}
        total = float(np.median(whole[name])) / count * 1e6
        rows.append({"case": name, "total_us": total, "stages_us": per_call})

    def tasks(workers: int) -> Any:
        def run() -> None:
            with Team(workers) as team:
                team.run([0, 1], lambda: lambda task: None)

        return _consecutive(run, count)

    hand = interleaved_medians({"one": tasks(1), "two": tasks(2)}, repeats)
    hand_over = (float(np.median(hand["two"])) - float(np.median(hand["one"]))) / count * 1e6
    return {"rows": rows, "hand_over_us": hand_over}


def _one_thread(torch: Any, run: Any) -> Any:
    """``run`` with torch held to one thread (its setting put back after: a fraction of a
    microsecond). On the Zen 5 EPYC torch's calls this small took 50-80 µs each on
    one thread and on two without pauses, but 250-280 on two after the 0.05 s pauses between
    runs (torch alone in its process): the table's ratio is to the faster of the two."""

    def on_one() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run()
        finally:
            torch.set_num_threads(threads)

    return on_one


def measure(quick: bool) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        torch = None
    else:
        torch.set_num_threads(cores())
    results: dict[str, Any] = {"environment": environment(torch), "calls": []}
    for dtype in (np.float32, np.float64):
        for name, calls in cases(dtype, torch).items():
            functions = {who: _consecutive(call) for who, call in calls.items()}
            if "torch" in calls:  # torch on one thread too: the faster is the ratio's
                functions["torch, 1 thread"] = _one_thread(torch, functions["torch"])
            times = interleaved_medians(functions, 5 if quick else 15, pause=0.05)
            per_call = {who: [t / CONSECUTIVE for t in ts] for who, ts in times.items()}
            results["calls"].append({
                "case": name, "dtype": np.dtype(dtype).name,
                "seconds": {who: float(np.median(ts)) for who, ts in per_call.items()},
                "all_seconds": per_call,
            })  # fmt: skip
    results["breakdown"] = breakdown(quick)
    return results


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for results in runs:
        lines += [
            measured_on(results["environment"])
            + f"B={B}, L={L}, d_model={E}, {H} heads (head dim {E // H}); µs per call, "
            f"medians of interleaved runs of {CONSECUTIVE} consecutive calls.",
            "",
            "| call | dtype | mha µs | torch µs | torch µs, 1 thread | mha / torch's faster "
            "| within 2x (layer, function) |",
            "|---|---|---:|---:|---:|---:|:---:|",
        ]
        for row in results["calls"]:
            s = row["seconds"]
            ours = s["mha"] * 1e6
            if "torch" in s:
                one = s.get("torch, 1 thread")
                ratio = s["mha"] / min(s["torch"], one or np.inf)
                theirs, vs = f"{s['torch'] * 1e6:.0f}", f"{ratio:.2f}"
                alone = "—" if one is None else f"{one * 1e6:.0f}"
                within = row["case"] in ("layer", "function")
                ok = ("yes" if ratio <= TARGET else "no") if within else "—"
            else:
                theirs = alone = vs = ok = "—"
            cells = [row["case"], row["dtype"], f"{ours:.0f}", theirs, alone, vs, ok]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if "breakdown" in results:
            lines += _breakdown_lines(results["breakdown"])
    return "\n".join(lines)


def _breakdown_lines(found: dict[str, Any]) -> list[str]:
    lines = [
        "Where a float32 call's µs go (each stage's functions timed inside the call; the "
        "rest is the whole call's median, measured without the timers, less theirs):",
        "",
        "| call | whole µs | " + " | ".join(STAGES) + " | the rest |",
        "|---|---:|" + "---:|" * (len(STAGES) + 1),
    ]
    for row in found["rows"]:
        parts = [row["stages_us"][stage] for stage in STAGES]
        rest = row["total_us"] - sum(parts)
        cells = [row["case"], f"{row['total_us']:.1f}", *(f"{x:.1f}" for x in parts), f"{rest:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Handing work to a helper thread: {found['hand_over_us']:.1f} µs a call (a team of "
        "two running two empty tasks, against one worker running them).",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    return readme_script(
        argv, __doc__, __file__, measure, "calls", markdown, (BEGIN, END), per_cpu=True
    )


if __name__ == "__main__":
    sys.exit(main())
