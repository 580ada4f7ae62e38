"""Rope scaling (mha.api.rope_scaling and apply_rotary's scaling=) against transformers 5.24:
its ROPE_INIT_FUNCTIONS in float32 and run in float64, then its rotary modules and
apply_rotary_pos_emb in float64 (tests/support/rope_oracle.py), including the stateful
dynamic update; the adjoint used by the backward pass; every refusal."""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest
from support.configs import relative_error
from support.rope_oracle import float64_rotary, float64_torch

import mha
from mha.api.rope_scaling import ROPE_TYPES, RopeScaling, check_rope_scaling

r = np.random.default_rng(31)
PHI3_SHORT = [float(f) for f in 1 + 0.2 * r.random(48)]
PHI3_LONG = [float(f) for f in np.sort(1 + 60 * r.random(48))]

# (name, rope parameters as a config gives them, head_dim, max_position_embeddings)
CASES = [
    ("default", {"rope_type": "default", "rope_theta": 10000.0}, 64, 4096),
    ("linear, Gemma 3", {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}, 128, 131072),
    ("linear, partial", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                         "partial_rotary_factor": 0.5}, 64, 4096),
    ("dynamic", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 64, 2048),
    ("dynamic, Qwen", {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}, 128, 4096),
    ("llama3, Llama 3.1", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, 128, 131072),
    ("llama3, Llama 3.2", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, 64, 131072),
    ("llama3, other", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                       "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                       "original_max_position_embeddings": 256}, 32, 1024),
    ("yarn, DeepSeek-V3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                           "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                           "original_max_position_embeddings": 4096}, 64, 163840),
    ("yarn, gpt-oss", {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                       "original_max_position_embeddings": 4096}, 64, 131072),
    ("yarn, Qwen3", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                     "original_max_position_embeddings": 32768}, 128, 131072),
    ("yarn, derived factor", {"rope_type": "yarn", "rope_theta": 1e4, "factor": None,
                              "original_max_position_embeddings": 4096}, 64, 16384),
    ("yarn, mscales", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "mscale": 0.9,
                       "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0,
                       "original_max_position_embeddings": 2048}, 32, 32768),
    ("yarn, attention_factor", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                                "attention_factor": 1.25, "partial_rotary_factor": 0.5,
                                "original_max_position_embeddings": 1024}, 64, 8192),
    ("yarn, mscale alone", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0,
                            "mscale": 0.707, "original_max_position_embeddings": 2048}, 32, 32768),
    ("yarn, empty ramp", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "beta_fast": 32.0, "beta_slow": 4.0,
                          "original_max_position_embeddings": 16}, 16, 64),
    ("longrope, Phi-3", {"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                         "original_max_position_embeddings": 4096}, 96, 131072),
    ("longrope, Phi-4-mini", {"rope_type": "longrope", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.75, "short_factor": PHI3_SHORT,
                              "long_factor": PHI3_LONG,
                              "original_max_position_embeddings": 4096}, 128, 131072),
    ("longrope, factors", {"rope_type": "longrope", "rope_theta": 1e4, "factor": 8.0,
                           "attention_factor": 1.2, "short_factor": PHI3_SHORT[:16],
                           "long_factor": PHI3_LONG[:16],
                           "original_max_position_embeddings": 512}, 32, 4096),
    ("proportional", {"rope_type": "proportional", "rope_theta": 1e6,
                      "partial_rotary_factor": 0.25}, 256, 131072),
    ("proportional, factor", {"rope_type": "proportional", "rope_theta": 1e4, "factor": 8.0,
                              "partial_rotary_factor": 0.5}, 64, 4096),
]  # fmt: skip


ROPE = {name: rope for name, rope, *_ in CASES}


def mha_scaling(rope, max_position_embeddings):
    """mha's dict: transformers' rope parameters as written, with the model's length."""
    return {**rope, "max_position_embeddings": max_position_embeddings}


def rotated_width(rope, head_dim):
    if rope["rope_type"] == "proportional":  # the rotation spans the head; some pairs stay
        return head_dim
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


def config_of(transformers, rope, head_dim, max_position_embeddings):
    return transformers.LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rope_parameters=dict(rope),
    )  # fmt: skip


