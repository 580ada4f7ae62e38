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
from .._kernel import compiled, walk
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import Visibility
from .._kernel.forward import PRODUCT_CHUNK, WIDE_BELOW_ROWS, plan_tiles
from .._kernel.team import Team, default_workers, workers_for
from .checks import checked_heads, kernel_options
from .checks import masking as masking_of

__all__ = ["planned_attention"]

KEPT = 64
"""Plans kept at most; when full, the kept ones are forgotten and planning starts over."""

_PLANS: dict[tuple[Any, ...], _Plan | None] = {}

_PLAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _Plan:
    """One call signature's plan: the output's shape, the team's size and the walk's plan."""

    def __init__(self, out_shape: tuple[int, ...], workers: int, forward: walk.ForwardPlan):
        self.out_shape, self.workers, self.forward = out_shape, workers, forward


def planned_attention(
    q: Any,
    k: Any,
    v: Any,
    causal: Any,
    window: Any,
    scale: Any,
    return_lse: Any,
    max_memory: Any,
    workers: Any,
) -> np.ndarray | tuple[np.ndarray, np.ndarray] | None:
    """:func:`mha.scaled_dot_product_attention` ``(q, k, v, causal=causal, window=window,
    scale=scale, return_lse=return_lse, max_memory=max_memory, workers=workers)`` by its
    kept plan (made now if there is none), or ``None`` when the call is not one to plan or
    the walk left work undone: the caller then takes the unplanned path. Arguments the
    checks refuse raise as there."""
    if not (
        type(q) is np.ndarray
        and type(k) is np.ndarray
        and type(v) is np.ndarray
        and q.dtype in _PLAIN_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and (causal is True or causal is False)
        and (return_lse is True or return_lse is False)
        and (window is None or type(window) is int)
        and (scale is None or type(scale) is float)
        and (max_memory is None or type(max_memory) is int)
        and (workers is None or type(workers) is int)
        and compiled.walk_available()
    ):
        return None
    size = workers if workers is not None else default_workers()  # (the cores may change)
    key = (q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, q.dtype, causal, window,
           scale, return_lse, max_memory, workers, size)  # fmt: skip
    if key in _PLANS:
        plan = _PLANS[key]
    else:
        if not (q.flags.aligned and k.flags.aligned and v.flags.aligned):
            return None  # this call's arrays, not its signature: nothing to keep
        plan = _plan(q, k, v, causal, window, scale, max_memory, workers)
        if len(_PLANS) >= KEPT:
            _PLANS.clear()
        _PLANS[key] = plan  # None: the walk does not take calls of this signature
    if plan is None:
        return None
    out = np.zeros(plan.out_shape, q.dtype)
    lse = np.full(plan.out_shape[:-1], -np.inf, q.dtype) if return_lse else None
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


def _plan(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: bool,
    window: int | None,
    scale: float | None,
    max_memory: int | None,
    workers: int | None,
) -> _Plan | None:
    """The plan of a plain call, checked as the unplanned path checks it (and refused with
    its errors); ``None`` when the compiled walk would not take calls of its signature (a
    size of 0, strides it cannot read: aligned arrays, so nothing that depends on where
    they lie)."""
    q, k, v, _, dtype = checked_heads(q, k, v)
    factor = resolve_scale(scale, q.shape[-1], dtype)
    budget, threads = kernel_options(max_memory, workers)
    masking = masking_of(None, causal, None, None, None, None, window, None, None, None)
    visibility = Visibility.build(
        batch_shape=q.shape[:-3], H=q.shape[-3], L=q.shape[-2], S=k.shape[-2], dtype=dtype,
        context=f"q {q.shape}, k {k.shape}", **masking,
    )  # fmt: skip
    out_shape = (*q.shape[:-1], v.shape[-1])
    out = np.zeros(out_shape, dtype)
    call = KernelCall(q, k, v, visibility, factor, budget=budget)
    if walk.forward_walkable(call, Outputs(out)) is None:
        return None
    cost = float(math.prod(q.shape[:-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    team_size = workers_for(cost, threads)
    H_kv = k.shape[-3]
    group = q.shape[-3] // H_kv
    tiles = plan_tiles(q.shape[-2], k.shape[-2], H_kv, q.shape[-1], v.shape[-1], dtype.itemsize,
                       budget, False, group, False)  # fmt: skip
    forward = walk.ForwardPlan(call, tiles, team_size, WIDE_BELOW_ROWS, PRODUCT_CHUNK)
    return _Plan(out_shape, team_size, forward)
