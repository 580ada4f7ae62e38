"""Position-dependent query temperatures of today's models, read from their checkpoints:
Llama 4's ``attn_temperature_tuning`` (``llama4_text``: chunked rope layers with an L2
QK-norm after the rotation, layers without rope whose queries take the temperature),
Ministral 3's ``llama_4_scaling_beta`` and Beam's scalable softmax, the keyword
``query_temperature=(beta, floor, offset, law)`` with its ``"power"`` law.

The oracles are transformers' own: each law against the models' own functions (Ministral 3's
``get_llama_4_attn_scale``, Beam's ``compute_attention_scaling``, Llama 4's formula as its
attention writes it) at their positions and offsets; the power law against torch (forward
and autograd), through a KV cache and a paged cache step by step; the layers read from the
tiny checkpoints against transformers' attention modules in float64 (test_pretrained.py
compares every layer, whole sequences and decoding; here their gradients against autograd
through transformers' own layers); and the float64 oracle itself against transformers'
float32 computation, at float32 precision.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha._kernel.scores import QueryTemperature

BEAM = (0.1, 2048.0, 1.0, "power")
STEEP = (0.5, 3.0, 1.0, "power")  # a power law that grows fast within a few positions
POSITIONS = np.arange(40)


def test_each_law_is_the_models_own_function(torch, transformers):
    """The factors at positions 0..39 against Beam's ``compute_attention_scaling`` and
    Ministral 3's ``get_llama_4_attn_scale`` (run in float64) and Llama 4's formula as its
    attention computes it, past each threshold (floor 4 and 6)."""
    from support.rope_oracle import float64_torch
    from transformers.models.beam import modeling_beam
    from transformers.models.ministral3 import modeling_ministral3

    positions = torch.arange(40)[None]
    with float64_torch():
        beam = modeling_beam.compute_attention_scaling(positions).flatten().numpy()
        ministral = modeling_ministral3.get_llama_4_attn_scale(positions, 0.5, 6)
        llama4 = torch.log1p(torch.floor((positions.float() + 1.0) / 4)) * 0.1 + 1.0
    cases = [(BEAM, beam), ((0.5, 6.0, 0.0), ministral.flatten().numpy()),
             ((0.1, 4.0, 1.0), llama4.flatten().numpy())]  # fmt: skip
    for given, expected in cases:
        assert expected.dtype == np.float64
        got = mha.api.variants.check_query_temperature(given).factors(POSITIONS)
        np.testing.assert_allclose(got, expected, rtol=1e-15, atol=0)
        assert len(set(np.round(expected, 12))) > 5  # past the threshold: many values
    single = modeling_beam.compute_attention_scaling(positions).flatten().numpy()
    assert single.dtype == np.float32  # transformers' own, in float32: the same to 1e-7
    np.testing.assert_allclose(single, beam, rtol=1e-6, atol=0)


def heads(seed, B=2, H=4, H_kv=2, L=9, S=21, d=8):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, H, L, d)), *rng.standard_normal((2, B, H_kv, S, d))


def power_factors(positions, beta, floor, offset, law):
    """The definition: ``(1 + (p + offset) / floor) ** beta``."""
    return (1.0 + (positions + offset) / floor) ** beta


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_power_law_and_its_gradients_match_torch(torch, causal, record_error):
    q, k, v = heads(0)
    out, backward = mha.scaled_dot_product_attention(
        q, k, v, causal=causal, query_temperature=STEEP, return_backward=True
    )
    L, S = q.shape[-2], k.shape[-2]
    t = torch.from_numpy(power_factors(np.arange(S - L, S), *STEEP))[:, None]
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L) if causal else None
    expected = torch.nn.functional.scaled_dot_product_attention(
        tq * t, tk.repeat_interleave(2, dim=-3), tv.repeat_interleave(2, dim=-3), attn_mask=mask
    )
    assert (
        record_error("power temperature vs torch", relative_error(out, expected.detach().numpy()))
        <= 1e-13
    )
    grad = np.random.default_rng(1).standard_normal(out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    for name, tensor in zip("qkv", (tq, tk, tv), strict=True):
        error = relative_error(ours[name], tensor.grad.numpy())
        assert record_error("power temperature gradients vs autograd", error) <= 1e-10, name
    assert not np.allclose(out, mha.scaled_dot_product_attention(q, k, v, causal=causal))


@pytest.mark.parametrize("kind", ["KVCache", "PagedKVCache"])
def test_a_cache_places_each_step_at_its_position(kind, record_error):
    """Prefill then decoding steps through a KVCache or a PagedKVCache equal the whole
    sequence: each step's query at the cache's length."""
    q, k, v = heads(4, L=21)
    whole = mha.scaled_dot_product_attention(q, k, v, causal=True, query_temperature=STEEP)
    if kind == "KVCache":
        cache = mha.KVCache(2, 2, 8)
    else:
        cache = mha.PagedKVCache(16, 4, 2, 8, dtype=np.float64)
        cache.add(0)
        cache.add(1)
    parts = [mha.scaled_dot_product_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6],
                                              cache=cache, query_temperature=STEEP)]  # fmt: skip
    for i in range(6, 21):
        step = slice(i, i + 1)
        parts.append(mha.scaled_dot_product_attention(
            q[:, :, step], k[:, :, step], v[:, :, step], cache=cache, query_temperature=STEEP,
        ))  # fmt: skip
    error = relative_error(np.concatenate(parts, axis=-2), whole)
    assert record_error(f"power temperature, {kind} steps vs whole", error) <= 1e-13


def test_the_layer_keeps_the_law_in_its_spec_files_and_repr(tmp_path):
    attention = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=7, query_temperature=BEAM)
    assert attention.spec.query_temperature == BEAM
    assert "query_temperature=(0.1, 2048.0, 1.0, 'power')" in repr(attention)
    attention.save(tmp_path / "layer.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "layer.npz")
    assert loaded.query_temperature == BEAM
    X = np.random.default_rng(8).standard_normal((1, 6, 16))
    np.testing.assert_array_equal(loaded(X, mask=True), attention(X, mask=True))
    log = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=7, query_temperature=(0.1, 4.0))
    assert log.query_temperature == (0.1, 4.0, 0.0)  # the log law, as before: three numbers


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ((0.1, 4.0, 1.0, "cubic"), mha.AttentionValueError, "law must be 'log' or 'power'"),
        ((0.1, 4.0, 1.0, 2), mha.AttentionTypeError, "offset, law"),
        ((0.1, 4.0, -4.0, "power"), mha.AttentionValueError, "power law needs offset > -floor"),
        ((0.1, 4.0, 1.0, "power", 0), mha.AttentionTypeError, "query_temperature must be"),
    ],
)
def test_a_wrong_law_is_refused_by_name(value, error, match):
    with pytest.raises(error, match=match):
        mha.scaled_dot_product_attention(*heads(9), query_temperature=value)
    with pytest.raises(error, match=match):
        mha.MultiHeadAttention(16, 4, query_temperature=value)


def test_the_kernels_temperature_is_the_keyword_it_came_from():
    assert QueryTemperature(0.1, 4.0, 1.0).keyword() == (0.1, 4.0, 1.0)
    assert QueryTemperature(*BEAM).keyword() == BEAM


# ------------------------------------------------------------- the families read


FAMILIES = ("llama4_text", "ministral3_scaled", "beam")


@pytest.mark.parametrize(
    ("family", "layer", "temperature", "chunk", "norm"),
    [
        ("llama4_text", 0, None, 8, "head"),  # rope, chunked, L2 QK-norm after the rotation
        ("llama4_text", 1, (0.5, 4.0, 1.0), None, None),  # no rope: the temperature
        ("ministral3_scaled", 2, (0.5, 6.0, 0.0), None, None),
        ("beam", 0, None, None, "head"),  # sliding, rope
        ("beam", 1, BEAM, None, "head"),  # full, no rope: the power law
    ],
)
def test_the_layers_read_their_temperature(family, layer, temperature, chunk, norm, transformers):
    spec = mha.from_pretrained(models.saved(family), layer=layer).spec
    assert spec.query_temperature == temperature
    assert spec.chunk == chunk and spec.qk_norm == norm
    assert (spec.rope_theta is None) == (family != "ministral3_scaled" and layer == 1)
    if family == "llama4_text":
        assert spec.rotary_interleaved == (layer != 1) and spec.qk_norm_after_rope == (layer != 1)


def variant(tmp_path, family, change):
    folder = shutil.copytree(models.saved(family), tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return folder


def test_llama4_without_temperature_tuning_reads_no_temperature(tmp_path, transformers):
    folder = variant(tmp_path, "llama4_text", {"attn_temperature_tuning": False,
                                               "use_qk_norm": False})  # fmt: skip
    assert mha.from_pretrained(folder, layer=1).spec.query_temperature is None
    assert mha.from_pretrained(folder, layer=0).spec.qk_norm is None


@pytest.mark.parametrize(
    ("family", "change", "said"),
    [
        ("llama4_text", {"attn_scale": "0.1"}, "llama4_text with attn_scale='0.1' (a query "
         "temperature that is not a number)"),
        ("llama4_text", {"floor_scale": 0}, "floor_scale=0"),
        ("llama4_text", {"no_rope_layers": [1, 0]}, "no_rope_layers must list 1 (rope) or 0"),
        ("ministral3_scaled", {"rope_parameters": {
            "rope_type": "default", "rope_theta": 500.0, "llama_4_scaling_beta": 0.5}},
         "ministral3 with rope_parameters['llama_4_scaling_beta']=0.5 and original_max_"
         "position_embeddings=None (Llama 4's query scale growing with the position"),
        ("beam", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
         "beam with no rope_parameters entry for its full_attention layers"),
    ],
)  # fmt: skip
def test_configs_mha_cannot_read_are_refused_by_name(tmp_path, family, change, said, transformers):
    folder = variant(tmp_path, family, change)
    with pytest.raises(mha.AttentionValueError) as error:
        mha.from_pretrained(folder, layer=1)
    assert str(folder) in str(error.value) and said in str(error.value), str(error.value)


def captured(family):
    """The float64 transformers model of ``family`` (its float64 rotary) and, per layer, the
    keywords its ``self_attn`` got in a forward of 2 sequences of 24 tokens."""
    return models.captured(family, 2, 24)


def mha_name(name):
    """mha's name of a transformers attention parameter, and whether it is transposed."""
    if name.endswith("_proj.weight"):
        return f"W_{name[0]}", True
    if name.endswith("_proj.bias"):
        return f"b_{name[0]}", False
    if name == "gate_bias":  # Beam's: one a head, b_g over the head's features
        return "b_g", False
    return name.removesuffix(".weight"), False


