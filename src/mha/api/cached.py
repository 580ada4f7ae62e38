"""Calls with ``cache=``: the new tokens' keys and values appended to a cache, and their
queries attending over everything it holds.

A cache is anything that follows :class:`Cache`: :class:`mha.KVCache` (contiguous, with a
window and sink tokens), :class:`mha.PagedKVCache` (blocks, shared prefixes, quantized
pools). :func:`check_cache` checks what a call would append before the cache changes;
:func:`attend_cached` appends, attends (each sequence aligned to its own length) and commits
the new lengths only once the attention is computed, restoring the cache when anything fails.
The new tokens attend causally unless the call says ``causal=False`` (or ``mask=False``):
then each sees every cached key of its sequence and every new one (CPM-Ant's prefill).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from .._arrays import cast_result
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import (
    CachedPositions,
    MaskArrays,
    MaskRules,
    ScoreShape,
    Visibility,
    check_lengths,
)
from .._kernel.forward import attend, attend_band, attend_step
from .._kernel.geometry import NO_WINDOW
from .._kernel.team import Team, workers_for
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .padding import to_front, to_left
from .spec import Checked, Request

__all__ = [
    "PLAIN_CAUSAL",
    "Append",
    "Cache",
    "CacheFit",
    "attend_cached",
    "attend_cached_step",
    "attend_split_cached",
    "check_cache",
    "plain_append",
    "plain_band",
    "plain_queries",
    "plain_visibility",
]


class Cache(Protocol):
    """What the attention calls need of a cache: its state seen through ``lengths`` (each
    sequence's next position), ``first`` (the position in the first slot after the sink
    tokens'), its ``window``, ``sink_tokens`` and dtypes; the checks and writes of an
    append, a snapshot to restore when a call fails, and the tiles a walk reads. A new kind
    of cache implements these (:class:`mha.KVCache`, :class:`mha.PagedKVCache`)."""

    @property
    def lengths(self) -> np.ndarray: ...
    @property
    def first(self) -> np.ndarray: ...
    @property
    def window(self) -> int | None: ...
    @property
    def sink_tokens(self) -> int: ...
    @property
    def values_in_keys(self) -> bool: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def compute_dtype(self) -> np.dtype: ...

    def _check_fit(self, batch: int, heads: int, d_k: int, d_v: int, where: str) -> None:
        """Refuse, naming the shapes, new keys and values this cache cannot hold."""

    def _append(self, k: np.ndarray, v: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Write the first ``counts[b]`` new keys and values of each sequence ``b`` after
        its length (the lengths do not move yet); return each sequence's filled slots."""

    def _attended(self, S: int) -> tuple[Any, Any]:
        """The keys and values of the first ``S`` slots, as the kernel reads them: arrays
        ``(B, H_kv, S, d)`` or a paged pool's tiles (:class:`mha._kernel.paged.PagedKV`)."""

    def _snapshot(self) -> Any:
        """The state an append changes."""

    def _restore(self, state: Any) -> None:
        """Back to a :meth:`_snapshot`'s state."""

    def _commit(self, counts: np.ndarray) -> None:
        """Advance each sequence's length by its new tokens: the append is done."""


class CacheFit(NamedTuple):
    """What a cached call would append: ``B`` sequences of ``L`` queries and ``new_keys``
    new keys, ``H_kv`` heads ``d_k`` and ``d_v`` wide."""

    B: int
    H_kv: int
    d_k: int
    d_v: int
    L: int
    new_keys: int


@dataclass(frozen=True)
class Append:
    """A checked append to ``cache``: each sequence's new tokens (``counts``), the call's
    mask rules as the cache sets them (its window, the sink tokens it keeps) and the call's
    mask and bias arrays (over positions)."""

    cache: Any
    counts: np.ndarray
    rules: MaskRules
    arrays: MaskArrays


@dataclass(frozen=True)
class CachedCall:
    """One cached call: the new tokens' ``q (B, H, L, d_k)``, ``k``, ``v`` (``(B, H_kv, L,
    d)``), what they append, the scale and the changes to the scores, and the request."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    append: Append
    scale: float
    scores: Any
    request: Request


def check_cache(
    cache: Any,
    rules: MaskRules,
    arrays: MaskArrays,
    fit: CacheFit,
    dtype: np.dtype,
    context: str,
) -> Append:
    """What a call with ``cache=`` appends, checked before the cache changes (computed in
    ``dtype``; ``context`` names the caller's arrays). The window attended within is the
    call's, which may be the cache's or narrower (a cache without a window keeps every
    position)."""
    if not hasattr(cache, "_append") or not hasattr(cache, "_attended"):
        raise AttentionTypeError(
            f"cache must be an mha.KVCache or mha.PagedKVCache; got {type(cache).__name__}"
        )
    where = f" ({context})"
    cache._check_fit(fit.B, fit.H_kv, fit.d_k, fit.d_v, where)
    if fit.new_keys != fit.L:
        raise ShapeError(
            f"with cache=, the keys and values are the new tokens' own, one per query: "
            f"{fit.L} queries but {fit.new_keys} keys{where}"
        )
    window = rules.window
    if cache.window is not None and (window is None or window > cache.window):
        raise AttentionValueError(
            f"window={window} but the cache keeps only what window={cache.window} needs: "
            f"{cache!r}; a call attends within the cache's window or a narrower one (make "
            "the cache with the attention's window, as new_cache does)"
        )
    tokens = rules.sink_tokens
    if (
        cache.window is not None
        and tokens not in (None, cache.sink_tokens)
        and (tokens or cache.sink_tokens)
    ):
        raise AttentionValueError(
            f"sink_tokens={tokens} but the cache keeps sink_tokens={cache.sink_tokens}: "
            f"{cache!r}; a call with a window cache attends to the sink tokens it keeps "
            "(make the cache with the attention's sink_tokens, as new_cache does)"
        )
    if tokens is None and cache.window is not None and cache.sink_tokens:
        tokens = cache.sink_tokens  # the sink tokens it keeps stay visible
    _check_dtype(cache, dtype, where)
    _refuse_by_position(cache, rules, arrays)
    counts = check_lengths("query_lengths", arrays.query_lengths, (fit.B,), fit.L, "query", context)
    counts = np.full(fit.B, fit.L, np.int64) if counts is None else counts
    if (window, tokens) != (rules.window, rules.sink_tokens):
        rules = replace(rules, window=window, sink_tokens=tokens)
    return Append(cache, counts, rules, arrays)


def _check_dtype(cache: Any, dtype: np.dtype, where: str) -> None:
    if dtype != cache.compute_dtype:
        held = f"{cache.dtype}" + (
            "" if cache.dtype == cache.compute_dtype else f", computed in {cache.compute_dtype},"
        )
        raise AttentionTypeError(
            f"the cache holds {held} but this call computes in {dtype}: make the "
            f"cache with dtype={dtype.name}, or cast the inputs{where}"
        )


def _refuse_by_position(cache: Any, rules: MaskRules, arrays: MaskArrays) -> None:
    """What a cache's call cannot take: key lengths, a mask or bias over the slots of a
    window's cache, a window without the causal mask, top-left alignment."""
    if arrays.key_lengths is not None:
        raise AttentionValueError(
            "cache= attends over the cached tokens; key_lengths cannot be combined "
            "with it (the cache's lengths say which keys each sequence has)"
        )
    given = {"bias": arrays.bias is not None, "mask": arrays.mask is not None}
    by_position = [name for name, present in given.items() if present]
    if by_position and cache.window is not None:
        raise AttentionValueError(
            f"{' and '.join(by_position)} with cache= index keys by position, but a cache "
            f"with a window drops old positions, so its slots are not positions: {cache!r}"
        )
    if rules.ahead:  # (0: causal, as a cache's call is)
        raise AttentionValueError(
            f"window=(left, right) with cache=: the right side ({rules.ahead} keys after each "
            "query) is not available with a cache, whose new tokens attend causally; give "
            "window=left + 1, or call without the cache"
        )
    if rules.causal is False and (cache.window is not None or rules.window is not None):
        raise AttentionValueError(
            "causal=False (or mask=False) with cache= attends to every cached key and every "
            f"new one, but a window hides keys by distance (window={rules.window}, "
            f"{cache!r}): a window's cache is for causal attention (leave causal and the "
            "window out, or make the cache without one)"
        )
    if rules.alignment not in (None, "bottom_right"):
        raise AttentionValueError(
            f"causal_alignment={rules.alignment!r} cannot be used with cache=: "
            "new tokens are the last of their sequence (bottom-right)"
        )


def attend_split_cached(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    checked: Checked,
    scale: float,
    scores: Any,
    dtypes: tuple[np.dtype, np.dtype],
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """:func:`mha.scaled_dot_product_attention`'s call with ``cache=``, its heads checked:
    the output (and the log-sum-exp) in the result dtype of ``dtypes`` (result,
    compute)."""
    spec, given, request = checked.spec, checked.given, checked.request
    if request.weights or request.backward or spec.dropout_p:
        raise AttentionValueError(
            "return_weights, return_backward and dropout are not available with cache=: "
            "call without the cache"
        )
    if k.ndim != 4 or v.ndim != 4:
        raise ShapeError(
            f"with cache=, k and v must be the new tokens' (B, H_kv, L_new, d): "
            f"got k {k.shape}, v {v.shape}"
        )
    fit = CacheFit(q.shape[0], k.shape[1], k.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2])
    context = f"q {q.shape}, k {k.shape}, v {v.shape}"
    append = check_cache(given.cache, spec.mask, given.arrays, fit, dtypes[1], context)
    if given.left_padded:  # the real rows first, as for right padding
        q, k, v = (to_front(x, append.counts, axis=-2) for x in (q, k, v))
    out, lse = attend_cached(CachedCall(q, k, v, append, scale, scores, request))
    if given.left_padded:
        out = to_left(out, append.counts, axis=-2)
        lse = None if lse is None else to_left(lse[..., None], append.counts, axis=-2)[..., 0]
    out = cast_result(out, dtypes[0])
    return out if lse is None else (out, lse)


def attend_cached(
    call: CachedCall, team: Team | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Append the first ``counts[b]`` new keys and values of each sequence ``b`` to the
    cache and attend over everything it holds: ``(out, lse or None)`` in the cache's
    compute dtype. The call was checked by :func:`check_cache`; the cache's lengths advance
    only once the attention is computed."""
    cache, v, k = call.append.cache, call.v, call.k
    if cache.values_in_keys and not np.array_equal(v, k[..., : v.shape[-1]]):
        raise AttentionValueError(
            f"the cache holds its values in its keys (values_in_keys=True): the new values "
            f"must be the first {v.shape[-1]} features of the new keys (v = k[..., :"
            f"{v.shape[-1]}]), and these are not ({cache!r})"
        )
    return _committed(call.append, lambda positions: _append_and_attend(call, team, positions))


_Result = TypeVar("_Result")


def _committed(append: Append, attend_appended: Callable[[np.ndarray], _Result]) -> _Result:
    """``attend_appended(positions)`` (``positions``: each sequence's first new token),
    which appends ``append``'s tokens and attends, then the cache's commit; on any error (a
    mask_mod or score_mod that fails, Ctrl-C) the cache as it was."""
    cache = append.cache
    positions = cache.lengths.copy()
    saved = cache._snapshot()
    try:
        result = attend_appended(positions)
    except BaseException:
        cache._restore(saved)
        raise
    cache._commit(append.counts)
    return result


def attend_cached_step(call: CachedCall, team: Team) -> np.ndarray:
    """:func:`attend_cached` of a decoding step on one worker (``team``'s, of one): a call
    of :func:`plain_queries` with one query a sequence (``q (B, H, 1, d_k)``), no
    log-sum-exp asked, a cache whose values are not in its keys. The same appends, commit,
    walk and bits (:func:`attend_band`'s on one worker: :func:`.forward.attend_step`),
    without the :class:`Visibility` and :class:`KernelCall` the general route builds first
    (its band made from the filled slots: :func:`plain_band`): tens of microseconds of a
    small layer's step (:mod:`.decoding`). What that walk does not take, :func:`attend`
    computes within the visibility the general route builds, as :func:`attend_band` hands
    it on."""
    q, append = call.q, call.append
    cache, counts = append.cache, append.counts

    def attend_appended(positions: np.ndarray) -> np.ndarray:
        filled = cache._append(call.k, call.v, counts)
        keys, values = cache._attended(int(filled.max(initial=0)))
        band = plain_band(filled, counts)
        out = attend_step(q, keys, values, band, call.scale, call.request.budget)
        if out is None:
            visibility = plain_visibility(q, filled, counts, positions, cache.first)
            out, _ = _attend_held(call, team, visibility, attend)
        return out

    return _committed(append, attend_appended)


def _append_and_attend(
    call: CachedCall, team: Team | None, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`attend_cached`'s work before the commit."""
    q, append = call.q, call.append
    cache, counts = append.cache, append.counts
    B, L = q.shape[0], q.shape[-2]
    dtype = cache.compute_dtype  # a bfloat16 cache's tiles are read in float32
    if plain_queries(append, call.scores, q):  # a decoding step, a prompt (plain_visibility)
        filled = cache._append(call.k, call.v, counts)
        visibility = plain_visibility(q, filled, counts, positions, cache.first)
        return _attend_held(call, team, visibility, attend_band)
    held_sink_tokens = cache.sink_tokens if cache.window is not None else 0
    rules = replace(append.rules, causal=append.rules.causal is not False)  # unless refused

    def visibility_for(filled: np.ndarray) -> Visibility:
        lengths = MaskArrays(append.arrays.mask, append.arrays.bias, filled, counts)
        cached = CachedPositions(
            filled - counts, positions, cache.first - held_sink_tokens, held_sink_tokens
        )
        shape = ScoreShape((B,), q.shape[-3], L, int(filled.max(initial=0)))
        return Visibility.build(rules, lengths, shape, dtype, "", cached)

    # Without a window a cache's slots are its positions: the call's mask and bias are
    # checked against them before anything is written (a window's cache moves them).
    checked = visibility_for(cache.lengths + counts) if cache.window is None else None
    filled = cache._append(call.k, call.v, counts)
    visibility = checked if checked is not None else visibility_for(filled)
    return _attend_held(call, team, visibility, attend)


def _attend_held(
    call: CachedCall, team: Team | None, visibility: Visibility, route: Any
) -> tuple[np.ndarray, np.ndarray | None]:
    """The call's queries over the keys the cache holds now (appended), within
    ``visibility``, by ``route`` (:func:`attend`, or :func:`attend_band` for a decoding
    step): ``(out, lse or None)`` in the cache's compute dtype."""
    q, request, cache = call.q, call.request, call.append.cache
    dtype = cache.compute_dtype  # a bfloat16 cache's tiles are read in float32
    S = visibility.S
    keys, values = cache._attended(S)
    outputs = Outputs(np.zeros((*q.shape[:-1], values.shape[-1]), dtype=dtype))
    if request.lse:
        outputs.lse = np.full(q.shape[:-1], -np.inf, dtype=dtype)
    cost = float(math.prod(q.shape[:-1])) * S * (q.shape[-1] + values.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"), ExitStack() as stack:
        if team is None:
            team = stack.enter_context(Team(workers_for(cost, request.threads)))
        kernel = KernelCall(
            q, keys, values, visibility, call.scale, call.scores, budget=request.budget
        )
        route(kernel, outputs, team)
    return outputs.out, outputs.lse


PLAIN_CAUSAL = (MaskRules(causal=None), MaskRules(causal=True))
"""The mask rules of a plain decoding step: causal (given or not), nothing else."""


def plain_append(append: Append) -> bool:
    """Whether ``append``'s call hides keys by the causal mask alone: no window, sink
    tokens, chunks or ``mask_mod``, no mask, bias or lengths of its own."""
    arrays = append.arrays
    return (
        append.rules in PLAIN_CAUSAL
        and arrays.mask is None
        and arrays.bias is None
        and arrays.key_lengths is None
        and arrays.query_lengths is None
    )


def plain_queries(append: Append, scores: Any, q: np.ndarray) -> bool:
    """Whether a cached call of queries ``q (B, H, L, d)`` takes the compiled walk's own
    route (:func:`plain_visibility`, :func:`attend_band`): :func:`plain_append` (causal,
    nothing else hidden, as many new tokens in each sequence: a decoding step, or a prompt),
    no changes to the scores, a cache without a window holding ``q``'s dtype, float32 or
    float64."""
    cache = append.cache
    return (
        scores is None
        and plain_append(append)
        and cache.window is None
        and q.dtype in _WALKED
        and cache.dtype == q.dtype
    )


_WALKED = (np.dtype(np.float32), np.dtype(np.float64))


def plain_band(filled: np.ndarray, counts: np.ndarray) -> tuple[Any, ...]:
    """The band of :func:`plain_visibility`'s visibility as :func:`.walk_inputs.band_of`
    gives it (one query a sequence, each seeing the keys up to its own), made from the
    filled slots and the new tokens' counts directly (``tests/test_decoding.py`` compares
    the two)."""
    offsets = (filled - counts).astype(np.int64, copy=False)
    return True, NO_WINDOW, offsets, filled.astype(np.int64), counts.astype(np.int64)


def plain_visibility(
    q: np.ndarray, filled: np.ndarray, counts: np.ndarray, positions: np.ndarray, first: Any
) -> Visibility:
    """The visibility :meth:`Visibility.build` gives a call of :func:`plain_queries` (each
    sequence's ``L`` queries its last, each seeing the keys up to its own), made without
    its checks (``tests/test_decoding.py`` compares the two field by field)."""
    S, L = int(filled.max(initial=0)), q.shape[-2]
    return Visibility(
        index_shape=q.shape[:2], L=L, S=S, causal_offset=S - L, key_lengths=filled,
        query_lengths=counts, causal=True, offsets=filled - counts, query_index=positions,
        key_index=first,
    )  # fmt: skip
