"""A layer's kept plan of a plain call (:mod:`mha.api.layer_plan`): the same bits as the
general path call after call, an independent reference's values, taken only while
everything it was made from holds, and never where the general path would refuse or
compute something else."""

from __future__ import annotations

import gc
import itertools
import weakref

import numpy as np
import pytest
from support.extras import needs_numba
from support.kept import same_in_threads, taken

import mha
from mha._kernel import compiled, runtime
from mha.api import layer_plan, module


@pytest.fixture(autouse=True)
def walked(request):
    """A plan runs the compiled walk: without numba none is kept (the last test here says
    so), and the others skip, or fail where ``MHA_REQUIRE_NUMBA=1`` asks for it."""
    if request.function is test_without_the_compiled_walk_no_plan_is_kept:
        return
    needs_numba(compiled.walk_available(), "no plan is kept")


def _general(monkeypatch):
    """Every call through the checks and :func:`mha.api.projection.compute`."""
    monkeypatch.setattr(module, "kept_plan", lambda layer: None)


def _spy(monkeypatch):
    """The calls the kept plan computed."""
    return taken(monkeypatch, layer_plan.LayerPlan)


def _small_calls(monkeypatch):
    """The compiled calls of a small planned call (:class:`mha.api.layer_plan.SmallCall`)."""
    calls = []
    for name in ("project", "output"):
        real = getattr(compiled, f"layer_{name}")

        def spied(*args, real=real, name=name):
            calls.append(name)
            return real(*args)

        monkeypatch.setattr(compiled, f"layer_{name}", spied)
    return calls


