"""The projection layer's computation: :func:`compute` projects a checked call's inputs
into heads, rotates them (rotary positions), appends torch's extra keys, runs the
split-head core on the kernel (or on a cache), joins the heads and applies the output
projection (:func:`mha.multi_head_attention`, :mod:`.function`, checks the call; a layer,
:mod:`.module`).

Weights use the "x @ W" layout: ``W_q (d_q, H*d_k)`` maps a query of width ``d_q`` to the
``H`` heads' concatenated queries. Shapes are named as in the paper: ``B`` batch, ``H``
heads, ``L`` query positions, ``S`` key positions, ``d_k``/``d_v`` per-head widths.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any

import numpy as np

from .._arrays import cast_result
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import MaskArrays, MaskRules, ScoreShape, Visibility
from .._kernel.dropout import Dropout, drawn
from .._kernel.forward import attend
from .._kernel.team import Team, workers_for
from .cached import CachedCall, attend_cached
from .checks import Call, Weights
from .clip import clip
from .gradients import Forward, ProjectedBackward, join_heads, split_heads
from .padding import to_front, to_left
from .qk_norm import QKNorm
from .qkv import qkv_weights
from .rotary import rotate, rotation
from .selection import select_keys
from .sequence_blocks import blocks_for
from .v_norm import v_norm

__all__ = [
    "append_keys",
    "compute",
    "layer_sizes",
    "layer_workers",
    "project_heads",
]


def compute(call: Call) -> np.ndarray | tuple[Any, ...]:
    """A call checked by :func:`check_layer`, computed: the output, then the weights and
    ``backward`` if asked for."""
    if call.given.left_padded:  # each sequence's real rows first, as for right padding
        call = _real_rows_first(call)
    H, L, S = call.H, call.L, call.S
    dtype, given, request = call.compute_dtype, call.weights, call.request
    w = given.in_dtype(dtype)
    visibility = call.visibility
    if visibility is not None and call.extra:
        visibility = with_extra_keys(visibility, call.extra, dtype)
    # Everything is checked: the dropout's seed may be drawn.
    drop_p = call.spec.dropout_p

    workers = request.threads
    if workers is None:  # the default for the call's multiply-adds
        keys = S if call.cache is None else int(call.cache.lengths.max(initial=0)) + L
        workers = layer_workers(layer_sizes(call), keys)
    blocks = blocks_for(call, workers)  # many sequences: a block of them at a time
    if blocks is not None:
        with np.errstate(invalid="ignore", over="ignore"), Team(workers) as team:
            by_blocks = blocks(call, w, team)
        if by_blocks is not None:
            return cast_result(by_blocks, call.result_dtype)
    with (  # the seed drawn once everything is checked, put back if the call still fails
        drawn(drop_p, call.given.generator, H, L) if drop_p else _NO_DROPOUT as dropout,
        np.errstate(invalid="ignore", over="ignore"),
        Team(workers) as team,
    ):
        saved: dict[str, list[np.ndarray]] = {}  # the QK-norm's, for the backward
        q, k, v = project_heads(call, w, team, saved if request.backward else None)
        if call.extra:
            k = append_keys(k, w.bias_k, call.spec.add_zero_attn, call.H_kv)
            v = append_keys(v, w.bias_v, call.spec.add_zero_attn, call.H_kv)
        if visibility is not None:
            visibility = select_keys(call.spec.selection, q, k, visibility.classified(team))
        joined, outputs, kernel = _attend(call, (q, k, v), visibility, dropout, team)
        staged, stage_state = joined, None
        if call.spec.output is not None:  # a change between the heads and W_o
            output = call.spec.output
            shared = getattr(output, "uses_matmul", False)  # and may overwrite the heads
            product: tuple[Any, ...] = (team, not request.backward) if shared else ()
            staged, stage_state = output.forward(joined, call.Q, *product)
        out = team.matmul(staged, w.W_o, w.b_o)
    if call.given.left_padded:
        assert call.counts is not None
        out = to_left(out, call.counts, axis=-2)
    results: list[Any] = [cast_result(out, call.result_dtype)]
    if outputs is not None and outputs.weights is not None:
        results.append(cast_result(outputs.weights, call.result_dtype))
    if request.backward:
        assert outputs is not None and outputs.lse is not None and visibility is not None
        stage = (staged, stage_state)
        assert kernel is not None
        forward = Forward(kernel, joined, outputs.lse, saved, stage)
        results.append(ProjectedBackward(call, forward))
    return results[0] if len(results) == 1 else tuple(results)


_NO_DROPOUT = contextlib.nullcontext()
"""A call's dropout when it has none (``drawn``'s ``None``, without its generator's
microseconds)."""


def layer_workers(sizes: tuple[Any, ...], keys: int) -> int:
    """The default workers of a layer's call of ``sizes`` (:func:`layer_sizes`) whose
    queries attend over ``keys`` keys: :func:`workers_for` its multiply-adds, the
    projections' and the attention's."""
    sequences, L, S, W_q, W_kv, W_o, H, width = sizes
    cost = float(sequences) * (L * W_q + S * W_kv + L * W_o + H * L * keys * width)
    return workers_for(cost, None)


def layer_sizes(call: Call) -> tuple[Any, ...]:
    """What :func:`layer_workers` reads of a call."""
    w = call.weights
    return (
        math.prod(call.B), call.L, call.S, w.W_q.size, w.W_k.size + w.W_v.size, w.W_o.size,
        call.H, call.d_k + call.d_v,
    )  # fmt: skip


def _attend(
    call: Call,
    heads: tuple[np.ndarray, np.ndarray, np.ndarray],
    visibility: Visibility | None,
    dropout: Dropout | None,
    team: Team,
) -> tuple[np.ndarray, Outputs | None, KernelCall | None]:
    """The joined heads ``(*B, L, H*d_v)`` of the projected ``heads`` (q, k, v): over the
    given keys within ``visibility``, or on the call's cache (``visibility`` ``None``); and
    the kernel's outputs and call (``None`` for a cache's call)."""
    q, k, v = heads
    H, B, L, request = call.H, call.B, call.L, call.request
    if visibility is None:  # the cache's call
        assert call.append is not None
        cached = CachedCall(q, k, v, call.append, 1.0, call.scores, request)
        return join_heads(attend_cached(cached, team)[0]), None, None
    joined = np.zeros((*B, L, H * call.d_v), dtype=call.compute_dtype)  # (*B, L, H*d_v)
    outputs = Outputs(split_heads(joined, H))
    if request.weights:
        outputs.weights = np.zeros((*B, H, L, call.S + call.extra), dtype=call.compute_dtype)
    if request.backward:
        outputs.lse = np.full((*B, H, L), -np.inf, dtype=call.compute_dtype)
    kernel = KernelCall(q, k, v, visibility, 1.0, call.scores, dropout, request.budget)
    attend(kernel, outputs, team)
    return joined, outputs, kernel


def _real_rows_first(call: Call) -> Call:
    """A left-padded cached call with each sequence's real rows first (:func:`to_front`)."""
    assert call.counts is not None
    Q = to_front(call.Q, call.counts, axis=-2)
    K = Q if call.K is call.Q else to_front(call.K, call.counts, axis=-2)
    V = Q if call.V is call.Q else K if call.V is call.K else to_front(call.V, call.counts, -2)
    return replace(call, Q=Q, K=K, V=V)


