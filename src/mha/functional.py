"""The functional API: ``scaled_dot_product_attention`` and ``multi_head_attention``.

Weights use the "x @ W" layout: ``W_q (d_q, H*d_k)`` maps a query of width ``d_q`` to the
``H`` heads' concatenated queries. Shapes are named as in the paper: ``B`` batch, ``H``
heads, ``L`` query positions, ``S`` key positions, ``d_k``/``d_v`` per-head widths.
"""

from __future__ import annotations

import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays import (
    as_float_array,
    check_rank,
    positive_int,
    resolve_scale,
    result_and_compute_dtypes,
)
from ._arrays import (
    flag as _flag,
)
from ._kernel.backward import attend_backward
from ._kernel.contract import Visibility, check_lengths
from ._kernel.dropout import Dropout
from ._kernel.forward import DEFAULT_MAX_MEMORY, attend, merge_partials
from ._kernel.team import Team, default_workers, workers_for
from .cache import KVCache
from .errors import AttentionTypeError, AttentionValueError, ShapeError
from .rotary import apply_rotary

__all__ = ["merge_attention", "multi_head_attention", "scaled_dot_product_attention"]


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: bool = False,
    causal_alignment: str | None = None,
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    window: int | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_backward: bool = False,
    dropout_p: float = 0.0,
    generator: np.random.Generator | None = None,
    cache: KVCache | None = None,
    max_memory: int | None = None,
    workers: int | None = None,
) -> Any:
    """Attention over already split heads: ``softmax(q k^T * scale + bias) v`` per head.

    Arguments (every mask argument combines with the others by AND; True = may attend):

    * ``q (..., H, L, d_k)``, ``k (..., H_kv, S, d_k)``, ``v (..., H_kv, S, d_v)``: queries,
      keys and values with the same batch axes. ``H_kv`` divides ``H``: with fewer key/value
      heads (grouped-query or multi-query attention) query head ``h`` uses key/value head
      ``h // (H // H_kv)``, without the keys ever being repeated. float64 in gives float64
      out; float32 is computed in float32; float16 in float32.
    * ``mask``: a boolean array, **True = may attend**, broadcastable to the scores
      ``(..., H, L, S)``; with batch axes, ``(B, L, S)`` applies to every head. ``mask=True``
      is the causal mask (as ``causal=True``). Integer or float arrays are refused: an
      additive mask of 0 and ``-inf`` goes in ``bias``.
    * ``causal``: hide key ``j`` from query ``i`` when ``j > i + (S - L)``: the last query
      sees every key ("bottom_right" alignment, what cached decoding needs).
    * ``causal_alignment``: ``"top_left"`` for ``j > i`` instead (PyTorch's ``is_causal``);
      only with a causal mask.
    * ``key_lengths``: one integer per sequence (shape of the batch axes, or a single number
      without them): keys at index ``>= length`` are padding.
    * ``query_lengths``: likewise for query rows: padding rows see no key and get zeros.
    * ``bias``: an additive float array broadcastable like ``mask``, added to the scaled
      scores; ``-inf`` hides a key.
    * ``window``: a sliding window: query ``i`` sees key ``j`` only if
      ``(i + offset) - j < window``, ``offset`` being the causal alignment's (``S - L``, or
      0 for top-left). Tiles outside the band are skipped: time O(L·window), not O(L·S).
    * ``scale``: the factor on ``q k^T``; default ``1/sqrt(d_k)``.
    * ``return_weights``: also return the weights ``(..., H, L, S)`` (this builds the full
      score matrix, which the default path never does).
    * ``return_lse``: also return the log-sum-exp of each row's logits ``(..., H, L)``
      (``-inf`` for a row that sees no key; float32 for float16 inputs), for
      :func:`merge_attention`.
    * ``return_backward``: also return ``backward``, a function of the output's gradient
      ``grad_out`` that returns ``{"q": dq, "k": dk, "v": dv}`` (and ``"bias"`` when a bias
      was given), each shaped like its input, in its dtype: FlashAttention-2's backward pass,
      tile by tile from the saved log-sum-exp, never building the score matrix.
    * ``dropout_p`` with ``generator`` (a ``np.random.Generator``, required with dropout):
      drop each attention weight with probability ``dropout_p`` and scale the rest by
      ``1 / (1 - dropout_p)``, in training. The mask depends only on one number drawn from
      ``generator``, not on the tiling; ``backward`` reuses it.
    * ``cache``: a :class:`mha.KVCache`. Then ``k`` and ``v`` are the new tokens'
      ``(B, H_kv, L, d)``: they are appended to the cache after each sequence's length (only
      the first ``query_lengths[b]`` rows of sequence ``b``, when given) and ``q`` attends
      causally over everything cached, each sequence aligned to its own length, within the
      cache's window. ``mask``, ``bias``, ``key_lengths``, ``return_weights`` and a top-left
      alignment are refused with a cache, and a refused call leaves it unchanged.
    * ``max_memory``: bytes of scratch per worker (default 6 MiB); sets the tile sizes.
    * ``workers``: threads (default: every core when threadpoolctl is installed, else 1).
      Results are bitwise reproducible for fixed inputs, ``max_memory`` and ``workers``.

    Returns ``out (..., H, L, d_v)``, then the weights, the log-sum-exp and ``backward`` if
    asked for, in that order. A query row that sees no key gets zero weights and a zero output.

    >>> import numpy as np
    >>> from mha import scaled_dot_product_attention
    >>> q = k = np.eye(2)[None]                      # one head, two positions
    >>> v = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    >>> scaled_dot_product_attention(q, k, v, causal=True).round(3)  # e^(1/sqrt 2) = 2.028
    array([[[1.  , 0.  ],
            [0.33, 0.67]]])
    """
    q, k, v, result_dtype, compute_dtype = _checked_heads(q, k, v)
    scale = resolve_scale(scale, q.shape[-1], compute_dtype)
    budget, threads = _kernel_options(return_weights, max_memory, workers)
    masking = _masking(mask, causal, causal_alignment, key_lengths, query_lengths, bias, window)
    drop_p = _dropout_p(dropout_p, generator)
    if cache is not None:
        if return_weights or return_backward or drop_p:
            raise AttentionValueError(
                "return_weights, return_backward and dropout are not available with cache=: "
                "call without the cache"
            )
        return _with_cache(
            q, k, v, cache, masking, scale, _flag("return_lse", return_lse), budget, threads,
            result_dtype, compute_dtype,
        )  # fmt: skip
    visibility = Visibility.build(
        batch_shape=q.shape[:-3], H=q.shape[-3], L=q.shape[-2], S=k.shape[-2],
        dtype=compute_dtype, context=f"q {q.shape}, k {k.shape}", **masking,
    )  # fmt: skip
    # The seed is drawn once everything is checked: a refused call leaves the generator be.
    dropout = Dropout.draw(drop_p, generator, q.shape[-3], q.shape[-2]) if drop_p else None
    want_lse = _flag("return_lse", return_lse)
    want_backward = _flag("return_backward", return_backward)
    out = np.zeros((*q.shape[:-1], v.shape[-1]), dtype=compute_dtype)
    weights = None
    if return_weights:
        weights = np.zeros((*q.shape[:-1], k.shape[-2]), dtype=compute_dtype)
    lse = None
    if want_lse or want_backward:
        lse = np.full(q.shape[:-1], -np.inf, dtype=compute_dtype)
    cost = float(np.prod(q.shape[:-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"), Team(workers_for(cost, threads)) as team:
        attend(
            q, k, v, visibility, scale, out, weights=weights, lse=lse, max_memory=budget,
            team=team, dropout=dropout,
        )  # fmt: skip
    results: list[Any] = [_cast(out, result_dtype)]
    if weights is not None:
        results.append(_cast(weights, result_dtype))
    if want_lse:
        results.append(lse)
    if want_backward:
        assert lse is not None
        results.append(_SplitHeadsBackward(
            q, k, v, bias, out, lse, visibility, scale, compute_dtype, budget, threads, dropout,
        ))  # fmt: skip
    return results[0] if len(results) == 1 else tuple(results)


def _checked_heads(
    q: Any, k: Any, v: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype, np.dtype]:
    """:func:`scaled_dot_product_attention`'s ``q``, ``k``, ``v`` as arrays whose shapes fit
    together, with the result and compute dtypes (shared with :mod:`mha.dask`)."""
    q = as_float_array("q", q)
    k = as_float_array("k", k)
    v = as_float_array("v", v)
    for name, array in (("q", q), ("k", k), ("v", v)):
        if array.ndim < 3:
            raise ShapeError(
                f"{name} must have shape (..., H, {'L' if name == 'q' else 'S'}, d) with a "
                f"head axis; got shape {array.shape}"
            )
    _same("q", q, "k", k, "batch axes {}", q.shape[:-3], k.shape[:-3])
    _same("k", k, "v", v, "leading (batch..., H_kv) axes {}", k.shape[:-2], v.shape[:-2])
    _kv_heads(q.shape[-3], k.shape[-3], f"q {q.shape}, k {k.shape}")
    _same("q", q, "k", k, "head width {}", q.shape[-1], k.shape[-1])
    _same("k", k, "v", v, "{} positions", k.shape[-2], v.shape[-2])
    result_dtype, compute_dtype = result_and_compute_dtypes(q, k, v)
    return q, k, v, result_dtype, compute_dtype


class _SplitHeadsBackward:
    """``backward(grad_out)`` of one :func:`scaled_dot_product_attention` call: the
    gradients of ``sum(grad_out * out)`` for ``q``, ``k``, ``v`` (and ``bias``), each shaped
    like its input, in its dtype. It keeps q, k, v (the caller's arrays: a fingerprint
    refuses a backward after they changed), the output and the log-sum-exp, never the score
    matrix, and may be called any number of times, from any thread."""

    def __init__(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: Any, out: np.ndarray,
        lse: np.ndarray, visibility: Visibility, scale: float, dtype: np.dtype, budget: int,
        threads: int | None, dropout: Dropout | None,
    ) -> None:  # fmt: skip
        self.dtypes = {"q": q.dtype, "k": k.dtype, "v": v.dtype}
        self.q, self.k, self.v = q, k, v
        self.unchanged = _Fingerprints({
            "q": q, "k": k, "v": v, "mask": visibility.mask, "bias": visibility.bias,
            "the returned output": out, "the returned log-sum-exp": lse,
        }, threads)  # fmt: skip
        self.bias_shape = None if bias is None else np.shape(bias)
        if bias is not None:
            self.dtypes["bias"] = as_float_array("bias", bias).dtype
        self.out, self.lse, self.visibility = out, lse, visibility
        self.scale, self.dtype, self.budget, self.threads = scale, dtype, budget, threads
        self.dropout = dropout

    def __call__(self, grad_out: Any) -> dict[str, np.ndarray]:
        grad = _gradient("grad_out", grad_out, self.out.shape, self.dtype)
        self.unchanged.check()
        dq, dk, dv = (np.zeros(x.shape, self.dtype) for x in (self.q, self.k, self.v))
        dbias = None
        if self.bias_shape is not None and self.visibility.bias is not None:
            dbias = np.zeros(self.visibility.bias.shape, self.dtype)  # the bias's own size
        cost = (
            float(np.prod(self.q.shape[:-1]))
            * self.k.shape[-2]
            * 2
            * (self.q.shape[-1] + self.v.shape[-1])
        )
        with (
            np.errstate(invalid="ignore", over="ignore"),
            Team(workers_for(cost, self.threads)) as team,
        ):
            attend_backward(
                self.q, self.k, self.v, self.out, self.lse, grad, self.visibility, self.scale,
                dq=dq, dk=dk, dv=dv, dbias=dbias, max_memory=self.budget, team=team,
                dropout=self.dropout,
            )  # fmt: skip
        grads = {"q": dq, "k": dk, "v": dv}
        if dbias is not None and self.bias_shape is not None:
            grads["bias"] = _sum_to(dbias, self.bias_shape, self.q.shape[:-3])
        return {name: _cast(g, self.dtypes[name]) for name, g in grads.items()}


class _Fingerprints:
    """Checksums (CRC-32 of each MiB, on the thread team: zlib releases the GIL) of the arrays
    a backward pass reads again, to refuse one after they changed: torch counts versions of
    its tensors; NumPy arrays have none."""

    CHUNK = 2**20

    def __init__(self, arrays: dict[str, Any], threads: int | None) -> None:
        given = {name: x for name, x in arrays.items() if isinstance(x, np.ndarray)}
        self.threads = threads
        self.arrays = given
        self.sums = self._checksums(given)

    def _checksums(self, arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        unique = {id(x): np.ascontiguousarray(x) for x in arrays.values()}  # read once each
        chunks = [
            (key, start) for key, x in unique.items() for start in range(0, x.nbytes, self.CHUNK)
        ]
        sums: dict[tuple[int, int], int] = {}

        def make_worker() -> Any:
            def crc(chunk: tuple[int, int]) -> None:
                key, start = chunk
                data = unique[key].reshape(-1).view(np.uint8)[start : start + self.CHUNK]
                sums[chunk] = zlib.crc32(data.data)

            return crc

        workers = self.threads or (default_workers() if len(chunks) > 1 else 1)
        with Team(workers) as team:
            team.run(chunks, make_worker)
        by_array = {
            key: tuple(sums[key, start] for start in range(0, x.nbytes, self.CHUNK))
            for key, x in unique.items()
        }
        return {name: by_array[id(x)] for name, x in arrays.items()}

    def check(self) -> None:
        now = self._checksums(self.arrays)
        changed = [name for name in self.arrays if now[name] != self.sums[name]]
        if changed:
            raise AttentionValueError(
                f"{', '.join(changed)} changed after the forward pass; backward needs them as "
                "they were (call it before updating them, or run the forward pass again)"
            )


def _dropout_p(p: Any, generator: Any) -> float:
    """``dropout_p`` checked with ``generator`` (required with dropout, refused without)."""
    real = isinstance(p, (int, float, np.integer, np.floating)) and not isinstance(
        p, (bool, np.bool_)
    )
    if not real or not 0.0 <= float(p) < 1.0:
        raise AttentionValueError(f"dropout_p must be a number in [0, 1); got {p!r}")
    if float(p) == 0.0:
        if generator is not None:
            raise AttentionValueError(
                "generator= has no effect without dropout_p > 0: give both, or neither"
            )
        return 0.0
    if not isinstance(generator, np.random.Generator):
        raise AttentionTypeError(
            f"dropout_p={p} needs generator=, a np.random.Generator (for example "
            f"np.random.default_rng(0)), so that runs can be repeated; got {generator!r}"
        )
    return float(p)


def _gradient(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The upstream gradient: real, finite, of the output's shape, in the compute dtype."""
    grad = as_float_array(name, value)
    if grad.shape != shape:
        raise ShapeError(f"{name} must have the output's shape {shape}; got {grad.shape}")
    bad = int(np.size(grad) - np.count_nonzero(np.isfinite(grad)))
    if bad:
        raise AttentionValueError(
            f"{name} holds {bad} NaN or infinite value{'s' if bad > 1 else ''} (shape "
            f"{shape}); gradients are computed from finite upstream gradients only"
        )
    return grad.astype(dtype, copy=False)


def _sum_to(full: np.ndarray, shape: tuple[int, ...], batch_shape: tuple[int, ...]) -> np.ndarray:
    """The gradient of an array of ``shape`` broadcast to ``full``'s shape as the mask
    contract broadcasts ``bias``: summed over the axes it was broadcast along."""
    aligned = shape
    if batch_shape and len(shape) == full.ndim - 1:
        aligned = (*shape[:-2], 1, *shape[-2:])  # (B, L, S): the same for every head
    aligned = (1,) * (full.ndim - len(aligned)) + aligned
    axes = tuple(i for i, (a, b) in enumerate(zip(aligned, full.shape, strict=True)) if a != b)
    summed: np.ndarray = full.sum(axis=axes, keepdims=True) if axes else full
    return summed.reshape(shape)


def _kv_heads(H: int, H_kv: int, shapes: str) -> int:
    """The query heads per key/value head; ``H_kv`` must divide ``H``."""
    if H_kv == 0 or H % H_kv:
        raise ShapeError(
            f"{H_kv} key/value heads do not divide {H} query heads ({shapes}); grouped-query "
            "attention needs H to be a multiple of H_kv"
        )
    return H // H_kv


def _with_cache(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cache: Any,
    masking: dict[str, Any],
    scale: float,
    want_lse: bool,
    budget: int,
    threads: int | None,
    result_dtype: np.dtype,
    compute_dtype: np.dtype,
    team: Team | None = None,
) -> Any:
    """Append the new keys and values to ``cache`` and attend over everything it holds.

    Everything is checked before the cache changes; its lengths advance only once the
    attention is computed."""
    if not isinstance(cache, KVCache):
        raise AttentionTypeError(f"cache must be an mha.KVCache; got {type(cache).__name__}")
    where = f" (q {q.shape}, k {k.shape}, v {v.shape})"
    cache._check(k, v, where)
    if k.shape[-2] != q.shape[-2]:
        raise ShapeError(
            f"with cache=, k and v are the new tokens' own keys and values, one per query: "
            f"q has {q.shape[-2]} positions but k has {k.shape[-2]}{where}"
        )
    _flag("causal", masking["causal"])
    if masking["window"] is not None:
        positive_int("window", masking["window"])
    if compute_dtype != cache.dtype:
        raise AttentionTypeError(
            f"the cache holds {cache.dtype} but this call computes in {compute_dtype}: "
            f"make the cache with dtype={compute_dtype.name}, or cast the inputs{where}"
        )
    explicit = [name for name in ("key_lengths", "bias") if masking[name] is not None]
    mask = masking["mask"]
    if mask is not None and not (isinstance(mask, (bool, np.bool_)) and mask):
        explicit.append("mask")
    if explicit:
        raise AttentionValueError(
            f"cache= attends causally over the cached tokens; {', '.join(explicit)} cannot be "
            "combined with it (the cache's lengths say which keys each sequence has)"
        )
    if masking["causal_alignment"] not in (None, "bottom_right"):
        raise AttentionValueError(
            f"causal_alignment={masking['causal_alignment']!r} cannot be used with cache=: "
            "new tokens are the last of their sequence (bottom-right)"
        )
    window = masking["window"]
    if window is not None and window != cache.window:
        raise AttentionValueError(
            f"window={window} but the cache was made for window={cache.window}: {cache!r}"
        )
    B, L = q.shape[0], q.shape[-2]
    counts = check_lengths(
        "query_lengths", masking["query_lengths"], (B,), L, "query", f"q {q.shape}"
    )
    if counts is None:
        counts = np.full(B, L, np.int64)
    filled = cache._append(k, v, counts)
    S = int(filled.max(initial=0))
    visibility = Visibility.build(
        batch_shape=(B,), H=q.shape[-3], L=L, S=S, causal=True, key_lengths=filled,
        query_lengths=counts, window=cache.window, offsets=filled - counts, dtype=compute_dtype,
    )  # fmt: skip
    out = np.zeros((*q.shape[:-1], cache.v.shape[-1]), dtype=compute_dtype)
    lse = np.full(q.shape[:-1], -np.inf, dtype=compute_dtype) if want_lse else None
    cost = float(B * q.shape[-3] * L) * S * (q.shape[-1] + cache.v.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"), ExitStack() as stack:
        if team is None:
            team = stack.enter_context(Team(workers_for(cost, threads)))
        attend(
            q, cache.k[:, :, :S], cache.v[:, :, :S], visibility, scale, out, lse=lse,
            max_memory=budget, team=team,
        )  # fmt: skip
    cache._commit(counts)
    if lse is not None:
        return _cast(out, result_dtype), lse
    return _cast(out, result_dtype)


def multi_head_attention(
    Q: Any,
    K: Any,
    V: Any,
    W_q: Any,
    W_k: Any,
    W_v: Any,
    W_o: Any,
    num_heads: int,
    *,
    mask: Any = None,
    causal: bool = False,
    causal_alignment: str | None = None,
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    b_q: Any = None,
    b_k: Any = None,
    b_v: Any = None,
    b_o: Any = None,
    scale: float | None = None,
    return_weights: bool = False,
    max_memory: int | None = None,
    workers: int | None = None,
    bias_k: Any = None,
    bias_v: Any = None,
    add_zero_attn: bool = False,
    num_kv_heads: int | None = None,
    window: int | None = None,
    rope_theta: float | None = None,
    rotary_dim: int | None = None,
    rotary_interleaved: bool = False,
    positions: Any = None,
    cache: KVCache | None = None,
    return_backward: bool = False,
    dropout_p: float = 0.0,
    generator: np.random.Generator | None = None,
) -> Any:
    """Multi-head attention (Vaswani et al., 2017) with "x @ W" weights.

    Projects, splits the width evenly across ``num_heads`` heads, runs
    :func:`scaled_dot_product_attention` per head, joins the heads and applies ``W_o``.

    * ``Q (B, L, d_q)``, ``K (B, S, d_kin)``, ``V (B, S, d_vin)``: queries, keys and values,
      or unbatched ``(L, d)``. When ``Q``, ``K`` and ``V`` are one array, one GEMM
      projects all three.
    * ``W_q (d_q, H*d_k)``, ``W_k (d_kin, H*d_k)``, ``W_v (d_vin, H*d_v)``,
      ``W_o (H*d_v, d_out)``: the projections, applied as ``x @ W``. PyTorch stores the
      transpose: see :meth:`MultiHeadAttention.from_torch`.
    * ``num_heads``: ``H``; it must divide the columns of ``W_q`` and ``W_v``.
    * ``mask``: a boolean array, **True = may attend**, broadcastable to the scores
      ``(B, H, L, S)``; ``(L, S)`` and ``(B, L, S)`` apply to every head. ``mask=True`` is
      the causal mask. Integer or float arrays are refused (an additive mask goes in
      ``bias``). Every mask argument combines with the others by AND.
    * ``causal``: hide key ``j`` from query ``i`` when ``j > i + (S - L)`` (the last query
      sees every key); for ``L == S`` the usual lower triangle.
    * ``causal_alignment``: ``"top_left"`` for ``j > i`` instead (PyTorch's
      ``is_causal``); only with a causal mask.
    * ``key_lengths``: ``(B,)`` integers (one number for unbatched input): keys at index
      ``>= length`` are padding.
    * ``query_lengths``: ``(B,)`` integers: rows at index ``>= length`` are padding; their
      attention output is zero, so their final output is ``b_o`` (zero without it).
    * ``bias``: an additive float array broadcastable like ``mask``; ``-inf`` hides a key.
    * ``b_q``, ``b_k``, ``b_v``, ``b_o``: biases added after their projections.
    * ``scale``: the factor on ``q k^T``; default ``1/sqrt(d_k)``.
    * ``return_weights``: also return the per-head weights ``(B, H, L, S)``.
    * ``max_memory``, ``workers``: scratch bytes per worker and threads, as in
      :func:`scaled_dot_product_attention`; they never change results beyond rounding.
    * ``num_kv_heads``: ``H_kv`` key/value heads for grouped-query (or, with 1, multi-query)
      attention; ``W_k`` and ``W_v`` are then ``H_kv*d_k`` and ``H_kv*d_v`` wide, and query
      head ``h`` uses key/value head ``h // (H // H_kv)``. Default ``num_heads``.
    * ``window``: a sliding window (transformers' ``sliding_window``): query ``i`` sees key
      ``j`` only if ``(i + offset) - j < window``, ``offset`` the causal alignment's.
    * ``rope_theta``: rotate q and k after projection with rotary position embeddings of
      this base (:func:`mha.apply_rotary`), at ``positions`` (``(L,)`` or ``(B, L)``;
      default ``0..S-1`` for keys, the last ``L`` of them for queries) or at the cache's
      positions. ``rotary_dim`` and ``rotary_interleaved`` are :func:`mha.apply_rotary`'s
      ``rotary_dim`` and ``interleaved``.
    * ``return_backward``: also return ``backward``, a function of the output's gradient
      that returns the gradients of every input and weight given, keyed by parameter name
      (``Q``, ``K``, ``V``, ``W_q``, ..., ``b_o``, ``bias_k``, ``bias_v``, ``bias``), each
      shaped like it, in its dtype. With ``Q is K is V`` the three are still separate (their
      sum is the shared input's gradient).
    * ``dropout_p`` and ``generator``: dropout on the attention weights, as in
      :func:`scaled_dot_product_attention`.
    * ``cache``: a :class:`mha.KVCache`: ``Q``, ``K``, ``V`` are the next tokens
      ``(B, L, d)`` of each sequence (with ``query_lengths``, only the first
      ``query_lengths[b]`` rows of sequence ``b`` are real). Their keys and values are
      appended and the queries attend causally over everything cached, as in
      :func:`scaled_dot_product_attention`.
    * ``bias_k (H*d_k,)`` with ``bias_v (H*d_v,)``, and ``add_zero_attn``: PyTorch's extra
      keys, a learned key/value pair and a zero key/value pair appended after the
      projections (in that order), visible to every query whatever the masks say, which
      refer to the ``S`` given keys. The weights then have ``S`` plus one column per extra
      key.

    Returns ``(B, L, d_out)`` (``(L, d_out)`` unbatched) in the inputs' dtype, or
    ``(out, weights)`` with ``return_weights=True``.

    >>> import numpy as np
    >>> from mha import multi_head_attention
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((1, 3, 4))
    >>> W_q, W_k, W_v, W_o = rng.standard_normal((4, 4, 4))
    >>> out, weights = multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, 2, causal=True,
    ...                                     return_weights=True)
    >>> out.shape, out.dtype, weights.shape
    ((1, 3, 4), dtype('float64'), (1, 2, 3, 3))
    >>> weights[0, 0, 0]                             # the first query sees only itself
    array([1., 0., 0.])
    >>> weights.sum(axis=-1)                         # every row of weights sums to 1
    array([[[1., 1., 1.],
            [1., 1., 1.]]])
    """
    masking = _masking(mask, causal, causal_alignment, key_lengths, query_lengths, bias, window)
    call = _check_call(
        Q, K, V, W_q, W_k, W_v, W_o, num_heads, masking, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
        scale=scale, return_weights=return_weights, max_memory=max_memory, workers=workers,
        bias_k=bias_k, bias_v=bias_v, add_zero_attn=add_zero_attn, num_kv_heads=num_kv_heads,
        rope_theta=rope_theta, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
        positions=positions, cache=cache, return_backward=return_backward, dropout_p=dropout_p,
        generator=generator,
    )  # fmt: skip
    Q, K, V, W_q, W_k, W_v, W_o = call.Q, call.K, call.V, call.W_q, call.W_k, call.W_v, call.W_o
    b_q, b_k, b_v, b_o = call.b_q, call.b_k, call.b_v, call.b_o
    bias_k, bias_v = call.bias_k, call.bias_v
    H, H_kv, d_k, d_v, B, L, S = call.H, call.H_kv, call.d_k, call.d_v, call.B, call.L, call.S
    extra, result_dtype, compute_dtype = call.extra, call.result_dtype, call.compute_dtype
    scale, budget, threads, visibility = call.scale, call.budget, call.threads, call.visibility
    rotary, q_positions, k_positions = call.rotary, call.q_positions, call.k_positions
    want_backward, drop_p = call.want_backward, call.drop_p
    lengths: tuple[Any, Any] = (None, None)  # query and key lengths, for the backward pass
    if visibility is not None:
        lengths = (visibility.query_lengths, visibility.key_lengths)
        if extra:
            visibility = _with_extra_keys(visibility, extra, compute_dtype)
    dropout = Dropout.draw(drop_p, generator, H, L) if drop_p else None  # all checked: draw

    def cast(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else array.astype(compute_dtype, copy=False)

    batch = float(np.prod(B))
    keys = S if cache is None else int(cache.lengths.max(initial=0)) + L  # what is attended
    cost = batch * (  # multiply-adds of the projections and of attention
        L * W_q.size + S * (W_k.size + W_v.size) + L * W_o.size + H * L * keys * (d_k + d_v)
    )
    with np.errstate(invalid="ignore", over="ignore"), Team(workers_for(cost, threads)) as team:
        q, k, v = _project_heads(
            cast(Q), cast(K), cast(V), cast(W_q), cast(W_k), cast(W_v), cast(b_q), cast(b_k),
            cast(b_v), H, H_kv, scale, team, self_attention=Q is K is V,
        )  # fmt: skip
        if rotary is not None:
            q = apply_rotary(q, q_positions, **rotary)
            k = apply_rotary(k, k_positions, **rotary)
        if extra:
            k = _append_keys(k, cast(bias_k), call.add_zero_attn, H_kv)
            v = _append_keys(v, cast(bias_v), call.add_zero_attn, H_kv)
        weights = None
        lse = None
        if want_backward:
            lse = np.full((*B, H, L), -np.inf, dtype=compute_dtype)
        if visibility is None:  # the cache's call
            heads = _with_cache(
                q, k, v, cache, masking, 1.0, False, budget, threads, compute_dtype,
                compute_dtype, team,
            )  # fmt: skip
            joined = np.moveaxis(heads, -3, -2).reshape((*B, L, H * d_v))
        else:
            joined = np.zeros((*B, L, H * d_v), dtype=compute_dtype)  # (*B, L, H*d_v)
            if return_weights:
                weights = np.zeros((*B, H, L, S + extra), dtype=compute_dtype)
            attend(
                q, k, v, visibility, 1.0, _split_heads(joined, H), weights=weights, lse=lse,
                max_memory=budget, team=team, dropout=dropout,
            )  # fmt: skip
        out = team.matmul(joined, W_o.astype(compute_dtype, copy=False), cast(b_o))
    results: list[Any] = [_cast(out, result_dtype)]
    if weights is not None:
        results.append(_cast(weights, result_dtype))
    if want_backward:
        given = {
            "Q": Q, "K": K, "V": V, "W_q": W_q, "W_k": W_k, "W_v": W_v, "W_o": W_o, "b_q": b_q,
            "b_k": b_k, "b_v": b_v, "b_o": b_o, "bias_k": bias_k, "bias_v": bias_v,
        }  # fmt: skip
        results.append(_ProjectedBackward(
            {name: x for name, x in given.items() if x is not None}, bias, q, k, v, joined, lse,
            visibility, scale, H, H_kv, S, rotary, q_positions, k_positions, bool(extra),
            lengths, compute_dtype, budget, threads, dropout,
        ))  # fmt: skip
    return results[0] if len(results) == 1 else tuple(results)


@dataclass(frozen=True)
class _Call:
    """A checked :func:`multi_head_attention` call: its arrays as arrays, its sizes, and its
    options resolved. ``visibility`` covers the ``S`` given keys (``None`` with a cache)."""

    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray
    b_q: np.ndarray | None
    b_k: np.ndarray | None
    b_v: np.ndarray | None
    b_o: np.ndarray | None
    bias_k: np.ndarray | None
    bias_v: np.ndarray | None
    add_zero_attn: bool
    H: int
    H_kv: int
    d_k: int
    d_v: int
    B: tuple[int, ...]  # () for unbatched input
    L: int
    S: int
    result_dtype: np.dtype
    compute_dtype: np.dtype
    visibility: Visibility | None
    scale: float
    budget: int
    threads: int | None
    want_backward: bool
    drop_p: float
    rotary: dict[str, Any] | None
    q_positions: Any
    k_positions: Any

    @property
    def extra(self) -> int:
        """Keys appended after the projections: bias_k's and the zero key."""
        return (self.bias_k is not None) + self.add_zero_attn


def _check_call(
    Q: Any,
    K: Any,
    V: Any,
    W_q: Any,
    W_k: Any,
    W_v: Any,
    W_o: Any,
    num_heads: Any,
    masking: dict[str, Any],
    *,
    b_q: Any,
    b_k: Any,
    b_v: Any,
    b_o: Any,
    scale: Any,
    return_weights: Any,
    max_memory: Any,
    workers: Any,
    bias_k: Any,
    bias_v: Any,
    add_zero_attn: Any,
    num_kv_heads: Any,
    rope_theta: Any,
    rotary_dim: Any,
    rotary_interleaved: Any,
    positions: Any,
    cache: Any,
    return_backward: Any,
    dropout_p: Any,
    generator: Any,
) -> _Call:
    """Every check of :func:`multi_head_attention`'s arguments, in the order it makes them
    (shared with :mod:`mha.dask`, which gives the same errors)."""
    window = masking["window"]
    Q = as_float_array("Q", Q)
    K = as_float_array("K", K)
    V = as_float_array("V", V)
    check_rank("Q", Q, "(B, L, d_q) or (L, d_q)", (2, 3))
    for name, X, width in (("K", K, "d_kin"), ("V", V, "d_vin")):
        layout = f"{'(B, S, ' if Q.ndim == 3 else '(S, '}{width}), like Q {Q.shape}"
        check_rank(name, X, layout, (Q.ndim,))
    _same("Q", Q, "K", K, "batch shape {}", Q.shape[:-2], K.shape[:-2])
    _same("K", K, "V", V, "batch shape {}", K.shape[:-2], V.shape[:-2])
    _same("K", K, "V", V, "{} positions", K.shape[-2], V.shape[-2])

    W_q, W_k, W_v, W_o = (
        as_float_array(name, W) for name, W in zip(_WEIGHTS, (W_q, W_k, W_v, W_o), strict=True)
    )
    for name, W in zip(_WEIGHTS, (W_q, W_k, W_v, W_o), strict=True):
        check_rank(name, W, "(rows, columns) in the x @ W layout", (2,))
    _chain("Q", Q, "W_q", W_q)
    _chain("K", K, "W_k", W_k)
    _chain("V", V, "W_v", W_v)
    H = positive_int("num_heads", num_heads)
    H_kv = H if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    _kv_heads(H, H_kv, f"num_heads={H}, num_kv_heads={H_kv}")
    kv_label = "num_heads" if num_kv_heads is None else "num_kv_heads"
    for name, W, heads, label in (("W_q", W_q, H, "num_heads"), ("W_k", W_k, H_kv, kv_label),
                                  ("W_v", W_v, H_kv, kv_label)):  # fmt: skip
        if W.shape[1] % heads:
            raise ShapeError(
                f"{label}={heads} does not divide the {W.shape[1]} columns of {name} "
                f"({name} {W.shape}); each head needs an equal share of the width"
            )
    d_k, d_v = W_q.shape[1] // H, W_v.shape[1] // H_kv
    if num_kv_heads is None:
        _same("W_q", W_q, "W_k", W_k, "{} columns", W_q.shape[1], W_k.shape[1])
    if W_k.shape[1] != H_kv * d_k:
        raise ShapeError(
            f"W_k has {W_k.shape[1]} columns but {H_kv} key heads of width {d_k} (from W_q "
            f"{W_q.shape} and num_heads={H}) need {H_kv * d_k} (W_k {W_k.shape})"
        )
    if W_o.shape[0] != H * d_v:
        raise ShapeError(
            f"W_o has {W_o.shape[0]} rows but the {H} joined heads of width {d_v} (from W_v "
            f"{W_v.shape}) are {H * d_v} wide (W_v {W_v.shape}, W_o {W_o.shape}); they feed W_o"
        )
    b_q, b_k, b_v, b_o = (
        _projection_bias(name, b, W.shape[1], W)
        for name, b, W in zip(
            ("b_q", "b_k", "b_v", "b_o"), (b_q, b_k, b_v, b_o), (W_q, W_k, W_v, W_o), strict=True
        )
    )

    bias_k, bias_v = _extra_key_biases(bias_k, bias_v, W_k, W_v)
    add_zero_attn = _flag("add_zero_attn", add_zero_attn)
    extra = (bias_k is not None) + add_zero_attn
    result_dtype, compute_dtype = result_and_compute_dtypes(
        Q, K, V, W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, bias_k, bias_v
    )
    B, L, S = Q.shape[:-2], Q.shape[-2], K.shape[-2]  # B is () for unbatched input
    rotary = _rotary_options(rope_theta, rotary_dim, rotary_interleaved, d_k)
    visibility = None
    if cache is not None:
        _check_cache_call(cache, Q, K, extra, return_weights, positions)
        if window != cache.window:
            raise AttentionValueError(
                f"window={window} but the cache was made for window={cache.window}: "
                f"{cache!r}; make the cache with the attention's window (new_cache does)"
            )
        cache._check_fit(Q.shape[0], H_kv, d_k, d_v, f" (Q {Q.shape}, num_kv_heads={H_kv})")
    else:
        visibility = Visibility.build(
            batch_shape=B, H=H, L=L, S=S, dtype=compute_dtype,
            context=f"Q {Q.shape}, K {K.shape}", **masking,
        )  # fmt: skip
    scale = resolve_scale(scale, d_k, compute_dtype, f"W_q {W_q.shape}")
    budget, threads = _kernel_options(return_weights, max_memory, workers)
    want_backward = _flag("return_backward", return_backward)
    drop_p = _dropout_p(dropout_p, generator)
    if (want_backward or drop_p) and cache is not None:
        raise AttentionValueError("return_backward and dropout are not available with cache=")
    q_positions, k_positions = None, None
    if rotary is not None:
        q_positions, k_positions = _rotary_positions(positions, cache, B, L, S)
    elif positions is not None:
        raise AttentionValueError("positions= has no effect without rope_theta=: give both")
    return _Call(
        Q, K, V, W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, bias_k, bias_v,
        add_zero_attn, H, H_kv, d_k, d_v, B, L, S, result_dtype,
        compute_dtype, visibility, scale, budget, threads, want_backward, drop_p, rotary,
        q_positions, k_positions,
    )  # fmt: skip


class _ProjectedBackward:
    """``backward(grad_out)`` of one :func:`multi_head_attention` call: the gradients of
    ``sum(grad_out * out)`` for every input and weight given, keyed by parameter name and
    shaped like it, in its dtype. It keeps the inputs and weights (the caller's arrays: a
    fingerprint refuses a backward after they changed, as after an optimiser's step), the
    projected q, k, v, the joined heads and the log-sum-exp, never the score matrix; it may
    be called any number of times, from any thread."""

    def __init__(
        self, given: dict[str, np.ndarray], bias: Any, q: np.ndarray, k: np.ndarray,
        v: np.ndarray, joined: np.ndarray, lse: Any, visibility: Any, scale: float, H: int,
        H_kv: int, S: int, rotary: dict[str, Any] | None, q_positions: Any, k_positions: Any,
        extra: bool, lengths: tuple[Any, Any], dtype: np.dtype, budget: int,
        threads: int | None, dropout: Any,
    ) -> None:  # fmt: skip
        self.dtypes = {name: x.dtype for name, x in given.items()}
        self.arrays = dict(given)
        self.unchanged = _Fingerprints({
            **given, "mask": getattr(visibility, "mask", None),
            "bias": getattr(visibility, "bias", None),
        }, threads)  # fmt: skip
        self.bias_shape = None if bias is None else np.shape(bias)
        if bias is not None:
            self.dtypes["bias"] = as_float_array("bias", bias).dtype
        self.q, self.k, self.v, self.joined, self.lse = q, k, v, joined, lse
        self.visibility, self.scale, self.H, self.H_kv, self.S = visibility, scale, H, H_kv, S
        self.rotary = rotary
        self.positions = tuple(  # copies: the caller may reuse its positions array
            None if p is None else np.array(p, dtype=np.float64) for p in (q_positions, k_positions)
        )
        self.extra, self.dtype, self.budget, self.threads = extra, dtype, budget, threads
        self.lengths = {"Q": lengths[0], "K": lengths[1], "V": lengths[1]}
        self.dropout = dropout

    def __call__(self, grad_out: Any) -> dict[str, np.ndarray]:
        dtype, H = self.dtype, self.H
        lead = self.joined.shape[:-1]
        out_shape = (*lead, self.arrays["W_o"].shape[1])
        grad = _gradient("grad_out", grad_out, out_shape, dtype)
        self.unchanged.check()

        def a(name: str) -> np.ndarray:  # a saved input or weight, in the compute dtype
            return self.arrays[name].astype(dtype, copy=False)

        grads: dict[str, np.ndarray] = {}
        cost = float(self.q.size) * self.k.shape[-2] * 4
        with (
            np.errstate(invalid="ignore", over="ignore"),
            Team(workers_for(cost, self.threads)) as team,
        ):
            grads["W_o"] = _weight_grad(self.joined, grad, team)
            if "b_o" in self.arrays:
                grads["b_o"] = _rows(grad).sum(axis=0)
            d_joined = team.matmul(grad, a("W_o").T)  # BLAS reads the transposes in place
            dk, dv = (_zeros_joined(x, dtype) for x in (self.k, self.v))
            # dq is written over d_joined's heads tile by tile: one (B, L, H*d) buffer less
            shared = self.q.shape[-1] == self.joined.shape[-1] // H
            dq = _split_heads(d_joined, H) if shared else np.zeros_like(self.q)
            dbias = None
            if self.bias_shape is not None and self.visibility.bias is not None:
                dbias = np.zeros(self.visibility.bias.shape, dtype)  # the bias's own size
            attend_backward(
                self.q, self.k, self.v, _split_heads(self.joined, H), self.lse,
                _split_heads(d_joined, H), self.visibility, 1.0, dq=dq, dk=dk, dv=dv,
                dbias=dbias, max_memory=self.budget, team=team, dropout=self.dropout,
                dq_factor=self.scale,  # q = (Q @ W_q + b_q) * scale
            )  # fmt: skip
            del d_joined  # memory: each intermediate goes as soon as it is used (dq keeps it)
            if self.extra:  # the appended keys: bias_k/bias_v's gradients, then drop them
                if "bias_k" in self.arrays:  # (*B, H_kv, d) at the first appended key
                    for name, d in (("bias_k", dk), ("bias_v", dv)):
                        at = d[..., self.S, :]
                        grads[name] = at.reshape(-1, *at.shape[-2:]).sum(axis=0).reshape(-1)
                dk, dv = dk[..., : self.S, :], dv[..., : self.S, :]
            if dbias is not None and self.bias_shape is not None:
                grads["bias"] = _sum_to(dbias[..., : self.S], self.bias_shape, lead[:-1])
            del dbias
            if self.rotary is not None:  # undo the rotation: rotate back by the same angle
                q_at, k_at = (-np.asarray(p, dtype=np.float64) for p in self.positions)
                dq = apply_rotary(dq, q_at, **self.rotary)
                dk = apply_rotary(dk, k_at, **self.rotary)
            pending = {"Q": dq, "K": dk, "V": dv}
            del dq, dk, dv
            for x, W, b in (("Q", "W_q", "b_q"), ("K", "W_k", "b_k"), ("V", "W_v", "b_v")):
                joined_grad = _join_heads(pending.pop(x))
                grads[W] = _weight_grad(_valid_rows(a(x), self.lengths[x]), joined_grad, team)
                if b in self.arrays:
                    grads[b] = _rows(joined_grad).sum(axis=0)
                # the input's gradient takes the buffer of its projection's: 32 MiB less at
                # L = 16384, d_model = 512 in float32 (nothing else reads it any more)
                grads[x] = team.matmul(joined_grad, a(W).T, overwrite=True)
                del joined_grad
        return {name: _cast(g, self.dtypes[name]) for name, g in grads.items()}


def _valid_rows(X: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """``X (*B, N, d)`` with its padded rows (at or after ``lengths``) zeroed when they hold
    NaN or inf, which would otherwise reach the weight gradients as ``0 * NaN``."""
    if lengths is None or np.isfinite(X).all():
        return X
    valid = np.arange(X.shape[-2]) < np.asarray(lengths)[..., None]  # (*B, N)
    return np.where(valid[..., None], X, 0.0).astype(X.dtype, copy=False)


def _zeros_joined(like: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Zeros shaped like the heads ``like (*B, H, L, d)`` but laid out as the joined
    ``(*B, L, H*d)``, so that joining them again copies nothing."""
    *B, H, L, d = like.shape
    return _split_heads(np.zeros((*B, L, H * d), dtype), H)


def _rows(x: np.ndarray) -> np.ndarray:
    """``(..., n)`` as ``(rows, n)``."""
    return x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])


def _weight_grad(x: np.ndarray, grad: np.ndarray, team: Team) -> np.ndarray:
    """``d(x @ W)/dW`` for ``x (..., m)`` and ``grad (..., n)``: ``x^T @ grad`` over rows."""
    return team.matmul(_rows(x).T, _rows(grad))


def _join_heads(x: np.ndarray) -> np.ndarray:
    """``(*B, H, L, d)`` to ``(*B, L, H*d)``."""
    return np.moveaxis(x, -3, -2).reshape((*x.shape[:-3], x.shape[-2], -1))


def _rotary_options(
    theta: Any, rotary_dim: Any, interleaved: Any, d_k: int
) -> dict[str, Any] | None:
    """The keywords of :func:`apply_rotary`, or ``None`` without ``rope_theta``."""
    if theta is None:
        given = [name for name, value in (("rotary_dim", rotary_dim),
                                          ("rotary_interleaved", interleaved))
                 if value is not None and value is not False]  # fmt: skip
        if given:
            raise AttentionValueError(
                f"{', '.join(given)} has no effect without rope_theta=: give rope_theta too"
            )
        return None
    return {"theta": theta, "rotary_dim": rotary_dim, "interleaved": interleaved}


def _rotary_positions(
    positions: Any, cache: KVCache | None, B: tuple[int, ...], L: int, S: int
) -> tuple[Any, Any]:
    """Where the queries and keys sit: the cache's next positions, ``positions``, or
    ``0..S-1`` for the keys with the queries as the last ``L`` of them."""
    if cache is not None:
        at = cache.lengths[:, None] + np.arange(L)  # each sequence's own next positions
        return at, at
    if positions is not None:
        if L != S:
            raise ShapeError(
                f"positions= places the queries and the keys together, so it needs as many "
                f"queries as keys; got L={L}, S={S}: leave positions out for 0..S-1"
            )
        return positions, positions
    return np.arange(S - L, S), np.arange(S)


def _check_cache_call(
    cache: Any, Q: np.ndarray, K: np.ndarray, extra: int, return_weights: Any, positions: Any
) -> None:
    """What a call with ``cache=`` cannot also have, refused before the cache changes."""
    if not isinstance(cache, KVCache):
        raise AttentionTypeError(f"cache must be an mha.KVCache; got {type(cache).__name__}")
    refused = []
    if Q.ndim != 3:
        refused.append(f"unbatched inputs (Q {Q.shape}; give (B, L, d))")
    if Q.ndim == K.ndim and Q.shape[-2] != K.shape[-2]:
        refused.append(f"keys that are not the new tokens' own (Q {Q.shape}, K {K.shape})")
    if extra:
        refused.append("bias_k/bias_v or add_zero_attn")
    if _flag("return_weights", return_weights):
        refused.append("return_weights")
    if positions is not None:
        refused.append("positions= (the cache's lengths give the positions)")
    if refused:
        raise AttentionValueError(f"cache= cannot be combined with {'; '.join(refused)}")


def _extra_key_biases(
    bias_k: Any, bias_v: Any, W_k: np.ndarray, W_v: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray | None]:
    if (bias_k is None) != (bias_v is None):
        raise AttentionValueError("bias_k and bias_v go together: give both or neither")
    if bias_k is None:
        return None, None
    return (
        _projection_bias("bias_k", bias_k, W_k.shape[1], W_k),
        _projection_bias("bias_v", bias_v, W_v.shape[1], W_v),
    )


def _with_extra_keys(visibility: Visibility, extra: int, dtype: np.dtype) -> Visibility:
    """The visibility over ``S + extra`` keys: the extra keys are seen by every query."""
    allowed = visibility.allowed()  # (*B, H, L, S), query padding included
    rows = np.ones(allowed.shape[-2], dtype=bool)
    if visibility.query_lengths is not None:
        rows = np.arange(visibility.L) < visibility.query_lengths[..., None]
    seen = np.broadcast_to(rows[..., None, :, None], (*allowed.shape[:-1], extra))
    bias = None
    if visibility.bias is not None:
        bias = np.broadcast_to(visibility.bias, allowed.shape)
        bias = np.concatenate([bias, np.zeros((*allowed.shape[:-1], extra), dtype)], axis=-1)
    return Visibility.build(
        batch_shape=visibility.index_shape[:-1], H=visibility.index_shape[-1], L=visibility.L,
        S=visibility.S + extra, mask=np.concatenate([allowed, seen], axis=-1), bias=bias,
        dtype=dtype,
    )  # fmt: skip


def _append_keys(x: np.ndarray, bias: np.ndarray | None, zero: bool, H: int) -> np.ndarray:
    """``x (*B, H, S, d)`` with the learned row ``bias (H*d,)`` and a zero row appended."""
    rows = [x]
    lead = x.shape[:-2]
    if bias is not None:
        rows.append(np.broadcast_to(bias.reshape(H, 1, -1), (*lead, 1, x.shape[-1])))
    if zero:
        rows.append(np.zeros((*lead, 1, x.shape[-1]), dtype=x.dtype))
    return np.concatenate(rows, axis=-2)


def merge_attention(outputs: Any, lses: Any) -> tuple[np.ndarray, np.ndarray]:
    """Merge attention computed over disjoint key ranges into the attention over all of them.

    ``outputs`` and ``lses`` are lists: ``outputs[p] (..., L, d_v)`` and ``lses[p] (..., L)``
    are the results of
    :func:`scaled_dot_product_attention` with ``return_lse=True`` for the same queries over
    part ``p`` of the keys (split-key decoding, sequence-parallel attention). Returns the
    merged ``(out, lse)``. A part in which a row sees no key (``lse = -inf``) adds nothing;
    a row that sees no key in any part stays zero with ``lse = -inf``.

    >>> import numpy as np
    >>> from mha import merge_attention, scaled_dot_product_attention as sdpa
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 1, 4, 8))
    >>> left = sdpa(q, k[:, :3], v[:, :3], return_lse=True)
    >>> right = sdpa(q, k[:, 3:], v[:, 3:], return_lse=True)
    >>> out, lse = merge_attention([left[0], right[0]], [left[1], right[1]])
    >>> bool(np.allclose(out, sdpa(q, k, v), rtol=1e-14, atol=0))
    True
    """
    outs = [as_float_array(f"outputs[{p}]", x) for p, x in enumerate(_sequence("outputs", outputs))]
    logs = [as_float_array(f"lses[{p}]", x) for p, x in enumerate(_sequence("lses", lses))]
    if len(outs) != len(logs) or not outs:
        raise AttentionValueError(
            f"merge_attention needs one lse per output and at least one of each; "
            f"got {len(outs)} outputs and {len(logs)} lses"
        )
    for p, (out, lse) in enumerate(zip(outs, logs, strict=True)):
        if out.ndim < 2 or lse.shape != out.shape[:-1]:
            raise ShapeError(
                f"lses[{p}] must have the shape of outputs[{p}] without its last axis "
                f"(outputs[{p}] {out.shape}, lses[{p}] {lse.shape})"
            )
        _same("outputs[0]", outs[0], f"outputs[{p}]", out, "shape {}", outs[0].shape, out.shape)
    result_dtype, compute_dtype = result_and_compute_dtypes(*outs)
    _, lse_dtype = result_and_compute_dtypes(*outs, *logs)
    with np.errstate(invalid="ignore", over="ignore"):
        merged, lse_merged = merge_partials(
            [out.astype(compute_dtype, copy=False) for out in outs],
            [lse.astype(lse_dtype, copy=False) for lse in logs],
        )
    return _cast(merged, result_dtype), lse_merged


def _masking(
    mask: Any,
    causal: Any,
    causal_alignment: Any,
    key_lengths: Any,
    query_lengths: Any,
    bias: Any,
    window: Any,
) -> dict[str, Any]:
    """The mask contract's arguments, as :meth:`Visibility.build` takes them."""
    return {"mask": mask, "causal": causal, "causal_alignment": causal_alignment,
            "key_lengths": key_lengths, "query_lengths": query_lengths, "bias": bias,
            "window": window}  # fmt: skip


def _sequence(name: str, value: Any) -> list[Any]:
    if isinstance(value, np.ndarray) or not isinstance(value, (list, tuple)):
        raise AttentionTypeError(f"{name} must be a list or tuple of arrays, one per key range")
    return list(value)


_WEIGHTS = ("W_q", "W_k", "W_v", "W_o")


def _project_heads(
    Q: Any,
    K: Any,
    V: Any,
    W_q: Any,
    W_k: Any,
    W_v: Any,
    b_q: Any,
    b_k: Any,
    b_v: Any,
    H: int,
    H_kv: int,
    scale: float,
    team: Team,
    *,
    self_attention: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The projected ``q (*B, H, L, d_k)`` (already times ``scale``), ``k``, ``v``.

    The scale goes where it costs least: into ``W_q`` when there are more query rows than
    input features, into the projected ``q`` otherwise. For self-attention with enough rows
    to pay for copying the weights, one GEMM against ``[W_q | W_k | W_v]`` projects all three.
    """  # fmt: skip
    rows = int(np.prod(Q.shape[:-1]))
    if rows >= Q.shape[-1]:
        W_q, b_q = W_q * scale, None if b_q is None else b_q * scale
    if self_attention and rows >= Q.shape[-1]:
        W_qkv = np.concatenate([W_q, W_k, W_v], axis=1)
        b_qkv = None
        if b_q is not None or b_k is not None or b_v is not None:
            b_qkv = np.concatenate([
                np.zeros(W.shape[1], W.dtype) if b is None else b
                for b, W in ((b_q, W_q), (b_k, W_k), (b_v, W_v))
            ])  # fmt: skip
        qkv = team.matmul(Q, W_qkv, b_qkv)
        widths = [W_q.shape[1], W_q.shape[1] + W_k.shape[1]]
        q, k, v = np.split(qkv, widths, axis=-1)
        return _split_heads(q, H), _split_heads(k, H_kv), _split_heads(v, H_kv)
    q = team.matmul(Q, W_q, b_q)
    if rows < Q.shape[-1]:
        q *= scale
    return (
        _split_heads(q, H),
        _split_heads(team.matmul(K, W_k, b_k), H_kv),
        _split_heads(team.matmul(V, W_v, b_v), H_kv),
    )


def _split_heads(x: np.ndarray, H: int) -> np.ndarray:
    """``(*B, L, H*d)`` to ``(*B, H, L, d)``."""
    return np.moveaxis(x.reshape((*x.shape[:-1], H, x.shape[-1] // H)), -2, -3)


def _cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        return array.astype(dtype, copy=False)


def _kernel_options(return_weights: Any, max_memory: Any, workers: Any) -> tuple[int, int | None]:
    """Check the kernel's keywords: ``(max_memory, workers)``."""
    _flag("return_weights", return_weights)
    budget = DEFAULT_MAX_MEMORY if max_memory is None else positive_int("max_memory", max_memory)
    return budget, None if workers is None else positive_int("workers", workers)


def _same(
    name_a: str, a: np.ndarray, name_b: str, b: np.ndarray, what: str, value_a: Any, value_b: Any
) -> None:
    """Raise unless ``value_a == value_b``; ``what`` is a phrase such as "{} positions"."""
    if value_a != value_b:
        raise ShapeError(
            f"{name_a} has {what.format(value_a)} but {name_b} has {value_b} "
            f"({name_a} {a.shape}, {name_b} {b.shape})"
        )


def _chain(name_x: str, x: np.ndarray, name_W: str, W: np.ndarray) -> None:
    """``x @ W`` needs ``x``'s width to equal ``W``'s rows."""
    if x.shape[-1] != W.shape[0]:
        raise ShapeError(
            f"{name_x} has width {x.shape[-1]} but {name_W} has {W.shape[0]} rows "
            f"({name_x} {x.shape}, {name_W} {W.shape}); x @ W needs them equal"
        )


def _projection_bias(name: str, b: Any, width: int, W: np.ndarray) -> np.ndarray | None:
    if b is None:
        return None
    array = as_float_array(name, b)
    if array.shape != (width,):
        raise ShapeError(
            f"{name} must have shape ({width},) to match the columns of its weight {W.shape}; "
            f"got shape {array.shape}"
        )
    return array
