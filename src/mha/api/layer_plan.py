"""A layer's plain call kept for its next calls: a model run at one length, a training
loop, a benchmark calling the same layer on arrays of the same shape again and again.

A layer's call checks its arguments and keywords, works out the mask contract's
:class:`Visibility`, the tiles, the compiled walk's table of work items and the team's size,
and only then computes: for a small call (16 tokens, 64 features) that Python took about
three quarters of the call's time. When a call is a plain one (:func:`plan_for`: no cache,
self-attention, the mask ``None`` or causal, every keyword but ``workers`` left out, no
extra keys, sinks, soft-capping, ALiBi, QK-norm, key selection, dropout or output stage,
:class:`mha.MultiHeadAttention` itself, a float32 or float64 walk the compiled forward
takes), the layer keeps a :class:`LayerPlan`: that checked call without its input, with the
forward walk's plan (:class:`.walk.ForwardPlan`) and the team's size. The next call with
the same module state, input shape and dtype, mask and workers is that call with its input
put in, computed as :func:`.projection.compute` computes it (its projection, the compiled
walk on the kept plan, the output's product: the same functions in the same order, the same
bits; over many sequences, by the same blocks of them, :mod:`.sequence_blocks`; a few rows
on one worker as three compiled calls, :class:`SmallCall`, the same products and
operations), without the checks whose answers cannot have changed.

What the plan checks each call: the module's attributes are those it was made from
(:class:`.kept_state.LayerState`: an assignment to any of them, or a change in place to a
dict of them, drops the plan), the weights have the shapes and dtypes they had (a weight
updated in place is read as it is now: a plan is kept only where the call holds the layer's
own weight arrays, not copies the checks converted), and the input is a NumPy array of the
kept shape and dtype (with the default workers, the cores they were chosen from). Any other
call, including every call the checks would refuse, goes the general way. A call whose walk
leaves work undone (a non-finite value at a hidden key) is computed again the general way,
which does it.

:func:`mha.multi_head_attention` has no layer to keep a plan: its plain self-attention call
keeps one per signature of the input's and the weights' shapes and dtypes
(:class:`FunctionPlan`), which holds no array of the caller's and takes each call's own."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._arrays import cast_result
from .._kernel import compiled, runtime, walk
from .._kernel.team import Team, default_workers
from .checks import Call, LayerArrays, LayerWeights, Weights, plain_heads, with_fields
from .gradients import split_heads
from .kept_state import LayerState, weights_as_given
from .plans import as_given
from .projection import layer_sizes, layer_workers, project_heads
from .qkv import qkv_weights
from .sequence_blocks import blocks_for, forward_plan, plain_call, whole_call

__all__ = [
    "FunctionPlan",
    "LayerPlan",
    "function_signature",
    "keep_function_plan",
    "keep_plan",
    "kept_function_plan",
    "kept_plan",
    "plan_for",
]


class LayerPlan:
    """One layer's plain call (:mod:`.layer_plan`), made from a checked call and its
    forward walk's plan by :func:`plan_for`; called with the layer, its input, the mask and
    the workers given. The function's (:class:`FunctionPlan`) has no layer, and no weights
    of its own: it calls :meth:`run` with each call's (its signature fixes what
    :meth:`fits` checks)."""

    def __init__(self, call: Call, given: tuple[Any, Any], planned: tuple[int, Any]) -> None:
        self.state: LayerState | None = None  # (a layer's attributes: plan_for's)
        self.mask, self.workers = given
        self.cores = default_workers()  # (what the team's size was chosen from)
        self.shape, self.dtype = call.Q.shape, call.Q.dtype
        self.call = with_fields(call, Q=None, K=None, V=None)  # (no input held)
        self.team, self.forward = planned  # the team's size, the walk's plan
        self.blocks = blocks_for(call, self.team)  # (the same blocks as the general path's)
        self.small: SmallCall | None = None  # one worker, a few rows (plan_for, once kept)

    def __call__(self, module: Any, query: Any, mask: Any, workers: Any) -> np.ndarray | None:
        """The layer's output for ``query``, or ``None`` when this call is not the kept
        one (or its walk left work undone): the general path then checks and computes it."""
        if self.state is None or not self.state.holds(module):
            runtime.DEFAULT.layer_plans.pop(module, None)  # (its arrays not kept alive)
            return None
        if not self.fits(query, mask, workers):
            return None
        return self.run(with_fields(self.call, Q=query, K=query, V=query))

    def fits(self, query: Any, mask: Any, workers: Any) -> bool:
        """Whether a call of ``query``, ``mask`` and ``workers`` is the kept one."""
        return (
            type(query) is np.ndarray
            and query.shape == self.shape
            and query.dtype == self.dtype
            and mask is self.mask
            and type(workers) is type(self.workers)
            and workers == self.workers
            and (workers is not None or default_workers() == self.cores)
        )

    def run(self, call: Call) -> np.ndarray | None:
        """The kept ``call`` (its input and weights put in) computed, or ``None`` when its
        walk left work undone."""
        dtype, H = call.compute_dtype, call.H
        w = call.weights.in_dtype(dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            done = None if self.small is None else self.small(call, w)
        if done is not None:
            return cast_result(done, call.result_dtype)
        with np.errstate(invalid="ignore", over="ignore"), Team(self.team) as team:
            if self.blocks is not None:  # many sequences: a block of them at a time
                by_blocks = self.blocks(call, w, team)
                return None if by_blocks is None else cast_result(by_blocks, call.result_dtype)
            q, k, v = project_heads(call, w, team)
            joined = np.zeros((*call.B, call.L, H * call.d_v), dtype=dtype)
            out = split_heads(joined, H)
            if q.ndim == 4 and _fresh(q) and _fresh(k) and _fresh(v):
                views: list[np.ndarray] | None = [q, k, v, out]  # (walk_views's, as they are)
            else:
                views = walk.walk_views((q, k, v), (out,), operands=(q, k, v))
            if views is None:
                return None
            failed, parts = self.forward.run(views, k, team)
            if failed.any():
                return None
            if parts is not None:
                parts.merge_into(out, None)
            result = team.matmul(joined, w.W_o, w.b_o)
        return cast_result(result, call.result_dtype)


class SmallCall:
    """A layer's small planned call on one worker as three compiled calls, on buffers the
    plan keeps: the q, k, v projection into heads (:func:`.compiled.layer_project`, or
    :func:`.compiled.layer_project_apart` by three products), the forward walk
    (:meth:`.walk.ForwardPlan.bind`) and the output's product
    (:func:`.compiled.layer_output`), with no Python between them but their calls. The same
    bits as the path it shortens (:func:`.projection.project_heads`, the kept walk and
    ``Team.matmul``): the same products by NumPy's BLAS, the bias added and the late scale
    multiplied as NumPy does. Taken where that path makes one product of each (fewer rows
    than ``thresholds.matmul_rows``, at least two of everything: NumPy's ``matmul`` calls
    ``gemm`` then), the q, k, v weights one product (:func:`.qkv.qkv_weights`: side by
    side, or joined for the call) or three (separate weights, fewer rows than features: the
    same three GEMM calls), no rotary embedding, the input and the weights
    C-contiguous in the compute dtype, and the buffers of a call at most
    :data:`SMALL_MOST` bytes; each call checks what may change between calls (the weights'
    layout, the scale's type, NumPy's handling of underflow: the compiled products report
    none, so a caller who asks for it is left to NumPy's) and returns ``None`` to leave a
    call to that path.

    On the Zen 4 EPYC (znver4), OpenBLAS's SkylakeX kernel, a 16-token layer of 64
    features and 4 heads took 72 us a call on that path (projections 25, output 6.4, the
    walk 14.7: ``benchmarks/calls.py``) and 47 this way (projections 9.0, output 2.5, the
    walk 14.2); ``docs/benchmarks.md``."""

    def __init__(
        self, forward: walk.ForwardPlan, call: Call, shapes: list[tuple[int, ...]], width: int
    ) -> None:
        self.forward, self.dtype, self.H = forward, call.compute_dtype, call.H
        self.rows, self.lead = math.prod(call.B) * call.L, call.B
        self.shapes, self.width = shapes, width  # q's, k's, v's heads, the joined heads'; q, k, v's
        self.none = np.empty(0, self.dtype)  # (no bias)
        self.spare: list[tuple[Any, ...]] = []  # (not the plan: no cycle keeps it alive)

    @classmethod
    def of(cls, plan: LayerPlan, call: Call) -> SmallCall | None:
        """The small call of ``plan`` (of the checked ``call``), or ``None``."""
        dtype, n, L = call.compute_dtype, math.prod(call.B) * call.L, call.L
        H, H_kv, d_k, d_v = call.H, call.H_kv, call.d_k, call.d_v
        width, widest = call.Q.shape[-1], call.weights.W_o.shape[1]
        if not (
            plan.team == 1
            and plan.blocks is None
            and plain_heads(call)  # (project_heads's other steps: none of them)
            and call.rotary is None
            and call.Q.dtype == dtype
            and 2 <= n < runtime.DEFAULT.thresholds.matmul_rows
            and min(width, H * d_k, H_kv * d_k, H_kv * d_v, widest) >= 2
        ):
            return None
        B, forward = math.prod(call.B), plan.forward
        shapes = [(B, H, L, d_k), (B, H_kv, L, d_k), (B, H_kv, L, d_v), (B, L, H * d_v)]
        product = (n, H * d_k + H_kv * (d_k + d_v))
        scratch = walk.scratch_shapes(forward.R, forward.cols, d_k, d_v, False, forward.flip_below)
        held = sum(math.prod(shape) for shape in (*shapes, product, *scratch)) * dtype.itemsize
        if held > SMALL_MOST:
            return None
        small = cls(forward, call, shapes, product[1])
        buffers = small._buffers()
        if buffers is None:  # (the walk would copy the keys first, or split them)
            return None
        small.spare.append(buffers)
        return small

    def __call__(self, call: Call, w: Weights) -> np.ndarray | None:
        """``call``'s output (before its cast to the result's dtype), or ``None`` when this
        call is not one to take here, or its walk left work undone."""
        if np.geterr()["under"] != "ignore":  # (NumPy's products report underflow then)
            return None
        weights = qkv_weights(call, w, self.rows)
        scale = call.scale if weights.late_scale else None
        if not (scale is None or type(scale) is float):
            return None  # (another Python number would round the product otherwise)
        x = call.Q.reshape(self.rows, call.Q.shape[-1])
        dtype, none = self.dtype, self.none
        if weights.joined is not None:  # one product
            W, b = weights.joined
            given: tuple[Any, ...] = (W, none if b is None else b)
            width, project = W.shape[1], compiled.layer_project
        else:  # three (separate weights)
            given = (*weights.W, *(none if b is None else b for b in weights.b))
            width, project = self.width, compiled.layer_project_apart
            if sum(part.shape[1] for part in weights.W) != width:
                return None
        if width != self.width or not all(
            a is None or (a.flags.c_contiguous and a.dtype == dtype)
            for a in (x, *given, w.W_o, w.b_o)
        ):
            return None
        buffers = self._buffers()
        if buffers is None:
            return None
        heads, joined, product, run = buffers
        out = np.empty((self.rows, w.W_o.shape[1]), dtype)
        first = dtype.type(0.0 if scale is None else scale)  # as NumPy rounds a Python float
        with Team(1):  # (BLAS held to one thread, as on the path it shortens)
            project(dtype, x, *given, scale is not None, first, heads, joined, product)
            done = run()
            if done:
                rows = joined.reshape(self.rows, joined.shape[-1])
                bias = none if w.b_o is None else w.b_o
                compiled.layer_output(dtype, rows, w.W_o, bias, out)
        self.spare.append((heads, joined, product, run))  # (list.pop, append: thread-safe)
        del self.spare[_SPARE:]
        return out.reshape(*self.lead, call.L, out.shape[-1]) if done else None

    def _buffers(self) -> tuple[Any, ...] | None:
        """A spare set of buffers (q, k, v's heads, the joined heads, their product, the
        walk's run on them), or a new one (``None``: the walk cannot be bound to them,
        :meth:`.walk.ForwardPlan.bind`)."""
        try:
            return self.spare.pop()
        except IndexError:
            pass
        *heads, joined = (np.zeros(shape, self.dtype) for shape in self.shapes)
        run = self.forward.bind([*heads, split_heads(joined, self.H)])
        product = np.empty((self.rows, self.width), self.dtype)
        return None if run is None else (tuple(heads), joined, product, run)


SMALL_MOST = 2**20
"""The most bytes a :class:`SmallCall`'s buffers may hold (heads, joined heads, product,
the walk's scratch): a plan keeps up to :data:`_SPARE` sets of them between calls."""

