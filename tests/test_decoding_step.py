"""A layer's kept decoding step (:mod:`mha.api.decoding`): the same bits as the general
path call after call, taken only while everything it was made from holds, and never where
the general path would refuse or compute something else."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from support.extras import needs_numba
from support.kept import taken

import mha
from mha._kernel import compiled, runtime
from mha.api import decoding, module


def _general(monkeypatch):
    """Every call through the checks and :func:`mha.api.projection.compute`."""
    monkeypatch.setattr(module, "kept_step", lambda layer: None)


def _spy(monkeypatch):
    """The calls the kept step computed (on one worker itself, else by ``compute``)."""
    return taken(monkeypatch, decoding.DecodingStep)


CONFIGS = {
    "gqa, rotary": dict(num_heads=8, num_kv_heads=2, rope_theta=10000.0),
    "interleaved, partial rotary": dict(
        num_heads=4, num_kv_heads=4, rope_theta=500.0, rotary_dim=8, rotary_interleaved=True
    ),
    "biases, no rotary": dict(num_heads=4, num_kv_heads=1, bias=True),
    "one kv head, rotary": dict(num_heads=4, num_kv_heads=1, rope_theta=10000.0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("workers", [None, 1, 2])
def test_the_kept_step_gives_the_general_paths_bits(name, dtype, workers, monkeypatch):
    """A prompt of ragged lengths, then steps of a batch of 3 (the cache growing on the
    way): every output, the cache's keys, values and lengths, bit for bit the general
    path's; the step is taken for every step but the first (which makes it), on one
    worker by itself (:meth:`DecodingStep._on_one_worker`) but where the cache grows."""
    rng = np.random.default_rng(7)
    layer = mha.MultiHeadAttention(32, seed=2, dtype=dtype, **CONFIGS[name])
    prompt = rng.standard_normal((3, 5, 32)).astype(dtype)
    steps = [rng.standard_normal((3, 1, 32)).astype(dtype) for _ in range(7)]

    def run():
        runtime.DEFAULT.forget()  # (no step kept from an earlier run)
        cache = layer.new_cache(3, capacity=6)
        outs = [layer(prompt, cache=cache, query_lengths=[5, 2, 4], workers=workers)]
        outs += [layer(x, cache=cache, workers=workers) for x in steps]
        return outs, cache

    taken = _spy(monkeypatch)
    itself, on_one_worker = [], decoding.DecodingStep._on_one_worker

    def spied(*args):
        out = on_one_worker(*args)
        itself.append(out is not None)
        return out

    monkeypatch.setattr(decoding.DecodingStep, "_on_one_worker", spied)
    own, own_cache = run()
    assert len(taken) == len(steps) - 1
    one_worker = workers == 1 or workers is None  # (None: one, for calls this small)
    walked = compiled.walk_available()  # (its walk: without numba, compute's)
    assert itself == ([False, *[walked] * 5] if one_worker else [])  # (grown at the first)
    with monkeypatch.context() as m:
        _general(m)
        general, general_cache = run()
    for a, b in zip(own, general, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    for field in ("lengths", "k", "v"):
        np.testing.assert_array_equal(getattr(own_cache, field), getattr(general_cache, field))


def _layer_and_cache(rng, bias=False):
    layer = mha.MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0, seed=1, bias=bias)
    cache = layer.new_cache(2, capacity=16)
    layer(rng.standard_normal((2, 3, 16)), cache=cache)
    layer(rng.standard_normal((2, 1, 16)), cache=cache)  # the step made
    return layer, cache


def _twin(layer, cache):
    """The same layer state and cache, on their own (for the general path)."""
    twin = mha.MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0, seed=1, bias=True)
    for name, value in vars(layer).items():
        setattr(twin, name, value.copy() if isinstance(value, np.ndarray) else value)
    copy = twin.new_cache(2, capacity=16)
    copy._k, copy._v = cache._k.copy(), cache._v.copy()
    copy._lengths, copy._first = cache._lengths.copy(), cache._first.copy()
    return twin, copy


@pytest.mark.parametrize(
    "change",
    [
        "W_q replaced", "W_o updated in place", "b_q updated in place", "window set",
        "scale set", "softcap set",
    ],
)  # fmt: skip
def test_a_changed_layer_is_computed_as_it_is_now(change, monkeypatch):
    """After the step is made, an attribute assigned (a weight, a window, the scale, a
    variant) sends the call the general way, and a weight updated in place is read as it
    is now: the output of a layer made afresh in that state."""
    rng = np.random.default_rng(3)
    layer, cache = _layer_and_cache(rng, bias=True)
    taken = _spy(monkeypatch)
    kept = runtime.DEFAULT.layer_steps.get(layer)
    assert kept is not None
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
    twin, copy = _twin(layer, cache)
    x = rng.standard_normal((2, 1, 16))
    out = layer(x, cache=cache)
    in_place = change.endswith("in place")
    assert len(taken) == in_place
    now = runtime.DEFAULT.layer_steps.get(layer)
    assert (now is kept) == in_place  # a stale step dropped (a new one made where plain)
    assert (now is None) == (change in ("window set", "softcap set"))
    with monkeypatch.context() as m:
        _general(m)
        expected = twin(x, cache=copy)
    np.testing.assert_array_equal(out, expected)


def test_calls_the_step_does_not_take_are_checked_as_ever(monkeypatch):
    """With a step kept, a cache of another dtype, batch or kind, a query of another shape,
    other workers or any other keyword go the general way: the same refusals (the cache
    unchanged), the same results."""
    rng = np.random.default_rng(5)
    layer, cache = _layer_and_cache(rng)
    taken = _spy(monkeypatch)
    before = cache.lengths.copy()
    with pytest.raises(mha.AttentionTypeError, match="float32"):
        layer(rng.standard_normal((2, 1, 16)), cache=mha.KVCache(2, 2, 4, dtype=np.float32))
    with pytest.raises(mha.ShapeError, match="batch"):
        layer(rng.standard_normal((2, 1, 16)), cache=mha.KVCache(3, 2, 4, dtype=np.float64))
    with pytest.raises(mha.ShapeError, match="width"):
        layer(rng.standard_normal((2, 1, 17)), cache=cache)
    np.testing.assert_array_equal(cache.lengths, before)
    paged = mha.PagedKVCache(8, 4, 2, 4, dtype=np.float64)
    paged.add("a")
    paged.add("b")
    x = rng.standard_normal((2, 1, 16))
    layer(x, cache=paged)
    layer(x, cache=cache, query_lengths=[1, 0])
    layer(x, cache=cache, workers=2)
    assert not taken
    np.testing.assert_array_equal(cache.lengths, np.add(before, [2, 1]))


def test_subclasses_and_variants_get_no_step():
    """A subclass computes more than the step (DifferentialAttention's output stage), and a
    layer with sinks, ALiBi or a windowed cache changes the scores or the keys: none keeps
    a step."""
    rng = np.random.default_rng(6)
    layers = [
        mha.DifferentialAttention(16, 4, seed=1),
        mha.MultiHeadAttention(16, 4, sinks=True, seed=1),
        mha.MultiHeadAttention(16, 4, alibi=True, seed=1),
        mha.MultiHeadAttention(16, 4, window=4, seed=1),
    ]
    for layer in layers:
        cache = layer.new_cache(1, capacity=8)
        for _ in range(3):
            layer(rng.standard_normal((1, 1, 16)), cache=cache)
        assert layer not in runtime.DEFAULT.layer_steps, type(layer).__name__


def test_the_step_holds_neither_the_cache_nor_the_layer():
    """A kept step holds no cache (a cache dropped is freed) and goes with its layer."""
    rng = np.random.default_rng(9)
    layer, cache = _layer_and_cache(rng)
    assert layer in runtime.DEFAULT.layer_steps
    dropped = weakref.ref(cache)
    del cache
    gc.collect()
    assert dropped() is None
    gone = weakref.ref(layer)
    del layer
    gc.collect()
    assert gone() is None


def test_a_step_is_kept_only_from_a_call_with_every_keyword_left_out(monkeypatch):
    """A cached call with its own scale (or budget) makes no step: the next plain call is
    computed with the layer's scale, as the general path computes it."""
    rng = np.random.default_rng(12)
    layer = mha.MultiHeadAttention(16, 4, rope_theta=10000.0, seed=1)
    cache = layer.new_cache(1, capacity=8)
    twin_cache = layer.new_cache(1, capacity=8)
    xs = rng.standard_normal((4, 1, 1, 16))
    for x in xs[:2]:
        layer(x, cache=cache, scale=3.0)
        layer(x, cache=cache, max_memory=2**16)
    with monkeypatch.context() as m:
        _general(m)
        for x in xs[:2]:
            layer(x, cache=twin_cache, scale=3.0)
            layer(x, cache=twin_cache, max_memory=2**16)
        expected = layer(xs[2], cache=twin_cache)
    np.testing.assert_array_equal(layer(xs[2], cache=cache), expected)


def test_weights_cast_for_a_call_are_cast_again_after_an_update_in_place():
    """A float32 layer called with float64 queries computes with its weights cast to
    float64, cast again each call: an update in place is seen, as by a layer made with
    the new values."""
    rng = np.random.default_rng(13)
    layer = mha.MultiHeadAttention(16, 4, seed=1, dtype=np.float32)
    x = rng.standard_normal((1, 3, 16))
    layer(x)
    layer.W_q *= 2.0
    fresh = mha.MultiHeadAttention(16, 4, seed=1, dtype=np.float32)
    fresh.W_q = layer.W_q.copy()
    np.testing.assert_array_equal(layer(x), fresh(x))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lse", [False, True])
def test_a_decoding_steps_features_are_the_bands(dtype, lse):
    """What a decoding step's kernel call sets (:func:`mha._kernel.walk.features`) is
    within what ``attend_band`` asks the compiled walk about, so the walk it takes is the
    one ``walk.choose`` would give it."""
    from mha._kernel import forward, walk
    from mha._kernel.call import KernelCall, Outputs
    from mha.api import cached

    filled, counts = np.array([3, 5]), np.ones(2, np.int64)
    q = np.zeros((2, 4, 1, 8), dtype)
    k = np.zeros((2, 2, 5, 8), dtype)
    visibility = cached.plain_visibility(q, filled, counts, filled - 1, np.zeros(2, np.int64))
    outputs = Outputs(np.zeros((2, 4, 1, 8), dtype))
    if lse:
        outputs.lse = np.zeros((2, 4, 1), dtype)
    call = KernelCall(q, k, k, visibility, 0.5, budget=2**20)
    arrays = (q, k, k, outputs.out) if not lse else (q, k, k, outputs.out, outputs.lse)
    needs = walk.features(call, outputs, arrays)
    assert needs <= {*forward.BAND_FEATURES, f"dtype {np.dtype(dtype).name}"}


def test_a_kept_step_the_walk_leaves_is_computed_by_the_general_route(monkeypatch):
    """When the compiled walk leaves a kept step's task on one worker (as it does a
    non-finite value at a hidden key), :func:`attend` computes the step from the start:
    the general path's output and cache, bit for bit, with the walk leaving the same."""
    from mha._kernel import compiled
    from mha._kernel import forward as kernel_forward
    from mha.api import cached

    needs_numba(compiled.walk_available(), "the general path computes every step")
    rng = np.random.default_rng(14)
    xs = rng.standard_normal((3, 2, 1, 16))

    def run():
        layer, cache = _layer_and_cache(np.random.default_rng(3))
        return [layer(x, cache=cache) for x in xs], cache  # (one worker: the step's choice)

    real_walk, real_attend = compiled.forward_walk, kernel_forward.attend
    attended = []

    def leaves_one(dtype, work, *rest):
        real_walk(dtype, work, *rest)
        work[2][:1] = True

    monkeypatch.setattr(compiled, "forward_walk", leaves_one)
    with monkeypatch.context() as m:
        _general(m)
        expected, expected_cache = run()
    monkeypatch.setattr(cached, "attend", lambda *a: attended.append(1) or real_attend(*a))
    taken = _spy(monkeypatch)
    outs, cache = run()
    assert len(taken) == len(xs) and len(attended) == len(xs)
    for a, b in zip(outs, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    for field in ("lengths", "k", "v"):
        np.testing.assert_array_equal(getattr(cache, field), getattr(expected_cache, field))


def test_a_kept_step_that_fails_leaves_the_cache_as_it_was(monkeypatch):
    """An error inside a kept step's walk (Ctrl-C, say) reaches the caller and leaves the
    cache as it was: its lengths, and the keys and values it holds (slots past a length are
    free, as a truncation leaves them); the next step, kept, is the general path's."""
    from mha._kernel import compiled

    needs_numba(compiled.walk_available(), "the general path computes every step")
    rng = np.random.default_rng(15)
    layer, cache = _layer_and_cache(rng)
    x = rng.standard_normal((2, 1, 16))
    before = {field: getattr(cache, field).copy() for field in ("lengths", "k", "v")}
    twin, twin_cache = _twin(layer, cache)
    taken = _spy(monkeypatch)

    def interrupted(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(compiled, "forward_walk", interrupted)
        with pytest.raises(KeyboardInterrupt):
            layer(x, cache=cache)
    assert not taken  # (it raised)
    np.testing.assert_array_equal(cache.lengths, before["lengths"])
    held = int(before["lengths"].max())  # (both sequences hold as many)
    for field in ("k", "v"):
        np.testing.assert_array_equal(
            getattr(cache, field)[:, :, :held], before[field][:, :, :held], err_msg=field
        )
    with monkeypatch.context() as m:
        _general(m)
        expected = twin(x, cache=twin_cache)
    np.testing.assert_array_equal(layer(x, cache=cache), expected)
    assert len(taken) == 1
