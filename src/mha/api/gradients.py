"""The backward objects that ``return_backward=True`` returns: ``backward(grad_out)`` of one
:func:`mha.scaled_dot_product_attention` call (:class:`SplitHeadsBackward`) or one
:func:`mha.multi_head_attention` call (:class:`ProjectedBackward`), and the checksums that
refuse a backward pass after its inputs changed.

Each keeps what its forward pass read (the caller's arrays, never copies), the output and
the log-sum-exp, never the score matrix: the kernel's backward recomputes each tile's
probabilities. Both may be called any number of times, from any thread. Every gradient has
its array's shape and dtype, zero-size ones included.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import as_float_array, cast_result
from .._kernel.backward import attend_backward
from .._kernel.call import Gradients, KernelCall, Outputs
from .._kernel.team import Team, default_workers, workers_for
from ..errors import AttentionValueError, ShapeError
from .checks import Call
from .clip import clip_backward
from .rotary import apply_rotary
from .v_norm import v_norm_backward

__all__ = [
    "Fingerprints",
    "Forward",
    "ProjectedBackward",
    "SplitHeadsBackward",
    "join_heads",
    "split_heads",
]


class SplitHeadsBackward:
    """``backward(grad_out)`` of one :func:`scaled_dot_product_attention` call: the
    gradients of ``sum(grad_out * out)`` for ``q``, ``k``, ``v`` (and ``bias``, ``sinks``
    when given), each shaped like its input, in its dtype. It keeps the kernel's call (q, k,
    v: the caller's arrays, which a fingerprint refuses a backward after they changed), the
    output and the log-sum-exp; ``given`` holds the caller's ``bias`` and ``sinks`` (or
    ``None``), whose gradients take their shapes and dtypes."""

    def __init__(
        self, call: KernelCall, forward: Outputs, given: dict[str, Any], threads: int | None
    ) -> None:
        q, k, v, visibility = call.q, call.k, call.v, call.visibility
        self.call, self.forward, self.threads = call, forward, threads
        self.dtypes = {"q": q.dtype, "k": k.dtype, "v": v.dtype}
        scores = call.scores
        if scores is not None and scores.sinks is not None:
            self.dtypes["sinks"] = as_float_array("sinks", given["sinks"]).dtype
        self.unchanged = Fingerprints(
            {
                "q": q,
                "k": k,
                "v": v,
                "mask": visibility.mask,
                "bias": visibility.bias,
                "the returned output": forward.out,
                "the returned log-sum-exp": forward.lse,
            },
            threads,
        )
        bias = given["bias"]
        self.bias_shape = None if bias is None else np.shape(bias)
        if bias is not None:
            self.dtypes["bias"] = as_float_array("bias", bias).dtype

    def __call__(self, grad_out: Any) -> dict[str, np.ndarray]:
        call, dtype = self.call, self.forward.out.dtype
        q, k, v, visibility = call.q, call.k, call.v, call.visibility
        grad = gradient("grad_out", grad_out, self.forward.out.shape, dtype)
        self.unchanged.check()
        dq, dk, dv = (np.zeros(x.shape, dtype) for x in (q, k, v))
        dbias = None
        if self.bias_shape is not None and visibility.bias is not None:
            dbias = np.zeros(visibility.bias.shape, dtype)  # the bias's own size
        dsinks = None
        if call.scores is not None and call.scores.sinks is not None:
            dsinks = np.zeros(call.scores.sinks.shape, dtype)
        dtable = _table_gradient(call.scores, dtype)
        cost = float(math.prod(q.shape[:-1])) * k.shape[-2] * 2 * (q.shape[-1] + v.shape[-1])
        cost *= visibility.seen_fraction()  # the pairs computed
        with (
            np.errstate(invalid="ignore", over="ignore"),
            Team(workers_for(cost, self.threads)) as team,
        ):
            if q.shape[-3]:  # (no query heads: no gradient)
                into = Gradients(dq, dk, dv, dbias, dsinks, dtable=dtable)
                attend_backward(call, self.forward, grad, into, team)
        grads = {"q": dq, "k": dk, "v": dv}
        if dsinks is not None:
            grads["sinks"] = dsinks
        if dtable is not None:
            grads["relative_bias"] = dtable
        if dbias is not None and self.bias_shape is not None:
            grads["bias"] = _sum_to(dbias, self.bias_shape, q.shape[:-3])
        return {name: cast_result(g, self.dtypes.get(name, dtype)) for name, g in grads.items()}


@dataclass(frozen=True)
class Forward:
    """What a layer's backward keeps of its forward: the kernel's call (the projected
    ``q``, ``k``, ``v`` with the extra keys appended, the visibility of the keys attended,
    the scores' changes, the dropout), the joined heads, the log-sum-exp, the QK-norm's
    ``saved`` rows and, with an output stage, its output and what its backward needs."""

    call: KernelCall
    joined: np.ndarray
    lse: np.ndarray
    saved: dict[str, list[np.ndarray]]
    stage: tuple[np.ndarray, Any] = (np.empty(0), None)


class ProjectedBackward:
    """``backward(grad_out)`` of one :func:`multi_head_attention` call: the gradients of
    ``sum(grad_out * out)`` for every input and weight given, keyed by parameter name and
    shaped like it, in its dtype. It keeps the inputs and weights (the caller's arrays: a
    fingerprint refuses a backward after they changed, as after an optimiser's step), the
    projected ``q``, ``k``, ``v`` (the extra keys appended), the joined heads and the
    log-sum-exp; ``visibility`` covers the keys attended, extra ones included."""

    def __init__(self, call: Call, forward: Forward) -> None:
        given = {"Q": call.Q, "K": call.K, "V": call.V, **call.weights.present()}
        norm = call.qk_norm
        if norm is not None:
            given |= {"q_norm": norm.q_norm, "k_norm": norm.k_norm}
            if norm.q_bias is not None and norm.k_bias is not None:
                given |= {"q_norm_bias": norm.q_bias, "k_norm_bias": norm.k_bias}
        given |= getattr(call.spec.output, "weights", {})  # an output gate's W_g, b_g
        if call.q_scale is not None:
            given["q_scale"] = call.q_scale
        self.saved = forward.saved  # the QK-norm's rows and factors, the clamp's masks
        self.call = call
        self.arrays = given
        self.dtypes = {name: x.dtype for name, x in given.items()}
        given_masks = call.visibility
        self.unchanged = Fingerprints(
            {
                **given,
                "mask": getattr(given_masks, "mask", None),
                "bias": getattr(given_masks, "bias", None),
            },
            call.request.threads,
        )
        bias = call.given.arrays.bias
        self.bias_shape = None if bias is None else np.shape(bias)
        if bias is not None:
            self.dtypes["bias"] = as_float_array("bias", bias).dtype
        self.kernel = forward.call
        self.q, self.k, self.v = forward.call.q, forward.call.k, forward.call.v
        self.joined, self.lse = forward.joined, forward.lse
        self.staged, self.stage_state = forward.stage
        self.visibility = forward.call.visibility
        if call.sinks is not None:
            self.dtypes["sinks"] = call.sinks.dtype
        self.positions = tuple(  # copies: the caller may reuse its positions array
            None if p is None else np.array(p, dtype=np.float64)
            for p in (call.q_positions, call.k_positions)
        )
        lengths: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        if given_masks is not None:
            lengths = (given_masks.query_lengths, given_masks.key_lengths)
        self.lengths = {"Q": lengths[0], "K": lengths[1], "V": lengths[1]}

    def __call__(self, grad_out: Any) -> dict[str, np.ndarray]:
        call, dtype = self.call, self.call.compute_dtype
        lead = self.joined.shape[:-1]
        grad = gradient("grad_out", grad_out, (*lead, call.weights.W_o.shape[1]), dtype)
        self.unchanged.check()
        grads: dict[str, np.ndarray] = {}
        cost = float(self.q.size) * self.k.shape[-2] * 4
        with (
            np.errstate(invalid="ignore", over="ignore"),
            Team(workers_for(cost, call.request.threads)) as team,
        ):
            stage = call.spec.output
            grads["W_o"] = _weight_grad(self.joined if stage is None else self.staged, grad, team)
            if "b_o" in self.arrays:
                grads["b_o"] = _rows(grad).sum(axis=0)
            d_joined = team.matmul(grad, self._in(dtype, "W_o").T)  # BLAS reads it in place
            d_inputs = None
            if stage is not None:  # back through the output stage
                d_joined, d_inputs, stage_grads = stage.backward(d_joined, self.stage_state)
                grads |= stage_grads
            dq, dk, dv = self._heads_backward(d_joined, grads, team)
            self._projections_backward({"Q": dq, "K": dk, "V": dv}, grads, team)
            if d_inputs is not None:  # the output stage read the queries' inputs too
                grads["Q"] += d_inputs
        # (an output stage's weights without a dtype given keep the compute dtype)
        return {name: cast_result(g, self.dtypes.get(name, dtype)) for name, g in grads.items()}

    def _in(self, dtype: np.dtype, name: str) -> np.ndarray:
        """A saved input or weight, in the compute dtype."""
        return self.arrays[name].astype(dtype, copy=False)

    def _heads_backward(
        self, d_joined: np.ndarray, grads: dict[str, np.ndarray], team: Team
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The gradients of the projected heads from that of the joined heads: the kernel's
        backward, then back through the extra keys (bias_k/bias_v's gradients), the rotation,
        the clamp (``clip_qkv``) and the QK-norm; the bias's and the sinks' gradients into
        ``grads``."""
        call, dtype = self.call, self.call.compute_dtype
        H, S = call.H, call.S
        dk, dv = (_zeros_joined(x, dtype) for x in (self.k, self.v))
        # dq is written over d_joined's heads tile by tile: one (B, L, H*d) buffer less
        shared = self.q.shape[-1] == self.joined.shape[-1] // H
        dq = split_heads(d_joined, H) if shared else np.zeros_like(self.q)
        dbias = None
        if self.bias_shape is not None and self.visibility.bias is not None:
            dbias = np.zeros(self.visibility.bias.shape, dtype)  # the bias's own size
        dsinks = None if call.sinks is None else np.zeros(call.sinks.shape, dtype)
        dtable = _table_gradient(self.kernel.scores, dtype)
        into = Gradients(dq, dk, dv, dbias, dsinks, dq_factor=call.scale, dtable=dtable)
        forward = Outputs(split_heads(self.joined, H), lse=self.lse)
        attend_backward(self.kernel, forward, split_heads(d_joined, H), into, team)
        if dsinks is not None:
            grads["sinks"] = dsinks
        if dtable is not None:
            grads["relative_bias"] = dtable
        del d_joined  # memory: each intermediate goes as soon as it is used (dq keeps it)
        if call.extra:  # the appended keys: bias_k/bias_v's gradients, then drop them
            if "bias_k" in self.arrays:  # (*B, H_kv, d) at the first appended key
                for name, d in (("bias_k", dk), ("bias_v", dv)):
                    at = d[..., S, :]
                    grads[name] = at.sum(axis=tuple(range(at.ndim - 2))).reshape(-1)
            dk, dv = dk[..., :S, :], dv[..., :S, :]
        if dbias is not None and self.bias_shape is not None:
            grads["bias"] = _sum_to(dbias[..., :S], self.bias_shape, self.joined.shape[:-2])
        if call.q_scale is not None:  # through each query feature's factor (q_scale)
            (before,) = self.saved["q_scale"]  # the scaled, rotated q it multiplied
            by_feature = (dq * before).reshape(-1, H, dq.shape[-2], dq.shape[-1]).sum(axis=(0, 2))
            grads["q_scale"] = by_feature.reshape(-1) / call.scale  # dq carries the scale
            dq = dq * self._in(dtype, "q_scale").reshape(H, 1, -1)
        after = call.qk_norm is not None and call.qk_norm.after_rope
        if after:  # through HunYuan's norm, after the rotation
            dq = self._norm_backward(dq, "q", H, grads)
            dk = self._norm_backward(dk, "k", call.H_kv, grads)
        if call.rotary is not None:  # through the rotation: its transpose, same angles
            q_at, k_at = (p for p in self.positions if p is not None)
            dq = apply_rotary(dq, q_at, **call.rotary, inverse=True)
            dk = apply_rotary(dk, k_at, **call.rotary, inverse=True)
        if "clip" in self.saved:  # through the clamp of q, k, v (clip_qkv)
            q_in, k_in, v_in = self.saved["clip"]
            dq, dk, dv = clip_backward(dq, q_in), clip_backward(dk, k_in), clip_backward(dv, v_in)
        if "v" in self.saved:  # through the values' norm (v_norm)
            dv = v_norm_backward(dv, *self.saved["v"])
        if call.qk_norm is not None and not after:  # through the norm of q and k
            dq = self._norm_backward(dq, "q", H, grads)
            dk = self._norm_backward(dk, "k", call.H_kv, grads)
        return dq, dk, dv

    def _projections_backward(
        self, pending: dict[str, np.ndarray], grads: dict[str, np.ndarray], team: Team
    ) -> None:
        """The inputs', the projections' and their biases' gradients into ``grads``, from
        the heads' ``pending`` (each dropped as soon as it is used)."""
        dtype = self.call.compute_dtype
        for x, W, b in (("Q", "W_q", "b_q"), ("K", "W_k", "b_k"), ("V", "W_v", "b_v")):
            joined_grad = join_heads(pending.pop(x))
            grads[W] = _weight_grad(
                _valid_rows(self._in(dtype, x), self.lengths[x]), joined_grad, team
            )
            if b in self.arrays:
                grads[b] = _rows(joined_grad).sum(axis=0)
            # the input's gradient takes the buffer of its projection's: 32 MiB less at
            # L = 16384, d_model = 512 in float32 (nothing else reads it any more)
            grads[x] = team.matmul(joined_grad, self._in(dtype, W).T, overwrite=True)
            del joined_grad

    def _norm_backward(
        self, d: np.ndarray, which: str, heads: int, grads: dict[str, np.ndarray]
    ) -> np.ndarray:
        """The gradient ``(*B, heads, L, d_k)`` before the QK-norm of ``which`` ("q" or
        "k"); those of its weight (and bias) into ``grads``."""
        norm = self.call.qk_norm
        assert norm is not None
        normed, r = self.saved[which]
        if norm.kind != "all":
            dx, found = norm.backward(d, normed, r, which)
        else:  # a token's every head
            dx, found = norm.backward(join_heads(d), normed, r, which)
            dx = split_heads(dx, heads)
        grads |= found
        return dx


class Fingerprints:
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


def gradient(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
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


def split_heads(x: np.ndarray, H: int) -> np.ndarray:
    """``(*B, L, H*d)`` to ``(*B, H, L, d)``, a view."""
    heads = x.reshape((*x.shape[:-1], H, x.shape[-1] // H))
    return heads.swapaxes(-3, -2)  # (np.moveaxis's: adjacent axes, without its checks)


def join_heads(x: np.ndarray) -> np.ndarray:
    """``(*B, H, L, d)`` to ``(*B, L, H*d)`` (no ``-1`` in the shape: any size may be 0)."""
    joined = x.swapaxes(-3, -2)  # (np.moveaxis's: adjacent axes, without its checks)
    return joined.reshape((*x.shape[:-3], x.shape[-2], x.shape[-3] * x.shape[-1]))


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
    return split_heads(np.zeros((*B, L, H * d), dtype), H)


def _rows(x: np.ndarray) -> np.ndarray:
    """``(..., n)`` as ``(rows, n)``."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _weight_grad(x: np.ndarray, grad: np.ndarray, team: Team) -> np.ndarray:
    """``d(x @ W)/dW`` for ``x (..., m)`` and ``grad (..., n)``: ``x^T @ grad`` over rows."""
    return team.matmul(_rows(x).T, _rows(grad))


def _table_gradient(scores: Any, dtype: np.dtype) -> np.ndarray | None:
    """A zeroed gradient for the table of the call's relative-position bias, if it has one."""
    relative = None if scores is None else scores.relative
    return None if relative is None else np.zeros(relative.table.shape, dtype)
