"""Latent attention with an output gate beside sparse top-k attention (issue 33;
readers/latentgates.py): A.X-K2's query and sigmoid gate per feature fused in
``q_gate_proj`` (saved as ``q_b_proj``), both reading ``[norm(a), a]``, the query latent
after and before its RMSNorm (:attr:`mha.LatentSpec.query_gate`), beside DeepSeek-V3.2's
indexer.

The layers are those of the tiny checkpoints of support.pretrained_models (``index_topk`` 4
of 24 positions; compared with transformers' whole and decoding in test_pretrained.py and
the census), loaded by transformers in float64 with the float64 rotary of
support.rope_oracle. Here: the gradient of the attention given the choice against
torch.autograd (every weight's, laid out as the reader lays out its tensor, and the
input's, to 1e-10); the fused rows' order matters; the layer's spec survives ``from_spec``
and ``save``/``load``, its cache decodes as the whole sequence; its mistakes are refused by
name.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.errors import AttentionValueError
from mha.integrations import readers
from mha.integrations.readers.attention import describe
from mha.integrations.readers.config import Settings
from mha.integrations.readers.layouts import lay_out

B, L, PREFILL = 2, 24, 10
TOLERANCE = 1e-10
LATENT = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4}
RENAMED = {"q_gate_proj.weight": "q_b_proj.weight"}
"""transformers' modules, by their saved names."""


def settings(folder, family):
    row = readers.FAMILIES[family]
    config = json.loads((folder / "config.json").read_text())
    source = type("Source", (), {"path": "ckpt", "config": config})()
    return Settings(source, family, row.defaults, row.keys)


def captured(family):
    return models.captured(family, B, L, 64)


@pytest.mark.parametrize(
    ("family", "layer"),
    [("axk2", 0), ("axk2", 2), ("dots3_note_text", 0), ("dots3_note_text", 2)],
)
def test_gradients_given_the_choice_match_autograd(
    family, layer, torch, transformers, record_error
):
    """Each parameter's gradient, transformers' tensor laid out as the reader lays it out
    (``q_gate_proj`` into ``W_q_b`` and ``W_g``; dots3's norms' weights times their
    scales, whose gradients are transformers' divided by them), and the hidden state's; the
    indexer's choice has none."""
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
    assert set(grads) == {*attention.parameters(), "query"}
    _, _, tensors = describe(readers.FAMILIES[family], settings(folder, family), layer)
    label = f"latent gates {family} gradients vs autograd, float64"
    compared = set()
    scales = {  # dots3's norms: mha's weight is transformers' times the scale
        "q_a_norm": getattr(module, "q_lora_scale", 1.0),
        "kv_a_norm": getattr(module, "kv_lora_scale", 1.0),
    }
    for name, parameter in module.named_parameters():
        if name.startswith("indexer."):  # the choice has no gradient
            assert parameter.grad is None, name
            continue
        theirs = lay_out(parameter.grad.numpy(), tensors[RENAMED.get(name, name)])
        for ours, expected_grad in theirs.items():
            assert np.abs(expected_grad).max() > 1e-3, (name, ours)  # every gradient matters
            error = relative_error(grads[ours], expected_grad / scales.get(ours, 1.0))
            assert record_error(label, error) <= TOLERANCE, (name, ours)
            compared.add(ours)
    assert compared == set(attention.parameters()) and "W_g" in compared
    error = relative_error(grads["query"], tx.grad.numpy())
    assert record_error(label, error) <= TOLERANCE


