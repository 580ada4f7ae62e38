"""Kimi-Linear's latent attention without rope and Zamba's and Zamba2's attention blocks shared
across layers (readers/nope.py, readers/shared_blocks.py), beyond test_pretrained.py's
comparisons: every gradient of each attention layer of the tiny checkpoints against
torch.autograd through transformers' own attention module in float64 (Zamba2's adapters'
gradients from the folded weights' by the chain rule), the adapters folded exactly and
mattering, ``LatentAttention(rotate=False)`` and ``MultiHeadAttention(qdim=)`` on their own
(forward, cache, paged cache, gradient), and the refusals by name.

As in test_pretrained_gradients.py, a pre-hook captures the keywords each layer's attention
gets in a model forward; the module is called again with them and a random leaf hidden
state under ``float64_torch`` (Kimi-Linear's RMSNorms upcast to float32 otherwise).
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha import AttentionValueError, WeightsFileError
from mha.integrations import readers
from mha.integrations.readers.shared_blocks import SharedBlocks

B, L = 2, 24
FORWARD, GRADIENT = 1e-12, 1e-10
FAMILIES = ("kimi_linear", "zamba", "zamba2")

LATENT_NAMES = {"q_proj.weight": "W_q", "kv_a_proj_with_mqa.weight": "W_kv_a",
                "kv_a_layernorm.weight": "kv_a_norm", "kv_b_proj.weight": "W_kv_b",
                "o_proj.weight": "W_o"}  # fmt: skip


@functools.cache
def captured(family):
    """The float64 transformers model of ``family`` and each attention layer's module and
    the keywords it got in a forward over ``B`` sequences of ``L`` tokens, by layer."""
    import torch
    from support.rope_oracle import float64_rotary, float64_torch, rotary_modules
    from support.transformers_oracle import attention_layers

    from mha.integrations.readers.layouts import module_path

    model = models.transformers_model(family)
    if rotary_modules(model):  # Zamba2's (Kimi-Linear and Zamba have none)
        float64_rotary(model)
    path = models.attention_path(model)
    modules = {i: model.get_submodule(module_path(path, i)) for i in attention_layers(model)}
    calls = {}

    def hook(index):
        def save(module, args, kwargs):
            calls[index] = {**kwargs, **({"hidden_states": args[0]} if args else {})}

        return save

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in modules.items()]
    ids = torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad(), float64_torch():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return model, modules, calls


CASES = [("kimi_linear", 0), ("kimi_linear", 2), ("zamba", 0), ("zamba", 2), ("zamba2", 0),
         ("zamba2", 2), ("zamba2", 3)]  # fmt: skip
"""Every attention layer of the tiny checkpoints (Zamba2's 0 and 3 share a block)."""


@pytest.mark.parametrize(("family", "layer"), CASES)
def test_gradients_match_autograd_through_transformers_layers(
    family, layer, torch, transformers, record_error
):
    from support.rope_oracle import float64_torch

    _, modules, calls = captured(family)
    module, keywords = modules[layer], {**calls[layer], "cache": None}
    width = keywords["hidden_states"].shape[-1]
    g = np.random.default_rng(10 * len(family) + layer)
    x = 0.7 * g.standard_normal((B, L, width))
    tx = torch.tensor(x, requires_grad=True)
    module.zero_grad(set_to_none=True)
    with float64_torch():
        expected = module(**{**keywords, "hidden_states": tx})[0]
        grad_out = g.standard_normal(tuple(expected.shape))
        (expected * torch.tensor(grad_out)).sum().backward()

    attention = mha.from_pretrained(models.saved(family), layer=layer, dtype=np.float64)
    out, backward = attention(x, mask=True, return_backward=True)
    label = f"pretrained {family} gradients vs autograd, float64"
    assert record_error(label, relative_error(out, expected.detach().numpy())) <= FORWARD
    grads = backward(grad_out)
    grad_x = grads["query"] + grads.get("key", 0.0) + grads.get("value", 0.0)
    assert record_error(label, relative_error(grad_x, tx.grad.numpy())) <= GRADIENT

    for name, parameter in module.named_parameters():
        if ".weight" not in name or "adapter" in name:
            continue
        theirs = parameter.grad.numpy()
        ours = LATENT_NAMES[name] if family == "kimi_linear" else f"W_{name[0]}"
        want = theirs.T if theirs.ndim == 2 else theirs
        assert np.abs(want).max() > 1e-3, name
        assert record_error(label, relative_error(grads[ours], want)) <= GRADIENT, name
    if family == "zamba2":  # the adapters' by the chain rule: W = W_p + A @ B
        n = [0, 2, 3].index(layer)
        adapters = module.linear_q_adapter_list[n], module.linear_v_adapter_list[n]
        for p, adapter in zip("qv", adapters, strict=True):
            A, Bw = adapter[0].weight.detach().numpy().T, adapter[1].weight.detach().numpy().T
            G = grads[f"W_{p}"]
            for ours, theirs in ((G @ Bw.T, adapter[0].weight.grad.numpy().T),
                                 (A.T @ G, adapter[1].weight.grad.numpy().T)):  # fmt: skip
                assert record_error(label, relative_error(ours, theirs)) <= GRADIENT, p


def test_zamba2s_adapters_are_folded_per_layer_and_matter(transformers, monkeypatch):
    """Layers 0 and 3 share a block but not their adapters: read without them, every layer
    differs from transformers'; the weights read are the block's plus the layer's adapter."""
    _, modules, _ = captured("zamba2")
    folder = models.saved("zamba2")
    read = {i: mha.from_pretrained(folder, layer=i, dtype=np.float64) for i in (0, 2, 3)}
    assert read[0].W_o is not read[3].W_o and np.array_equal(read[0].W_o, read[3].W_o)
    assert not np.array_equal(read[0].W_q, read[3].W_q)
    for i, n in ((0, 0), (2, 1), (3, 2)):
        module = modules[i]
        A, Bw = (module.linear_k_adapter_list[n][j].weight.detach().numpy() for j in (0, 1))
        W = module.k_proj.weight.detach().numpy().T + A.T @ Bw.T
        assert np.abs(read[i].W_k - W).max() <= 1e-15

    def unfolded(self, read, weights):
        return {name: W for name, W in weights.items() if name[:2] not in ("A_", "B_")}

    monkeypatch.setattr(SharedBlocks, "folded", unfolded)
    oracle = models.decoding_calls(models.transformers_model("zamba2"), B, 12, 6)
    for layer, calls in oracle.items():
        x, expected = calls[0]
        ours = mha.from_pretrained(folder, layer=layer, dtype=np.float64)(x, mask=True)
        assert relative_error(ours, expected) > 1e-4, layer


def test_zamba_reads_the_first_layers_block_for_every_attention_layer(transformers):
    """Zamba's checkpoint keeps its one block under layer 0: layer 2 reads the same weights."""
    folder = models.saved("zamba")
    first, second = (mha.from_pretrained(folder, layer=i) for i in (0, 2))
    for name in ("W_q", "W_k", "W_v", "W_o"):
        assert np.array_equal(getattr(first, name), getattr(second, name)), name
    assert first.qdim == 96 and first.d_model == 48 and first.num_kv_heads == 2
    assert first.scale == pytest.approx((12 / 2) ** -0.5)


def test_kimi_linear_reads_its_latent_attention_unrotated(transformers):
    attention = mha.from_pretrained(models.saved("kimi_linear"), layer=2)
    assert isinstance(attention, mha.LatentAttention) and attention.rotate is False
    assert attention.scale == pytest.approx((8 + 4) ** -0.5)


def test_kimi_linears_layer_types_from_its_linear_attn_config(tmp_path, transformers):
    """A released config's ``linear_attn_config`` (layers numbered from 1) without
    ``layer_types``, as transformers' config class reads it; a KDA layer refused by index."""
    folder = tmp_path / "kimi"
    shutil.copytree(models.saved("kimi_linear"), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["layer_types"]
    config["linear_attn_config"] = {"full_attn_layers": [1, 3], "kda_layers": [2]}
    (folder / "config.json").write_text(json.dumps(config))
    assert mha.attention_layers(folder) == [0, 2]
    with pytest.raises(AttentionValueError, match="layer 1 of this Kimi-Linear checkpoint is a "
                       "Kimi Delta Attention"):  # fmt: skip
        mha.from_pretrained(folder, layer=1)


def test_zamba2s_other_kinds_of_blocks_are_refused_by_name(tmp_path, transformers):
    """A block whose adapter writes other widths than its projection (grouped key/value
    heads with adapters, which transformers cannot add) is refused, naming the adapter."""
    folder = tmp_path / "zamba2"
    shutil.copytree(models.saved("zamba2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsFileError, match=r"k_proj\.weight has shape"):
        mha.from_pretrained(folder, layer=0)


# ------------------------------------------------------------- the layers on their own


def test_latent_attention_without_rotation_is_position_free():
    """``rotate=False``: the rope features unrotated, so shifting the positions changes
    nothing; the cache, the gradient (central differences) and save/load agree."""
    attention = mha.LatentAttention(24, 3, kv_lora_rank=10, qk_nope_head_dim=6,
                                    qk_rope_head_dim=3, v_head_dim=5, q_lora_rank=7,
                                    rotate=False, seed=1)  # fmt: skip
    x = np.random.default_rng(2).standard_normal((2, 9, 24))
    out, backward = attention(x, mask=True, return_backward=True)
    assert np.abs(attention(x, mask=True, positions=np.arange(9) + 100) - out).max() <= 1e-13
    cache = attention.new_cache(2)
    steps = [attention(x[:, :5], cache=cache)] + [attention(x[:, t:t + 1], cache=cache)
                                                  for t in range(5, 9)]  # fmt: skip
    assert relative_error(np.concatenate(steps, axis=1), out) <= 1e-13
    grad_out = np.random.default_rng(3).standard_normal(out.shape)
    grads = backward(grad_out)
    W, index, h = attention.W_kv_a, (4, 11), 1e-6
    kept, sides = W[index], []
    for step in (h, -h):
        W[index] = kept + step
        sides.append(float(np.sum(attention(x, mask=True) * grad_out)))
    W[index] = kept
    assert (sides[0] - sides[1]) / (2 * h) == pytest.approx(grads["W_kv_a"][index], rel=1e-6)
    with pytest.raises(AttentionValueError, match="rotate=False"):
        mha.LatentAttention(24, 3, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                            v_head_dim=5, q_lora_rank=7, rotate=False,
                            indexer=mha.api.sparse.IndexerSpec(2, 2, 8))  # fmt: skip


def test_multi_head_attention_with_queries_wider_than_the_model(torch):
    """``qdim``: queries (and, for self-attention, keys and values) of another width than
    the output; against the functional call, the cache, the paged cache, autograd."""
    attention = mha.MultiHeadAttention(8, 2, num_kv_heads=1, qdim=16, kdim=16, vdim=16, seed=0)
    assert "qdim=16" in repr(attention) and attention.W_q.shape == (16, 8)
    x = np.random.default_rng(0).standard_normal((2, 7, 16))
    out, backward = attention(x, mask=True, return_backward=True)
    assert out.shape == (2, 7, 8)
    cache = attention.new_cache(2)
    steps = [attention(x[:, :4], cache=cache)] + [attention(x[:, t:t + 1], cache=cache)
                                                  for t in range(4, 7)]  # fmt: skip
    assert relative_error(np.concatenate(steps, axis=1), out) <= 1e-13
    paged = mha.PagedKVCache(8, 4, 1, 4, dtype=np.float64)
    paged.add(0), paged.add(1)
    assert relative_error(attention(x, cache=paged), out) <= 1e-13

    grad_out = np.random.default_rng(1).standard_normal(out.shape)
    grads = backward(grad_out)
    tx = torch.tensor(x, requires_grad=True)
    tw = {name: torch.tensor(W, requires_grad=True) for name, W in attention.parameters().items()}
    q = (tx @ tw["W_q"]).view(2, 7, 2, 4).transpose(1, 2)
    k = (tx @ tw["W_k"]).view(2, 7, 1, 4).transpose(1, 2)
    v = (tx @ tw["W_v"]).view(2, 7, 1, 4).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k.expand(2, 2, 7, 4), v.expand(2, 2, 7, 4), is_causal=True
    )
    expected = o.transpose(1, 2).reshape(2, 7, 8) @ tw["W_o"]
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    (expected * torch.tensor(grad_out)).sum().backward()
    for name, W in tw.items():
        assert relative_error(grads[name], W.grad.numpy()) <= GRADIENT, name
    grad_x = grads["query"] + grads["key"] + grads["value"]
    assert relative_error(grad_x, tx.grad.numpy()) <= GRADIENT

    again = mha.MultiHeadAttention.from_spec(attention.spec, attention.weights())
    assert (again.qdim, again.d_model) == (16, 8)
    with pytest.raises(AttentionValueError, match="not qdim=16"):
        mha.MultiHeadAttention(8, 2, qdim=16)(x)
    with pytest.raises(mha.ShapeError, match="qdim=16"):
        attention(x[..., :8])
    with pytest.raises(AttentionValueError, match=r"qdim"):
        attention.to_torch()


def test_the_families_are_read(transformers):
    assert set(FAMILIES) <= set(readers.FAMILIES) and not set(FAMILIES) & set(readers.REFUSED)
