"""A ``score_mod`` traced into one compiled pass per tile (:mod:`mha._kernel.traced`): the
same scores as the function's own NumPy passes (NumPy's bits for arithmetic; the walks'
``tanh`` within 4 ulp; libm's ``exp``, ``cos`` ... within an ulp or two), functions it
cannot trace called on each tile as before, and a loop that differs never used."""

from __future__ import annotations

import numpy as np
import pytest
from support.extras import needs_numba

import mha
from mha._kernel import compiled, traced

SLOPES = mha.alibi_slopes(4).astype(np.float32)
TABLE = np.linspace(-1.0, 1.0, 4)


def alibi(s, b, h, q, kv):
    return s + SLOPES[h] * (kv - q).astype(np.float32)


def softcap(s, b, h, q, kv):
    cap = np.float32(3.0)
    return cap * np.tanh(s / cap)


def tilt(s, b, h, q, kv):
    return s + 0.1 * (h + 1) * np.cos(q - kv) + 0.01 * b


def buckets(s, b, h, q, kv):  # integer // and %, comparisons, booleans, np.where
    near = ((q - kv) // 3 < 2) & ~((kv % 5) == 0)
    return np.where(near, s * TABLE[h], -s) / 2


def exponent(s, b, h, q, kv):
    return s - np.log(1.0 + np.exp(-np.abs(s))) + np.sqrt(np.abs(q - kv) + 1.0)


ARITHMETIC = {"alibi": alibi, "buckets": buckets}  # NumPy's bits
FUNCTIONS = ARITHMETIC | {"softcap": softcap, "tilt": tilt, "exponent": exponent}


@pytest.fixture
def tracing():
    needs_numba(compiled.available(), "score_mod is called on each tile")
    traced._KERNELS.loops.clear()
    traced._KERNELS.checked.clear()


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 4, 150, 16)).astype(dtype) for _ in range(3))
    return q, k, v


def _untraced(monkeypatch):
    monkeypatch.setattr(traced, "trace", lambda *args: None)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_traced_score_mod_gives_the_functions_scores(tracing, monkeypatch, name, dtype):
    q, k, v = _inputs(dtype)
    keywords = {"causal": True, "score_mod": FUNCTIONS[name], "max_memory": 2**16}
    ours = mha.scaled_dot_product_attention(q, k, v, **keywords)
    checks = traced._KERNELS.checks(FUNCTIONS[name])
    assert checks and all(checks.values())  # traced, and checked
    with monkeypatch.context() as patch:
        _untraced(patch)
        theirs = mha.scaled_dot_product_attention(q, k, v, **keywords)
    if name in ARITHMETIC:
        np.testing.assert_array_equal(ours, theirs)
    else:
        scale = np.abs(theirs).max()  # scores within a few ulp: outputs within rounding
        assert np.abs(ours - theirs).max() <= (1e-13 if dtype == np.float64 else 2e-6) * scale


def test_a_traced_gradient_gives_the_functions_gradients(tracing, monkeypatch):
    q, k, v = _inputs(np.float64, seed=1)
    grad = np.random.default_rng(2).standard_normal(q.shape)

    def gradient(s, b, h, q, kv):
        t = np.tanh(s / 3.0)
        return 1.0 - t * t

    keywords = {"causal": True, "score_mod": lambda s, b, h, i, j: 3.0 * np.tanh(s / 3.0)}
    keywords["score_mod_grad"] = gradient
    results = []
    for patched in (False, True):
        with monkeypatch.context() as patch:
            if patched:
                _untraced(patch)
            out, backward = mha.scaled_dot_product_attention(
                q, k, v, **keywords, return_backward=True
            )
            results.append([out, *backward(grad).values()])
    for ours, theirs in zip(*results, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-13, atol=1e-15)


def test_an_array_changed_between_calls_is_read_as_it_is(tracing):
    q, k, v = _inputs(np.float32)
    table = np.array([0.5, 1.0, 2.0, 4.0], np.float32)

    def scaled(s, b, h, q, kv):
        return s * table[h]

    first = mha.scaled_dot_product_attention(q, k, v, score_mod=scaled)
    table[:] = 1.0
    second = mha.scaled_dot_product_attention(q, k, v, score_mod=scaled)
    plain = mha.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(second, plain, rtol=1e-6, atol=1e-7)
    assert np.abs(first - plain).max() > 1e-3