def test_the_fused_rows_are_each_heads_query_then_its_gate(monkeypatch, transformers):
    """``q_b_proj`` read as two contiguous blocks (every head's query, then every gate), or
    its query and gate swapped, computes another layer than transformers'."""
    from mha.integrations.readers.layouts import Tensor

    folder = models.saved("axk2")
    x = np.random.default_rng(3).standard_normal((B, L, 48))
    expected = mha.from_pretrained(folder, layer=1, dtype=np.float64)(x, mask=True)
    row = readers.FAMILIES["axk2"]

    @dataclasses.dataclass(frozen=True)
    class Blocks(type(row.tensors)):
        swapped: bool = False

        def tensors(self, settings, biased):
            tensors = super().tensors(settings, biased)
            H, v = settings["num_heads"], settings["v_head_dim"]
            qk = settings["qk_nope_head_dim"] + settings["qk_rope_head_dim"]
            fused = tensors["q_b_proj.weight"]
            parts = (
                (("W_g", v), ("W_q_b", qk)) if self.swapped else (("W_q_b", H * qk), ("W_g", H * v))
            )
            tensors["q_b_proj.weight"] = Tensor(fused.shape, parts, H if self.swapped else 1)
            return tensors

    fields = dataclasses.asdict(row.tensors)
    for wrong in (Blocks(**fields), Blocks(**fields, swapped=True)):
        monkeypatch.setitem(readers.FAMILIES, "axk2", dataclasses.replace(row, tensors=wrong))
        changed = mha.from_pretrained(folder, layer=1, dtype=np.float64)(x, mask=True)
        assert relative_error(changed, expected) > 1e-4


