"""QK-norm (Qwen3, Gemma 3 per head; OLMo 2 across heads): the forward against a torch
transcription of transformers' layers, the backward against torch.autograd, in float64.
The families' own layers are compared in tests/test_pretrained.py."""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import relative_error
from support.torch_reference import rope

import mha
from mha.errors import AttentionValueError, ShapeError

CASES = [  # kind, offset, heads, kv heads, rotary, biases
    ("head", 0.0, 4, 2, True, False),  # Qwen3
    ("head", 1.0, 4, 1, True, False),  # Gemma 3: (1 + w)
    ("all", 0.0, 4, 4, True, False),  # OLMo 2
    ("head", 0.0, 2, 2, False, True),
    ("all", 0.0, 6, 3, False, True),
]


def torch_attention(torch, x, w, H, H_kv, kind, offset, eps, theta, positions, scale):
    """Projection, RMSNorm of q and k (transformers' order), rotate_half rotary, GQA SDPA."""
    B, L, _ = x.shape

    def rms(t, weight):
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        return t * (offset + weight)

    q = x @ w["W_q"] + w.get("b_q", 0)
    k = x @ w["W_k"] + w.get("b_k", 0)
    v = x @ w["W_v"] + w.get("b_v", 0)
    if kind == "all":
        q, k = rms(q, w["q_norm"]), rms(k, w["k_norm"])
    q, k, v = (t.view(B, L, n, -1).transpose(1, 2) for t, n in ((q, H), (k, H_kv), (v, H_kv)))
    if kind == "head":
        q, k = rms(q, w["q_norm"]), rms(k, w["k_norm"])
    if theta is not None:
        q, k = rope(torch, q, positions, theta), rope(torch, k, positions, theta)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2).reshape(B, L, -1) @ w["W_o"]
    return out + w.get("b_o", 0)


@pytest.mark.parametrize(("kind", "offset", "H", "H_kv", "rotary", "biases"), CASES)
def test_qk_norm_forward_and_backward_match_torch(
    kind, offset, H, H_kv, rotary, biases, torch, record_error
):
    g = np.random.default_rng(H * 10 + H_kv)
    B, L, E, d = 2, 7, 12, 8
    widths = {"W_q": (E, H * d), "W_k": (E, H_kv * d), "W_v": (E, H_kv * d), "W_o": (H * d, E)}
    w = {name: g.standard_normal(shape) * 0.5 for name, shape in widths.items()}
    if biases:
        w |= {f"b_{n}": g.standard_normal(widths[f"W_{n}"][1]) for n in "qkvo"}
    w["q_norm"] = g.standard_normal(d if kind == "head" else H * d)
    w["k_norm"] = g.standard_normal(d if kind == "head" else H_kv * d)
    x = g.standard_normal((B, L, E))
    eps, theta, scale = 1e-5, (500.0 if rotary else None), 0.3
    positions = np.arange(3, 3 + L)
    ours, backward = mha.multi_head_attention(
        x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H, num_kv_heads=H_kv, causal=True,
        **{n: w[n] for n in ("b_q", "b_k", "b_v", "b_o") if n in w}, q_norm=w["q_norm"],
        k_norm=w["k_norm"], qk_norm=kind, qk_norm_eps=eps, qk_norm_offset=offset,
        rope_theta=theta, positions=positions if rotary else None, scale=scale,
        return_backward=True,
    )  # fmt: skip
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    expected = torch_attention(torch, tx, tensors, H, H_kv, kind, offset, eps, theta, positions,
                               scale)  # fmt: skip
    error = relative_error(ours, expected.detach().numpy())
    assert record_error("QK-norm forward vs torch, float64", error) <= 1e-13
    grad_out = g.standard_normal(ours.shape)
    expected.backward(torch.tensor(grad_out))
    grads = backward(grad_out)
    assert set(grads) == {*w, "Q", "K", "V"}
    for name, tensor in tensors.items():
        error = relative_error(grads[name], tensor.grad.numpy())
        assert record_error("QK-norm gradients vs autograd, float64", error) <= 1e-10, name
    shared = grads["Q"] + grads["K"] + grads["V"]
    error = relative_error(shared, tx.grad.numpy())
    assert record_error("QK-norm gradients vs autograd, float64", error) <= 1e-10


