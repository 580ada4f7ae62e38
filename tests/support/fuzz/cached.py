"""``scaled_dot_product_attention(..., cache=)``: the new tokens appended to a cache and
attending over everything it holds (README's "Decoding", docs/serving.md), drawn with the
keywords a cached call takes and the ones it refuses. The reference attends over the
model's history with the new tokens after it, each sequence at its own positions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha
from support.reference import paper_slopes

from . import dense
from .arrays import chance, data, drawn_rng, pick, sizes
from .keywords import Drawn, failing_callback, kernel, masking, scores, scores_array, spoil
from .known import avoid
from .outcome import Call, MismatchError, UserCallbackError, expect_array, expect_close
from .rules import STORAGE, as_float64, dtypes, tolerance
from .sdpa import called

SPOILABLE = ["causal", "query_lengths", "window", "sink_tokens", "chunk", "mask_mod", "sinks",
             "softcap", "alibi", "score_mod", "scale", "max_memory", "workers"]  # fmt: skip
REFUSED_WITH_A_CACHE = {
    "return_weights": True, "return_backward": True, "dropout_p": 0.5,
    "key_lengths": 0, "causal_alignment": "top_left", "padding_side": "middle",
}  # fmt: skip


def inputs_for(cache: Any, draw: Any) -> np.dtype:
    """A data dtype the call computes in the cache's compute dtype."""
    if cache.compute_dtype == np.float64:
        return np.dtype(draw(pick([np.float64] * 4 + [np.int64]), label="dtype"))
    options = [np.float32] * 3 + STORAGE  # float16, and bfloat16 when installed
    return np.dtype(draw(pick(options), label="dtype"))


