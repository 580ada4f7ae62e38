"""Dory's reader (mha.integrations.readers.dory) beside test_pretrained.py's comparisons: the
gradients of a layer against torch.autograd through transformers' ``DoryAttention`` (its
``sqk`` and ``s_gate`` folded into ``q_scale`` and ``W_g``: their gradients by the chain
rule), the cache slots of the looped section, and what is refused by name."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.integrations.readers.layouts import loop_sections, loop_slot

B, L = 2, 24
TOLERANCE = 1e-10


def test_the_cache_slots_of_the_looped_section():
    """Slot ``i`` below ``num_hidden_layers`` is layer ``i``; the later loops' slots follow,
    loop by loop; a released config's ``"mlp"`` blocks halve the counts."""
    config = {"num_hidden_layers": 6, "n_input_layers": 1, "n_output_layers": 2,
              "n_recurrent_loops": 3}  # fmt: skip
    assert [loop_slot(config, s) for s in range(12)] == [0, 1, 2, 3, 4, 5, 1, 2, 3, 1, 2, 3]
    released = {**config, "num_hidden_layers": 12, "n_input_layers": 2, "n_output_layers": 4,
                "layer_types": ["full_attention", "mlp"] * 6}  # fmt: skip
    assert loop_sections(released) == loop_sections(config) == (6, 1, 3, 3)


@pytest.mark.parametrize("layer", [1, 4])  # the recurrent layer's first loop and its third
def test_gradients_match_autograd_through_transformers_layer(
    layer, torch, transformers, record_error
):
    from support.rope_oracle import float64_rotary, float64_torch
    from support.transformers_oracle import attention_keywords

    model = models.transformers_model("dory")
    float64_rotary(model)
    ids = torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(0))
    module = model.model.layers[1].self_attn  # every slot of the loop runs layer 1
    keywords = {**attention_keywords(model, ids)[1], "cache": None}
    g = np.random.default_rng(layer)
    x, grad_out = 0.7 * g.standard_normal((B, L, 48)), g.standard_normal((B, L, 48))
    tx = torch.tensor(x, requires_grad=True)
    module.zero_grad(set_to_none=True)
    with float64_torch():
        expected = module(**{**keywords, "hidden_states": tx})[0]
        (expected * torch.tensor(grad_out)).sum().backward()

    attention = mha.from_pretrained(models.saved("dory"), layer=layer, dtype=np.float64)
    out, backward = attention(x, mask=True, return_backward=True)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("pretrained dory gradients forward, float64", error) <= 1e-12
    grads = backward(grad_out)
    d, E = module.head_dim, 48
    a, b = d**0.5 / 0.2, E**0.25 / 0.2  # sqk's and s_gate's stored scale (initializer_range)
    sqk, s_gate = module.sqk.detach().numpy(), module.s_gate.detach().numpy()
    W_g = module.gate_proj.weight.detach().numpy().T  # (E, H*d), before s_gate's factors
    c = np.square(s_gate * b)
    ours = {
        "sqk": grads["q_scale"] * 2.0 * a * a * sqk,
        "s_gate": (grads["W_g"] * W_g).sum(axis=0) * 2.0 * b * b * s_gate,
        "gate_proj.weight": (grads["W_g"] * c).T,
    }
    for p in "qkvo":
        ours[f"{p}_proj.weight"] = grads[f"W_{p}"].T
        ours[f"{p}_proj.bias"] = grads[f"b_{p}"]
    label = "pretrained dory gradients vs autograd, float64"
    for name, parameter in module.named_parameters():
        theirs = parameter.grad.numpy()
        assert np.abs(theirs).max() > 1e-3, name  # every gradient matters
        assert record_error(label, relative_error(ours[name], theirs)) <= TOLERANCE, name
    shared = grads["query"] + grads["key"] + grads["value"]
    assert record_error(label, relative_error(shared, tx.grad.numpy())) <= TOLERANCE


def _variant(tmp_path, **changes):
    folder = tmp_path / "dory"
    shutil.copytree(models.saved("dory"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_what_dory_computes_beyond_mha_is_refused_by_name(tmp_path, transformers):
    folder = _variant(tmp_path, recurrent_kv_cache_mode="last_loop")
    with pytest.raises(mha.AttentionValueError, match="recurrent_kv_cache_mode='last_loop'"):
        mha.from_pretrained(folder, layer=0)


def test_sections_that_do_not_add_up_are_refused(tmp_path, transformers):
    folder = _variant(tmp_path, n_recurrent_layers=4)  # 2 + 4 + 2 blocks of 6
    with pytest.raises(mha.AttentionValueError, match="must add up to it"):
        mha.from_pretrained(folder, layer=0)
    count = 3 + 2 * 1  # the model's layers, then the recurrent layer's two later loops
    assert mha.attention_layers(models.saved("dory")) == list(range(count))
    with pytest.raises(mha.AttentionValueError, match="layer=5 is out of range"):
        mha.from_pretrained(models.saved("dory"), layer=count)


def _released(name):
    """The name of a tensor in a released checkpoint: each decoder layer ``i`` two blocks,
    its attention ``layers.{2i}.mixer`` and its mlp ``layers.{2i+1}.mixer``, the residual
    rates ``attn_alpha`` and ``mlp_alpha`` (what transformers' ``LayerPairCollapse`` loads)."""
    match = re.match(r"backbone\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(.*)", name)
    if match is None:
        return name
    i, part, rest = int(match[1]), match[2], match[3]
    block = 2 * i + (part in ("mlp", "lambda_2"))
    new = {"lambda_1": "attn_alpha", "lambda_2": "mlp_alpha"}.get(part, "mixer")
    return f"backbone.layers.{block}.{new}{rest}"


def test_a_released_checkpoint_of_two_blocks_a_layer_is_read_the_same(
    tmp_path, torch, transformers
):
    """The attention blocks of a released checkpoint (``backbone.layers.{2i}.mixer``), which
    transformers loads as the same model, are read as the same layers."""
    from safetensors.torch import load_file, save_file

    saved, folder = models.saved("dory"), tmp_path / "released"
    state = {}
    for shard in sorted(saved.glob("*.safetensors")):
        state |= load_file(shard)
    folder.mkdir()
    renamed = {_released(name): tensor.contiguous() for name, tensor in state.items()}
    assert "backbone.layers.2.mixer.sqk" in renamed
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(saved / "config.json", folder / "config.json")
    theirs = models.transformers_model("dory", folder).state_dict()
    ours = models.transformers_model("dory").state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[name], ours[name]) for name in ours)
    for layer in mha.attention_layers(saved):
        read = mha.from_pretrained(folder, layer=layer, dtype=np.float64).parameters()
        expected = mha.from_pretrained(saved, layer=layer, dtype=np.float64).parameters()
        assert read.keys() == expected.keys()
        for name, W in expected.items():
            assert (W is None and read[name] is None) or np.array_equal(read[name], W), name
