"""``mha.multi_head_attention``: inputs and weights of every shape and dtype, grouped heads,
projection biases, torch's extra keys, rotary positions (with rope scaling), QK-norm and
the mask contract's and variants' keywords, valid and not. The reference projects, norms,
rotates and appends as the docstring says, then attends with :mod:`.dense`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha

from . import dense
from .arrays import chance, data, data_dtypes, drawn_rng, pick, sizes, values
from .functions import BAD_SCALINGS, SCALINGS, rope_factor
from .keywords import Drawn, kernel, masking, scores, spoil
from .known import avoid
from .outcome import Call, MismatchError, expect_array, expect_close, run
from .rules import as_float64, dtype_of, dtypes, tolerance
from .sdpa import combination_refusals

WEIGHTS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")
POSITIONAL = ("alibi", "score_mod", "mask_mod", "chunk", "sink_tokens")
"""Variants that need positions: refused with torch's extra keys."""


def rms(x: np.ndarray, weight: Any, eps: float, offset: float) -> np.ndarray:
    """QK-norm: ``x / sqrt(mean(x²) + eps) * (offset + w)`` over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + as_float64(weight))


def gated(joined: np.ndarray, x: Any, W_g: Any, b_g: Any, activation: str | None) -> np.ndarray:
    """The output gate: ``joined`` times ``act(x @ W_g + b_g)``, one value a feature, or a
    head (``W_g`` narrower than ``joined``) over each of its features."""
    z = as_float64(x) @ as_float64(W_g) + (0.0 if b_g is None else as_float64(b_g))
    gate = np.logaddexp(0, z) if activation == "softplus" else 1 / (1 + np.exp(-z))
    if gate.shape[-1] != joined.shape[-1]:
        gate = np.repeat(gate, joined.shape[-1] // max(gate.shape[-1], 1), axis=-1)
    return joined * gate


def heads(x: np.ndarray, H: int) -> np.ndarray:
    """``(..., L, H*d)`` -> ``(..., H, L, d)``."""
    return np.moveaxis(x.reshape(*x.shape[:-1], H, x.shape[-1] // H), -2, -3)


def projected(arrays: dict[str, Any], H: int, H_kv: int, kw: dict[str, Any],
              q_at: np.ndarray, k_at: np.ndarray) -> tuple[np.ndarray, ...] | None:  # fmt: skip
    """``q`` (scaled), ``k``, ``v`` split into heads, normed and rotated at ``q_at``,
    ``k_at`` as the docstring says; ``None`` for a rope scaling the reference lacks."""
    a = {name: as_float64(x) for name, x in arrays.items() if x is not None}
    q, k, v = ((a[X] @ a[W] + a.get(b, 0.0)) for X, W, b in
               (("Q", "W_q", "b_q"), ("K", "W_k", "b_k"), ("V", "W_v", "b_v")))  # fmt: skip
    d_k = a["W_q"].shape[1] // H
    norm = kw.get("q_norm") is not None
    eps, offset = kw.get("qk_norm_eps") or 1e-6, kw.get("qk_norm_offset") or 0.0
    if norm and kw.get("qk_norm") == "all":
        q, k = rms(q, kw["q_norm"], eps, offset), rms(k, kw["k_norm"], eps, offset)
    q, k, v = heads(q, H), heads(k, H_kv), heads(v, H_kv)
    if norm and kw.get("qk_norm") != "all":
        q, k = rms(q, kw["q_norm"], eps, offset), rms(k, kw["k_norm"], eps, offset)
    scale = kw.get("scale")
    q = q * (1 / math.sqrt(d_k) if scale is None else float(scale))
    if kw.get("rope_theta") is not None:
        factor = rope_factor(kw.get("rope_scaling"), np.concatenate([q_at.ravel(), k_at.ravel()]))
        if factor is None:
            return None
        rotary = (float(kw["rope_theta"]), kw.get("rotary_dim"), bool(kw.get("rotary_interleaved")),
                  factor)  # fmt: skip
        q, k = dense.rotate(q, q_at, *rotary), dense.rotate(k, k_at, *rotary)
    return q, k, v


def layer_reference(arrays: dict[str, Any], H: int, H_kv: int,
                    kw: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, float] | None:  # fmt: skip
    """``(out, weights, magnitude)`` of a call without a cache, or ``None`` where the
    reference does not apply; ``magnitude`` bounds what rounding errors scale with."""
    Q, K = as_float64(arrays["Q"]), as_float64(arrays["K"])
    unbatched = Q.ndim == 2
    if unbatched:
        arrays = {n: (as_float64(x)[None] if n in "QKV" else x) for n, x in arrays.items()}
        Q, K = Q[None], K[None]
    B, L, S = Q.shape[0], Q.shape[1], K.shape[1]
    if kw.get("positions") is not None:
        at = np.asarray(kw["positions"], np.float64)
        at = at[None] if at.ndim == 1 else at
        q_at = k_at = at[:, None, :, None][..., 0]
    else:
        q_at, k_at = np.arange(S - L, S)[None, None], np.arange(S)[None, None]
    parts = projected(arrays, H, H_kv, kw, q_at, k_at)
    if parts is None:
        return None
    q, k, v = parts
    a = {name: as_float64(x) for name, x in arrays.items() if x is not None}
    extra = []  # torch's extra keys: after the projections, seen by every real row
    if "bias_k" in a:
        extra.append((a["bias_k"].reshape(H_kv, 1, -1), a["bias_v"].reshape(H_kv, 1, -1)))
    if kw.get("add_zero_attn"):
        extra.append((np.zeros((1, 1, k.shape[-1])), np.zeros((1, 1, v.shape[-1]))))
    for ek, ev in extra:
        k = np.concatenate([k, np.broadcast_to(ek, (B, H_kv, 1, k.shape[-1]))], axis=-2)
        v = np.concatenate([v, np.broadcast_to(ev, (B, H_kv, 1, v.shape[-1]))], axis=-2)
    from .sdpa import scene_of

    call_kw = {n: x for n, x in kw.items() if n not in ("scale",) and x is not None}
    if unbatched:
        for name in ("key_lengths", "query_lengths"):
            if name in call_kw:
                call_kw[name] = np.reshape(call_kw[name], (1,))
        for name in ("mask", "bias"):
            given = call_kw.get(name)
            if isinstance(given, np.ndarray):
                fitted = dense.fit(given, (H, L, S), False)
                call_kw[name] = None if fitted is None else fitted[None]
    scene = scene_of(q, k[..., :S, :], v[..., :S, :], {**call_kw, "scale": 1.0})
    scene.k, scene.v, scene.free_keys = k, v, len(extra)
    scene.keys = np.concatenate([np.broadcast_to(scene.keys, (B, 1, 1, S)),
                                 np.ones((B, 1, 1, len(extra)), bool)], axis=-1)  # fmt: skip
    scene.k_pos = np.arange(S + len(extra)).reshape(1, 1, 1, -1)
    scene.k_idx = scene.k_pos
    reference = dense.attend(scene)
    joined = np.moveaxis(reference.out, 1, 2).reshape(B, L, H * v.shape[-1])
    if "W_g" in a:
        joined = gated(joined, arrays["Q"], a["W_g"], a.get("b_g"), kw.get("output_gate"))
    out = joined @ a["W_o"] + a.get("b_o", 0.0)
    magnitude = np.abs(joined) @ np.abs(a["W_o"]) + np.abs(a.get("b_o", 0.0))
    bound = float(np.max(magnitude, initial=0.0))
    return (out[0] if unbatched else out), (reference.p[0] if unbatched else reference.p), bound


def layer_refusals(kw: dict[str, Any], d_k: int, L: int, S: int) -> set[str]:
    """What the docstring refuses in combination, beyond :func:`.sdpa.combination_refusals`."""
    names: set[str] = set()
    extra = kw.get("bias_k") is not None or kw.get("add_zero_attn") is True
    positional = [n for n in POSITIONAL if kw.get(n) is not None and kw.get(n) is not False]
    if extra and positional:
        names |= {"bias_k", "add_zero_attn", *positional}
    rope = kw.get("rope_theta") is not None
    for name in ("rotary_dim", "rotary_interleaved", "rope_scaling", "positions"):
        if not rope and kw.get(name) is not None and kw.get(name) is not False:
            names.add(name)
    if rope and kw.get("rotary_dim") is None and d_k % 2:
        names.add("rotary_dim")
    if kw.get("positions") is not None and L != S:
        names.add("positions")
    if rope and (kw.get("rope_scaling") or {}).get("rope_type") == "dynamic" and (
        kw.get("rotary_dim") or d_k) <= 2:  # fmt: skip
        names |= {"rope_scaling", "rotary_dim"}
    if kw.get("q_norm") is None:
        names |= {n for n in ("qk_norm", "qk_norm_eps", "qk_norm_offset") if kw.get(n) is not None}
    if kw.get("W_g") is None:
        names |= {n for n in ("b_g", "output_gate") if kw.get(n) is not None}
    return names


@st.composite
def layer_calls(draw: Any) -> Call:
    """One call of ``multi_head_attention`` (no cache)."""
    rng = drawn_rng(draw, "seed")
    unbatched = draw(chance(0.15), label="unbatched")
    B = () if unbatched else (draw(sizes, label="B"),)
    H_kv = draw(pick([1, 1, 2]), label="H_kv")
    H = H_kv * draw(pick([1, 1, 2, 3]), label="group")
    L, S = draw(sizes, label="L"), draw(sizes, label="S")
    d_k, d_v = draw(pick([1, 2, 4, 3]), label="d_k"), draw(sizes, label="d_v")
    d_q, d_kin, d_vin, d_out = (draw(pick([1, 3, 4, 8, 0]), label=n)
                                for n in ("d_q", "d_kin", "d_vin", "d_out"))  # fmt: skip
    dtype = draw(data_dtypes, label="dtype")
    self_attention = draw(chance(0.3), label="self-attention")
    if self_attention:
        S, d_kin = L, d_q
        d_vin = d_q
    Q = draw(data(rng, (*B, L, d_q), dtype), label="Q")
    K, V = (Q, Q) if self_attention else (
        draw(data(rng, (*B, S, d_kin), dtype), label="K"),
        draw(data(rng, (*B, S, d_vin), dtype), label="V"))  # fmt: skip
    wdtype = dtype if draw(chance(0.8), label="weights in its dtype") else np.dtype(np.float64)
    shapes = {"W_q": (d_q, H * d_k), "W_k": (d_kin, H_kv * d_k), "W_v": (d_vin, H_kv * d_v),
              "W_o": (H * d_v, d_out), "b_q": (H * d_k,), "b_k": (H_kv * d_k,),
              "b_v": (H_kv * d_v,), "b_o": (d_out,), "bias_k": (H_kv * d_k,),
              "bias_v": (H_kv * d_v,)}  # fmt: skip
    W = {n: draw(data(rng, shapes[n], wdtype, spread=0.5), label=n) for n in WEIGHTS[:4]}
    drawn = Drawn(draw(masking(rng, B, H, L, S), label="masking"))
    kw = drawn.kwargs
    if draw(chance(0.4), label="biases"):
        kw |= {n: values(rng, shapes[n], wdtype) for n in ("b_q", "b_k", "b_v", "b_o")}
    if H_kv != H or draw(chance(0.2), label="num_kv_heads given"):
        kw["num_kv_heads"] = H_kv
    if draw(chance(0.1), label="extra keys"):
        if draw(st.booleans(), label="bias_k"):
            kw |= {n: values(rng, shapes[n], wdtype) for n in ("bias_k", "bias_v")}
        if draw(st.booleans(), label="add_zero_attn"):
            kw["add_zero_attn"] = True
    backward = draw(chance(0.25), label="return_backward")
    kw |= draw(scores(rng, H, backward), label="scores")
    if draw(chance(0.25), label="rope"):
        kw["rope_theta"] = draw(pick([10000.0, 1.0, 50]), label="rope_theta")
        if draw(chance(0.3), label="rotary_dim given"):
            kw["rotary_dim"] = draw(pick([r for r in (2, 4) if r <= d_k] or [2]))
            if kw["rotary_dim"] > d_k:
                drawn.refuse.add("rotary_dim")
        if draw(chance(0.3), label="interleaved"):
            kw["rotary_interleaved"] = True
        if draw(chance(0.3), label="rope_scaling") and not (S == 0 < L and avoid(
                "rope scaling without keys")):  # fmt: skip
            kw["rope_scaling"] = draw(pick(SCALINGS[1:]), label="rope_scaling")
            if kw["rope_scaling"]["rope_type"] == "yarn" and kw.get("rope_theta", 2) <= 1:
                drawn.refuse |= {"rope_theta", "rope_scaling"}  # yarn divides by log(theta)
        if L == S and draw(chance(0.3), label="positions"):
            kw["positions"] = rng.integers(0, 40, (*B, L) if B and draw(st.booleans()) else (L,))
    if draw(chance(0.15), label="qk_norm"):
        kind = draw(pick([None, "head", "all"]), label="qk_norm")
        widths = (d_k, d_k) if kind != "all" else (H * d_k, H_kv * d_k)
        kw |= {"q_norm": values(rng, widths[:1], wdtype), "k_norm": values(rng, widths[1:], wdtype)}
        if kind is not None:
            kw["qk_norm"] = kind
        if draw(st.booleans(), label="eps"):
            kw["qk_norm_eps"] = 1e-3
        if draw(st.booleans(), label="offset"):
            kw["qk_norm_offset"] = 1.0
    if draw(chance(0.12), label="output gate"):
        gates = H if draw(st.booleans(), label="a gate per head") else H * d_v
        kw["W_g"] = values(rng, (d_q, gates), wdtype)
        if draw(st.booleans(), label="b_g"):
            kw["b_g"] = values(rng, (gates,), wdtype)
        if draw(st.booleans(), label="output_gate given"):
            kw["output_gate"] = draw(pick(["sigmoid", "softplus"]), label="output_gate")
    if draw(chance(0.2), label="return_weights"):
        kw["return_weights"] = True
    if backward:
        kw["return_backward"] = True
    if draw(chance(0.05), label="dropout"):
        kw |= {"dropout_p": 0.3, "generator": drawn_rng(draw)}
    kw |= draw(kernel(), label="kernel")
    args = [Q, K, V, W["W_q"], W["W_k"], W["W_v"], W["W_o"], H]
    spoilt = draw(pick(["none"] * 24 + ["keyword"] * 2 + ["layer", "shapes"]))
    if spoilt == "keyword":
        draw(spoil(rng, drawn, ["mask", "causal", "key_lengths", "bias", "window", "chunk",
                                "softcap", "alibi", "scale", "workers"], (B, H, L, S)))  # fmt: skip
    elif spoilt == "layer":
        bad_ones = [
            ("num_kv_heads", 0), ("num_kv_heads", H + 1), ("add_zero_attn", 1),
            ("rope_theta", float("nan")), ("rotary_dim", 3), ("qk_norm", "each"),
            ("q_norm", np.ones(d_k + 1)), ("b_q", np.ones(H * d_k + 1)), ("bias_k", np.ones(1)),
            ("positions", np.zeros((L + 1,))), ("qk_norm_offset", float("inf")),
            ("W_g", np.ones((d_q + 1, H))), ("output_gate", "relu"),
        ]  # fmt: skip
        if not avoid("rope_scaling refusal names scaling"):
            bad_ones.append(("rope_scaling", BAD_SCALINGS[1]))
        name, bad = draw(pick(bad_ones), label="bad layer keyword")
        kw[name] = bad
        drawn.refuse |= {
            name,
            *({"rope_theta"} if name in ("rotary_dim", "rope_scaling", "positions") else ()),
            *({"bias_v", "num_heads"} if name in ("bias_k", "num_kv_heads") else ()),
            *({"k_norm"} if name in ("q_norm", "qk_norm") else ()),
        }
        if name in ("q_norm",):
            kw.setdefault("k_norm", np.ones(d_k))
        if name == "qk_norm_offset" and kw.get("q_norm") is None:
            drawn.refuse |= {"qk_norm_offset"}
    elif spoilt == "shapes":
        n = draw(st.integers(0, 7), label="which argument")
        names = ["Q", "K", "V", "W_q", "W_k", "W_v", "W_o", "num_heads"]
        bad = [np.zeros((2, 3, 4, 5)), np.zeros((9, 7)), *([0, 2.0] if n == 7 else [])]
        args[n] = draw(pick(bad), label="bad argument")
        drawn.refuse |= {names[n], "Q", "K", "V", "W_q", "W_k", "W_v", "W_o", "num_heads"}
        drawn.may_refuse = (
            np.shape(args[n]) == np.shape([Q, K, V, *W.values()][n]) if n < 7 else False
        )
    scores_full = (*B, H, L, S)
    drawn.refuse |= combination_refusals(kw, d_k, scores_full, bool(B))
    drawn.refuse |= layer_refusals(kw, d_k, L, S)
    call = Call("multi_head_attention", mha.multi_head_attention, tuple(args), kw,
                frozenset(drawn.refuse) or None, drawn.may_refuse)  # fmt: skip
    call.changes = tuple(x for x in (kw.get("generator"),) if x is not None)
    call.check = lambda result: check_layer(call, result, draw)
    return call


def check_layer(call: Call, result: Any, draw: Any) -> float | None:
    Q, K, V, W_q, W_k, W_v, W_o, H = call.args
    kw = call.kwargs
    arrays = {"Q": Q, "K": K, "V": V, "W_q": W_q, "W_k": W_k, "W_v": W_v, "W_o": W_o}
    arrays |= {n: kw[n] for n in (*WEIGHTS[4:], "W_g", "b_g") if kw.get(n) is not None}
    rdtype, cdtype = dtypes(*arrays.values())
    parts = list(result) if (kw.get("return_weights") or kw.get("return_backward")) else [result]
    out = parts.pop(0)
    lead, L, S = np.shape(Q)[:-1], np.shape(Q)[-2], np.shape(K)[-2]
    expect_array("out", out, (*lead, np.shape(W_o)[1]), rdtype, finite=True)
    extra = (kw.get("bias_k") is not None) + bool(kw.get("add_zero_attn"))
    weights = parts.pop(0) if kw.get("return_weights") else None
    if weights is not None:
        expect_array("weights", weights, (*lead[:-1], H, L, S + extra), rdtype, finite=True)
    backward = parts.pop(0) if kw.get("return_backward") else None
    error = None
    H_kv = kw.get("num_kv_heads") or H
    reference = None if kw.get("dropout_p") else layer_reference(arrays, H, H_kv, kw)
    if reference is not None:
        expected, p, bound = reference
        tol = tolerance(rdtype, cdtype)
        error = expect_close("out", out, expected, tol, max(bound, 1e-3))
        if weights is not None:
            error = max(error, expect_close("weights", weights, p.reshape(weights.shape), tol))
    if backward is not None:
        given = {**arrays, **{n: kw[n] for n in ("bias", "sinks", "q_norm", "k_norm")
                              if kw.get(n) is not None}}  # fmt: skip
        check_gradients("multi_head_attention backward", backward, out, given, draw)
    return error


def check_gradients(entry: str, backward: Any, out: np.ndarray, given: dict[str, Any],
                    draw: Any) -> None:  # fmt: skip
    """``backward(grad_out)`` as a call: one gradient per array given, by name, each of
    its shape and dtype, finite."""
    rng = drawn_rng(draw, "grad_out seed")
    refuse = None
    shape = out.shape
    if draw(chance(0.1), label="bad grad_out"):
        shape, refuse = (*shape, 1), frozenset({"grad_out"})
    grad = rng.standard_normal(shape).astype(out.dtype)

    def check(grads: Any) -> None:
        if not isinstance(grads, dict) or set(grads) != set(given):
            raise MismatchError(f"gradients {sorted(grads)}; the contract gives {sorted(given)}")
        for name, x in given.items():
            expect_array(f"d{name}", grads[name], np.shape(x), dtype_of(x), finite=True)

    run(Call(entry, backward, (grad,), refuse=refuse, check=check))