@pytest.mark.parametrize(
    ("family", "layer"),
    [("llama4_text", 0), ("llama4_text", 1), ("ministral3_scaled", 0), ("beam", 0), ("beam", 1)],
)
def test_gradients_match_autograd_through_transformers_layers(
    family, layer, torch, transformers, record_error
):
    from support.rope_oracle import float64_torch

    model, calls = captured(family)
    module = model.model.layers[layer].self_attn
    g = np.random.default_rng(layer)
    x = 0.7 * g.standard_normal((2, 24, 48))
    grad_out = g.standard_normal((2, 24, 48))
    module.zero_grad(set_to_none=True)
    tx = torch.tensor(x, requires_grad=True)
    with float64_torch():
        expected = module(**{**calls[layer], "cache": None, "hidden_states": tx})[0]
        (expected * torch.tensor(grad_out)).sum().backward()
    attention = mha.from_pretrained(models.saved(family), layer=layer, dtype=np.float64)
    out, backward = attention(x, mask=True, return_backward=True)
    error = relative_error(out, expected.detach().numpy())
    assert record_error(f"temperature {family} gradients forward", error) <= 1e-12
    grads = backward(grad_out)
    label = f"temperature {family} gradients vs autograd, float64"
    for name, parameter in module.named_parameters():
        ours, transposed = mha_name(name)
        theirs = parameter.grad.numpy()
        theirs = theirs.T if transposed else theirs
        mine = grads[ours]
        if name == "gate_bias":
            mine = mine.reshape(-1, attention.head_dim).sum(-1)
        assert np.abs(theirs).max() > 1e-3, name
        assert record_error(label, relative_error(mine, theirs)) <= 1e-10, (name, layer)
    shared = grads["query"] + grads["key"] + grads["value"]
    assert record_error(label, relative_error(shared, tx.grad.numpy())) <= 1e-10


