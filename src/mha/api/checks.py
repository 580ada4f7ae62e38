"""Every check of the entry points' arguments, made before any work, and the checked call.

:func:`checked_heads` checks :func:`mha.scaled_dot_product_attention`'s ``q``, ``k``, ``v``;
:func:`check_call` checks a whole :func:`mha.multi_head_attention` call and returns it as a
:class:`Call`; :func:`check_cache` checks what a call with ``cache=`` appends. :mod:`mha.dask`
runs the same checks on stand-ins of its arrays' shapes when it builds a graph, so both raise
the same errors. Messages name the arguments as the caller gave them: ``names`` maps ``Q``,
``K`` and ``V`` to the caller's names (``MultiHeadAttention.forward`` calls them ``query``,
``key`` and ``value``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._arrays import (
    as_array,
    as_float_array,
    check_rank,
    flag,
    positive_int,
    resolve_scale,
    result_and_compute_dtypes,
)
from .._kernel.contract import Visibility, check_lengths, check_variants
from .._kernel.call import DEFAULT_MAX_MEMORY
from .._kernel.scores import Scores
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .cache import KVCache
from .padding import check_padding_side
from .paged_cache import PagedKVCache
from .qk_norm import QKNorm, check_qk_norm
from .rope_scaling import check_rope_scaling
from .rotary import check_positions, check_rotary_options
from .variants import check_scores

__all__ = [
    "INPUT_NAMES",
    "WEIGHT_NAMES",
    "Call",
    "Weights",
    "check_cache",
    "check_call",
    "check_dropout",
    "checked_heads",
    "kernel_options",
    "kv_heads",
    "masking",
    "same",
]

INPUT_NAMES: Mapping[str, str] = {"Q": "Q", "K": "K", "V": "V", "d_q": "d_q", "d_kin": "d_kin",
                                  "d_vin": "d_vin"}  # fmt: skip
"""The function's names for its inputs and their widths, as messages quote them."""

WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")


def masking(
    mask: Any,
    causal: Any,
    causal_alignment: Any,
    key_lengths: Any,
    query_lengths: Any,
    bias: Any,
    window: Any,
    sink_tokens: Any = None,
    chunk: Any = None,
    mask_mod: Any = None,
) -> dict[str, Any]:
    """The mask contract's arguments, as :meth:`Visibility.build` takes them."""
    return {"mask": mask, "causal": causal, "causal_alignment": causal_alignment,
            "key_lengths": key_lengths, "query_lengths": query_lengths, "bias": bias,
            "window": window, "sink_tokens": sink_tokens, "chunk": chunk,
            "mask_mod": mask_mod}  # fmt: skip


def kernel_options(max_memory: Any, workers: Any) -> tuple[int, int | None]:
    """Check the kernel's keywords: ``(max_memory, workers)``."""
    budget = DEFAULT_MAX_MEMORY if max_memory is None else positive_int("max_memory", max_memory)
    return budget, None if workers is None else positive_int("workers", workers)


def check_dropout(p: Any, generator: Any) -> float:
    """``dropout_p`` checked with ``generator``: required with dropout, refused when no
    dropout was asked for at all (``dropout_p`` left out). ``dropout_p=0.0`` with a
    generator is accepted (``p if training else 0.0`` with one generator)."""
    if p is None:
        if generator is not None:
            raise AttentionValueError(
                "generator= is for dropout, but no dropout_p= was given: give dropout_p= "
                "too (0.0 turns dropout off), or leave the generator out"
            )
        return 0.0
    real = isinstance(p, (int, float, np.integer, np.floating)) and not isinstance(
        p, (bool, np.bool_)
    )
    if not real or not 0.0 <= float(p) < 1.0:
        raise AttentionValueError(f"dropout_p must be a number in [0, 1); got {p!r}")
    if float(p) == 0.0:
        if generator is not None and not isinstance(generator, np.random.Generator):
            raise AttentionTypeError(f"generator must be a np.random.Generator; got {generator!r}")
        return 0.0
    if not isinstance(generator, np.random.Generator):
        raise AttentionTypeError(
            f"dropout_p={p} needs generator=, a np.random.Generator (for example "
            f"np.random.default_rng(0)), so that runs can be repeated; got {generator!r}"
        )
    return float(p)


