"""Multi-head latent attention (DeepSeek-V2/V3) against transformers' DeepseekV3Attention in
float64: whole sequences, prefill then token-by-token decoding from the latent cache against
transformers' DynamicCache, and every gradient against torch.autograd; against a plain NumPy
reference of the expanded (not absorbed) form without torch; and its errors.

transformers computes two things in float32 even in a float64 model, which would hide every
error below 1e-7: the rotary embedding (support.rope_oracle runs transformers' own code in
float64, yarn's included) and its RMSNorm, which casts its input to float32 (the attention's
two norms get the same formula in the input's dtype). The rest, the interleaved rope's
permuted layout and the yarn-corrected softmax scale included, is transformers' code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.configs import relative_error
from support.rope_oracle import float64_rotary
from support.transformers_oracle import AttentionRecorder

import mha
from mha.api.latent import LatentAttention

OUT, GRAD = 1e-12, 1e-10  # float64 tolerances: outputs, gradients

SIZES = {"hidden_size": 40, "num_attention_heads": 4, "kv_lora_rank": 12,
         "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5}  # fmt: skip


def settings(**overrides):
    """LatentAttention's keywords for SIZES."""
    given = {"d_model": SIZES["hidden_size"], "num_heads": SIZES["num_attention_heads"],
             **{name: SIZES[name] for name in list(SIZES)[2:]}}  # fmt: skip
    given.update(overrides)
    return given


# ---------------------------------------------------------------- transformers' layers


def tiny_model(seed, **overrides):
    """A random float64 DeepseekV3ForCausalLM of two dense layers (no experts), every
    attention weight away from its initial value, with float64 rotary and RMSNorms."""
    import torch
    import transformers

    config = transformers.DeepseekV3Config(**{
        **SIZES, "num_key_value_heads": SIZES["num_attention_heads"], "q_lora_rank": 10,
        "intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 2,
        "vocab_size": 53, "max_position_embeddings": 64, "attn_implementation": "sdpa",
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 300.0}, **overrides,
    })  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "self_attn" in name and name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
            elif "self_attn" in name and "norm" in name:
                parameter.normal_(1.0, 0.3)
    for layer in model.model.layers:
        float64_norms(layer.self_attn)
    float64_rotary(model)
    return model


def float64_norms(attention):
    """The attention's RMSNorms in their input's dtype (transformers casts it to float32)."""
    import torch

    for norm in (attention.q_a_layernorm, attention.kv_a_layernorm):
        if norm is None:
            continue

        def forward(h, norm=norm):
            variance = h.pow(2).mean(-1, keepdim=True)
            return norm.weight * (h * torch.rsqrt(variance + norm.variance_epsilon))

        norm.forward = forward


def ours(attention, config):
    """A LatentAttention with transformers' layer's weights (``x @ W``: the transposes)."""
    state = {name: p.detach().numpy() for name, p in attention.state_dict().items()}
    names = {"q_proj.weight": "W_q", "q_a_proj.weight": "W_q_a", "q_a_proj.bias": "b_q_a",
             "q_a_layernorm.weight": "q_a_norm", "q_b_proj.weight": "W_q_b",
             "kv_a_proj_with_mqa.weight": "W_kv_a", "kv_a_proj_with_mqa.bias": "b_kv_a",
             "kv_a_layernorm.weight": "kv_a_norm", "kv_b_proj.weight": "W_kv_b",
             "o_proj.weight": "W_o", "o_proj.bias": "b_o"}  # fmt: skip
    weights = {names[k]: (v.T if v.ndim == 2 else v) for k, v in state.items()}
    sizes = {name: getattr(config, name) for name in list(SIZES)[2:]}
    rope = config.rope_parameters
    scaling = None
    if rope["rope_type"] != "default":  # the model's length too, as rope_scaling needs it
        scaling = {**rope, "max_position_embeddings": config.max_position_embeddings}
    return LatentAttention.from_spec(
        mha.LatentSpec(**settings(**sizes, q_lora_rank=config.q_lora_rank,
                            rope_theta=rope["rope_theta"], rope_scaling=scaling,
                            rotary_interleaved=config.rope_interleave,
                            norm_eps=attention.kv_a_layernorm.variance_epsilon,
                            scale=attention.scaling)), weights,
    )  # fmt: skip