def elementwise_error(ours, reference):
    """``max |ours - reference| / |reference|`` element by element (an exact 0 must be 0)."""
    reference = np.asarray(reference, dtype=np.float64)
    difference = np.abs(np.asarray(ours, dtype=np.float64) - reference)
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    zero = reference == 0
    if np.any(difference[zero] > 0):
        return float("inf")
    return float(np.max(difference[~zero] / np.abs(reference[~zero]), initial=0.0))


@contextlib.contextmanager
def quiet_transformers():
    """transformers' advice on the configs (longrope's factor, yarn's implicit factor)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


# ------------------------------------------------- the frequencies, type by type


@pytest.mark.parametrize(("name", "rope", "head_dim", "trained"), CASES, ids=[c[0] for c in CASES])
def test_frequencies_match_transformers_init_functions(
    name, rope, head_dim, trained, torch, transformers, record_error
):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = rope["rope_type"]
    with quiet_transformers():
        config = config_of(transformers, rope, head_dim, trained)
    if kind == "default":  # no ROPE_INIT_FUNCTIONS entry: the models' own, without seq_len
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        def init(config, device, seq_len):
            return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        init = ROPE_INIT_FUNCTIONS[kind]
    scaling = check_rope_scaling(mha_scaling(rope, trained), rotated_width(rope, head_dim))
    original = rope.get("original_max_position_embeddings", trained)
    lengths = [1, original // 2, original, original + 1, 3 * original]
    with quiet_transformers():
        for seq_len in lengths:
            for given in (seq_len, torch.tensor(seq_len)):  # the dynamic update passes a tensor
                ours, attention = scaling.frequencies(rope["rope_theta"], seq_len)
                single, single_attention = init(config, "cpu", given)
                with float64_torch():
                    double, double_attention = init(config, "cpu", given)
                assert single.dtype == torch.float32 and double.dtype == torch.float64
                error = elementwise_error(ours, single.numpy())
                assert record_error(f"rope frequencies {kind} vs float32", error) <= 1e-6, name
                error = elementwise_error(ours, double.numpy())
                assert record_error(f"rope frequencies {kind} vs float64", error) <= 1e-13, name
                assert attention == pytest.approx(float(single_attention), rel=1e-15, abs=0)
                assert attention == pytest.approx(float(double_attention), rel=1e-15, abs=0)


def test_the_types_scale_as_their_papers_say():
    """What each type changes, at the sizes of real models (a test of our reading of the
    formulas, independent of transformers)."""
    plain = mha.api.rope_scaling.default_frequencies(500000.0, 128)
    llama = check_rope_scaling(dict(ROPE["llama3, Llama 3.1"]), 128)
    frequencies, attention = llama.frequencies(500000.0, 10)
    wavelengths = 2 * np.pi / plain
    np.testing.assert_array_equal(frequencies[wavelengths < 8192 / 4], plain[wavelengths < 2048])
    np.testing.assert_allclose(frequencies[wavelengths > 8192], plain[wavelengths > 8192] / 8)
    assert attention == 1.0
    deepseek = check_rope_scaling(dict(ROPE["yarn, DeepSeek-V3"]), 64)
    assert deepseek.attention_factor == 1.0  # mscale = mscale_all_dim: they cancel
    gpt_oss = check_rope_scaling(dict(ROPE["yarn, gpt-oss"]), 64)
    assert gpt_oss.attention_factor == pytest.approx(0.1 * np.log(32) + 1)
    frequencies, _ = gpt_oss.frequencies(150000.0, 1)
    plain = mha.api.rope_scaling.default_frequencies(150000.0, 64)
    assert frequencies[0] == plain[0] and frequencies[-1] == pytest.approx(plain[-1] / 32)
    phi3 = check_rope_scaling(mha_scaling(ROPE["longrope, Phi-3"], 131072), 96)
    assert phi3.attention_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))
    short, _ = phi3.frequencies(1e4, 4096)
    long, _ = phi3.frequencies(1e4, 4097)
    plain = mha.api.rope_scaling.default_frequencies(1e4, 96)
    np.testing.assert_allclose(short, plain / PHI3_SHORT, rtol=1e-15)
    np.testing.assert_allclose(long, plain / PHI3_LONG, rtol=1e-15)


# ------------------------------------------------- whole rotary modules, model by model

LONG = 24
"""The tiny models' original_max_position_embeddings (their max_position_embeddings for
dynamic): the positions below go to three times past it."""

COMMON = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1, "vocab_size": 40,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
          "max_position_embeddings": 4 * LONG, "pad_token_id": None, "bos_token_id": None,
          "eos_token_id": None}  # fmt: skip
DROP = object()  # a COMMON setting the family does not take (OLMo 2, Phi-3: no head_dim)
YARN_DEEPSEEK = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                 "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                 "original_max_position_embeddings": LONG}  # fmt: skip
FAMILIES = {
    "Llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": LONG}},
    "Qwen2": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0},
              "max_position_embeddings": LONG},
    "Qwen3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                  "original_max_position_embeddings": LONG}},
    "Mistral": {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},
    "Gemma2": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
               "max_position_embeddings": LONG},
    "Gemma3": {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}},
        "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8},
    "Olmo2": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0,
                                  "short_factor": [1.0, 1.1, 1.3, 1.2, 1.0, 1.5, 1.1, 1.05],
                                  "long_factor": [1.0, 2.0, 3.5, 5.0, 8.0, 13.0, 21.0, 30.0],
                                  "original_max_position_embeddings": LONG},
              "head_dim": DROP},
    "Phi3": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                 "partial_rotary_factor": 0.5,
                                 "short_factor": [1.0, 1.2, 1.1, 1.4],
                                 "long_factor": [1.5, 4.0, 9.0, 20.0]},
             "original_max_position_embeddings": LONG, "head_dim": DROP},
    "GptOss": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": LONG},
               "num_local_experts": 4, "num_experts_per_tok": 2,
               "experts_implementation": "eager", "sliding_window": 8},
    "DeepseekV3": {"rope_parameters": YARN_DEEPSEEK, "num_key_value_heads": 2, "q_lora_rank": 16,
                   "kv_lora_rank": 16,
                   "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 8,
                   "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                   "topk_group": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                   "n_shared_experts": 1, "experts_implementation": "eager", "head_dim": DROP},
}  # fmt: skip
CONFIGS = {"Gemma3": "Gemma3TextConfig"}
MODELS = {"Gemma3": "Gemma3ForCausalLM"}


def tiny_model(transformers, torch, family):
    settings = {**COMMON, **FAMILIES[family]}
    settings = {key: value for key, value in settings.items() if value is not DROP}
    config_class = getattr(transformers, CONFIGS.get(family, f"{family}Config"))
    with quiet_transformers():
        config = config_class(**settings, attn_implementation="eager")
        torch.manual_seed(0)
        model = getattr(transformers, MODELS.get(family, f"{family}ForCausalLM"))(config)
    return model.double().eval()


def calls(torch):
    """The position_ids of one forward call after another: a batch whose rows start apart,
    going past the original length, then decoding, a shorter sequence, a longer one."""
    batch = torch.stack([torch.arange(2 * LONG), torch.arange(2 * LONG) + 5])
    return [
        batch,
        torch.tensor([[2 * LONG + 5], [2 * LONG + 9]]),  # decoding, further
        torch.arange(LONG // 2)[None],  # below the original length: back to the first
        torch.arange(3 * LONG)[None],  # longer than any before
    ]


def scalings(model):
    """mha's dict per layer type (None: the only one) from the model's config."""
    config = model.config
    nested = "full_attention" in config.rope_parameters
    ropes = config.rope_parameters if nested else {None: config.rope_parameters}
    trained = {"max_position_embeddings": config.max_position_embeddings}
    return {layer_type: {**rope, **trained} for layer_type, rope in ropes.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_apply_rotary_matches_transformers_rotary_modules(family, torch, transformers,
                                                          record_error):  # fmt: skip
    model = tiny_model(transformers, torch, family)
    (rotary,) = float64_rotary(model)
    modeling = importlib.import_module(type(model).__module__)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    interleaved = bool(getattr(config, "rope_interleave", False))
    generator = np.random.default_rng(len(family))
    for layer_type, scaling in scalings(model).items():
        share = scaling.get("partial_rotary_factor", 1.0)
        width = int(head_dim * share)
        for position_ids in calls(torch):
            B, L = position_ids.shape
            q, k = (generator.standard_normal((B, 3, L, head_dim)) for _ in range(2))
            like = torch.zeros(1, dtype=torch.float64)  # the dtype of the cosines and sines
            cos, sin = rotary(like, position_ids, *([layer_type] if layer_type else []))
            tq, tk = torch.from_numpy(q), torch.from_numpy(k)
            if interleaved:
                expected = modeling.apply_rotary_pos_emb_interleave(tq, tk, cos, sin)
            else:
                expected = modeling.apply_rotary_pos_emb(tq, tk, cos, sin)
            for x, want in zip((q, k), expected, strict=True):
                ours = mha.apply_rotary(
                    x, position_ids.numpy(), theta=scaling["rope_theta"], rotary_dim=width,
                    interleaved=interleaved, scaling=scaling,
                )  # fmt: skip
                if interleaved:  # DeepSeek writes the rotated pairs de-interleaved
                    ours = ours[..., np.r_[0:width:2, 1:width:2]]
                error = relative_error(ours, want.numpy())
                family_name = f"apply_rotary scaled vs transformers {family}"
                assert record_error(family_name, error) <= 1e-12
    with torch.no_grad():  # the model still runs on the float64 rotary
        logits = model(torch.arange(3 * LONG)[None] % config.vocab_size).logits
    assert logits.dtype == torch.float64 and torch.isfinite(logits).all()


def test_stateless_dynamic_differs_from_transformers_in_one_case(torch, transformers):
    """After a longer sequence, transformers' dynamic module keeps its frequencies for a
    shorter one still past max_position_embeddings; mha uses the shorter one's, or the
    longer one's when given seq_len."""
    model = tiny_model(transformers, torch, "Qwen2")
    (rotary,) = float64_rotary(model)
    (scaling,) = scalings(model).values()
    q = np.random.default_rng(1).standard_normal((1, 2, 2 * LONG, 16))
    like = torch.zeros(1, dtype=torch.float64)
    for seq_len in (3 * LONG, 2 * LONG):  # the second reuses the first's frequencies
        position_ids = torch.arange(2 * LONG)[None] + (seq_len - 2 * LONG)
        cos, sin = rotary(like, position_ids)
    (expected, _) = importlib.import_module(type(model).__module__).apply_rotary_pos_emb(
        torch.from_numpy(q), torch.from_numpy(q), cos, sin
    )
    positions = position_ids.numpy()
    ours = mha.apply_rotary(q, positions, theta=1e6, scaling=scaling)
    assert relative_error(ours, expected.numpy()) > 1e-3
    pinned = mha.apply_rotary(q, positions, theta=1e6, scaling=scaling, seq_len=3 * LONG)
    assert relative_error(pinned, expected.numpy()) <= 1e-12


