"""The checks of the arrays an entry point is given, against each other and its spec.

:func:`checked_heads` checks :func:`mha.scaled_dot_product_attention`'s ``q``, ``k``, ``v``;
:func:`check_layer` checks a layer's call (:func:`mha.multi_head_attention`'s inputs,
weights and head counts, with its keywords already checked into a spec by
:mod:`.spec`) and returns it as a :class:`Call`. :mod:`mha.dask` runs the same checks on
stand-ins of its arrays' shapes when it builds a graph, so both raise the same errors.
Messages name the arguments as the caller gave them: ``names`` maps ``Q``, ``K`` and ``V``
to the caller's names (``MultiHeadAttention.forward`` calls them ``query``, ``key`` and
``value``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from .._arrays import (
    as_array,
    as_float_array,
    check_rank,
    positive_int,
    resolve_scale,
    result_and_compute_dtypes,
)
from .._kernel.contract import ScoreShape, Visibility
from .._kernel.scores import Scores
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .cached import Append, CacheFit, check_cache
from .gates import OutputGate
from .output_norm import OutputNorm, Stages
from .qk_norm import QKNorm, check_qk_norm
from .rope_scaling import check_base, check_rope_scaling
from .rotary import check_positions, check_rotary_options
from .spec import AttentionSpec, CallInputs, Checked, Request

__all__ = [
    "INPUT_NAMES",
    "WEIGHT_NAMES",
    "Call",
    "LayerArrays",
    "LayerWeights",
    "Weights",
    "cache_positions",
    "check_layer",
    "checked_heads",
    "kv_heads",
    "plain_heads",
    "same",
    "side_by_side",
    "side_by_side_bias",
]

INPUT_NAMES: Mapping[str, str] = {
    "Q": "Q",
    "K": "K",
    "V": "V",
    "d_q": "d_q",
    "d_kin": "d_kin",
    "d_vin": "d_vin",
}
"""The function's names for its inputs and their widths, as messages quote them."""

WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")


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
    """The query heads per key/value head; ``H_kv`` must divide ``H`` (0 query heads: an
    empty result)."""
    if H_kv == 0 or H % H_kv:
        raise ShapeError(
            f"{H_kv} key/value heads do not divide {H} query heads ({shapes}); grouped-query "
            "attention needs H to be a multiple of H_kv"
        )
    return H // H_kv


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
        """The weights in ``dtype`` (the same arrays where they already are: found once per
        dtype, a kept call's weights being the same object call after call; a cast is made
        afresh every call, so a weight updated in place is read as it is now)."""
        memo = self.__dict__.setdefault("_memo", {})  # (a frozen dataclass's own dict)
        if memo.get(dtype) is True:
            return self
        present = self.present()
        if all(x.dtype == dtype for x in present.values()):
            memo[dtype] = True  # (replace() costs microseconds a call)
            return self
        cast = {name: x.astype(dtype, copy=False) for name, x in present.items()}
        return replace(self, **cast)

    def joined(self) -> np.ndarray | None:
        """The one matrix whose blocks of columns ``W_q``, ``W_k`` and ``W_v`` are, when
        they are (:func:`side_by_side`), found once: an array's layout does not change
        while a kept call holds it (the kept check compares the shapes)."""
        memo = self.__dict__.setdefault("_memo", {})
        if "joined" not in memo:
            memo["joined"] = side_by_side(self.W_q, self.W_k, self.W_v)
        joined: np.ndarray | None = memo["joined"]
        return joined

    def present(self) -> dict[str, np.ndarray]:
        """The weights given, by parameter name."""
        arrays = {name: getattr(self, name) for name in WEIGHT_NAMES}
        return {name: x for name, x in arrays.items() if x is not None}


class LayerArrays(NamedTuple):
    """A layer's inputs as given: ``Q``, ``K``, ``V`` (one array for self-attention)."""

    Q: Any
    K: Any
    V: Any


