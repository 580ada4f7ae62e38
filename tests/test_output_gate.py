"""Output gates (Qwen3-Next, Qwen3.5, LFM3, Laguna): the joined heads times ``act(x @ W_g +
b_g)`` before ``W_o``, per element or per head, sigmoid or softplus. Checked against torch
written from the definition, forward and backward (autograd), and through every path a
layer takes: the module, a KV cache and a paged cache step by step, left padding, saved
files, the spec, mha.dask."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.configs import relative_error

import mha

B, L, E, H = 2, 7, 12, 3
KINDS = [(per_head, act) for per_head in (False, True) for act in ("sigmoid", "softplus")]
IDS = [f"{'head' if p else 'element'}-{a}" for p, a in KINDS]


def arrays(seed, per_head, dtype=np.float64):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((B, L, E))
    W = list(rng.standard_normal((4, E, E)) / np.sqrt(E))
    columns = H if per_head else E
    W_g, b_g = rng.standard_normal((E, columns)), rng.standard_normal(columns)
    return [a.astype(dtype) for a in (X, *W, W_g, b_g)]


def torch_gated(torch, t, per_head, act, memory=None):
    """The layer in torch from its definition (causal self-attention, or cross-attention
    over ``memory``), gated before ``W_o``."""
    source = t["X"] if memory is None else memory
    q = (t["X"] @ t["W_q"]).reshape(B, -1, H, E // H).transpose(1, 2)
    k, v = ((source @ t[n]).reshape(B, -1, H, E // H).transpose(1, 2) for n in ("W_k", "W_v"))
    causal = memory is None
    heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    z = t["X"] @ t["W_g"] + t["b_g"]
    g = torch.sigmoid(z) if act == "sigmoid" else torch.nn.functional.softplus(z)
    heads = heads.transpose(1, 2)  # (B, L, H, d)
    gated = heads * (g[..., None] if per_head else g.reshape(*g.shape[:-1], H, -1))
    return gated.reshape(B, -1, E) @ t["W_o"]


@pytest.mark.parametrize("rows", [4, 1000])
@pytest.mark.parametrize(("per_head", "act"), KINDS, ids=IDS)
def test_the_gate_made_by_blocks_of_rows_matches_torch(per_head, act, rows, torch, tuned):
    """Two workers share the gate's product by blocks of 4 rows (each gating its rows of the
    joined heads as it makes them) or, with too few rows to go round, by columns: torch's
    answer either way, and the same gradients; without a backward, in place, the gate made
    block by block in each worker's buffer."""
    tuned(matmul_rows=rows, matmul_max_rows=rows)
    X, W_q, W_k, W_v, W_o, W_g, b_g = arrays(2, per_head)
    given = dict(X=X, W_q=W_q, W_k=W_k, W_v=W_v, W_o=W_o, W_g=W_g, b_g=b_g)
    out, backward = mha.multi_head_attention(
        X, X, X, W_q, W_k, W_v, W_o, H, causal=True, W_g=W_g, b_g=b_g, output_gate=act,
        workers=2, return_backward=True,
    )  # fmt: skip
    t = {name: torch.tensor(a, requires_grad=True) for name, a in given.items()}
    expected = torch_gated(torch, t, per_head, act)
    assert relative_error(out, expected.detach().numpy()) <= 1e-13
    alone = mha.multi_head_attention(
        X, X, X, W_q, W_k, W_v, W_o, H, causal=True, W_g=W_g, b_g=b_g, output_gate=act,
        workers=2,
    )  # fmt: skip
    assert relative_error(alone, expected.detach().numpy()) <= 1e-13
    grad = np.random.default_rng(3).standard_normal(out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    assert relative_error(ours["W_g"], t["W_g"].grad.numpy()) <= 1e-10


@pytest.mark.parametrize(("per_head", "act"), KINDS, ids=IDS)
def test_the_gate_and_its_gradients_match_torch(per_head, act, torch, record_error):
    X, W_q, W_k, W_v, W_o, W_g, b_g = arrays(0, per_head)
    given = dict(X=X, W_q=W_q, W_k=W_k, W_v=W_v, W_o=W_o, W_g=W_g, b_g=b_g)
    out, backward = mha.multi_head_attention(
        X, X, X, W_q, W_k, W_v, W_o, H, causal=True, W_g=W_g, b_g=b_g, output_gate=act,
        return_backward=True,
    )  # fmt: skip
    t = {name: torch.tensor(a, requires_grad=True) for name, a in given.items()}
    expected = torch_gated(torch, t, per_head, act)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("output gate vs torch, float64", error) <= 1e-13
    grad = np.random.default_rng(1).standard_normal(out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    ours["X"] = ours["Q"] + ours["K"] + ours["V"]  # one input: the sum of its gradients
    for name in given:
        error = relative_error(ours[name], t[name].grad.numpy())
        assert record_error("output gate gradients vs autograd", error) <= 1e-10, name
    assert relative_error(out, mha.multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, H,
                                                        causal=True)) > 1e-3  # fmt: skip


def test_a_cross_attention_gate_reads_the_queries_inputs(torch):
    X, W_q, W_k, W_v, W_o, W_g, b_g = arrays(2, False)
    memory = np.random.default_rng(3).standard_normal((B, 9, E))
    out = mha.multi_head_attention(X, memory, memory, W_q, W_k, W_v, W_o, H, W_g=W_g, b_g=b_g)
    t = {n: torch.tensor(a) for n, a in dict(X=X, W_q=W_q, W_k=W_k, W_v=W_v, W_o=W_o,
                                              W_g=W_g, b_g=b_g).items()}  # fmt: skip
    expected = torch_gated(torch, t, False, "sigmoid", torch.tensor(memory))
    assert relative_error(out, expected.numpy()) <= 1e-13


@pytest.mark.parametrize(("per_head", "act"), KINDS, ids=IDS)
def test_the_module_gates_alike_with_caches_and_saved_files(per_head, act, tmp_path):
    layer = mha.MultiHeadAttention(E, H, output_gate=act, output_gate_per_head=per_head,
                                   bias=True, rope_theta=100.0, seed=0)  # fmt: skip
    assert layer.W_g.shape == (E, H if per_head else E) and layer.b_g.shape == (layer.W_g.shape[1],)
    layer.b_g[:] = np.random.default_rng(4).standard_normal(layer.b_g.shape)
    X = np.random.default_rng(5).standard_normal((B, L, E))
    whole = layer(X, True)
    weights = {k: v for k, v in layer.weights().items() if k not in ("sinks", "q_norm", "k_norm")}
    function = mha.multi_head_attention(X, X, X, num_heads=H, causal=True, rope_theta=100.0,
                                        output_gate=act, **weights)  # fmt: skip
    assert np.array_equal(whole, function)
    paged = mha.PagedKVCache(16, 2, H, E // H, dtype=np.float64)
    for cache in (layer.new_cache(B), paged):
        if isinstance(cache, mha.PagedKVCache):
            for s in range(B):
                cache.add(s)
        steps = [layer(X[:, :3], cache=cache)]
        steps += [layer(X[:, i : i + 1], cache=cache) for i in range(3, L)]
        assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-14
    path = os.path.join(tmp_path, "gated.npz")
    layer.save(path)
    loaded = mha.MultiHeadAttention.load(path)
    assert repr(loaded) == repr(layer) and np.array_equal(loaded(X, True), whole)
    rebuilt = mha.MultiHeadAttention.from_spec(layer.spec, layer.weights())
    assert np.array_equal(rebuilt(X, True), whole)
    grads = layer(X, True, return_backward=True)[1](np.ones_like(whole))
    assert grads["W_g"].shape == layer.W_g.shape and grads["b_g"].shape == layer.b_g.shape


def test_left_padded_rows_are_gated_by_their_own_inputs():
    """A left-padded prompt: each real row keeps its own gate (the rows move, the gate's
    inputs with them)."""
    layer = mha.MultiHeadAttention(E, H, output_gate="sigmoid", seed=1)
    X = np.random.default_rng(6).standard_normal((B, L, E))
    cache = layer.new_cache(B)
    out = layer(X, cache=cache, query_lengths=[L, 4], padding_side="left")
    alone = layer(X[1:, L - 4 :], True)
    assert relative_error(out[1, L - 4 :], alone[0]) <= 1e-14


def test_float32_gates_in_float32(record_error, torch):
    X, W_q, W_k, W_v, W_o, W_g, b_g = arrays(7, True, np.float32)
    out = mha.multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, H, causal=True, W_g=W_g,
                                   b_g=b_g, output_gate="softplus")  # fmt: skip
    assert out.dtype == np.float32
    t = {n: torch.tensor(a.astype(np.float64)) for n, a in dict(
        X=X, W_q=W_q, W_k=W_k, W_v=W_v, W_o=W_o, W_g=W_g, b_g=b_g).items()}  # fmt: skip
    expected = torch_gated(torch, t, True, "softplus").numpy()
    assert record_error("output gate vs torch, float32", relative_error(out, expected)) <= 1e-5


def test_mha_dask_gates_each_chunk_of_queries():
    if os.environ.get("MHA_REQUIRE_DASK") != "1":  # CI's full tier requires it
        pytest.importorskip("dask.array", reason="the dask extra is not installed")
    import dask.array as da

    import mha.dask

    X, W_q, W_k, W_v, W_o, W_g, b_g = arrays(8, False)
    X = np.concatenate([X] * 4, axis=1)  # 28 positions in chunks of 8
    exact = mha.multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, H, causal=True, W_g=W_g,
                                     b_g=b_g, output_gate="softplus")  # fmt: skip
    for chunks in ((1, 8, E), (B, 28, E)):
        lazy = mha.dask.multi_head_attention(
            da.from_array(X, chunks=chunks), X, X, W_q, W_k, W_v, W_o, H, causal=True,
            W_g=W_g, b_g=b_g, output_gate="softplus",
        )  # fmt: skip
        assert relative_error(lazy.compute(scheduler="sync"), exact) <= 1e-14


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"W_g": np.ones((E, 5))}, r"W_g must be \(d_q, H\*d_v\) = \(12, 12\)"),
        ({"W_g": np.ones((E, H)), "b_g": np.ones(E)}, r"b_g must have shape \(3,\)"),
        ({"b_g": np.ones(E)}, "b_g needs the gate's weights W_g"),
        ({"output_gate": "sigmoid"}, "output_gate='sigmoid' needs the gate's weights W_g"),
        ({"W_g": np.ones((E, E)), "output_gate": "relu"}, "output_gate must be one of"),
        ({"W_g": np.ones((E, E), complex)}, "W_g has dtype complex128"),
    ],
)
def test_mistakes_are_refused_by_name(keywords, message):
    X, W_q, W_k, W_v, W_o, *_ = arrays(9, False)
    with pytest.raises(mha.AttentionError, match=message):
        mha.multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, H, **keywords)
    with pytest.raises(mha.AttentionError, match="output_gate_per_head needs output_gate"):
        mha.MultiHeadAttention(E, H, output_gate_per_head=True)
    with pytest.raises(mha.AttentionError, match="go together"):
        mha.MultiHeadAttention.from_spec(mha.LayerSpec(num_heads=H), {
            "W_q": W_q, "W_k": W_k, "W_v": W_v, "W_o": W_o, "W_g": np.ones((E, E))})  # fmt: skip