def test_qk_norm_module_and_cache_agree_with_whole_sequences():
    attention = mha.MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=100.0, qk_norm="head",
                                       seed=0)  # fmt: skip
    g = np.random.default_rng(1)
    attention.q_norm[:] = g.standard_normal(4)
    attention.k_norm[:] = g.standard_normal(4)
    x = g.standard_normal((2, 9, 16))
    whole = attention(x, mask=True)
    cache = attention.new_cache(2)
    steps = [attention(x[:, :5], cache=cache)] + [
        attention(x[:, t : t + 1], cache=cache) for t in range(5, 9)
    ]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    assert "qk_norm='head'" in repr(attention)
    assert {"q_norm", "k_norm"} <= set(attention.parameters())


def test_qk_norm_refusals_name_the_argument():
    x = np.ones((1, 3, 8))
    W = np.ones((8, 8))
    with pytest.raises(AttentionValueError, match="q_norm and k_norm go together"):
        mha.multi_head_attention(x, x, x, W, W, W, W, 2, q_norm=np.ones(4))
    with pytest.raises(ShapeError, match=r"k_norm must have shape \(8,\)"):
        mha.multi_head_attention(x, x, x, W, W, W, W, 2, q_norm=np.ones(8), k_norm=np.ones(4),
                                 qk_norm="all")  # fmt: skip
    with pytest.raises(AttentionValueError, match="qk_norm must be 'head'"):
        mha.multi_head_attention(x, x, x, W, W, W, W, 2, q_norm=np.ones(4), k_norm=np.ones(4),
                                 qk_norm="token")  # fmt: skip
    with pytest.raises(AttentionValueError, match="qk_norm_eps has no effect"):
        mha.multi_head_attention(x, x, x, W, W, W, W, 2, qk_norm_eps=1e-5)


