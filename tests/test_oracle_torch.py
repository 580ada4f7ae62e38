"""mha against PyTorch on hundreds of random configurations, float64 and float32.

Every mask kind and their combinations, biases, L != S, different input widths, batch 1-8,
heads 1-16. The oracles are ``F.scaled_dot_product_attention`` with an explicit mask and
``torch.nn.MultiheadAttention`` with the weights copied in.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import call_args, random_config, relative_error, with_dtype
from support.torch_oracle import module_oracle, sdpa_oracle

import mha

SDPA_SEEDS = range(300)
MODULE_SEEDS = range(1000, 1150)
TOLERANCE = {np.float64: 1e-12, np.float32: 2e-5}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("seed", SDPA_SEEDS)
def test_matches_torch_sdpa(torch, record_error, seed, dtype):
    config = with_dtype(random_config(seed), dtype)
    expected_out, expected_weights = sdpa_oracle(config, torch)  # float64, from the same inputs
    positional, keywords = call_args(config)
    out, weights = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_weights=True
    )
    assert out.dtype == dtype and weights.dtype == dtype
    name = np.dtype(dtype).name
    assert (
        record_error(f"torch SDPA, output, {name}", relative_error(out, expected_out))
        <= (TOLERANCE[dtype])
    )
    assert (
        record_error(f"torch SDPA, weights, {name}", relative_error(weights, expected_weights))
        <= TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("seed", MODULE_SEEDS)
def test_matches_torch_multihead_attention_module(torch, record_error, seed, dtype):
    config = with_dtype(random_config(seed, torch_module_layout=True), dtype)
    expected_out, expected_weights, sees_a_key = module_oracle(config, torch)
    positional, keywords = call_args(config)
    out, weights = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_weights=True
    )
    # torch gives NaN for a query row that sees no key (in any head); the contract says
    # zero weights there, and a zero attention output for that head.
    rows = sees_a_key.all(axis=1)  # (B, L): every head of this row sees a key
    name = np.dtype(dtype).name
    assert (
        record_error(
            f"torch nn.MultiheadAttention, output, {name}",
            relative_error(out[rows], expected_out[rows]),
        )
        <= TOLERANCE[dtype]
    )
    visible = np.broadcast_to(sees_a_key[..., None], weights.shape)
    assert (
        record_error(
            f"torch nn.MultiheadAttention, weights, {name}",
            relative_error(weights[visible], expected_weights[visible]),
        )
        <= TOLERANCE[dtype]
    )
    assert np.all(weights[~visible] == 0)
    assert not np.isnan(out).any()


def random_heads_case(seed):
    """Split-head inputs with 0, 1 or 2 batch axes and every mask kind, for the public SDPA."""
    rng = np.random.default_rng(seed)
    batch = [(), (int(rng.integers(1, 4)),), (2, int(rng.integers(1, 3)))][seed % 3]
    H, L, S = int(rng.integers(1, 5)), int(rng.integers(1, 11)), int(rng.integers(1, 11))
    d_k, d_v = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    q = rng.standard_normal((*batch, H, L, d_k))
    k = rng.standard_normal((*batch, H, S, d_k))
    v = rng.standard_normal((*batch, H, S, d_v))
    kw = {}
    if rng.random() < 0.5:
        shape = [(L, S), (*batch, 1, L, S), (*batch, H, L, S), (S,)][int(rng.integers(4))]
        kw["mask"] = rng.random(shape) < 0.7
    if rng.random() < 0.4:
        kw["causal"] = True
        kw["causal_alignment"] = ("bottom_right", "top_left")[int(rng.integers(2))]
    if rng.random() < 0.4:
        kw["key_lengths"] = rng.integers(0, S + 1, size=batch)
    if rng.random() < 0.3:
        kw["query_lengths"] = rng.integers(0, L + 1, size=batch)
    if rng.random() < 0.3:
        bias = rng.standard_normal((*batch, H, L, S))
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        kw["bias"] = bias
    if rng.random() < 0.2:
        kw["scale"] = float(rng.uniform(0.1, 2.0))
    return q, k, v, kw


def torch_sdpa_oracle(q, k, v, kw, torch):
    """The same attention by torch, its visibility built here with torch operations."""
    L, S = q.shape[-2], k.shape[-2]
    tq, tk, tv = (torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in (q, k, v))
    allowed = torch.ones((*q.shape[:-1], S), dtype=torch.bool)
    if "mask" in kw:
        allowed = allowed & torch.from_numpy(kw["mask"])
    if kw.get("causal"):
        top_left = kw.get("causal_alignment") == "top_left"
        allowed = allowed & torch.tril(torch.ones(L, S, dtype=torch.bool), 0 if top_left else S - L)
    if "key_lengths" in kw:
        lengths = torch.as_tensor(kw["key_lengths"])[..., None, None, None]
        allowed = allowed & (torch.arange(S) < lengths)
    if "query_lengths" in kw:
        lengths = torch.as_tensor(kw["query_lengths"])[..., None, None, None]
        allowed = allowed & (torch.arange(L)[:, None] < lengths)
    bias = torch.from_numpy(kw["bias"]) if "bias" in kw else torch.zeros((), dtype=torch.float64)
    allowed = allowed & ~torch.isneginf(bias)
    additive = torch.where(allowed, bias, -float("inf"))
    scale = kw.get("scale", 1 / np.sqrt(q.shape[-1]))
    flat = lambda x: x.reshape(-1, *x.shape[-3:])  # noqa: E731  torch wants one batch axis
    out = torch.nn.functional.scaled_dot_product_attention(
        flat(tq), flat(tk), flat(tv), attn_mask=flat(additive.expand(allowed.shape)), scale=scale
    ).reshape((*q.shape[:-1], v.shape[-1]))
    weights = torch.softmax(tq @ tk.transpose(-1, -2) * scale + additive, dim=-1)
    sees = allowed.any(dim=-1, keepdim=True)
    return torch.where(sees, out, 0.0).numpy(), torch.where(sees, weights, 0.0).numpy()


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("seed", range(4000, 4150))
def test_public_sdpa_matches_torch(torch, record_error, seed, dtype):
    q, k, v, kw = random_heads_case(seed)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    expected_out, expected_weights = torch_sdpa_oracle(q, k, v, kw, torch)
    out, weights = mha.scaled_dot_product_attention(q, k, v, **kw, return_weights=True)
    name = np.dtype(dtype).name
    assert out.dtype == dtype
    assert (
        record_error(f"public SDPA vs torch, output, {name}", relative_error(out, expected_out))
        <= TOLERANCE[dtype]
    )
    assert relative_error(weights, expected_weights) <= TOLERANCE[dtype]


@pytest.mark.parametrize("seed", range(50))
def test_multi_head_attention_is_per_head_sdpa(seed):
    config = random_config(seed)
    positional, keywords = call_args(config)
    Q, K, V, W_q, W_k, W_v, W_o = positional
    a, H = config["arrays"], config["num_heads"]
    masking = {name: value for name, value in keywords.items() if not name.startswith("b_")}

    def heads(X, W, b):
        x = X @ W + a.get(b, 0.0)
        return np.moveaxis(x.reshape(*x.shape[:-1], H, -1), -2, -3)

    attended = mha.scaled_dot_product_attention(
        heads(Q, W_q, "b_q"), heads(K, W_k, "b_k"), heads(V, W_v, "b_v"), **masking
    )
    joined = np.moveaxis(attended, -3, -2).reshape(*attended.shape[:-3], Q.shape[-2], -1)
    expected = joined @ W_o + a.get("b_o", 0.0)
    out = mha.multi_head_attention(*positional, H, **keywords)
    assert relative_error(out, expected) <= 1e-13
