"""Values of another head width than the keys' (MiMo-V2-Flash: ``v_head_dim`` 128 beside
``head_dim`` 192): ``MultiHeadAttention(v_head_dim=)``, its weights shaped by it, checked
against torch written from the definition, forward and backward, step by step through a
cache, and kept by its spec and saved files."""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import relative_error

import mha

E, H, H_KV, D, DV = 12, 4, 2, 6, 10


def layer(**options):
    return mha.MultiHeadAttention(E, H, num_kv_heads=H_KV, head_dim=D, v_head_dim=DV, seed=1,
                                  bias=True, **options)  # fmt: skip


def torch_layer(torch, attention, X):
    """Causal grouped-query attention from its definition, values ``DV`` wide."""
    t = {name: torch.tensor(W, requires_grad=True) for name, W in attention.parameters().items()}
    x = torch.tensor(X, requires_grad=True)
    B, L = X.shape[:2]
    q = (x @ t["W_q"] + t["b_q"]).reshape(B, L, H, D).transpose(1, 2)
    k = (x @ t["W_k"] + t["b_k"]).reshape(B, L, H_KV, D).transpose(1, 2)
    v = (x @ t["W_v"] + t["b_v"]).reshape(B, L, H_KV, DV).transpose(1, 2)
    k, v = (a.repeat_interleave(H // H_KV, dim=1) for a in (k, v))
    heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return heads.transpose(1, 2).reshape(B, L, H * DV) @ t["W_o"] + t["b_o"], t, x


def test_the_layer_and_its_gradients_match_torch(torch, record_error):
    attention = layer()
    assert attention.W_v.shape == (E, H_KV * DV) and attention.W_o.shape == (H * DV, E)
    X = np.random.default_rng(2).standard_normal((2, 7, E))
    out, backward = attention(X, mask=True, return_backward=True)
    expected, t, x = torch_layer(torch, attention, X)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("value head width vs torch", error) <= 1e-13
    grad = np.random.default_rng(3).standard_normal(out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    grads = backward(grad)
    for name, tensor in t.items():
        if name == "b_k":  # zero (a key bias shifts each row's scores alike): rounding only
            np.testing.assert_allclose(grads[name], tensor.grad.numpy(), rtol=0, atol=1e-14)
            continue
        assert relative_error(grads[name], tensor.grad.numpy()) <= 1e-10, name
    dX = grads["query"] + grads["key"] + grads["value"]  # X was all three
    assert relative_error(dX, x.grad.numpy()) <= 1e-10


def test_a_cache_holds_values_of_their_width(record_error):
    attention = layer(rope_theta=100.0)
    X = np.random.default_rng(4).standard_normal((2, 9, E))
    whole = attention(X, mask=True)
    cache = attention.new_cache(2)
    steps = [attention(X[:, :3], cache=cache)]
    steps += [attention(X[:, i : i + 1], cache=cache) for i in range(3, 9)]
    error = relative_error(np.concatenate(steps, axis=1), whole)
    assert record_error("value head width, cache steps vs whole", error) <= 1e-13


def test_the_spec_files_and_repr_keep_the_width(tmp_path):
    attention = layer(output_gate="sigmoid")
    assert attention.W_g.shape == (E, H * DV)
    assert attention.spec.v_head_dim == DV and "v_head_dim=10" in repr(attention)
    X = np.random.default_rng(5).standard_normal((1, 5, E))
    attention.save(tmp_path / "a.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "a.npz")
    np.testing.assert_array_equal(loaded(X, True), attention(X, True))
    spec = mha.LayerSpec(**{**vars(attention.spec), "v_head_dim": None})  # from the weights
    again = mha.MultiHeadAttention.from_spec(spec, attention.weights())
    assert again.v_head_dim == DV
    np.testing.assert_array_equal(again(X, True), attention(X, True))
    plain = mha.MultiHeadAttention(E, H, seed=0)
    assert plain.spec.v_head_dim is None and "v_head_dim" not in repr(plain)


def test_what_cannot_hold_it_refuses_it():
    with pytest.raises(mha.AttentionValueError, match="another head width"):
        mha.MultiHeadAttention(8, 2, v_head_dim=3).to_torch()
    with pytest.raises(mha.AttentionError, match="v_head_dim"):
        mha.MultiHeadAttention(8, 2, v_head_dim=0)
    attention = layer()
    with pytest.raises(mha.ShapeError):
        mha.MultiHeadAttention.from_spec(
            attention.spec, {**attention.weights(), "W_o": attention.W_o[:-1]}
        )