def test_the_float64_oracle_is_transformers_own_computation(torch, transformers):
    """transformers' Llama 4 layers as transformers computes them (its complex rotation, its
    L2 norm and its temperature in float32) agree with the float64 oracle (its rotation in
    complex128, the rest under float64_torch) to float32 precision, and differ from it
    beyond 1e-12 on every layer: the patch is needed and faithful."""
    from support.rope_oracle import float64_rotary, float64_torch
    from support.transformers_oracle import AttentionRecorder

    model = models.transformers_model("llama4_text")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))

    def outputs():
        recorder = AttentionRecorder(model)
        try:
            with torch.no_grad():
                model(ids)
        finally:
            recorder.close()
        return [calls[0][1] for calls in recorder.calls]

    as_is = outputs()
    (rotary,) = float64_rotary(model)  # checked against the float32 rotation, at 1e-6
    assert rotary.forward(torch.zeros(1), torch.arange(3)[None]).dtype == torch.complex128
    with float64_torch():
        oracle = outputs()
    for layer, (theirs, ours) in enumerate(zip(as_is, oracle, strict=True)):
        assert 1e-12 < relative_error(theirs, ours) <= 1e-5, layer


LATENT_NAMES = {
    "q_a_proj.weight": ("W_q_a", True),
    "q_a_layernorm.weight": ("q_a_norm", False),
    "q_b_proj.weight": ("W_q_b", True),
    "kv_a_proj_with_mqa.weight": ("W_kv_a", True),
    "kv_a_layernorm.weight": ("kv_a_norm", False),
    "kv_b_proj.weight": ("W_kv_b", True),
    "o_proj.weight": ("W_o", True),
}
"""mha's names of transformers' latent attention parameters, and whether transposed."""