@st.composite
def attend_call(draw: Any, session: Any) -> Call:
    """One attention call appending to ``session``'s cache; its check compares the result
    with the reference, then advances the model and compares the cache with it."""
    cache = session.cache
    rng = drawn_rng(draw, "seed")
    B = len(session.model)
    H = session.H_kv * draw(pick([1, 1, 2]), label="group")
    L = draw(sizes, label="L")
    dtype = inputs_for(cache, draw)
    drawn = Drawn()
    if draw(chance(0.05), label="other dtype"):
        dtype = np.dtype(np.float32 if cache.compute_dtype == np.float64 else np.float64)
        drawn.refuse |= {"cache", "dtype"}
    q = draw(data(rng, (B, H, L, session.d_k), dtype), label="q")
    k = draw(data(rng, (B, session.H_kv, L, session.d_k), dtype, spread=2.0), label="k")
    v = draw(data(rng, (B, session.H_kv, L, session.d_v), dtype), label="v")
    if session.values_in_keys:
        v = np.asarray(k)[..., : session.d_v]
    before = np.array([h.keys.shape[1] for h in session.model.values()], np.int64)
    kw = draw(masking(rng, (B,), H, L, int((before + L).max(initial=0)), cached=True))
    drawn.kwargs = kw
    if (
        session.window is not None
        and kw.get("mask") is False
        and avoid("mask=False with a window cache")
    ):
        del kw["mask"]
    if session.window is not None and "window" in kw and kw["window"] > session.window:
        drawn.refuse.add("window")
    if bidirectional(kw) and (session.window is not None or "window" in kw):
        drawn.refuse.add("window")  # every key seen: a window has no place
    if (
        session.window is not None
        and kw.get("sink_tokens") not in (None, session.sink_tokens)
        and (kw["sink_tokens"] or session.sink_tokens)
    ):
        drawn.refuse.add("sink_tokens")
    if kw.get("sink_tokens") and kw.get("window") is None and session.window is None:
        drawn.refuse.add("sink_tokens")
    by_position = [n for n in ("mask", "bias") if isinstance(kw.get(n), np.ndarray)]
    if by_position and (session.window is not None or draw(chance(0.5), label="keep arrays")) \
            and not draw(chance(0.1), label="keep them anyway"):  # fmt: skip
        for name in by_position:  # mostly: calls that compute
            del kw[name]
        by_position = []
        drawn.refuse -= {"mask", "bias"}
    if draw(chance(0.2), label="padding_side") and (not by_position or draw(chance(0.1))):
        kw["padding_side"] = draw(pick(["left", "right"]), label="padding_side")
        if kw["padding_side"] == "left" and by_position:
            drawn.refuse.add("padding_side")
    kw |= draw(scores(rng, H, False), label="scores")
    kw |= draw(kernel(), label="kernel")
    if draw(chance(0.3), label="return_lse"):
        kw["return_lse"] = True
    if by_position and session.window is not None:
        drawn.refuse |= set(by_position)
    counts = np.full(B, L) if kw.get("query_lengths") is None else np.asarray(
        kw["query_lengths"]).reshape(B)  # fmt: skip
    S = int((before + counts).max(initial=0))  # positions after the append
    for name in by_position:  # over them: (B, H, L, S)
        kw[name] = scores_array(draw, rng, (B,), H, L, S, bool if name == "mask" else float)
        if dense.fit(np.asarray(kw[name]), (B, H, L, S), True) is None:
            drawn.refuse.add(name)
    spoilt = draw(pick(["none"] * 24 + ["keyword", "with a cache", "callback",
                                                  "shapes"]), label="spoil")  # fmt: skip
    if spoilt == "keyword":
        draw(spoil(rng, drawn, SPOILABLE, ((B,), H, L, S)))
    elif spoilt == "with a cache":
        name = draw(pick(sorted(REFUSED_WITH_A_CACHE)), label="refused with a cache")
        kw[name] = REFUSED_WITH_A_CACHE[name]
        drawn.refuse |= {name, "cache", "dropout"}
        if name == "dropout_p":
            kw["generator"] = np.random.default_rng(0)
    elif spoilt == "callback":
        draw(failing_callback(drawn))
    elif spoilt == "shapes":
        which = draw(pick(["batch", "heads", "width", "keys", "rank"]), label="bad")
        shape = {"batch": (B + 1, session.H_kv), "heads": (B, session.H_kv + 1)}.get(which)
        if shape is not None:
            q = np.zeros((shape[0], H, L, session.d_k))
            k, v = (np.zeros((*shape, L, d)) for d in (session.d_k, session.d_v))
        elif which == "width":
            q, k = (
                np.zeros((B, H, L, session.d_k + 1)),
                np.zeros((B, session.H_kv, L, session.d_k + 1)),
            )
        elif which == "keys":
            k, v = (np.zeros((B, session.H_kv, L + 1, d)) for d in (session.d_k, session.d_v))
        else:
            k, v = (np.zeros((session.H_kv, L, d)) for d in (session.d_k, session.d_v))
        drawn.refuse |= {"cache", "q", "k", "v"}
    window = kw.get("window")  # a spoilt keyword may have brought one
    if session.window is not None and isinstance(window, int) and window > session.window:
        drawn.refuse.add("window")
    if session.values_in_keys and draw(chance(0.1), label="values apart") and L and B:
        v = np.asarray(v) + 1.0
        drawn.refuse |= {"values_in_keys", "v"}
    if session.paged and not drawn.refuse:
        size = session.block_size
        worst = sum(
            -(-(n + c) // size) - n // size + 1 for n, c in zip(before, counts, strict=True) if c
        )
        if worst > cache.num_free_blocks:  # the pool may run out (PoolExhaustedError)
            drawn.refuse.add("num_blocks")
            drawn.may_refuse = True
    call = Call("scaled_dot_product_attention (cache)", mha.scaled_dot_product_attention,
                (q, k, v), {**kw, "cache": cache}, frozenset(drawn.refuse) or None,
                drawn.may_refuse, changes=(cache,))  # fmt: skip
    call.refusals = (mha.AttentionError, UserCallbackError)
    call.check = lambda result: check_cached(session, call, result, drawn.lazy, before)
    return call


def check_cached(session: Any, call: Call, result: Any, lazy: str | None,
                 before: np.ndarray) -> float:  # fmt: skip
    """The output (and lse) against the reference; then the model advanced and compared."""
    q, k, v = call.args
    kw = {name: x for name, x in call.kwargs.items() if name != "cache"}
    if lazy is not None:  # a result: the callback must not have been needed
        kw[lazy] = None
    B, H, L, _ = np.shape(q)
    rdtype, cdtype = dtypes(q, k, v)
    out, lse = result if kw.get("return_lse") else (result, None)
    expect_array("out", out, (B, H, L, session.d_v), rdtype, finite=True)
    counts = np.full(B, L) if kw.get("query_lengths") is None else np.asarray(
        kw["query_lengths"]).reshape(B)  # fmt: skip
    left = kw.get("padding_side") == "left"
    kept = [np.arange(L - c, L) if left else np.arange(c) for c in counts]  # real rows
    for b, history in enumerate(session.model.values()):  # the model advances
        history.append(np.asarray(k)[b][:, kept[b]], np.asarray(v)[b][:, kept[b]])
    if session.quantize is None:
        held = [(h.keys, h.values) for h in session.model.values()]
    else:
        held = [session.cache.dequantized(s) for s in session.model]
    scene = cached_scene(session, q, held, before, counts, left, kw)
    if lazy is not None and called(lazy, scene):
        raise MismatchError(f"returned a result with the {lazy} that it must call refused")
    reference = dense.attend(scene)
    expected, expected_lse = reference.out, reference.lse
    if left:  # back to each sequence's last rows
        expected = np.stack([np.roll(expected[b], L - c, axis=-2) for b, c in enumerate(counts)]) \
            if B else expected  # fmt: skip
        expected_lse = np.stack([np.roll(expected_lse[b], L - c, axis=-1)
                                 for b, c in enumerate(counts)]) if B else expected_lse  # fmt: skip
    error = expect_close("out", out, expected, tolerance(rdtype, cdtype))
    if lse is not None:
        expect_array("lse", lse, (B, H, L), cdtype, finite=False)
        error = max(error, expect_close("lse", lse, expected_lse, tolerance(cdtype, cdtype)))
    session.check()
    return error


def bidirectional(kw: dict[str, Any]) -> bool:
    """``causal=False`` or ``mask=False`` (and neither ``True``): a cached call's new tokens
    see every key of their sequence, the new ones after them too."""
    flags = [kw[name] for name in ("causal", "mask") if isinstance(kw.get(name), (bool, np.bool_))]
    return bool(flags) and not any(flags)


def cached_scene(session: Any, q: Any, held: list[tuple[np.ndarray, np.ndarray]],
                 before: np.ndarray, counts: np.ndarray, left: bool,
                 kw: dict[str, Any]) -> dense.Scene:  # fmt: skip
    """Each sequence's new queries at its positions ``before[b] + i`` over its keys at
    ``0..`` (causal unless :func:`bidirectional`, within the call's window or the cache's)."""
    qa = as_float64(q)
    B, H, L, d_k = qa.shape
    if left:  # each sequence's real rows first
        qa = np.stack([np.roll(qa[b], -(L - c), axis=-2) for b, c in enumerate(counts)]) if (
            B) else qa  # fmt: skip
    after = before + counts
    S = int(after.max(initial=0))
    keys = np.zeros((B, session.H_kv, S, d_k))
    vals = np.zeros((B, session.H_kv, S, session.d_v))
    for b, (hk, hv) in enumerate(held):
        keys[b, :, : after[b]], vals[b, :, : after[b]] = hk, hv
    i, j = np.arange(L).reshape(1, 1, L, 1), np.arange(S).reshape(1, 1, 1, S)
    at = before.reshape(B, 1, 1, 1) + i
    window = kw.get("window", session.window)
    sinks = kw.get("sink_tokens")
    if sinks is None:
        sinks = session.sink_tokens if session.window is not None else 0

    def over_positions(name: str) -> np.ndarray | None:
        given = kw.get(name)
        if not isinstance(given, np.ndarray):
            return None
        fitted = dense.fit(given, (B, H, L, S), True)
        assert fitted is not None
        return fitted.astype(bool if name == "mask" else np.float64)

    alibi, scale = kw.get("alibi"), kw.get("scale")
    slopes = (paper_slopes(H) if H else np.zeros(0)) if alibi is True else (
        None if alibi is None or alibi is False else np.asarray(alibi, np.float64))  # fmt: skip
    return dense.Scene(
        q=qa, k=keys, v=vals, scale=1 / math.sqrt(d_k) if scale is None else float(scale),
        q_pos=at, k_pos=j, q_idx=at, k_idx=j, rows=i < counts.reshape(B, 1, 1, 1),
        keys=j < after.reshape(B, 1, 1, 1), causal=not bidirectional(kw), window=window,
        sink_tokens=sinks,
        chunk=kw.get("chunk"), mask=over_positions("mask"), bias=over_positions("bias"),
        mask_mod=kw.get("mask_mod"), score_mod=kw.get("score_mod"), softcap=kw.get("softcap"),
        slopes=slopes, sinks=None if kw.get("sinks") is None else np.asarray(kw["sinks"], float),
    )  # fmt: skip
