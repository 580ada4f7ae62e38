"""The dense reference, written from the docs (docs/contract.md, docs/variants.md,
docs/serving.md and the docstrings), sharing no code with mha: the whole score matrix in
float64, every visibility rule as its formula, a softmax with the sinks' term, and the
gradients of FlashAttention's backward written out densely.

Every call is reduced to a :class:`Scene`: ``N`` sequences (the batch axes flattened), each
query row and key at a position. Without a cache query ``i`` sits at ``i + offset`` (``S -
L``, or 0 for top-left) and key ``j`` at ``j``; ``mask_mod`` and ``score_mod`` see the row
and key indices. With a cache, both are the tokens' positions in their sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Scene:
    """What the scores of ``N`` sequences are made of (arrays broadcast to ``(N, H, L, S)``).

    ``q (N, H, L, d_k)``, ``k (N, H_kv, S, d_k)``, ``v (N, H_kv, S, d_v)`` in float64;
    ``q_pos (N, 1, L, 1)``, ``k_pos (N, 1, 1, S)`` the positions of the causal mask, the
    window, the chunks and ALiBi; ``q_idx``, ``k_idx`` what ``mask_mod`` and ``score_mod``
    see; ``rows``, ``keys`` the real (unpadded) ones; ``free_keys`` trailing keys that every
    real row sees whatever the masks say (torch's ``bias_k`` and zero key)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    q_pos: np.ndarray
    k_pos: np.ndarray
    q_idx: np.ndarray
    k_idx: np.ndarray
    rows: np.ndarray
    keys: np.ndarray
    causal: bool = False
    window: int | None = None
    sink_tokens: int = 0
    chunk: int | None = None
    mask: np.ndarray | None = None  # (N, H or 1, L or 1, S or 1)
    bias: np.ndarray | None = None
    mask_mod: Callable[..., Any] | None = None
    score_mod: Callable[..., Any] | None = None
    score_mod_grad: Callable[..., Any] | None = None
    softcap: float | None = None
    slopes: np.ndarray | None = None
    sinks: np.ndarray | None = None
    free_keys: int = 0
    b_idx: np.ndarray | None = None  # mask_mod's b per sequence (default 0..N-1)

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        N, H = self.q.shape[:2]
        b = np.arange(N) if self.b_idx is None else self.b_idx
        return b.reshape(N, 1, 1, 1).astype(np.int64), np.arange(H).reshape(1, H, 1, 1)


@dataclass
class Dense:
    out: np.ndarray  # (N, H, L, d_v)
    lse: np.ndarray  # (N, H, L)
    p: np.ndarray  # (N, H, L, S)
    parts: dict[str, np.ndarray] = field(default_factory=dict)


def visible(scene: Scene) -> np.ndarray:
    """``(N, H, L, S)``: True where a query may attend to a key, every rule ANDed."""
    N, H, L = scene.q.shape[:3]
    S = scene.k.shape[2]
    given = S - scene.free_keys
    pos, j = scene.q_pos, scene.k_pos
    seen = np.broadcast_to(scene.rows & scene.keys, (N, H, L, S)).copy()
    ruled = np.ones((N, H, L, given), dtype=bool)
    jg = j[..., :given]
    if scene.causal:
        ruled &= jg <= pos
    if scene.window is not None:
        ruled &= (pos - jg < scene.window) | (jg < scene.sink_tokens)
    if scene.chunk is not None:
        ruled &= pos // scene.chunk == jg // scene.chunk
    if scene.mask is not None:
        ruled &= scene.mask[..., :given]
    if scene.bias is not None:
        ruled &= ~np.isneginf(scene.bias[..., :given])
    if scene.mask_mod is not None:
        b, h = scene.indices()
        ruled &= np.asarray(scene.mask_mod(b, h, scene.q_idx, scene.k_idx[..., :given]))
    seen[..., :given] &= ruled
    return seen


def attend(scene: Scene) -> Dense:
    """The attention of ``scene``: outputs, log-sum-exps (``-inf``, or the sink, for a row
    that sees no key) and weights."""
    N, H, L, _ = scene.q.shape
    H_kv = scene.k.shape[1]
    group = H // H_kv if H_kv else 1
    k, v = np.repeat(scene.k, group, axis=1), np.repeat(scene.v, group, axis=1)
    s0 = np.einsum("nhid,nhjd->nhij", scene.q, k) * scene.scale
    s1 = s0 if scene.softcap is None else scene.softcap * np.tanh(s0 / scene.softcap)
    s2 = s1
    b, h = scene.indices()
    if scene.score_mod is not None:
        s2 = np.broadcast_to(scene.score_mod(s1, b, h, scene.q_idx, scene.k_idx), s1.shape)
    s3 = s2.astype(np.float64, copy=True)
    S = s3.shape[-1]
    given = S - scene.free_keys
    if scene.slopes is not None:
        s3[..., :given] -= scene.slopes.reshape(1, H, 1, 1) * (
            scene.q_pos - scene.k_pos[..., :given]
        )
    if scene.bias is not None:
        s3[..., :given] += np.where(np.isneginf(scene.bias), 0.0, scene.bias)[..., :given]
    seen = visible(scene)
    logits = np.where(seen, s3, -np.inf)
    sink = np.full((N, H, L, 1), -np.inf)
    if scene.sinks is not None:
        sink[...] = scene.sinks.reshape(1, H, 1, 1)
    full = np.concatenate([logits, sink], axis=-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        top = full.max(axis=-1, keepdims=True, initial=-np.inf)
        top = np.where(np.isfinite(top), top, 0.0)
        lse = np.log(np.exp(full - top).sum(axis=-1, keepdims=True)) + top
        p = np.where(seen, np.exp(s3 - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    out = p @ v
    parts = {"s0": s0, "s1": s1, "seen": seen, "k": k, "v": v}
    return Dense(out, lse[..., 0], p, parts)


def gradients(scene: Scene, dense: Dense, grad_out: np.ndarray) -> dict[str, tuple[Any, Any]]:
    """The gradients of ``sum(grad_out * out)``: name -> ``(gradient, magnitude)``, the
    magnitude being the same sums over absolute values (what rounding errors scale with).
    ``q`` ``(N, H, L, d_k)``, ``k`` and ``v`` per key/value head, ``bias (N, H, L, S)``
    over the scores (the caller sums it to the bias's shape), ``sinks (H,)``."""
    N, H = scene.q.shape[:2]
    H_kv = scene.k.shape[1]
    group = H // H_kv if H_kv else 1
    p, out, parts = dense.p, dense.out, dense.parts
    dP = grad_out @ np.swapaxes(parts["v"], -1, -2)
    D = (grad_out * out).sum(axis=-1, keepdims=True)
    dS = p * (dP - D)
    mag_dS = p * (np.abs(dP) + np.abs(D))
    grads = {"bias": (dS, mag_dS)}
    b, h = scene.indices()
    factor = np.ones_like(dS)
    if scene.score_mod is not None:
        assert scene.score_mod_grad is not None
        factor = factor * scene.score_mod_grad(parts["s1"], b, h, scene.q_idx, scene.k_idx)
    if scene.softcap is not None:
        factor = factor * (1.0 - np.tanh(parts["s0"] / scene.softcap) ** 2)
    dS0, mag0 = dS * factor, mag_dS * np.abs(factor)
    grads["q"] = (scene.scale * dS0 @ parts["k"], scene.scale * mag0 @ np.abs(parts["k"]))

    def per_kv_head(x: np.ndarray) -> np.ndarray:
        return x.reshape(N, H_kv, group, *x.shape[2:]).sum(axis=2)

    T = np.swapaxes
    grads["k"] = tuple(per_kv_head(scene.scale * T(a, -1, -2) @ x)
                       for a, x in ((dS0, scene.q), (mag0, np.abs(scene.q))))  # fmt: skip
    grads["v"] = tuple(per_kv_head(T(a, -1, -2) @ g)
                       for a, g in ((p, grad_out), (p, np.abs(grad_out))))  # fmt: skip
    if scene.sinks is not None:
        with np.errstate(invalid="ignore"):
            weight = np.exp(scene.sinks.reshape(1, H, 1) - dense.lse)
        weight = np.where(np.isfinite(weight), weight, 0.0)
        grads["sinks"] = (-(weight * D[..., 0]).sum(axis=(0, 2)),
                          (weight * np.abs(D[..., 0])).sum(axis=(0, 2)))  # fmt: skip
    return grads


def sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` summed over the axes it was broadcast along from ``shape``."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def fit(array: np.ndarray, full: tuple[int, ...], batched: bool) -> np.ndarray | None:
    """A mask or bias against the scores ``full = (*batch, H, L, S)`` as the contract reads
    it: with batch axes, an array of one axis fewer is ``(*batch, L, S)`` for every head.
    ``None`` when it does not broadcast (the call must be refused)."""
    if batched and array.ndim == len(full) - 1:
        array = np.expand_dims(array, -3)
    if array.ndim > len(full):
        return None
    try:
        if np.broadcast_shapes(array.shape, full) != full:
            return None
    except ValueError:
        return None
    return np.broadcast_to(array, full)


def rotate(x: np.ndarray, positions: np.ndarray, theta: float, rotary_dim: int | None,
           interleaved: bool, factor: float = 1.0) -> np.ndarray:  # fmt: skip
    """Rotary embeddings of ``x (..., L, d)`` at ``positions`` (broadcasting against
    ``x.shape[:-1]``), written from docs/pretrained.md: pair ``i`` of the ``r`` rotated
    features turns by ``position / factor * theta^(-2i/r)``; pairs ``(i, i + r/2)``, or
    ``(2i, 2i + 1)`` interleaved (GPT-J). ``factor`` is ``linear`` rope scaling's."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    out = np.array(x, dtype=np.float64)
    if r == 0:
        return out
    angle = (np.asarray(positions, np.float64)[..., None] / factor) * theta ** (
        -np.arange(0, r, 2) / r
    )
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = (x[..., 0:r:2], x[..., 1:r:2]) if interleaved else (x[..., : r // 2], x[..., r // 2 : r])
    first, second = a * cos - b * sin, b * cos + a * sin
    if interleaved:
        out[..., 0:r:2], out[..., 1:r:2] = first, second
    else:
        out[..., : r // 2], out[..., r // 2 : r] = first, second
    return out
