"""A layer's decoding step kept for its next calls: the calls a model makes thousands of
times, one new token per sequence on a contiguous :class:`mha.KVCache`.

A layer's cached call checks its arguments, its keywords and its cache's state before
:func:`.projection.compute` computes it. When a call is a plain decoding step
(:func:`step_for`: every keyword but the cache and the workers left out, one query per
sequence, self-attention, causal over a cache without a window, no mask, bias, sinks,
soft-capping, ALiBi, QK-norm or output stage, :class:`mha.MultiHeadAttention` itself), the
layer keeps a :class:`DecodingStep`: that checked call without its query and cache. The
next call with the same module state, query shape and dtype, workers and kind of cache is
that call with its own query and cache put in (what the cache appends and the rotary
positions, worked out as :func:`.checks.with_cache_state` does), computed by
:func:`.projection.compute` as every call is: the same bits, without the checks whose
answers cannot have changed. Any other call, including every call the step would refuse,
goes the general way, which checks it.

What the step checks each call: the module's attributes are those it was made from
(:class:`.kept_state.LayerState`: an assignment to any of them, a weight replaced, a window
set, a dict of them changed in place, drops the step; a weight updated in place is read as
it is now, by the general path's functions: a step is kept only where the call holds the
layer's own weight arrays), the weights it reads have the shapes and dtypes they had, the
query is a NumPy array of the kept shape and dtype, and the cache is a :class:`mha.KVCache`
of the kept batch, heads, widths and dtype without a window (its append checks its room)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import cast_result
from .._kernel import compiled, runtime
from .._kernel.team import Team
from .cache import KVCache
from .cached import Append, CachedCall, attend_cached_step, plain_append
from .checks import Call, cache_positions, plain_heads, side_by_side_bias, with_fields
from .gradients import join_heads
from .kept_state import LayerState, weights_as_given
from .projection import compute, layer_sizes, layer_workers
from .rotary import rotate, rotation
from .spec import with_cache

__all__ = ["DecodingStep", "keep_step", "kept_step", "step_for"]


class DecodingStep:
    """One layer's decoding step (:mod:`.decoding`), made from a checked call by
    :func:`step_for`; called with the layer, its query, its cache and the workers given."""

    def __init__(self, module: Any, call: Call, workers: Any) -> None:
        self.state = LayerState(module, call)
        self.workers = workers
        self.shape, self.dtype = call.Q.shape, call.Q.dtype
        self.fit = (call.B[0], call.H_kv, call.d_k, call.d_v, call.compute_dtype)
        assert call.append is not None
        self.rules, self.arrays = call.append.rules, call.append.arrays
        self.counts = np.ones(call.B[0], np.int64)
        self.counts.flags.writeable = False
        # the call without its query, cache and positions (none of them held)
        self.call = with_fields(
            call, Q=None, K=None, V=None, given=None, append=None, q_positions=None,
            k_positions=None,
        )  # fmt: skip
        self.given = with_cache(call.given, None)  # (its cache put in each call)
        self.layer = layer_sizes(call)  # (what the default workers are chosen from)
        self.heads = call.H, call.H_kv, call.d_k, call.d_v

    def __call__(self, module: Any, query: Any, cache: Any, workers: Any) -> Any:
        """The layer's output for ``query`` appended to ``cache``, or ``None`` when this
        call is not the kept step's (the general path then checks and computes it)."""
        if not self.state.holds(module):
            runtime.DEFAULT.layer_steps.pop(module, None)  # (its arrays not kept alive)
            return None
        if not (
            type(query) is np.ndarray
            and query.shape == self.shape
            and query.dtype == self.dtype
            and type(cache) is KVCache
            and cache.window is None
            and not cache.values_in_keys
            and _fit(cache) == self.fit
            and type(workers) is type(self.workers)
            and workers == self.workers
        ):
            return None
        at = cache_positions(cache, 1)
        if workers is None:  # compute's default for the call
            workers = layer_workers(self.layer, int(cache.lengths.max(initial=0)) + 1)
        if workers == 1:
            out = self._on_one_worker(query, cache, at)
            if out is not None:
                return out
        append = Append(cache, self.counts, self.rules, self.arrays)
        call = with_fields(
            self.call, Q=query, K=query, V=query, given=with_cache(self.given, cache),
            append=append, q_positions=at, k_positions=at,
        )  # fmt: skip
        return compute(call)

    def _on_one_worker(self, query: np.ndarray, cache: KVCache, at: np.ndarray) -> Any:
        """The step on one worker as :func:`.projection.compute` computes it, the same
        functions in the same order (the same bits), without the general path's Python
        between them (a SmolLM2 layer's step, its weights in cache: 198 us against 222
        through ``compute``, medians of interleaved runs): the projection of the query, key
        and value in one product, the rotation, the cache's plain route for one worker
        (:func:`.cached.attend_cached_step`: the append, the compiled walk without a plan
        or a visibility, the commit: 152 -> 126 us a small layer's step, 258 -> 226 a
        SmolLM2 layer's, against :func:`.cached.attend_cached`), the output's product.
        ``None`` (nothing changed) where it does not apply: the weights not side by side, a
        cache of another dtype or full (it grows on the general path), the compiled walk
        unavailable."""
        call = self.call
        dtype = call.compute_dtype
        w = call.weights.in_dtype(dtype)
        W_qkv = w.joined()
        if (
            W_qkv is None
            or dtype.type not in (np.float32, np.float64)  # (the compiled walk's)
            or cache.dtype != dtype
            or int(cache._held().max(initial=0)) >= cache.capacity
            or not compiled.walk_available()
        ):
            return None
        H, H_kv, d_k, d_v = self.heads
        B = len(query)
        with np.errstate(invalid="ignore", over="ignore"), Team(1) as team:
            b_qkv = side_by_side_bias((w.b_q, w.W_q), (w.b_k, w.W_k), (w.b_v, w.W_v))
            qkv = team.matmul(query.astype(dtype, copy=False).reshape(B, -1), W_qkv, b_qkv)
            cuts = (H * d_k, (H + H_kv) * d_k)
            q = qkv[:, : cuts[0]].reshape(B, H, 1, d_k)  # views of the product
            k = qkv[:, cuts[0] : cuts[1]].reshape(B, H_kv, 1, d_k)
            v = qkv[:, cuts[1] :].reshape(B, H_kv, 1, d_v)
            q *= call.scale
            if call.rotary is not None:
                turn = rotation(q.shape, at, dtype, **call.rotary)
                q, k = rotate(q, turn), rotate(k, turn)
            append = Append(cache, self.counts, self.rules, self.arrays)
            cached = CachedCall(q, k, v, append, 1.0, None, call.request)
            out = attend_cached_step(cached, team)
            result = team.matmul(join_heads(out), w.W_o, w.b_o)
        return cast_result(result, call.result_dtype)


