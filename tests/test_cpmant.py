"""Attention that is not causal through the KV cache (``causal=False`` or ``mask=False`` with
``cache=``, CPM-Ant's prefill): the new tokens see every cached key of their sequence and
every new one. Against a plain loop, against the same call without the cache (a prefill
is the whole attention), with the mask contract's pieces, a paged cache and a layer."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.integrations import readers


def _reference(q, k, v, bias=None):  # type: ignore[no-untyped-def]
    """A plain loop: softmax over every key of each query's row, plus ``bias``."""
    B, H, L, d = q.shape
    out = np.zeros((B, H, L, v.shape[-1]))
    lse = np.zeros((B, H, L))
    for b in range(B):
        for h in range(H):
            for i in range(L):
                s = [q[b, h, i] @ k[b, h, j] / math.sqrt(d) for j in range(k.shape[-2])]
                s = np.array(s) + (0.0 if bias is None else bias[b, h, i])
                m = s.max()
                p = np.exp(s - m)
                out[b, h, i] = p @ v[b, h] / p.sum()
                lse[b, h, i] = m + math.log(p.sum())
    return out, lse


def _chunks(L: int) -> list[tuple[int, int]]:
    cuts = [0, 5, 6, 9, L]
    return list(itertools.pairwise(cuts))


@pytest.mark.parametrize("spelling", [{"causal": False}, {"mask": False}])
def test_every_key_seen_against_a_plain_loop(spelling: dict[str, bool]) -> None:
    """A prefill and then calls of several tokens and of one: each sees its sequence's
    cached keys and every new key (after it too); the log-sum-exp, small tiles."""
    B, H, L, d = 2, 3, 13, 5
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, B, H, L, d))
    cache = mha.KVCache(B, H, d)
    for start, end in _chunks(L):
        x = (q[:, :, start:end], k[:, :, start:end], v[:, :, start:end])
        out, lse = mha.scaled_dot_product_attention(
            *x, cache=cache, return_lse=True, max_memory=600, **spelling
        )
        expected, expected_lse = _reference(x[0], k[:, :, :end], v[:, :, :end])
        assert np.abs(out - expected).max() <= 1e-14
        assert np.abs(lse - expected_lse).max() <= 1e-13
    default = mha.KVCache(B, H, d)  # without the keyword: causal, as before
    got = mha.scaled_dot_product_attention(q, k, v, cache=default)
    assert np.abs(got - mha.scaled_dot_product_attention(q, k, v, causal=True)).max() == 0


def test_prefill_is_the_whole_attention_with_the_mask_contract() -> None:
    """A score_mod (the segment bias), a mask and a bias over positions and ragged new
    tokens (query_lengths): a prefill equals the call without the cache, and the next
    call's rows equal the whole sequence's."""
    B, H, L, d, P = 2, 4, 11, 6, 7
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, B, H, L, d))
    segments = rng.integers(0, 2, (B, L))
    table = rng.standard_normal((H, 16 + 4))
    bias = mha.relative_position_bias(
        table, "segments", num_buckets=16, max_distance=30, segments=segments, num_segments=2
    )
    mask = rng.random((B, 1, L, L)) < 0.8
    mask[..., 0] = True
    dense = rng.standard_normal((B, H, L, L))
    keywords = {"score_mod": bias, "causal": False}
    whole = mha.scaled_dot_product_attention(q, k, v, mask=mask, bias=dense, **keywords)
    cache = mha.KVCache(B, H, d)
    cut = (slice(None), slice(None), slice(0, P))
    prefill = mha.scaled_dot_product_attention(
        q[cut], k[cut], v[cut], cache=cache, mask=mask[..., :P, :P], bias=dense[..., :P, :P],
        **keywords,
    )  # fmt: skip
    alone = mha.scaled_dot_product_attention(
        q[cut], k[cut], v[cut], mask=mask[..., :P, :P], bias=dense[..., :P, :P], **keywords
    )
    assert np.abs(prefill - alone).max() <= 1e-14
    rest = (slice(None), slice(None), slice(P, L))
    out = mha.scaled_dot_product_attention(
        q[rest], k[rest], v[rest], cache=cache, mask=mask[..., P:, :], bias=dense[..., P:, :],
        **keywords,
    )  # fmt: skip
    assert np.abs(out - whole[rest]).max() <= 1e-14
    ragged = mha.KVCache(B, H, d)  # sequence 1 takes 3 tokens of the 4 given
    got = mha.scaled_dot_product_attention(
        q[..., :4, :], k[..., :4, :], v[..., :4, :], cache=ragged, causal=False,
        query_lengths=[4, 3],
    )  # fmt: skip
    expected, _ = _reference(q[1:, :, :3], k[1:, :, :3], v[1:, :, :3])
    assert np.abs(got[1, :, :3] - expected[0]).max() <= 1e-14
    assert list(ragged.lengths) == [4, 3]


