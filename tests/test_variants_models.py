"""The attention variants against Hugging Face transformers' own layers, in float64: gpt-oss's
learned sinks with its sliding layers, Gemma 2's soft-capping and query_pre_attn_scalar,
BLOOM's ALiBi (with padding), Llama 4's chunked mask; outputs, gradients, and decoding with
mha.KVCache against transformers' DynamicCache; StreamingLLM's sink tokens against a dense mask.

Tiny random models in float64. gpt-oss's eager attention keeps float64 throughout (its SDPA
path would drop the sinks); Gemma 2's and BLOOM's eager attentions ask for a float32 softmax,
so ``float64_softmax`` lets a float64 input keep its dtype there, and BLOOM's float32 ALiBi
slopes are multiplied by the positions in float64 (the slopes keep their float32 values, which
mha is given as ``alibi=`` where they are not exact: 12 heads). Their code otherwise runs as
it is. Rotary angles are computed in float64 from transformers' formula (see
support.transformers_oracle).
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from support.configs import relative_error

import mha

OUT, GRAD = 1e-12, 1e-10  # float64 tolerances: outputs, gradients


@pytest.fixture(autouse=True)
def float64_softmax(monkeypatch):
    """``softmax(x, dtype=torch.float32)`` keeps float64 for a float64 ``x``."""
    try:
        import torch
    except ImportError:
        return
    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if input.dtype == torch.float64:
            dtype = torch.float64
        return original(input, dim=dim, dtype=dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    try:
        from transformers.models.bloom import modeling_bloom
    except ImportError:
        return
    slopes = modeling_bloom._get_alibi_slopes  # float32 slopes, times positions in float32
    monkeypatch.setattr(
        modeling_bloom, "_get_alibi_slopes", lambda n, device: slopes(n, device).double()
    )


# ---------------------------------------------------------------- tiny models and recorders


def tiny_model(family, seed, **overrides):
    """A random float64 ``ForCausalLM``: "gpt_oss", "gemma2" or "bloom"."""
    import torch
    import transformers

    settings = {"hidden_size": 48, "vocab_size": 61, "initializer_range": 0.3,
                "attn_implementation": "eager"}  # fmt: skip
    if family == "bloom":
        settings.update(n_layer=2, n_head=6)
    else:
        settings.update(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=5,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_hidden_layers=2,
        )  # fmt: skip
    if family == "gpt_oss":
        settings.update(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                        experts_implementation="eager")  # fmt: skip
    if family == "gemma2":
        settings.update(intermediate_size=64, query_pre_attn_scalar=20, attn_logit_softcapping=2.5)
    names = {"gpt_oss": "GptOss", "gemma2": "Gemma2", "bloom": "Bloom"}
    config = getattr(transformers, f"{names[family]}Config")(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{names[family]}ForCausalLM")(config).double().eval()
    if family == "bloom":
        return model
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.5)  # sinks that take a real share
    _float64_rotary(model, halves=family == "gpt_oss")
    return model


def _float64_rotary(model, halves):
    """transformers' default rotary in float64: gpt-oss's returns the half-width angles."""
    import torch

    dim = model.config.head_dim
    theta = model.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq
        emb = freqs if halves else torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    model.model.rotary_emb.forward = forward


def attentions(model):
    if hasattr(model, "transformer"):  # BLOOM
        return [block.self_attention for block in model.transformer.h]
    return [layer.self_attn for layer in model.model.layers]


def variant_options(model, index):
    """mha's keywords for layer ``index`` of ``model``, from its config."""
    config = model.config
    if config.model_type == "bloom":  # up to 8 heads its float32 slopes are exact
        return {"alibi": True if config.n_head <= 8 else bloom_slopes(config.n_head)}
    sliding = config.layer_types[index] == "sliding_attention"
    options = {"window": config.sliding_window if sliding else None}
    if config.model_type == "gpt_oss":
        options["sinks"] = attentions(model)[index].sinks.detach().numpy().copy()
        options["scale"] = config.head_dim**-0.5
    else:
        options["softcap"] = config.attn_logit_softcapping
        options["scale"] = config.query_pre_attn_scalar**-0.5
    return options