YARN = {"rope_type": "yarn", "rope_theta": 300.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 8.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 6}  # fmt: skip
"""DeepSeek-V3's rope: yarn, with the softmax scale corrected by its mscale; sequences of
11 tokens go past the original length."""

MODELS = [
    {},  # q through its own latent, DeepSeek's interleaved rope
    {"rope_parameters": YARN},
    {"q_lora_rank": None},  # DeepSeek-V2-Lite's q_proj
    {"q_lora_rank": None, "attention_bias": True, "rope_interleave": False},
    {"attention_bias": True, "kv_lora_rank": 20, "qk_rope_head_dim": 6},
]


@pytest.mark.parametrize("overrides", MODELS)
def test_whole_sequences_match_transformers(overrides, torch, transformers, record_error):
    model = tiny_model(0, **overrides)
    recorder = AttentionRecorder(model)
    ids = torch.randint(0, 53, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
    recorder.close()
    for layer, ((x, expected),) in zip(model.model.layers, recorder.calls, strict=True):
        attention = ours(layer.self_attn, model.config)
        error = relative_error(attention(x, mask=True), expected)
        assert record_error("transformers DeepSeek-V3 latent attention, float64", error) <= OUT
        spread = attention(x, mask=True, positions=2 * np.arange(11))  # the rope matters
        assert relative_error(spread, expected) > 1e-6


@pytest.mark.parametrize("overrides", MODELS[:4])
def test_decoding_from_the_latent_cache_matches_transformers(
    overrides, torch, transformers, record_error
):
    """Prefill 5 tokens, then decode 6 one at a time, with transformers' DynamicCache: every
    step's attention output compared; the cache holds kv_lora_rank + rope numbers a token."""
    model = tiny_model(1, **overrides)
    recorder = AttentionRecorder(model)
    ids = torch.randint(0, 53, (3, 11), generator=torch.Generator().manual_seed(2))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :5], cache=cache, use_cache=True)
        for t in range(5, 11):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    recorder.close()
    width = SIZES["kv_lora_rank"] + SIZES["qk_rope_head_dim"]
    for layer, layer_calls in zip(model.model.layers, recorder.calls, strict=True):
        attention = ours(layer.self_attn, model.config)
        latent = attention.new_cache(3, capacity=4)  # small: it has to grow
        assert len(layer_calls) == 7
        for x, expected in layer_calls:
            error = relative_error(attention(x, cache=latent), expected)
            assert record_error("transformers DeepSeek-V3 latent cache, every step", error) <= OUT
        assert latent.lengths.tolist() == [11, 11, 11]
        assert latent.k.shape == (3, 1, latent.capacity, width)
        assert latent.v.shape == (3, 1, latent.capacity, SIZES["kv_lora_rank"])
        assert np.shares_memory(latent.k, latent.v) and latent.nbytes == latent.k.nbytes


