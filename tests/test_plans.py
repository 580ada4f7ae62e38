"""Plain calls run by a plan kept per call signature (``mha.api.plans``): the same bits as
the unplanned path, the same refusals, and the unplanned path wherever the plan cannot do
the call. Without the compiled walk (no numba, ``MHA_COMPILED=0``) nothing is planned and
these tests check that every call takes the unplanned path."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import mha
from mha._kernel import compiled, runtime
from mha.api import plans, split_heads

r = np.random.default_rng(20)


def unplanned(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(split_heads, "planned_attention", lambda *a: None)
        return mha.scaled_dot_product_attention(*args, **kwargs)


def arrays(shape_q, shape_k, dtype=np.float32, d_v=None):
    q = r.standard_normal(shape_q).astype(dtype)
    k = r.standard_normal(shape_k).astype(dtype)
    v = r.standard_normal((*shape_k[:-1], d_v or shape_k[-1])).astype(dtype)
    return q, k, v


CALLS = [  # (q shape, k shape, dtype, options)
    ((1, 32, 1, 128), (1, 8, 1024, 128), np.float32, {}),  # a decoding step, grouped heads
    ((1, 32, 1, 128), (1, 8, 1024, 128), np.float32, {"causal": True, "window": 300}),
    ((2, 4, 70, 16), (2, 4, 90, 16), np.float64, {"causal": True, "return_lse": True}),
    ((1, 1, 3, 32), (1, 1, 5000, 32), np.float32, {"workers": 2}),  # split keys
    ((1, 1, 3, 32), (1, 1, 5000, 32), np.float64, {"workers": 2, "return_lse": True}),
    ((3, 2, 40, 8), (3, 2, 40, 8), np.float32, {"scale": 0.3, "max_memory": 20000}),
    ((4, 50, 16), (4, 60, 16), np.float64, {"causal": True, "workers": 1}),  # no batch axes
    ((2, 3, 2, 9, 8), (2, 3, 1, 11, 8), np.float32, {}),  # two batch axes
]


@pytest.mark.parametrize(("shape_q", "shape_k", "dtype", "options"), CALLS)
def test_a_planned_call_gives_the_unplanned_bits(monkeypatch, shape_q, shape_k, dtype, options):
    q, k, v = arrays(shape_q, shape_k, dtype)
    expected = unplanned(monkeypatch, q, k, v, **options)
    first = mha.scaled_dot_product_attention(q, k, v, **options)  # plans it
    again = mha.scaled_dot_product_attention(q, k, v, **options)  # by the kept plan
    if compiled.walk_available():
        assert len(runtime.DEFAULT.plans) == 1
    else:
        assert not runtime.DEFAULT.plans
    listed = lambda x: list(x) if isinstance(x, tuple) else [x]  # noqa: E731
    for result in (first, again):
        for ours, theirs in zip(listed(result), listed(expected), strict=True):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            np.testing.assert_array_equal(ours, theirs)


def test_a_kept_plan_takes_new_arrays_of_its_shapes(monkeypatch):
    q, k, v = arrays((1, 8, 1, 64), (1, 2, 700, 64))
    mha.scaled_dot_product_attention(q, k, v)
    q2, k2, v2 = arrays((1, 8, 1, 64), (1, 2, 700, 64))
    ours = mha.scaled_dot_product_attention(q2, k2, v2)
    np.testing.assert_array_equal(ours, unplanned(monkeypatch, q2, k2, v2))
    dense = np.einsum("hgd,hsd->hgs", q2[0].reshape(2, 4, 64).astype(np.float64), k2[0]) / 8.0
    weights = np.exp(dense - dense.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("hgs,hsd->hgd", weights, v2[0]).reshape(1, 8, 1, 64)
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=2e-6)


def test_views_and_strides_are_planned_apart(monkeypatch):
    q, k, v = arrays((2, 4, 30, 16), (2, 4, 40, 16), np.float64)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # rows apart
    for keys in (k, kt, k[:, :, ::-1]):
        ours = mha.scaled_dot_product_attention(q, keys, v, causal=True)
        np.testing.assert_array_equal(ours, unplanned(monkeypatch, q, keys, v, causal=True))


@pytest.mark.parametrize(("bad", "error", "match"), [
    ({"causal": 1}, mha.AttentionTypeError, "causal must be True or False"),
    ({"workers": 0}, mha.AttentionValueError, "workers"),
    ({"scale": -1.0}, mha.AttentionValueError, "scale must be a positive number"),
    ({"window": 0}, mha.AttentionValueError, "window"),
    ({"max_memory": -5}, mha.AttentionValueError, "max_memory"),
])  # fmt: skip
def test_what_the_checks_refuse_is_refused_after_a_plan_is_kept(bad, error, match):
    q, k, v = arrays((1, 4, 1, 16), (1, 4, 50, 16))
    mha.scaled_dot_product_attention(q, k, v, causal=True)
    mha.scaled_dot_product_attention(q, k, v, causal=True)
    with pytest.raises(error, match=match):
        mha.scaled_dot_product_attention(q, k, v, **{"causal": True, **bad})


def test_refused_shapes_are_refused_and_nothing_is_kept():
    q, k, v = arrays((1, 4, 1, 16), (1, 3, 50, 16))
    with pytest.raises(mha.ShapeError, match="3 key/value heads do not divide 4"):
        mha.scaled_dot_product_attention(q, k, v)
    assert not runtime.DEFAULT.plans


def test_a_hidden_non_finite_value_goes_to_the_unplanned_path(monkeypatch):
    q, k, v = arrays((1, 2, 8, 16), (1, 2, 8, 16), np.float64)
    v[0, 0, 7] = np.inf  # hidden from every query row but the last by causal
    mha.scaled_dot_product_attention(q, k, v, causal=True)
    ours = mha.scaled_dot_product_attention(q, k, v, causal=True)
    expected = unplanned(monkeypatch, q, k, v, causal=True)
    np.testing.assert_array_equal(ours, expected)
    assert np.isfinite(ours[0, 0, :7]).all() and not np.isfinite(ours[0, 0, 7]).all()


def test_unaligned_arrays_take_the_unplanned_path(monkeypatch):
    q, k, v = arrays((1, 2, 5, 8), (1, 2, 9, 8))
    raw = np.empty(k.nbytes + 1, np.uint8)
    shifted = raw[1:].view(np.float32).reshape(k.shape)  # one byte off: not aligned
    shifted[...] = k
    assert not shifted.flags.aligned
    mha.scaled_dot_product_attention(q, k, v)  # plans the shapes and strides
    ours = mha.scaled_dot_product_attention(q, shifted, v)
    np.testing.assert_array_equal(ours, unplanned(monkeypatch, q, shifted, v))
    np.testing.assert_allclose(ours, unplanned(monkeypatch, q, k, v), rtol=1e-5, atol=1e-6)


def test_plans_kept_are_bounded():
    for S in range(1, runtime.DEFAULT.plans.most + 10):
        q, k, v = arrays((1, 1, 1, 4), (1, 1, S, 4))
        mha.scaled_dot_product_attention(q, k, v)
        assert len(runtime.DEFAULT.plans) <= runtime.DEFAULT.plans.most


def test_inputs_are_not_modified_and_outputs_are_fresh():
    q, k, v = arrays((1, 4, 3, 16), (1, 4, 50, 16))
    copies = [x.copy() for x in (q, k, v)]
    first = mha.scaled_dot_product_attention(q, k, v)
    second = mha.scaled_dot_product_attention(q, k, v)
    assert first is not second and not np.shares_memory(first, second)
    for x, copy in zip((q, k, v), copies, strict=True):
        np.testing.assert_array_equal(x, copy)


def test_threads_sharing_a_plan_get_the_same_bits(monkeypatch):
    q, k, v = arrays((1, 8, 1, 32), (1, 2, 3000, 32))
    expected = unplanned(monkeypatch, q, k, v, workers=2)
    results, errors = [], []

    def call():
        try:
            for _ in range(20):
                results.append(mha.scaled_dot_product_attention(q, k, v, workers=2))
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(results) == 60
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_a_signature_the_walk_does_not_take_is_kept_as_such(monkeypatch):
    q, k, v = arrays((1, 2, 4, 8), (1, 2, 6, 8))
    broadcast = np.broadcast_to(k[:, :, :1], k.shape)  # every key the same row: stride 0
    first = mha.scaled_dot_product_attention(q, broadcast, v)
    assert list(runtime.DEFAULT.plans.values()) == ([None] if compiled.walk_available() else [])
    planned = []
    monkeypatch.setattr(plans, "_plan", lambda *a: planned.append(a))
    second = mha.scaled_dot_product_attention(q, broadcast, v)
    assert not planned  # not planned again
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(second, unplanned(monkeypatch, q, broadcast, v))


# A layer's checked call, kept for its next call of the same signature (plans.checked_layer)


def layer_and_input(dtype=np.float64, **options):
    layer = mha.MultiHeadAttention(16, 4, seed=3, dtype=dtype, **options)
    return layer, r.standard_normal((2, 5, 16)).astype(dtype)


def fresh(layer, *args, **kwargs):
    """The layer's call checked afresh (nothing kept for it)."""
    runtime.DEFAULT.layer_checks.pop(layer, None)
    out = layer(*args, **kwargs)
    runtime.DEFAULT.layer_checks.pop(layer, None)
    return out