# ------------------------------------------------- the adjoint of the backward pass

ADJOINT_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 3.0, "max_position_embeddings": 20},
    dict(ROPE["llama3, Llama 3.1"], original_max_position_embeddings=16),
    dict(YARN_DEEPSEEK, mscale_all_dim=0.5, original_max_position_embeddings=16),
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
    {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 5.0, 9.0],
     "factor": 8.0, "original_max_position_embeddings": 16},
    {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5},
]  # fmt: skip


@pytest.mark.parametrize("scaling", ADJOINT_SCALINGS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_inverse_is_the_transpose_of_the_scaled_rotation(scaling, interleaved):
    x, y = r.standard_normal((2, 2, 3, 40, 10))
    positions = r.integers(0, 60, size=(2, 40))
    options = {"theta": 50.0, "rotary_dim": 6, "interleaved": interleaved, "scaling": scaling}
    if scaling is not None and scaling["rope_type"] == "proportional":
        options["rotary_dim"] = 10  # proportional rotates over the head; half its pairs turn
    forward = mha.apply_rotary(x, positions, **options)
    transpose = mha.apply_rotary(y, positions, **options, inverse=True)
    inner = float(np.sum(forward * y))
    assert abs(inner - float(np.sum(x * transpose))) <= 1e-13 * np.sum(np.abs(forward * y))
    seq_len = float(positions.max()) + 1
    width = options["rotary_dim"]
    rope = check_rope_scaling(scaling, width)
    attention = 1.0 if rope is None else rope.frequencies(50.0, seq_len)[1]
    back = mha.apply_rotary(forward, positions, **options, inverse=True)
    expected = x.copy()
    expected[..., :width] *= attention**2
    np.testing.assert_allclose(back, expected, rtol=1e-13, atol=1e-13)
    if scaling is not None and scaling["rope_type"] in ("dynamic", "longrope"):
        assert not np.array_equal(forward, mha.apply_rotary(x, positions, **options, seq_len=8))


def test_without_scaling_the_bits_stay():
    """scaling=None, the default type and the old backward (negated positions) agree bit for
    bit with inverse=True."""
    x = r.standard_normal((2, 3, 9, 8)).astype(np.float32)
    positions = r.integers(0, 500, size=(2, 9))
    plain = mha.apply_rotary(x, positions, theta=321.0, rotary_dim=6)
    default = mha.apply_rotary(x, positions, theta=321.0, rotary_dim=6,
                               scaling={"rope_type": "default", "rope_theta": 1.0})  # fmt: skip
    np.testing.assert_array_equal(plain, default)
    old_backward = mha.apply_rotary(x, -positions, theta=321.0, rotary_dim=6)
    inverse = mha.apply_rotary(x, positions, theta=321.0, rotary_dim=6, inverse=True)
    np.testing.assert_array_equal(old_backward, inverse)
    empty = mha.apply_rotary(np.zeros((0, 8)), np.zeros(0), scaling=ADJOINT_SCALINGS[2])
    assert empty.shape == (0, 8)
    made = check_rope_scaling(ADJOINT_SCALINGS[1], 8)
    assert isinstance(made, RopeScaling) and check_rope_scaling(made, 8) is made
    np.testing.assert_array_equal(
        mha.apply_rotary(x, positions, rotary_dim=8, scaling=made),
        mha.apply_rotary(x, positions, rotary_dim=8, scaling=ADJOINT_SCALINGS[1]),
    )


# ------------------------------------------------- refusals

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
REFUSALS = [
    ({"rope_type": "su"}, ValueError, "'rope_type'] 'su' is not supported: use one of default"),
    ({"rope_type": "mrope"}, ValueError, "proportional"),
    ({"type": "linear", "rope_type": "yarn"}, ValueError, "scaling['type'] 'linear'"),
    ({"rope_type": "linear", "factor": 2.0, "mrope_section": [2, 2]}, ValueError,
     "the key 'mrope_section', which rope_type 'linear' does not take (it takes factor)"),
    ({"rope_type": "default", "factor": 2.0}, ValueError, "'factor', which rope_type 'default'"),
    ({"rope_type": "linear"}, ValueError, "needs the key 'factor' for rope_type 'linear'"),
    ({"rope_type": "linear", "factor": None}, ValueError, "needs the key 'factor'"),
    ({"rope_type": "linear", "factor": 0.5}, ValueError, "scaling['factor'] must be a number >= 1"),
    ({"rope_type": "linear", "factor": "2"}, TypeError, "scaling['factor'] must be a number"),
    ({"rope_type": "linear", "factor": True}, TypeError, "scaling['factor']"),
    ({"rope_type": "dynamic", "factor": 2.0}, ValueError,
     "needs the key 'max_position_embeddings'"),
    ({"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64.0}, TypeError,
     "scaling['max_position_embeddings'] must be a positive integer"),
    ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}, ValueError,
     "the key 'original_max_position_embeddings', which rope_type 'dynamic' does not take"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     ValueError, "needs the key 'original_max_position_embeddings' (or 'max_position_embeddings'"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, ValueError, "needs the key 'low_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, ValueError, "scaling['high_freq_factor'] must be"),
    ({**YARN, "factor": None}, ValueError, "needs the key 'factor' (or 'max_position_embeddings'"),
    ({**YARN, "beta_fast": 1.0, "beta_slow": 2.0}, ValueError, "scaling['beta_fast'] must be"),
    ({**YARN, "beta_fast": 0}, ValueError, "scaling['beta_fast'] must be a number > 0.0"),
    ({**YARN, "truncate": 1}, TypeError, "scaling['truncate'] must be True or False"),
    ({**YARN, "attention_factor": -1.0}, ValueError, "scaling['attention_factor']"),
    ({**YARN, "mscale": float("nan")}, ValueError, "scaling['mscale']"),
    ({**YARN, "short_factor": [1.0] * 4}, ValueError, "the key 'short_factor', which rope_type"),
    ({**LONGROPE, "short_factor": [1.0] * 3}, ValueError,
     "scaling['short_factor'] must be a list of rotary_dim/2 = 4 positive numbers; got 3"),
    ({**LONGROPE, "long_factor": [1.0, 2.0, 0.0, 1.0]}, ValueError, "scaling['long_factor']"),
    ({**LONGROPE, "long_factor": "1 2 3 4"}, TypeError, "scaling['long_factor'] must be a list"),
    ({k: v for k, v in LONGROPE.items() if k != "long_factor"}, ValueError,
     "needs the key 'long_factor'"),
    ({k: v for k, v in LONGROPE.items() if k != "factor"}, ValueError, "needs the key 'factor'"),
    ({"rope_type": "proportional", "partial_rotary_factor": 1.5}, ValueError,
     "scaling['partial_rotary_factor'] must be a number > 0.0 and <= 1.0"),
    ({1: "linear"}, TypeError, "scaling's keys must be strings"),
    ([("rope_type", "linear")], TypeError, "scaling must be a dict of rope parameters"),
]  # fmt: skip


@pytest.mark.parametrize(("scaling", "error", "message"), REFUSALS)
def test_every_problem_is_refused_naming_the_key(scaling, error, message):
    with pytest.raises(error) as raised:
        mha.apply_rotary(np.ones((4, 8)), np.arange(4), scaling=scaling)
    assert isinstance(raised.value, mha.AttentionError)
    assert message in str(raised.value) and "(x (4, 8))" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_refusals_of_the_call():
    x = np.ones((2, 4, 12))
    with pytest.raises(mha.AttentionValueError, match=r"partial_rotary_factor'\] 0.5 rotates 6"):
        mha.apply_rotary(x, np.arange(4), rotary_dim=8,
                         scaling={"rope_type": "linear", "factor": 2.0,
                                  "partial_rotary_factor": 0.5})  # fmt: skip
    with pytest.raises(mha.AttentionValueError, match="made for rotary_dim=8, not 12"):
        mha.apply_rotary(x, np.arange(4), scaling=check_rope_scaling(ADJOINT_SCALINGS[1], 8))
    with pytest.raises(mha.AttentionValueError, match="needs rotary_dim > 2"):
        mha.apply_rotary(x, np.arange(4), rotary_dim=2, scaling=ADJOINT_SCALINGS[2])
    with pytest.raises(mha.AttentionValueError, match="seq_len must be a positive number"):
        mha.apply_rotary(x, np.arange(4), scaling=ADJOINT_SCALINGS[2], seq_len=0)
    with pytest.raises(mha.AttentionTypeError, match="inverse must be True or False"):
        mha.apply_rotary(x, np.arange(4), inverse=1)
    with pytest.raises(mha.AttentionValueError, match="needs max_position_embeddings"):
        RopeScaling("dynamic", 8, factor=2.0)
    with pytest.raises(mha.AttentionValueError, match="'ntk' is not supported"):
        RopeScaling("ntk", 8)
    assert set(ROPE_TYPES) == {"default", "linear", "dynamic", "llama3", "yarn", "longrope",
                               "proportional"}  # fmt: skip


def test_every_transformers_rope_type_is_known(transformers):
    """A rope type transformers adds fails here until mha computes or refuses it by name."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPE_TYPES)
