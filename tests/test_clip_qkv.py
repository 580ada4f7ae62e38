"""``clip_qkv`` (DBRX, OLMo, OLMoE, MPT): the projections clamped to ``[-c, c]``, after the
QK-norm (OLMoE's order), before the rotation and the scale. The forward against a torch
transcription of transformers' layers, the backward against torch.autograd, in float64; the
module, its caches and saved files, and mha.dask against the function. The families' own
layers are compared in tests/test_pretrained.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.configs import relative_error
from support.torch_reference import rope

import mha
from mha.errors import AttentionTypeError, AttentionValueError

B, L, E, d = 2, 7, 12, 4

CASES = [  # heads, kv heads, QK-norm across heads (OLMoE), rotary, biases
    (3, 3, False, True, False),  # OLMo
    (3, 1, False, True, False),  # DBRX: grouped key/value heads
    (3, 3, True, True, False),  # OLMoE
    (3, 3, False, False, True),  # MPT: no rope, biases
]


def layer(seed, H, H_kv, norm, biases):
    g = np.random.default_rng(seed)
    widths = {"W_q": (E, H * d), "W_k": (E, H_kv * d), "W_v": (E, H_kv * d), "W_o": (H * d, E)}
    w = {name: g.standard_normal(shape) * 0.6 for name, shape in widths.items()}
    if biases:
        w |= {f"b_{n}": g.standard_normal(widths[f"W_{n}"][1]) for n in "qkvo"}
    if norm:
        w["q_norm"], w["k_norm"] = g.standard_normal(H * d), g.standard_normal(H_kv * d)
    return w, g.standard_normal((B, L, E))


def torch_clipped(torch, x, w, H, H_kv, c, theta, scale, eps=1e-5):
    """transformers' OLMoE order: project, RMSNorm across heads, clamp, split, rotate."""
    q = x @ w["W_q"] + w.get("b_q", 0)
    k = x @ w["W_k"] + w.get("b_k", 0)
    v = x @ w["W_v"] + w.get("b_v", 0)
    if "q_norm" in w:
        q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w[n]
                for t, n in ((q, "q_norm"), (k, "k_norm")))  # fmt: skip
    q, k, v = (t.clamp(min=-c, max=c) for t in (q, k, v))
    q, k, v = (t.view(B, L, n, -1).transpose(1, 2) for t, n in ((q, H), (k, H_kv), (v, H_kv)))
    if theta is not None:
        q, k = rope(torch, q, range(L), theta), rope(torch, k, range(L), theta)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(B, L, -1) @ w["W_o"] + w.get("b_o", 0)


def ours(x, w, H, H_kv, c, theta, scale, **keywords):
    extra = {n: w[n] for n in ("b_q", "b_k", "b_v", "b_o", "q_norm", "k_norm") if n in w}
    if "q_norm" in w:
        extra |= {"qk_norm": "all", "qk_norm_eps": 1e-5}
    return mha.multi_head_attention(
        x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H, num_kv_heads=H_kv, causal=True,
        rope_theta=theta, scale=scale, clip_qkv=c, **extra, **keywords,
    )  # fmt: skip


@pytest.mark.parametrize(("H", "H_kv", "norm", "rotary", "biases"), CASES)
def test_clip_qkv_forward_and_backward_match_torch(H, H_kv, norm, rotary, biases, torch,
                                                   record_error):  # fmt: skip
    w, x = layer(H * 10 + H_kv + norm, H, H_kv, norm, biases)
    c, theta, scale = 0.8, (100.0 if rotary else None), 0.4
    out, backward = ours(x, w, H, H_kv, c, theta, scale, return_backward=True)
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    expected = torch_clipped(torch, tx, tensors, H, H_kv, c, theta, scale)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("clip_qkv forward vs torch, float64", error) <= 1e-13
    unclipped = ours(x, w, H, H_kv, None, theta, scale)
    assert relative_error(unclipped, out) > 1e-3  # the clamp cut some values
    grad_out = np.random.default_rng(5).standard_normal(out.shape)
    expected.backward(torch.tensor(grad_out))
    grads = backward(grad_out)
    assert set(grads) == {*w, "Q", "K", "V"}
    for name, tensor in tensors.items():
        error = relative_error(grads[name], tensor.grad.numpy())
        assert record_error("clip_qkv gradients vs autograd, float64", error) <= 1e-10, name
    error = relative_error(grads["Q"] + grads["K"] + grads["V"], tx.grad.numpy())
    assert record_error("clip_qkv gradients vs autograd, float64", error) <= 1e-10