_SPARE = 2
"""Sets of buffers a :class:`SmallCall` keeps between calls (more run at once allocate)."""


def _fresh(x: np.ndarray) -> bool:
    """Whether ``x`` is an array the compiled walk reads as it is (:func:`.walk.walk_views`
    takes a contiguous, aligned array of four axes unchanged)."""
    return bool(x.flags.c_contiguous and x.flags.aligned)


def _forward_plan(call: Call, workers: int) -> walk.ForwardPlan | None:
    """The compiled forward walk's plan of ``call``'s attention on a team of ``workers``,
    as :func:`.forward.attend` makes it (its tiles, its choice of walk); ``None`` when the
    compiled walk does not take it."""
    kernel, outputs = whole_call(call)
    if walk.forward_walkable(kernel, outputs) is None:
        return None
    return forward_plan(kernel, outputs, workers)


def plan_for(module: Any, call: Call, mask: Any, workers: Any) -> LayerPlan | None:
    """The plan of a layer's checked ``call``, or ``None`` when the call is not a plain one
    (:mod:`.layer_plan`). ``mask`` and ``workers``: as the call was given; the caller has
    checked that every other keyword was left out and that the layer's class is
    :class:`mha.MultiHeadAttention` itself (a subclass may compute more)."""
    if not (workers is None or type(workers) is int) or not (mask is None or mask is True):
        return None
    plain = (
        getattr(module, "shares_kv_with", None) is None
        and weights_as_given(module, call)  # (an update in place is read)
        and plain_call(call)
    )
    plan = _planned(call, mask, workers) if plain else None
    if plan is None:
        return None
    plan.state = LayerState(module, call)
    if not plan.state.keepable:
        return None
    plan.small = SmallCall.of(plan, call)
    return plan


