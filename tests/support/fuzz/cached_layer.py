"""``multi_head_attention(..., cache=)`` on a session's cache (:mod:`.caches`): the layer's
path to a cache, contiguous or paged. The tokens ``X (B, L, E)`` are projected, rotated at
each sequence's next positions, appended and attend over the cache, as the docstring says;
the reference projects them itself (:func:`.layers.projected`) and attends with
:func:`.cached.cached_scene`. The keys the cache then holds are its own projection's, which
agrees with the reference's to rounding: checked to the tolerance, they become the model's
(so the exact checks of the model go on for everything held before)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha

from . import dense
from .arrays import chance, data, drawn_rng, pick, sizes, values
from .cached import cached_scene, inputs_for
from .known import avoid
from .layers import projected
from .outcome import Call, MismatchError, expect_array, expect_close, held_positions
from .rules import dtypes, tolerance

REFUSED = {  # keyword: (value, names a refusal may give)
    "return_weights": (True, {"return_weights", "cache"}),
    "positions": ("row", {"positions", "cache"}),
    "add_zero_attn": (True, {"add_zero_attn", "cache"}),
    "causal_alignment": ("top_left", {"causal_alignment", "cache"}),
    "return_backward": (True, {"return_backward", "cache"}),
}


@st.composite
def layer_call(draw: Any, session: Any) -> Call:
    """One ``multi_head_attention`` call appending to ``session``'s cache."""
    cache, rng = session.cache, drawn_rng(draw)
    B, H_kv, d_k, d_v = len(session.model), session.H_kv, session.d_k, session.d_v
    H = H_kv * draw(pick([1, 2]), label="group")
    E, L = draw(pick([2, 4, 6]), label="d_model"), draw(sizes, label="L")
    dtype = inputs_for(cache, draw)
    X = draw(data(rng, (B, L, E), dtype), label="X")
    W = [values(rng, shape, dtype, 0.5) for shape in
         ((E, H * d_k), (E, H_kv * d_k), (E, H_kv * d_v), (H * d_v, E))]  # fmt: skip
    kw: dict[str, Any] = {"num_kv_heads": H_kv}
    if session.values_in_keys:  # each value head: the first d_v features of its key head
        W[2] = np.concatenate([W[1][:, h * d_k : h * d_k + d_v] for h in range(H_kv)], axis=1)
    elif d_k % 2 == 0 and draw(chance(0.3), label="rope"):
        kw["rope_theta"] = 10000.0
    if draw(chance(0.3), label="query_lengths"):
        kw["query_lengths"] = rng.integers(0, L + 1, B)
        if draw(chance(0.3), label="left"):
            kw["padding_side"] = "left"
    if draw(chance(0.2), label="scale"):
        kw["scale"] = 0.5
    if session.window is not None and draw(chance(0.3), label="narrower window"):
        kw["window"] = draw(st.integers(1, session.window), label="window")
    elif session.window is not None and avoid("layer over a window cache without window="):
        kw["window"] = session.window
    refuse: set[str] = set()
    if draw(chance(0.1), label="spoil"):
        name = draw(pick(sorted(REFUSED)), label="refused with a cache")
        value, refuse = REFUSED[name]
        kw[name] = np.arange(L) if value == "row" else value
        if name == "causal_alignment":
            kw["causal"] = True
    counts = np.full(B, L) if "query_lengths" not in kw else kw["query_lengths"]
    size = session.block_size
    before = np.array([h.keys.shape[1] for h in session.model.values()], np.int64)
    may = False
    if session.paged and not refuse:
        worst = sum(
            -(-(n + c) // size) - n // size + 1 for n, c in zip(before, counts, strict=True) if c
        )
        may = worst > cache.num_free_blocks
        refuse |= {"num_blocks"} if may else set()
    call = Call("multi_head_attention (cache)", mha.multi_head_attention, (X, X, X, *W, H),
                {**kw, "cache": cache}, frozenset(refuse) or None, may)  # fmt: skip
    call.changes = (cache,)
    call.check = lambda result: check_layer_call(session, call, result, before, counts)
    return call


def check_layer_call(session: Any, call: Call, out: Any, before: np.ndarray,
                     counts: np.ndarray) -> float:  # fmt: skip
    X, *W, H = call.args[2:]
    X = np.asarray(call.args[0], np.float64)
    kw = {name: x for name, x in call.kwargs.items() if name != "cache"}
    B, L, E = X.shape
    rdtype, cdtype = dtypes(call.args[0], *W)
    expect_array("out", out, (B, L, E), rdtype, finite=True)
    left = kw.get("padding_side") == "left"
    if left:  # each sequence's real rows first, as the call moves them
        X = np.stack([np.roll(X[b], -(L - c), axis=0) for b, c in enumerate(counts)]) if B else X
    at = (before[:, None] + np.arange(L))[:, None, :]
    inputs = {"Q": X, "K": X, "V": X, **dict(zip(("W_q", "W_k", "W_v", "W_o"), W, strict=True))}
    parts = projected(inputs, H, session.H_kv, kw, at, at)
    assert parts is not None  # no rope scaling is drawn here
    q, k, v = parts
    stored = session.cache.dtype
    tol = tolerance(rdtype, cdtype) + (4 * tolerance(stored) if stored != cdtype else 0.0)
    adopt(session, k, v, before, counts, tol)
    held = ([(h.keys, h.values) for h in session.model.values()] if session.quantize is None
            else [session.cache.dequantized(s) for s in session.model])  # fmt: skip
    scene = cached_scene(session, q, held, before, counts, False, {**kw, "scale": 1.0})
    joined = np.moveaxis(dense.attend(scene).out, 1, 2).reshape(B, L, H * session.d_v)
    if left:
        joined = np.stack([np.roll(joined[b], L - c, axis=0) for b, c in enumerate(counts)]) \
            if B else joined  # fmt: skip
    W_o = np.asarray(W[3], np.float64)
    bound = float(np.max(np.abs(joined) @ np.abs(W_o), initial=0.0))
    error = expect_close("out", out, joined @ W_o, tol, max(bound, 1e-3))
    session.check()
    return error


def adopt(session: Any, k: np.ndarray, v: np.ndarray, before: np.ndarray, counts: np.ndarray,
          tol: float) -> None:  # fmt: skip
    """Each sequence's new keys and values as the cache holds them, checked against the
    reference's projection ``k``, ``v`` to ``tol``, appended to the model."""
    cache = session.cache
    for b, (s, history) in enumerate(session.model.items()):
        c = int(counts[b])
        mine = k[b][:, :c], v[b][:, :c]
        if session.quantize is not None:  # the model holds what was given: its projection
            history.append(*mine)
            continue
        if session.paged:
            theirs = tuple(x[:, before[b] :] for x in cache.dequantized(s))
        else:  # the new positions a window's cache still holds
            slots, positions = held_positions(cache, b)
            new = [slot for slot, p in zip(slots, positions, strict=True) if p >= before[b]]
            theirs = (cache.k[b][:, new], cache.v[b][:, new])
        for name, ours, held in (("keys", mine[0], theirs[0]), ("values", mine[1], theirs[1])):
            kept = held.shape[1]  # a window's cache may have dropped the first of them
            scale = max(float(np.max(np.abs(ours), initial=0.0)), 1.0)
            if np.max(np.abs(ours[:, c - kept :] - held), initial=0.0) > tol * scale:
                raise MismatchError(f"sequence {b}'s new {name} are off their projection")
        keys = np.concatenate([mine[0][:, : c - theirs[0].shape[1]], theirs[0]], axis=1)
        vals = np.concatenate([mine[1][:, : c - theirs[1].shape[1]], theirs[1]], axis=1)
        history.append(keys, vals)
