"""``LatentAttention.from_pretrained`` on DeepSeek-V2 checkpoints (``model_type``
"deepseek_v2") against the layers of transformers' own DeepseekV2ForCausalLM, loaded in
float64 from the same tiny bfloat16 sharded checkpoints (support.pretrained_models): yarn
rope with ``mscale``/``mscale_all_dim``, with q's low-rank projection (``q_lora_rank=20``) and
without it (``q_lora_rank=None``, with biases, as DeepSeek-V2-Lite's ``q_proj``).

Each layer's attention is compared on whole sequences of 24 positions (past the rope's
``original_max_position_embeddings`` of 16), and in prefill then token-by-token decoding with
transformers' DynamicCache, every step against ``attention(x, cache=ours)``.

transformers' DeepSeek-V2 rotates its (2i, 2i + 1) pairs as complex numbers: its rotary
module returns ``freqs_cis = polar(1, position * inv_freq) * attention_scaling`` in float32,
and ``apply_rotary_emb`` multiplies ``view_as_complex(q_pe.float())`` by it. Both would hide
every error below 1e-7, and support.rope_oracle.float64_rotary covers only the cos/sin
modules, so here the rotary module gets inverse frequencies from transformers' own yarn
function run in float64 (support.rope_oracle.float64_torch), checked against its float32
ones, and a forward returning the same ``polar`` in complex128; the whole forward runs under
float64_torch, where ``.float()`` (the rotation, the RMSNorms) gives float64. Everything else
is transformers' code as it is.
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
from unittest import mock

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error
from support.rope_oracle import FAITHFUL, float64_torch, init_function

import mha
from mha.integrations import readers

B, L, PREFILL = 2, 24, 10
TOLERANCE = 1e-12
WITHOUT_Q_LATENT = "deepseek_v2_q_proj"
"""DeepSeek V2 without q's latent (``q_lora_rank=None``) and with biases: a family of
support.pretrained_models registered only while it is built and loaded here."""
VARIANTS = ["deepseek_v2", WITHOUT_Q_LATENT]


def _registered():
    name, changes = models.MODELS["deepseek_v2"]
    extra = {"q_lora_rank": None, "attention_bias": True}
    return mock.patch.dict(models.MODELS, {WITHOUT_Q_LATENT: (name, {**changes, **extra})})


@functools.cache
def checkpoint(variant):
    """The variant's saved folder and transformers' float64 model of it, with its float64
    complex rotary."""
    with _registered():
        folder = models.saved(variant)
        model = models.transformers_model(variant)
    assert model.config.model_type == "deepseek_v2"
    float64_complex_rotary(model)
    return folder, model


def float64_complex_rotary(model):
    """DeepseekV2RotaryEmbedding in complex128: its yarn frequencies and attention scaling
    by transformers' own function under float64_torch, each within FAITHFUL of the float32
    ones; the angles and ``polar`` as its forward computes them."""
    import torch

    rotary = model.model.rotary_emb
    source = inspect.getsource(type(rotary).forward)
    assert "torch.polar(torch.ones_like(freqs), freqs)" in source, "another rotary layout"
    assert "freqs_cis * self.attention_scaling" in source
    assert rotary.rope_type in ("default", "yarn"), rotary.rope_type  # no dynamic update
    with float64_torch():
        inv_freq, scaling = init_function(rotary, rotary.rope_type)(rotary.config)
    single = rotary.original_inv_freq.double()
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == single.shape
    assert ((inv_freq - single).abs() / single.abs()).max() <= FAITHFUL
    assert abs(scaling - rotary.attention_scaling) <= FAITHFUL * abs(scaling)
    positions = torch.arange(L)[None]
    before = rotary(torch.zeros(1, dtype=torch.float64), positions)

    def forward(x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq
        return torch.polar(torch.ones_like(freqs), freqs) * scaling

    rotary.forward = forward
    after = rotary(torch.zeros(1, dtype=torch.float64), positions)
    assert before.dtype == torch.complex64 and after.dtype == torch.complex128
    assert (after - before).abs().max() <= 10 * FAITHFUL * scaling  # angles up to 23 rad


@functools.cache
def oracle(variant):
    """Each layer's attention calls in transformers, ``(input, output)`` as NumPy: first the
    whole sequence, then the prefill and each decoding step."""
    _, model = checkpoint(variant)
    return models.decoding_calls(model, B, L, PREFILL)


def load(variant, layer, folder=None):
    folder = folder or checkpoint(variant)[0]
    return mha.LatentAttention.from_pretrained(folder, layer=layer, dtype=np.float64)


@pytest.mark.parametrize("variant", VARIANTS)
def test_settings_and_scale_are_transformers(variant, transformers):
    _, model = checkpoint(variant)
    config = model.config
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["mscale_all_dim"] == 0.8
    for index, layer in enumerate(model.model.layers):
        attention = load(variant, index)
        own = layer.self_attn
        assert attention.scale == own.scaling != own.qk_head_dim**-0.5
        assert attention.rotary_interleaved is True
        assert attention.q_lora_rank == config.q_lora_rank == own.q_lora_rank
        assert (attention.kv_lora_rank, attention.qk_nope_head_dim, attention.qk_rope_head_dim,
                attention.v_head_dim) == (own.kv_lora_rank, own.qk_nope_head_dim,
                                          own.qk_rope_head_dim, own.v_head_dim)  # fmt: skip
        assert attention.norm_eps == own.kv_a_layernorm.variance_epsilon
        if own.q_a_layernorm is not None:
            assert attention.norm_eps == own.q_a_layernorm.variance_epsilon
        assert ("b_kv_a" in attention.parameters()) == (variant == WITHOUT_Q_LATENT)


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_sequences_match_transformers(variant, transformers, record_error):
    for layer, calls in oracle(variant).items():
        x, expected = calls[0]
        assert x.shape == (B, L, 48) and np.abs(expected).max() > 0.1
        error = relative_error(load(variant, layer)(x, mask=True), expected)
        assert record_error("pretrained deepseek_v2, float64", error) <= TOLERANCE, layer


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_decoding_matches_transformers_cache(variant, transformers, record_error):
    for layer, calls in oracle(variant).items():
        attention = load(variant, layer)
        ours = attention.new_cache(B)
        assert len(calls) == 2 + L - PREFILL
        for x, expected in calls[1:]:
            error = relative_error(attention(x, cache=ours), expected)
            assert record_error("pretrained deepseek_v2 cached decoding, float64", error) <= (
                TOLERANCE
            ), layer
        assert ours.lengths.tolist() == [L] * B


CHANGES = {
    "deepseek_v2": [{"rotary_interleaved": False}, {"scale": None}, {"rope_scaling": None}],
    WITHOUT_Q_LATENT: [{"rotary_interleaved": False}, {"b_kv_a": None}, {"b_o": None}],
}
"""Settings changed (or weights, given as None, removed) that the comparison must catch: the
complex pairs are not rotate_half's halves, the yarn mscale matters, and so on."""


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_setting_read_matters_in_these_models(variant, monkeypatch, transformers):
    read = readers.layer_attention
    whole = [calls[0] for calls in oracle(variant).values()]
    for change in CHANGES[variant]:
        monkeypatch.setattr(readers, "layer_attention", models.changed(read, change))
        errors = [relative_error(load(variant, layer)(x, mask=True), expected)
                  for layer, (x, expected) in enumerate(whole)]  # fmt: skip
        assert max(errors) > 1e-4, (change, errors)


def test_rope_interleave_in_a_v2_config_is_ignored_as_transformers_does(tmp_path, transformers):
    """DeepseekV2Attention has no rope_interleave: a config.json naming it changes nothing."""
    folder = shutil.copytree(checkpoint("deepseek_v2")[0], tmp_path / "deepseek_v2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    x, expected = oracle("deepseek_v2")[0][0]
    attention = load("deepseek_v2", 0, folder)
    assert attention.rotary_interleaved is True
    assert relative_error(attention(x, mask=True), expected) <= TOLERANCE