def _planned(call: Call, mask: Any, workers: Any) -> LayerPlan | None:
    """The plan of a plain ``call`` (:func:`.sequence_blocks.plain_call`) on the team
    ``compute`` would take, without its small call (``None`` where the compiled walk does
    not take the call)."""
    team = workers
    if team is None:  # compute's default for the call
        team = layer_workers(layer_sizes(call), call.S)
    forward = _forward_plan(call, team)
    if forward is None:
        return None
    return LayerPlan(call, (mask, workers), (team, forward))


def kept_plan(module: Any) -> LayerPlan | None:
    """The layer's kept plan, if it has one."""
    plan: LayerPlan | None = runtime.DEFAULT.layer_plans.get(module)
    return plan


def keep_plan(module: Any, call: Call, mask: Any, workers: Any) -> None:
    """Keep the layer's plan of ``call`` (:func:`plan_for`), or drop the one it had when
    ``call`` is not a plain one (its arrays are not kept alive)."""
    plan = plan_for(module, call, mask, workers)
    if plan is not None:
        runtime.DEFAULT.layer_plans[module] = plan
    else:
        runtime.DEFAULT.layer_plans.pop(module, None)


class FunctionPlan:
    """:func:`mha.multi_head_attention`'s plain call kept for its next calls of the same
    signature (:func:`function_signature`): a :class:`LayerPlan` that holds neither the
    input nor the weights, each call's own put in (their shapes and dtypes are the
    signature's, every check of the call reads only those), kept from the signature's
    second call (:func:`keep_function_plan`). ``plan`` is ``None`` for a signature seen
    once, and for one whose calls are not kept (not plain, or not taken by the compiled
    walk): they are checked and computed the general way, the latter without a new try at
    keeping them."""

    def __init__(self, plan: LayerPlan | None) -> None:
        self.plan = plan

    def __call__(self, query: np.ndarray, given: LayerWeights) -> np.ndarray | None:
        """The output for ``query`` and the weights ``given``, or ``None`` when the call
        is left to the general path."""
        plan = self.plan
        if plan is None:  # (what fits() checks, the signature fixed)
            return None
        weights = Weights(*given[:8])  # (W_q, W_k, W_v, W_o and their biases: as given)
        return plan.run(with_fields(plan.call, Q=query, K=query, V=query, weights=weights))