class LayerWeights(NamedTuple):
    """A layer's weights as given: the projections (``x @ W``), their biases, torch's extra
    key/value biases and the QK-norm's weights (``None`` where absent)."""

    W_q: Any
    W_k: Any
    W_v: Any
    W_o: Any
    b_q: Any = None
    b_k: Any = None
    b_v: Any = None
    b_o: Any = None
    bias_k: Any = None
    bias_v: Any = None
    q_norm: Any = None
    k_norm: Any = None
    W_g: Any = None
    b_g: Any = None
    q_norm_bias: Any = None
    k_norm_bias: Any = None
    o_norm: Any = None
    q_scale: Any = None


@dataclass(frozen=True)
class Call:
    """A checked :func:`mha.multi_head_attention` call: its arrays as arrays, its sizes,
    its spec fitted to them (the scale, the scores, the rotary keywords and positions, the
    QK-norm), what it carries and asks back. ``visibility`` covers the ``S`` given keys;
    with a cache it is ``None`` and ``append`` says what the call appends."""

    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    weights: Weights
    H: int
    H_kv: int
    d_k: int
    d_v: int
    B: tuple[int, ...]  # () for unbatched input
    L: int
    S: int
    result_dtype: np.dtype
    compute_dtype: np.dtype
    spec: AttentionSpec
    given: CallInputs
    request: Request
    scale: float
    visibility: Visibility | None = None
    append: Append | None = None  # with a cache: what the call appends
    scores: Scores | None = None  # sinks, soft-capping, ALiBi, score_mod
    sinks: np.ndarray | None = None  # as given (its gradient takes its dtype)
    qk_norm: QKNorm | None = None  # RMSNorm (or LayerNorm) of q and k before the rotation
    rotary: dict[str, Any] | None = None  # apply_rotary's keywords
    q_positions: Any = None
    k_positions: Any = None
    q_scale: np.ndarray | None = None  # each query feature's factor after the rotation

    @property
    def extra(self) -> int:
        """Keys appended after the projections: bias_k's and the zero key."""
        return (self.weights.bias_k is not None) + self.spec.add_zero_attn

    @property
    def self_attention(self) -> bool:
        return self.Q is self.K is self.V

    @property
    def cache(self) -> Any:
        return self.given.cache

    @property
    def counts(self) -> np.ndarray | None:
        """With a cache: each sequence's new tokens."""
        return None if self.append is None else self.append.counts


def check_layer(
    arrays: LayerArrays,
    given: LayerWeights,
    num_heads: Any,
    checked: Checked,
    names: Mapping[str, str] = INPUT_NAMES,
) -> Call:
    """Every check of a layer's call, in the order :func:`mha.multi_head_attention` makes
    them, its keywords already checked (``checked``). ``Q is K is V`` stays true of the
    checked call (one GEMM projects all three). ``names`` gives the caller's names of the
    inputs and their widths; a key and value named like the query are the query itself
    (self-attention), quoted once."""
    spec, inputs, request = checked.spec, checked.given, checked.request
    Q, K, V = _layer_inputs(arrays, names)
    weights = _weights(given, (Q, K, V), names)
    H, H_kv, d_k, d_v = _heads(weights, num_heads, spec.num_kv_heads, spec.output)
    weights = with_biases(weights, given)
    spec = _with_gate(spec, given, H, d_v, Q.shape[-1])
    spec = _with_output_norm(spec, given, H * d_v)
    gate_weights = getattr(spec.output, "weights", {}).values()
    result_dtype, compute_dtype = result_and_compute_dtypes(
        Q, K, V, *weights.present().values(), *gate_weights
    )
    B, L, S = Q.shape[:-2], Q.shape[-2], K.shape[-2]  # B is () for unbatched input
    nq, nk = names["Q"], names["K"]
    context = f"{nq} {Q.shape}" if nk == nq else f"{nq} {Q.shape}, {nk} {K.shape}"
    visibility, append = None, None
    if inputs.cache is not None:
        _refuse_with_cache(Q, K, weights, checked, names)
        fit = CacheFit(Q.shape[0], H_kv, d_k, d_v, L, S)
        append = check_cache(inputs.cache, spec.mask, inputs.arrays, fit, compute_dtype, context)
    else:
        shape = ScoreShape(B, H, L, S)
        visibility = Visibility.build(spec.mask, inputs.arrays, shape, compute_dtype, context)
    scale = resolve_scale(spec.scale, d_k, compute_dtype, f"W_q {weights.W_q.shape}")
    if (request.backward or spec.dropout_p) and inputs.cache is not None:
        raise AttentionValueError("return_backward and dropout are not available with cache=")
    scores = spec.scores.fit(H, request.backward, tuple(B))
    _refuse_positional_with_extra_keys(weights, spec, scores)
    sizes = (H, d_k, S, weights.W_q.shape)
    rotary, q_positions, k_positions = _rotary(spec, inputs, Q, sizes, nq)
    norm_weights = (given.q_norm, given.k_norm, given.q_norm_bias, given.k_norm_bias)
    norm = check_qk_norm(spec.qk_norm, norm_weights, (H, H_kv, d_k))
    sinks = None if spec.scores.sinks is None else as_float_array("sinks", spec.scores.sinks)
    q_scale = _query_scale(given.q_scale, H, d_k)
    return Call(
        Q, K, V, weights, H, H_kv, d_k, d_v, B, L, S, result_dtype, compute_dtype, spec,
        inputs, request, scale, visibility, append, scores, sinks, norm, rotary, q_positions,
        k_positions, q_scale,
    )  # fmt: skip