def test_gradients_match_torch_autograd(torch, transformers, record_error):
    """Every weight's gradient, the norms' and x's, through DeepseekV3Attention by autograd
    (causal, with and without q's latent, with biases), and two by finite differences."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    for seed, overrides in enumerate(
        ({"attention_bias": True, "rope_parameters": YARN}, {"q_lora_rank": None})
    ):
        config = tiny_model(0, **overrides).config
        torch.manual_seed(seed)
        layer = DeepseekV3Attention(config, 0).double()
        with torch.no_grad():
            for name, parameter in layer.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    parameter.normal_(1.0 if "norm" in name else 0.0, 0.4)
        float64_norms(layer)
        rotary = DeepseekV3RotaryEmbedding(config)
        float64_rotary(rotary)
        g = np.random.default_rng(seed)
        x = g.standard_normal((2, 7, SIZES["hidden_size"]))
        grad_out = g.standard_normal(x.shape)
        x_t = torch.tensor(x, requires_grad=True)
        out_t, _ = layer(x_t, rotary(x_t, torch.arange(7)[None]), None)
        (out_t * torch.from_numpy(grad_out)).sum().backward()

        attention = ours(layer, config)
        out, backward = attention(x, mask=True, return_backward=True)
        assert relative_error(out, out_t.detach().numpy()) <= OUT
        grads = backward(grad_out)
        expected = {"query": x_t.grad.numpy()}
        names = {"q_proj.weight": "W_q", "q_a_proj.weight": "W_q_a", "q_a_proj.bias": "b_q_a",
                 "q_a_layernorm.weight": "q_a_norm", "q_b_proj.weight": "W_q_b",
                 "kv_a_proj_with_mqa.weight": "W_kv_a", "kv_a_proj_with_mqa.bias": "b_kv_a",
                 "kv_a_layernorm.weight": "kv_a_norm", "kv_b_proj.weight": "W_kv_b",
                 "o_proj.weight": "W_o", "o_proj.bias": "b_o"}  # fmt: skip
        for name, parameter in layer.named_parameters():
            grad = parameter.grad.numpy()
            expected[names[name]] = grad.T if grad.ndim == 2 else grad
        assert sorted(grads) == sorted(expected) == sorted([*attention.parameters(), "query"])
        for name, grad in grads.items():
            assert grad.shape == expected[name].shape, name
            error = relative_error(grad, expected[name])
            assert record_error("torch.autograd through DeepseekV3Attention", error) <= GRAD, name

        for name, index in (("W_kv_b", (3, 7)), ("kv_a_norm", (5,))):  # central differences
            W = attention.parameters()[name]
            h, kept = 1e-6, W[index]
            sides = []
            for step in (h, -h):
                W[index] = kept + step
                sides.append(float(np.sum(attention(x, mask=True) * grad_out)))
            W[index] = kept
            numeric = (sides[0] - sides[1]) / (2 * h)
            assert math.isclose(numeric, grads[name][index], rel_tol=1e-6, abs_tol=1e-8), name


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_mha"])
def test_from_pretrained_matches_the_checkpoints_model(family, torch, transformers, record_error):
    """Each layer of a saved DeepSeek V3 checkpoint (yarn, bfloat16 shards; with q's latent,
    and without it but with biases and rotate_half) read by from_pretrained, against the
    model transformers loads from it in float64, past the rope's original length."""
    from support import pretrained_models

    model = pretrained_models.transformers_model(family)
    float64_rotary(model)
    folder = pretrained_models.saved(family)
    x = np.random.default_rng(3).standard_normal((2, 21, model.config.hidden_size))
    x_t = torch.from_numpy(x)
    cos_sin = model.model.rotary_emb(x_t, torch.arange(21)[None])
    for index, layer in enumerate(model.model.layers):  # the attention alone: no experts
        float64_norms(layer.self_attn)
        with torch.no_grad():
            expected = layer.self_attn(x_t, cos_sin, None)[0].numpy()  # causal (SDPA's)
        attention = LatentAttention.from_pretrained(folder, layer=index, dtype=np.float64)
        assert attention.scale == layer.self_attn.scaling
        error = relative_error(attention(x, mask=True), expected)
        assert record_error("transformers DeepSeek-V3 checkpoints, from_pretrained", error) <= OUT
    if family == "deepseek_v3_mha":
        with pytest.raises(mha.AttentionValueError, match="not multi-head latent attention"):
            LatentAttention.from_pretrained(pretrained_models.saved("mistral"))


# ---------------------------------------------------------------- without torch


def expanded_reference(attention, x, positions):
    """The layer written out as DeepSeek-V2's paper has it, with plain loops over heads and
    rows: each head's key [c @ W_uk_h, k_pe] and value c @ W_uv_h built, then a causal
    softmax; ``math.fsum`` for the softmax's sums."""
    r, n, p = attention.kv_lora_rank, attention.qk_nope_head_dim, attention.qk_rope_head_dim
    H, d_v, eps = attention.num_heads, attention.v_head_dim, attention.norm_eps

    def norm(a, w):
        return w * a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps)

    def rope(v, at):  # interleaved pairs (2i, 2i + 1)
        angle = at * attention.rope_theta ** (-np.arange(0, p, 2) / p)
        out = v.copy()
        out[0::2] = v[0::2] * np.cos(angle) - v[1::2] * np.sin(angle)
        out[1::2] = v[1::2] * np.cos(angle) + v[0::2] * np.sin(angle)
        return out

    if attention.q_lora_rank is None:
        q = x @ attention.W_q
    else:
        q = norm(x @ attention.W_q_a, attention.q_a_norm) @ attention.W_q_b
    kv = x @ attention.W_kv_a
    c = norm(kv[:, :r], attention.kv_a_norm)
    expanded = (c @ attention.W_kv_b).reshape(-1, H, n + d_v)
    L = x.shape[0]
    heads = np.zeros((L, H, d_v))
    for h in range(H):
        keys = [np.concatenate([expanded[j, h, :n], rope(kv[j, r:], positions[j])])
                for j in range(L)]  # fmt: skip
        for i in range(L):
            qi = q[i].reshape(H, n + p)[h]
            qi = np.concatenate([qi[:n], rope(qi[n:], positions[i])])
            logits = [float(qi @ keys[j]) * attention.scale for j in range(i + 1)]
            top = max(logits)
            weights = [math.exp(s - top) for s in logits]
            total = math.fsum(weights)
            heads[i, h] = sum(w / total * expanded[j, h, n:] for j, w in enumerate(weights))
    return heads.reshape(L, H * d_v) @ attention.W_o