def checked_heads(
    q: Any, k: Any, v: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype, np.dtype]:
    """:func:`mha.scaled_dot_product_attention`'s ``q``, ``k``, ``v`` as arrays whose
    shapes fit together, with the result and compute dtypes."""
    q = as_float_array("q", q)
    k = as_float_array("k", k)
    v = as_float_array("v", v)
    for name, array in (("q", q), ("k", k), ("v", v)):
        if array.ndim < 3:
            raise ShapeError(
                f"{name} must have shape (..., H, {'L' if name == 'q' else 'S'}, d) with a "
                f"head axis; got shape {array.shape}"
            )
    same("q", q, "k", k, "batch axes {}", q.shape[:-3], k.shape[:-3])
    same("k", k, "v", v, "leading (batch..., H_kv) axes {}", k.shape[:-2], v.shape[:-2])
    if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:  # the message only when refused
        kv_heads(q.shape[-3], k.shape[-3], f"q {q.shape}, k {k.shape}")
    same("q", q, "k", k, "head width {}", q.shape[-1], k.shape[-1])
    same("k", k, "v", v, "{} positions", k.shape[-2], v.shape[-2])
    result_dtype, compute_dtype = result_and_compute_dtypes(q, k, v)
    return q, k, v, result_dtype, compute_dtype


def kv_heads(H: int, H_kv: int, shapes: str) -> int:
    """The query heads per key/value head; ``H_kv`` must divide ``H``."""
    if H_kv == 0 or H % H_kv:
        raise ShapeError(
            f"{H_kv} key/value heads do not divide {H} query heads ({shapes}); grouped-query "
            "attention needs H to be a multiple of H_kv"
        )
    return H // H_kv


def check_cache(
    cache: Any,
    masking: dict[str, Any],
    *,
    B: int,
    H_kv: int,
    d_k: int,
    d_v: int,
    L: int,
    new_keys: int,
    dtype: np.dtype,
    context: str,
) -> tuple[np.ndarray, int | None]:
    """What a call with ``cache=`` appends, checked before the cache changes: ``B``
    sequences of ``L`` queries and ``new_keys`` new keys, ``H_kv`` heads ``d_k`` and ``d_v``
    wide, computed in ``dtype``. Returns how many new tokens each sequence appends (its
    ``query_lengths``, or ``L``) and the window to attend within: the call's, which may be
    the cache's or narrower (a cache without a window keeps every position). ``context``
    names the caller's arrays."""
    if not isinstance(cache, (KVCache, PagedKVCache)):
        raise AttentionTypeError(
            f"cache must be an mha.KVCache or mha.PagedKVCache; got {type(cache).__name__}"
        )
    where = f" ({context})"
    cache._check_fit(B, H_kv, d_k, d_v, where)
    if new_keys != L:
        raise ShapeError(
            f"with cache=, the keys and values are the new tokens' own, one per query: "
            f"{L} queries but {new_keys} keys{where}"
        )
    flag("causal", masking["causal"])
    window = None if masking["window"] is None else positive_int("window", masking["window"])
    if cache.window is not None and (window is None or window > cache.window):
        raise AttentionValueError(
            f"window={window} but the cache keeps only what window={cache.window} needs: "
            f"{cache!r}; a call attends within the cache's window or a narrower one (make "
            "the cache with the attention's window, as new_cache does)"
        )
    checked, _ = check_variants(masking["sink_tokens"], masking["chunk"], masking["mask_mod"],
                                window)  # fmt: skip
    sinks = None if masking["sink_tokens"] is None else checked
    if (
        cache.window is not None
        and sinks not in (None, cache.sink_tokens)
        and (sinks or cache.sink_tokens)
    ):
        raise AttentionValueError(
            f"sink_tokens={sinks} but the cache keeps sink_tokens={cache.sink_tokens}: "
            f"{cache!r}; a call with a window cache attends to the sink tokens it keeps "
            "(make the cache with the attention's sink_tokens, as new_cache does)"
        )
    if sinks is None and cache.window is not None and cache.sink_tokens:
        masking["sink_tokens"] = cache.sink_tokens  # the sinks it keeps stay visible
    if dtype != cache.compute_dtype:
        held = f"{cache.dtype}" + (
            "" if cache.dtype == cache.compute_dtype else f", computed in {cache.compute_dtype},"
        )
        raise AttentionTypeError(
            f"the cache holds {held} but this call computes in {dtype}: make the "
            f"cache with dtype={dtype.name}, or cast the inputs{where}"
        )
    if masking["key_lengths"] is not None:
        raise AttentionValueError(
            "cache= attends causally over the cached tokens; key_lengths cannot be combined "
            "with it (the cache's lengths say which keys each sequence has)"
        )
    mask = masking["mask"]
    by_position = [name for name, given in (
        ("bias", masking["bias"] is not None),
        ("mask", mask is not None and not (isinstance(mask, (bool, np.bool_)) and mask)),
    ) if given]  # fmt: skip
    if by_position and cache.window is not None:
        raise AttentionValueError(
            f"{' and '.join(by_position)} with cache= index keys by position, but a cache "
            f"with a window drops old positions, so its slots are not positions: {cache!r}"
        )
    if masking["causal_alignment"] not in (None, "bottom_right"):
        raise AttentionValueError(
            f"causal_alignment={masking['causal_alignment']!r} cannot be used with cache=: "
            "new tokens are the last of their sequence (bottom-right)"
        )
    counts = check_lengths("query_lengths", masking["query_lengths"], (B,), L, "query", context)
    return (np.full(B, L, np.int64) if counts is None else counts), window