@pytest.mark.parametrize(
    "options", [{}, {"bias": True}, {"qk_norm": "head"}, {"output_gate": "sigmoid"}]
)
def test_a_layer_call_checked_once_takes_new_inputs(options):
    layer, x = layer_and_input(**options)
    layer(x, True)
    assert layer in runtime.DEFAULT.layer_checks  # kept: every array taken as given
    for _ in range(2):
        y = r.standard_normal(x.shape)
        np.testing.assert_array_equal(layer(y, True), fresh(layer, y, True))
    np.testing.assert_array_equal(layer(y), fresh(layer, y))  # other keywords: checked afresh


def test_a_layer_kept_check_sees_its_weights_replaced_and_updated_in_place():
    layer, x = layer_and_input(bias=True)
    before = layer(x)
    layer.W_q = layer.W_q * 2.0  # a new array
    replaced = layer(x)
    assert not np.array_equal(replaced, before)
    np.testing.assert_array_equal(replaced, fresh(layer, x))
    layer.b_v += 1.0  # the same array, updated in place
    np.testing.assert_array_equal(layer(x), fresh(layer, x))
    assert not np.array_equal(layer(x), replaced)


def test_a_layer_kept_check_refuses_what_the_checks_refuse():
    layer, x = layer_and_input()
    layer(x)
    with pytest.raises(mha.ShapeError, match="query"):
        layer(x[..., :8])  # another width: checked afresh, and refused
    layer.W_k = layer.W_k[:, :8]  # a weight of another shape
    with pytest.raises(mha.ShapeError):
        layer(x)
    layer, x = layer_and_input()
    layer(x)
    np.testing.assert_array_equal(layer(x, key=x[:, :3], value=x[:, :3]),
                                  fresh(layer, x, key=x[:, :3], value=x[:, :3]))  # fmt: skip


