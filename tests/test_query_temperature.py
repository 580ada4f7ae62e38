"""A query temperature that grows with the position (Llama 4's ``attn_temperature_tuning``,
Ministral 3's ``llama_4_scaling_beta``): the scores of the query at position ``p`` times
``1 + beta * log(1 + floor((p + offset) / floor))``, the keyword ``query_temperature``.
Checked against torch written from transformers' definition (the queries scaled before the
attention), forward and backward (autograd), and through every path a call takes: the
compiled walk, a KV cache step by step, split keys and merged parts, float32 and bfloat16,
the layer with its saved files and spec, mha.dask."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.configs import relative_error
from support.extras import needs_numba
from support.torch_reference import rope

import mha
from mha._kernel import compiled, walk
from mha._kernel.call import KernelCall, Outputs
from mha._kernel.contract import ScoreShape, Visibility
from mha.api.spec import SdpaKeywords, check_sdpa

LLAMA4 = (0.1, 4.0, 1.0)  # (attn_scale, floor_scale, 1): transformers' Llama4TextAttention
MINISTRAL = (0.5, 3.0)  # (llama_4_scaling_beta, original_max_position_embeddings)


def factors(positions, beta, floor, offset=0.0):
    """The definition: transformers' ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``
    (Llama 4) and ``1 + beta * log(1 + floor(p / max_position_embeddings))`` (Ministral 3)."""
    return 1.0 + beta * np.log1p(np.floor((positions + offset) / floor))


def heads(seed, B=2, H=4, H_kv=2, L=9, S=21, d=8, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, d))
    k, v = rng.standard_normal((2, B, H_kv, S, d))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def torch_attention(torch, q, k, v, temperature, causal=True):
    """The queries at positions ``S - L + i`` (bottom-right, as a cache places them) times
    the temperature, then torch's attention (grouped heads repeated)."""
    L, S = q.shape[-2], k.shape[-2]
    t = torch.from_numpy(factors(np.arange(S - L, S), *temperature))[:, None]
    group = q.shape[-3] // k.shape[-3]
    k, v = (x.repeat_interleave(group, dim=-3) for x in (k, v))
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L) if causal else None
    return torch.nn.functional.scaled_dot_product_attention(q * t, k, v, attn_mask=mask)


@pytest.mark.parametrize("temperature", [LLAMA4, MINISTRAL], ids=["llama4", "ministral3"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_temperature_and_its_gradients_match_torch(torch, temperature, causal, record_error):
    q, k, v = heads(0)
    out, lse, backward = mha.scaled_dot_product_attention(
        q, k, v, causal=causal, query_temperature=temperature, return_lse=True,
        return_backward=True,
    )  # fmt: skip
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    expected = torch_attention(torch, *t, temperature, causal)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("query temperature vs torch", error) <= 1e-13
    grad = np.random.default_rng(1).standard_normal(out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    for name, tensor in zip("qkv", t, strict=True):
        error = relative_error(ours[name], tensor.grad.numpy())
        assert record_error("query temperature gradients vs autograd", error) <= 1e-10, name
    plain = mha.scaled_dot_product_attention(q, k, v, causal=causal, return_lse=True)[1]
    assert not np.allclose(lse, plain)  # the temperature reaches the scores


def test_float32_and_bfloat16_follow_float64(record_error):
    q, k, v = heads(2)
    exact = mha.scaled_dot_product_attention(q, k, v, causal=True, query_temperature=LLAMA4)
    single = mha.scaled_dot_product_attention(
        *(x.astype(np.float32) for x in (q, k, v)), causal=True, query_temperature=LLAMA4
    )
    assert single.dtype == np.float32
    assert record_error("query temperature, float32", relative_error(single, exact)) <= 1e-5
    ml_dtypes = pytest.importorskip("ml_dtypes")  # the test extra installs it
    bf16 = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    half = mha.scaled_dot_product_attention(*bf16, causal=True, query_temperature=LLAMA4)
    reference = mha.scaled_dot_product_attention(
        *(x.astype(np.float64) for x in bf16), causal=True, query_temperature=LLAMA4
    )
    assert relative_error(half.astype(np.float64), reference) <= 2e-2


def test_the_compiled_walk_takes_a_call_with_a_temperature():
    """The temperature is folded into the queries: the call the walks see is a plain one."""
    needs_numba(compiled.walk_available(), "the NumPy walk computes the call")
    q, k, v = heads(3)
    checked = check_sdpa(SdpaKeywords(causal=True, query_temperature=LLAMA4))
    scores = checked.spec.scores.fit(q.shape[-3], False)
    shape = ScoreShape(q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-2])
    visibility = Visibility.build(checked.spec.mask, checked.given.arrays, shape)
    call = KernelCall(q, k, v, visibility, 8**-0.5, scores)
    folded, t = call.folded()
    assert folded.scores is None and t is not None
    assert walk.forward_walkable(folded, Outputs(np.zeros_like(q))) is not None
    np.testing.assert_array_equal(q, heads(3)[0])  # the queries given are not changed


def test_a_cache_places_each_step_at_its_position(record_error):
    """Prefill then decoding steps through a KVCache equal the whole sequence: each step's
    query sits at the cache's length."""
    q, k, v = heads(4, L=21)
    whole = mha.scaled_dot_product_attention(q, k, v, causal=True, query_temperature=LLAMA4)
    cache = mha.KVCache(2, 2, 8)
    parts = [mha.scaled_dot_product_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6],
                                              cache=cache, query_temperature=LLAMA4)]  # fmt: skip
    for i in range(6, 21):
        step = slice(i, i + 1)
        parts.append(mha.scaled_dot_product_attention(
            q[:, :, step], k[:, :, step], v[:, :, step], cache=cache, query_temperature=LLAMA4,
        ))  # fmt: skip
    error = relative_error(np.concatenate(parts, axis=-2), whole)
    assert record_error("query temperature, cache steps vs whole", error) <= 1e-13