@dataclass(frozen=True)
class Weights:
    """The projections of one call, checked against each other: ``x @ W`` matrices, the
    biases added after them, and torch's extra key/value biases (``None`` where absent)."""

    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray
    b_q: np.ndarray | None = None
    b_k: np.ndarray | None = None
    b_v: np.ndarray | None = None
    b_o: np.ndarray | None = None
    bias_k: np.ndarray | None = None
    bias_v: np.ndarray | None = None

    def in_dtype(self, dtype: np.dtype) -> Weights:
        """The weights in ``dtype`` (the same arrays where they already are)."""
        cast = {name: x.astype(dtype, copy=False) for name, x in self.present().items()}
        return replace(self, **cast)

    def present(self) -> dict[str, np.ndarray]:
        """The weights given, by parameter name."""
        arrays = {name: getattr(self, name) for name in WEIGHT_NAMES}
        return {name: x for name, x in arrays.items() if x is not None}


@dataclass(frozen=True)
class Call:
    """A checked :func:`mha.multi_head_attention` call: its arrays as arrays, its sizes and
    its options resolved. ``visibility`` covers the ``S`` given keys; with a cache it is
    ``None`` and ``counts`` holds each sequence's new tokens."""

    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    weights: Weights
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
    cache: KVCache | None
    counts: np.ndarray | None  # with a cache: each sequence's new tokens
    window: int | None  # with a cache: the window attended within
    scale: float
    budget: int
    threads: int | None
    want_weights: bool
    want_backward: bool
    drop_p: float
    rotary: dict[str, Any] | None  # apply_rotary's keywords
    q_positions: Any
    k_positions: Any
    scores: Scores | None = None  # sinks, soft-capping, ALiBi, score_mod
    sinks: np.ndarray | None = None  # as given (its gradient takes its dtype)
    masking: dict[str, Any] | None = None  # with a cache: the sink tokens, chunk, mask_mod
    qk_norm: QKNorm | None = None  # RMSNorm of q and k before the rotation
    left_padded: bool = False  # with a cache: each sequence's real new rows are its last

    @property
    def extra(self) -> int:
        """Keys appended after the projections: bias_k's and the zero key."""
        return (self.weights.bias_k is not None) + self.add_zero_attn

    @property
    def self_attention(self) -> bool:
        return self.Q is self.K is self.V