def test_a_bound_no_value_reaches_changes_nothing():
    w, x = layer(0, 3, 1, True, True)
    plain = ours(x, w, 3, 1, None, 100.0, None)
    assert np.array_equal(ours(x, w, 3, 1, 1e9, 100.0, None), plain)


def test_the_module_clips_alike_with_caches_and_saved_files(tmp_path):
    attention = mha.MultiHeadAttention(E, 3, num_kv_heads=1, rope_theta=100.0, clip_qkv=0.3,
                                       seed=0)  # fmt: skip
    x = np.random.default_rng(2).standard_normal((B, 9, E))
    whole = attention(x, mask=True)
    W = attention.weights()
    direct = mha.multi_head_attention(x, x, x, W["W_q"], W["W_k"], W["W_v"], W["W_o"], 3,
                                      num_kv_heads=1, causal=True, rope_theta=100.0,
                                      clip_qkv=0.3)  # fmt: skip
    assert np.array_equal(whole, direct)
    cache = attention.new_cache(B)
    steps = [attention(x[:, :5], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    assert "clip_qkv=0.3" in repr(attention) and attention.spec.clip_qkv == 0.3
    path = tmp_path / "clipped.npz"
    attention.save(path)
    loaded = mha.MultiHeadAttention.load(path)
    assert loaded.clip_qkv == 0.3 and np.array_equal(loaded(x, mask=True), whole)
    with pytest.raises(AttentionValueError, match=r"cannot hold this attention \(clip_qkv\)"):
        mha.MultiHeadAttention(E, 3, clip_qkv=0.3).to_torch_state_dict()


def test_mha_dask_clips_each_chunk():
    if os.environ.get("MHA_REQUIRE_DASK") != "1":  # CI's full tier requires it
        pytest.importorskip("dask.array", reason="the dask extra is not installed")
    import dask.array as da

    import mha.dask

    w, x = layer(3, 3, 3, True, True)
    x = np.concatenate([x] * 4, axis=1)  # 28 positions in chunks of 8
    extra = {n: w[n] for n in ("b_q", "b_k", "b_v", "b_o", "q_norm", "k_norm")}
    arguments = (w["W_q"], w["W_k"], w["W_v"], w["W_o"], 3)
    keywords = {"causal": True, "rope_theta": 100.0, "clip_qkv": 0.8, "qk_norm": "all", **extra}
    exact = mha.multi_head_attention(x, x, x, *arguments, **keywords)
    for chunks in ((1, 8, E), (B, 28, E)):
        lazy = mha.dask.multi_head_attention(da.from_array(x, chunks=chunks), x, x, *arguments,
                                             **keywords)  # fmt: skip
        assert relative_error(lazy.compute(scheduler="sync"), exact) <= 1e-14


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, AttentionValueError), (-1.0, AttentionValueError), (float("inf"), AttentionValueError),
     ("8", AttentionTypeError), (True, AttentionTypeError)],
)  # fmt: skip
def test_a_bound_that_is_not_a_positive_number_is_refused_by_name(value, error):
    x, W = np.ones((1, 3, 8)), np.ones((8, 8))
    with pytest.raises(error, match="clip_qkv must be a positive number"):
        mha.multi_head_attention(x, x, x, W, W, W, W, 2, clip_qkv=value)
    with pytest.raises(error, match="clip_qkv must be a positive number"):
        mha.MultiHeadAttention(8, 2, clip_qkv=value)
