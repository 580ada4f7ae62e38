"""A layer's decoding step kept for its next calls: the calls a model makes thousands of
times, one new token per sequence on a contiguous :class:`mha.KVCache`.

A layer's cached call checks its arguments, its keywords and its cache's state, and then
computes through the general pipeline (:func:`.projection.compute`), which asks at each
stage what the call carries. When a call is a plain decoding step (:func:`step_for`: one
query per sequence, self-attention, causal over a cache without a window, no mask, bias,
sinks, soft-capping, ALiBi, QK-norm or output stage, the module's own class), the layer
keeps a :class:`DecodingStep` made from that checked call; the next call with the same
module state, query shape and dtype, workers and kind of cache runs it: the same
functions in the same order on the same arrays (the fused projection of
``Team.matmul_heads``, the scale, :func:`.rotary.rotate`, :func:`.cached.attend_cached`
and its walk, ``Team.matmul`` for ``W_o``), so the same bits, without the checks and the
questions whose answers cannot have changed. Anything else, including every call the
step would refuse, goes the general way, which checks it.

What the step checks each call: the module's attributes are the very objects it was made
with (an assignment to any of them, a weight replaced, a window set, forgets the step; a
weight updated in place is read as it is now, as by the general path), the query is a
NumPy array of the kept shape and dtype, and the cache is a :class:`mha.KVCache` of the
kept shape and dtype without a window (the cache's own append checks its room).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .._arrays import cast_result
from .._kernel import runtime
from .._kernel.contract import MaskRules
from .._kernel.team import Team
from .cache import KVCache
from .cached import Append, CachedCall, attend_cached
from .checks import Call
from .gradients import join_heads
from .projection import layer_sizes, layer_workers
from .rotary import rotate, rotation

__all__ = ["DecodingStep", "keep_step", "kept_step", "step_for"]


class DecodingStep:
    """One layer's decoding step (:mod:`.decoding`), made from a checked call by
    :func:`step_for`; called with the layer, its query and cache and the workers given."""

    def __init__(self, module: Any, call: Call, workers: Any) -> None:
        w = call.weights.in_dtype(call.compute_dtype)
        self.state = dict(vars(module))  # the module's attributes, by identity
        self.values = tuple(self.state.values())
        self.workers, self.threads, self.sizes = workers, call.request.threads, layer_sizes(call)
        self.shape, self.dtype = call.Q.shape, call.Q.dtype
        self.cache_shape = (call.B[0], call.H_kv, call.d_k, call.d_v)
        self.compute_dtype, self.result_dtype = call.compute_dtype, call.result_dtype
        self.scale, self.rotary = call.scale, call.rotary
        joined = w.joined()
        assert joined is not None  # (step_for's condition)
        self.W_qkv, self.W_o, self.b_o = joined, w.W_o, w.b_o
        self.b_qkv = None
        if w.b_q is not None or w.b_k is not None or w.b_v is not None:
            self.b_qkv = np.concatenate(
                [
                    np.zeros(W.shape[1], W.dtype) if b is None else b
                    for b, W in ((w.b_q, w.W_q), (w.b_k, w.W_k), (w.b_v, w.W_v))
                ]
            )
        self.heads = [(call.H, call.d_k), (call.H_kv, call.d_k), (call.H_kv, call.d_v)]
        assert call.append is not None
        self.rules, self.arrays = call.append.rules, call.append.arrays
        self.counts = np.ones(call.B[0], np.int64)
        self.counts.flags.writeable = False
        self.request = call.request

    def __call__(self, module: Any, query: Any, cache: Any, workers: Any) -> np.ndarray | None:
        """The layer's output for ``query`` appended to ``cache``, or ``None`` when this
        call is not the kept step's (the general path then checks and computes it)."""
        if not (
            type(query) is np.ndarray
            and query.shape == self.shape
            and query.dtype == self.dtype
            and type(cache) is KVCache
            and cache.window is None
            and not cache.values_in_keys
            and cache.dtype == self.compute_dtype
            and cache._k.shape[0] == self.cache_shape[0]
            and (cache._k.shape[1], cache._k.shape[3], cache._v.shape[3]) == self.cache_shape[1:]
            and type(workers) is type(self.workers)
            and workers == self.workers
            and self._same_state(module)
        ):
            return None
        return self._run(query, cache)

    def _same_state(self, module: Any) -> bool:
        state = vars(module)
        return (
            len(state) == len(self.state)
            and all(map(operator.is_, state.values(), self.values))
            and state.keys() == self.state.keys()
        )

    def _run(self, query: np.ndarray, cache: KVCache) -> np.ndarray:
        """:func:`.projection.compute` of the kept call, its stages those this call has."""
        dtype = self.compute_dtype
        Q = query.astype(dtype, copy=False)
        workers = self.threads
        if workers is None:  # as compute() works it out, from the keys attended
            workers = layer_workers(self.sizes, int(cache.lengths.max(initial=0)) + 1)
        with np.errstate(invalid="ignore", over="ignore"), Team(workers) as team:
            q, k, v = team.matmul_heads(Q, self.W_qkv, self.b_qkv, self.heads)
            q *= self.scale
            if self.rotary is not None:
                positions = cache.lengths[:, None] + _ONE_ROW
                turn = rotation(q.shape, positions, q.dtype, **self.rotary)
                q, k = rotate(q, turn), rotate(k, turn)
            append = Append(cache, self.counts, self.rules, self.arrays)
            cached = CachedCall(q, k, v, append, 1.0, None, self.request)
            joined = join_heads(attend_cached(cached, team)[0])
            out = team.matmul(joined, self.W_o, self.b_o)
        return cast_result(out, self.result_dtype)


