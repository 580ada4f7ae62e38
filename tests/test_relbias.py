"""A learned relative-position bias (``mha.relative_position_bias``, given as ``score_mod=``):
T5's buckets and CPM-Ant's segment-aware ones against transformers' own code, the bias
against the same bias given dense, its table's gradient against torch.autograd, and decoding
with a cache against the whole sequence."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import mha

CONFIGS = ((32, 128), (8, 16), (32, 1000), (512, 2048))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_are_t5s(transformers: Any, torch: Any, bidirectional: bool) -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-30000, 30000)[None]
    for num_buckets, max_distance in CONFIGS:
        expected = T5Attention._relative_position_bucket(
            relative, bidirectional, num_buckets, max_distance
        ).numpy()
        got = mha.position_buckets(relative.numpy(), num_buckets, max_distance, bidirectional)
        assert (got == expected).all(), (num_buckets, max_distance)


def _cpmant_embedding(transformers: Any, torch: Any, H: int, buckets: int, segments: int) -> Any:
    from transformers.models.cpmant.modeling_cpmant import CpmAntSegmentPositionEmbedding

    config = transformers.CpmAntConfig(
        num_attention_heads=H,
        position_bias_num_buckets=buckets,
        position_bias_max_distance=40,
        segment_types=segments,
    )
    embedding = CpmAntSegmentPositionEmbedding(config).double()
    torch.manual_seed(0)
    with torch.no_grad():
        embedding.relative_attention_bias.normal_()
    return embedding


def test_segments_are_cpmants(transformers: Any, torch: Any) -> None:
    """CPM-Ant's bias of every query and key (its prompt in segment 0, text in 2, token id 0
    in 0) is what the kernel adds, tile by tile: the attention with it equals the attention
    with transformers' dense bias."""
    B, H, L, d, nb, ns = 2, 3, 45, 8, 16, 3
    embedding = _cpmant_embedding(transformers, torch, H, nb, ns)
    rng = np.random.default_rng(1)
    segments = np.where(rng.random((B, L)) < 0.3, 0, 2)
    segments[:, :6] = 0  # the prompt
    at = torch.arange(L).repeat(B, 1)
    seg = torch.tensor(segments)
    dense = embedding(at, at, seg, seg).detach().numpy()  # (B, H, L, L)
    table = embedding.relative_attention_bias.detach().numpy().T
    bias = mha.relative_position_bias(
        table, "segments", num_buckets=nb, max_distance=40, segments=segments, num_segments=ns
    )
    q, k, v = rng.standard_normal((3, B, H, L, d))
    expected = mha.scaled_dot_product_attention(q, k, v, bias=dense)
    got = mha.scaled_dot_product_attention(q, k, v, score_mod=bias, max_memory=20000)
    assert np.abs(got - expected).max() <= 1e-13


def _autograd(torch: Any, q: Any, k: Any, v: Any, table: Any, at: Any, causal: bool, g: Any) -> Any:
    T = torch.tensor(table, requires_grad=True)
    Q, K, V = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = Q @ K.transpose(-1, -2) / math.sqrt(q.shape[-1])
    index = torch.tensor(at)
    s = s + (T[:, index] if index.ndim == 2 else T[:, index].permute(1, 0, 2, 3))
    if causal:
        L = q.shape[-2]
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf)
    o = torch.softmax(s, -1) @ V
    (o * torch.tensor(g)).sum().backward()
    return o.detach().numpy(), {"q": Q.grad, "k": K.grad, "v": V.grad, "relative_bias": T.grad}