def function_signature(
    query: Any, given: LayerWeights, num_heads: Any, mask: Any, causal: Any, workers: Any
) -> tuple[Any, ...] | None:
    """What a plain self-attention call of :func:`mha.multi_head_attention` is kept by
    (the caller has checked that only ``mask``, ``None`` or ``True``, ``causal``, ``None``
    or a ``bool``, and ``workers``, ``None`` or an ``int``, are given among the keywords,
    and no weight but the projections and their biases): the input's and each weight's
    shape and dtype, the head count, the mask, ``causal`` and the workers (with the cores
    the default is chosen from); ``None`` where one of them is not a NumPy array (or the
    head count not an ``int``): such a call is checked each time."""
    if type(query) is not np.ndarray or type(num_heads) is not int:
        return None
    cores = default_workers() if workers is None else None  # (what they are chosen from)
    sizes: list[Any] = [query.shape, query.dtype, num_heads, mask, causal, workers, cores]
    for x in given[:8]:
        if x is None:
            sizes.append(None)
        elif type(x) is np.ndarray:
            sizes.append((x.shape, x.dtype))
        else:
            return None
    return tuple(sizes)


def kept_function_plan(signature: tuple[Any, ...]) -> FunctionPlan | None:
    """The plan kept for ``signature`` (:func:`function_signature`), if any."""
    plan: FunctionPlan | None = runtime.DEFAULT.function_plans.get(signature)
    return plan