@pytest.mark.parametrize("q_lora_rank", [None, 7])
def test_absorbed_form_matches_the_expanded_one(q_lora_rank, record_error):
    attention = LatentAttention(**settings(q_lora_rank=q_lora_rank, rope_theta=50.0), seed=3)
    for W in attention.parameters().values():
        W *= 3.0  # logits of order 1 and more: the softmax is far from uniform
    x = np.random.default_rng(4).standard_normal((6, SIZES["hidden_size"]))
    positions = np.array([0, 1, 2, 5, 8, 13])
    expected = expanded_reference(attention, x, positions)
    error = relative_error(attention(x, mask=True, positions=positions), expected)
    assert record_error("plain-loop expanded MLA", error) <= OUT


def test_padding_and_masks_follow_the_library_conventions():
    """query_lengths/key_lengths give the unpadded sequences' answers; a boolean (B, L, L)
    mask is applied to every head; mask=True is causal=True; float32 in gives float32."""
    attention = LatentAttention(**settings(q_lora_rank=9), bias=True, seed=5)
    g = np.random.default_rng(6)
    x = g.standard_normal((2, 7, SIZES["hidden_size"]))
    padded = attention(x, causal=True, query_lengths=[7, 4], key_lengths=[7, 4])
    alone = attention(x[1:, :4], mask=True)
    assert relative_error(padded[1, :4], alone[0]) <= 1e-14
    assert np.array_equal(padded[1, 4:], np.broadcast_to(attention.b_o, (3, SIZES["hidden_size"])))
    causal = np.tril(np.ones((7, 7), dtype=bool))
    as_array = attention(x, np.broadcast_to(causal, (2, 7, 7)))  # the Python walk, with numba
    np.testing.assert_allclose(as_array, attention(x, True), rtol=1e-14, atol=1e-15)
    assert np.array_equal(attention(x, causal=True), attention(x, mask=True))
    single = LatentAttention(**settings(), dtype=np.float32, seed=5)
    assert single(x.astype(np.float32), mask=True).dtype == np.float32
    half = LatentAttention(**settings(), dtype=np.float16, seed=5)  # computed in float32
    cache = half.new_cache(2)
    assert half(x.astype(np.float16), cache=cache).dtype == np.float16
    assert cache.dtype == np.float16 and cache.compute_dtype == np.float32