def check_call(
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
    names: Mapping[str, str] = INPUT_NAMES,
    sinks: Any = None,
    softcap: Any = None,
    alibi: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    rope_scaling: Any = None,
    q_norm: Any = None,
    k_norm: Any = None,
    qk_norm: Any = None,
    qk_norm_eps: Any = None,
    qk_norm_offset: Any = None,
    padding_side: Any = None,
) -> Call:
    """Every check of :func:`mha.multi_head_attention`'s arguments, in the order it makes
    them. ``Q is K is V`` stays true of the checked call (one GEMM projects all three).
    ``names`` gives the caller's names of the inputs and their widths; a key and value named
    like the query are the query itself (self-attention), quoted once."""
    nq, nk, nv = names["Q"], names["K"], names["V"]
    one = Q is K is V
    Q = as_float_array(nq, Q)
    K = Q if one else as_float_array(nk, K)
    V = Q if one else as_float_array(nv, V)
    d_q = names["d_q"]
    check_rank(nq, Q, f"(B, L, {d_q}) or (L, {d_q})", (2, 3))
    for name, X, width in ((nk, K, names["d_kin"]), (nv, V, names["d_vin"])):
        layout = f"{'(B, S, ' if Q.ndim == 3 else '(S, '}{width}), like {nq} {Q.shape}"
        check_rank(name, X, layout, (Q.ndim,))
    same(nq, Q, nk, K, "batch shape {}", Q.shape[:-2], K.shape[:-2])
    same(nk, K, nv, V, "batch shape {}", K.shape[:-2], V.shape[:-2])
    same(nk, K, nv, V, "{} positions", K.shape[-2], V.shape[-2])

    W_q, W_k, W_v, W_o = (
        as_float_array(name, W) for name, W in zip(_MATRICES, (W_q, W_k, W_v, W_o), strict=True)
    )
    for name, W in zip(_MATRICES, (W_q, W_k, W_v, W_o), strict=True):
        check_rank(name, W, "(rows, columns) in the x @ W layout", (2,))
    _chain(nq, Q, "W_q", W_q)
    _chain(nk, K, "W_k", W_k)
    _chain(nv, V, "W_v", W_v)
    H = positive_int("num_heads", num_heads)
    H_kv = H if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    kv_heads(H, H_kv, f"num_heads={H}, num_kv_heads={H_kv}")
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
        same("W_q", W_q, "W_k", W_k, "{} columns", W_q.shape[1], W_k.shape[1])
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
        _projection_bias(name, b, W)
        for name, b, W in zip(
            ("b_q", "b_k", "b_v", "b_o"), (b_q, b_k, b_v, b_o), (W_q, W_k, W_v, W_o), strict=True
        )
    )
    if (bias_k is None) != (bias_v is None):
        raise AttentionValueError("bias_k and bias_v go together: give both or neither")
    bias_k = _projection_bias("bias_k", bias_k, W_k)
    bias_v = _projection_bias("bias_v", bias_v, W_v)
    weights = Weights(W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, bias_k, bias_v)
    add_zero_attn = flag("add_zero_attn", add_zero_attn)
    extra = (bias_k is not None) + add_zero_attn
    result_dtype, compute_dtype = result_and_compute_dtypes(Q, K, V, *weights.present().values())
    B, L, S = Q.shape[:-2], Q.shape[-2], K.shape[-2]  # B is () for unbatched input
    context = f"{nq} {Q.shape}" if nk == nq else f"{nq} {Q.shape}, {nk} {K.shape}"
    want_weights = flag("return_weights", return_weights)
    visibility, counts, window = None, None, masking["window"]
    if cache is not None:
        _refuse_with_cache(Q, K, extra, want_weights, positions, nq, nk)
        counts, window = check_cache(
            cache, masking, B=Q.shape[0], H_kv=H_kv, d_k=d_k, d_v=d_v, L=L, new_keys=S,
            dtype=compute_dtype, context=context,
        )  # fmt: skip
    else:
        visibility = Visibility.build(
            batch_shape=B, H=H, L=L, S=S, dtype=compute_dtype, context=context, **masking
        )
    scale = resolve_scale(scale, d_k, compute_dtype, f"W_q {W_q.shape}")
    budget, threads = kernel_options(max_memory, workers)
    want_backward = flag("return_backward", return_backward)
    drop_p = check_dropout(dropout_p, generator)
    if (want_backward or drop_p) and cache is not None:
        raise AttentionValueError("return_backward and dropout are not available with cache=")
    scores = check_scores(
        sinks=sinks, softcap=softcap, alibi=alibi, score_mod=score_mod,
        score_mod_grad=score_mod_grad, H=H, want_backward=want_backward,
    )  # fmt: skip
    positional = [name for name, value in (
        ("alibi", scores is not None and scores.alibi is not None), ("score_mod", score_mod),
        ("mask_mod", masking["mask_mod"]), ("chunk", masking["chunk"]),
        ("sink_tokens", masking["sink_tokens"]),
    ) if value is not None and value is not False]  # fmt: skip
    if extra and positional:
        raise AttentionValueError(
            f"bias_k/bias_v and add_zero_attn append keys that have no position, so they "
            f"cannot be combined with {', '.join(positional)}"
        )
    rotary, q_positions, k_positions = None, None, None
    if rope_theta is not None:
        subject = f"W_q {W_q.shape}, num_heads={H}"
        _, theta, interleaved = check_rotary_options(
            d_k, rope_theta, rotary_dim, rotary_interleaved, subject, "rope_theta"
        )
        rotary = {"theta": theta, "rotary_dim": rotary_dim, "interleaved": interleaved}
        q_positions, k_positions = _rotary_positions(positions, cache, Q, S, nq)
        if rope_scaling is not None:  # one length for q and k, as transformers' position_ids
            rotary["scaling"] = check_rope_scaling(rope_scaling, rotary_dim or d_k, subject)
            rotary["seq_len"] = 1 + max(
                (float(np.max(p)) for p in (q_positions, k_positions) if np.size(p)), default=0.0
            )
    else:
        given = [name for name, value in (("rotary_dim", rotary_dim),
                                          ("rotary_interleaved", rotary_interleaved),
                                          ("rope_scaling", rope_scaling))
                 if value is not None and value is not False]  # fmt: skip
        if given:
            raise AttentionValueError(
                f"{', '.join(given)} has no effect without rope_theta=: give rope_theta too"
            )
        if positions is not None:
            raise AttentionValueError("positions= has no effect without rope_theta=: give both")
    return Call(
        Q, K, V, weights, add_zero_attn, H, H_kv, d_k, d_v, B, L, S, result_dtype,
        compute_dtype, visibility, cache, counts, window, scale, budget, threads, want_weights,
        want_backward, drop_p, rotary, q_positions, k_positions, scores,
        None if sinks is None else as_float_array("sinks", sinks), masking,
        check_qk_norm(q_norm, k_norm, qk_norm, qk_norm_eps, qk_norm_offset, H=H, H_kv=H_kv,
                      d_k=d_k),
        check_padding_side(padding_side, cache, masking),
    )  # fmt: skip