def _fit(cache: KVCache) -> tuple[Any, ...]:
    """What a step's cache must match: its batch, key/value heads, widths and dtype."""
    B, H_kv, _, d_k = cache._k.shape
    return B, H_kv, d_k, cache._v.shape[3], cache.dtype


def step_for(module: Any, call: Call, workers: Any) -> DecodingStep | None:
    """The decoding step of a layer's checked cached ``call``, or ``None`` when the call is
    not a plain decoding step (:mod:`.decoding`). ``workers``: as the call was given; the
    caller has checked that every other keyword was left out and that the layer's class is
    :class:`mha.MultiHeadAttention` itself (a subclass may compute more)."""
    append = call.append
    if append is None or not (workers is None or type(workers) is int):
        return None
    cache = append.cache
    plain = (
        getattr(module, "shares_kv_with", None) is None
        and weights_as_given(module, call)  # (an update in place is read)
        and type(cache) is KVCache
        and cache.window is None
        and not cache.values_in_keys
        and call.L == 1
        and len(call.B) == 1
        and call.self_attention
        and call.Q.ndim == 3
        and plain_heads(call)
        and plain_append(append)
        and (call.rotary is None or "scaling" not in call.rotary)
    )
    step = DecodingStep(module, call, workers) if plain else None
    return step if step is not None and step.state.keepable else None


def kept_step(module: Any) -> DecodingStep | None:
    """The layer's kept decoding step, if it has one."""
    step: DecodingStep | None = runtime.DEFAULT.layer_steps.get(module)
    return step


def keep_step(module: Any, call: Call, workers: Any) -> None:
    """Keep the layer's decoding step of ``call`` (:func:`step_for`), or drop the one it
    had when ``call`` is not one (its arrays are not kept alive)."""
    step = step_for(module, call, workers)
    if step is not None:
        runtime.DEFAULT.layer_steps[module] = step
    else:
        runtime.DEFAULT.layer_steps.pop(module, None)
