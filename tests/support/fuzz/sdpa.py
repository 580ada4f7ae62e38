"""``mha.scaled_dot_product_attention`` without a cache: every keyword of the contract, valid
and not, on data of every dtype and layout; results checked against :mod:`.dense`, and
``backward`` called with a random ``grad_out`` (its gradients against the dense ones in
float64). The cached calls are :mod:`.caches`'."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha
from support.reference import paper_slopes

from . import dense
from .arrays import chance, data, data_dtypes, drawn_rng, invalid_data, long_sizes, pick, sizes
from .keywords import Drawn, failing_callback, kernel, masking, scores, spoil
from .known import avoid
from .outcome import Call, MismatchError, UserCallbackError, expect_array, expect_close, run
from .rules import as_float64, dtype_of, dtypes, tolerance

GRADIENT_TOLERANCE = 1e-10
"""float64 gradients against the dense ones, relative to the sums of absolute values."""

SPOILABLE = ["mask", "causal", "causal_alignment", "key_lengths", "query_lengths", "bias",
             "window", "sink_tokens", "chunk", "mask_mod", "sinks", "softcap", "alibi",
             "score_mod", "scale", "max_memory", "workers", "dropout_p"]  # fmt: skip


def is_flag(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_))


def combination_refusals(kw: dict[str, Any], d_k: int, full: tuple[int, ...],
                         batched: bool) -> set[str]:  # fmt: skip
    """The names a refusal must mention for what the contract refuses in combination
    (each keyword valid alone), from the docs; empty when the call must compute."""
    names: set[str] = set()
    mask = kw.get("mask")
    causal = kw.get("causal") is True or kw.get("causal") is np.True_ or (
        is_flag(mask) and bool(mask))  # fmt: skip
    if kw.get("sink_tokens") and kw.get("window") is None:
        names.add("sink_tokens")
    if kw.get("causal_alignment") is not None and not causal and kw.get("window") is None:
        names.add("causal_alignment")
    if kw.get("score_mod_grad") is not None and kw.get("score_mod") is None:
        names |= {"score_mod_grad", "score_mod"}
    if kw.get("return_backward") is True and kw.get("score_mod") is not None and kw.get(
        "score_mod_grad") is None:  # fmt: skip
        names.add("score_mod_grad")
    if "generator" in kw and "dropout_p" not in kw:
        names.add("generator")
    if kw.get("dropout_p") and "generator" not in kw:
        names |= {"dropout_p", "generator"}
    if kw.get("padding_side") == "left" and kw.get("cache") is None:
        names.add("padding_side")
    if d_k == 0 and kw.get("scale") is None:
        names.add("scale")
    for name in ("mask", "bias"):
        value = kw.get(name)
        if isinstance(value, np.ndarray) and dense.fit(value, full, batched) is None:
            names.add(name)
    return names


@st.composite
def sdpa_calls(draw: Any) -> Call:
    """One call of ``scaled_dot_product_attention`` (no cache)."""
    rng = drawn_rng(draw, "seed")
    batch = tuple(
        draw(sizes, label="batch axis")
        for _ in range(draw(pick([0, 1, 1, 1, 2]), label="batch axes"))
    )
    H_kv = draw(pick([1, 1, 2, 3]), label="H_kv")
    H = H_kv * draw(pick([1, 1, 2, 3] + ([] if avoid("zero query heads") else [0])), label="group")
    L, S = draw(long_sizes, label="L"), draw(long_sizes, label="S")
    d_k = 0 if draw(chance(0.05), label="d_k = 0") else draw(pick([1, 2, 3, 4, 8]),
                                                             label="d_k")  # fmt: skip
    d_v = draw(sizes, label="d_v")
    dtype = draw(data_dtypes, label="dtype")
    mixed = lambda: draw(pick([dtype] * 9 + [np.float32, np.float64]), label="mix")  # noqa: E731
    q = draw(data(rng, (*batch, H, L, d_k), mixed()), label="q")
    k = draw(data(rng, (*batch, H_kv, S, d_k), mixed(), spread=2.0), label="k")
    v = draw(data(rng, (*batch, H_kv, S, d_v), mixed()), label="v")
    drawn = Drawn(draw(masking(rng, batch, H, L, S), label="masking"))
    backward = draw(chance(0.33), label="return_backward")
    drawn.kwargs |= draw(scores(rng, H, backward), label="scores")
    drawn.kwargs |= draw(kernel(), label="kernel")
    for name, wanted in (("return_weights", 0.25), ("return_lse", 0.33)):
        if draw(chance(wanted), label=name):
            drawn.kwargs[name] = draw(pick([True, False, np.True_]), label=name)
    if backward:
        drawn.kwargs["return_backward"] = True
    if draw(chance(0.05), label="padding_side"):  # only with a cache, or "right": no effect
        drawn.kwargs["padding_side"] = draw(pick(["right", "left", "middle"]), label="side")
        if drawn.kwargs["padding_side"] == "middle":
            drawn.refuse.add("padding_side")
    if draw(chance(0.1), label="dropout"):
        drawn.kwargs["dropout_p"] = draw(pick([0.0, 0.25, 0.75]), label="p")
        drawn.kwargs["generator"] = drawn_rng(draw, "dropout seed")
    spoilt = draw(
        pick(["none"] * 30 + ["keyword"] * 3 + ["callback", "data", "shapes"]),
        label="spoil",
    )
    if spoilt == "keyword":
        draw(spoil(rng, drawn, SPOILABLE, (batch, H, L, S)))
    elif spoilt == "callback":
        draw(failing_callback(drawn))
    elif spoilt == "data":  # data the contract refuses
        name = draw(pick(["q", "k", "v"]), label="refused data")
        shape = {"q": (*batch, H, L, d_k), "k": (*batch, H_kv, S, d_k), "v": (*batch, H_kv, S, d_v)}
        bad = draw(invalid_data(rng, shape[name]), label="bad data")
        q, k, v = (bad if n == name else x for n, x in (("q", q), ("k", k), ("v", v)))
        drawn.refuse.add(name)
    elif spoilt == "shapes":  # shapes that do not fit
        name = draw(pick(["k heads", "k width", "v positions", "q rank"]), label="bad")
        if name == "k heads":  # H_kv not dividing H (none at all for H = 0)
            k, v = (np.zeros((*batch, H + 1 if H else 0, S, d)) for d in (d_k, d_v))
        elif name == "k width":
            k = np.zeros((*batch, H_kv, S, d_k + 1))
        elif name == "v positions":
            v = np.zeros((*batch, H_kv, S + 1, d_v))
        else:
            q = np.zeros((L, d_k))
        drawn.refuse |= {"q", "k", "v"}
    if (
        drawn.lazy == "mask_mod"
        and drawn.kwargs.get("dropout_p")
        and avoid("mask_mod refused after dropout's draw")
    ):
        del drawn.kwargs["dropout_p"], drawn.kwargs["generator"]
    full = (*batch, H, L, S)
    drawn.refuse |= combination_refusals(drawn.kwargs, d_k, full, bool(batch))
    call = Call("scaled_dot_product_attention", mha.scaled_dot_product_attention, (q, k, v),
                drawn.kwargs, frozenset(drawn.refuse) or None, drawn.may_refuse)  # fmt: skip
    call.refusals = (mha.AttentionError, UserCallbackError)
    call.changes = tuple(x for x in (drawn.kwargs.get("generator"),) if x is not None)
    call.check = lambda result: check_sdpa(call, result, draw, drawn.lazy)
    return call


def called(lazy: str, scene: dense.Scene) -> bool:
    """Whether mha must call the callback ``lazy`` on ``scene``: ``mask_mod`` whenever there
    are scores (the block map is evaluated over all of them), ``score_mod`` whenever a
    query sees a key (it runs on the tiles computed)."""
    if lazy == "mask_mod":
        N, H, L = scene.q.shape[:3]
        return N * H * L * scene.k.shape[2] > 0
    kept = dataclasses.replace(scene, score_mod=None)
    return bool(dense.visible(kept).any())


def scene_of(q: Any, k: Any, v: Any, kw: dict[str, Any]) -> dense.Scene:
    """The dense reference's view of a call without a cache, from the docs."""
    qa, ka, va = (as_float64(x) for x in (q, k, v))
    batch, (H, L, d_k), (H_kv, S) = qa.shape[:-3], qa.shape[-3:], ka.shape[-3:-1]
    N = math.prod(batch)
    mask = kw.get("mask")
    causal = bool(kw.get("causal")) or (isinstance(mask, (bool, np.bool_)) and bool(mask))
    offset = 0 if kw.get("causal_alignment") == "top_left" else S - L
    i, j = np.arange(L).reshape(1, 1, L, 1), np.arange(S).reshape(1, 1, 1, S)
    full = (*batch, H, L, S)

    def per_sequence(name: str, top: int) -> np.ndarray:
        given = kw.get(name)
        return np.full(N, top) if given is None else np.asarray(given).reshape(N)

    def scores_array(name: str) -> np.ndarray | None:
        given = kw.get(name)
        if given is None or isinstance(given, (bool, np.bool_)):
            return None
        fitted = dense.fit(np.asarray(given), full, bool(batch))
        assert fitted is not None
        return fitted.reshape(N, H, L, S).astype(bool if name == "mask" else np.float64)

    alibi = kw.get("alibi")
    slopes = None
    if alibi is True:
        slopes = paper_slopes(H) if H else np.zeros(0)  # no heads: no slopes
    elif alibi is not None and alibi is not False:
        slopes = np.asarray(alibi, np.float64)
    scale = kw.get("scale")
    return dense.Scene(
        q=qa.reshape(N, H, L, d_k), k=ka.reshape(N, H_kv, S, d_k),
        v=va.reshape(N, H_kv, S, va.shape[-1]),
        scale=1 / math.sqrt(d_k) if scale is None else float(scale),
        q_pos=i + offset, k_pos=j, q_idx=i, k_idx=j,
        rows=i < per_sequence("query_lengths", L).reshape(N, 1, 1, 1),
        keys=j < per_sequence("key_lengths", S).reshape(N, 1, 1, 1),
        causal=causal, window=kw.get("window"), sink_tokens=kw.get("sink_tokens") or 0,
        chunk=kw.get("chunk"), mask=scores_array("mask"), bias=scores_array("bias"),
        mask_mod=kw.get("mask_mod"), score_mod=kw.get("score_mod"),
        score_mod_grad=kw.get("score_mod_grad"), softcap=kw.get("softcap"), slopes=slopes,
        sinks=None if kw.get("sinks") is None else np.asarray(kw["sinks"], np.float64),
    )  # fmt: skip


