"""``mha.MultiHeadAttention``: a layer made with drawn options (valid or not), its weights
set to random values in place (``parameters()`` says they may be), then a few ``forward``
calls, self- or cross-attention, with the call's keywords, and at times a cache from
``new_cache`` that the calls append to. The reference is the function's
(:func:`.layers.layer_reference`) with the layer's weights and settings, as the class
docstring says the layer computes: the function's path, same inputs."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha

from . import dense
from .arrays import chance, data, drawn_rng, pick, sizes
from .cached import cached_scene
from .functions import SCALINGS
from .keywords import NOT_FLAGS, NOT_POSITIVE, NOT_REAL, Drawn, kernel, masking
from .known import avoid
from .layers import check_gradients, gated, layer_reference, layer_refusals, projected
from .outcome import Call, MismatchError, expect_array, expect_close, run
from .rules import BFLOAT16, compute_dtype, result_dtype
from .rules import tolerance as tolerance_of
from .sdpa import combination_refusals

OPTIONS = {  # constructor keyword: (valid values, refused values)
    "bias": ([True, False], NOT_FLAGS[:-1]),
    "add_bias_kv": ([True], NOT_FLAGS[:-1]),
    "add_zero_attn": ([True], NOT_FLAGS[:-1]),
    "rope_theta": ([10000.0, 50.0], NOT_REAL),
    "window": ([1, 2, 4], NOT_POSITIVE),
    "sinks": ([True], NOT_FLAGS[:-1]),
    "softcap": ([1.5, 30.0], NOT_REAL),
    "alibi": ([True, False], ["yes", np.ones(99)]),
    "chunk": ([1, 3], NOT_POSITIVE),
    "scale": ([0.3, 1], NOT_REAL),
    "qk_norm": (["head", "all"], ["each", 1]),
    "output_gate": (["sigmoid", "softplus"], ["relu", 1]),
    "dtype": ([np.float64, np.float32, np.float16, *([BFLOAT16] if BFLOAT16 is not None else [])],
              [np.int64, bool, "half-float", np.complex128]),
    "seed": ([0, 7, "a generator"], ["x", -1, 1.5]),
}  # fmt: skip


@st.composite
def made(draw: Any) -> Any:
    """A layer (or ``None`` when the constructor refused the options drawn)."""
    H_kv = draw(pick([1, 1, 2]), label="num_kv_heads")
    H = H_kv * draw(pick([1, 2]), label="group")
    head_dim = draw(pick([2, 4]), label="head_dim")
    d_model = H * head_dim if draw(chance(0.7), label="d_model = H * head_dim") else draw(
        pick([3, 6, 8]), label="d_model")  # fmt: skip
    kwargs: dict[str, Any] = {}
    refuse: set[str] = set()
    if H_kv != H or draw(chance(0.2), label="num_kv_heads given"):
        kwargs["num_kv_heads"] = H_kv
    if d_model != H * head_dim or draw(chance(0.2), label="head_dim given"):
        kwargs["head_dim"] = head_dim
    for name in ("kdim", "vdim"):
        if draw(chance(0.15), label=f"{name} given"):
            kwargs[name] = draw(pick([1, 5]), label=name)
    for name, (valid, _) in OPTIONS.items():
        if draw(chance(0.15), label=f"{name} given"):
            kwargs[name] = draw(pick(valid), label=name)
    if "window" in kwargs and draw(chance(0.3), label="sink_tokens"):
        kwargs["sink_tokens"] = draw(st.integers(0, 2), label="sink_tokens")
    if "rope_theta" in kwargs:
        if draw(chance(0.3), label="rotary_dim"):
            kwargs["rotary_dim"] = 2
        if draw(chance(0.2), label="rotary_interleaved"):
            kwargs["rotary_interleaved"] = True
        if draw(chance(0.2), label="rope_scaling"):
            kwargs["rope_scaling"] = draw(pick(SCALINGS[1:]), label="rope_scaling")
            if kwargs["rope_scaling"]["rope_type"] == "dynamic" and kwargs.get(
                "rotary_dim", head_dim) <= 2:  # fmt: skip
                refuse |= {"rope_scaling", "rotary_dim"}
            if kwargs["rope_scaling"]["rope_type"] == "yarn" and kwargs.get("rope_theta", 2) <= 1:
                refuse |= {"rope_theta", "rope_scaling"}  # yarn divides by log(theta)
    if "qk_norm" in kwargs:
        for name, value in (("qk_norm_eps", 1e-3), ("qk_norm_offset", 1.0)):
            if draw(chance(0.3), label=name):
                kwargs[name] = value
    if kwargs.get("seed") == "a generator":
        kwargs["seed"] = np.random.default_rng(1)  # drawn from: the call may change it
    positional = [n for n in ("alibi", "chunk", "sink_tokens") if kwargs.get(n)]
    if (
        (kwargs.get("add_bias_kv") or kwargs.get("add_zero_attn"))
        and positional
        and not draw(chance(0.1), label="keep extra keys with positions")
    ):  # forward refuses them together
        for name in ("add_bias_kv", "add_zero_attn"):
            kwargs.pop(name, None)
    if draw(chance(0.1), label="spoil"):
        name = draw(pick(sorted(OPTIONS)), label="refused option")
        kwargs[name] = draw(pick(OPTIONS[name][1]), label=f"bad {name}")
        refuse.add(name)
    if isinstance(kwargs.get("seed"), np.random.Generator) and refuse & {"add_bias_kv", "sinks"} \
            and avoid("layer refused after drawing its weights"):  # fmt: skip
        kwargs["seed"] = 1
    args: list[Any] = [d_model, H]
    if draw(chance(0.05), label="bad size"):
        n = draw(st.integers(0, 1), label="which")
        args[n] = draw(pick(NOT_POSITIVE), label="bad size")
        refuse.add(["d_model", "num_heads"][n])
    if "head_dim" not in kwargs and d_model % H:
        refuse |= {"d_model", "num_heads", "head_dim"}
    outcome = run(Call("MultiHeadAttention", mha.MultiHeadAttention, tuple(args), kwargs,
                       frozenset(refuse) or None, changes=(kwargs.get("seed"),)))  # fmt: skip
    if outcome.kind != "result":
        return None
    layer = outcome.value
    rng = drawn_rng(draw, "weights seed")
    for W in layer.parameters().values():  # random weights, in place
        W[...] = (rng.standard_normal(W.shape) * 0.5).astype(W.dtype)
    return layer


def settings_of(layer: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """The function's keywords that the layer and a call's keywords ``kw`` make."""
    window = kw.get("window")
    if layer.window is not None:
        window = layer.window if window is None else min(window, layer.window)
    given = {**kw, "window": window, "num_kv_heads": layer.num_kv_heads,
             "add_zero_attn": layer.add_zero_attn, "sinks": layer.sinks,
             "sink_tokens": layer.sink_tokens, "softcap": layer.softcap, "alibi": layer.alibi,
             "chunk": layer.chunk, "rope_theta": layer.rope_theta,
             "rotary_dim": layer.rotary_dim, "rotary_interleaved": layer.rotary_interleaved,
             "rope_scaling": layer.rope_scaling, "q_norm": layer.q_norm, "k_norm": layer.k_norm,
             "qk_norm": layer.qk_norm, "scale": kw.get("scale", layer.scale),
             "output_gate": layer.output_gate, "W_g": layer.W_g, "b_g": layer.b_g}  # fmt: skip
    if layer.qk_norm is not None:
        given |= {"qk_norm_eps": layer.qk_norm_eps, "qk_norm_offset": layer.qk_norm_offset}
    return {name: x for name, x in given.items() if x is not None}


def fuzz_module(data: Any) -> None:
    """A layer, then up to 4 calls of ``forward``, with a cache at times."""
    layer = data.draw(made(), label="layer")
    if layer is None:
        return
    cache = None
    itself = (
        layer.kdim == layer.vdim == layer.d_model
        and layer.bias_k is None
        and not (layer.add_zero_attn)
    )  # a cache's calls attend over the query, no extra keys
    if data.draw(chance(0.25), label="cache") and (itself or data.draw(chance(0.1))):
        B = data.draw(st.integers(1, 2), label="batch_size")
        capacity = data.draw(pick([1, 16]), label="capacity")
        cache = run(Call("MultiHeadAttention.new_cache", layer.new_cache, (B,),
                         {"capacity": capacity})).value  # fmt: skip
        d_v = layer.W_v.shape[1] // layer.num_kv_heads
        empty = [np.zeros((layer.num_kv_heads, 0, d)) for d in (layer.head_dim, d_v)]
        HISTORY[id(cache)] = [(empty[0], empty[1]) for _ in range(B)]
    try:
        for _ in range(data.draw(st.integers(1, 4), label="calls")):
            run(data.draw(forward_call(layer, cache), label="forward"))
    finally:
        HISTORY.pop(id(cache), None)


@st.composite
def forward_call(draw: Any, layer: Any, cache: Any) -> Call:
    rng = drawn_rng(draw, "seed")
    H, E = layer.num_heads, layer.d_model
    cross = cache is None and (layer.kdim != E or layer.vdim != E or draw(chance(0.3)))
    unbatched = cache is None and draw(chance(0.15), label="unbatched")
    B = () if unbatched else ((cache.batch_size,) if cache is not None else (draw(sizes),))
    L = draw(sizes, label="L")
    S = draw(sizes, label="S") if cross else L
    if S == 0 < L and layer.rope_scaling is not None and avoid("rope scaling without keys"):
        S = 1
    dtype = layer.dtype if draw(chance(0.7), label="in the layer's dtype") else np.dtype(
        np.float64)  # fmt: skip
    if cache is not None:
        dtype = np.dtype(np.float32) if compute_dtype(layer.dtype) == np.float32 else layer.dtype
    query = draw(data(rng, (*B, L, E), dtype), label="query")
    named: dict[str, Any] = {}
    if cross:
        named["key"] = draw(data(rng, (*B, S, layer.kdim), dtype), label="key")
        if layer.vdim != layer.kdim or draw(chance(0.5), label="value given"):
            named["value"] = draw(data(rng, (*B, S, layer.vdim), dtype), label="value")
    drawn = Drawn(draw(masking(rng, B, H, L, S, cached=cache is not None), label="masking"))
    kw = drawn.kwargs
    for name in ("sink_tokens", "chunk"):  # the layer's, not forward's
        kw.pop(name, None)
    args: list[Any] = [query]
    if "mask" in kw and draw(chance(0.5), label="mask by position"):
        args.append(kw.pop("mask"))
    if cache is not None:
        kw["cache"] = cache
        for name in ("mask", "bias"):
            if isinstance(kw.get(name), np.ndarray):
                del kw[name]
        if len(args) > 1 and isinstance(args[1], np.ndarray):
            args.pop()
        if layer.window is not None and kw.get("window", 0) > layer.window:
            del kw["window"]
        if kw.get("mask") is False or (len(args) > 1 and args[1] is False):
            kw.pop("mask", None)
            del args[1:]
        if kw.get("causal") is False and (layer.window is not None or "window" in kw):
            drawn.refuse.add("window")  # every key seen: a window has no place
    backward = cache is None and draw(chance(0.2), label="return_backward")
    if backward:
        kw["return_backward"] = True
    if cache is None and draw(chance(0.2), label="return_weights"):
        kw["return_weights"] = True
    if draw(chance(0.2), label="scale"):
        kw["scale"] = 0.7
    if layer.rope_theta is not None and cache is None and L == S and draw(chance(0.3)):
        kw["positions"] = rng.integers(0, 30, (L,))
    kw |= draw(kernel(), label="kernel")
    spoil = draw(pick(["none"] * 27 + ["mask", "arguments", "query"]), label="spoil")
    if spoil == "mask":
        kw.pop("mask", None)
        args[1:] = [draw(pick([np.ones((L, S)), 1, [[0.5]]]), label="bad mask")]
        drawn.refuse.add("mask")
    elif spoil == "arguments":
        if draw(st.booleans(), label="three positional"):
            args[1:] = [kw.pop("mask", None), query]
            drawn.refuse |= {"query", "mask", "key", "value"}
        else:
            named = {"value": query}
            drawn.refuse |= {"value", "key"}
    elif spoil == "query":
        args[0] = np.zeros((*B, L, E + 1)) if draw(st.booleans()) else np.zeros(E)
        drawn.refuse.add("query")
    settings = settings_of(layer, {**kw, "mask": args[1] if len(args) > 1 else kw.get("mask")})
    if cache is not None and (layer.bias_k is not None or layer.add_zero_attn):
        drawn.refuse |= {"cache", "bias_k", "add_zero_attn"}
    if not cross and (layer.kdim != E or layer.vdim != E):  # a cache's call attends itself
        drawn.refuse |= {"key", "value", "kdim", "vdim"}
    scores_full = (*B, H, L, S)
    drawn.refuse |= combination_refusals({n: x for n, x in settings.items() if n != "cache"},
                                         layer.head_dim, scores_full, bool(B))  # fmt: skip
    extra = {"bias_k": layer.bias_k} if layer.bias_k is not None else {}
    drawn.refuse |= layer_refusals({**settings, **extra}, layer.head_dim, L, S)
    call = Call("MultiHeadAttention.forward", layer.forward, tuple(args), {**named, **kw},
                frozenset(drawn.refuse) or None)  # fmt: skip
    call.changes = (cache,) if cache is not None else ()
    before = None if cache is None else cache.lengths.copy()
    call.check = lambda result: check_forward(layer, call, settings, result, draw, before)
    return call


def check_forward(layer: Any, call: Call, settings: dict[str, Any], result: Any, draw: Any,
                  before: np.ndarray | None) -> float | None:  # fmt: skip
    query, kw = call.args[0], call.kwargs
    key = kw.get("key", query)
    value = kw.get("value", key)
    weights = {n: W for n, W in layer.weights().items() if W is not None and n not in (
        "sinks", "q_norm", "k_norm")}  # fmt: skip
    arrays = {"Q": query, "K": key, "V": value, **weights}
    rdtype = result_dtype(*arrays.values())
    parts = list(result) if (kw.get("return_weights") or kw.get("return_backward")) else [result]
    out = parts.pop(0)
    expect_array("out", out, (*np.shape(query)[:-1], layer.d_model), rdtype, finite=True)
    if kw.get("return_weights"):
        parts.pop(0)
    tol = tolerance_of(rdtype, compute_dtype(rdtype))
    if before is not None:
        if id(kw["cache"]) not in HISTORY:
            return None
        stored = kw["cache"].dtype  # keys and values rounded to it as they are held
        tol += 4 * tolerance_of(stored) if stored != compute_dtype(stored) else 0.0
        return check_cached_forward(layer, call, settings, out, before, tol)
    kept = {n: x for n, x in settings.items() if n not in WEIGHTS_KW}
    reference = layer_reference(arrays, layer.num_heads, layer.num_kv_heads, kept)
    error = None
    if reference is not None:
        error = expect_close("out", out, reference[0], tol, max(reference[2], 1e-3))
    if kw.get("return_backward"):
        given = {"query": query, "key": key if "key" in kw else query,
                 "value": value if "value" in kw or "key" in kw else query,
                 **layer.parameters()}  # fmt: skip
        if kw.get("bias") is not None:
            given["bias"] = kw["bias"]
        check_gradients("MultiHeadAttention backward", parts[-1], out, given, draw)
    return error


WEIGHTS_KW = ("b_q", "b_k", "b_v", "b_o")


def check_cached_forward(layer: Any, call: Call, settings: dict[str, Any], out: np.ndarray,
                         before: np.ndarray, tol: float) -> float | None:  # fmt: skip
    """A cached call: each sequence's real rows projected and rotated at its positions
    ``before[b] + i``, their keys and values appended to the history kept beside the cache
    (``held``), the queries attending over it; then the lengths advanced."""
    cache, kw = call.kwargs["cache"], call.kwargs
    held = HISTORY[id(cache)]
    Q = np.asarray(call.args[0], np.float64)
    B, L = Q.shape[:2]
    counts = np.full(B, L) if kw.get("query_lengths") is None else np.asarray(
        kw["query_lengths"]).reshape(B)  # fmt: skip
    left = kw.get("padding_side") == "left"
    if left:  # each sequence's real rows first, as the layer moves them
        Q = np.stack([np.roll(Q[b], -(L - c), axis=0) for b, c in enumerate(counts)])
    arrays = {"Q": Q, "K": Q, "V": Q, **{n: W for n, W in layer.weights().items()
                                          if W is not None and n in WEIGHT_NAMES}}  # fmt: skip
    at = (before[:, None] + np.arange(L))[:, None, :]  # (B, 1, L)
    parts = projected(arrays, layer.num_heads, layer.num_kv_heads, settings, at, at)
    if cache.lengths.tolist() != (before + counts).tolist():
        raise MismatchError(f"lengths {cache.lengths}; the calls appended {before + counts}")
    if parts is None:
        HISTORY.pop(id(cache))  # the reference cannot follow this cache any more
        return None
    q, k, v = parts
    for b, c in enumerate(counts):
        held[b] = (np.concatenate([held[b][0], k[b][:, :c]], axis=1),
                   np.concatenate([held[b][1], v[b][:, :c]], axis=1))  # fmt: skip
    view = types.SimpleNamespace(H_kv=layer.num_kv_heads, d_v=v.shape[-1], window=layer.window,
                                 sink_tokens=layer.sink_tokens or 0)  # fmt: skip
    scene = cached_scene(view, q, held, before, counts, False, {**settings, "scale": 1.0})
    reference = dense.attend(scene)
    joined = np.moveaxis(reference.out, 1, 2).reshape(B, L, layer.num_heads * v.shape[-1])
    if left:
        joined = np.stack([np.roll(joined[b], L - c, axis=0) for b, c in enumerate(counts)])
    if layer.W_g is not None:  # the gate of each row's own input
        joined = gated(joined, call.args[0], layer.W_g, layer.b_g, layer.output_gate)
    W_o = np.asarray(layer.W_o, np.float64)
    b_o = 0.0 if layer.b_o is None else np.asarray(layer.b_o, np.float64)
    bound = float(np.max(np.abs(joined) @ np.abs(W_o) + np.abs(b_o), initial=0.0))
    return expect_close("out", out, joined @ W_o + b_o, tol, max(bound, 1e-3))


WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")
HISTORY: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
"""Per cache (by id, while its session runs): each sequence's projected keys and values."""
