""":func:`mha.multi_head_attention`'s plain calls kept per signature
(:class:`mha.api.layer_plan.FunctionPlan`): the general path's bits call after call, each
call's own input and weights (new arrays of the same shapes, a weight changed in place),
an independent reference's values, no array of the caller's kept, and the checks' refusals
unchanged."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from support.extras import needs_numba
from support.kept import same_in_threads, taken

import mha
from mha._kernel import compiled, runtime
from mha.api import function, layer_plan


@pytest.fixture(autouse=True)
def walked(request):
    """A plan runs the compiled walk: without numba none is kept (the last test here says
    so), and the others skip, or fail where ``MHA_REQUIRE_NUMBA=1`` asks for it."""
    runtime.DEFAULT.forget()
    if request.function is test_without_the_compiled_walk_no_plan_is_kept:
        return
    needs_numba(compiled.walk_available(), "no plan is kept")


def _general(monkeypatch):
    """Every call through the checks and :func:`mha.api.projection.compute` (nothing
    looked up, nothing kept)."""
    monkeypatch.setattr(function, "kept_function_plan", lambda signature: None)
    monkeypatch.setattr(function, "keep_function_plan", lambda *args: None)


def _reference(X, W, biases, H, causal):
    """The function's output in float64 by plain loops over heads: the projections with
    their biases, the scaled scores, the causal mask, a softmax, the output projection."""
    X = np.asarray(X, np.float64)
    lead = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])
    W = [np.asarray(w, np.float64) for w in W]
    b = [0.0 if x is None else np.asarray(x, np.float64) for x in biases]
    d = W[0].shape[1] // H
    L = X.shape[1]
    out = np.zeros((X.shape[0], L, W[2].shape[1]))
    for s in range(X.shape[0]):
        q, k, v = (X[s] @ W[i] + b[i] for i in range(3))
        for h in range(H):
            cut = slice(h * d, (h + 1) * d)
            scores = q[:, cut] @ k[:, cut].T / np.sqrt(d)
            if causal:
                scores = np.where(np.tri(L, dtype=bool), scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[s, :, cut] = (p / p.sum(axis=1, keepdims=True)) @ v[:, cut]
    return (out @ W[3] + b[3]).reshape(*lead, L, -1)


def _weights(rng, width, dtype, biases):
    W = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(dtype) for _ in range(4)]
    b = [rng.standard_normal(width).astype(dtype) if on else None for on in biases]
    return W, b


def _call(X, W, b, H, mask=None, workers=None, **causal):
    return mha.multi_head_attention(
        X, X, X, *W, H, mask=mask, workers=workers, b_q=b[0], b_k=b[1], b_v=b[2], b_o=b[3],
        **causal,
    )  # fmt: skip


BIASES = {"none": (False,) * 4, "all": (True,) * 4, "q and v": (True, False, True, False)}
SHAPES = {
    "batch of 3, 7 tokens": (3, 7),
    "one token": (2, 1),
    "unbatched 40": (40,),
    "300 rows": (2, 150),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("biases", list(BIASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", [None, True])
@pytest.mark.parametrize("causal", [{}, dict(causal=False), dict(causal=True)])
@pytest.mark.parametrize("workers", [None, 1, 2])
def test_the_kept_plan_gives_the_general_paths_bits(
    shape, biases, dtype, mask, causal, workers, monkeypatch
):
    """Four calls of one signature, each on its own input and weights (new arrays of the
    same shapes): the first is noted, the second keeps the plan, the next two take it;
    every output bit for bit the general path's and within float rounding of a float64
    reference. ``causal`` given (``False`` or ``True``, as a benchmark's call gives it) is
    kept as ``mask`` is."""
    rng = np.random.default_rng(5)
    width, H = 32, 4
    calls = []
    for _ in range(4):
        X = rng.standard_normal((*SHAPES[shape][:-1], SHAPES[shape][-1], width)).astype(dtype)
        calls.append((X, *_weights(rng, width, dtype, BIASES[biases])))
    kept = taken(monkeypatch, layer_plan.FunctionPlan)
    own = [_call(X, W, b, H, mask, workers, **causal) for X, W, b in calls]
    assert len(kept) == 2
    with monkeypatch.context() as m:
        _general(m)
        general = [_call(X, W, b, H, mask, workers, **causal) for X, W, b in calls]
    tolerance = 2e-5 if dtype == np.float32 else 1e-12
    hidden = mask is True or causal.get("causal", False)
    for (X, W, b), a, g in zip(calls, own, general, strict=True):
        assert a.dtype == g.dtype == dtype and a.shape == X.shape
        np.testing.assert_array_equal(a, g)
        np.testing.assert_allclose(a, _reference(X, W, b, H, hidden), rtol=0, atol=tolerance)


@pytest.mark.parametrize("side_by_side", [True, False])
def test_small_calls_are_three_compiled_calls(side_by_side, monkeypatch):
    """A few rows on one worker: with W_q, W_k and W_v side by side in one array (one
    product projects all three, as for a layer's own weights) the kept plan's small call
    (the projection and the output as compiled calls) serves the function as it serves a
    layer, and separate weights by three products (:func:`compiled.layer_project_apart`)."""
    rng = np.random.default_rng(6)
    W, b = _weights(rng, 64, np.float32, (False,) * 4)
    if side_by_side:
        joined = np.concatenate(W[:3], axis=1)
        W[:3] = joined[:, :64], joined[:, 64:128], joined[:, 128:]
    X = rng.standard_normal((1, 16, 64)).astype(np.float32)
    done = []
    real = compiled.layer_output
    monkeypatch.setattr(compiled, "layer_output", lambda *a: (done.append(1), real(*a))[1])
    kept = taken(monkeypatch, layer_plan.FunctionPlan)
    first = _call(X, W, b, 4)
    again = [_call(X, W, b, 4) for _ in range(3)]  # (the plan kept by the first of them)
    assert len(kept) == 2 and len(done) == 2
    for out in again:
        np.testing.assert_array_equal(out, first)
    np.testing.assert_allclose(first, _reference(X, W, b, 4, False), atol=2e-5)


def test_a_weight_changed_in_place_is_read_as_it_is_now():
    """The plan holds no weight: a weight updated in place between calls is read then."""
    rng = np.random.default_rng(7)
    W, b = _weights(rng, 32, np.float64, (True,) * 4)
    X = rng.standard_normal((2, 6, 32))
    _call(X, W, b, 4)
    _call(X, W, b, 4)
    W[1] *= 1.5
    b[3] += 1.0
    np.testing.assert_allclose(_call(X, W, b, 4), _reference(X, W, b, 4, False), atol=1e-12)


def test_the_plan_holds_no_array_of_the_callers():
    """Neither the input nor any weight stays alive through a kept plan."""
    rng = np.random.default_rng(8)
    gc.disable()
    try:
        W, b = _weights(rng, 16, np.float32, (True,) * 4)
        X = rng.standard_normal((2, 5, 16)).astype(np.float32)
        for _ in range(3):
            _call(X, W, b, 4)
        (kept,) = runtime.DEFAULT.function_plans.values()
        assert kept.plan is not None
        refs = [weakref.ref(x) for x in (X, *W, *b)]
        del X, W, b
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()


def test_refused_calls_are_refused_as_ever():
    """A kept signature does not let through what the checks refuse: another head count,
    a weight of another shape, a mask of another kind, a list for an array."""
    rng = np.random.default_rng(9)
    W, b = _weights(rng, 16, np.float64, (False,) * 4)
    X = rng.standard_normal((2, 5, 16))
    _call(X, W, b, 4)
    with pytest.raises(mha.ShapeError, match="num_heads=3"):
        _call(X, W, b, 3)
    with pytest.raises(mha.ShapeError, match="W_o"):
        _call(X, [*W[:3], W[3][:, :8].T.copy()], b, 4)
    with pytest.raises(mha.AttentionError, match="mask"):
        _call(X, W, b, 4, mask=1)
    with pytest.raises(mha.AttentionError, match="workers"):
        _call(X, W, b, 4, workers=0)
    listed = _call(X.tolist(), W, b, 4)  # (read as an array: checked, not kept)
    np.testing.assert_allclose(listed, _reference(X, W, b, 4, False), atol=1e-12)


def test_weights_the_checks_convert_keep_no_plan(monkeypatch):
    """Integer weights become float64 copies in the checks: their signature keeps no plan
    (each call converts its own), and the outputs follow the weights given."""
    rng = np.random.default_rng(10)
    X = rng.standard_normal((2, 5, 16))
    kept = taken(monkeypatch, layer_plan.FunctionPlan)
    for _ in range(3):
        W = [rng.integers(-2, 3, (16, 16)) for _ in range(4)]
        out = mha.multi_head_attention(X, X, X, *W, 4)
        np.testing.assert_allclose(out, _reference(X, W, [None] * 4, 4, False), atol=1e-12)
    assert not kept
    (plan,) = runtime.DEFAULT.function_plans.values()
    assert plan.plan is None


@pytest.mark.parametrize(
    "options",
    [dict(causal=np.True_), dict(causal_alignment="top_left"), dict(scale=0.5),
     dict(return_weights=True), dict(max_memory=2**20), dict(mask=np.True_),
     dict(workers=True), dict(cross=True)],
)  # fmt: skip
def test_calls_that_are_not_plain_are_not_kept(options, monkeypatch):
    """Any keyword but mask (None or True), causal (None or a bool) and workers (None or
    an int), or keys that are not the queries: checked and computed every time, to the
    general path's values."""
    rng = np.random.default_rng(11)
    W, _ = _weights(rng, 16, np.float64, (False,) * 4)
    X = rng.standard_normal((2, 5, 16))
    options = dict(options)
    K = X.copy() if options.pop("cross", False) else X
    kept = taken(monkeypatch, layer_plan.FunctionPlan)

    def call():
        try:
            return mha.multi_head_attention(X, K, K, *W, 4, **options)
        except mha.AttentionError as error:
            return type(error), str(error)

    own = [call() for _ in range(3)]
    with monkeypatch.context() as m:
        _general(m)
        general = call()
    assert not kept and len(runtime.DEFAULT.function_plans) == 0
    for got in own:
        if isinstance(general, tuple) and isinstance(general[0], type):  # (refused)
            assert got == general
        elif isinstance(general, tuple):  # (the output and the weights)
            for a, g in zip(got, general, strict=True):
                np.testing.assert_array_equal(a, g)
        else:
            np.testing.assert_array_equal(got, general)


def test_a_non_finite_value_at_a_hidden_key_is_computed_the_general_way(monkeypatch):
    """A causal call whose last token holds an infinite value, a key every other query
    has hidden: the walk leaves the work to the general path, which gives its own bits,
    and the other rows what the first five tokens alone give."""
    rng = np.random.default_rng(12)
    W, b = _weights(rng, 16, np.float64, (False,) * 4)
    X = rng.standard_normal((1, 6, 16))
    for _ in range(2):
        _call(X, W, b, 4, mask=True)  # (the plan kept)
    bad = X.copy()
    bad[0, -1, 0] = np.inf
    kept = taken(monkeypatch, layer_plan.FunctionPlan)
    out = _call(bad, W, b, 4, mask=True)
    assert not kept
    with monkeypatch.context() as m:
        _general(m)
        np.testing.assert_array_equal(out, _call(bad, W, b, 4, mask=True))
    np.testing.assert_allclose(out[:, :-1], _reference(X[:, :-1], W, b, 4, True), atol=1e-12)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(13)
    W, b = _weights(rng, 16, np.float32, (True,) * 4)
    X = rng.standard_normal((2, 5, 16)).astype(np.float32)
    copies = [x.copy() for x in (X, *W, *b)]
    for _ in range(3):
        _call(X, W, b, 4, mask=True)
    for x, c in zip((X, *W, *b), copies, strict=True):
        np.testing.assert_array_equal(x, c)


def test_threads_share_a_plan():
    """Four threads calling at once, each on its own input and weights of one signature:
    each gets what its call alone gives."""
    rng = np.random.default_rng(14)
    given = [(rng.standard_normal((2, 5, 16)), *_weights(rng, 16, np.float64, (True,) * 4))
             for _ in range(4)]  # fmt: skip
    same_in_threads([lambda g=g: _call(*g, 4) for g in given])


def test_the_kept_plans_are_bounded():
    """Calls of many signatures keep at most the runtime's bound of plans."""
    rng = np.random.default_rng(15)
    W, b = _weights(rng, 16, np.float64, (False,) * 4)
    for L in range(1, 41):
        _call(rng.standard_normal((1, L, 16)), W, b, 4)
    assert 1 <= len(runtime.DEFAULT.function_plans) <= runtime.DEFAULT.function_plans.most


def test_without_the_compiled_walk_no_plan_is_kept(monkeypatch):
    """Where the compiled walk is unavailable (no numba: the core install), the function
    keeps no plan and every call goes the general way, to the float64 reference's values."""
    monkeypatch.setattr(compiled, "walk_available", lambda: False)
    rng = np.random.default_rng(16)
    W, b = _weights(rng, 16, np.float64, (True,) * 4)
    kept = taken(monkeypatch, layer_plan.FunctionPlan)
    for _ in range(3):
        X = rng.standard_normal((2, 5, 16))
        np.testing.assert_allclose(_call(X, W, b, 4, True), _reference(X, W, b, 4, True),
                                   atol=1e-12)  # fmt: skip
    assert not kept
    assert all(plan.plan is None for plan in runtime.DEFAULT.function_plans.values())


@pytest.mark.parametrize(
    "dtypes", [(np.float16, np.float16), (np.float16, np.float32), (np.float32, np.float64)]
)
def test_inputs_and_weights_of_other_dtypes_keep_their_bits(dtypes, monkeypatch):
    """A half-precision input, or weights wider than the input: the kept plan computes in
    the general path's dtype and returns its result's dtype, the same bits."""
    rng = np.random.default_rng(17)
    x_dtype, w_dtype = dtypes
    biases = (True, False, True, True)
    calls = [(rng.standard_normal((2, 9, 16)).astype(x_dtype), *_weights(rng, 16, w_dtype, biases))
             for _ in range(4)]  # fmt: skip
    kept = taken(monkeypatch, layer_plan.FunctionPlan)
    own = [_call(X, W, b, 4, True) for X, W, b in calls]
    assert len(kept) == 2
    with monkeypatch.context() as m:
        _general(m)
        general = [_call(X, W, b, 4, True) for X, W, b in calls]
    for (X, W, b), a, g in zip(calls, own, general, strict=True):
        assert a.dtype == g.dtype == np.result_type(x_dtype, w_dtype)
        np.testing.assert_array_equal(a, g)
        tolerance = 2e-2 if np.float16 in dtypes else 1e-6
        np.testing.assert_allclose(a, _reference(X, W, b, 4, True), rtol=0, atol=tolerance)


def test_signatures_seen_once_make_no_plan(monkeypatch):
    """Calls whose signatures keep changing (a growing prefix) are noted, not planned: no
    plan is made until a signature comes again."""
    rng = np.random.default_rng(18)
    W, b = _weights(rng, 16, np.float64, (False,) * 4)
    made = []
    real = layer_plan._planned
    monkeypatch.setattr(layer_plan, "_planned", lambda *a: (made.append(1), real(*a))[1])
    for L in range(1, 12):
        X = rng.standard_normal((1, L, 16))
        np.testing.assert_allclose(_call(X, W, b, 4, True), _reference(X, W, b, 4, True),
                                   atol=1e-12)  # fmt: skip
    assert not made
    _call(rng.standard_normal((1, 5, 16)), W, b, 4, True)
    assert len(made) == 1


@pytest.mark.parametrize("layer", [False, True])
def test_underflow_is_reported_as_numpy_reports_it(layer, monkeypatch):
    """A caller who asks NumPy to raise on underflow gets the general path's error from a
    kept call too (the compiled products report none: the call is left to NumPy's)."""
    rng = np.random.default_rng(19)
    W, b = _weights(rng, 16, np.float64, (False,) * 4)
    if layer:
        module = mha.MultiHeadAttention(16, 4, seed=1, bias=False)
        W = [module.W_q, module.W_k, module.W_v, module.W_o]

    def call(X):
        return module(X) if layer else _call(X, W, b, 4)

    X = rng.standard_normal((2, 5, 16))
    for _ in range(3):
        call(X)  # (the plan kept, its small call taken)
    tiny = X * 1e-307  # (its products underflow)
    with np.errstate(under="raise"), pytest.raises(FloatingPointError, match="underflow"):
        call(tiny)
    with monkeypatch.context() as m:
        _general(m)
        m.setattr(mha.api.module, "kept_plan", lambda module: None)
        with np.errstate(under="raise"), pytest.raises(FloatingPointError, match="underflow"):
            call(tiny)
        expected = call(tiny)
    np.testing.assert_array_equal(call(tiny), expected)


def test_a_full_table_keeps_what_is_kept_again():
    """Keeping a key already kept does not forget the others, even when the table is full."""
    kept = runtime.Kept(2)
    kept.keep("a", 1)
    kept.keep("b", 2)
    kept.keep("a", 3)
    assert (kept.get("a"), kept.get("b")) == (3, 2)
    kept.keep("c", 4)
    assert len(kept) == 1 and kept.get("c") == 4
