"""The redesign's extension points, each used by a change written here as a test: an output
stage between the heads and ``W_o`` (a sigmoid gate), a selection of keys ahead of the walk
(top-k), a new change to the scores (a query temperature; a per-head temperature written
here, outside the package), a new kind of cache (fp8). Each is checked against a dense
reference written from its definition, forward and backward."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from support.configs import relative_error

import mha
from mha._kernel.backward import attend_backward
from mha._kernel.call import Gradients, KernelCall, Outputs
from mha._kernel.contract import MaskArrays, ScoreShape, Visibility
from mha._kernel.forward import attend
from mha._kernel.scores import Scores
from mha.api.checks import LayerArrays, LayerWeights, check_layer
from mha.api.projection import compute
from mha.api.spec import MhaKeywords, SdpaKeywords, check_mha, check_sdpa
from mha.api.split_heads import attention


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class SigmoidGate:
    """Qwen3-Next's output gate: the joined heads times ``sigmoid(X @ W_g)``, per element."""

    def __init__(self, W_g):
        self.W_g = W_g

    def forward(self, joined, inputs):
        gate = sigmoid(inputs.astype(joined.dtype) @ self.W_g)
        return joined * gate, (joined, gate, inputs)

    def backward(self, d_out, saved):
        joined, gate, inputs = saved
        d_logits = d_out * joined * gate * (1.0 - gate)
        rows = inputs.reshape(-1, inputs.shape[-1])
        d_weight = rows.T @ d_logits.reshape(-1, d_logits.shape[-1])
        return d_out * gate, d_logits @ self.W_g.T, {"W_g": d_weight}


def layer_arrays(seed, B=2, L=9, E=12, H=3):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((B, L, E))
    W = [rng.standard_normal((E, E)) / np.sqrt(E) for _ in range(4)]
    return X, W, rng.standard_normal((E, E)) / np.sqrt(E), rng.standard_normal((B, L, E))


def torch_layer(torch, X, W, H, W_g=None, mask=None):
    """The layer in torch from its definition: causal, with the gate when given."""
    B, L, E = X.shape
    q, k, v = ((X @ w).reshape(B, L, H, -1).transpose(1, 2) for w in W[:3])
    allowed = torch.tril(torch.ones(L, L, dtype=torch.bool))
    if mask is not None:
        allowed = allowed & mask
    heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    joined = heads.transpose(1, 2).reshape(B, L, E)
    if W_g is not None:
        joined = joined * torch.sigmoid(X @ W_g)
    return joined @ W[3]


def test_an_output_stage_between_the_heads_and_W_o(torch, record_error):
    X, W, W_g, grad = layer_arrays(0)
    checked = check_mha(MhaKeywords(causal=True, return_backward=True))
    checked = checked._replace(spec=replace(checked.spec, output=SigmoidGate(W_g)))
    call = check_layer(LayerArrays(X, X, X), LayerWeights(*W), 3, checked)
    out, backward = compute(call)
    ours = backward(grad)
    t = {
        name: torch.tensor(a, requires_grad=True)
        for name, a in (
            ("X", X),
            ("W_q", W[0]),
            ("W_k", W[1]),
            ("W_v", W[2]),
            ("W_o", W[3]),
            ("W_g", W_g),
        )
    }
    expected = torch_layer(torch, t["X"], [t[n] for n in ("W_q", "W_k", "W_v", "W_o")], 3, t["W_g"])
    (expected * torch.from_numpy(grad)).sum().backward()
    assert (
        record_error(
            "output stage (a gate) vs torch", relative_error(out, expected.detach().numpy())
        )
        <= 1e-12
    )
    assert ours["W_g"].shape == W_g.shape
    for name in ("W_q", "W_k", "W_v", "W_o", "W_g"):
        assert relative_error(ours[name], t[name].grad.numpy()) <= 1e-10, name
    dX = ours["Q"] + ours["K"] + ours["V"]  # one input: the sum of its three gradients
    assert relative_error(dX, t["X"].grad.numpy()) <= 1e-10
    plain = mha.multi_head_attention(X, X, X, *W, 3, causal=True)  # without the stage
    assert relative_error(out, plain) > 1e-3


class TopK:
    """Each query keeps the ``k`` keys of its largest scores among those before it (sparse
    top-k attention over causal keys)."""

    def __init__(self, k):
        self.k = k

    def select(self, q, k):
        scores = q @ np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3).swapaxes(-1, -2)
        causal = np.tril(np.ones(scores.shape[-2:], bool))
        scores = np.where(causal, scores, -np.inf)
        cut = -np.sort(-scores, axis=-1)[..., self.k - 1 : self.k]
        return (scores >= cut) & causal


