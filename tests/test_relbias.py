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