class Recorder:
    """Each attention call of each layer: its input, q/k/v as transformers computes them (after
    rotary), the attention's output before the output projection, and after it."""

    def __init__(self, model):
        self.calls = [[] for _ in attentions(model)]
        self.handles = []
        bloom = model.config.model_type == "bloom"
        if not bloom:
            rotary = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
        for index, attention in enumerate(attentions(model)):
            out_proj = attention.dense if bloom else attention.o_proj

            def start(module, args, kwargs, index=index):
                hidden = args[0] if args else kwargs["hidden_states"]
                if bloom:
                    q, k, v = module._reshape(module.query_key_value(hidden))
                    residual = args[1] if len(args) > 1 else kwargs["residual"]
                else:
                    shape = (*hidden.shape[:-1], -1, module.head_dim)
                    q, k, v = (
                        proj(hidden).view(shape).transpose(1, 2)
                        for proj in (module.q_proj, module.k_proj, module.v_proj)
                    )
                    q, k = rotary.apply_rotary_pos_emb(q, k, *kwargs["position_embeddings"])
                    residual = 0.0 * hidden
                numpy = [t.detach().numpy().copy() for t in (hidden, q, k, v, residual)]
                self.calls[index].append(
                    dict(zip(("x", "q", "k", "v", "residual"), numpy, strict=True))
                )

            def core(module, args, index=index):
                self.calls[index][-1]["core"] = args[0].detach().numpy().copy()

            def end(module, args, kwargs, output, index=index):
                call = self.calls[index][-1]
                call["out"] = output[0].detach().numpy() - call.pop("residual")

            self.handles += [
                attention.register_forward_pre_hook(start, with_kwargs=True),
                out_proj.register_forward_pre_hook(core),
                attention.register_forward_hook(end, with_kwargs=True),
            ]

    def close(self):
        for handle in self.handles:
            handle.remove()


def heads(core, num_heads):
    """(B, L, H * d) -> (B, H, L, d)."""
    B, L, _ = core.shape
    return core.reshape(B, L, num_heads, -1).transpose(0, 2, 1, 3)


def layer_weights(attention):
    """mha.multi_head_attention's weights ("x @ W") and biases of one attention layer."""
    if hasattr(attention, "query_key_value"):  # BLOOM: rows (H, 3, d) of the fused projection
        H, d = attention.num_heads, attention.head_dim
        w = attention.query_key_value.weight.detach().numpy().reshape(H, 3, d, -1)
        b = attention.query_key_value.bias.detach().numpy().reshape(H, 3, d)
        out = attention.dense
        weights = [w[:, i].reshape(H * d, -1).T for i in range(3)]
        biases = [b[:, i].reshape(H * d) for i in range(3)]
    else:
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        out = attention.o_proj
        weights = [p.weight.detach().numpy().T for p in projections]
        biases = [None if p.bias is None else p.bias.detach().numpy() for p in projections]
    weights.append(out.weight.detach().numpy().T)
    biases.append(None if out.bias is None else out.bias.detach().numpy())
    return weights, dict(zip(("b_q", "b_k", "b_v", "b_o"), biases, strict=True))


def dense_attention(q, k, v, allowed, scale, sinks=None):
    """softmax over the allowed keys (and the sinks), in float64: the formula, densely."""
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scores = np.where(allowed, scale * q @ k.swapaxes(-1, -2), -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks)[:, None, None]
    top = np.maximum(top, -np.inf if sink is None else sink)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - top)
    return np.divide(weights, total, out=np.zeros_like(weights), where=total > 0) @ v


FAMILIES = [
    ("gpt_oss", {}),
    ("gemma2", {}),
    ("bloom", {}),  # 6 heads
    ("bloom", {"n_head": 12}),
    ("gpt_oss", {"num_key_value_heads": 1, "sliding_window": 3}),
    ("gemma2", {"attn_logit_softcapping": 0.7, "query_pre_attn_scalar": 7}),
]


def family_name(model):
    return {"gpt_oss": "gpt-oss sinks", "gemma2": "Gemma 2 softcap", "bloom": "BLOOM ALiBi"}[
        model.config.model_type
    ]