def test_the_module_refuses_what_it_would_otherwise_ignore_or_lose(tmp_path):
    """q_norm weights without qk_norm, a bad offset, settings torch cannot hold; rope
    scaling kept as plain numbers (a saved file's JSON), not the caller's objects."""
    attention = mha.MultiHeadAttention(8, 2)
    attention.q_norm, attention.k_norm = np.ones(4), np.ones(4)
    with pytest.raises(AttentionValueError, match="holds q_norm/k_norm weights but has qk_norm"):
        attention(np.ones((1, 3, 8)))
    with pytest.raises(mha.AttentionTypeError, match="qk_norm_offset must be a finite real"):
        mha.MultiHeadAttention(8, 2, qk_norm="head", qk_norm_offset="a")
    for settings in ({"scale": 0.1}, {"qk_norm": "head"}):
        with pytest.raises(AttentionValueError, match=r"torch\.nn\.MultiheadAttention cannot hold"):
            mha.MultiHeadAttention(8, 2, **settings).to_torch_state_dict()
    factors = np.ones(2)
    scaling = {
        "rope_type": "longrope",
        "short_factor": factors,
        "long_factor": [1.0, 2.0],
        "original_max_position_embeddings": np.int64(8),
        "max_position_embeddings": 32,
    }
    attention = mha.MultiHeadAttention(8, 2, rope_theta=10.0, rope_scaling=scaling, seed=0)
    factors[0] = 5.0  # the caller's array changes afterwards: the module's copy does not
    assert attention.rope_scaling["short_factor"] == [1.0, 1.0]
    attention.save(tmp_path / "a.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "a.npz")
    x = np.random.default_rng(0).standard_normal((1, 12, 8))
    np.testing.assert_array_equal(loaded(x, mask=True), attention(x, mask=True))
    with pytest.raises(mha.AttentionTypeError, match="rope_scaling must be a dict"):
        mha.MultiHeadAttention(8, 2, rope_theta=10.0, rope_scaling=[("rope_type", "linear")])


def test_hunyuans_norm_after_the_rotation_and_its_gradients_match_torch(torch, record_error):
    """HunYuan normalises each head's rotated queries and keys (RMSNorm after the rotation);
    the module, its caches, saved files and mha.dask alike."""
    g = np.random.default_rng(11)
    H, H_kv, E, d, B, L = 4, 2, 12, 8, 2, 7
    widths = {"W_q": (E, H * d), "W_k": (E, H_kv * d), "W_v": (E, H_kv * d), "W_o": (H * d, E)}
    w = {name: g.standard_normal(shape) * 0.5 for name, shape in widths.items()}
    w["q_norm"], w["k_norm"] = 1 + 0.3 * g.standard_normal(d), 1 + 0.3 * g.standard_normal(d)
    x = g.standard_normal((B, L, E))
    keywords = {"num_kv_heads": H_kv, "causal": True, "rope_theta": 50.0, "qk_norm_eps": 1e-5,
                "q_norm": w["q_norm"], "k_norm": w["k_norm"],
                "qk_norm_after_rope": True}  # fmt: skip
    ours, backward = mha.multi_head_attention(x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H,
                                              return_backward=True, **keywords)  # fmt: skip
    before = mha.multi_head_attention(x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H,
                                      **{**keywords, "qk_norm_after_rope": False})  # fmt: skip
    assert relative_error(before, ours) > 1e-3  # the order matters
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    q, k, v = (tx @ tensors[f"W_{n}"] for n in "qkv")
    q, k, v = (t.view(B, L, n, -1).transpose(1, 2) for t, n in ((q, H), (k, H_kv), (v, H_kv)))
    inv = 1.0 / 50.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat([torch.arange(L, dtype=torch.float64)[:, None] * inv] * 2, -1)

    def rotate(t):
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return t * emb.cos() + torch.cat((-b, a), -1) * emb.sin()

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    q, k = rms(rotate(q), tensors["q_norm"]), rms(rotate(k), tensors["k_norm"])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=True)  # fmt: skip
    expected = out.transpose(1, 2).reshape(B, L, -1) @ tensors["W_o"]
    error = relative_error(ours, expected.detach().numpy())
    assert record_error("QK-norm after rope vs torch, float64", error) <= 1e-13
    grad_out = g.standard_normal(ours.shape)
    expected.backward(torch.tensor(grad_out))
    grads = backward(grad_out)
    for name, tensor in tensors.items():
        error = relative_error(grads[name], tensor.grad.numpy())
        assert record_error("QK-norm after rope gradients vs autograd", error) <= 1e-10, name
    attention = mha.MultiHeadAttention.from_spec(
        mha.LayerSpec(H, H_kv, d, rope_theta=50.0, qk_norm="head", qk_norm_eps=1e-5,
                      qk_norm_after_rope=True), w)  # fmt: skip
    assert "qk_norm_after_rope=True" in repr(attention)
    assert relative_error(attention(x, mask=True), ours) <= 1e-15
    cache = attention.new_cache(B)
    steps = [attention(x[:, :4], cache=cache)] + [
        attention(x[:, t : t + 1], cache=cache) for t in range(4, L)
    ]
    assert relative_error(np.concatenate(steps, axis=1), ours) <= 1e-13
    try:
        import dask.array as da

        from mha import dask as mha_dask
    except ImportError:
        return
    lazy = mha_dask.multi_head_attention(da.from_array(x, chunks=(1, 3, E)), x, x, w["W_q"],
                                         w["W_k"], w["W_v"], w["W_o"], H, **keywords)  # fmt: skip
    assert relative_error(lazy.compute(scheduler="sync"), ours) <= 1e-14