def with_cache_state(call: Call, checked: Checked, names: Mapping[str, str]) -> Call:
    """A call :func:`check_layer` checked with a cache, for the cache ``checked`` carries
    now: what it appends (:func:`.cached.check_cache`, which checks the cache's state) and
    the rotary positions its lengths give, as :func:`check_layer` works them out; the rest
    of the call is the same for every call with these keywords, inputs and weights."""
    inputs, spec, Q = checked.given, call.spec, call.Q
    nq, nk = names["Q"], names["K"]
    context = f"{nq} {Q.shape}" if nk == nq else f"{nq} {Q.shape}, {nk} {call.K.shape}"
    fit = CacheFit(Q.shape[0], call.H_kv, call.d_k, call.d_v, call.L, call.S)
    append = check_cache(inputs.cache, spec.mask, inputs.arrays, fit, call.compute_dtype, context)
    rotary: dict[str, Any] | None = call.rotary
    if rotary is not None and "scaling" not in rotary:  # its keywords as kept
        q_positions, k_positions = _rotary_positions(None, inputs.cache, Q, call.S, nq)
    else:  # (a scaling's length follows the positions)
        sizes = (call.H, call.d_k, call.S, call.weights.W_q.shape)
        rotary, q_positions, k_positions = _rotary(spec, inputs, Q, sizes, nq)
    return with_fields(
        call, given=inputs, append=append, rotary=rotary, q_positions=q_positions,
        k_positions=k_positions,
    )  # fmt: skip


def plain_heads(call: Call) -> bool:
    """Whether nothing of ``call`` changes its heads or their scores beyond the projection,
    the scale, the rotation and the mask (no extra keys, left padding, score changes,
    QK-norm, query scale, output stage, clamp, value norm or dropout), and only its output
    is asked for: what a layer's kept paths (:mod:`.decoding`, :mod:`.layer_plan`,
    :mod:`.sequence_blocks`) compute without the general path."""
    spec, request = call.spec, call.request
    return (
        not call.extra
        and not call.given.left_padded
        and call.scores is None
        and call.qk_norm is None
        and call.q_scale is None
        and spec.output is None
        and spec.clip_qkv is None
        and spec.v_norm is None
        and not spec.dropout_p
        and not request.weights
        and not request.backward
        and not request.lse
    )


def with_fields(call: Call, **fields: Any) -> Call:
    """``call`` with ``fields`` in place of its own (without ``dataclasses.replace``'s
    checks, which cost microseconds a call)."""
    again: Call = object.__new__(Call)
    again.__dict__.update(call.__dict__, **fields)
    return again