# ---------------------------------------------------------------- whole sequences


@pytest.mark.parametrize(("family", "overrides"), FAMILIES)
@pytest.mark.parametrize("seed", range(2))
def test_whole_sequences_match_transformers(
    family, overrides, seed, torch, transformers, record_error
):
    """Each layer of a 2-layer model on 2 x 17 tokens (sliding and full layers): mha's
    attention on transformers' q/k/v, and mha.multi_head_attention on the layer's input."""
    model = tiny_model(family, seed, **overrides)
    recorder = Recorder(model)
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(ids)
    recorder.close()
    name = family_name(model)
    for index, (attention, calls) in enumerate(zip(attentions(model), recorder.calls, strict=True)):
        (call,) = calls
        options = variant_options(model, index)
        H = call["q"].shape[1]
        out = mha.scaled_dot_product_attention(
            call["q"], call["k"], call["v"], causal=True, **options
        )
        error = relative_error(out, heads(call["core"], H))
        assert record_error(f"transformers {name} attention, float64", error) <= OUT
        weights, biases = layer_weights(attention)
        rope = {} if family == "bloom" else {"rope_theta": 10000.0}
        layer = mha.multi_head_attention(
            *(call["x"],) * 3, *weights, H, num_kv_heads=call["k"].shape[1], causal=True,
            **biases, **rope, **options,
        )  # fmt: skip
        error = relative_error(layer, call["out"])
        assert record_error(f"transformers {name} layer, float64", error) <= OUT
        if family == "gpt_oss":  # the layer read by from_llama, its sinks included
            module = mha.MultiHeadAttention.from_llama(
                model.state_dict(), prefix=f"model.layers.{index}.self_attn.", num_heads=H,
                num_kv_heads=call["k"].shape[1], head_dim=call["k"].shape[-1],
                window=options["window"],
            )  # fmt: skip
            assert module.sinks is not None
            error = relative_error(module(call["x"], mask=True, scale=options["scale"]),
                                   call["out"])  # fmt: skip
            assert record_error("transformers gpt-oss layer via from_llama", error) <= OUT


def test_sinks_merge_and_log_sum_exp(torch, transformers, record_error):
    """Split-key partials without the sinks, merged with them, equal gpt-oss's attention; the
    lse with sinks is log(exp(sink) + sum exp(s))."""
    model = tiny_model("gpt_oss", 7)
    recorder = Recorder(model)
    with torch.no_grad():
        model(torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(7)))
    recorder.close()
    for index, calls in enumerate(recorder.calls):
        (call,) = calls
        options = variant_options(model, index)
        sinks = options.pop("sinks")
        q, k, v = call["q"], call["k"], call["v"]
        S = k.shape[2]
        _, lse = mha.scaled_dot_product_attention(
            q, k, v, causal=True, sinks=sinks, return_lse=True, **options
        )
        allowed = np.tril(np.ones((S, S), dtype=bool))
        if options["window"]:
            allowed &= np.subtract.outer(np.arange(S), np.arange(S)) < options["window"]
        group = q.shape[1] // k.shape[1]
        scores = options["scale"] * q @ np.repeat(k, group, axis=1).swapaxes(-1, -2)
        logits = torch.from_numpy(np.where(allowed, scores, -np.inf))
        sink_logits = torch.from_numpy(sinks)[None, :, None, None].expand(2, -1, S, 1)
        expected = torch.logsumexp(torch.cat([logits, sink_logits], dim=-1), dim=-1).numpy()
        assert record_error("gpt-oss sinks lse, float64", relative_error(lse, expected)) <= OUT
        scale = options["scale"]
        parts = [
            mha.scaled_dot_product_attention(
                q, k[:, :, part], v[:, :, part], mask=allowed[:, part], scale=scale, return_lse=True
            )
            for part in (slice(0, 6), slice(6, S))
        ]
        merged, merged_lse = mha.merge_attention(*zip(*parts, strict=True), sinks=sinks)
        error = relative_error(merged, heads(call["core"], q.shape[1]))
        assert record_error("gpt-oss sinks merge_attention, float64", error) <= OUT
        assert relative_error(merged_lse, expected) <= OUT


