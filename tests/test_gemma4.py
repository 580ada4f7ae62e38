"""``v_norm`` (Gemma 3n, Gemma 4): each value head divided by its root mean square, without
weights, after the projection. The forward against a torch transcription of transformers'
layer (QK-norm, rotation, the value norm, a scale of 1), the backward against torch.autograd,
in float64; the module's caches (holding the normalised values) and saved files; the errors.
The families' own layers are compared in tests/test_pretrained.py."""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import relative_error
from support.torch_reference import rope

import mha
from mha.errors import AttentionTypeError, AttentionValueError

B, L, E, d = 2, 7, 12, 4
EPS = 1e-6

CASES = [(3, 3, True), (4, 2, True), (4, 1, False), (2, 2, False)]  # heads, kv heads, rotary


def layer(seed, H, H_kv):
    g = np.random.default_rng(seed)
    widths = {"W_q": (E, H * d), "W_k": (E, H_kv * d), "W_v": (E, H_kv * d), "W_o": (H * d, E)}
    w = {name: g.standard_normal(shape) * 0.6 for name, shape in widths.items()}
    w["q_norm"], w["k_norm"] = g.standard_normal(d), g.standard_normal(d)
    return w, g.standard_normal((B, L, E))


def torch_gemma(torch, x, w, H, H_kv, theta):
    """transformers' Gemma 3n and Gemma 4 order: project, split, RMSNorm q and k (weights)
    and v (none), rotate q and k, attend with a scale of 1."""

    def rms(t, weight=None):
        t = t * torch.pow(t.pow(2).mean(-1, keepdim=True) + EPS, -0.5)
        return t if weight is None else t * weight

    q, k, v = ((x @ w[n]).view(B, L, h, d) for n, h in (("W_q", H), ("W_k", H_kv), ("W_v", H_kv)))
    q, k, v = rms(q, w["q_norm"]), rms(k, w["k_norm"]), rms(v)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if theta is not None:
        q, k = rope(torch, q, range(L), theta), rope(torch, k, range(L), theta)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=1.0, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(B, L, -1) @ w["W_o"]


def ours(x, w, H, H_kv, theta, **keywords):
    return mha.multi_head_attention(
        x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H, num_kv_heads=H_kv, causal=True,
        rope_theta=theta, scale=1.0, q_norm=w["q_norm"], k_norm=w["k_norm"], qk_norm="head",
        qk_norm_eps=EPS, v_norm=EPS, **keywords,
    )  # fmt: skip


@pytest.mark.parametrize(("H", "H_kv", "rotary"), CASES)
def test_v_norm_forward_and_backward_match_torch(H, H_kv, rotary, torch, record_error):
    w, x = layer(H * 10 + H_kv, H, H_kv)
    theta = 100.0 if rotary else None
    out, backward = ours(x, w, H, H_kv, theta, return_backward=True)
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    expected = torch_gemma(torch, tx, tensors, H, H_kv, theta)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("v_norm forward vs torch, float64", error) <= 1e-13
    without = mha.multi_head_attention(
        x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H, num_kv_heads=H_kv, causal=True,
        rope_theta=theta, scale=1.0, q_norm=w["q_norm"], k_norm=w["k_norm"], qk_norm_eps=EPS,
    )  # fmt: skip
    assert relative_error(without, out) > 1e-3  # the norm changes the values
    grad = np.random.default_rng(5).standard_normal(out.shape)
    expected.backward(torch.tensor(grad))
    grads = backward(grad)
    for name, tensor in {**tensors, "Q": tx}.items():
        found = grads[name] if name != "Q" else grads["Q"] + grads["K"] + grads["V"]
        error = relative_error(found, tensor.grad.numpy())
        assert record_error(f"v_norm gradient of {name} vs autograd", error) <= 1e-10, name


def test_v_norm_module_cache_and_saved_file_match_the_function(tmp_path):
    """The module computes the function's values; a cache holds the normalised values, and
    a prefill then one token at a time gives the whole sequence's outputs."""
    w, x = layer(3, 4, 2)
    attention = mha.MultiHeadAttention(E, 4, num_kv_heads=2, head_dim=d, rope_theta=100.0,
                                       scale=1.0, qk_norm="head", v_norm=EPS, seed=0)  # fmt: skip
    for name in ("W_q", "W_k", "W_v", "W_o", "q_norm", "k_norm"):
        setattr(attention, name, w[name])
    whole = attention(x, mask=True)
    assert relative_error(whole, ours(x, w, 4, 2, 100.0)) <= 1e-15
    cache = attention.new_cache(B)
    steps = [attention(x[:, :3], cache=cache)]
    steps += [attention(x[:, i : i + 1], cache=cache) for i in range(3, L)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    held = cache.v[:, :, :L]
    assert np.allclose(np.mean(held * held, axis=-1), 1.0, atol=1e-5)  # the normalised ones
    assert attention.spec.v_norm == EPS and "v_norm=1e-06" in repr(attention)
    attention.save(tmp_path / "layer.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "layer.npz")
    assert loaded.v_norm == EPS
    assert np.array_equal(loaded(x, mask=True), whole)


def test_v_norm_errors_name_the_keyword(torch):
    w, x = layer(1, 2, 2)
    with pytest.raises(AttentionTypeError, match="v_norm is the epsilon"):
        mha.MultiHeadAttention(8, 2, v_norm=True)
    with pytest.raises(AttentionValueError, match="v_norm must be a positive number"):
        mha.multi_head_attention(x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], 2, v_norm=0.0)
    with pytest.raises(AttentionValueError, match=r"torch\.nn\.MultiheadAttention cannot hold"):
        mha.MultiHeadAttention(8, 2, v_norm=1e-6).to_torch()
