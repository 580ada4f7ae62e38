"""Plans kept per call signature, for the calls a program makes thousands of times.

A decoding loop over a fixed window, a model run at one length or a benchmark calls
:func:`mha.scaled_dot_product_attention` again and again with arrays of the same shapes,
strides and dtype and the same options. Everything the call works out before the compiled
walk runs (the argument checks, the mask contract's :class:`Visibility`, the tile sizes, the
table of work items and their shares among the workers: :class:`.walk.ForwardPlan`)
depends only on those, so the first such call keeps it here and the next ones run it: a
hundred microseconds of Python less per call (the README's per-call table).

Only plain calls are planned: float32 or float64 ``q``, ``k`` and ``v`` of one dtype, given
as NumPy arrays, with at most ``causal``, ``window``, ``scale``, ``return_lse``,
``max_memory`` and ``workers`` as options (each of its exact Python type, so a value that the
checks would refuse never matches a kept plan). A planned call computes exactly what the
unplanned one does, on the same tiles: the same bits. What the compiled walk cannot do (a
non-finite value at a hidden key) sends the call back to the unplanned path, which does it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._arrays import resolve_scale
from .._kernel import compiled, runtime, walk
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import ScoreShape, Visibility
from .._kernel.forward import plan_tiles
from .._kernel.team import Team, default_workers, workers_for
from .checks import checked_heads
from .spec import Checked

__all__ = ["planned_attention"]


_PLAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _Plan:
    """One call signature's plan: the output's shape, the team's size and the walk's plan."""

    def __init__(self, out_shape: tuple[int, ...], workers: int, forward: walk.ForwardPlan):
        self.out_shape, self.workers, self.forward = out_shape, workers, forward


def planned_attention(
    q: Any, k: Any, v: Any, checked: Checked
) -> np.ndarray | tuple[np.ndarray, np.ndarray] | None:
    """:func:`mha.scaled_dot_product_attention` of ``q``, ``k``, ``v`` for its ``checked``
    keywords by their kept plan (made now if there is none), or ``None`` when the call is
    not one to plan or the walk left work undone: the caller then takes the unplanned path.
    A call is planned when its keywords were kept (plain values), it carries nothing of its
    own and asks back at most the log-sum-exp, its operands are plain float32 or float64
    arrays of one dtype, and the compiled walk takes what its spec computes (:func:`_plan`).
    Arguments the checks refuse raise as there."""
    given, request = checked.given, checked.request
    if not (
        checked.kept
        and type(q) is np.ndarray
        and type(k) is np.ndarray
        and type(v) is np.ndarray
        and q.dtype in _PLAIN_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and not request.weights
        and not request.backward
        and given.empty
        and compiled.walk_available()
    ):
        return None
    size = request.threads if request.threads is not None else default_workers()
    key = (checked, q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, q.dtype, size)
    plans = runtime.DEFAULT.plans  # at most 64: when full, planning starts over
    if key in plans:
        plan = plans.get(key)
    else:
        if not (q.flags.aligned and k.flags.aligned and v.flags.aligned):
            return None  # this call's arrays, not its signature: nothing to keep
        plan = _plan(q, k, v, checked)
        plans.keep(key, plan)  # None: the walk does not take calls of this signature
    if plan is None:
        return None
    out = np.zeros(plan.out_shape, q.dtype)
    lse = np.full(plan.out_shape[:-1], -np.inf, q.dtype) if request.lse else None
    outputs = (out,) if lse is None else (out, lse[..., None])
    views = walk.walk_views((q, k, v), outputs, operands=(q, k, v))
    if views is None:  # arrays not aligned: the unplanned path copes
        return None
    with np.errstate(invalid="ignore", over="ignore"), Team(plan.workers) as team:
        failed, parts = plan.forward.run(views, k, team)
        if failed.any():
            return None
        if parts is not None:
            parts.merge_into(out, lse)
    return out if lse is None else (out, lse)


def _plan(q: np.ndarray, k: np.ndarray, v: np.ndarray, checked: Checked) -> _Plan | None:
    """The plan of a call, checked as the unplanned path checks it (and refused with its
    errors); ``None`` when the compiled walk would not take calls of its signature (what
    its spec computes, a size of 0, strides it cannot read: aligned arrays, so nothing that
    depends on where they lie)."""
    spec, given, request = checked.spec, checked.given, checked.request
    q, k, v, _, dtype = checked_heads(q, k, v)
    factor = resolve_scale(spec.scale, q.shape[-1], dtype)
    if spec.scores.fit(q.shape[-3], False) is not None or spec.dropout_p:
        return None  # changes to the scores (sinks too) and dropout: the unplanned path
    shape = ScoreShape(q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-2])
    visibility = Visibility.build(
        spec.mask, given.arrays, shape, dtype, f"q {q.shape}, k {k.shape}"
    )
    out_shape = (*q.shape[:-1], v.shape[-1])
    out = np.zeros(out_shape, dtype)
    call = KernelCall(q, k, v, visibility, factor, budget=request.budget)
    if walk.forward_walkable(call, Outputs(out)) is None:
        return None
    cost = float(math.prod(q.shape[:-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    team_size = workers_for(cost, request.threads)
    H_kv = k.shape[-3]
    group = q.shape[-3] // H_kv
    tiles = plan_tiles(
        q.shape[-2],
        k.shape[-2],
        H_kv,
        q.shape[-1],
        v.shape[-1],
        dtype.itemsize,
        request.budget,
        False,
        group,
        False,
    )
    tuned = runtime.DEFAULT.thresholds
    forward = walk.ForwardPlan(call, tiles, team_size, tuned.wide_below_rows, tuned.product_chunk)
    return _Plan(out_shape, team_size, forward)