# ---------------------------------------------------------------- gradients


def bloom_slopes(num_heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(num_heads, "cpu").double().numpy()


def reference_attention(family, model, index, q, k, v, key_lengths):
    """transformers' attention function of ``family`` on leaf tensors q/k/v (B, H, L, d):
    output (B, H, L, d), with the mask transformers builds (causal, sliding, padding)."""
    import torch
    from transformers import masking_utils as masks

    attention = attentions(model)[index]
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    padding = torch.arange(S)[None] < torch.as_tensor(key_lengths)[:, None]
    window = getattr(attention, "sliding_window", None)
    function = (
        masks.sliding_window_causal_mask_function(window) if window else masks.causal_mask_function
    )
    mask = masks.eager_mask(
        B, L, S, q_offset=S - L, mask_function=function, attention_mask=padding,
        dtype=torch.float64,
    )  # fmt: skip
    if family == "bloom":  # its own layer on these q/k/v, the first S - L keys in its cache
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer in range(attention.layer_idx + 1):
            cache.update(k[:, :, : S - L], v[:, :, : S - L], layer)
        new = (q, k[:, :, S - L :], v[:, :, S - L :])
        fused = torch.stack([t.transpose(1, 2) for t in new], dim=3).reshape(B, L, -1)

        class Fused(torch.nn.Module):
            def forward(self, hidden):
                return fused

        alibi = model.transformer.build_alibi_tensor(
            padding.long(), attention.num_heads, torch.float64
        )
        attention.query_key_value, attention.dense = Fused(), torch.nn.Identity()
        out, _ = attention(fused[..., :1] * 0, 0.0, alibi, mask, layer_past=cache)
        return out.view(B, L, attention.num_heads, -1).transpose(1, 2)
    module = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
    extra = {"softcap": attention.attn_logit_softcapping} if family == "gemma2" else {}
    out, _ = module.eager_attention_forward(
        attention, q, k, v, mask, scaling=attention.scaling, **extra
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize(("family", "overrides"), FAMILIES)
@pytest.mark.parametrize("index", [0, 1])  # the sliding layer and the full one
@pytest.mark.parametrize("seed", range(2))
def test_gradients_match_transformers_autograd(
    family, overrides, index, seed, torch, transformers, record_error
):
    """Output and dq, dk, dv (and d sinks) through transformers' attention by torch.autograd,
    against mha's return_backward; L < S (a chunk of queries after cached keys), padded
    keys; float32 outputs against the float64 reference."""
    model = tiny_model(family, seed, **overrides)
    attention = attentions(model)[index]
    g = np.random.default_rng(seed)
    H = model.config.num_attention_heads if family != "bloom" else attention.num_heads
    H_kv = model.config.num_key_value_heads if family != "bloom" else H
    d = attention.head_dim
    B, L, S = 2, 9, 14
    arrays = [g.standard_normal((B, h, n, d)) for h, n in ((H, L), (H_kv, S), (H_kv, S))]
    arrays[0] *= 2.0  # larger scores: soft-capping and the sinks both matter
    key_lengths = np.array([S, 11])
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    expected = reference_attention(family, model, index, *leaves, key_lengths)
    grad_out = g.standard_normal(expected.shape)
    expected.backward(torch.from_numpy(grad_out))
    options = variant_options(model, index)
    out, backward = mha.scaled_dot_product_attention(
        *arrays, causal=True, key_lengths=key_lengths, return_backward=True, **options
    )
    name = family_name(model)
    error = relative_error(out, expected.detach().numpy())
    assert record_error(f"transformers {name} attention, float64", error) <= OUT
    grads = backward(grad_out)
    wanted = dict(zip("qkv", (leaf.grad.numpy() for leaf in leaves), strict=True))
    if family == "gpt_oss":
        wanted["sinks"] = attention.sinks.grad.numpy()
    assert set(grads) >= set(wanted)
    for key, value in wanted.items():
        error = relative_error(grads[key], value)
        assert record_error(f"transformers {name} d{key}, float64", error) <= GRAD, key
    single = [a.astype(np.float32) for a in arrays]
    options32 = {k: (v.astype(np.float32) if k == "sinks" else v) for k, v in options.items()}
    out32 = mha.scaled_dot_product_attention(
        *single, causal=True, key_lengths=key_lengths, **options32
    )
    assert out32.dtype == np.float32
    error = relative_error(out32, expected.detach().numpy())
    assert record_error(f"transformers {name} attention, float32", error) <= 2e-5


# ---------------------------------------------------------------- BLOOM: slopes and padding


def test_alibi_slopes_are_blooms(torch, transformers, record_error):
    for n in [*range(1, 41), 48, 64, 96, 112]:
        ours, theirs = mha.alibi_slopes(n), bloom_slopes(n)
        assert ours.shape == (n,) and ours.dtype == np.float64
        if n <= 8:  # powers of two: float32 holds them exactly
            np.testing.assert_array_equal(ours, theirs)
        error = relative_error(ours, theirs)
        assert record_error("BLOOM ALiBi slopes (float32 in BLOOM)", error) <= 1e-6, n
    # the paper's geometric sequence for a power of two; the interleaved extras otherwise
    np.testing.assert_allclose(mha.alibi_slopes(16), 2.0 ** (-0.5 * np.arange(1, 17)), rtol=1e-15)
    twelve = np.concatenate([2.0 ** -np.arange(1.0, 9.0), 2.0 ** (-0.5 * np.arange(1, 8, 2))])
    np.testing.assert_allclose(mha.alibi_slopes(12), twelve, rtol=1e-15)


@pytest.mark.parametrize("side", ["right", "left"])
def test_bloom_with_padding(side, torch, transformers, record_error):
    """A padded batch through BLOOM (its alibi tensor counts positions from each sequence's
    first token): right padding is key_lengths, left padding a key mask."""
    model = tiny_model("bloom", 4)
    lengths = np.array([15, 9, 4])
    S = 15
    pad = np.arange(S)[None] < lengths[:, None]
    if side == "left":
        pad = pad[:, ::-1].copy()
    recorder = Recorder(model)
    ids = torch.randint(0, 61, (3, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, attention_mask=torch.from_numpy(pad.astype(np.int64)))
    recorder.close()
    for index, (attention, calls) in enumerate(zip(attentions(model), recorder.calls, strict=True)):
        (call,) = calls
        keys = {"key_lengths": lengths} if side == "right" else {"mask": pad[:, None, None, :]}
        out = mha.scaled_dot_product_attention(
            call["q"], call["k"], call["v"], causal=True, **keys, **variant_options(model, index)
        )
        expected = heads(call["core"], attention.num_heads)
        rows = pad[:, None, :, None]  # a left-padding row sees no key: ours is zero
        if side == "left":
            assert np.all(np.where(rows, 0.0, out) == 0.0)
        error = relative_error(np.where(rows, out, 0.0), np.where(rows, expected, 0.0))
        assert record_error(f"transformers BLOOM ALiBi {side} padding, float64", error) <= OUT


# ---------------------------------------------------------------- Llama 4: chunked attention


def llama4_chunk_mask(B, L, S, chunk, q_offset):
    import torch
    from transformers import masking_utils as masks

    function = masks.chunked_causal_mask_function(chunk, torch.zeros(B, dtype=torch.long))
    mask = masks.sdpa_mask(
        B, L, S, q_offset=q_offset, mask_function=function, allow_is_causal_skip=False
    )
    return mask.numpy()  # (B, 1, L, S), True = may attend


@pytest.mark.parametrize("seed", range(12))
def test_chunked_attention_matches_llama4_mask(seed, torch, transformers, record_error):
    g = np.random.default_rng(400 + seed)
    B, H_kv, group, d = int(g.integers(1, 3)), int(g.integers(1, 3)), int(g.integers(1, 4)), 8
    S = int(g.integers(2, 40))
    L = int(g.integers(1, S + 1))
    chunk = int(g.integers(1, 12))
    q = g.standard_normal((B, H_kv * group, L, d))
    k, v = g.standard_normal((2, B, H_kv, S, d))
    allowed = llama4_chunk_mask(B, L, S, chunk, q_offset=S - L)
    out = mha.scaled_dot_product_attention(q, k, v, causal=True, chunk=chunk)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(allowed),
        enable_gqa=True,
    ).numpy()  # fmt: skip
    error = relative_error(out, expected)
    assert record_error("Llama 4 chunk vs torch SDPA + transformers mask", error) <= OUT
    dense = dense_attention(q, k, v, allowed, d**-0.5)
    assert record_error("Llama 4 chunk vs dense softmax", relative_error(out, dense)) <= OUT
    masked = mha.scaled_dot_product_attention(q, k, v, mask=allowed)
    assert relative_error(out, masked) <= OUT


@pytest.mark.parametrize("seed", range(4))
def test_chunked_gradients_match_autograd_through_llama4_mask(seed, torch, transformers,
                                                               record_error):  # fmt: skip
    """Gradients of chunked attention (grouped heads, L < S) against torch.autograd through
    torch's SDPA with transformers' own chunked mask."""
    g = np.random.default_rng(450 + seed)
    B, H_kv, group, d, S, L = 2, 2, 2, 8, 37, 23
    chunk = int(g.integers(3, 11))
    q = g.standard_normal((B, H_kv * group, L, d))
    k, v = g.standard_normal((2, B, H_kv, S, d))
    grad_out = g.standard_normal((B, H_kv * group, L, d))
    allowed = torch.from_numpy(llama4_chunk_mask(B, L, S, chunk, q_offset=S - L))
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=allowed, enable_gqa=True
    )
    expected.backward(torch.from_numpy(grad_out))
    out, backward = mha.scaled_dot_product_attention(
        q, k, v, causal=True, chunk=chunk, return_backward=True
    )
    assert relative_error(out, expected.detach().numpy()) <= OUT
    grads = backward(grad_out)
    for name, tensor in (("q", tq), ("k", tk), ("v", tv)):
        error = relative_error(grads[name], tensor.grad.numpy())
        assert record_error(f"Llama 4 chunk d{name}, float64", error) <= GRAD


def test_chunked_decoding_matches_llama4_mask(torch, transformers, record_error):
    """Prefill 5, then tokens one by one (and 3 at once) past three chunk boundaries: every
    step against transformers' chunked mask at that offset, and the whole sequence."""
    g = np.random.default_rng(41)
    B, H, H_kv, d, T, chunk = 2, 4, 2, 8, 22, 6
    q = g.standard_normal((B, H, T, d))
    k, v = g.standard_normal((2, B, H_kv, T, d))
    whole = mha.scaled_dot_product_attention(q, k, v, causal=True, chunk=chunk)
    cache = mha.KVCache(B, H_kv, d, capacity=4)
    bounds = [0, 5, *range(6, 15), 18, *range(19, T + 1)]
    for start, stop in pairwise(bounds):
        step = mha.scaled_dot_product_attention(
            *(a[:, :, start:stop] for a in (q, k, v)), cache=cache, causal=True, chunk=chunk
        )
        allowed = llama4_chunk_mask(B, stop - start, stop, chunk, q_offset=start)
        expected = dense_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop],
                                   allowed, d**-0.5)  # fmt: skip
        assert record_error("Llama 4 chunk, cached decoding", relative_error(step, expected)) <= OUT
        assert relative_error(step, whole[:, :, start:stop]) <= OUT
    assert cache.lengths.tolist() == [T, T]


