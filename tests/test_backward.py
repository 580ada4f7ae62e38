"""Gradients: the tiled backward pass against torch.autograd, finite differences and itself,
with every mask kind, and what it promises about hidden positions and bad input."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from support.configs import call_args, random_config, relative_error, with_dtype
from support.torch_oracle import gradient_oracle

import mha

r = np.random.default_rng(21)


def gradient_error(ours, expected, name):
    """Relative error of one gradient. ``b_k`` adds ``q . b_k`` to every key of a row, a
    shift the softmax ignores: its true gradient is exactly 0, so both sides are rounding
    noise, measured against the largest gradient of the call instead."""
    if name == "b_k":
        scale = max(float(np.abs(g).max(initial=0.0)) for g in expected.values()) or 1.0
        return float(np.abs(ours[name] - expected[name]).max()) / scale
    return relative_error(ours[name], expected[name])


@pytest.mark.parametrize("seed", range(80))
def test_gradients_match_autograd(seed, torch, record_error):
    config = random_config(4000 + seed)
    positional, keywords = call_args(config)
    out, backward = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_backward=True
    )
    grad = np.random.default_rng(seed).standard_normal(out.shape)
    expected = gradient_oracle(config, torch, grad)
    ours = backward(grad)
    assert set(ours) == set(expected)
    for name, value in expected.items():
        assert ours[name].shape == value.shape and ours[name].dtype == np.float64
        error = gradient_error(ours, expected, name)
        assert record_error("gradients vs autograd, float64", error) <= 1e-10, name
    single = with_dtype(config, np.float32)
    positional, keywords = call_args(single)
    keywords = {k: v for k, v in keywords.items() if k != "bias"} | (
        {"bias": config["kwargs"]["bias"]} if "bias" in config["kwargs"] else {}
    )
    _, backward32 = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_backward=True
    )
    ours32 = backward32(grad.astype(np.float32))
    for name in expected:
        if name == "bias":
            continue  # the bias keeps its float64 dtype: checked above
        assert ours32[name].dtype == np.float32
        error = gradient_error(ours32, expected, name)
        assert record_error("gradients vs autograd, float32", error) <= 1e-4, name


def explicit_attention(torch, q, k, v, allowed, scale, bias=None):
    """Attention with repeated key/value heads and an explicit mask, for autograd."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    logits = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        logits = logits + bias
    mask = torch.from_numpy(allowed)
    logits = torch.where(mask, logits, -math.inf)
    logits = torch.where(mask.any(-1, keepdim=True), logits, 0.0)
    return (torch.softmax(logits, -1) * mask) @ v


@pytest.mark.parametrize("seed", range(40))
def test_split_head_gradients_with_groups_and_windows_match_autograd(seed, torch, record_error):
    g = np.random.default_rng(500 + seed)
    B, H_kv, group = int(g.integers(1, 3)), int(g.integers(1, 3)), int(g.integers(1, 4))
    H, L, S, d = H_kv * group, int(g.integers(1, 30)), int(g.integers(1, 40)), int(g.integers(1, 9))
    q = g.standard_normal((B, H, L, d))
    k, v = g.standard_normal((2, B, H_kv, S, d))
    kw, allowed = {}, np.ones((B, H, L, S), bool)
    i, j = np.arange(L)[:, None], np.arange(S)
    if g.random() < 0.5:
        kw["causal"] = True
        allowed &= j <= i + S - L
    if g.random() < 0.4:
        kw["window"] = int(g.integers(1, S + 1))
        allowed &= (i + S - L) - j < kw["window"]
    if g.random() < 0.4:
        kw["key_lengths"] = g.integers(0, S + 1, B)
        allowed &= j < kw["key_lengths"][:, None, None, None]
    if g.random() < 0.3:
        kw["query_lengths"] = g.integers(0, L + 1, B)
        allowed &= i < kw["query_lengths"][:, None, None, None]
    if g.random() < 0.4:
        kw["mask"] = g.random((B, L, S)) < 0.8
        allowed &= kw["mask"][:, None]
    bias = None
    if g.random() < 0.5:
        bias = g.standard_normal((B, 1, L, S) if g.random() < 0.5 else (L, S))
        kw["bias"] = bias
    grad = g.standard_normal((B, H, L, d))
    out, backward = mha.scaled_dot_product_attention(
        q,
        k,
        v,
        return_backward=True,
        max_memory=2**13 if seed % 2 else 2**22,
        workers=1 + seed % 3,
        **kw,
    )
    tensors = {
        name: torch.tensor(x, requires_grad=True)
        for name, x in (("q", q), ("k", k), ("v", v))
        + ((("bias", bias),) if bias is not None else ())
    }
    expected = explicit_attention(
        torch,
        tensors["q"],
        tensors["k"],
        tensors["v"],
        allowed,
        1 / math.sqrt(d),
        tensors.get("bias"),
    )
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    assert set(ours) == set(tensors)
    for name, tensor in tensors.items():
        error = relative_error(ours[name], tensor.grad.numpy())
        assert record_error("split-head gradients vs autograd, float64", error) <= 1e-10, name


