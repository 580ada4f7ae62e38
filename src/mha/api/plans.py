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
import operator
from dataclasses import replace
from typing import Any

import numpy as np

from .._arrays import resolve_scale
from .._kernel import compiled, runtime, walk
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import ScoreShape, Visibility
from .._kernel.forward import plan_tiles
from .._kernel.team import Team, default_workers, workers_for
from .checks import (
    Call,
    LayerArrays,
    LayerWeights,
    check_layer,
    checked_heads,
    with_cache_state,
    with_fields,
)
from .spec import Checked, same_keywords

__all__ = ["as_given", "checked_layer", "planned_attention"]


_PLAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _Plan:
    """One call signature's plan: the output's shape, the team's size, the walk's plan, and
    whether the walk takes ``q``, ``k`` and ``v`` as they are (``direct``: four axes each,
    strides it reads, which the signature fixes: only their alignment is left to check)."""

    def __init__(self, out_shape: tuple[int, ...], workers: int, forward: walk.ForwardPlan):
        self.out_shape, self.workers, self.forward = out_shape, workers, forward
        self.direct = False


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
        if plan is not None and q.ndim == k.ndim == v.ndim == 4:
            out = np.zeros(plan.out_shape, q.dtype)
            plan.direct = walk.walk_views((q, k, v), (out,), operands=(q, k, v)) is not None
        plans.keep(key, plan)  # None: the walk does not take calls of this signature
    if plan is None:
        return None
    out = np.zeros(plan.out_shape, q.dtype)
    lse = np.full(plan.out_shape[:-1], -np.inf, q.dtype) if request.lse else None
    outputs = (out,) if lse is None else (out, lse[..., None])
    if plan.direct and q.flags.aligned and k.flags.aligned and v.flags.aligned:
        views: list[np.ndarray] | None = [q, k, v, *outputs]
    else:
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
    if spec.scores.fit(q.shape[-3], False, q.shape[:-3]) is not None or spec.dropout_p:
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
    team_size = workers_for(cost * visibility.seen_fraction(), request.threads)
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


class _KeptCheck:
    """A layer's checked call kept for its next call with the same signature: the same
    checked keywords (the same kept object), head count and names, inputs of the same
    shapes and dtypes (and the same sameness: self-attention stays self-attention), and the
    same weight arrays, of the same shapes and dtypes. Every check of :func:`check_layer`
    reads only those, so the kept call is the new call with its inputs put in. Kept only
    when the checks took every array as it is: a weight they converted (a list, integers)
    is the call's own copy, which an update of the weight in place would not reach."""

    def __init__(
        self, call: Call, arrays: LayerArrays, given: LayerWeights, key: tuple[Any, Any, Any]
    ) -> None:
        checked, self.num_heads, self.names = key
        cache = checked.given.cache
        self.cache_kind = None if cache is None else type(cache)
        if cache is not None:  # what depends on the cache is worked out each call: not kept
            call = with_fields(call, given=None, append=None, q_positions=None, k_positions=None)
            checked = checked._replace(given=replace(checked.given, cache=None))
        self.call = with_fields(call, Q=None, K=None, V=None)  # (no input kept alive)
        self.checked = checked
        self.inputs = _inputs_signature(arrays)
        self.weights = tuple(given)
        self.present = [i for i, w in enumerate(given) if w is not None]
        self.sizes = [(given[i].shape, given[i].dtype) for i in self.present]

    def call_for(
        self, arrays: LayerArrays, given: LayerWeights, num_heads: Any, checked: Checked, names: Any
    ) -> Call | None:
        """The kept call with ``arrays`` as its inputs, or ``None`` when this call differs in
        anything its checks read."""
        if (
            not same_keywords(checked, self.checked, self.cache_kind)
            or num_heads != self.num_heads
            or names is not self.names
            or _inputs_signature(arrays) != self.inputs
        ):
            return None
        if not all(map(operator.is_, given, self.weights)):
            return None
        if [(given[i].shape, given[i].dtype) for i in self.present] != self.sizes:
            return None  # (an array's shape set in place)
        Q, K, V = arrays  # (the checks took them as they are)
        call = with_fields(self.call, Q=Q, K=K, V=V)
        return call if self.cache_kind is None else with_cache_state(call, checked, names)


def _inputs_signature(arrays: LayerArrays) -> tuple[Any, ...] | None:
    Q, K, V = arrays
    if not (type(Q) is np.ndarray and type(K) is np.ndarray and type(V) is np.ndarray):
        return None
    return Q.shape, Q.dtype, K.shape, K.dtype, V.shape, V.dtype, Q is K, K is V


def checked_layer(
    owner: Any,
    arrays: LayerArrays,
    given: LayerWeights,
    num_heads: Any,
    checked: Checked,
    names: Any,
) -> Call:
    """:func:`check_layer` of a layer ``owner``'s call, by the checked call kept for the
    layer's last call (made now when this call differs from it in what the checks read).
    Kept for calls with plain keywords (``checked.kept``: no arrays of their own; with a
    cache, what its state decides worked out each call) on NumPy arrays taken as they
    are."""
    layers = runtime.DEFAULT.layer_checks
    kept: _KeptCheck | None = layers.get(owner)
    if kept is not None:
        again = kept.call_for(arrays, given, num_heads, checked, names)
        if again is not None:
            return again
    call = check_layer(arrays, given, num_heads, checked, names)
    if checked.kept and _inputs_signature(arrays) is not None and as_given(call, arrays, given):
        layers[owner] = _KeptCheck(call, arrays, given, (checked, num_heads, names))
    return call


def as_given(call: Call, arrays: LayerArrays, given: LayerWeights) -> bool:
    """Whether ``call`` holds the inputs and every weight as given (no copy made)."""
    weights, norm, gate = call.weights, call.qk_norm, call.spec.output
    held = {
        "Q": call.Q, "K": call.K, "V": call.V,
        **{name: getattr(weights, name) for name in _WEIGHTS},
        "q_norm": None if norm is None else norm.q_norm,
        "k_norm": None if norm is None else norm.k_norm,
        "q_norm_bias": None if norm is None else norm.q_bias,
        "k_norm_bias": None if norm is None else norm.k_bias,
        "W_g": None, "b_g": None, "o_norm": None, "q_scale": call.q_scale,
        **getattr(gate, "weights", {}),  # the output stages' (a gate's, a norm's)
    }  # fmt: skip
    asked = (*arrays._asdict().items(), *given._asdict().items())
    return all(held.get(name, _UNKNOWN) is value for name, value in asked)  # (a new weight: no)


_UNKNOWN = object()
"""What a weight this function does not know is held as: never the weight given, so a call
with a kind of weight added later is checked every time rather than kept unchecked."""

_WEIGHTS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")