# ---------------------------------------------------------------- decoding with caches


@pytest.mark.parametrize(("family", "overrides"), FAMILIES)
def test_decoding_matches_transformers_dynamic_cache(
    family, overrides, torch, transformers, record_error
):
    """Prefill 6 tokens, then decode 10 one at a time with transformers' DynamicCache (its
    sliding layers keep window - 1 tokens) and with mha.KVCache (windowed for the sliding
    layers): every step, and the steps against the whole sequence run at once."""
    model = tiny_model(family, 3, **overrides)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(5))
    stepped = Recorder(model)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :6], cache=cache, use_cache=True)
        for t in range(6, 16):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    stepped.close()
    recorder = Recorder(model)
    with torch.no_grad():
        model(ids)
    recorder.close()
    name = family_name(model)
    for index, calls in enumerate(stepped.calls):
        options = variant_options(model, index)
        H, H_kv, d = calls[0]["q"].shape[1], calls[0]["k"].shape[1], calls[0]["k"].shape[3]
        ours = mha.KVCache(2, H_kv, d, capacity=3, window=options.get("window"))
        steps = []
        for call in calls:
            out = mha.scaled_dot_product_attention(
                call["q"], call["k"], call["v"], cache=ours, causal=True, **options
            )
            error = relative_error(out, heads(call["core"], H))
            assert record_error(f"transformers {name} cached decoding, float64", error) <= OUT
            steps.append(out)
        (whole,) = recorder.calls[index]
        error = relative_error(np.concatenate(steps, axis=2), heads(whole["core"], H))
        assert record_error(f"transformers {name} decoding vs whole sequence", error) <= OUT
        assert ours.lengths.tolist() == [16, 16]