def test_split_key_decoding_over_a_long_cache() -> None:
    """Two new tokens over 20000 cached keys, split over workers (flash-decoding): each sees
    every key, the other new one's too, as the call without the cache computes them."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 2, 16))
    k, v = rng.standard_normal((2, 1, 2, 20002, 16))
    expected = mha.scaled_dot_product_attention(q, k, v, workers=1)
    for workers in (1, 3):
        cache = mha.KVCache(1, 2, 16, capacity=20002)
        held = np.array([20000])
        cache._append(k[..., :20000, :], v[..., :20000, :], held)  # the keys cached so far
        cache._commit(held)
        new = (k[..., 20000:, :], v[..., 20000:, :])
        got = mha.scaled_dot_product_attention(q, *new, cache=cache, causal=False, workers=workers)
        assert np.abs(got - expected).max() <= 1e-14


def test_a_layer_and_a_paged_cache() -> None:
    """A layer's ``mask=False`` over a contiguous and a paged cache: its prefill is its
    whole attention, and each later call sees every key so far."""
    B, E, H, L = 2, 16, 4, 10
    rng = np.random.default_rng(2)
    layer = mha.MultiHeadAttention(E, H, seed=0)
    x = rng.standard_normal((B, L, E))
    paged = mha.PagedKVCache(
        num_blocks=16, block_size=4, num_kv_heads=H, head_dim=4, dtype=np.float64
    )
    for sequence in range(B):
        paged.add(sequence)
    for cache in (layer.new_cache(B), paged):
        for start, end in _chunks(L):
            got = layer(x[:, start:end], cache=cache, mask=False)
            expected = layer(x[:, :end])[:, start:end]  # the whole prefix, no mask
            assert np.abs(got - expected).max() <= 1e-13


def test_a_window_cache_is_refused_by_name() -> None:
    q = np.zeros((1, 2, 3, 4))
    cache = mha.KVCache(1, 2, 4, window=8)
    with pytest.raises(mha.AttentionValueError, match="with cache= attends to every cached key"):
        mha.scaled_dot_product_attention(q, q, q, cache=cache, causal=False)
    plain = mha.KVCache(1, 2, 4)
    with pytest.raises(mha.AttentionValueError, match="a window hides keys by distance"):
        mha.scaled_dot_product_attention(q, q, q, cache=plain, causal=False, window=2)
    assert list(plain.lengths) == [0]


# ------------------------------------------- CPM-Ant read by mha.from_pretrained, its tiny model

B, L, PREFILL = 2, 24, 10


@functools.cache
def _oracle() -> dict[int, list[Any]]:
    """Each layer's calls in transformers' float64 CPM-Ant (support.pretrained_models.drive:
    the whole sequence, the prefill, each decoding step, its prompt prepended)."""
    return models.decoding_calls(models.transformers_model("cpmant"), B, L, PREFILL)


def _keywords(layer: Any, step: int) -> dict[str, Any]:
    """The segments and mask of drive's token ids: the whole sequence's, the prefill's, and
    each step's row over the positions so far."""
    ids = models.token_ids(64, B, L)
    inputs = layer.token_inputs(ids[:, : L if step == 0 else PREFILL + step - 1])
    if step > 1:
        inputs["mask"] = inputs["mask"][:, -1:]
    return dict(inputs)


def _errors(load: Any) -> list[float]:
    """Each layer's worst error: whole sequence, prefill through the cache, each step."""
    errors = []
    for index, calls in _oracle().items():
        layer = load(index)
        cache = layer.new_cache(B)
        (x, expected), *steps = calls
        worst = relative_error(layer(x, **_keywords(layer, 0)), expected)
        for step, (x, expected) in enumerate(steps, 1):
            out = layer(x, cache=cache, **_keywords(layer, step))
            worst = max(worst, relative_error(out, expected))
        errors.append(worst)
    return errors


def _load(index: int) -> Any:
    return mha.from_pretrained(models.saved("cpmant"), layer=index, dtype=np.float64)