def test_a_decoder_layer_with_rotary_groups_and_a_window_matches_autograd(
    torch, transformers, record_error
):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attention = mha.MultiHeadAttention(
        24, 6, num_kv_heads=2, rope_theta=500.0, window=5, bias=True, seed=3
    )
    for name in ("b_q", "b_k", "b_v", "b_o"):
        setattr(attention, name, r.standard_normal(getattr(attention, name).shape))
    X = r.standard_normal((2, 9, 24))
    out, backward = attention(X, mask=True, return_backward=True)
    grad = r.standard_normal(out.shape)
    t = {name: torch.tensor(W, requires_grad=True) for name, W in attention.parameters().items()}
    x = torch.tensor(X, requires_grad=True)
    L, d = 9, 4
    inv = 1.0 / (500.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.arange(L, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)[None]  # (1, L, d): every sequence

    def heads(W, b, n):
        return (x @ t[W] + t[b]).reshape(2, L, n, d).transpose(1, 2)

    q, k = apply_rotary_pos_emb(
        heads("W_q", "b_q", 6), heads("W_k", "b_k", 2), emb.cos(), emb.sin()
    )
    i, j = np.arange(L)[:, None], np.arange(L)
    allowed = np.broadcast_to((j <= i) & (i - j < 5), (2, 6, L, L)).copy()
    heads_out = explicit_attention(torch, q, k, heads("W_v", "b_v", 2), allowed, 0.5)
    expected = heads_out.transpose(1, 2).reshape(2, L, 24) @ t["W_o"] + t["b_o"]
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    assert set(ours) == {*t, "query", "key", "value"}
    shared = ours["query"] + ours["key"] + ours["value"]  # one input, three roles
    assert (
        record_error("decoder layer gradients vs autograd", relative_error(shared, x.grad.numpy()))
        <= 1e-10
    )
    autograd = {n: v.grad.numpy() for n, v in t.items()}
    for name in t:
        error = gradient_error(ours, autograd, name)
        assert record_error("decoder layer gradients vs autograd", error) <= 1e-10, name


def test_torch_extra_keys_get_their_gradients(torch, record_error):
    module = torch.nn.MultiheadAttention(
        12, 3, add_bias_kv=True, add_zero_attn=True, batch_first=True, dtype=torch.float64
    )
    ours = mha.MultiHeadAttention.from_torch(module)
    X, M = r.standard_normal((2, 4, 12)), r.standard_normal((2, 6, 12))
    out, backward = ours(X, key=M, return_backward=True)
    grad = r.standard_normal(out.shape)
    x, m = torch.tensor(X, requires_grad=True), torch.tensor(M, requires_grad=True)
    expected = module(x, m, m, need_weights=False)[0]
    (expected * torch.from_numpy(grad)).sum().backward()
    grads = backward(grad)
    E = 12
    pairs = {
        "query": x.grad,
        "W_q": module.in_proj_weight.grad[:E].T,
        "W_k": module.in_proj_weight.grad[E : 2 * E].T,
        "W_v": module.in_proj_weight.grad[2 * E :].T,
        "W_o": module.out_proj.weight.grad.T,
        "b_q": module.in_proj_bias.grad[:E],
        "b_v": module.in_proj_bias.grad[2 * E :],
        "b_o": module.out_proj.bias.grad,
        "bias_k": module.bias_k.grad.reshape(-1),
        "bias_v": module.bias_v.grad.reshape(-1),
    }
    pairs["key"] = m.grad - torch.from_numpy(grads["value"])  # M was both key and value
    for name, value in pairs.items():
        error = relative_error(grads[name], value.numpy())
        assert record_error("extra keys' gradients vs nn.MultiheadAttention", error) <= 1e-10, name


def test_finite_differences_on_a_small_case():
    config = random_config(7, tiny=True)
    positional, keywords = call_args(config)
    names = ["Q", "K", "V", "W_q", "W_k", "W_v", "W_o"]
    arrays = dict(zip(names, positional, strict=True)) | {
        n: keywords.pop(n) for n in ("b_q", "b_k", "b_v", "b_o") if n in keywords
    }
    H = config["num_heads"]
    out, backward = mha.multi_head_attention(
        *positional,
        H,
        **keywords,
        **{n: arrays[n] for n in arrays if n.startswith("b_")},
        return_backward=True,
    )
    grad = np.random.default_rng(1).standard_normal(out.shape)
    grads = backward(grad)

    def loss(values):
        biases = {n: values[n] for n in values if n.startswith("b_")}
        result = mha.multi_head_attention(*(values[n] for n in names), H, **keywords, **biases)
        return float(np.sum(result * grad))

    for name, array in arrays.items():
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            step = 1e-6 * max(1.0, abs(array[index]))
            plus, minus = array.copy(), array.copy()
            plus[index] += step
            minus[index] -= step
            numeric[index] = (loss(arrays | {name: plus}) - loss(arrays | {name: minus})) / (
                2 * step
            )
        scale = max(float(np.abs(numeric).max()), 1e-3)
        assert float(np.abs(grads[name] - numeric).max()) / scale <= 1e-6, name


TILINGS = [(1, 2**12, 1), (3, 2**13, 2), (7, 2**14, 3), (16, 2**15, 2), (512, 2**30, 1)]


@pytest.mark.parametrize("seed", range(20))
def test_tiles_and_workers_change_gradients_only_by_rounding(seed, monkeypatch, tuned):
    tuned(serial_below=0)
    config = random_config(6000 + seed, long=True)
    positional, keywords = call_args(config)
    grad = None
    results = []
    for cols, budget, workers in TILINGS:
        tuned(key_tile=cols, wide_key_tile=cols)
        out, backward = mha.multi_head_attention(
            *positional,
            config["num_heads"],
            **keywords,
            return_backward=True,
            max_memory=budget,
            workers=workers,
        )
        if grad is None:
            grad = np.random.default_rng(seed).standard_normal(out.shape)
        results.append(backward(grad))
    scale = max(float(np.abs(g).max(initial=0.0)) for g in results[-1].values()) or 1.0
    for other in results[:-1]:
        for name, value in results[-1].items():  # against the largest gradient of the call
            assert float(np.abs(other[name] - value).max(initial=0.0)) / scale <= 1e-12, name


def test_hidden_positions_get_exactly_zero_gradient_and_never_nan():
    q = r.standard_normal((2, 2, 5, 4))
    k, v = r.standard_normal((2, 2, 2, 7, 4))
    k[0, :, 5:] = np.nan  # padded keys of sequence 0 (key_lengths 5)
    v[0, :, 5:] = np.inf
    mask = np.ones((2, 5, 7), bool)
    mask[1, :, 2] = False  # a masked key: NaN stored there too
    k[1, :, 2], v[1, :, 2] = np.nan, np.nan
    mask[1, 3] = False  # a fully masked row
    out, backward = mha.scaled_dot_product_attention(
        q, k, v, key_lengths=[5, 7], mask=mask, return_backward=True
    )
    grads = backward(r.standard_normal(out.shape))
    for name, g in grads.items():
        assert np.isfinite(g).all(), name
    assert np.all(grads["k"][0, :, 5:] == 0) and np.all(grads["v"][0, :, 5:] == 0)
    assert np.all(grads["k"][1, :, 2] == 0) and np.all(grads["v"][1, :, 2] == 0)
    assert np.all(grads["q"][1, :, 3] == 0)  # the row that sees nothing contributes nothing


def test_backward_can_be_called_again_and_from_threads():
    X = r.standard_normal((2, 6, 8))
    W = r.standard_normal((4, 8, 8))
    out, backward = mha.multi_head_attention(X, X, X, *W, 2, causal=True, return_backward=True)
    grad = r.standard_normal(out.shape)
    first = backward(grad)
    kept = X.copy()
    X[0, 0, 0] += 1.0  # the caller changed an input: refused, not silently wrong
    with pytest.raises(mha.AttentionValueError, match="Q, K, V changed after the forward pass"):
        backward(grad)
    X[:] = kept
    results = []
    threads = [threading.Thread(target=lambda: results.append(backward(grad))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for result in [backward(grad), *results]:
        for name in first:
            np.testing.assert_array_equal(result[name], first[name])
    doubled = backward(2 * grad)
    np.testing.assert_allclose(doubled["W_q"], 2 * first["W_q"], rtol=1e-13)


def test_bad_gradients_are_refused_with_their_shapes():
    q = r.standard_normal((1, 2, 3, 4))
    out, backward = mha.scaled_dot_product_attention(q, q, q, return_backward=True)
    with pytest.raises(
        mha.ShapeError,
        match=r"grad_out must have the output's shape \(1, 2, 3, 4\); got \(1, 2, 3\)",
    ):
        backward(np.ones((1, 2, 3)))
    with pytest.raises(mha.AttentionTypeError, match="grad_out has dtype complex128"):
        backward(np.ones(out.shape, complex))
    bad = np.ones(out.shape)
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(mha.AttentionValueError, match=r"grad_out holds 1 NaN or infinite value"):
        backward(bad)
    X = r.standard_normal((1, 3, 8))
    W = r.standard_normal((4, 8, 8))
    out, backward = mha.multi_head_attention(X, X, X, *W, 2, return_backward=True)
    with pytest.raises(mha.ShapeError, match=r"output's shape \(1, 3, 8\); got \(3, 8\)"):
        backward(np.ones((3, 8)))
    attention = mha.MultiHeadAttention(8, 2)
    cache = attention.new_cache(1)
    with pytest.raises(
        mha.AttentionValueError, match="return_backward and dropout are not available with cache="
    ):
        attention(X, cache=cache, return_backward=True)


def test_dropout_masks_match_in_both_passes_and_autograd(torch, record_error):
    from mha._kernel.dropout import Dropout

    B, H, L, S, d, p = 2, 3, 7, 9, 4, 0.3
    q = r.standard_normal((B, H, L, d))
    k, v = r.standard_normal((2, B, H, S, d))
    grad = r.standard_normal((B, H, L, d))
    outs = []
    for budget, workers in ((2**12, 1), (2**22, 2)):  # the mask does not depend on tiling
        out, backward = mha.scaled_dot_product_attention(
            q,
            k,
            v,
            causal=True,
            dropout_p=p,
            generator=np.random.default_rng(5),
            return_backward=True,
            max_memory=budget,
            workers=workers,
        )
        outs.append((out, backward(grad)))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-13, atol=1e-14)
    dropout = Dropout.draw(p, np.random.default_rng(5), H, L)  # the mask the call used
    keep = np.stack([dropout.scale(b, 0, H, 0, L, 0, S, np.float64) for b in range(B)])
    assert 0.5 < np.mean(keep > 0) < 0.9  # about 1 - p kept
    i, j = np.arange(L)[:, None], np.arange(S)
    allowed = np.broadcast_to(j <= i + S - L, (B, H, L, S)).copy()
    t = {name: torch.tensor(x, requires_grad=True) for name, x in (("q", q), ("k", k), ("v", v))}
    logits = (t["q"] @ t["k"].transpose(-1, -2) / 2.0).masked_fill(
        ~torch.from_numpy(allowed), -math.inf
    )
    expected = (torch.softmax(logits, -1) * torch.from_numpy(keep)) @ t["v"]
    (expected * torch.from_numpy(grad)).sum().backward()
    assert relative_error(outs[0][0], expected.detach().numpy()) <= 1e-12
    for name, tensor in t.items():
        error = relative_error(outs[0][1][name], tensor.grad.numpy())
        assert record_error("dropout gradients vs autograd", error) <= 1e-10, name
    with pytest.raises(mha.AttentionTypeError, match=r"dropout_p=0\.3 needs generator="):
        mha.scaled_dot_product_attention(q, k, v, dropout_p=p)
    with pytest.raises(mha.AttentionValueError, match="generator= is for dropout, but no"):
        mha.scaled_dot_product_attention(q, k, v, generator=np.random.default_rng(0))
    with pytest.raises(mha.AttentionValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        mha.scaled_dot_product_attention(q, k, v, dropout_p=1.0, generator=np.random.default_rng(0))


# ---------------------------------------------------------------- found in review


@pytest.mark.parametrize(
    "masking",
    [{"bias": "L,1"}, {"bias": "scalar"}, {"mask": "0-d"}, {"mask": "L,1"}, {"bias": "B,1,L,1"}],
)
def test_masks_and_biases_that_broadcast_over_keys(masking, torch):
    B, H, L, S, d = 2, 2, 5, 5, 4  # L == S: a wrong reshape would go unnoticed by shapes
    q, k, v = r.standard_normal((3, B, H, L, d))
    shapes = {"L,1": (L, 1), "B,1,L,1": (B, 1, L, 1)}
    kw, allowed, bias = {}, np.ones((B, H, L, S), bool), None
    if "bias" in masking:
        bias = 0.5 if masking["bias"] == "scalar" else r.standard_normal(shapes[masking["bias"]])
        kw["bias"] = bias
    else:
        mask = np.array(True) if masking["mask"] == "0-d" else r.random((L, 1)) < 0.6
        kw["mask"] = mask
        allowed &= np.broadcast_to(mask, allowed.shape)
    out, backward = mha.scaled_dot_product_attention(q, k, v, return_backward=True, **kw)
    grad = r.standard_normal(out.shape)
    t = {name: torch.tensor(x, requires_grad=True) for name, x in (("q", q), ("k", k), ("v", v))}
    t_bias = None if bias is None else torch.as_tensor(np.broadcast_to(bias, allowed.shape).copy())
    expected = explicit_attention(torch, t["q"], t["k"], t["v"], allowed.copy(), 0.5, t_bias)
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    for name in t:
        assert relative_error(ours[name], t[name].grad.numpy()) <= 1e-12, name
    if bias is not None:
        assert np.shape(ours["bias"]) == np.shape(bias)


def test_what_backward_reads_again_is_guarded_and_bounded():
    import tracemalloc

    empty, backward = mha.scaled_dot_product_attention(
        np.zeros((1, 2, 0, 4)),
        np.zeros((1, 2, 3, 4)),
        np.zeros((1, 2, 3, 4)),
        return_backward=True,
    )
    assert backward(np.zeros(empty.shape))["k"].shape == (1, 2, 3, 4)
    q = r.standard_normal((1, 2, 4, 8))
    out, backward = mha.scaled_dot_product_attention(q, q, q, return_backward=True)
    out += 1.0  # an in-place residual on the returned output
    with pytest.raises(mha.AttentionValueError, match="the returned output changed"):
        backward(np.ones(out.shape))
    H, L = 8, 2048
    q = r.standard_normal((1, H, L, 16)).astype(np.float32)
    out, backward = mha.scaled_dot_product_attention(
        q, q, q, bias=np.zeros((1, 1, 1, L), np.float32), return_backward=True
    )
    tracemalloc.start()
    grads = backward(np.ones_like(out))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert grads["bias"].shape == (1, 1, 1, L)
    assert peak < 3 * q.nbytes + 16 * 2**20  # never (H, L, S) for the bias gradient (128 MiB)


def test_positions_are_kept_and_padded_rows_never_poison_weight_gradients():
    X = r.standard_normal((2, 6, 8))
    W = r.standard_normal((4, 8, 8))
    positions = np.arange(6)
    out, backward = mha.multi_head_attention(
        X, X, X, *W, 2, rope_theta=100.0, positions=positions, causal=True, return_backward=True
    )
    grad = r.standard_normal(out.shape)
    first = backward(grad)
    positions += 7  # the caller reuses its array
    np.testing.assert_array_equal(backward(grad)["W_q"], first["W_q"])
    Q, K = r.standard_normal((2, 2, 5, 8))
    Q[0, 3:], K[1, 4:] = np.nan, np.inf  # padding, beyond query_lengths / key_lengths
    out, backward = mha.multi_head_attention(
        Q, K, K, *W, 2, query_lengths=[3, 5], key_lengths=[5, 4], return_backward=True
    )
    grads = backward(np.ones(out.shape))
    for name in ("W_q", "W_k", "W_v", "W_o"):
        assert np.isfinite(grads[name]).all(), name


def test_a_refused_call_does_not_draw_from_the_generator():
    attention = mha.MultiHeadAttention(8, 2)
    generator = np.random.default_rng(1)
    with pytest.raises(mha.AttentionValueError):
        attention(
            np.ones((1, 2, 8)), cache=attention.new_cache(1), dropout_p=0.1, generator=generator
        )
    assert generator.integers(2**63) == np.random.default_rng(1).integers(2**63)


# ---------------------------------------------------------------- zero-size inputs

SIZES = [(B, L, S) for B in (0, 2) for L in (0, 3) for S in (0, 4) if 0 in (B, L, S)]


@pytest.mark.parametrize(("B", "L", "S"), SIZES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_zero_size_gradients_are_zeros_of_the_right_shapes(B, L, S, dtype):
    """No sequences, no queries or no keys: a query that sees no key has a zero attention
    output, so the output is ``b_o`` on every row and only ``b_o`` gets a gradient (the sum
    of the output's gradient); every other gradient is zero, shaped like its array."""
    attention = mha.MultiHeadAttention(8, 2, bias=True, seed=0, dtype=dtype)
    for p in attention.parameters().values():
        p[...] = r.standard_normal(p.shape)  # biases that are not zero
    query, memory = r.standard_normal((B, L, 8)).astype(dtype), r.standard_normal((B, S, 8))
    calls = [{"key": memory.astype(dtype)}]
    if L == S:
        calls += [{"mask": True}, {"key_lengths": np.zeros(B, int), "query_lengths": [L] * B}]
    for kwargs in calls:
        out, backward = attention(query, return_backward=True, **kwargs)
        assert out.shape == (B, L, 8) and out.dtype == dtype
        np.testing.assert_array_equal(out, np.broadcast_to(attention.b_o, out.shape))
        grad = r.standard_normal(out.shape).astype(dtype)
        grads = backward(grad)
        given = {"query": query, "key": kwargs.get("key", query), "value": kwargs.get("key", query)}
        for name, array in {**given, **attention.parameters()}.items():
            assert grads[name].shape == array.shape and grads[name].dtype == dtype, name
            if name == "b_o":
                np.testing.assert_allclose(grads[name], grad.sum(axis=(0, 1)), rtol=1e-6)
            else:
                assert not grads[name].any(), name


@pytest.mark.parametrize(("B", "L", "S"), SIZES)
def test_zero_size_split_heads_and_every_projection_option(B, L, S):
    """The same through scaled_dot_product_attention (grouped heads, a bias) and
    multi_head_attention with grouped heads, rotary positions, a window, dropout and
    torch's extra keys: shapes and zeros wherever no query sees a key."""
    q, k = r.standard_normal((B, 4, L, 6)), r.standard_normal((B, 2, S, 6))
    bias = r.standard_normal((1, 4, L, S))
    out, lse, backward = mha.scaled_dot_product_attention(
        q, k, k, bias=bias, causal=True, return_lse=True, return_backward=True
    )
    assert out.shape == (B, 4, L, 6) and lse.shape == (B, 4, L) and not out.any()
    assert (lse == -np.inf).all()
    grads = backward(np.ones(out.shape))
    for name, array in (("q", q), ("k", k), ("v", k), ("bias", bias)):
        assert grads[name].shape == array.shape and not grads[name].any(), name
    Q, K = r.standard_normal((B, L, 8)), r.standard_normal((B, S, 8))
    W_q, W_k, W_v, W_o = (r.standard_normal(shape) for shape in ((8, 8), (8, 4), (8, 4), (8, 8)))
    bias_k, bias_v = r.standard_normal(4), r.standard_normal(4)
    options = [
        {"num_kv_heads": 1, "rope_theta": 10.0, "window": 2},
        {"num_kv_heads": 1, "dropout_p": 0.5, "generator": np.random.default_rng(0)},
        {"num_kv_heads": 1, "bias_k": bias_k, "bias_v": bias_v, "add_zero_attn": True},
    ]
    for kwargs in options:
        out, backward = mha.multi_head_attention(
            Q, K, K, W_q, W_k, W_v, W_o, 2, return_backward=True, **kwargs
        )
        assert out.shape == (B, L, 8)
        grads = backward(np.ones(out.shape))
        arrays = {"Q": Q, "K": K, "V": K, "W_q": W_q, "W_k": W_k, "W_v": W_v, "W_o": W_o}
        for name, array in arrays.items():
            assert grads[name].shape == array.shape, (name, kwargs)
            if "bias_k" not in kwargs or B * L == 0:  # the extra keys are seen by every query
                assert not grads[name].any(), (name, kwargs)
        if "bias_k" in kwargs:
            assert grads["bias_k"].shape == (4,) and grads["bias_v"].shape == (4,)