@pytest.mark.parametrize("seed", range(8))
def test_streaming_llm_cache_matches_a_dense_mask(seed, torch, record_error):
    """KVCache(window=w, sink_tokens=n): key j visible when j < n or i - j < w (and j <= i),
    prompt then single tokens, against a dense softmax and torch SDPA with that mask; with
    gpt-oss sinks in half the cases."""
    g = np.random.default_rng(500 + seed)
    B, H_kv, group, d = int(g.integers(1, 3)), int(g.integers(1, 3)), int(g.integers(1, 3)), 6
    H, w, n = H_kv * group, int(g.integers(1, 6)), int(g.integers(0, 4))
    T, prompt = int(g.integers(12, 30)), int(g.integers(1, 10))
    q = g.standard_normal((B, H, T, d))
    k, v = g.standard_normal((2, B, H_kv, T, d))
    sinks = {"sinks": g.standard_normal(H)} if seed % 2 else {}
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & ((j < n) | (i - j < w))
    expected = dense_attention(q, k, v, allowed, d**-0.5, sinks=sinks.get("sinks"))
    if not sinks:
        oracle = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(allowed),
            enable_gqa=True,
        ).numpy()  # fmt: skip
        assert relative_error(expected, oracle) <= OUT
    whole = mha.scaled_dot_product_attention(q, k, v, causal=True, window=w, sink_tokens=n, **sinks)
    assert record_error("StreamingLLM whole sequence", relative_error(whole, expected)) <= OUT
    cache = mha.KVCache(B, H_kv, d, capacity=2, window=w, sink_tokens=n)
    bounds = [0, *range(prompt, T + 1)]
    for start, stop in pairwise(bounds):
        step = mha.scaled_dot_product_attention(
            *(a[:, :, start:stop] for a in (q, k, v)), cache=cache, causal=True, window=w,
            sink_tokens=n, **sinks,
        )  # fmt: skip
        error = relative_error(step, expected[:, :, start:stop])
        assert record_error("StreamingLLM cached decoding", error) <= OUT
    assert cache.lengths.tolist() == [T] * B


def test_streaming_llm_cache_stays_bounded(record_error):
    """300 tokens through KVCache(window=4, sink_tokens=2): the sinks and the window are held,
    not the sequence; the last step still equals the dense reference."""
    g = np.random.default_rng(77)
    T, w, n = 300, 4, 2
    q = g.standard_normal((1, 2, T, 4))
    k, v = g.standard_normal((2, 1, 2, T, 4))
    cache = mha.KVCache(1, 2, 4, window=w, sink_tokens=n)
    for t in range(T):
        step = mha.scaled_dot_product_attention(
            *(a[:, :, t : t + 1] for a in (q, k, v)), cache=cache, causal=True, window=w,
            sink_tokens=n,
        )  # fmt: skip
    assert cache.lengths.tolist() == [T] and cache.capacity <= 4 * (w + n)
    keys = np.r_[0:n, T - w : T]
    expected = dense_attention(q[:, :, -1:], k[:, :, keys], v[:, :, keys], True, 0.5)
    assert record_error("StreamingLLM cached decoding", relative_error(step, expected)) <= OUT
