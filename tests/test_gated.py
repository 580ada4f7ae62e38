"""The gated hybrid families (issue 33; readers/gated.py): Qwen3-Next's and Qwen3.5's gate
fused into ``q_proj`` (each head's query, then its gate), LFM3's gate per head and
Bailing-hybrid's on DeepSeek's latent attention (:class:`mha.LatentAttention`), read from
the tiny checkpoints of support.pretrained_models (their layers are compared with
transformers' in test_pretrained.py and the census).

Here: the fused rows' order matters (read as two contiguous blocks, the layer differs from
transformers'); the config keys that choose the layers and the gate are read as the config
classes read them; the backward of each family's layers, through the gate, agrees with
torch.autograd through transformers' own attention module (float64, 1e-10), every
parameter's gradient laid out as the reader lays out its tensor.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.errors import AttentionValueError, WeightsFileError
from mha.integrations import readers
from mha.integrations.readers import gated
from mha.integrations.readers.attention import describe
from mha.integrations.readers.config import Settings
from mha.integrations.readers.layouts import Tensor, lay_out

B, L = 2, 24
TOLERANCE = 1e-10
QWEN = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def settings(config, family):
    row = readers.FAMILIES[family]
    source = type("Source", (), {"path": "ckpt", "config": config})()
    return Settings(source, family, row.defaults, row.keys)


@dataclasses.dataclass(frozen=True)
class Contiguous(gated.QueryGate):
    """Qwen3-Next's fused rows read wrongly: all the queries, then all the gates."""

    def tensors(self, read, E, H, d):
        return {f"{self.tensor}.weight": Tensor((2 * H * d, E), (("W_q", H * d), ("W_g", H * d)))}


def test_the_fused_rows_are_each_heads_query_then_its_gate(monkeypatch, transformers):
    """Qwen3.5's ``q_proj`` read as all the queries, then all the gates: wrong."""
    from support.rope_oracle import float64_rotary

    family = "qwen3_5_text"
    changed = dataclasses.replace(readers.FAMILIES[family], gate=Contiguous(bias=None))
    monkeypatch.setitem(readers.FAMILIES, family, changed)
    model = models.transformers_model(family)
    float64_rotary(model)
    for layer, calls in models.decoding_calls(model, B, L, L - 1).items():
        x, expected = calls[0]
        attention = mha.MultiHeadAttention.from_pretrained(
            models.saved(family), layer=layer, dtype=np.float64
        )
        assert relative_error(attention(x, mask=True), expected) > 1e-4, layer


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize("interval", [1, 2, 3, 4])
def test_qwen_layer_types_default_as_the_config_classes(family, interval, transformers):
    config_class = transformers.CONFIG_MAPPING[family]
    expected = config_class(num_hidden_layers=9, full_attention_interval=interval).layer_types
    config = {"num_hidden_layers": 9, "full_attention_interval": interval}
    assert gated.every_interval(settings(config, family), 9) == expected
    if interval == 4:  # the class's default, when config.json has no key
        assert gated.every_interval(settings({}, family), 9) == expected


def test_lfm3_layer_types_default_as_the_config_class(transformers):
    expected = transformers.Lfm3Config(num_hidden_layers=11).layer_types
    assert gated.lfm3_types(settings({}, "lfm3"), 11) == expected


def test_a_bad_full_attention_interval_is_refused_by_name(tmp_path, transformers):
    folder = _variant(tmp_path, "qwen3_next", {"full_attention_interval": 0}, ["layer_types"])
    with pytest.raises(AttentionValueError, match="full_attention_interval=0"):
        mha.attention_layers(folder)


def test_lfm3_without_its_gate_has_no_gate_weights(tmp_path, transformers):
    """``use_attention_gate: false`` is read: the checkpoint's gate is then a tensor the
    config does not call for, and the layer without it computes no gate."""
    folder = _variant(tmp_path, "lfm3", {"use_attention_gate": False})
    with pytest.raises(WeightsFileError, match=r"does not have: gate_proj\.weight"):
        mha.from_pretrained(folder, layer=0)
    config = json.loads((folder / "config.json").read_text())
    read = settings(config, "lfm3")
    _, layer, tensors = describe(readers.FAMILIES["lfm3"], read, 0)
    assert "output_gate" not in layer and "gate_proj.weight" not in tensors


