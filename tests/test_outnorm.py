"""The output norm (``output_norm=``, :mod:`mha.api.output_norm`): the joined heads
normalised over all their features before ``W_o``, BitNet's RMSNorm of a weight ``o_norm``
and nGPT's L2 norm without weights, after an output gate where the layer has one; and the
queries' factors after the rotation (``q_scale``, Dory's nGPT ``sqk``). Against a torch
reference in float64 (forward and every gradient to 1e-10), with the KV cache, the paged
cache, save and load, and the errors by name. BitNet's checkpoints are compared with
transformers' own layers in test_pretrained.py and the census."""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import relative_error

import mha
from mha.errors import AttentionValueError, ShapeError

B, L, E, H, H_KV, D = 2, 7, 16, 4, 2, 4
EPS = 1e-3


def weights(seed):
    g = np.random.default_rng(seed)
    return {
        "W_q": g.standard_normal((E, H * D)) / 4,
        "W_k": g.standard_normal((E, H_KV * D)) / 4,
        "W_v": g.standard_normal((E, H_KV * D)) / 4,
        "W_o": g.standard_normal((H * D, E)) / 4,
        "W_g": g.standard_normal((E, H * D)) / 4,
        "o_norm": 1.0 + 0.3 * g.standard_normal(H * D),
    }


