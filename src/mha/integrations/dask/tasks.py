"""The tasks of :mod:`mha.dask`: module-level functions and plain data, since they travel to
the workers. Each calls the in-memory kernel or functions on its chunks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..._arrays import cast_result
from ..._kernel.call import KernelCall, Outputs
from ..._kernel.contract import Visibility
from ..._kernel.forward import attend, merge_partials
from ..._kernel.scores import Scores, add_sinks
from ..._kernel.team import Team, workers_for
from ...api import checks
from ...api.checks import LayerArrays, LayerWeights, check_layer
from ...api.clip import clip
from ...api.gates import OutputGate
from ...api.gradients import join_heads, split_heads
from ...api.projection import compute
from ...api.qk_norm import QKNorm
from ...api.rotary import apply_rotary
from ...api.spec import Checked
from ...api.split_heads import attention
from ...api.v_norm import v_norm

WEIGHT_NAMES = checks.WEIGHT_NAMES


Weights = dict[str, Any]  # the arrays of WEIGHT_NAMES, as checked (None where not given)


@dataclass(frozen=True)
class Projection:
    which: str  # "q", or "kv" for the keys and the values
    H: int
    H_kv: int
    scale: float
    dtype: np.dtype
    rotary: dict[str, Any] | None  # apply_rotary's positions and keywords for this chunk
    threads: int | None
    norm: QKNorm | None = None  # the QK-norm, with its weights
    clip: float | None = None  # clip_qkv: the projections clamped to [-clip, clip]
    v_norm: float | None = None  # the epsilon of the values' RMSNorm without weights


def project_chunk(inputs: list[np.ndarray], weights: Weights, plan: Projection) -> Any:
    """One chunk's heads ``(b, heads, n, d)`` in the compute dtype: the queries times the
    scale, or the keys and the values as a pair."""
    if plan.which == "q":
        return heads(inputs[0], weights["W_q"], weights["b_q"], plan, "q")
    return (
        heads(inputs[0], weights["W_k"], weights["b_k"], plan, "k"),
        heads(inputs[1], weights["W_v"], weights["b_v"], plan, "v"),
    )


def heads(
    X: np.ndarray, W: np.ndarray, b: np.ndarray | None, plan: Projection, which: str
) -> np.ndarray:
    """``X @ W + b`` split into heads, for the queries (``which="q"``: times the scale), the
    keys or the values: normalised by the QK-norm (the values by ``v_norm``), clamped by
    ``clip_qkv`` (the queries' scale
    after both) and rotated (the queries and the keys), as
    :func:`mha.api.projection.project_heads` does."""
    count = plan.H if which == "q" else plan.H_kv
    W = W.astype(plan.dtype, copy=False)
    b = None if b is None else b.astype(plan.dtype, copy=False)
    norm = plan.norm if which != "v" else None
    scale = plan.scale if which == "q" else 1.0
    late = norm is not None or plan.clip is not None  # the scale after both
    if scale != 1.0 and not late:
        W, b = W * scale, None if b is None else b * scale
    with Team(workers_for(float(X.size) * W.shape[1], plan.threads)) as team:
        projected = team.matmul(X.astype(plan.dtype, copy=False), W, b)
    after = norm is not None and norm.after_rope  # HunYuan's: after the rotation
    x = split_heads(projected, count)
    if norm is not None and not after:
        x = _normed(norm, x, which)
    if which == "v" and plan.v_norm is not None:  # Gemma 3n's and Gemma 4's
        x = v_norm(x, plan.v_norm)[0]
    if plan.clip is not None:
        x = clip(x, plan.clip)[0]
    if late and scale != 1.0 and not after:
        x *= scale
    if which != "v" and plan.rotary is not None:
        x = apply_rotary(x, **plan.rotary)
    if norm is not None and after:
        x = _normed(norm, x, which)
        if scale != 1.0:
            x *= scale
    return x


def _normed(norm: QKNorm, x: np.ndarray, which: str) -> np.ndarray:
    """The heads ``x (b, heads, n, d)`` of ``which`` through the QK-norm."""
    if norm.kind == "all":  # a token's features, every head's
        return split_heads(norm.apply(join_heads(x), which)[0], x.shape[-3])
    normed: np.ndarray = norm.apply(x, which)[0]
    return normed


@dataclass(frozen=True)
class Part:
    visibility: Visibility  # the chunk pair's, without its mask and bias
    scale: float
    budget: int
    threads: int | None
    dtype: np.dtype
    scores: Scores | None = None  # without the sinks: the merge adds them once


@dataclass(frozen=True)
class InBlock:
    """A ``mask_mod`` or ``score_mod`` called by the in-memory function on one batch block,
    which numbers its sequences from 0: ``b`` is mapped back to the call's numbering."""

    function: Any
    sequences: np.ndarray  # the block's sequences, flattened, in the call's numbering
    score: bool  # a score_mod (score first), or a mask_mod

    def __call__(self, *args: Any) -> Any:
        if self.score:
            score, b, *rest = args
            return self.function(score, self.sequences[b], *rest)
        b, *rest = args
        return self.function(self.sequences[b], *rest)