def project_heads(
    call: Call, w: Weights, team: Team, saved: dict[str, list[np.ndarray]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The projected ``q (*B, H, L, d_k)`` (already times the scale), ``k``, ``v``, rotated
    at the call's positions when it has rotary embeddings; ``w`` holds the call's weights in
    its compute dtype.

    Where the scale goes, and whether one GEMM against ``[W_q | W_k | W_v]`` projects all
    three: :func:`.qkv.qkv_weights`. With QK-norm (or ``clip_qkv``) the scale multiplies
    the normalised (clamped) queries, and ``saved`` (when given) receives what the norm's
    backward needs under ``"q"`` and ``"k"``, and where the clamp let each of q, k, v through
    under ``"clip"``.
    """
    dtype, scale, H = call.compute_dtype, call.scale, call.H
    Q = call.Q.astype(dtype, copy=False)
    norm, c = call.qk_norm, call.spec.clip_qkv
    weights = qkv_weights(call, w, math.prod(Q.shape[:-1]))
    # a late scale multiplies the queries as they are copied into heads when nothing comes
    # between (the same bits as after, without a pass over them)
    copy_scale = weights.late_scale and norm is None and c is None
    times = scale if copy_scale else None
    if weights.joined is not None:
        q, k, v = team.matmul_heads(Q, *weights.joined, weights.heads, times)
    else:
        K, V = call.K.astype(dtype, copy=False), call.V.astype(dtype, copy=False)
        q, k, v = (
            team.matmul_heads(x, W, b, [part], factor)[0]
            for x, W, b, part, factor in zip(
                (Q, K, V), weights.W, weights.b, weights.heads, (times, None, None), strict=True
            )
        )
    after = norm is not None and norm.after_rope  # HunYuan's: the norm after the rotation
    if norm is not None and not after:
        q, k = normalise(norm, q, k, saved)
    if call.spec.v_norm is not None:  # Gemma 3n, Gemma 4: each value head's RMSNorm
        v, *v_saved = v_norm(v, call.spec.v_norm)
        if saved is not None:
            saved["v"] = v_saved
    if c is not None:  # DBRX, OLMo, OLMoE: clamped after the norm
        (q, q_in), (k, k_in), (v, v_in) = clip(q, c), clip(k, c), clip(v, c)
        if saved is not None:
            saved["clip"] = [q_in, k_in, v_in]
    if weights.late_scale and not after and not copy_scale:
        q *= scale  # a buffer of this call's own: the norm's or the clamp's
    if call.rotary is not None:  # the queries' rotation for keys at the same positions too
        turn = rotation(q.shape, call.q_positions, q.dtype, **call.rotary)
        q = rotate(q, turn)
        same = call.k_positions is call.q_positions and (
            k.ndim,
            k.shape[0],
            k.shape[-2:],
            k.dtype,
        ) == (q.ndim, q.shape[0], q.shape[-2:], q.dtype)  # (the angles broadcast over the heads)
        k = rotate(k, turn if same else rotation(k.shape, call.k_positions, k.dtype, **call.rotary))
    if norm is not None and after:
        q, k = normalise(norm, q, k, saved)
        q *= scale
    if call.q_scale is not None:  # Dory's: each query feature's factor, after the rotation
        if saved is not None:
            saved["q_scale"] = [q]
        q = q * call.q_scale.astype(q.dtype, copy=False).reshape(H, 1, -1)
    return q, k, v


def normalise(
    norm: QKNorm, q: np.ndarray, k: np.ndarray, saved: dict[str, list[np.ndarray]] | None
) -> tuple[np.ndarray, np.ndarray]:
    """The heads ``q (*B, H, L, d_k)`` and ``k`` through the QK-norm, what its backward
    needs into ``saved`` (when given) under ``"q"`` and ``"k"``."""
    H, H_kv = q.shape[-3], k.shape[-3]
    if norm.kind == "all":  # OLMo 2: a token's features, every head's
        (q, *q_saved), (k, *k_saved) = (norm.apply(join_heads(q), "q"),
                                        norm.apply(join_heads(k), "k"))  # fmt: skip
        q, k = split_heads(q, H), split_heads(k, H_kv)
    else:  # Qwen3, Gemma 3, StableLM, Cohere, HunYuan: each head's features
        (q, *q_saved), (k, *k_saved) = norm.apply(q, "q"), norm.apply(k, "k")
    if saved is not None:
        saved["q"], saved["k"] = q_saved, k_saved
    return q, k


def with_extra_keys(visibility: Visibility, extra: int, dtype: np.dtype) -> Visibility:
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
    arrays = MaskArrays(np.concatenate([allowed, seen], axis=-1), bias)
    shape = ScoreShape(
        visibility.index_shape[:-1], visibility.index_shape[-1], visibility.L, visibility.S + extra
    )
    return Visibility.build(MaskRules(), arrays, shape, dtype)


def append_keys(x: np.ndarray, bias: np.ndarray | None, zero: bool, H: int) -> np.ndarray:
    """``x (*B, H, S, d)`` with the learned row ``bias (H*d,)`` and a zero row appended."""
    rows = [x]
    lead = x.shape[:-2]
    if bias is not None:
        rows.append(np.broadcast_to(bias.reshape(H, 1, x.shape[-1]), (*lead, 1, x.shape[-1])))
    if zero:
        rows.append(np.zeros((*lead, 1, x.shape[-1]), dtype=x.dtype))
    return np.concatenate(rows, axis=-2)