_ONE_ROW = np.arange(1)
"""A decoding step's offsets of its rows: its positions are the cache's lengths (as
:func:`.checks.with_cache_state` works them out for one row)."""

_PLAIN_CAUSAL = (MaskRules(causal=None), MaskRules(causal=True))


def step_for(module: Any, call: Call, workers: Any) -> DecodingStep | None:
    """The decoding step of a layer's checked cached ``call``, or ``None`` when the call is
    not a plain decoding step (:mod:`.decoding`). ``workers``: as the call was given. The
    layer's class is :class:`mha.MultiHeadAttention` itself (its caller's check: a
    subclass may compute more)."""
    append, spec = call.append, call.spec
    if append is None or not isinstance(workers, (int, type(None))):
        return None
    arrays = append.arrays
    plain = (
        getattr(module, "shares_kv_with", None) is None
        and call.L == 1
        and len(call.B) == 1
        and call.self_attention
        and call.Q.ndim == 3
        and not call.extra
        and not call.given.left_padded
        and call.scores is None
        and call.qk_norm is None
        and call.q_scale is None
        and spec.output is None
        and spec.clip_qkv is None
        and spec.v_norm is None
        and not spec.dropout_p
        and not call.request.weights
        and not call.request.backward
        and not call.request.lse
        and append.rules in _PLAIN_CAUSAL
        and arrays.mask is None
        and arrays.bias is None
        and arrays.key_lengths is None
        and arrays.query_lengths is None
        and (call.rotary is None or "scaling" not in call.rotary)
        and call.weights.in_dtype(call.compute_dtype).joined() is not None
    )
    return DecodingStep(module, call, workers) if plain else None


def kept_step(module: Any) -> DecodingStep | None:
    """The layer's kept decoding step, if it has one."""
    step: DecodingStep | None = runtime.DEFAULT.layer_steps.get(module)
    return step


def keep_step(module: Any, call: Call, workers: Any) -> None:
    """Keep the layer's decoding step of ``call`` (:func:`step_for`), when it is one (a
    prompt's call leaves the step kept: the next decoding step is its again)."""
    step = step_for(module, call, workers)
    if step is not None:
        runtime.DEFAULT.layer_steps[module] = step