def test_cpmant_matches_transformers(transformers: Any, record_error: Any) -> None:
    """Every layer of the tiny CPM-Ant (ids with a 0, which CPM-Ant takes for padding):
    its whole sequence, its prefill through the cache (bidirectional) and each step."""
    calls = _oracle()
    assert len(calls) == 3 and all(len(c) == 2 + L - PREFILL for c in calls.values())
    assert calls[0][0][0].shape == (B, 4 + L, 48) and (models.token_ids(64, B, L) == 0).any()
    layer = _load(0)
    assert isinstance(layer, mha.SegmentBiasAttention) and layer.relative_bias.shape == (4, 25)
    assert (layer.num_buckets, layer.max_distance, layer.num_segments) == (16, 40, 3)
    assert record_error("pretrained cpmant, float64", max(_errors(_load))) <= 1e-12
    (x, expected), *_ = calls[0]  # and the causal mask would not be CPM-Ant's
    causal = {**_keywords(layer, 0), "mask": True}
    assert relative_error(layer(x, **causal), expected) > 1e-4


@pytest.mark.parametrize(
    "change", [{"max_distance": 20}, {"num_buckets": 9, "num_segments": 4}, {"relative_bias": 0}]
)
def test_every_setting_read_matters(change: dict[str, Any], monkeypatch: Any, transformers: Any):
    """The buckets' distance, their number (the same table), the table: the comparison
    fails."""
    read = readers.layer_attention

    def layer_attention(source: Any, layer: Any, dtype: Any = None) -> Any:
        kind, settings, weights = read(source, layer, dtype)
        if "relative_bias" in change:
            return kind, settings, {**weights, "relative_bias": 0 * weights["relative_bias"]}
        return kind, {**settings, **change}, weights

    monkeypatch.setattr(readers, "layer_attention", layer_attention)
    assert min(_errors(_load)) > 1e-4


def test_cpmant_gradients(transformers: Any, torch: Any) -> None:
    """The layer's backward (the table's gradient among them) against torch.autograd through
    transformers' CpmAntAttention and CpmAntSegmentPositionEmbedding, in float64."""
    model = models.transformers_model("cpmant")
    layer = _load(1)
    ids = models.token_ids(64, B, 11)
    inputs = layer.token_inputs(ids)
    S = 4 + 11
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((2, B, S, 48))
    att = model.cpmant.encoder.layers[1].self_att.self_attention
    embedding = model.cpmant.position_bias
    model.zero_grad()
    X = torch.tensor(x, requires_grad=True)
    at, seg = torch.arange(S).repeat(B, 1), torch.tensor(inputs["segments"])
    out, _ = att(X, X, torch.tensor(inputs["mask"]), embedding(at, at, seg, seg))
    (out * torch.tensor(g)).sum().backward()
    got, backward = layer(x, **inputs, return_backward=True)
    assert np.abs(got - out.detach().numpy()).max() <= 1e-12
    grads = backward(g)
    expected = {
        "relative_bias": embedding.relative_attention_bias.grad.numpy().T,
        "query": X.grad.numpy(),
        "W_k": att.project_k.weight.grad.numpy().T,
        "W_o": att.attention_out.weight.grad.numpy().T,
    }
    grads["query"] = grads["query"] + grads.get("key", 0) + grads.get("value", 0)
    for name, grad in expected.items():
        assert np.abs(grads[name] - grad).max() <= 1e-10, name


def test_cpmant_errors_name_what_is_missing(transformers: Any) -> None:
    layer = _load(0)
    x = np.zeros((1, 3, 48))
    with pytest.raises(mha.AttentionValueError, match="pass segments="):
        layer(x)
    with pytest.raises(mha.AttentionValueError, match=r"SegmentBiasAttention\.from_pretrained"):
        mha.MultiHeadAttention.from_pretrained(models.saved("cpmant"), layer=0)
    with pytest.raises(mha.ShapeError, match="relative_bias must have shape"):
        mha.SegmentBiasAttention.from_spec(layer.spec, {**layer.weights(), "relative_bias": None})


def test_files_and_torch_refuse_the_layer_by_name(tmp_path: Any) -> None:
    """A saved file and torch's module have no place for the bias table: refused, naming it,
    nothing written."""
    layer = mha.SegmentBiasAttention(8, 2)
    with pytest.raises(mha.AttentionValueError, match="relative_bias and its buckets"):
        layer.save(tmp_path / "layer.npz")
    assert not any(tmp_path.iterdir())
    with pytest.raises(mha.AttentionValueError, match="relative-position bias by segment"):
        layer.to_torch()