def test_a_layer_check_is_not_kept_for_weights_it_converted():
    layer, x = layer_and_input()
    layer.W_o = layer.W_o.tolist()  # a list: the checks make an array of it
    layer(x)
    assert layer not in runtime.DEFAULT.layer_checks
    layer, x = layer_and_input()
    layer(x.astype(np.float32))  # float32 inputs: taken as they are, weights float64
    assert layer in runtime.DEFAULT.layer_checks
    layer(x.tolist())  # a list: converted per call, never kept
    np.testing.assert_array_equal(layer(x.tolist()), fresh(layer, x))


@pytest.mark.parametrize(
    "options",
    [
        {"rope_theta": 100.0},
        {"rope_theta": 100.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0,
                                               "max_position_embeddings": 8}},
        {"num_kv_heads": 2, "window": 4, "qk_norm": "head"},
    ],
)  # fmt: skip
def test_a_layer_with_a_cache_keeps_its_check_and_checks_the_cache_every_call(options):
    """A decoding loop's calls are checked once; what depends on the cache (what it holds,
    where the new tokens sit, its room) is worked out every call: the same bits and the
    same refusals as calls checked afresh, each with a cache of its own."""
    layer = mha.MultiHeadAttention(16, 4, seed=3, **options)
    twin = mha.MultiHeadAttention(16, 4, seed=3, **options)  # checked afresh every call
    kept_cache, fresh_cache = layer.new_cache(2, capacity=12), twin.new_cache(2, capacity=12)
    steps = [r.standard_normal((2, n, 16)) for n in (5, 1, 1, 2, 1)]
    for x in steps:
        np.testing.assert_array_equal(layer(x, cache=kept_cache), fresh(twin, x, cache=fresh_cache))
        # (a dict-valued keyword, the rope scaling, is the call's own: checked every call)
        assert (layer in runtime.DEFAULT.layer_checks) == ("rope_scaling" not in options)
    np.testing.assert_array_equal(kept_cache.lengths, [10, 10])  # (past 12: grown)
    H_kv = options.get("num_kv_heads", 4)
    wrong = mha.KVCache(2, H_kv, 4, dtype=np.float32)  # the kept call's, but float32
    messages = []
    for call in (layer, twin):
        with pytest.raises(mha.AttentionTypeError, match="holds float32") as refused:
            call(steps[1], cache=wrong) if call is layer else fresh(twin, steps[1], cache=wrong)
        messages.append(str(refused.value))
        np.testing.assert_array_equal(wrong.lengths, [0, 0])  # unchanged
    assert messages[0] == messages[1]
    other, others = layer.new_cache(3), twin.new_cache(3)  # another cache, another batch
    x = r.standard_normal((3, 2, 16))
    np.testing.assert_array_equal(layer(x, cache=other), fresh(twin, x, cache=others))
    with pytest.raises(mha.ShapeError, match="batch"):  # the kept check is the new call's
        layer(r.standard_normal((2, 1, 16)), cache=other)


def test_a_kept_check_does_not_hold_the_cache():
    import gc
    import weakref

    layer, x = layer_and_input()
    cache = layer.new_cache(2)
    layer(x, cache=cache)
    assert layer in runtime.DEFAULT.layer_checks
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None