def _reference(layer, X, causal):
    """The layer's attention in float64 by plain loops over heads: projections, the
    scaled scores, the mask (causal, the layer's window: ``i - j < window``), a softmax,
    the output projection (no rotary: the configurations below that rotate are checked
    against the general path, which tests/test_families.py checks against transformers)."""
    X = np.asarray(X, np.float64)
    lead = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])
    w = {name: None if v is None else np.asarray(v, np.float64)
         for name, v in layer.weights().items()}  # fmt: skip
    H, H_kv = layer.num_heads, layer.num_kv_heads
    d = w["W_q"].shape[1] // H
    L = X.shape[1]
    out = np.zeros((X.shape[0], L, H * d))
    for b in range(X.shape[0]):
        q, k, v = (X[b] @ w[f"W_{n}"] + (0 if w.get(f"b_{n}") is None else w[f"b_{n}"])
                   for n in "qkv")  # fmt: skip
        for h in range(H):
            g = h // (H // H_kv)
            qh, kh, vh = (
                q[:, h * d : (h + 1) * d],
                k[:, g * d : (g + 1) * d],
                v[:, g * d : (g + 1) * d],
            )
            s = qh @ kh.T * (layer.scale if layer.scale is not None else d**-0.5)
            i, j = np.arange(L)[:, None], np.arange(L)[None, :]
            seen = np.ones((L, L), bool)
            if causal:
                seen &= j <= i
            if layer.window is not None:
                seen &= i - j < layer.window
            s = np.where(seen, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[b, :, h * d : (h + 1) * d] = (p / p.sum(axis=1, keepdims=True)) @ vh
    result = out @ w["W_o"] + (0 if w.get("b_o") is None else w["b_o"])
    return result.reshape(*lead, L, -1)


CONFIGS = {
    "plain": dict(num_heads=4),
    "gqa, biases": dict(num_heads=8, num_kv_heads=2, bias=True),
    "window": dict(num_heads=4, num_kv_heads=1, window=3),
    "gqa, rotary": dict(num_heads=8, num_kv_heads=2, rope_theta=10000.0),
    "interleaved, partial rotary": dict(
        num_heads=4, rope_theta=500.0, rotary_dim=4, rotary_interleaved=True
    ),
}
SHAPES = {"batch of 3, 7 tokens": (3, 7), "one token": (2, 1), "unbatched 40": (40,)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", [None, True])
@pytest.mark.parametrize("workers", [None, 1, 2])
def test_the_kept_plan_gives_the_general_paths_bits(shape, name, dtype, mask, workers, monkeypatch):
    """Three calls of one layer on inputs of one shape: the first makes the plan, the next
    two take it; every output bit for bit the general path's, and within float rounding of
    a float64 reference where the layer does not rotate."""
    rng = np.random.default_rng(7)
    layer = mha.MultiHeadAttention(32, seed=2, dtype=dtype, **CONFIGS[name])
    xs = [rng.standard_normal((*SHAPES[shape][:-1], SHAPES[shape][-1], 32)).astype(dtype)
          for _ in range(3)]  # fmt: skip
    runtime.DEFAULT.forget()
    taken, small = _spy(monkeypatch), _small_calls(monkeypatch)
    own = [layer(x, mask, workers=workers) for x in xs]
    assert len(taken) == 2
    # one worker, no rotation: the projection, the walk and the output as compiled calls
    assert small == (["project", "output"] * 2 if workers != 2 and "rotary" not in name else [])
    with monkeypatch.context() as m:
        _general(m)
        general = [layer(x, mask, workers=workers) for x in xs]
    for a, b in zip(own, general, strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(a, b)
    if "rotary" not in name:
        tolerance = 2e-5 if dtype == np.float32 else 1e-12
        for x, a in zip(xs, own, strict=True):
            np.testing.assert_allclose(a, _reference(layer, x, mask), rtol=0, atol=tolerance)


def test_a_call_of_many_rows_shares_its_work_and_keeps_its_bits(monkeypatch):
    """A call large enough for two workers by default (and for the projection of all three
    inputs in one product): the plan's team and split, the general path's bits."""
    rng = np.random.default_rng(8)
    layer = mha.MultiHeadAttention(64, 4, num_kv_heads=2, seed=3, dtype=np.float32)
    xs = [rng.standard_normal((4, 300, 64)).astype(np.float32) for _ in range(2)]
    taken = _spy(monkeypatch)
    own = [layer(x, mask=True) for x in xs]
    assert len(taken) == 1
    assert runtime.DEFAULT.layer_plans[layer].team == mha._kernel.team.default_workers()
    with monkeypatch.context() as m:
        _general(m)
        general = [layer(x, mask=True) for x in xs]
    for a, b in zip(own, general, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(own[1], _reference(layer, xs[1], True), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_projection_and_output_give_numpys_bits(dtype):
    """:func:`compiled.layer_project` (and :func:`compiled.layer_project_apart`, of the
    weights cut apart) and :func:`compiled.layer_output` against what the team's products
    make of the same arrays (:meth:`Team.matmul_heads` with the late scale, one product or
    three, :meth:`Team.matmul`), bit for bit, over random sizes from two rows and columns up,
    with and without biases, scales that are no power of two."""
    rng = np.random.default_rng(21)
    team = mha._kernel.team.Team(1)
    for _ in range(60):
        B, L, H = (int(n) for n in rng.integers(1, 5, 3))
        H_kv = int(rng.choice([1, H]))
        d, d_v, width = int(rng.integers(1, 20)), int(rng.integers(1, 20)), int(rng.integers(2, 70))
        if B * L < 2 or H * d_v < 2:
            continue
        parts = [(H, d), (H_kv, d), (H_kv, d_v)]
        m = sum(h * size for h, size in parts)
        x = rng.standard_normal((B, L, width)).astype(dtype)
        W = rng.standard_normal((width, m)).astype(dtype)
        b = rng.standard_normal(m).astype(dtype) if rng.random() < 0.7 else None
        scale = float(rng.integers(1, 100)) ** -0.5
        with team:
            expected = team.matmul_heads(x, W, b, parts, scale)
        heads = tuple(np.empty((B, h, L, size), dtype) for h, size in parts)
        joined, product = np.ones((B, L, H * d_v), dtype), np.empty((B * L, m), dtype)
        bias = np.empty(0, dtype) if b is None else b
        first = np.dtype(dtype).type(scale)
        compiled.layer_project(np.dtype(dtype), x.reshape(B * L, width), W, bias, True, first,
                               heads, joined, product)  # fmt: skip
        for got, want in zip(heads, expected, strict=True):
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        assert not joined.any()
        if min(h * size for h, size in parts) >= 2:  # three products (separate weights)
            cuts = list(itertools.pairwise(np.cumsum([0] + [h * size for h, size in parts])))
            Ws = [np.ascontiguousarray(W[:, a:z]) for a, z in cuts]
            bs = [None if b is None else b[a:z].copy() for a, z in cuts]
            apart = zip(Ws, bs, parts, (scale, None, None), strict=True)
            with team:
                expected = [team.matmul_heads(x, *e[:2], [e[2]], e[3])[0] for e in apart]
            joined[:] = 1
            bias = [np.empty(0, dtype) if b_p is None else b_p for b_p in bs]
            compiled.layer_project_apart(np.dtype(dtype), x.reshape(B * L, width), *Ws, *bias,
                                         True, first, heads, joined, product)  # fmt: skip
            for got, want in zip(heads, expected, strict=True):
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
            assert not joined.any()
        rows = rng.standard_normal((B * L, H * d_v)).astype(dtype)
        W_o = rng.standard_normal((H * d_v, width)).astype(dtype)
        b_o = rng.standard_normal(width).astype(dtype) if b is not None else None
        with team:
            want = team.matmul(rows, W_o, b_o)
        out = np.empty((B * L, width), dtype)
        bias = np.empty(0, dtype) if b_o is None else b_o
        compiled.layer_output(np.dtype(dtype), rows, W_o, bias, out)
        np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_what_a_small_call_leaves_to_the_kept_walk_keeps_its_bits(dtype, monkeypatch):
    """A kept small call (:class:`layer_plan.SmallCall`) takes a contiguous input; a strided
    one of the kept shape (whose rows NumPy multiplies without BLAS), an input whose
    infinite value a causal mask hides from some rows (the walk leaves them) and a call of
    256 rows or more (several products) it leaves to the path it shortens: every output
    the general path's bits."""
    rng = np.random.default_rng(22)
    layer = mha.MultiHeadAttention(48, 4, seed=5, bias=True, dtype=dtype)
    big = rng.standard_normal((3, 12, 96)).astype(dtype)
    strided, contiguous = big[:, :, ::2], np.ascontiguousarray(big[:, :, 1::2])
    layer(contiguous, True)  # the plan made
    small = _small_calls(monkeypatch)
    out = [layer(contiguous, True)]
    assert small == ["project", "output"]
    out.append(layer(strided, True))
    assert small == ["project", "output"]  # (not taken)
    hidden = contiguous.copy()
    hidden[0, -1, :] = np.inf  # the last key's value infinite: hidden from earlier rows
    out.append(layer(hidden, True))
    assert small == ["project", "output", "project"]  # (the walk left tasks: no output)
    long = rng.standard_normal((2, 128, 48)).astype(dtype)
    out += [layer(long, True), layer(long, True)]
    assert small == ["project", "output", "project"]
    with monkeypatch.context() as m:
        _general(m)
        expected = [layer(x, True) for x in (contiguous, strided, hidden, long, long)]
    for got, want in zip(out, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.isfinite(out[2][0, :-1]).all() and np.isfinite(out[2][1:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_small_call_of_separate_weights_takes_the_scale_in_w_q(dtype, monkeypatch):
    """W_q, W_k, W_v apart and as many rows as features or more: the scale goes into W_q
    (:func:`mha.api.qkv.qkv_weights`), the queries are copied unscaled; Qwen-like biases
    (none on the keys or the output). A W_o in Fortran order is left to the kept walk's
    path (NumPy transposes it for BLAS). The general path's bits throughout."""
    rng = np.random.default_rng(23)
    layer = mha.MultiHeadAttention(12, 3, seed=6, bias=True, dtype=dtype)
    for name in ("W_q", "W_k", "W_v"):
        setattr(layer, name, getattr(layer, name).copy())
    layer.b_k, layer.b_o = None, None
    xs = [rng.standard_normal((2, 9, 12)).astype(dtype) for _ in range(3)]
    scaled = []
    real = compiled.layer_project
    monkeypatch.setattr(compiled, "layer_project",
                        lambda *args: scaled.append(args[4]) or real(*args))  # fmt: skip
    own = [layer(x) for x in xs]
    assert scaled == [False, False]
    layer.W_o = np.asfortranarray(layer.W_o)
    own += [layer(x) for x in xs]
    assert scaled == [False, False]
    with monkeypatch.context() as m:
        _general(m)
        expected = [layer(x) for x in xs] * 2
    for got, want in zip(own, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(own[1], _reference(layer, xs[1], None), rtol=0, atol=1e-5)


def test_a_dropped_plan_lets_go_of_its_buffers_at_once():
    """A plan replaced (a weight assigned anew) or dropped with its layer frees its small
    call's buffers when its last reference goes, with no collector run: nothing refers
    back to the plan."""
    rng = np.random.default_rng(24)
    gc.disable()
    try:
        layer = _layer(rng)
        x = rng.standard_normal((2, 5, 16))
        layer(x)
        plan = runtime.DEFAULT.layer_plans[layer]
        assert plan.small is not None and plan.small.spare
        gone = [weakref.ref(plan), weakref.ref(plan.small.spare[0][1])]
        del plan
        layer.W_o = layer.W_o.copy()
        layer(x)  # (a new plan made in place of the old)
        assert [ref() for ref in gone] == [None, None]
        kept = weakref.ref(runtime.DEFAULT.layer_plans[layer])
        del layer
        assert kept() is None
    finally:
        gc.enable()


def _layer(rng, **options):
    layer = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=1, bias=True, **options)
    layer(rng.standard_normal((2, 5, 16)))  # the plan made
    return layer


@pytest.mark.parametrize(
    "change",
    ["W_q replaced", "W_o updated in place", "b_q updated in place", "window set",
     "scale set", "softcap set"],
)  # fmt: skip
def test_a_changed_layer_is_computed_as_it_is_now(change, monkeypatch):
    """After the plan is made, an attribute assigned (a weight, a window, the scale, a
    variant) sends the call the general way, and a weight updated in place is read as it
    is now: the output of a layer made afresh in that state."""
    rng = np.random.default_rng(3)
    layer = _layer(rng)
    kept = runtime.DEFAULT.layer_plans.get(layer)
    assert kept is not None
    taken = _spy(monkeypatch)
    if change == "b_q updated in place":
        layer.b_q += 1.0
    elif change == "W_q replaced":
        layer.W_q = layer.W_q * 1.5
    elif change == "W_o updated in place":
        layer.W_o *= 0.5
    elif change == "window set":
        layer.window = 2
    elif change == "scale set":
        layer.scale = 0.1
    else:
        layer.softcap = 5.0
    twin = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=1, bias=True)
    for name, value in vars(layer).items():
        setattr(twin, name, value.copy() if isinstance(value, np.ndarray) else value)
    x = rng.standard_normal((2, 5, 16))
    out = layer(x)
    in_place = change.endswith("in place")
    assert len(taken) == in_place
    now = runtime.DEFAULT.layer_plans.get(layer)
    assert (now is kept) == in_place  # a stale plan dropped (a new one made where plain)
    assert (now is None) == (change == "softcap set")
    with monkeypatch.context() as m:
        _general(m)
        expected = twin(x)
    np.testing.assert_array_equal(out, expected)
    if change in ("W_o updated in place", "b_q updated in place", "window set"):
        np.testing.assert_allclose(out, _reference(layer, x, None), rtol=0, atol=1e-12)


def test_calls_the_plan_does_not_take_are_checked_as_ever(monkeypatch):
    """With a plan kept, an input of another width, shape or dtype, a list, a boolean mask,
    a mask the checks refuse, other workers or any other keyword go the general way: the
    same refusals, the same results."""
    rng = np.random.default_rng(5)
    layer = _layer(rng)
    taken = _spy(monkeypatch)
    x = rng.standard_normal((2, 5, 16))
    with pytest.raises(mha.ShapeError, match="width 17"):
        layer(rng.standard_normal((2, 5, 17)))
    with pytest.raises(mha.AttentionTypeError, match="mask"):
        layer(x, 1.5)
    with pytest.raises(mha.AttentionValueError):
        layer(x, workers=0)

    def calls():
        return {
            "list": layer(x.tolist()), "float32": layer(x.astype(np.float32)),
            "other shape": layer(x[:, :4]), "mask array": layer(x, np.tri(5, dtype=bool)),
            "workers": layer(x, workers=2), "scale": layer(x, scale=0.3),
            "causal=True": layer(x, causal=True),
        }  # fmt: skip

    with monkeypatch.context() as m:
        _general(m)
        expected = calls()
    got = calls()
    assert not taken  # each call above differs from the kept one (and replaces it)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_a_non_finite_value_at_a_hidden_key_is_computed_the_general_way(monkeypatch):
    """An infinite feature in a sequence's last token: causal rows before it never see its
    key, whose value is not finite (``0 * inf`` would spread NaN); the compiled walk leaves
    those tasks and the general path computes the call: the same bits, finite rows where
    the key is hidden."""
    rng = np.random.default_rng(11)
    layer = _layer(rng)
    x = rng.standard_normal((2, 5, 16))
    layer(x, True)  # the causal plan made
    x[0, -1, 0] = np.inf
    out = layer(x, True)
    with monkeypatch.context() as m:
        _general(m)
        expected = layer(x, True)
    np.testing.assert_array_equal(out, expected)
    assert np.isfinite(out[0, :-1]).all() and np.isfinite(out[1]).all()


def test_threads_share_a_plan():
    """Four threads calling one layer at once, each on its own inputs: each gets what a
    call alone gives."""
    rng = np.random.default_rng(12)
    layer = _layer(rng)
    xs = [rng.standard_normal((2, 5, 16)) for _ in range(4)]
    same_in_threads([lambda x=x: layer(x) for x in xs])
    small = runtime.DEFAULT.layer_plans[layer].small  # (the calls' compiled path)
    assert small is not None and 1 <= len(small.spare) <= layer_plan._SPARE


def test_subclasses_and_variants_keep_no_plan():
    """A subclass computes more than the plan (DifferentialAttention's output stage), and
    sinks, ALiBi, soft-capping or QK-norm change the scores or the heads: none keeps a
    plan; neither does a call with a cache (the decoding step's) or asking for weights."""
    rng = np.random.default_rng(6)
    layers = [
        mha.DifferentialAttention(16, 4, seed=1),
        mha.MultiHeadAttention(16, 4, sinks=True, seed=1),
        mha.MultiHeadAttention(16, 4, alibi=True, seed=1),
        mha.MultiHeadAttention(16, 4, softcap=30.0, seed=1),
        mha.MultiHeadAttention(16, 4, qk_norm="head", seed=1),
    ]
    for layer in layers:
        for _ in range(2):
            layer(rng.standard_normal((1, 3, 16)))
        assert layer not in runtime.DEFAULT.layer_plans, type(layer).__name__
    layer = mha.MultiHeadAttention(16, 4, seed=1)
    layer(rng.standard_normal((1, 3, 16)), return_weights=True)
    layer(rng.standard_normal((1, 1, 16)), cache=layer.new_cache(1))
    assert layer not in runtime.DEFAULT.layer_plans


def test_the_plan_holds_no_input_and_goes_with_its_layer():
    """A kept plan holds no input (an input dropped is freed) and goes with its layer."""
    rng = np.random.default_rng(9)
    layer = mha.MultiHeadAttention(16, 4, seed=1)
    x = rng.standard_normal((2, 5, 16))
    layer(x)
    assert layer in runtime.DEFAULT.layer_plans
    dropped = weakref.ref(x)
    del x
    gc.collect()
    assert dropped() is None
    gone = weakref.ref(layer)
    del layer
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("cached", [False, True])
def test_weights_the_checks_converted_are_read_again_each_call(cached, monkeypatch):
    """A weight given as integers is converted by the checks: a plan (or a decoding step)
    holding that copy would miss an update in place of the layer's own array, so none is
    kept and the update is read, as by the general path."""
    rng = np.random.default_rng(14)
    layer = mha.MultiHeadAttention(16, 4, seed=1)
    layer.W_o = np.round(layer.W_o * 10).astype(np.int64)
    cache = layer.new_cache(1, capacity=8) if cached else None
    x = rng.standard_normal((1, 1 if cached else 5, 16))
    layer(x, cache=cache)
    layer.W_o += 1
    if cached:
        layer(x, cache=cache)
        assert layer not in runtime.DEFAULT.layer_steps
    else:
        assert layer not in runtime.DEFAULT.layer_plans
    out = layer(x, cache=cache)
    twin = mha.MultiHeadAttention(16, 4, seed=1)
    twin.W_o = layer.W_o.astype(np.float64)
    twin_cache = twin.new_cache(1, capacity=8) if cached else None
    if cached:
        twin(x, cache=twin_cache)
        twin(x, cache=twin_cache)
    with monkeypatch.context() as m:
        _general(m)
        m.setattr(module, "kept_step", lambda layer: None)
        np.testing.assert_array_equal(out, twin(x, cache=twin_cache))


def test_a_dict_attribute_changed_in_place_drops_the_plan(monkeypatch):
    """``rope_scaling`` is a dict: changed in place, the layer rotates at other angles, so
    the kept plan is dropped and the call computed as a layer made with the new dict
    computes it. (A decoding step is not kept for scaled rotary embeddings.)"""
    rng = np.random.default_rng(15)
    scaling = {"rope_type": "linear", "factor": 2.0}
    layer = mha.MultiHeadAttention(16, 4, rope_theta=10000.0, rope_scaling=scaling, seed=1)
    x = rng.standard_normal((1, 5, 16))
    layer(x)
    assert layer in runtime.DEFAULT.layer_plans
    layer.rope_scaling["factor"] = 8.0
    out = layer(x)
    twin = mha.MultiHeadAttention(
        16, 4, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, seed=1
    )
    with monkeypatch.context() as m:
        _general(m)
        expected = twin(x)
    np.testing.assert_array_equal(out, expected)
    assert (
        np.abs(
            out - layer.__class__(16, 4, rope_theta=10000.0, rope_scaling=scaling, seed=1)(x)
        ).max()
        > 1e-6
    )  # (the change matters)


def test_an_attribute_referring_back_to_the_layer_does_not_keep_it_alive():
    """A layer held by a block that it refers to in turn (``layer.parent``): the cycle is
    the program's own, and the kept plan must not add a strong path to it from the
    runtime's dict, so dropping the block frees the layer."""
    rng = np.random.default_rng(16)

    class Block:
        pass

    block = Block()
    layer = mha.MultiHeadAttention(16, 4, seed=1)
    block.attention, layer.parent = layer, block
    layer(rng.standard_normal((1, 5, 16)))
    assert layer in runtime.DEFAULT.layer_plans
    gone = weakref.ref(layer)
    del layer, block
    gc.collect()
    assert gone() is None


def test_without_the_compiled_walk_no_plan_is_kept(monkeypatch):
    """Where the compiled walk is unavailable (no numba: the core install), a layer keeps
    no plan and every call goes the general way, to the float64 reference's values."""
    monkeypatch.setattr(compiled, "walk_available", lambda: False)
    rng = np.random.default_rng(17)
    layer = mha.MultiHeadAttention(16, 4, seed=1)
    xs = rng.standard_normal((3, 2, 5, 16))
    for x in xs:
        np.testing.assert_allclose(layer(x, True), _reference(layer, x, True), atol=1e-12)
    assert layer not in runtime.DEFAULT.layer_plans


def test_an_attribute_that_takes_no_weak_reference_keeps_no_plan():
    """An attribute neither plain, an array, a container of plain values nor weakly
    referable (a tuple holding an object, which might be the layer's parent) could keep
    the layer alive from the runtime's dict: no plan (and no decoding step) is kept."""
    rng = np.random.default_rng(18)
    layer = mha.MultiHeadAttention(16, 4, seed=1)
    layer.tags = (object(),)
    layer(rng.standard_normal((1, 5, 16)))
    layer(rng.standard_normal((1, 1, 16)), cache=layer.new_cache(1))
    assert layer not in runtime.DEFAULT.layer_plans
    assert layer not in runtime.DEFAULT.layer_steps