def check_sdpa(call: Call, result: Any, draw: Any, lazy: str | None = None) -> float | None:
    """Shapes, dtypes and finiteness of every returned array; the reference's numbers
    where it applies; then ``backward`` as a call of its own. ``lazy``: a callback that
    is refused (or fails) once called: the result must be of a call that had no need to."""
    q, k, v = call.args
    kw = call.kwargs
    if lazy is not None:
        scene = scene_of(q, k, v, {**kw, lazy: None})
        if called(lazy, scene):
            raise MismatchError(f"returned a result with the {lazy} that it must call refused")
        kw = {**kw, lazy: None}
    qs, ks, vs = np.shape(q), np.shape(k), np.shape(v)
    batch, (H, L, _), S, d_v = qs[:-3], qs[-3:], ks[-2], vs[-1]
    rdtype, cdtype = dtypes(q, k, v)
    wanted = [name for name in ("return_weights", "return_lse", "return_backward") if kw.get(name)]
    parts = list(result) if wanted else [result]
    if len(parts) != 1 + len(wanted):
        raise MismatchError(f"{len(parts)} results for {wanted}")
    out = parts.pop(0)
    expect_array("out", out, (*batch, H, L, d_v), rdtype, finite=True)
    weights = parts.pop(0) if kw.get("return_weights") else None
    if weights is not None:
        expect_array("weights", weights, (*batch, H, L, S), rdtype, finite=True)
    lse = parts.pop(0) if kw.get("return_lse") else None
    if lse is not None:
        expect_array("lse", lse, (*batch, H, L), cdtype, finite=False)
        if np.isnan(lse).any() or np.isposinf(lse).any():
            raise MismatchError(f"lse holds NaN or +inf: {lse!r}")
    backward = parts.pop(0) if kw.get("return_backward") else None
    if kw.get("dropout_p"):  # random weights: no reference
        error = None
        reference = None
    else:
        scene = scene_of(q, k, v, kw)
        reference = dense.attend(scene)
        tol = tolerance(rdtype, cdtype)
        error = expect_close("out", out, reference.out.reshape(np.shape(out)), tol)
        if weights is not None:
            error = max(
                error, expect_close("weights", weights, reference.p.reshape(weights.shape), tol)
            )
        if lse is not None:
            error = max(error, expect_close("lse", lse, reference.lse.reshape(lse.shape),
                                            tolerance(cdtype, cdtype)))  # fmt: skip
    if backward is not None:
        check_backward(call, kw, backward, out, reference, draw)
    return error