def test_a_query_gate_layer_keeps_its_spec_and_decodes_as_a_whole(tmp_path):
    attention = mha.LatentAttention(16, 2, **LATENT, q_lora_rank=6, query_gate=True, seed=0)
    assert attention.W_q_b.shape == (12, 12) and attention.W_g.shape == (12, 8)
    assert attention.output_gate == "sigmoid" and "query_gate=True" in repr(attention)
    x = np.random.default_rng(1).standard_normal((2, 7, 16))
    whole = attention(x, mask=True)
    copy = mha.LatentAttention.from_spec(attention.spec, attention.weights())
    assert np.array_equal(copy(x, mask=True), whole)
    attention.save(tmp_path / "axk2.npz")
    loaded = mha.LatentAttention.load(tmp_path / "axk2.npz")
    assert loaded.query_gate and np.array_equal(loaded(x, mask=True), whole)
    cache = attention.new_cache(2)
    steps = [attention(x[:, :3], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(3, 7)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    ungated = {**attention.weights(), "W_g": np.zeros_like(attention.W_g)}  # sigmoid(0) = 1/2
    half = mha.LatentAttention.from_spec(attention.spec, ungated)(x, mask=True)
    assert relative_error(half, whole) > 1e-3


def test_a_query_gates_mistakes_are_refused_by_name():
    with pytest.raises(AttentionValueError, match="query_gate needs q_lora_rank"):
        mha.LatentAttention(16, 2, **LATENT, query_gate=True)
    attention = mha.LatentAttention(16, 2, **LATENT, q_lora_rank=6, query_gate=True, seed=0)
    weights = attention.weights()
    with pytest.raises(mha.ShapeError, match=r"W_g has shape \(16, 2\) .*query_gate"):
        mha.LatentAttention.from_spec(attention.spec, {**weights, "W_g": np.ones((16, 2))})
    with pytest.raises(mha.ShapeError, match=r"W_q_b has shape \(6, 12\) .*twice: query_gate"):
        mha.LatentAttention.from_spec(attention.spec, {**weights, "W_q_b": np.ones((6, 12))})
    with pytest.raises(AttentionValueError, match="weights W_g are missing"):
        mha.LatentAttention.from_spec(attention.spec, {**weights, "W_g": None})


def test_a_window_is_the_banded_mask_and_survives_the_cache_and_save(tmp_path):
    """dots3's sliding layers: the window hides the keys ``window`` or more behind, as a
    banded mask does; decoding keeps every token and reads the window; the window and the
    rotary key's norm are saved."""
    attention = mha.LatentAttention(
        16, 2, **LATENT, q_lora_rank=6, window=3, rope_key_norm=True, output_gate="sigmoid",
        seed=0,
    )  # fmt: skip
    attention.k_pe_norm[...] = [0.6, 1.3]
    x = np.random.default_rng(1).standard_normal((2, 9, 16))
    whole = attention(x, mask=True)
    i = np.arange(9)
    band = (i[:, None] >= i) & (i[:, None] - i < 3)
    unwindowed = dataclasses.replace(attention.spec, window=None)
    banded = mha.LatentAttention.from_spec(unwindowed, attention.weights())
    assert relative_error(banded(x, mask=band), whole) <= 1e-15
    assert relative_error(banded(x, mask=True), whole) > 1e-3
    cache = attention.new_cache(2)
    steps = [attention(x[:, :4], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    attention.save(tmp_path / "dots3.npz")
    loaded = mha.LatentAttention.load(tmp_path / "dots3.npz")
    assert (loaded.window, loaded.rope_key_norm) == (3, True)
    assert np.array_equal(loaded(x, mask=True), whole)
    unnormalised = dataclasses.replace(attention.spec, rope_key_norm=False)
    weights = {**attention.weights(), "k_pe_norm": None}
    plain = mha.LatentAttention.from_spec(unnormalised, weights)
    assert relative_error(plain(x, mask=True), whole) > 1e-3


def test_a_window_beside_an_indexer_takes_the_top_k_within_the_window():
    """The indexer's top-k among the keys the window shows, as transformers' indexer takes
    its layer's (sliding) mask: the banded mask given instead is the same layer; cached
    decoding, the same outputs."""
    indexer = mha.api.sparse.IndexerSpec(3, 2, 4)
    attention = mha.LatentAttention(
        16, 2, **LATENT, q_lora_rank=6, indexer=indexer, window=5, seed=2
    )
    x = np.random.default_rng(5).standard_normal((2, 12, 16))
    whole = attention(x, mask=True)
    i = np.arange(12)
    band = (i[:, None] >= i) & (i[:, None] - i < 5)
    unwindowed = dataclasses.replace(attention.spec, window=None)
    banded = mha.LatentAttention.from_spec(unwindowed, attention.weights())
    assert relative_error(banded(x, mask=band), whole) <= 1e-15
    # without the window, other keys
    assert relative_error(banded(x, mask=True), whole) > 1e-3
    cache = attention.new_cache(2)
    steps = [attention(x[:, :4], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(4, 12)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13


def test_a_window_and_the_rotary_keys_norm_are_refused_by_name_where_wrong():
    with pytest.raises(AttentionValueError, match="window"):
        mha.LatentAttention(16, 2, **LATENT, window=0)
    attention = mha.LatentAttention(16, 2, **LATENT, rope_key_norm=True, seed=0)
    weights = attention.weights()
    with pytest.raises(mha.ShapeError, match=r"k_pe_norm has shape \(3,\) .*rope_key_norm"):
        mha.LatentAttention.from_spec(attention.spec, {**weights, "k_pe_norm": np.ones(3)})
    with pytest.raises(AttentionValueError, match="weights k_pe_norm are missing"):
        mha.LatentAttention.from_spec(attention.spec, {**weights, "k_pe_norm": None})


def test_dots3_without_per_layer_config_reads_the_swa_keys(tmp_path, transformers):
    """A config.json as the released checkpoints write it (the sliding layers' sizes and
    base in ``swa_*`` keys, no ``layer_types``, ``per_layer_config`` or nested
    ``rope_parameters``) gives the layers the config class builds from it."""
    import shutil

    folder = tmp_path / "dots3"
    shutil.copytree(models.saved("dots3_note_text"), folder)
    config = json.loads((folder / "config.json").read_text())
    sliding = config.pop("per_layer_config")["2"]
    for key in ("layer_types", "rope_parameters"):
        config.pop(key)
    config |= {f"swa_{key}": value for key, value in sliding.items()}
    config |= {"swa_qk_nope_head_dim": 8, "rope_theta": 500.0, "swa_rope_theta": 100.0}
    (folder / "config.json").write_text(json.dumps(config))
    x = np.random.default_rng(4).standard_normal((2, 9, 48))
    for layer in range(3):
        expected = mha.from_pretrained(models.saved("dots3_note_text"), layer=layer)
        assert np.array_equal(mha.from_pretrained(folder, layer=layer)(x, mask=True),
                              expected(x, mask=True))  # fmt: skip
    config["layer_types"] = ["indexed_attention", "chunked_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttentionValueError, match=r"layer_types=.*layer 1's type"):
        mha.from_pretrained(folder, layer=1)