def dense(q, k, v, allowed):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


@pytest.mark.parametrize("workers", [1, 2])
def test_a_selection_of_keys_ahead_of_the_walk(torch, workers, record_error):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 2, 4, 37, 16))
    selection = TopK(5)
    checked = check_sdpa(SdpaKeywords(causal=True, return_backward=True, workers=workers))
    checked = checked._replace(spec=replace(checked.spec, selection=selection))
    out, backward = attention(q, k, v, checked)
    allowed = selection.select(q, k) & np.tril(np.ones((37, 37), bool))
    assert (
        record_error("key selection (top-k) vs dense", relative_error(out, dense(q, k, v, allowed)))
        <= 1e-12
    )
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expected = sdpa(*t, attn_mask=torch.from_numpy(allowed))
    grad = rng.standard_normal(out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    for name, tensor in zip("qkv", t, strict=True):
        assert relative_error(ours[name], tensor.grad.numpy()) <= 1e-10, name
    assert np.count_nonzero(allowed[0, 0, -1]) == 5  # the last query kept 5 of its 37 keys
    cached = check_sdpa(SdpaKeywords(cache=mha.KVCache(2, 4, 16)))
    cached = cached._replace(spec=replace(cached.spec, selection=selection))
    with pytest.raises(mha.AttentionValueError, match="selection of keys"):
        attention(q, k, v, cached)


def with_temperature(checked, floor_scale, attn_scale):
    """``checked`` with Llama 4's query temperature in its spec's changes to the scores."""
    scores = replace(checked.spec.scores, temperature=(attn_scale, floor_scale, 1))
    return checked._replace(spec=replace(checked.spec, scores=scores))


def temperature(positions, floor_scale, attn_scale):
    """transformers' Llama4TextAttention: ``log(floor((p + 1) / floor_scale) + 1) *
    attn_scale + 1``."""
    return np.log(np.floor((positions + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_new_change_to_the_scores_a_query_temperature(torch, dtype, record_error):
    """Llama 4's temperature: each query's scores scaled by a function of its position, one
    class beside the scores' pipeline, folded into the queries by the kernel; the walks, the
    backward and the caches take it as they take the others."""
    rng = np.random.default_rng(2)
    B, H, H_kv, L, S, d = 2, 4, 2, 40, 70, 16
    q = rng.standard_normal((B, H, L, d)).astype(dtype)
    k, v = rng.standard_normal((2, B, H_kv, S, d)).astype(dtype)
    checked = with_temperature(
        check_sdpa(SdpaKeywords(causal=True, return_lse=True, return_backward=True)), 8.0, 0.1
    )
    out, lse, backward = attention(q, k, v, checked)
    t = [torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v)]
    factor = torch.from_numpy(temperature(np.arange(S - L, S), 8.0, 0.1))[:, None]
    keys = [x.repeat_interleave(H // H_kv, dim=1) for x in t[1:]]
    s = t[0] @ keys[0].transpose(-1, -2) / np.sqrt(d) * factor
    s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(S - L), -torch.inf)
    expected = torch.softmax(s, dim=-1) @ keys[1]
    tolerance = 1e-12 if dtype == np.float64 else 2e-6
    error = relative_error(out, expected.detach().numpy())
    assert record_error(f"query temperature vs torch, {np.dtype(dtype).name}", error) <= tolerance
    assert relative_error(lse, torch.logsumexp(s, -1).detach().numpy()) <= tolerance
    grad = rng.standard_normal(out.shape).astype(dtype)
    (expected * torch.from_numpy(grad.astype(np.float64))).sum().backward()
    ours = backward(grad)
    for name, tensor in zip("qkv", t, strict=True):
        assert relative_error(ours[name], tensor.grad.numpy()) <= 1e4 * tolerance, name
    q_all = np.concatenate([rng.standard_normal((B, H, S - L, d)).astype(dtype), q], axis=2)
    cache = mha.KVCache(B, H_kv, d, capacity=8, dtype=dtype)
    decoded = []
    for a, b in [(0, 30), *((i, i + 1) for i in range(30, S))]:  # prefill, then one at a time
        cached = with_temperature(check_sdpa(SdpaKeywords(cache=cache)), 8.0, 0.1)
        decoded.append(attention(q_all[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cached))
    assert relative_error(np.concatenate(decoded, axis=2)[:, :, S - L :], out) <= tolerance


def test_a_new_kind_of_cache_float8():
    """A float8 (e4m3) cache: one more kind of quantized pool (the quantization's encode and
    decode, and the cache's option). Each group of channels round-trips within its stated
    bound, the values read back are float8 numbers times the group's scale, and the cache
    keeps the guarantees of the others (a refused call changes nothing, forks copy on
    write), tested with them in test_paged.py."""
    from mha._kernel.quantized import FLOAT8_MAX, Quantization

    ml_dtypes = pytest.importorskip("ml_dtypes")
    kind = Quantization(bits=8, group=32, float8=True)
    rng = np.random.default_rng(3)
    for x in (rng.standard_normal((40, 2, 64)).astype(np.float32) * 3,
              rng.uniform(-60000, 60000, (5, 1, 64)).astype(np.float32),
              np.zeros((2, 1, 64), np.float32)):  # fmt: skip
        codes, scale, zero = kind.quantize(x)
        assert codes.dtype == np.uint8 and codes.shape == x.shape and not zero.any()
        back = kind.dequantize(codes, scale, zero)
        error = np.abs(back - x).reshape(*x.shape[:-1], -1, 32).max(axis=-1)
        assert (error <= kind.error_bound(x)).all()
        values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        assert np.isfinite(values).all() and np.abs(values).max() <= FLOAT8_MAX
    cache = mha.PagedKVCache(8, 16, 1, 32, quantize="fp8")
    cache.add("a")
    x = rng.standard_normal((1, 1, 20, 32)).astype(np.float32)
    mha.scaled_dot_product_attention(x, x, x, cache=cache)
    before = cache.dequantized("a")
    with pytest.raises(mha.AttentionValueError):  # a refused call: the cache unchanged
        mha.scaled_dot_product_attention(x, x, x, cache=cache, key_lengths=[20])
    for a, b in zip(cache.dequantized("a"), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert cache.bytes_per_token == 2 * (32 + 4)  # a byte a value, a scale and zero a group


@dataclass(frozen=True)
class HeadTemperature:
    """A change to the scores written here, outside the package: each head's scores times
    its own ``tau[h]``, derivative ``tau[h]`` (one class with ``apply``, as the pipeline's
    own transforms are: :mod:`mha._kernel.scores`)."""

    tau: np.ndarray
    nonlinear = True  # the backward takes its derivative
    compiled = False

    def apply(self, s, tile, derivative):
        n, w = tile.r1 - tile.r0, tile.c1 - tile.c0
        stacked = s.reshape(s.size // max(1, n * w), n, w)  # one (n, w) tile per query head
        factor = self.tau[tile.item.heads].astype(s.dtype)[:, None, None]
        stacked *= factor
        return np.broadcast_to(factor, stacked.shape) if derivative else None


def test_a_change_to_the_scores_written_outside_the_package(torch, record_error):
    """The pipeline takes a transform it has never seen: the kernel's walks forward and
    backward, against torch autograd (no file of the package changed)."""
    rng = np.random.default_rng(4)
    B, H, H_kv, L, S, d = 2, 4, 2, 30, 45, 8
    q = rng.standard_normal((B, H, L, d))
    k, v = rng.standard_normal((2, B, H_kv, S, d))
    tau = rng.uniform(0.5, 2.0, H)
    shape = ScoreShape((B,), H, L, S)
    visibility = Visibility.build(check_sdpa(SdpaKeywords(causal=True)).spec.mask,
                                  MaskArrays(), shape)  # fmt: skip
    call = KernelCall(q, k, v, visibility, d**-0.5, Scores((HeadTemperature(tau),)))
    outputs = Outputs(np.zeros((B, H, L, d)), lse=np.full((B, H, L), -np.inf))
    attend(call, outputs)
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    keys, values = (x.repeat_interleave(H // H_kv, dim=1) for x in t[1:])
    scores = (t[0] @ keys.transpose(-1, -2)) * d**-0.5 * torch.from_numpy(tau)[:, None, None]
    scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(S - L), -torch.inf)
    expected = torch.softmax(scores, -1) @ values
    error = relative_error(outputs.out, expected.detach().numpy())
    assert record_error("a transform written outside vs torch", error) <= 1e-13
    grad = rng.standard_normal(outputs.out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    grads = Gradients(np.zeros_like(q), np.zeros_like(k), np.zeros_like(v))
    attend_backward(call, outputs, grad, grads)
    for ours, tensor in zip((grads.dq, grads.dk, grads.dv), t, strict=True):
        assert relative_error(ours, tensor.grad.numpy()) <= 1e-10
