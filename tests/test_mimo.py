"""Issue 33's families read here beyond test_pretrained.py's layer-by-layer comparisons:
differential attention (DiffLlama: :class:`mha.DifferentialAttention`) against transformers'
own ``DiffLlamaAttention`` in float64, forward and every gradient against torch.autograd,
through a KV cache and a paged cache, its errors by name; MiMo-V2-Flash's window from
``sliding_window_size`` and its value scale refused where it is not a number."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error
from support.rope_oracle import float64_torch

import mha
from mha.integrations.readers.family import Differential

E, H, H_KV, D, EPS, THETA = 24, 8, 4, 6, 1e-3, 100.0


def diffllama_layer(torch, transformers, index=2):
    """transformers' DiffLlamaAttention of layer ``index`` in float64, random weights."""
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

    config = transformers.DiffLlamaConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=H_KV, head_dim=D,
        attention_bias=True, rms_norm_eps=EPS, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    module = DiffLlamaAttention(config, layer_idx=index).double().eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.4)
    return module


def rotary(torch, L):
    """The rotation's cosines and sines (the halves paired), as Llama's rotary embedding."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)[None]
    return emb.cos(), emb.sin()


def ours(module):
    """The same layer as a DifferentialAttention: its values' columns as the reader joins
    them (each query head's two value heads)."""
    columns = Differential().columns(H_KV, D)
    weights = {
        f"{p}": getattr(module, f"{name}_proj").weight.detach().numpy().T
        for p, name in (("W_q", "q"), ("W_k", "k"), ("W_v", "v"), ("W_o", "o"))
    }
    weights |= {
        f"b_{p}": getattr(module, f"{p}_proj").bias.detach().numpy() for p in ("q", "k", "v", "o")
    }
    weights["W_v"], weights["b_v"] = weights["W_v"][:, columns], weights["b_v"][columns]
    weights |= {name: getattr(module, name).detach().numpy() for name in Differential().names}
    spec = mha.DifferentialSpec(
        num_heads=H, num_kv_heads=H_KV, head_dim=D, rope_theta=THETA, v_head_dim=2 * D,
        lambda_init=module.lambda_init, differential_eps=EPS,
    )  # fmt: skip
    return mha.DifferentialAttention.from_spec(spec, weights), columns


def test_differential_attention_and_its_gradients_match_transformers_layer(
    torch, transformers, record_error
):
    module = diffllama_layer(torch, transformers)
    layer, columns = ours(module)
    B, L = 2, 9
    X = np.random.default_rng(1).standard_normal((B, L, E))
    x = torch.tensor(X, requires_grad=True)
    with float64_torch():  # lambda's dot products, which DiffLlama takes in float32
        expected = module(x, position_embeddings=rotary(torch, L), attention_mask=None)[0]
    out, backward = layer(X, mask=True, return_backward=True)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("differential attention vs DiffLlamaAttention", error) <= 1e-13
    G = np.random.default_rng(2).standard_normal(out.shape)
    with float64_torch():
        (expected * torch.from_numpy(G)).sum().backward()
    grads = backward(G)
    dX = grads["query"] + grads["key"] + grads["value"]  # X was all three
    assert relative_error(dX, x.grad.numpy()) <= 1e-10
    for p in "qko":
        proj = getattr(module, f"{p}_proj")
        assert relative_error(grads[f"W_{p}"], proj.weight.grad.numpy().T) <= 1e-10, p
        if p != "k":  # b_k's is zero but for rounding: a key bias shifts a row's scores alike
            assert relative_error(grads[f"b_{p}"], proj.bias.grad.numpy()) <= 1e-10, p
    dW_v = np.zeros((E, H_KV * D))  # the joined values' columns, summed back to v_proj's
    np.add.at(dW_v.T, columns, grads["W_v"].T)
    assert relative_error(dW_v, module.v_proj.weight.grad.numpy().T) <= 1e-10
    for name in Differential().names:
        error = relative_error(grads[name], getattr(module, name).grad.numpy())
        assert record_error("differential attention's lambda gradients", error) <= 1e-10, name


def test_a_cache_and_a_paged_cache_decode_as_the_whole_sequence(record_error):
    layer = mha.DifferentialAttention(
        E, H, num_kv_heads=H_KV, head_dim=D, rope_theta=THETA, window=5, bias=True, seed=3
    )
    X = np.random.default_rng(4).standard_normal((2, 11, E))
    whole = layer(X, mask=True)
    cache = layer.new_cache(2)
    paged = mha.PagedKVCache(16, 4, H_KV, D, value_dim=2 * D, dtype=np.float64)
    paged.add(0)
    paged.add(1)
    steps, paged_steps = [], []
    for a, b in [(0, 4), (4, 5), (5, 6), (6, 11)]:
        steps.append(layer(X[:, a:b], cache=cache))
        paged_steps.append(layer(X[:, a:b], cache=paged, window=5))
    error = relative_error(np.concatenate(steps, axis=1), whole)
    assert record_error("differential attention, cache steps vs whole", error) <= 1e-13
    assert relative_error(np.concatenate(paged_steps, axis=1), whole) <= 1e-13


def test_the_spec_rebuilds_the_layer_and_what_it_cannot_do_is_refused_by_name(tmp_path):
    layer = mha.DifferentialAttention(16, 4, num_kv_heads=2, lambda_init=0.4, seed=5)
    X = np.random.default_rng(6).standard_normal((1, 5, 16))
    again = mha.DifferentialAttention.from_spec(layer.spec, layer.weights())
    np.testing.assert_array_equal(again(X, True), layer(X, True))
    assert "DifferentialAttention(lambda_init=0.4, d_model=16" in repr(layer)
    with pytest.raises(mha.AttentionValueError, match="num_heads=3 must be even"):
        mha.DifferentialAttention(12, 3)
    with pytest.raises(mha.AttentionValueError, match="output_gate: a DifferentialAttention"):
        mha.DifferentialAttention(16, 4, output_gate="sigmoid")
    with pytest.raises(mha.AttentionValueError, match="lambda_init must be a finite number"):
        mha.DifferentialAttention(16, 4, lambda_init=float("nan"))
    weights = {**layer.weights(), "lambda_k2": np.ones(3)}
    with pytest.raises(mha.ShapeError, match=r"lambda_k2 must have shape \(4,\)"):
        mha.DifferentialAttention.from_spec(layer.spec, weights)
    with pytest.raises(mha.AttentionValueError, match="needs lambda_init"):
        mha.DifferentialAttention.from_spec(mha.LayerSpec(num_heads=4), layer.weights())
    with pytest.raises(mha.AttentionValueError, match=r"not saved to \.npz files"):
        layer.save(tmp_path / "a.npz")
    with pytest.raises(mha.AttentionValueError, match="cannot hold differential attention"):
        layer.to_torch()


def variant(tmp_path, family, change):
    folder = shutil.copytree(models.saved(family), tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return folder


def test_a_diffllama_layer_loads_as_differential_attention_only(tmp_path, transformers):
    folder = models.saved("diffllama")
    assert type(mha.from_pretrained(folder, layer=1)) is mha.DifferentialAttention
    with pytest.raises(mha.AttentionValueError, match="is differential attention: load it with"):
        mha.MultiHeadAttention.from_pretrained(folder, layer=1)
    odd = variant(tmp_path, "diffllama", {"num_key_value_heads": 1})
    with pytest.raises(mha.AttentionValueError, match="8 heads and 1 key/value heads"):
        mha.from_pretrained(odd, layer=0)


def test_mimo_v2_flash_reads_its_window_as_its_config_class(tmp_path, transformers):
    """``sliding_window_size`` positions before the query and the query's own (the config
    class's ``sliding_window``), where config.json gives it."""
    folder = variant(tmp_path, "mimo_v2_flash", {"sliding_window_size": 3})
    config = transformers.AutoConfig.from_pretrained(folder)
    attention = mha.from_pretrained(folder, layer=0)
    assert attention.window == config.sliding_window == 4
    assert (attention.num_kv_heads, attention.v_head_dim, attention.sinks is not None) == (
        4, 8, True,
    )  # fmt: skip
    full = mha.from_pretrained(folder, layer=1)
    assert (full.window, full.num_kv_heads, full.sinks) == (None, 2, None)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"attention_value_scale": "0.7"}, r"attention_value_scale='0\.7' \(values scaled"),
        ({"sliding_window_size": -1}, r"sliding_window_size=-1 \(a window of no whole"),
    ],
)
def test_mimo_v2_flash_refuses_what_is_not_a_number(tmp_path, change, refusal, transformers):
    folder = variant(tmp_path, "mimo_v2_flash", change)
    with pytest.raises(mha.AttentionValueError, match=refusal) as error:
        mha.from_pretrained(folder, layer=0)
    assert str(folder) in str(error.value)