@pytest.mark.parametrize("law", ["bidirectional", "causal", "segments"])
def test_gradients_against_autograd(torch: Any, law: str) -> None:
    B, H, L, d, nb, ns = 2, 3, 37, 8, 8, 2
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, B, H, L, d))
    segments = rng.integers(0, ns, (B, L)) if law == "segments" else None
    T = nb + (ns * ns if segments is not None else 0)
    table = rng.standard_normal((H, T))
    bias = mha.relative_position_bias(
        table, law, num_buckets=nb, max_distance=20, segments=segments,
        num_segments=ns if segments is not None else None,
    )  # fmt: skip
    relative = np.arange(L)[None] - np.arange(L)[:, None]
    at = mha.position_buckets(relative, nb, 20, law != "causal")
    if segments is not None:
        sq, sk = segments[:, :, None], segments[:, None, :]
        at = np.where(sq == sk, at, nb + sq * ns + sk)  # (B, L, L)
    causal = law == "causal"
    out, backward = mha.scaled_dot_product_attention(
        q, k, v, score_mod=bias, causal=causal, return_backward=True, max_memory=30000
    )
    g = rng.standard_normal(out.shape)
    expected, grads = _autograd(torch, q, k, v, table, at, causal, g)
    assert np.abs(out - expected).max() <= 1e-12
    got = backward(g)
    assert sorted(got) == ["k", "q", "relative_bias", "v"]
    for name, grad in grads.items():
        assert np.abs(got[name] - grad.numpy()).max() <= 1e-10, name


@pytest.mark.parametrize("law", ["causal", "segments"])
def test_decoding_with_a_cache(law: str) -> None:
    """A layer's prefill and token-by-token decoding with the bias at the cached keys'
    positions equal its whole sequence; the layer's backward gives the table's gradient."""
    B, E, H, L, nb, ns = 2, 24, 4, 19, 16, 3
    rng = np.random.default_rng(3)
    layer = mha.MultiHeadAttention(E, H, seed=0)
    x = rng.standard_normal((B, L, E))
    segments = rng.integers(0, ns, (B, L)) if law == "segments" else None
    table = rng.standard_normal((H, nb + (ns * ns if segments is not None else 0)))
    bias = mha.relative_position_bias(
        table, law, num_buckets=nb, max_distance=40, segments=segments,
        num_segments=ns if segments is not None else None,
    )  # fmt: skip
    whole, backward = layer(x, causal=True, score_mod=bias, return_backward=True)
    assert "relative_bias" in backward(np.ones_like(whole))
    cache = layer.new_cache(B)
    steps = [layer(x[:, :7], cache=cache, score_mod=bias)]
    steps += [layer(x[:, t : t + 1], cache=cache, score_mod=bias) for t in range(7, L)]
    assert np.abs(np.concatenate(steps, axis=1) - whole).max() <= 1e-13


def _segmented(rng: np.random.Generator, H: int, B: int, L: int) -> Any:
    segments = rng.integers(0, 2, (B, L))
    table = rng.standard_normal((H, 16 + 4))
    return mha.relative_position_bias(
        table, "segments", num_buckets=16, max_distance=30, segments=segments, num_segments=2
    )


def test_grouped_heads_dask_and_paged_cache() -> None:
    """Grouped key/value heads (the table's rows are the query heads), Dask's blocks of
    sequences, queries and keys (each block's segments), and a paged cache."""
    B, H, H_kv, L, d = 2, 4, 2, 21, 8
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, H, L, d))
    k, v = rng.standard_normal((2, B, H_kv, L, d))
    bias = _segmented(rng, H, B, L)
    out = mha.scaled_dot_product_attention(q, k, v, score_mod=bias, max_memory=5000)
    segments = bias.segments
    at = mha.position_buckets(np.arange(L)[None] - np.arange(L)[:, None], 16, 30, True)
    sq, sk = segments[:, :, None], segments[:, None, :]
    dense = bias.table[:, np.where(sq == sk, at, 16 + sq * 2 + sk)].transpose(1, 0, 2, 3)
    k2, v2 = np.repeat(k, 2, 1), np.repeat(v, 2, 1)
    assert np.abs(out - mha.scaled_dot_product_attention(q, k2, v2, bias=dense)).max() <= 1e-14
    da = pytest.importorskip("dask.array")
    from mha import dask as mha_dask

    lazy = [da.from_array(x, chunks=(1, x.shape[1], n, d)) for x, n in ((q, 7), (k, 5), (v, 5))]
    got = mha_dask.scaled_dot_product_attention(*lazy, score_mod=bias).compute()
    assert np.abs(got - out).max() <= 1e-14
    E = 16
    layer = mha.MultiHeadAttention(E, H, seed=0)
    x = rng.standard_normal((B, L, E))
    whole = layer(x, causal=True, score_mod=bias)
    cache = mha.PagedKVCache(
        num_blocks=32, block_size=4, num_kv_heads=H, head_dim=4, dtype=np.float64
    )
    for sequence in range(B):
        cache.add(sequence)
    steps = [layer(x[:, :5], cache=cache, score_mod=bias)]
    steps += [layer(x[:, t : t + 1], cache=cache, score_mod=bias) for t in range(5, L)]
    assert np.abs(np.concatenate(steps, axis=1) - whole).max() <= 1e-14


