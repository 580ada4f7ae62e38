"""MultiHeadAttention: initialisation as PyTorch does it, and a thin wrapper over the function."""

from __future__ import annotations

import numpy as np
import pytest

import mha
from mha import MultiHeadAttention

r = np.random.default_rng(11)


def test_weights_have_the_function_layout_and_torch_initialisation_bounds():
    E = 64
    attention = MultiHeadAttention(E, 4, seed=0)
    xavier = np.sqrt(6.0 / (E + 3 * E))  # over the packed (3E, E) in-projection
    for W in (attention.W_q, attention.W_k, attention.W_v):
        assert W.shape == (E, E) and W.dtype == np.float64
        assert np.abs(W).max() <= xavier and np.abs(W).max() > 0.95 * xavier
        assert abs(W.std() - xavier / np.sqrt(3)) < 0.05 * xavier  # uniform's std
    linear = 1.0 / np.sqrt(E)  # nn.Linear's default for the output projection
    assert np.abs(attention.W_o).max() <= linear and np.abs(attention.W_o).max() > 0.95 * linear
    assert attention.b_q is None and attention.b_o is None


def test_kdim_vdim_get_their_own_xavier_bounds():
    attention = MultiHeadAttention(32, 4, kdim=16, vdim=48, bias=True, seed=1)
    assert attention.W_k.shape == (16, 32) and attention.W_v.shape == (48, 32)
    assert np.abs(attention.W_k).max() <= np.sqrt(6.0 / (16 + 32))
    assert np.abs(attention.W_v).max() <= np.sqrt(6.0 / (48 + 32))
    assert np.abs(attention.W_q).max() <= np.sqrt(6.0 / (32 + 32))
    for b in (attention.b_q, attention.b_k, attention.b_v, attention.b_o):
        np.testing.assert_array_equal(b, np.zeros(32))


def test_torch_initialisation_has_the_same_bounds(torch):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(64, 4)
    ours = MultiHeadAttention(64, 4, seed=0)
    theirs_in = module.in_proj_weight.detach().abs().max().item()
    theirs_out = module.out_proj.weight.detach().abs().max().item()
    assert abs(theirs_in - np.abs(ours.W_q).max()) < 0.02 * theirs_in
    assert abs(theirs_out - np.abs(ours.W_o).max()) < 0.02 * theirs_out