def _variant(tmp_path, family, change, drop=()):
    folder = shutil.copytree(models.saved(family), tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    config = {key: value for key, value in config.items() if key not in drop} | change
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def captured(family):
    """The float64 transformers model of ``family`` and the keywords each attention layer's
    ``self_attn`` got in a forward over ``B`` sequences of ``L`` tokens."""
    return models.captured(family, B, L)


@pytest.mark.parametrize(
    ("family", "layer"), [("qwen3_next", 0), ("lfm3", 0), ("lfm3", 2), ("bailing_hybrid", 2)]
)
def test_gradients_through_the_gate_match_autograd(family, layer, torch, transformers):
    """Each parameter's gradient, transformers' tensor laid out as the reader lays it out
    (Qwen3-Next's ``q_proj`` into ``W_q`` and ``W_g``), and the hidden state's."""
    from support.rope_oracle import float64_torch

    model, calls = captured(family)
    module = model.model.layers[layer].self_attn
    g = np.random.default_rng(layer + 33)
    x = 0.7 * g.standard_normal((B, L, model.config.hidden_size))
    grad_out = g.standard_normal(x.shape)
    module.zero_grad(set_to_none=True)
    tx = torch.tensor(x, requires_grad=True)
    with float64_torch():
        expected = module(**{**calls[layer], "hidden_states": tx, "cache": None})[0]
        (expected * torch.tensor(grad_out)).sum().backward()

    folder = models.saved(family)
    attention = mha.from_pretrained(folder, layer=layer, dtype=np.float64)
    out, backward = attention(x, mask=True, return_backward=True)
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    grads = backward(grad_out)
    row = readers.FAMILIES[family]
    read = settings(json.loads((folder / "config.json").read_text()), family)
    _, _, tensors = describe(row, read, layer)
    renamed = {  # transformers' modules, their saved names
        "g_proj.weight": "gate_proj.weight" if family == "lfm3" else "g_proj.weight",
        "o_proj.weight": "dense.weight" if family == "bailing_hybrid" else "o_proj.weight",
        "o_proj.bias": "dense.bias" if family == "bailing_hybrid" else "o_proj.bias",
    }
    compared = set()
    for name, parameter in module.named_parameters():
        theirs = lay_out(parameter.grad.numpy(), tensors[renamed.get(name, name)])
        for ours, expected_grad in theirs.items():
            assert np.abs(expected_grad).max() > 1e-3, (name, ours)  # every gradient matters
            assert relative_error(grads[ours], expected_grad) <= TOLERANCE, (name, ours)
            compared.add(ours)
    inputs = set(grads) - compared  # the latent attention's one input: "query"
    latent = family in models.LATENT_FAMILIES
    assert "W_g" in compared and inputs == ({"query"} if latent else {"query", "key", "value"})
    shared = sum(grads[name] for name in sorted(inputs))
    assert relative_error(shared, tx.grad.numpy()) <= TOLERANCE


LATENT = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4}


def test_a_latent_gate_is_one_per_head_and_its_mistakes_are_refused_by_name():
    gated_layer = mha.LatentAttention(16, 2, **LATENT, output_gate="sigmoid", seed=0)
    plain = mha.LatentAttention(16, 2, **LATENT, seed=0)
    assert gated_layer.W_g.shape == (16, 2) and "output_gate='sigmoid'" in repr(gated_layer)
    x = np.random.default_rng(1).standard_normal((2, 5, 16))
    whole = gated_layer(x, mask=True)
    assert relative_error(whole, plain(x, mask=True)) > 1e-3  # the gate changes the output
    copy = mha.LatentAttention.from_spec(gated_layer.spec, gated_layer.weights())
    assert np.array_equal(copy(x, mask=True), whole)
    cache = gated_layer.new_cache(2)
    steps = [gated_layer(x[:, :3], cache=cache)] + [
        gated_layer(x[:, t : t + 1], cache=cache) for t in range(3, 5)
    ]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    weights = gated_layer.weights()
    with pytest.raises(mha.ShapeError, match=r"W_g has shape \(16, 8\) but this layer needs"):
        mha.LatentAttention.from_spec(gated_layer.spec, {**weights, "W_g": np.ones((16, 8))})
    with pytest.raises(AttentionValueError, match="weights W_g are missing"):
        mha.LatentAttention.from_spec(gated_layer.spec, {**weights, "W_g": None})
    with pytest.raises(AttentionValueError, match="weights W_g are not used by this layer"):
        mha.LatentAttention.from_spec(plain.spec, weights)
    with pytest.raises(AttentionValueError, match="output_gate must be one of"):
        mha.LatentAttention(16, 2, **LATENT, output_gate="relu")