def test_errors_name_the_argument() -> None:
    table = np.zeros((2, 8))
    with pytest.raises(mha.AttentionValueError, match="law must be one of"):
        mha.relative_position_bias(table, "alibi")
    with pytest.raises(mha.ShapeError, match="num_buckets"):
        mha.relative_position_bias(table, num_buckets=6)
    with pytest.raises(mha.AttentionValueError, match="segments= and num_segments="):
        mha.relative_position_bias(table, "segments")
    with pytest.raises(
        mha.AttentionValueError, match=r"segments must lie in \[0, num_segments=2\)"
    ):
        mha.relative_position_bias(
            np.zeros((2, 12)), "segments", num_buckets=8, segments=[0, 3], num_segments=2
        )
    q = np.zeros((1, 3, 4, 2))
    with pytest.raises(mha.ShapeError, match="holds 2 heads; the call has 3"):
        mha.scaled_dot_product_attention(q, q, q, score_mod=mha.relative_position_bias(table))
    short = mha.relative_position_bias(
        np.zeros((3, 12)), "segments", num_buckets=8, segments=[0, 1], num_segments=2
    )
    with pytest.raises(mha.AttentionValueError, match="segments holds the segment of 2"):
        mha.scaled_dot_product_attention(q, q, q, score_mod=short)
    with pytest.raises(mha.AttentionValueError, match="reaches position -2"):
        mha.scaled_dot_product_attention(q, q[:, :, :2], q[:, :, :2], score_mod=short)


# ------------------------------------------ CPM-Ant's attention, transformers' own code

P, CPM_BUCKETS, CPM_DISTANCE, CPM_SEGMENTS = 4, 16, 40, 3