_MATRICES = ("W_q", "W_k", "W_v", "W_o")


def _refuse_with_cache(
    Q: np.ndarray, K: np.ndarray, extra: int, want_weights: bool, positions: Any, nq: str,
    nk: str,
) -> None:  # fmt: skip
    """What a call with ``cache=`` cannot also have, refused before the cache changes."""
    refused = []
    if Q.ndim != 3:
        refused.append(f"unbatched inputs ({nq} {Q.shape}; give (B, L, d))")
    if Q.ndim == K.ndim and Q.shape[-2] != K.shape[-2]:
        refused.append(f"keys that are not the new tokens' own ({nq} {Q.shape}, {nk} {K.shape})")
    if extra:
        refused.append("bias_k/bias_v or add_zero_attn")
    if want_weights:
        refused.append("return_weights")
    if positions is not None:
        refused.append("positions= (the cache's lengths give the positions)")
    if refused:
        raise AttentionValueError(f"cache= cannot be combined with {'; '.join(refused)}")


def _rotary_positions(
    positions: Any, cache: KVCache | None, Q: np.ndarray, S: int, nq: str
) -> tuple[np.ndarray, np.ndarray]:
    """Where the queries and keys sit: the cache's next positions, ``positions`` (``(L,)``,
    or ``(B, L)`` for batched queries), or ``0..S-1`` for the keys with the queries as the
    last ``L`` of them."""
    L = Q.shape[-2]
    if cache is not None:
        at = cache.lengths[:, None] + np.arange(L)  # each sequence's own next positions
        return at, at
    if positions is not None:
        if L != S:
            raise ShapeError(
                f"positions= places the queries and the keys together, so it needs as many "
                f"queries as keys; got L={L}, S={S}: leave positions out for 0..S-1"
            )
        at = check_positions(positions, Q.shape, f"{nq} {Q.shape}")  # (L,) or (B, L)
        return at, at
    return np.arange(S - L, S), np.arange(S)


def same(
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


def _projection_bias(name: str, b: Any, W: np.ndarray) -> np.ndarray | None:
    """A bias added after ``x @ W``: one value per column of ``W``."""
    if b is None:
        return None
    array = as_float_array(name, b)
    if array.shape != (W.shape[1],):
        raise ShapeError(
            f"{name} must have shape ({W.shape[1]},) to match the columns of its weight "
            f"{W.shape}; got shape {array.shape}"
        )
    return array


def check_mask_argument(mask: Any, hint: str = "") -> None:
    """A layer's mask slot takes None, True/False or a boolean array; anything else is
    refused, with ``hint`` (where a float array there belongs, say) after the message."""
    if mask is None or isinstance(mask, (bool, np.bool_)):
        return
    given = reprlib.repr(mask)
    if isinstance(mask, (np.ndarray, list, tuple)):
        array = as_array("mask", mask)
        if array.dtype.kind == "b":
            return
        given = f"an array of dtype {array.dtype} and shape {array.shape}"
    raise AttentionTypeError(
        f"the mask (forward's second argument, or mask=) must be None, True/False (causal) "
        f"or a boolean array with True = may attend; got {given}{hint}"
    )


def random_generator(seed: Any) -> np.random.Generator:
    """``np.random.default_rng(seed)``, or a clear refusal of the seed."""
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as error:
        raise AttentionTypeError(
            f"seed must be None, a non-negative integer or a np.random.Generator; "
            f"got {reprlib.repr(seed)} ({error})"
        ) from None