def _with_gate(
    spec: AttentionSpec, given: LayerWeights, H: int, d_v: int, d_q: int
) -> AttentionSpec:
    """``spec`` with the output gate of ``W_g`` (and ``b_g``) as its output stage."""
    if given.W_g is None:
        if given.b_g is not None or spec.output_gate is not None:
            name = "b_g" if given.b_g is not None else f"output_gate={spec.output_gate!r}"
            raise AttentionValueError(f"{name} needs the gate's weights W_g (d_q, H*d_v or H)")
        return spec
    if spec.output is not None:
        raise AttentionValueError("W_g: this call's spec has an output stage already")
    gate = OutputGate.check(spec.output_gate, given.W_g, given.b_g, H, d_v, d_q)
    return replace(spec, output=gate)


def _query_scale(q_scale: Any, H: int, d_k: int) -> np.ndarray | None:
    """``q_scale (H*d_k,)``: each query head's factors of its features after the rotation
    (Dory's nGPT ``sqk``), checked."""
    if q_scale is None:
        return None
    s = as_float_array("q_scale", q_scale)
    if s.shape != (H * d_k,):
        raise ShapeError(
            f"q_scale must have shape (H*d_k,) = ({H * d_k},), one factor a query feature; "
            f"got shape {s.shape}"
        )
    return s


def _with_output_norm(spec: AttentionSpec, given: LayerWeights, width: int) -> AttentionSpec:
    """``spec`` with the norm of the joined heads (``output_norm``, weight ``o_norm``) as its
    output stage, after its output gate where it has one."""
    if spec.output_norm is None:
        if given.o_norm is not None:
            raise AttentionValueError("o_norm needs output_norm='rms'")
        return spec
    norm = OutputNorm.check(spec.output_norm, given.o_norm, width)
    stage = norm if spec.output is None else Stages(spec.output, norm)
    return replace(spec, output=stage)