def test_cached_decoding_equals_the_whole_sequence():
    """Ragged prefill with query_lengths, then one token at a time, against each sequence
    computed whole; the cache's lengths, and its rows hold the latent and the rotary key."""
    attention = LatentAttention(**settings(q_lora_rank=9), seed=7)
    g = np.random.default_rng(8)
    x = g.standard_normal((2, 9, SIZES["hidden_size"]))
    cache = attention.new_cache(2, capacity=2)
    first = attention(x[:, :5], cache=cache, query_lengths=[5, 3])
    assert cache.lengths.tolist() == [5, 3]
    steps = [attention(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
    whole = attention(x, mask=True)
    got = np.concatenate([first[:1], *(step[:1] for step in steps)], axis=1)
    assert relative_error(got, whole[:1]) <= 1e-14
    late = np.concatenate([x[1:, :3], x[1:, 5:9]], axis=1)  # sequence 1 skipped rows 3 and 4
    expected = attention(late, mask=True)
    got = np.concatenate([first[1:, :3], *(s[1:] for s in steps)], axis=1)
    assert relative_error(got, expected) <= 1e-14
    assert cache.lengths.tolist() == [9, 7] and cache.k.shape[-1] == 16


# ---------------------------------------------------------------- errors


def test_mistakes_are_refused_by_name():
    attention = LatentAttention(**settings(q_lora_rank=9), seed=0)
    weights = attention.parameters()
    for changed, error, message in (
        ({"W_kv_b": np.zeros((12, 40))}, mha.ShapeError,
         r"W_kv_b has shape \(12, 40\) but this layer needs \(12, 44\) \(kv_lora_rank=12; "),
        ({"kv_a_norm": np.ones(13)}, mha.ShapeError,
         r"kv_a_norm has shape \(13,\) but this layer needs \(12,\)"),
        ({"W_q": np.zeros((40, 40))}, mha.AttentionValueError, "weights W_q are not used"),
    ):  # fmt: skip
        with pytest.raises(error, match=message):
            LatentAttention.from_spec(mha.LatentSpec(**settings(q_lora_rank=9)),
                                      {**weights, **changed})  # fmt: skip
    with pytest.raises(mha.AttentionValueError, match="W_q, kv_a_norm, W_kv_b, W_o are missing"):
        LatentAttention.from_spec(mha.LatentSpec(**settings()), {"W_kv_a": weights["W_kv_a"]})
    x = np.zeros((1, 3, SIZES["hidden_size"]))
    with pytest.raises(mha.ShapeError, match=r"shape \(B, L, 40\).*got shape \(1, 3, 8\)"):
        attention(np.zeros((1, 3, 8)))
    with pytest.raises(mha.AttentionTypeError, match=r"must be None, True/False .* boolean array"):
        attention(x, np.ones((3, 3)))
    cache = attention.new_cache(1)
    with pytest.raises(mha.AttentionValueError, match="cannot be combined with return_backward"):
        attention(x, cache=cache, return_backward=True)
    with pytest.raises(mha.AttentionValueError, match="positions="):
        attention(x, cache=cache, positions=[0, 1, 2])
    assert cache.lengths.tolist() == [0]
    with pytest.raises(mha.AttentionValueError, match="qk_rope_head_dim"):
        LatentAttention(**settings(qk_rope_head_dim=5))
    with pytest.raises(mha.AttentionTypeError, match="kv_lora_rank"):
        LatentAttention(**settings(kv_lora_rank=2.5))


def test_repr_parameters_and_backward_after_an_update():
    attention = LatentAttention(**settings(), bias=True, seed=0)
    assert repr(attention) == (
        "LatentAttention(d_model=40, num_heads=4, q_lora_rank=None, kv_lora_rank=12, "
        "qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, bias=True, dtype=float64)"
    )
    assert sorted(attention.parameters()) == ["W_kv_a", "W_kv_b", "W_o", "W_q", "b_kv_a", "b_o",
                                              "kv_a_norm"]  # fmt: skip
    x = np.random.default_rng(0).standard_normal((2, 3, 40))
    out, backward = attention(x, mask=True, return_backward=True)
    attention.W_o += 1.0
    with pytest.raises(mha.AttentionValueError, match="W_o changed after the forward pass"):
        backward(np.ones_like(out))


def test_a_reassigned_weight_or_another_cache_is_refused_by_name():
    attention = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                                v_head_dim=4, seed=0)  # fmt: skip
    x = np.ones((2, 3, 16))
    cache = attention.new_cache(3)
    with pytest.raises(mha.ShapeError, match="x has 2 sequences but the cache holds 3"):
        attention(x, cache=cache)
    attention.W_o = np.ones((3, 3))
    with pytest.raises(mha.ShapeError, match=r"W_o has shape \(3, 3\) but this layer needs"):
        attention(x)


def test_a_cache_of_values_in_keys_refuses_other_values_and_stays_as_it_was():
    k = np.random.default_rng(0).standard_normal((1, 1, 3, 6))
    cache = mha.KVCache(1, 1, 6, value_dim=4, values_in_keys=True, capacity=2)
    with pytest.raises(mha.AttentionValueError, match="must be the first 4 features"):
        mha.scaled_dot_product_attention(k, k, k[..., :4] + 1.0, cache=cache)
    assert cache.lengths.tolist() == [0] and cache.capacity == 2
    out = mha.scaled_dot_product_attention(k, k, k[..., :4], cache=cache)  # grows, shared
    expected = mha.scaled_dot_product_attention(k, k, k[..., :4], causal=True)
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-15)
    assert np.shares_memory(cache.k, cache.v) and cache.nbytes == cache.k.nbytes


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"q_lora_rank": 9, "bias": True},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                          "mscale": 1.0, "mscale_all_dim": 0.707},
         "scale": 0.3, "dtype": np.float32},
    ],
)  # fmt: skip
def test_save_and_load_round_trip_bit_for_bit(overrides, tmp_path):
    """The spec and every weight come back the same bits, and the layer computes the same."""
    attention = LatentAttention(**settings(), **overrides, seed=11)
    path = tmp_path / "latent.npz"
    attention.save(path)
    loaded = LatentAttention.load(path)
    assert loaded.spec == attention.spec and loaded.dtype == attention.dtype
    for name, W in attention.weights().items():
        other = loaded.weights()[name]
        assert (W is None) == (other is None), name
        assert W is None or (W.dtype == other.dtype and np.array_equal(W, other)), name
    x = np.random.default_rng(0).standard_normal((2, 6, attention.d_model)).astype(attention.dtype)
    np.testing.assert_array_equal(loaded(x, mask=True), attention(x, mask=True))