def part(
    q: np.ndarray,
    kv: Any,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    plan: Part,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``(out, lse)`` of a query chunk over a key chunk ``kv = (k, v)`` (whose batch
    axes may be 1, broadcast), by the in-memory kernel."""
    k, v = (np.broadcast_to(x, (*q.shape[:-3], *x.shape[-3:])) for x in kv)
    visibility = plan.visibility
    if mask is not None or bias is not None:
        bias = None if bias is None else bias.astype(plan.dtype, copy=False)
        visibility = visibility.with_arrays(mask, bias)
    out = np.zeros((*q.shape[:-1], v.shape[-1]), dtype=plan.dtype)
    lse = np.full(q.shape[:-1], -np.inf, dtype=plan.dtype)
    cost = float(np.prod(q.shape[:-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    with (
        np.errstate(invalid="ignore", over="ignore"),
        Team(workers_for(cost, plan.threads)) as team,
    ):
        call = KernelCall(q, k, v, visibility, plan.scale, plan.scores, budget=plan.budget)
        attend(call, Outputs(out, lse=lse), team)
    return out, lse


@dataclass(frozen=True)
class Empty:
    shape: tuple[int, ...]  # (*b, H, n, d_v)
    dtype: np.dtype
    sinks: np.ndarray | None = None  # added once every part is merged


def merge(
    parts: list[tuple[np.ndarray, np.ndarray]], empty: Empty | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Parts over disjoint key ranges merged by their log-sum-exp; with none (a query chunk
    that sees no key), a zero output and a ``-inf`` log-sum-exp of ``empty``'s shape. The
    last merge (the one given ``empty``) adds its sinks."""
    if not parts:
        assert empty is not None
        out = np.zeros(empty.shape, empty.dtype)
        lse = np.full(empty.shape[:-1], -np.inf, empty.dtype)
    elif len(parts) == 1:
        out, lse = parts[0]
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            out, lse = merge_partials([out for out, _ in parts], [lse for _, lse in parts])
    if empty is not None and empty.sinks is not None:
        out, lse = out.copy(), lse.copy()  # a part's own arrays may be shared
        add_sinks(out, lse, empty.sinks)
    return out, lse


@dataclass(frozen=True)
class Output:
    shape: tuple[int, ...]  # the heads' (b, H, n, d_v)
    dtype: np.dtype
    result_dtype: np.dtype
    threads: int | None
    sinks: np.ndarray | None = None
    gate: str | None = None  # an output gate's activation (its weights: W_g, b_g)


def mha_out(parts: list[Any], weights: Weights, plan: Output, Q: Any = None) -> Any:
    """The last parts merged (and the sinks added), the heads joined (gated by the output
    gate of the chunk's query inputs ``Q``, if any) and projected by ``W_o``: ``(b, n,
    d_out)`` in the result dtype."""
    heads, _ = merge(parts, Empty(plan.shape, plan.dtype, plan.sinks))
    joined = join_heads(heads)
    if plan.gate is not None:
        H, d_v = plan.shape[-3], plan.shape[-1]
        gate = OutputGate.check(plan.gate, weights["W_g"], weights["b_g"], H, d_v, Q.shape[-1])
        joined = gate.forward(joined, Q)[0]
    b_o = None if weights["b_o"] is None else weights["b_o"].astype(plan.dtype, copy=False)
    W_o = weights["W_o"].astype(plan.dtype, copy=False)
    with Team(workers_for(float(joined.size) * W_o.shape[1], plan.threads)) as team:
        out = team.matmul(joined, W_o, b_o)
    return cast_result(out, plan.result_dtype)


def sdpa_out(merged: tuple[np.ndarray, np.ndarray], result_dtype: np.dtype) -> np.ndarray:
    return cast_result(merged[0], result_dtype)


def lse_out(merged: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    return merged[1]


@dataclass(frozen=True)
class SdpaBlock:
    checked: Checked  # the call's, with the block's lengths and its mask_mod and score_mod


def sdpa_block(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any, bias: Any, plan: SdpaBlock
) -> tuple[np.ndarray, np.ndarray]:
    """One batch block by the in-memory function (one chunk of queries and of keys)."""
    checked = _with_arrays(plan.checked, mask, bias)
    out, lse = attention(q, k, v, checked)
    return out, lse


@dataclass(frozen=True)
class MhaBlock:
    num_heads: int
    checked: Checked  # the call's, with the block's lengths, positions, mask_mod, score_mod


def mha_block(
    Q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    mask: Any,
    bias: Any,
    weights: Weights,
    plan: MhaBlock,
) -> np.ndarray:
    """One batch block by the in-memory function (one chunk of queries and of keys)."""
    checked = _with_arrays(plan.checked, mask, bias)
    given = LayerWeights(*(weights.get(name) for name in LayerWeights._fields))
    call = check_layer(LayerArrays(Q, K, V), given, plan.num_heads, checked)
    out = compute(call)
    assert isinstance(out, np.ndarray)  # the output alone: nothing else asked for
    return out


def _with_arrays(checked: Checked, mask: Any, bias: Any) -> Checked:
    """``checked`` with a block's own mask and bias arrays."""
    arrays = replace(checked.given.arrays, mask=mask, bias=bias)
    return checked._replace(given=replace(checked.given, arrays=arrays))