def torch_layer(x, w, kind, gated):
    """The layer in torch: GQA causal attention, the gate, the norm, ``o_proj``."""
    import torch

    q = (x @ w["W_q"]).view(B, L, H, D).transpose(1, 2)
    k = (x @ w["W_k"]).view(B, L, H_KV, D).transpose(1, 2).repeat_interleave(H // H_KV, 1)
    v = (x @ w["W_v"]).view(B, L, H_KV, D).transpose(1, 2).repeat_interleave(H // H_KV, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = o.transpose(1, 2).reshape(B, L, H * D)
    if gated:
        o = o * torch.sigmoid(x @ w["W_g"])
    if kind == "rms":
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * w["o_norm"]
    else:
        o = o * torch.rsqrt(o.pow(2).sum(-1, keepdim=True) + EPS)
    return o @ w["W_o"]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_output_norm_and_its_gradients_match_autograd(kind, gated, torch, record_error):
    w = weights(1)
    x = np.random.default_rng(2).standard_normal((B, L, E))
    grad_out = np.random.default_rng(3).standard_normal((B, L, E))
    names = ["W_q", "W_k", "W_v", "W_o", *(["W_g"] if gated else [])]
    names += ["o_norm"] if kind == "rms" else []
    given = {name: w[name] for name in names}
    out, backward = mha.multi_head_attention(
        x, x, x, **given, num_heads=H, num_kv_heads=H_KV, causal=True, output_norm=kind,
        output_norm_eps=EPS, return_backward=True,
    )  # fmt: skip
    tw = {name: torch.tensor(a, requires_grad=True) for name, a in given.items()}
    tx = torch.tensor(x, requires_grad=True)
    expected = torch_layer(tx, tw, kind, gated)
    (expected * torch.tensor(grad_out)).sum().backward()
    label = f"output norm {kind} vs torch, float64"
    assert record_error(label, relative_error(out, expected.detach().numpy())) <= 1e-12
    grads = backward(grad_out)
    assert set(grads) == {*names, "Q", "K", "V"}
    for name in names:
        error = relative_error(grads[name], tw[name].grad.numpy())
        assert record_error(f"output norm {kind} gradients, float64", error) <= 1e-10, name
    shared = grads["Q"] + grads["K"] + grads["V"]
    assert relative_error(shared, tx.grad.numpy()) <= 1e-10


@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_output_norm_decodes_saves_and_loads(kind, tmp_path):
    attention = mha.MultiHeadAttention(
        E, H, num_kv_heads=H_KV, rope_theta=100.0, output_norm=kind, output_norm_eps=EPS,
        output_gate="sigmoid", seed=0,
    )  # fmt: skip
    assert (attention.o_norm is not None) == (kind == "rms")
    if kind == "rms":
        attention.o_norm = weights(4)["o_norm"]
    x = np.random.default_rng(5).standard_normal((B, L, E))
    whole = attention(x, mask=True)
    cache = attention.new_cache(B)
    steps = [attention(x[:, :3], cache=cache)]
    steps += [attention(x[:, i : i + 1], cache=cache) for i in range(3, L)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    paged = mha.PagedKVCache(16, 4, H_KV, D, dtype=np.float64)
    paged.add("a")
    paged.add("b")
    steps = [attention(x[:, :5], cache=paged), attention(x[:, 5:], cache=paged)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    assert f"output_norm={kind!r}" in repr(attention)
    attention.save(tmp_path / "layer.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "layer.npz")
    assert (loaded.output_norm, loaded.output_norm_eps) == (kind, EPS)
    assert np.array_equal(loaded(x, mask=True), whole)
    again = mha.MultiHeadAttention.from_spec(attention.spec, attention.weights())
    assert np.array_equal(again(x, mask=True), whole)


def test_output_norm_errors_name_the_keyword():
    w = weights(6)
    x = np.random.default_rng(7).standard_normal((1, 3, E))
    plain = (x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H)
    with pytest.raises(AttentionValueError, match="output_norm must be None, 'rms' or 'l2'"):
        mha.multi_head_attention(*plain, num_kv_heads=H_KV, output_norm="layer")
    with pytest.raises(AttentionValueError, match="output_norm='rms' needs its weight o_norm"):
        mha.multi_head_attention(*plain, num_kv_heads=H_KV, output_norm="rms")
    with pytest.raises(AttentionValueError, match="o_norm: output_norm='l2' has no weights"):
        mha.multi_head_attention(*plain, num_kv_heads=H_KV, output_norm="l2", o_norm=w["o_norm"])
    with pytest.raises(AttentionValueError, match="o_norm needs output_norm='rms'"):
        mha.multi_head_attention(*plain, num_kv_heads=H_KV, o_norm=w["o_norm"])
    with pytest.raises(ShapeError, match=r"o_norm must have shape \(H\*d_v,\) = \(16,\)"):
        mha.multi_head_attention(
            *plain, num_kv_heads=H_KV, output_norm="rms", o_norm=w["o_norm"][:4]
        )
    with pytest.raises(AttentionValueError, match="output_norm_eps needs output_norm="):
        mha.MultiHeadAttention(E, H, output_norm_eps=1e-6)
    with pytest.raises(AttentionValueError, match="output_norm_eps must be a positive number"):
        mha.MultiHeadAttention(E, H, output_norm="l2", output_norm_eps=-1.0)
    attention = mha.MultiHeadAttention(E, H, output_norm="rms", seed=0)
    with pytest.raises(AttentionValueError, match="o_norm and output_norm='rms' go together"):
        mha.MultiHeadAttention.from_spec(attention.spec, {**attention.weights(), "o_norm": None})
    with pytest.raises(AttentionValueError, match=r"cannot hold .*an output norm"):
        attention.to_torch()


def test_a_packed_bitnet_checkpoint_is_refused_by_its_quantization(tmp_path, transformers):
    import json
    import shutil

    from support import pretrained_models as models

    folder = tmp_path / "packed"
    shutil.copytree(models.saved("bitnet"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "linear_class": "autobitlinear"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttentionValueError, match=r"quantization_config=.*packed ternary"):
        mha.from_pretrained(folder, layer=0)


def torch_scaled_queries(x, w, theta):
    """Dory's queries, unit queries and keys rotated, then each query feature times its
    factor; the softmax scale 0.3."""
    import torch

    positions = torch.arange(L, dtype=torch.float64)
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.cat([positions[:, None] * inv] * 2, dim=-1)
    cos, sin = angles.cos(), angles.sin()

    def rotate(t):
        half = torch.cat([-t[..., D // 2 :], t[..., : D // 2]], dim=-1)
        return t * cos + half * sin

    def l2(t):
        return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)

    q = (x @ w["W_q"]).view(B, L, H, D).transpose(1, 2)
    k = (x @ w["W_k"]).view(B, L, H_KV, D).transpose(1, 2)
    v = (x @ w["W_v"]).view(B, L, H_KV, D).transpose(1, 2)
    q, k = rotate(l2(q)), rotate(l2(k))
    q = q * w["q_scale"].view(H, 1, D)
    k, v = (t.repeat_interleave(H // H_KV, 1) for t in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    return o.transpose(1, 2).reshape(B, L, H * D) @ w["W_o"]


def test_query_scale_after_the_rotation_and_its_gradient_match_autograd(torch, record_error):
    """Dory's nGPT queries: unit queries and keys (the sum's L2 norm: an RMSNorm of epsilon
    ``eps / d`` times ``1/sqrt(d)``, the factor folded into the scale), rotated, each query
    feature times its factor ``q_scale``."""
    w = weights(8)
    w["q_scale"] = 1.0 + np.random.default_rng(9).standard_normal(H * D)
    x = np.random.default_rng(10).standard_normal((B, L, E))
    grad_out = np.random.default_rng(11).standard_normal((B, L, E))
    names = ["W_q", "W_k", "W_v", "W_o", "q_scale"]
    ones = np.ones(D)
    out, backward = mha.multi_head_attention(
        x, x, x, **{name: w[name] for name in names}, num_heads=H, num_kv_heads=H_KV,
        causal=True, rope_theta=100.0, q_norm=ones, k_norm=ones, qk_norm="head",
        qk_norm_eps=1e-6 / D, scale=0.3 / D, return_backward=True,
    )  # fmt: skip
    tw = {name: torch.tensor(w[name], requires_grad=True) for name in names}
    tx = torch.tensor(x, requires_grad=True)
    expected = torch_scaled_queries(tx, tw, 100.0)
    (expected * torch.tensor(grad_out)).sum().backward()
    error = relative_error(out, expected.detach().numpy())
    assert record_error("query scale vs torch, float64", error) <= 1e-12
    grads = backward(grad_out)
    for name in names:
        error = relative_error(grads[name], tw[name].grad.numpy())
        assert record_error("query scale gradients, float64", error) <= 1e-10, name
    shared = grads["Q"] + grads["K"] + grads["V"]
    assert relative_error(shared, tx.grad.numpy()) <= 1e-10


def test_query_scale_decodes_saves_and_loads(tmp_path):
    attention = mha.MultiHeadAttention(
        E, H, num_kv_heads=H_KV, rope_theta=100.0, query_scale=True, seed=0
    )
    assert attention.q_scale is not None and "query_scale=True" in repr(attention)
    attention.q_scale = 1.0 + np.random.default_rng(12).standard_normal(H * D)
    x = np.random.default_rng(13).standard_normal((B, L, E))
    whole = attention(x, mask=True)
    cache = attention.new_cache(B)
    steps = [attention(x[:, :3], cache=cache)]
    steps += [attention(x[:, i : i + 1], cache=cache) for i in range(3, L)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    paged = mha.PagedKVCache(16, 4, H_KV, D, dtype=np.float64)
    paged.add("a")
    paged.add("b")
    steps = [attention(x[:, :5], cache=paged), attention(x[:, 5:], cache=paged)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    attention.save(tmp_path / "layer.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "layer.npz")
    assert np.array_equal(loaded.q_scale, attention.q_scale)
    assert np.array_equal(loaded(x, mask=True), whole)
    assert relative_error(attention(x, mask=True), whole) == 0.0
    plain = mha.MultiHeadAttention.from_spec(
        attention.spec, {**attention.weights(), "q_scale": None}
    )
    assert relative_error(plain(x, mask=True), whole) > 1e-3  # the factors matter
    with pytest.raises(ShapeError, match=r"q_scale must have shape \(H\*d_k,\) = \(16,\)"):
        mha.multi_head_attention(
            x, x, x, attention.W_q, attention.W_k, attention.W_v, attention.W_o, H,
            num_kv_heads=H_KV, q_scale=np.ones(4),
        )  # fmt: skip
    with pytest.raises(AttentionValueError, match=r"cannot hold .*a query scale"):
        attention.to_torch()
