"""The arithmetic of multi-head latent attention (:class:`mha.LatentAttention`), both ways:
the projections and RMSNorms, the absorbed attention on the library's kernel, and its
gradient by the chain rule through each step.

Shapes: ``B`` batch axes (none for unbatched input), ``L`` tokens, ``E`` model width, ``H``
query heads, ``r`` the latent's width (``kv_lora_rank``), ``n`` and ``p`` each head's
unrotated and rotary query widths (``qk_nope_head_dim``, ``qk_rope_head_dim``), ``d_v`` a
head's value width. ``W_kv_b (r, H*(n + d_v))`` holds, per head, ``W_uk_h (r, n)`` (the
latent to the head's unrotated key) beside ``W_uv_h (r, d_v)`` (the latent to its value).

The absorbed form never builds a head's key or value. With ``c`` the normalised latent,

    q_h . k_h = (q_nope_h @ W_uk_h^T) . c + q_pe_h . k_pe    one r + p wide dot product
    o_h = softmax(scale * q_h . k_h) @ (c @ W_uv_h) = (softmax(...) @ c) @ W_uv_h

so every query head attends over the same key rows ``[c, k_pe]``, one key/value head for
all ``H`` query heads (grouped-query attention with ``H_kv = 1``), whose values are the
keys' first ``r`` features: ``key[..., :r]``, a view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import cast_result
from .gates import OutputGate
from .gradients import Fingerprints, gradient, join_heads, split_heads
from .qk_norm import rms_norm, rms_norm_backward
from .rotary import apply_rotary
from .sparse import IndexerSpec, choose_keys
from .sparse_walk import attend_chosen, walks_chosen
from .split_heads import scaled_dot_product_attention

__all__ = ["LatentPlan", "latent_forward"]


@dataclass(frozen=True)
class LatentPlan:
    """What one call computes besides its arrays: the sizes, the norms' epsilon, the
    softmax scale, the rotary embedding's keywords (:func:`mha.apply_rotary`'s), the indexer
    of a sparse top-k attention (:mod:`.sparse`), if any, and the output gate's activation."""

    H: int
    r: int
    n: int
    p: int
    d_v: int
    eps: float
    scale: float
    rotary: dict[str, Any]
    indexer: IndexerSpec | None = None
    gate: str | None = None
    """The activation of the output gate per head (``W_g (E, H)``), when the layer has one."""
    rotates: bool = True
    """Whether the ``p`` features rotate (``False``: Kimi-Linear's NoPE)."""
    query_gate: bool = False
    """Whether the query and a gate per feature read ``[norm(a), a]``, the query latent after
    and before its norm (A.X-K2's ``q_gate_proj``), rather than the query ``norm(a)`` alone
    and the gate ``x``."""

    def output_gate(self, W: dict[str, np.ndarray], E: int) -> OutputGate | None:
        """The gate of the weights ``W`` (``None`` without ``W_g``): :mod:`.gates`'."""
        if "W_g" not in W:
            return None
        d_in = W["W_q_a"].shape[1] * 2 if self.query_gate else E
        return OutputGate.check(self.gate, W["W_g"], None, self.H, self.d_v, d_in)

    def rotate(self, x: np.ndarray, positions: np.ndarray, inverse: bool = False) -> np.ndarray:
        """``x (*B, heads, L, p)`` rotated at ``positions``; ``inverse`` applies the
        transpose of the rotation (the gradient's way back); ``x`` itself without a rotary
        embedding."""
        if not self.rotates:
            return x
        return apply_rotary(x, positions, inverse=inverse, **self.rotary)

    def absorbed(self, W_kv_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``W_uk (H, n, r)``, the transposes of each head's latent-to-key matrix, and
        ``W_uv (H, r, d_v)``, each head's latent-to-value matrix: views of ``W_kv_b``."""
        per_head = W_kv_b.reshape(self.r, self.H, self.n + self.d_v)  # (r, H, n + d_v)
        W_uk, W_uv = per_head[..., : self.n], per_head[..., self.n :]
        return W_uk.transpose(1, 2, 0), W_uv.transpose(1, 0, 2)


def latent_forward(
    plan: LatentPlan,
    x: np.ndarray,
    given: dict[str, np.ndarray],
    dtype: np.dtype,
    positions: np.ndarray,
    attention: dict[str, Any],
    want_backward: bool,
    threads: int | None,
) -> tuple[np.ndarray, LatentBackward | None]:
    """``x (*B, L, E)`` through the layer with the weights ``given`` (by name, those
    present), computed in ``dtype``: the output ``(*B, L, E)`` in ``dtype`` and, when asked
    for, its backward. ``attention`` holds :func:`scaled_dot_product_attention`'s mask,
    cache and kernel keywords."""
    W = {name: w.astype(dtype, copy=False) for name, w in given.items()}
    X = x.astype(dtype, copy=False)
    H, r, n = plan.H, plan.r, plan.n
    saved: dict[str, Any] = {}
    choice, gate_inputs = None, X
    if "W_q" in W:
        q = X @ W["W_q"]
    else:
        q_a = _linear(X, W["W_q_a"], W.get("b_q_a"))
        q_low, saved["q_normalised"], saved["q_inverse_rms"] = rms_norm(
            q_a, W["q_a_norm"], plan.eps
        )
        q_in = np.concatenate([q_low, q_a], axis=-1) if plan.query_gate else q_low
        saved["q_low"] = q_in  # what W_q_b reads
        if plan.query_gate:  # the gate reads the query's inputs
            gate_inputs = q_in
        q = q_in @ W["W_q_b"]
        if plan.indexer is not None:  # the keys each query attends to: the mask
            choice = choose_keys(plan, plan.indexer, X, q_low, W, positions, attention)
            attention = choice.attention
    q = split_heads(q, H)  # (*B, H, L, n + p)
    kv = _linear(X, W["W_kv_a"], W.get("b_kv_a"))  # (*B, L, r + p)
    c, saved["c_normalised"], saved["c_inverse_rms"] = rms_norm(
        kv[..., :r], W["kv_a_norm"], plan.eps
    )
    W_uk, W_uv = plan.absorbed(W["W_kv_b"])
    q_nope = q[..., :n]
    query = np.concatenate([q_nope @ W_uk, plan.rotate(q[..., n:], positions)], axis=-1)
    k_pe = kv[..., None, :, r:]
    if "k_pe_norm" in W:  # the shared rotary key normalised before its rotation
        k_pe, saved["k_pe_normalised"], saved["k_pe_inverse_rms"] = rms_norm(
            k_pe, W["k_pe_norm"], plan.eps
        )
    key = np.concatenate([c[..., None, :, :], plan.rotate(k_pe, positions)], -1)
    sinks = W.get("sinks")
    if choice is not None and not want_backward and walks_chosen(attention, dtype):
        chosen = attention["mask"][..., 0, :, :]  # over the chosen keys alone: (*B, H, L, r)
        gathered = {**attention, "sinks": sinks}
        latent, attention_backward = (
            attend_chosen(query, key, r, plan.scale, chosen, gathered),
            None,
        )
    else:
        result = scaled_dot_product_attention(  # (*B, H, L, r): one key/value head for all H
            query,
            key,
            key[..., :r],
            scale=plan.scale,
            sinks=sinks,
            return_backward=want_backward,
            **attention,
        )
        latent, attention_backward = result if want_backward else (result, None)
    if choice is not None:
        choice.commit()
    joined = join_heads(latent @ W_uv)  # (*B, L, H*d_v)
    gate = plan.output_gate(W, X.shape[-1])
    if gate is not None:  # the joined heads gated before W_o
        joined, saved["gate"] = gate.forward(joined, gate_inputs)
    out = _linear(joined, W["W_o"], W.get("b_o"))
    if attention_backward is None:
        return out, None
    saved.update(q_nope=q_nope, latent=latent, joined=joined)
    return out, LatentBackward(plan, x, given, W, saved, attention_backward, positions, threads)


class LatentBackward:
    """``backward(grad_out)`` of one :class:`mha.LatentAttention` call: the gradients of
    ``sum(grad_out * out)`` for every weight, by attribute name, and for the input, as
    ``"query"``, each shaped like it, in its dtype. It keeps the input and the weights (the
    caller's arrays: a fingerprint refuses a backward after they changed) and the
    intermediates the chain rule needs; the kernel's backward recomputes the attention."""

    def __init__(
        self,
        plan: LatentPlan,
        x: np.ndarray,
        given: dict[str, np.ndarray],
        W: dict[str, np.ndarray],
        saved: dict[str, Any],
        attention_backward: Any,
        positions: np.ndarray,
        threads: int | None,
    ) -> None:
        self.plan, self.W, self.saved = plan, W, saved
        self.X = x.astype(W["W_o"].dtype, copy=False)
        self.dtypes = {"query": x.dtype, **{name: w.dtype for name, w in given.items()}}
        self.unchanged = Fingerprints({"query": x, **given}, threads)
        self.attention_backward = attention_backward
        self.positions = np.array(positions, dtype=np.float64)  # the caller may reuse theirs

    def __call__(self, grad_out: Any) -> dict[str, np.ndarray]:
        plan, W, saved, X = self.plan, self.W, self.saved, self.X
        H, r, n = plan.H, plan.r, plan.n
        dtype = W["W_o"].dtype
        grad = gradient("grad_out", grad_out, (*X.shape[:-1], W["W_o"].shape[1]), dtype)
        self.unchanged.check()
        grads: dict[str, np.ndarray] = {}
        W_uk, W_uv = plan.absorbed(W["W_kv_b"])

        grads["W_o"] = _rows(saved["joined"]).T @ _rows(grad)
        if "b_o" in W:
            grads["b_o"] = _rows(grad).sum(0)
        d_joined, d_x_gate = grad @ W["W_o"].T, None
        gate = plan.output_gate(W, X.shape[-1])
        if gate is not None:
            d_joined, d_x_gate, gate_grads = gate.backward(d_joined, saved["gate"])
            grads |= gate_grads
        d_heads = split_heads(d_joined, H)  # (*B, H, L, d_v)
        d_W_uv = _per_head(saved["latent"]).transpose(0, 2, 1) @ _per_head(d_heads)  # (H, r, d_v)
        attention = self.attention_backward(d_heads @ W_uv.transpose(0, 2, 1))
        dq, dk = attention["q"], attention["k"]  # (*B, H, L, r + p), (*B, 1, L, r + p)
        dk[..., :r] += attention["v"]  # the values are the keys' first r features
        if "sinks" in W:
            grads["sinks"] = attention["sinks"]
        d_W_uk = _per_head(saved["q_nope"]).transpose(0, 2, 1) @ _per_head(dq[..., :r])
        grads["W_kv_b"] = np.concatenate(  # (H, n, r) and (H, r, d_v) back to (r, H*(n + d_v))
            [d_W_uk.transpose(2, 0, 1), d_W_uv.transpose(1, 0, 2)], axis=-1
        ).reshape(r, H * (n + plan.d_v))
        d_q = join_heads(
            np.concatenate(  # (*B, L, H*(n + p))
                [
                    dq[..., :r] @ W_uk.transpose(0, 2, 1),
                    plan.rotate(dq[..., r:], self.positions, inverse=True),
                ],
                axis=-1,
            )
        )

        d_c, grads["kv_a_norm"] = rms_norm_backward(
            dk[..., 0, :, :r], saved["c_normalised"], saved["c_inverse_rms"], W["kv_a_norm"]
        )
        d_k_pe = plan.rotate(dk[..., r:], self.positions, inverse=True)
        if "k_pe_norm" in W:
            d_k_pe, grads["k_pe_norm"] = rms_norm_backward(
                d_k_pe, saved["k_pe_normalised"], saved["k_pe_inverse_rms"], W["k_pe_norm"]
            )
        d_k_pe = d_k_pe[..., 0, :, :]
        d_kv = np.concatenate([d_c, d_k_pe], axis=-1)  # (*B, L, r + p)
        grads["W_kv_a"] = _rows(X).T @ _rows(d_kv)
        if "b_kv_a" in W:
            grads["b_kv_a"] = _rows(d_kv).sum(0)
        d_x = d_kv @ W["W_kv_a"].T

        if "W_q" in W:
            grads["W_q"] = _rows(X).T @ _rows(d_q)
            d_x += d_q @ W["W_q"].T
        else:
            grads["W_q_b"] = _rows(saved["q_low"]).T @ _rows(d_q)
            d_q_in = d_q @ W["W_q_b"].T
            if plan.query_gate:  # [norm(a), a] fed the query and the gate
                d_q_in += d_x_gate
                q = d_q_in.shape[-1] // 2
                d_q_in, d_q_raw, d_x_gate = d_q_in[..., :q], d_q_in[..., q:], None
            d_q_a, grads["q_a_norm"] = rms_norm_backward(
                d_q_in,
                saved["q_normalised"],
                saved["q_inverse_rms"],
                W["q_a_norm"],
            )
            if plan.query_gate:
                d_q_a += d_q_raw
            grads["W_q_a"] = _rows(X).T @ _rows(d_q_a)
            if "b_q_a" in W:
                grads["b_q_a"] = _rows(d_q_a).sum(0)
            d_x += d_q_a @ W["W_q_a"].T
        grads["query"] = d_x if d_x_gate is None else d_x + d_x_gate
        return {name: cast_result(g, self.dtypes[name]) for name, g in grads.items()}


def _linear(x: np.ndarray, W: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y: np.ndarray = x @ W
    if b is not None:
        y += b
    return y


def _rows(x: np.ndarray) -> np.ndarray:
    """``(..., m)`` as ``(rows, m)`` (no ``-1``: any size may be zero)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _per_head(x: np.ndarray) -> np.ndarray:
    """``(*B, H, L, d)`` as ``(H, rows, d)``, each head's rows together."""
    moved = np.moveaxis(x, -3, 0)
    return moved.reshape(moved.shape[0], math.prod(moved.shape[1:-1]), moved.shape[-1])