@pytest.mark.parametrize(
    "function",
    [
        lambda s, b, h, q, kv: s * 0.5 if s.shape[-1] > 0 else s,  # an attribute
        lambda s, b, h, q, kv: s + np.arange(s.shape[-1]),  # an array along the keys
        lambda s, b, h, q, kv: s + (1.0 if (q > 3).any() else 0.0),  # a branch
        lambda s, b, h, q, kv: np.maximum(s, -1.0),  # a ufunc it does not take
        # what the loop's Python would compute otherwise than NumPy (the review's cases):
        lambda s, b, h, q, kv: s + ((q // 60) & 1),  # & of integers: bitwise in NumPy
        lambda s, b, h, q, kv: s + (q // 60).astype(bool),  # a cast to booleans
        lambda s, b, h, q, kv: s + ((q > 60) + (q > 100)),  # True + True is True in NumPy
        lambda s, b, h, q, kv: s + np.logical_and(q // 60, kv // 60),  # of integers
        lambda s, b, h, q, kv: np.where((q > 60) & (kv < 2**63), s, -s),  # beyond int64
        lambda s, b, h, q, kv: s + ((kv - q) * 2.5).astype(np.uint8),  # wraps in NumPy
    ],
    ids=["attribute", "array of the keys", "branch", "maximum", "bitwise integers",
         "to booleans", "boolean sum", "logical integers", "a large integer", "to uint8"],
)  # fmt: skip
def test_what_cannot_be_traced_is_called_on_each_tile(tracing, monkeypatch, function):
    q, k, v = _inputs(np.float64)
    ours = mha.scaled_dot_product_attention(q, k, v, score_mod=function)
    assert not traced._KERNELS.loops
    with monkeypatch.context() as patch:
        _untraced(patch)
        theirs = mha.scaled_dot_product_attention(q, k, v, score_mod=function)
    np.testing.assert_array_equal(ours, theirs)


def test_a_constant_that_changes_compiles_nothing_new(tracing):
    """Scalars are the loop's arguments: a closure over a new value reuses the loop."""
    q, k, v = _inputs(np.float64)
    results = []
    for cap in (2.0, 3.0, 5.0):

        def capped(s, b, h, q, kv, cap=cap):
            return cap * np.tanh(s / cap)

        results.append((cap, mha.scaled_dot_product_attention(q, k, v, score_mod=capped)))
    assert len(traced._KERNELS.loops) == 1
    for cap, ours in results:
        expected = mha.scaled_dot_product_attention(q, k, v, softcap=cap)
        assert np.abs(ours - expected).max() <= 1e-13 * np.abs(expected).max()


def test_a_loop_that_differs_from_its_function_is_never_used(tracing, monkeypatch):
    q, k, v = _inputs(np.float64)
    monkeypatch.setattr(traced, "_close", lambda *args: False)
    ours = mha.scaled_dot_product_attention(q, k, v, score_mod=alibi)
    assert list(traced._KERNELS.checks(alibi).values()) == [False]
    monkeypatch.setattr(traced, "_compile", None)  # never compiled again, never run
    again = mha.scaled_dot_product_attention(q, k, v, score_mod=alibi)
    with monkeypatch.context() as patch:
        _untraced(patch)
        theirs = mha.scaled_dot_product_attention(q, k, v, score_mod=alibi)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(again, theirs)


def test_the_errors_of_a_score_mod_are_its_own():
    def in_place(s, b, h, q, kv):
        s += 1.0
        return s

    def fails(s, b, h, q, kv):
        raise RuntimeError("a score_mod that fails")

    q = np.ones((1, 2, 3, 4))
    with pytest.raises(mha.AttentionValueError, match="in place; return"):
        mha.scaled_dot_product_attention(q, q, q, score_mod=in_place)
    with pytest.raises(RuntimeError, match="fails"):
        mha.scaled_dot_product_attention(q, q, q, score_mod=fails)
    with pytest.raises(mha.ShapeError, match="score's shape"):
        mha.scaled_dot_product_attention(q, q, q, score_mod=lambda s, b, h, i, j: s[..., :1])