def test_a_bfloat16_layer_saves_its_bits(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    attention = LatentAttention(**settings(), dtype=ml_dtypes.bfloat16, seed=2)
    attention.save(tmp_path / "latent.npz")
    loaded = LatentAttention.load(tmp_path / "latent.npz")
    assert loaded.W_o.dtype == ml_dtypes.bfloat16
    assert np.array_equal(loaded.W_o.view(np.uint16), attention.W_o.view(np.uint16))


def test_loading_refuses_what_is_not_a_latent_layer_file(tmp_path):
    attention = LatentAttention(**settings(q_lora_rank=9), seed=0)
    mha.MultiHeadAttention(8, 2, seed=0).save(tmp_path / "mha.npz")
    with pytest.raises(mha.WeightsFileError, match=r"format is 'mha\.MultiHeadAttention'"):
        LatentAttention.load(tmp_path / "mha.npz")
    attention.save(tmp_path / "good.npz")
    with np.load(tmp_path / "good.npz") as saved:
        entries = dict(saved)
    for change, words in (
        ({"W_kv_b": None}, r"weights W_kv_b are missing"),
        ({"W_o": np.zeros((3, 3))}, r"W_o has shape \(3, 3\) but this layer needs"),
        ({"W_q": np.zeros((40, 40))}, r"weights W_q are not used by this layer"),
    ):
        given = {name: W for name, W in {**entries, **change}.items() if W is not None}
        np.savez(tmp_path / "bad.npz", **given)
        with pytest.raises(mha.WeightsFileError, match="cannot load .*bad.npz: " + words):
            LatentAttention.load(tmp_path / "bad.npz")
    with pytest.raises(mha.WeightsFileError, match="cannot save to"):
        attention.save(tmp_path / "no-such-folder" / "latent.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "good.npz", "mha.npz"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_paged_cache_gives_the_contiguous_caches_answer(dtype):
    """Decoding with new_paged_cache, step after step, against the contiguous cache; then a
    sequence forked from another (its blocks shared) against a contiguous cache that saw
    the same tokens."""
    layer = LatentAttention(32, 4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                            v_head_dim=4, seed=0, dtype=dtype)  # fmt: skip
    rng = np.random.default_rng(0)
    contiguous = layer.new_cache(2)
    paged = layer.new_paged_cache(num_blocks=16, block_size=4)
    paged.add("a")
    paged.add("b")
    tolerance = 0 if dtype == np.float64 else 1e-6
    inputs = [rng.standard_normal((2, 5, 32)).astype(dtype)]
    inputs += [rng.standard_normal((2, 1, 32)).astype(dtype) for _ in range(3)]
    for x in inputs:
        want, got = layer(x, cache=contiguous), layer(x, cache=paged)
        np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
    assert paged.lengths.tolist() == contiguous.lengths.tolist() == [8, 8]
    paged.fork("a", "c")  # c continues a: their blocks shared until they differ
    paged.release("b")
    alone = layer.new_cache(1)
    for x in inputs:
        layer(x[:1], cache=alone)  # a's tokens
    x = rng.standard_normal((2, 1, 32)).astype(dtype)
    got = layer(x, cache=paged)  # a and c each take their own next token
    np.testing.assert_allclose(got[1:], layer(x[1:], cache=alone), rtol=0, atol=tolerance)
    assert paged.lengths.tolist() == [9, 9]


def test_a_paged_cache_of_another_type_is_refused():
    layer = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                            v_head_dim=4, seed=0)  # fmt: skip
    with pytest.raises(mha.AttentionTypeError, match=r"KVCache or mha\.PagedKVCache"):
        layer(np.ones((1, 2, 16)), cache=object())