def test_seed_makes_weights_reproducible():
    a, b = MultiHeadAttention(16, 2, seed=5), MultiHeadAttention(16, 2, seed=5)
    c = MultiHeadAttention(16, 2, seed=np.random.default_rng(5))
    for name in ("W_q", "W_k", "W_v", "W_o"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        np.testing.assert_array_equal(getattr(a, name), getattr(c, name))
    assert not np.array_equal(a.W_q, MultiHeadAttention(16, 2, seed=6).W_q)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dtype_sets_the_weights_dtype(dtype):
    attention = MultiHeadAttention(8, 2, bias=True, dtype=dtype, seed=0)
    assert all(w.dtype == dtype for w in (attention.W_q, attention.W_o, attention.b_v))
    assert attention(r.standard_normal((1, 3, 8)).astype(dtype)).dtype == dtype


def test_repr_is_readable():
    assert repr(MultiHeadAttention(8, 2)) == (
        "MultiHeadAttention(d_model=8, num_heads=2, bias=False, dtype=float64)"
    )
    assert repr(MultiHeadAttention(8, 2, kdim=4, bias=True, dtype=np.float32)) == (
        "MultiHeadAttention(d_model=8, num_heads=2, kdim=4, bias=True, dtype=float32)"
    )


def make_module_and_inputs():
    attention = MultiHeadAttention(12, 3, kdim=5, vdim=7, bias=True, seed=2)
    for name in ("b_q", "b_k", "b_v", "b_o"):
        setattr(attention, name, r.standard_normal(getattr(attention, name).shape))
    X = r.standard_normal((2, 4, 12))
    memory_k, memory_v = r.standard_normal((2, 6, 5)), r.standard_normal((2, 6, 7))
    return attention, X, memory_k, memory_v


def test_forward_equals_the_function_bit_for_bit():
    attention, X, Km, Vm = make_module_and_inputs()
    keywords = {
        "mask": r.random((2, 4, 6)) < 0.8,
        "key_lengths": np.array([6, 2]),
        "causal": True,
        "return_weights": True,
    }
    out, weights = attention.forward(X, key=Km, value=Vm, **keywords)
    expected_out, expected_weights = mha.multi_head_attention(
        X,
        Km,
        Vm,
        attention.W_q,
        attention.W_k,
        attention.W_v,
        attention.W_o,
        3,
        b_q=attention.b_q,
        b_k=attention.b_k,
        b_v=attention.b_v,
        b_o=attention.b_o,
        **keywords,
    )
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(weights, expected_weights)
    np.testing.assert_array_equal(attention(X, key=Km, value=Vm, **keywords)[0], out)


def test_specification_form_forward_x_mask():
    attention = MultiHeadAttention(8, 2, seed=3)
    X = r.standard_normal((2, 5, 8))
    function = lambda **kw: mha.multi_head_attention(  # noqa: E731
        X, X, X, attention.W_q, attention.W_k, attention.W_v, attention.W_o, 2, **kw
    )
    np.testing.assert_array_equal(attention.forward(X), function())
    np.testing.assert_array_equal(attention.forward(X, mask=None), function())
    np.testing.assert_array_equal(attention.forward(X, mask=True), function(causal=True))
    np.testing.assert_array_equal(attention.forward(X, True), function(causal=True))
    mask = r.random((2, 5, 5)) < 0.7
    np.testing.assert_array_equal(attention.forward(X, mask), function(mask=mask))
    np.testing.assert_array_equal(attention.forward(X, mask=mask), function(mask=mask))


def test_value_defaults_to_key_and_key_to_query():
    attention = MultiHeadAttention(8, 2, seed=4)
    X, M = r.standard_normal((2, 3, 8)), r.standard_normal((2, 6, 8))
    np.testing.assert_array_equal(attention(X, key=M), attention(X, key=M, value=M))
    np.testing.assert_array_equal(attention(X), attention(X, key=X, value=X))


def test_unbatched_input():
    attention = MultiHeadAttention(8, 2, seed=4)
    X = r.standard_normal((5, 8))
    np.testing.assert_array_equal(attention(X, mask=True), attention(X[None], mask=True)[0])


def test_the_projections_lie_side_by_side_and_may_be_replaced():
    """Every layer mha makes holds ``W_q``, ``W_k``, ``W_v`` as views of one matrix, read
    in one product (mha.api.checks.side_by_side); updated in place they stay so, and
    replaced by arrays of their own the call reads those (the same result, up to the
    rounding of three products against one)."""
    from mha.api.checks import side_by_side

    rng = np.random.default_rng(8)
    made = MultiHeadAttention(24, 4, num_kv_heads=2, rope_theta=100.0, seed=1)
    weights = {name: rng.standard_normal(W.shape) for name, W in made.parameters().items()}
    read = MultiHeadAttention.from_spec(mha.LayerSpec(num_heads=4, num_kv_heads=2), weights)
    x = rng.standard_normal((2, 7, 24))
    for layer in (made, read):
        joined = side_by_side(layer.W_q, layer.W_k, layer.W_v)
        assert joined is not None and joined.shape == (24, 24 + 12 + 12)
        fused = layer(x, mask=True)
        layer.W_v *= 2.0  # in place: still one matrix
        assert side_by_side(layer.W_q, layer.W_k, layer.W_v) is joined
        doubled = layer(x, mask=True)
        layer.W_v = layer.W_v / 2.0  # an array of its own
        assert side_by_side(layer.W_q, layer.W_k, layer.W_v) is None
        np.testing.assert_allclose(layer(x, mask=True), fused, rtol=1e-13, atol=1e-14)
        assert not np.allclose(doubled, fused)
    assert side_by_side(weights["W_q"], weights["W_k"], weights["W_v"]) is None
    np.testing.assert_array_equal(read.W_q, weights["W_q"])  # the given weights, copied
