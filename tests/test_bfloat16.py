"""bfloat16 and float16 as storage dtypes: accepted everywhere, computed in float32 tile by
tile, returned in their own dtype; a bfloat16 cache holds half of a float32 one's bytes;
bfloat16 torch tensors keep their bits through interop. The accuracy oracle is float64
attention on the same (rounded) inputs, and the bar is torch's own bfloat16 SDPA."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from support.configs import relative_error

import mha

ml_dtypes = pytest.importorskip("ml_dtypes")  # the test extra installs it
bf16 = np.dtype(ml_dtypes.bfloat16)


def exact(x):
    """The float64 values a low-precision array holds."""
    return np.asarray(x).astype(np.float64)


@pytest.mark.parametrize("seed", range(6))
def test_bfloat16_sdpa_is_no_less_accurate_than_torch_bfloat16(seed, torch, record_error):
    g = np.random.default_rng(seed)
    B, H, H_kv, L, S, d = 2, 4, (4, 2, 1)[seed % 3], int(g.integers(1, 40)), 0, 32
    S = L + int(g.integers(0, 200))
    q = g.standard_normal((B, H, L, d)).astype(bf16)
    k = (2 * g.standard_normal((B, H_kv, S, d))).astype(bf16)
    v = g.standard_normal((B, H_kv, S, d)).astype(bf16)
    causal = bool(seed % 2)
    ours = mha.scaled_dot_product_attention(q, k, v, causal=causal, max_memory=2**14)
    assert ours.dtype == bf16
    oracle = mha.scaled_dot_product_attention(exact(q), exact(k), exact(v), causal=causal)
    t = [torch.from_numpy(exact(x)).to(torch.bfloat16) for x in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(
        *t, is_causal=False, enable_gqa=True,
        attn_mask=torch.ones(L, S, dtype=torch.bool).tril(S - L) if causal else None,
    )  # fmt: skip
    theirs = expected.float().numpy()
    ours_error, torch_error = relative_error(exact(ours), oracle), relative_error(theirs, oracle)
    record_error("bfloat16 SDPA vs float64 oracle", ours_error)
    record_error("torch bfloat16 SDPA vs float64 oracle", torch_error)
    assert ours_error <= torch_error * 1.05 + 1e-7


def test_bfloat16_gradients_are_float32_gradients_rounded_once():
    g = np.random.default_rng(4)
    q = g.standard_normal((2, 4, 20, 32)).astype(bf16)
    k, v = ((2 * g.standard_normal((2, 2, 150, 32))).astype(bf16) for _ in range(2))
    grad = g.standard_normal((2, 4, 20, 32)).astype(bf16)
    _, backward = mha.scaled_dot_product_attention(q, k, v, causal=True, return_backward=True)
    grads = backward(grad)
    wide = [exact(x).astype(np.float32) for x in (q, k, v)]
    _, backward32 = mha.scaled_dot_product_attention(*wide, causal=True, return_backward=True)
    for name, expected in backward32(exact(grad).astype(np.float32)).items():
        assert grads[name].dtype == bf16
        rounded = expected.astype(bf16)  # the float32 gradient in bfloat16: half an ulp off
        assert np.array_equal(grads[name].view(np.uint16), rounded.view(np.uint16)) or (
            relative_error(exact(grads[name]), expected) <= 2**-8
        ), name


def test_bfloat16_keys_are_read_a_tile_at_a_time(warm_kernel):
    """The call's peak is its tiles' (per worker), whatever the number of keys: twice the
    keys, the same peak on one worker, at most a set of tiles more for each worker that
    joins (how many do depends on when the helpers wake), and far below a float32 copy of
    K (64 MiB at the longer length)."""
    g = np.random.default_rng(0)
    d = 64
    q = g.standard_normal((1, 1, 4, d)).astype(bf16)
    k, v = (g.standard_normal((1, 1, 2**18, d)).astype(bf16) for _ in range(2))

    def peak(S, workers):
        mha.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], workers=workers)  # set-up
        tracemalloc.start()
        out = mha.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], workers=workers)
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return traced, out

    (short, _), (long, out) = peak(2**17, 1), peak(2**18, 1)
    assert long < 1.2 * short + 2**20, (short, long)
    shared, both = peak(2**18, 2)
    assert shared < 2 * long + 2**20, (long, shared)
    assert max(long, shared) < 2**18 * d * 4 / 4, (long, shared)
    oracle = mha.scaled_dot_product_attention(exact(q), exact(k), exact(v))
    assert relative_error(exact(out), oracle) < 1e-2
    assert relative_error(exact(both), oracle) < 1e-2


def test_bfloat16_cache_takes_half_the_memory_and_decodes_like_the_whole_sequence():
    attention = mha.MultiHeadAttention(64, 8, num_kv_heads=2, rope_theta=1e4, dtype=bf16, seed=0)
    g = np.random.default_rng(1)
    x = g.standard_normal((2, 40, 64)).astype(bf16)
    cache = attention.new_cache(2, capacity=64)
    wide = attention.new_cache(2, capacity=64, dtype=np.float32)
    assert cache.dtype == bf16 and cache.compute_dtype == np.float32
    assert cache.nbytes * 2 == wide.nbytes == 2 * (2 * 2 * 64 * 8) * 4  # keys and values
    steps = [attention(x[:, :30], cache=cache)] + [
        attention(x[:, t : t + 1], cache=cache) for t in range(30, 40)
    ]
    decoded = np.concatenate(steps, axis=1)
    assert decoded.dtype == bf16
    whole = attention(x, mask=True)
    # the cache rounds keys and values to bfloat16 once; both stay within bfloat16's
    # resolution of the float64 computation on the same weights
    oracle = mha.MultiHeadAttention.from_spec(
        mha.LayerSpec(8, num_kv_heads=2, rope_theta=1e4),
        {name: exact(w) for name, w in attention.weights().items() if w is not None},
    )(exact(x), mask=True)
    assert relative_error(exact(whole), oracle) < 2e-2
    assert relative_error(exact(decoded), oracle) < 2e-2


def test_float16_and_bfloat16_caches_for_a_float32_module():
    attention = mha.MultiHeadAttention(16, 2, rope_theta=100.0, dtype=np.float32, seed=0)
    x = np.random.default_rng(2).standard_normal((1, 6, 16)).astype(np.float32)
    whole = attention(x, mask=True)
    for dtype in (np.float16, bf16):
        cache = attention.new_cache(1, dtype=dtype)
        out = attention(x, cache=cache)
        assert out.dtype == np.float32 and cache.k.dtype == dtype
        assert relative_error(out, whole) < 1e-2
    with pytest.raises(mha.errors.AttentionTypeError, match="bfloat16, computed in float32"):
        mha.MultiHeadAttention(16, 2, seed=0)(x.astype(np.float64), cache=cache)


def test_bfloat16_everywhere_returns_bfloat16():
    g = np.random.default_rng(3)
    attention = mha.MultiHeadAttention(8, 2, bias=True, qk_norm="head", dtype=bf16, seed=0)
    x = g.standard_normal((2, 5, 8)).astype(bf16)
    out, backward = attention(x, mask=True, return_backward=True)
    assert out.dtype == bf16
    grads = backward(np.ones_like(out))
    assert {g.dtype for g in grads.values()} == {bf16}
    q = g.standard_normal((1, 2, 3, 4)).astype(bf16)
    out, lse = mha.scaled_dot_product_attention(q, q, q, return_lse=True)
    assert out.dtype == bf16 and lse.dtype == np.float32
    mixed = mha.scaled_dot_product_attention(q, q.astype(np.float16), q)
    assert mixed.dtype == np.float32  # bfloat16 with float16: no common storage dtype
    assert mha.apply_rotary(q, np.arange(3)).dtype == bf16


def test_bfloat16_torch_tensors_keep_their_bits(torch):
    module = torch.nn.MultiheadAttention(8, 2, dtype=torch.bfloat16)
    with torch.no_grad():
        module.in_proj_weight.normal_()
    ours = mha.MultiHeadAttention.from_torch(module)
    assert ours.dtype == bf16
    bits = module.in_proj_weight.detach().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours.W_q.T.view(np.uint16), bits[:8])
    back = ours.to_torch()
    assert back.in_proj_weight.dtype == torch.bfloat16
    assert torch.equal(back.in_proj_weight, module.in_proj_weight)
    state = {f"{n}.weight": torch.randn(8, 8, dtype=torch.bfloat16) for n in
             ("q_proj", "k_proj", "v_proj", "o_proj")}  # fmt: skip
    llama = mha.MultiHeadAttention.from_llama(state, num_heads=2)
    assert llama.dtype == bf16
    bits = state["k_proj.weight"].view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(llama.W_k.T.view(np.uint16), bits)


def test_without_ml_dtypes_bfloat16_tensors_are_read_as_exact_float32(torch, monkeypatch):
    """ml_dtypes is what holds bfloat16 in NumPy; without it a bfloat16 tensor is read as the
    float32 numbers it holds (every bfloat16 is one), never rounded."""
    monkeypatch.setitem(__import__("sys").modules, "ml_dtypes", None)  # import fails
    state = {f"{n}.weight": torch.randn(8, 8, dtype=torch.bfloat16) for n in
             ("q_proj", "k_proj", "v_proj", "o_proj")}  # fmt: skip
    llama = mha.MultiHeadAttention.from_llama(state, num_heads=2)
    assert llama.dtype == np.float32
    np.testing.assert_array_equal(llama.W_q.T, state["q_proj.weight"].float().numpy())


def test_saved_files_keep_each_bfloat16_array(tmp_path):
    """The bits of every bfloat16 array, whatever the module's dtype; a .npy of bfloat16
    bits read back without its type is named as such."""
    attention = mha.MultiHeadAttention(8, 2, sinks=True, dtype=bf16, seed=0)
    attention.sinks = np.linspace(-1, 1, 2).astype(np.float32)  # a wider array beside them
    attention.save(tmp_path / "a.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "a.npz")
    assert loaded.dtype == np.float32  # the weights' common dtype, as when built from them
    for name, weight in attention.parameters().items():
        np.testing.assert_array_equal(getattr(loaded, name), exact(weight).astype(np.float32))
    raw = np.ones((2, 3, 8), bf16).view(np.dtype("V2"))
    with pytest.raises(mha.AttentionTypeError, match=r"as \.npy files keep bfloat16"):
        attention(raw)