@pytest.mark.parametrize("layer", [0, 1])
def test_mistral4_gradients_match_autograd_through_transformers_layers(
    layer, torch, transformers, record_error
):
    """Mistral 4's latent attention with its query temperature (24 positions, past
    ``original_max_position_embeddings`` 6): every weight's gradient and the input's."""
    from support.rope_oracle import float64_torch

    model, calls = captured("mistral4")
    module = model.model.layers[layer].self_attn
    g = np.random.default_rng(layer)
    x = 0.7 * g.standard_normal((2, 24, 48))
    grad_out = g.standard_normal((2, 24, 48))
    module.zero_grad(set_to_none=True)
    tx = torch.tensor(x, requires_grad=True)
    with float64_torch():
        expected = module(**{**calls[layer], "cache": None, "hidden_states": tx})[0]
        (expected * torch.tensor(grad_out)).sum().backward()
    attention = mha.from_pretrained(models.saved("mistral4"), layer=layer, dtype=np.float64)
    assert attention.query_temperature == (0.5, 6.0, 0.0)
    out, backward = attention(x, mask=True, return_backward=True)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("temperature mistral4 gradients forward", error) <= 1e-12
    grads = backward(grad_out)
    label = "temperature mistral4 gradients vs autograd, float64"
    for name, parameter in module.named_parameters():
        ours, transposed = LATENT_NAMES[name]
        theirs = parameter.grad.numpy()
        theirs = theirs.T if transposed else theirs
        assert np.abs(theirs).max() > 1e-3, name
        assert record_error(label, relative_error(grads[ours], theirs)) <= 1e-10, (name, layer)
    assert record_error(label, relative_error(grads["query"], tx.grad.numpy())) <= 1e-10


def test_a_latent_layer_keeps_its_temperature_in_its_spec_file_and_cache(tmp_path):
    """LatentAttention's query_temperature: saved and loaded, shown, the same whole and
    decoded token by token, and refused with positions it would not scale by."""
    sizes = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4}
    attention = mha.LatentAttention(16, 2, query_temperature=(0.5, 3.0), seed=0, **sizes)
    plain = mha.LatentAttention(16, 2, seed=0, **sizes)
    x = np.random.default_rng(0).standard_normal((2, 9, 16))
    whole = attention(x, mask=True)
    assert relative_error(whole[:, :3], plain(x, mask=True)[:, :3]) <= 1e-15  # p < 3: 1
    assert relative_error(whole[:, 3:], plain(x, mask=True)[:, 3:]) > 1e-3
    cache = attention.new_cache(2)
    steps = [attention(x[:, :4], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-14
    path = tmp_path / "latent.npz"
    attention.save(path)
    assert mha.LatentAttention.load(path).query_temperature == (0.5, 3.0, 0.0)
    assert "query_temperature=(0.5, 3.0, 0.0)" in repr(attention)
    with pytest.raises(mha.AttentionValueError, match=r"positions= other than 0\.\.8"):
        attention(x, mask=True, positions=np.arange(9) + 1)
    with pytest.raises(mha.AttentionTypeError, match="query_temperature must be"):
        mha.LatentAttention(16, 2, query_temperature=0.5, **sizes)