def test_split_keys_give_the_whole_call(record_error):
    """Decoding over many keys on two workers (split keys, merged by their log-sum-exps):
    the temperature is applied once, as in the call on one worker."""
    q, k, v = heads(5, B=1, H=2, H_kv=1, L=1, S=20000, d=64)  # one work item: keys split
    whole = mha.scaled_dot_product_attention(q, k, v, query_temperature=MINISTRAL, workers=1)
    split = mha.scaled_dot_product_attention(q, k, v, query_temperature=MINISTRAL, workers=2)
    assert record_error("query temperature, split keys", relative_error(split, whole)) <= 1e-13
    plain = mha.scaled_dot_product_attention(q, k, v, workers=2)
    assert not np.allclose(split, plain)  # position 19,999: a factor of 1 + 0.5 log(6667)


def layer(**options):
    return mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=7, query_temperature=LLAMA4,
                                  **options)  # fmt: skip


def test_the_layer_scales_its_queries_by_position(torch, record_error):
    attention = layer(rope_theta=100.0)
    X = np.random.default_rng(6).standard_normal((2, 11, 16))
    out = attention(X, mask=True)
    no_temperature = mha.MultiHeadAttention.from_spec(
        mha.LayerSpec(**{**vars(attention.spec), "query_temperature": None}), attention.weights()
    )
    q = (X @ attention.W_q).reshape(2, 11, 4, 4).transpose(0, 2, 1, 3)
    k = (X @ attention.W_k).reshape(2, 11, 2, 4).transpose(0, 2, 1, 3)
    v = (X @ attention.W_v).reshape(2, 11, 2, 4).transpose(0, 2, 1, 3)
    q, k = (rope(torch, torch.from_numpy(x), range(11), 100.0) for x in (q, k))
    heads_ = torch_attention(torch, q, k, torch.from_numpy(v), LLAMA4).numpy()
    expected = heads_.transpose(0, 2, 1, 3).reshape(2, 11, 16) @ attention.W_o
    assert record_error("query temperature, layer vs torch", relative_error(out, expected)) <= 1e-13
    assert not np.allclose(out, no_temperature(X, mask=True))
    cache = attention.new_cache(2)
    steps = [attention(X[:, :4], cache=cache)]
    steps += [attention(X[:, i : i + 1], cache=cache) for i in range(4, 11)]
    error = relative_error(np.concatenate(steps, axis=1), out)
    assert record_error("query temperature, layer cache steps", error) <= 1e-13


def test_the_layer_keeps_it_in_its_spec_files_and_repr(tmp_path):
    attention = layer()
    assert attention.spec.query_temperature == LLAMA4
    assert attention.variants()["query_temperature"] == LLAMA4
    assert "query_temperature=(0.1, 4.0, 1.0)" in repr(attention)
    path = tmp_path / "layer.npz"
    attention.save(path)
    loaded = mha.MultiHeadAttention.load(path)
    assert loaded.query_temperature == LLAMA4
    X = np.random.default_rng(8).standard_normal((1, 6, 16))
    np.testing.assert_array_equal(loaded(X, mask=True), attention(X, mask=True))
    again = mha.MultiHeadAttention.from_spec(attention.spec, attention.weights())
    np.testing.assert_array_equal(again(X, mask=True), attention(X, mask=True))


def test_mha_dask_computes_it_chunk_by_chunk(record_error):
    if os.environ.get("MHA_REQUIRE_DASK") != "1":
        pytest.importorskip("dask.array", reason="the dask extra is not installed")
    import dask.array as da

    import mha.dask

    q, k, v = heads(9, L=21, S=21)
    exact = mha.scaled_dot_product_attention(q, k, v, causal=True, query_temperature=LLAMA4)
    lazy = mha.dask.scaled_dot_product_attention(
        da.from_array(q, chunks=(1, 4, 5, 8)), k, v, causal=True, query_temperature=LLAMA4
    )
    error = relative_error(lazy.compute(scheduler="sync"), exact)
    assert record_error("query temperature, mha.dask", error) <= 1e-13


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0.1, mha.AttentionTypeError, "query_temperature must be"),
        ((0.1,), mha.AttentionTypeError, "query_temperature must be"),
        ((0.1, 4.0, 1.0, 2.0), mha.AttentionTypeError, "query_temperature must be"),
        (np.array([0.1, 4.0]), mha.AttentionTypeError, "query_temperature must be"),
        ((0.1, 0.0), mha.AttentionValueError, "query_temperature's floor"),
        ((float("nan"), 4.0), mha.AttentionValueError, "query_temperature's beta"),
        ((0.1, 4.0, "1"), mha.AttentionValueError, "query_temperature's offset"),
        ((True, 4.0), mha.AttentionValueError, "query_temperature's beta"),
    ],
)
def test_a_wrong_temperature_is_refused_by_name(value, error, match):
    q, k, v = heads(10)
    with pytest.raises(error, match=match):
        mha.scaled_dot_product_attention(q, k, v, query_temperature=value)
    with pytest.raises(error, match=match):
        mha.MultiHeadAttention(16, 4, query_temperature=value)