def keep_function_plan(
    signature: tuple[Any, ...],
    kept: FunctionPlan | None,
    call: Call,
    given: tuple[np.ndarray, LayerWeights],
    mask: Any,
    workers: Any,
) -> None:
    """After the general path computed ``call`` of the input and weights ``given`` for
    ``signature`` (``kept``: what was kept for it before): a first call is only noted, the
    second keeps the plan of ``call`` (:class:`FunctionPlan`; of ``None`` where it is not
    plain, or holds an array the checks converted, :func:`.plans.as_given`: each call would
    then need its own conversion). Calls whose signatures keep
    changing (a growing prefix, batches of every length) then cost a lookup, not a plan
    each."""
    if kept is None:
        runtime.DEFAULT.function_plans.keep(signature, _SEEN_ONCE)
        return
    if kept is not _SEEN_ONCE:
        return  # (kept already, or not to keep)
    query, weights = given
    plan = None
    if as_given(call, LayerArrays(query, query, query), weights) and plain_call(call):
        plan = _planned(call, mask, workers)
    if plan is not None:
        plan.small = SmallCall.of(plan, call)
        plan.call = with_fields(plan.call, weights=None)  # (no weight kept alive)
    runtime.DEFAULT.function_plans.keep(signature, FunctionPlan(plan))


_SEEN_ONCE = FunctionPlan(None)
"""What a signature seen once is kept as (:func:`keep_function_plan`)."""