def check_backward(call: Call, kw: dict[str, Any], backward: Any, out: np.ndarray,
                   reference: Any, draw: Any) -> None:  # fmt: skip
    """``backward(grad_out)`` as a call: the gradients' names, shapes, dtypes and
    finiteness; in float64 without dropout, their values against the dense ones."""
    rng = drawn_rng(draw, "grad_out seed")
    shape = out.shape
    refuse = None
    if draw(chance(0.1), label="bad grad_out"):
        shape = (*shape[:-1], shape[-1] + 1)
        refuse = frozenset({"grad_out"})
    grad = rng.standard_normal(shape).astype(out.dtype)
    given = {"q": call.args[0], "k": call.args[1], "v": call.args[2]}
    given |= {name: kw[name] for name in ("bias", "sinks") if kw.get(name) is not None}

    def check(grads: Any) -> float | None:
        if not isinstance(grads, dict) or set(grads) != set(given):
            raise MismatchError(f"gradients {sorted(grads)}; the contract gives {sorted(given)}")
        for name, x in given.items():
            expect_array(f"d{name}", grads[name], np.shape(x), dtype_of(x), finite=True)
        if reference is None or dtypes(*call.args)[1] != np.float64:
            return None
        scene = scene_of(*call.args, kw)
        expected = dense.gradients(scene, reference, grad.astype(np.float64).reshape(
            reference.out.shape))  # fmt: skip
        worst = 0.0
        for name, x in given.items():
            ours, (exact, magnitude) = grads[name], expected[name]
            if name == "bias":
                exact, magnitude = (bias_gradient(a, call.args[0], x) for a in (exact, magnitude))
            exact = np.reshape(exact, np.shape(x))
            magnitude = np.reshape(magnitude, np.shape(x))
            # the rounding to the input's own dtype on top: float32 data has float32 gradients
            allowed = GRADIENT_TOLERANCE + tolerance(dtype_of(x)) * (dtype_of(x) != np.float64)
            if exact.size:
                error = float(np.max(np.abs(ours - exact))) / max(float(np.max(magnitude)), 1e-300)
                if not error <= allowed:
                    raise MismatchError(f"d{name} is off the dense gradient by {error:.3e} of its "
                                        f"magnitude (tolerance {allowed:.0e})")  # fmt: skip
                worst = max(worst, error / allowed)
        return worst

    run(Call("scaled_dot_product_attention backward", backward, (grad,), refuse=refuse,
             check=check))  # fmt: skip


def bias_gradient(dS: np.ndarray, q: Any, bias: Any) -> np.ndarray:
    """The scores' gradient ``(N, H, L, S)`` summed to the bias's shape, as the contract
    reads the bias (with batch axes, one axis fewer is ``(*batch, L, S)`` for every head)."""
    qs = np.shape(q)
    batch, H = qs[:-3], qs[-3]
    x = dS.reshape(*batch, H, *dS.shape[-2:])
    shape = np.shape(bias)
    if batch and len(shape) == x.ndim - 1:
        x = x.sum(axis=-3)
    return dense.sum_to(x, shape)