def _cpmant(transformers: Any, torch: Any) -> Any:
    """A tiny random CPM-Ant in float64 (transformers' eager attention keeps float64)."""
    config = transformers.CpmAntConfig(
        vocab_size=61, hidden_size=48, num_attention_heads=4, dim_head=12, dim_ff=64,
        num_hidden_layers=2, position_bias_num_buckets=CPM_BUCKETS,
        position_bias_max_distance=CPM_DISTANCE, segment_types=CPM_SEGMENTS, prompt_types=3,
        prompt_length=P, init_std=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.CpmAntForCausalLM(config).double().eval()


def _cpmant_layer(model: Any, index: int) -> mha.MultiHeadAttention:
    """Layer ``index``'s attention as mha's layer: its four projections, no biases."""
    from mha.api.configuration import LayerSpec

    att = model.cpmant.encoder.layers[index].self_att.self_attention
    names = {"W_q": "project_q", "W_k": "project_k", "W_v": "project_v", "W_o": "attention_out"}
    weights = {w: getattr(att, m).weight.detach().numpy().T for w, m in names.items()}
    return mha.MultiHeadAttention.from_spec(LayerSpec(num_heads=4, head_dim=12), weights)


def _cpmant_inputs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CPM-Ant's segments and mask of the token ids ``ids (B, L)``, as its model's forward
    makes them: the prompt's ``P`` tokens prepended in segment 0, text in 2, token id 0 in 0;
    the last ``length`` text tokens (the nonzero ids' count) and the prompt visible."""
    B, L = ids.shape
    segments = np.concatenate([np.zeros((B, P), np.int64), np.where(ids != 0, 2, 0)], 1)
    length = (ids != 0).sum(-1)
    visible = np.concatenate([np.ones((B, P), bool), np.arange(L)[::-1] < length[:, None]], 1)
    return segments, visible[:, :, None] & visible[:, None, :]


def _recorded(model: Any) -> tuple[list[list[Any]], list[Any]]:
    calls: list[list[Any]] = [[] for _ in model.cpmant.encoder.layers]

    def hook(index: int) -> Any:
        def record(module: Any, args: Any, output: Any) -> None:
            calls[index].append((args[0].detach().numpy().copy(), output[0].detach().numpy()))

        return record

    handles = [
        layer.self_att.self_attention.register_forward_hook(hook(i))
        for i, layer in enumerate(model.cpmant.encoder.layers)
    ]
    return calls, handles


def _bias(model: Any, segments: np.ndarray) -> Any:
    table = model.cpmant.position_bias.relative_attention_bias.detach().numpy().T
    return mha.relative_position_bias(
        table, "segments", num_buckets=CPM_BUCKETS, max_distance=CPM_DISTANCE,
        segments=segments, num_segments=CPM_SEGMENTS,
    )  # fmt: skip


def test_cpmant_whole_sequence_and_decoding(transformers: Any, torch: Any) -> None:
    """Each layer's attention of CPM-Ant from its table (``cpmant.position_bias``, outside
    the layers) and the tokens' segments: a left-padded sequence whole (the mask of its
    padding given), then a prefill through the cache (bidirectional: ``causal=False``) and
    decoding token by token."""
    model = _cpmant(transformers, torch)
    calls, handles = _recorded(model)
    B, L, prefill = 2, 13, 6
    padded = torch.randint(1, 61, (B, L), generator=torch.Generator().manual_seed(0))
    padded[0, :3] = 0
    ids = torch.randint(1, 61, (B, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(padded)
        cache = transformers.DynamicCache(config=model.config)
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, L):  # CPM-Ant's forward takes the whole ids at each step
            model(ids[:, : t + 1], cache=cache, use_cache=True)
    for handle in handles:
        handle.remove()
    segments, mask = _cpmant_inputs(padded.numpy())
    decoded, _ = _cpmant_inputs(ids.numpy())
    worst = 0.0
    for index in range(2):
        layer = _cpmant_layer(model, index)
        (x, expected), (x0, e0), *steps = calls[index]
        got = layer(x, mask=mask, score_mod=_bias(model, segments))
        worst = max(worst, np.abs(got - expected).max() / np.abs(expected).max())
        bias = _bias(model, decoded)
        kv = layer.new_cache(B)
        prefilled = layer(x0, cache=kv, score_mod=bias, causal=False)
        worst = max(worst, np.abs(prefilled - e0).max() / np.abs(e0).max())
        assert len(steps) == L - prefill
        for x_t, e_t in steps:
            got = layer(x_t, cache=kv, score_mod=bias)
            worst = max(worst, np.abs(got - e_t).max() / np.abs(e_t).max())
    assert worst <= 1e-12


def test_cpmant_table_gradient(transformers: Any, torch: Any) -> None:
    """The gradients of the table, the input and the projections through transformers' own
    CpmAntAttention and CpmAntSegmentPositionEmbedding in float64, by torch.autograd."""
    model = _cpmant(transformers, torch)
    B, L = 2, 11
    ids = np.random.default_rng(4).integers(1, 61, (B, L))
    segments, mask = _cpmant_inputs(ids)
    S = P + L
    x = np.random.default_rng(5).standard_normal((B, S, 48))
    g = np.random.default_rng(6).standard_normal((B, S, 48))
    att = model.cpmant.encoder.layers[1].self_att.self_attention
    embedding = model.cpmant.position_bias
    model.zero_grad()
    X = torch.tensor(x, requires_grad=True)
    positions, seg = torch.arange(S).repeat(B, 1), torch.tensor(segments)
    out, _ = att(X, X, torch.tensor(mask), embedding(positions, positions, seg, seg))
    (out * torch.tensor(g)).sum().backward()
    layer = _cpmant_layer(model, 1)
    got, backward = layer(x, mask=mask, score_mod=_bias(model, segments), return_backward=True)
    assert np.abs(got - out.detach().numpy()).max() <= 1e-12
    grads = backward(g)
    grads["input"] = grads["query"] + grads["key"] + grads["value"]  # one shared input
    expected = {
        "relative_bias": embedding.relative_attention_bias.grad.numpy().T,
        "input": X.grad.numpy(),
        "W_q": att.project_q.weight.grad.numpy().T,
        "W_o": att.attention_out.weight.grad.numpy().T,
    }
    for name, grad in expected.items():
        assert np.abs(grads[name] - grad).max() <= 1e-10, name