def _layer_inputs(
    arrays: LayerArrays, names: Mapping[str, str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``Q``, ``K``, ``V`` as float arrays of fitting ranks and lengths."""
    nq, nk, nv = names["Q"], names["K"], names["V"]
    one = arrays.Q is arrays.K is arrays.V
    Q = as_float_array(nq, arrays.Q)
    K = Q if one else as_float_array(nk, arrays.K)
    V = Q if one else as_float_array(nv, arrays.V)
    d_q = names["d_q"]
    check_rank(nq, Q, f"(B, L, {d_q}) or (L, {d_q})", (2, 3))
    for name, X, width in ((nk, K, names["d_kin"]), (nv, V, names["d_vin"])):
        layout = f"{'(B, S, ' if Q.ndim == 3 else '(S, '}{width}), like {nq} {Q.shape}"
        check_rank(name, X, layout, (Q.ndim,))
    same(nq, Q, nk, K, "batch shape {}", Q.shape[:-2], K.shape[:-2])
    same(nk, K, nv, V, "batch shape {}", K.shape[:-2], V.shape[:-2])
    same(nk, K, nv, V, "{} positions", K.shape[-2], V.shape[-2])
    return Q, K, V


def _weights(
    given: LayerWeights, inputs: tuple[np.ndarray, ...], names: Mapping[str, str]
) -> Weights:
    """The projections and their biases as arrays that fit the inputs (the head counts
    are checked by :func:`_heads`)."""
    W_q, W_k, W_v, W_o = (
        as_float_array(name, W)
        for name, W in zip(_MATRICES, (given.W_q, given.W_k, given.W_v, given.W_o), strict=True)
    )
    for name, W in zip(_MATRICES, (W_q, W_k, W_v, W_o), strict=True):
        check_rank(name, W, "(rows, columns) in the x @ W layout", (2,))
    for X, name_x, W, name_W in zip(
        inputs, (names["Q"], names["K"], names["V"]), (W_q, W_k, W_v), _MATRICES, strict=False
    ):
        _chain(name_x, X, name_W, W)
    return Weights(W_q, W_k, W_v, W_o)


def _heads(
    weights: Weights, num_heads: Any, num_kv_heads: Any, stage: Any = None
) -> tuple[int, int, int, int]:
    """``(H, H_kv, d_k, d_v)`` from the head counts and the weights' widths, checked (``W_o``
    against what an output ``stage`` makes of the joined heads, where it changes their width:
    differential attention's)."""
    W_q, W_k, W_v, W_o = weights.W_q, weights.W_k, weights.W_v, weights.W_o
    H = positive_int("num_heads", num_heads)
    H_kv = H if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    kv_heads(H, H_kv, f"num_heads={H}, num_kv_heads={H_kv}")
    kv_label = "num_heads" if num_kv_heads is None else "num_kv_heads"
    for name, W, heads, label in (
        ("W_q", W_q, H, "num_heads"),
        ("W_k", W_k, H_kv, kv_label),
        ("W_v", W_v, H_kv, kv_label),
    ):
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
    staged = getattr(stage, "staged_width", None)
    joined = H * d_v if staged is None else staged(H, d_v)
    if W_o.shape[0] != joined:
        raise ShapeError(
            f"W_o has {W_o.shape[0]} rows but the {H} joined heads of width {d_v} (from W_v "
            f"{W_v.shape}) feed it {joined} (W_v {W_v.shape}, W_o {W_o.shape})"
        )
    return H, H_kv, d_k, d_v


def with_biases(weights: Weights, given: LayerWeights) -> Weights:
    """``weights`` with the biases of ``given``, checked against their matrices."""
    biases = (given.b_q, given.b_k, given.b_v, given.b_o, given.bias_k, given.bias_v)
    if all(b is None for b in biases):
        return weights  # none given: none to check (replace() costs microseconds a call)
    b_q, b_k, b_v, b_o = (
        _projection_bias(name, b, W)
        for name, b, W in zip(
            ("b_q", "b_k", "b_v", "b_o"),
            (given.b_q, given.b_k, given.b_v, given.b_o),
            (weights.W_q, weights.W_k, weights.W_v, weights.W_o),
            strict=True,
        )
    )
    if (given.bias_k is None) != (given.bias_v is None):
        raise AttentionValueError("bias_k and bias_v go together: give both or neither")
    bias_k = _projection_bias("bias_k", given.bias_k, weights.W_k)
    bias_v = _projection_bias("bias_v", given.bias_v, weights.W_v)
    return replace(weights, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o, bias_k=bias_k, bias_v=bias_v)


def _refuse_positional_with_extra_keys(
    weights: Weights, spec: AttentionSpec, scores: Scores | None
) -> None:
    """bias_k's key and the zero key have no position: what needs one is refused."""
    rules = spec.mask
    positional = [
        name
        for name, value in (
            ("alibi", scores is not None and scores.alibi is not None),
            ("score_mod", spec.scores.score_mod),
            ("mask_mod", rules.mask_mod),
            ("chunk", rules.chunk),
            ("sink_tokens", rules.sink_tokens),
        )
        if value is not None and value is not False
    ]
    if ((weights.bias_k is not None) or spec.add_zero_attn) and positional:
        raise AttentionValueError(
            f"bias_k/bias_v and add_zero_attn append keys that have no position, so they "
            f"cannot be combined with {', '.join(positional)}"
        )


def _rotary(
    spec: AttentionSpec, inputs: CallInputs, Q: np.ndarray, sizes: tuple[Any, ...], nq: str
) -> tuple[dict[str, Any] | None, Any, Any]:
    """The rotary keywords of :func:`mha.apply_rotary`, and where the queries and keys
    sit; ``(None, None, None)`` without rotary positions (whose options are then refused).
    ``sizes`` is ``(H, d_k, S, W_q's shape)``."""
    H, d_k, S, W_q_shape = sizes
    rules = spec.rotary
    if rules.theta is None:
        given = [
            name
            for name, value in (
                ("rotary_dim", rules.rotary_dim),
                ("rotary_interleaved", rules.interleaved),
                ("rope_scaling", rules.scaling),
            )
            if value is not None and value is not False
        ]
        if given:
            raise AttentionValueError(
                f"{', '.join(given)} has no effect without rope_theta=: give rope_theta too"
            )
        if inputs.positions is not None:
            raise AttentionValueError("positions= has no effect without rope_theta=: give both")
        return None, None, None
    subject = f"W_q {W_q_shape}, num_heads={H}"
    _, theta, interleaved = check_rotary_options(
        d_k, rules.theta, rules.rotary_dim, rules.interleaved, subject, "rope_theta"
    )
    rotary: dict[str, Any] = {
        "theta": theta,
        "rotary_dim": rules.rotary_dim,
        "interleaved": interleaved,
    }
    q_positions, k_positions = _rotary_positions(inputs.positions, inputs.cache, Q, S, nq)
    if rules.scaling is not None:  # one length for q and k, as transformers' position_ids
        rotary["scaling"] = check_rope_scaling(
            rules.scaling, rules.rotary_dim or d_k, subject, "rope_scaling"
        )
        check_base(rotary["scaling"], theta, ("rope_theta", "rope_scaling"))
        rotary["seq_len"] = 1 + max(  # (at least 1: with no keys, queries sit below 0)
            (float(np.max(p)) for p in (q_positions, k_positions) if np.size(p)), default=0.0
        )
        rotary["seq_len"] = max(rotary["seq_len"], 1.0)
    return rotary, q_positions, k_positions


_MATRICES = ("W_q", "W_k", "W_v", "W_o")


def _refuse_with_cache(
    Q: np.ndarray, K: np.ndarray, weights: Weights, checked: Checked, names: Mapping[str, str]
) -> None:
    """What a call with ``cache=`` cannot also have, refused before the cache changes."""
    nq, nk = names["Q"], names["K"]
    refused = []
    if Q.ndim != 3:
        refused.append(f"unbatched inputs ({nq} {Q.shape}; give (B, L, d))")
    if Q.ndim == K.ndim and Q.shape[-2] != K.shape[-2]:
        refused.append(f"keys that are not the new tokens' own ({nq} {Q.shape}, {nk} {K.shape})")
    if weights.bias_k is not None or checked.spec.add_zero_attn:
        refused.append("bias_k/bias_v or add_zero_attn")
    if checked.request.weights:
        refused.append("return_weights")
    if checked.given.positions is not None:
        refused.append("positions= (the cache's lengths give the positions)")
    if checked.spec.selection is not None:
        refused.append("a selection of keys")
    if refused:
        raise AttentionValueError(f"cache= cannot be combined with {'; '.join(refused)}")


def cache_positions(cache: Any, L: int) -> np.ndarray:
    """The positions ``(B, L)`` of the next ``L`` tokens of each sequence of ``cache``."""
    at: np.ndarray = cache.lengths[:, None] + np.arange(L)  # each sequence's own
    return at


def _rotary_positions(
    positions: Any, cache: Any, Q: np.ndarray, S: int, nq: str
) -> tuple[np.ndarray, np.ndarray]:
    """Where the queries and keys sit: the cache's next positions, ``positions`` (``(L,)``,
    or ``(B, L)`` for batched queries), or ``0..S-1`` for the keys with the queries as the
    last ``L`` of them."""
    L = Q.shape[-2]
    if cache is not None:
        at = cache_positions(cache, L)
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


def side_by_side(*matrices: np.ndarray) -> np.ndarray | None:
    """The one C-contiguous matrix whose consecutive blocks of columns ``matrices`` are, in
    order (a read checkpoint's ``W_q``, ``W_k`` and ``W_v``: :meth:`mha.MultiHeadAttention.
    from_spec` lays them out so), else ``None``: a call projects all three with one product
    (a decoding step of SmolLM2's layer: 114 us against 172 for three, one thread)."""
    whole = matrices[0].base
    if not isinstance(whole, np.ndarray) or whole.ndim != 2 or not whole.flags.c_contiguous:
        return None
    at = whole.ctypes.data
    for W in matrices:
        if W.base is not whole or W.strides != whole.strides or len(W) != len(whole):
            return None
        if W.ctypes.data != at:
            return None
        at += W.shape[1] * W.itemsize
    return whole if at == whole.ctypes.data + whole.shape[1] * whole.itemsize else None


def side_by_side_bias(*parts: tuple[np.ndarray | None, np.ndarray]) -> np.ndarray | None:
    """The biases ``b`` of the products by matrices ``W`` side by side, ``parts = ((b,
    W), ...)``, as one (zeros for those absent), or ``None`` when none has one."""
    if all(b is None for b, _ in parts):
        return None
    return np.concatenate([np.zeros(W.shape[1], W.dtype) if b is None else b for b, W in parts])
