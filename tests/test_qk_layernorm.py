"""QK-norm as a LayerNorm (Persimmon and Phi: one weight and bias for every head; StableLM
and Cohere: each head's own weights, ``qk_norm="each_head"``): the forward against torch's
``layer_norm`` in transformers' order, the backward against torch.autograd, in float64; the
module, its caches and saved files, and mha.dask against the function. The families' own
layers are compared in tests/test_pretrained.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.configs import relative_error

import mha
from mha.errors import AttentionValueError, ShapeError

B, L, E, d = 2, 7, 12, 4

CASES = [  # kind, heads, kv heads, biases of the norm, rotary
    ("head", 3, 3, True, True),  # Persimmon, Phi
    ("each_head", 3, 1, False, True),  # StableLM, Cohere
    ("each_head", 3, 3, True, False),
    ("all", 3, 1, True, True),
]


def shapes(kind, H, H_kv):
    return {"head": ((d,), (d,)), "each_head": ((H, d), (H_kv, d)),
            "all": ((H * d,), (H_kv * d,))}[kind]  # fmt: skip


def layer(seed, kind, H, H_kv, biases):
    g = np.random.default_rng(seed)
    widths = {"W_q": (E, H * d), "W_k": (E, H_kv * d), "W_v": (E, H_kv * d), "W_o": (H * d, E)}
    w = {name: g.standard_normal(shape) * 0.6 for name, shape in widths.items()}
    q, k = shapes(kind, H, H_kv)
    w["q_norm"], w["k_norm"] = 1.0 + 0.3 * g.standard_normal(q), 1.0 + 0.3 * g.standard_normal(k)
    if biases:
        w["q_norm_bias"], w["k_norm_bias"] = g.standard_normal(q), g.standard_normal(k)
    return w, g.standard_normal((B, L, E))


def torch_layernormed(torch, x, w, kind, H, H_kv, theta, eps):
    """Project, LayerNorm (before the split for "all", else each head's, with each head's
    weights for "each_head"), rotate_half rotary, GQA SDPA."""
    F = torch.nn.functional

    def norm(t, which):
        weight, bias = w[f"{which}_norm"], w.get(f"{which}_norm_bias")
        if kind == "each_head":  # (B, heads, L, d): a weight (heads, 1, d)
            t = F.layer_norm(t, (d,), eps=eps) * weight[:, None]
            return t if bias is None else t + bias[:, None]
        return F.layer_norm(t, (t.shape[-1],), weight, bias, eps)

    q, k, v = (x @ w[f"W_{n}"] for n in "qkv")
    if kind == "all":
        q, k = norm(q, "q"), norm(k, "k")
    q, k, v = (t.view(B, L, n, -1).transpose(1, 2) for t, n in ((q, H), (k, H_kv), (v, H_kv)))
    if kind != "all":
        q, k = norm(q, "q"), norm(k, "k")
    if theta is not None:
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        emb = torch.cat([torch.arange(L, dtype=torch.float64)[:, None] * inv] * 2, -1)

        def rotate(t):
            a, b = t[..., : d // 2], t[..., d // 2 :]
            return t * emb.cos() + torch.cat((-b, a), -1) * emb.sin()

        q, k = rotate(q), rotate(k)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(B, L, -1) @ w["W_o"]


def ours(x, w, kind, H, H_kv, theta, eps, **keywords):
    norms = {n: w[n] for n in ("q_norm", "k_norm", "q_norm_bias", "k_norm_bias") if n in w}
    return mha.multi_head_attention(
        x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H, num_kv_heads=H_kv, causal=True,
        rope_theta=theta, qk_norm=kind, qk_norm_eps=eps, qk_layernorm=True, **norms, **keywords,
    )  # fmt: skip


@pytest.mark.parametrize(("kind", "H", "H_kv", "biases", "rotary"), CASES)
def test_the_layernorm_and_its_gradients_match_torch(kind, H, H_kv, biases, rotary, torch,
                                                     record_error):  # fmt: skip
    w, x = layer(H + H_kv + biases, kind, H, H_kv, biases)
    theta, eps = (100.0 if rotary else None), 1e-5
    out, backward = ours(x, w, kind, H, H_kv, theta, eps, return_backward=True)
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    expected = torch_layernormed(torch, tx, tensors, kind, H, H_kv, theta, eps)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("QK LayerNorm forward vs torch, float64", error) <= 1e-13
    rms = {n: w[n] for n in ("q_norm", "k_norm")}
    plain = mha.multi_head_attention(x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H,
                                     num_kv_heads=H_kv, causal=True, rope_theta=theta,
                                     qk_norm=kind, qk_norm_eps=eps, **rms)  # fmt: skip
    assert relative_error(plain, out) > 1e-3  # an RMSNorm computes something else
    grad_out = np.random.default_rng(5).standard_normal(out.shape)
    expected.backward(torch.tensor(grad_out))
    grads = backward(grad_out)
    assert set(grads) == {*w, "Q", "K", "V"}
    for name, tensor in tensors.items():
        if name == "k_norm_bias" and not rotary:  # a shift of every key: zero, up to rounding
            assert np.abs(grads[name] - tensor.grad.numpy()).max() <= 1e-12
            continue
        error = relative_error(grads[name], tensor.grad.numpy())
        assert record_error("QK LayerNorm gradients vs autograd, float64", error) <= 1e-10, name
    error = relative_error(grads["Q"] + grads["K"] + grads["V"], tx.grad.numpy())
    assert record_error("QK LayerNorm gradients vs autograd, float64", error) <= 1e-10


def test_the_module_normalises_alike_with_caches_and_saved_files(tmp_path):
    attention = mha.MultiHeadAttention(E, 3, num_kv_heads=1, rope_theta=100.0,
                                       qk_norm="each_head", qk_layernorm=True, bias=True,
                                       seed=0)  # fmt: skip
    g = np.random.default_rng(1)
    for name in ("q_norm", "k_norm", "q_norm_bias", "k_norm_bias"):
        array = getattr(attention, name)
        array[:] = g.standard_normal(array.shape)
    assert attention.q_norm.shape == (3, d) and attention.k_norm_bias.shape == (1, d)
    x = g.standard_normal((B, 9, E))
    whole = attention(x, mask=True)
    cache = attention.new_cache(B)
    steps = [attention(x[:, :5], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    assert "qk_norm='each_head', qk_layernorm=True" in repr(attention)
    assert {"q_norm_bias", "k_norm_bias"} <= set(attention.parameters())
    path = tmp_path / "layernormed.npz"
    attention.save(path)
    loaded = mha.MultiHeadAttention.load(path)
    assert loaded.qk_layernorm and np.array_equal(loaded(x, mask=True), whole)
    unbiased = mha.MultiHeadAttention(E, 3, qk_norm="head", qk_layernorm=True, seed=0)
    assert unbiased.q_norm_bias is None and unbiased.q_norm.shape == (d,)


def test_mha_dask_normalises_each_chunk():
    if os.environ.get("MHA_REQUIRE_DASK") != "1":  # CI's full tier requires it
        pytest.importorskip("dask.array", reason="the dask extra is not installed")
    import dask.array as da

    import mha.dask

    w, x = layer(3, "each_head", 3, 1, True)
    x = np.concatenate([x] * 4, axis=1)  # 28 positions in chunks of 8
    norms = {n: w[n] for n in ("q_norm", "k_norm", "q_norm_bias", "k_norm_bias")}
    arguments = (w["W_q"], w["W_k"], w["W_v"], w["W_o"], 3)
    keywords = {"causal": True, "rope_theta": 100.0, "num_kv_heads": 1, "qk_norm": "each_head",
                "qk_layernorm": True, **norms}  # fmt: skip
    exact = mha.multi_head_attention(x, x, x, *arguments, **keywords)
    for chunks in ((1, 8, E), (B, 28, E)):
        lazy = mha.dask.multi_head_attention(da.from_array(x, chunks=chunks), x, x, *arguments,
                                             **keywords)  # fmt: skip
        assert relative_error(lazy.compute(scheduler="sync"), exact) <= 1e-14


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"q_norm": np.ones(4), "k_norm": np.ones(4), "q_norm_bias": np.ones(4),
          "k_norm_bias": np.ones(4)}, AttentionValueError, "give qk_layernorm=True too"),
        ({"q_norm": np.ones(4), "k_norm": np.ones(4), "qk_layernorm": True,
          "q_norm_bias": np.ones(4)}, AttentionValueError, "q_norm_bias and k_norm_bias go"),
        ({"qk_layernorm": True}, AttentionValueError, "qk_layernorm has no effect without"),
        ({"q_norm": np.ones(4), "k_norm": np.ones(4), "qk_norm": "each_head"}, ShapeError,
         r"q_norm must have shape \(2, 4\) = \(heads, d_k\) for qk_norm='each_head'"),
        ({"q_norm": np.ones(4), "k_norm": np.ones(4), "qk_layernorm": True,
          "q_norm_bias": np.ones(3), "k_norm_bias": np.ones(4)}, ShapeError,
         r"q_norm_bias must have shape \(4,\)"),
        ({"q_norm": np.ones(4), "k_norm": np.ones(4), "qk_layernorm": 1}, mha.AttentionTypeError,
         "qk_layernorm"),
    ],
)  # fmt: skip
def test_mistakes_are_refused_by_name(keywords, error, message):
    x, W = np.ones((1, 3, 8)), np.ones((8, 8))
    with pytest.raises(error, match=message):
        mha.multi_head_attention(x, x, x, W, W, W, W, 2, **keywords)


def test_the_module_refuses_a_layernorm_without_a_qk_norm():
    with pytest.raises(AttentionValueError, match="qk_layernorm needs qk_norm="):
        mha.MultiHeadAttention(8, 2, qk_layernorm=True)
