"""Decoding: grouped-query attention, rotary positions, sliding windows and the KV cache,
against Hugging Face transformers (Llama, Qwen2, Mistral) and PyTorch, in float64."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.configs import relative_error
from support.extras import needs_numba
from support.transformers_oracle import AttentionRecorder, attention_settings, tiny_model

import mha
from mha._kernel import forward as kernel
from mha._kernel import tasks as work_items

r = np.random.default_rng(9)


def layers(model):
    settings_ = attention_settings(model)
    state = model.state_dict()
    return [
        mha.MultiHeadAttention.from_llama(state, prefix=f"model.layers.{i}.self_attn.", **settings_)
        for i in range(len(model.model.layers))
    ]


MODELS = [
    ("llama", {}),
    ("qwen2", {}),
    ("mistral", {"sliding_window": 4}),
    ("llama", {"num_key_value_heads": 1}),
    ("mistral", {"sliding_window": 7}),
]


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize(("kind", "overrides"), MODELS)
@pytest.mark.parametrize("seed", range(2))
def test_whole_sequences_match_transformers(
    kind, overrides, seed, torch, transformers, record_error
):
    model = tiny_model(kind, seed, **overrides)
    recorder = AttentionRecorder(model)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        model(ids)
    recorder.close()
    for attention, calls in zip(layers(model), recorder.calls, strict=True):
        ((x, expected),) = calls
        error = relative_error(attention(x, mask=True), expected)
        assert record_error(f"transformers {kind} attention, float64", error) <= 1e-12


@pytest.mark.parametrize(("kind", "overrides"), MODELS)
def test_prefill_then_decoding_matches_transformers_cache(
    kind, overrides, torch, transformers, record_error
):
    """Prefill 6 tokens, then decode 7 one at a time, with transformers' DynamicCache (and
    its sliding-window layers for Mistral): every step's attention output compared."""
    model = tiny_model(kind, 3, **overrides)
    recorder = AttentionRecorder(model)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1)
    )
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :6], cache=cache, use_cache=True)
        for t in range(6, 13):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    recorder.close()
    for attention, calls in zip(layers(model), recorder.calls, strict=True):
        ours = attention.new_cache(2, capacity=4)  # small: it has to grow
        assert len(calls) == 8
        for x, expected in calls:
            error = relative_error(attention(x, cache=ours), expected)
            assert record_error(f"transformers {kind} cached decoding, float64", error) <= 1e-12
        assert ours.lengths.tolist() == [13, 13]


def test_rotary_matches_transformers_conventions(torch, transformers, record_error):
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

    for seed in range(10):
        g = np.random.default_rng(seed)
        B, H, L, d = 2, 3, int(g.integers(1, 9)), 2 * int(g.integers(2, 9))
        rotary_dim = 2 * int(g.integers(1, d // 2 + 1))
        theta = float(g.choice([10000.0, 500000.0, 1e6, 37.5]))
        x = g.standard_normal((B, H, L, d))
        positions = g.integers(0, 4000, size=(B, L))

        def angles(dim, theta=theta, positions=positions):
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            return torch.from_numpy(positions).double()[..., None] * inv  # (B, L, dim/2)

        # Llama / Qwen (rotate_half), and GPT-NeoX's partial rotary: the first rotary_dim
        # features go through apply_rotary_pos_emb, the rest pass, as GPTNeoXAttention does.
        for dim in (d, rotary_dim):
            freqs = angles(dim)
            emb = torch.cat((freqs, freqs), dim=-1)
            t = torch.from_numpy(x)
            rotated, _ = llama_rotary(t[..., :dim], t[..., :dim], emb.cos(), emb.sin())
            expected = torch.cat((rotated, t[..., dim:]), dim=-1).numpy()
            ours = mha.apply_rotary(x, positions, theta=theta, rotary_dim=dim)
            assert (
                record_error("rotary vs transformers (rotate_half)", relative_error(ours, expected))
                <= 1e-12
            )
        # GPT-J (rotate_every_two), (B, L, H, d) with its own partial rotary.
        freqs = angles(rotary_dim)
        t = torch.from_numpy(x.transpose(0, 2, 1, 3).copy())
        rotated = gptj_rotary(t[..., :rotary_dim], freqs.sin(), freqs.cos())
        expected = torch.cat((rotated, t[..., rotary_dim:]), dim=-1).numpy().transpose(0, 2, 1, 3)
        ours = mha.apply_rotary(x, positions, theta=theta, rotary_dim=rotary_dim, interleaved=True)
        assert record_error("rotary vs transformers (GPT-J)", relative_error(ours, expected)) <= (
            1e-12
        )
    one = mha.apply_rotary(x, positions[0], theta=theta)  # (L,) positions for every sequence
    np.testing.assert_array_equal(one[1], mha.apply_rotary(x[1], positions[0], theta=theta))


@pytest.mark.parametrize("seed", range(30))
def test_grouped_query_sdpa_matches_torch_enable_gqa(seed, torch, record_error):
    g = np.random.default_rng(100 + seed)
    B, H_kv, group = int(g.integers(1, 3)), int(g.integers(1, 4)), int(g.integers(1, 5))
    H, L, S, d = H_kv * group, int(g.integers(1, 20)), int(g.integers(1, 30)), int(g.integers(1, 9))
    q = g.standard_normal((B, H, L, d))
    k, v = g.standard_normal((2, B, H_kv, S, d))
    keywords = {}
    allowed = np.ones((B, 1, L, S), dtype=bool)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    if g.random() < 0.6:
        keywords["causal"] = True
        allowed &= j <= i + (S - L)
    if g.random() < 0.5:
        keywords["window"] = int(g.integers(1, S + 1))
        allowed &= (i + (S - L)) - j < keywords["window"]
    if g.random() < 0.5:
        keywords["key_lengths"] = g.integers(0, S + 1, size=B)
        allowed &= j < keywords["key_lengths"][:, None, None, None]
    for dtype, tolerance in (("float64", 1e-12), ("float32", 2e-6)):
        ours = mha.scaled_dot_product_attention(*(a.astype(dtype) for a in (q, k, v)), **keywords)
        mask = torch.from_numpy(allowed)
        expected = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=mask, enable_gqa=True
        ).numpy()
        expected = np.where(allowed.any(axis=-1, keepdims=True), expected, 0.0)
        error = relative_error(ours, expected)
        assert record_error(f"SDPA GQA vs torch enable_gqa, {dtype}", error) <= tolerance
    _, weights = mha.scaled_dot_product_attention(q, k, v, return_weights=True, **keywords)
    repeated = torch.from_numpy(k).repeat_interleave(group, dim=1)  # transformers' repeat_kv
    logits = torch.from_numpy(q) @ repeated.transpose(-1, -2) / math.sqrt(d)
    expected = torch.softmax(logits.masked_fill(~torch.from_numpy(allowed), -math.inf), dim=-1)
    expected = torch.nan_to_num(expected, nan=0.0).numpy()  # rows that see no key: zeros
    assert weights.shape == (B, H, L, S)  # per query head
    assert record_error(
        "SDPA GQA weights vs torch, float64", relative_error(weights, expected)
    ) <= (1e-12)


# ---------------------------------------------------------------- the cache's promises


def decoder(**overrides):
    settings_ = {"num_kv_heads": 2, "rope_theta": 10000.0, "seed": 5} | overrides
    return mha.MultiHeadAttention(24, 6, **settings_)


@pytest.mark.parametrize("window", [None, 3])
def test_ragged_batch_decodes_as_each_sequence_alone(window):
    attention = decoder(window=window)
    prompts = [r.standard_normal((5, 24)), r.standard_normal((2, 24)), r.standard_normal((4, 24))]
    steps = [r.standard_normal((3, 1, 24)) for _ in range(6)]
    batch = np.zeros((3, 5, 24))
    for b, prompt in enumerate(prompts):
        batch[b, : len(prompt)] = prompt
    batch[1, 2:] = np.nan  # padding rows are never read
    cache = attention.new_cache(3, capacity=2)
    together = [attention(batch, cache=cache, query_lengths=[5, 2, 4])]
    together += [attention(step, cache=cache) for step in steps]
    assert cache.lengths.tolist() == [11, 8, 10]
    assert np.all(together[0][1, 2:] == 0.0)  # padding rows: zero attention, no bias
    for b, prompt in enumerate(prompts):
        alone = attention.new_cache(1)
        first = attention(prompt[None], cache=alone)
        np.testing.assert_allclose(together[0][b, : len(prompt)], first[0], rtol=1e-13, atol=1e-14)
        for t, step in enumerate(steps):
            out = attention(step[b : b + 1], cache=alone)
            np.testing.assert_allclose(together[t + 1][b], out[0], rtol=1e-13, atol=1e-14)


def test_truncate_then_decode_equals_never_having_decoded():
    attention = decoder()
    prompt, accepted, rejected = (r.standard_normal((2, n, 24)) for n in (6, 2, 3))
    reference = attention.new_cache(2)
    attention(prompt, cache=reference)
    expected = attention(accepted, cache=reference)
    speculative = attention.new_cache(2)
    attention(prompt, cache=speculative)
    attention(rejected, cache=speculative)  # speculative tokens, then rejected
    speculative.truncate(6)
    np.testing.assert_array_equal(attention(accepted, cache=speculative), expected)
    with pytest.raises(mha.AttentionValueError, match="truncate only shortens"):
        speculative.truncate(9)


def test_reorder_equals_decoding_the_reordered_batch():
    attention = decoder()
    x = r.standard_normal((3, 4, 24))
    step = r.standard_normal((3, 1, 24))
    order = [2, 0, 0]
    cache = attention.new_cache(3)
    attention(x, cache=cache)
    cache.reorder(order)
    reordered = attention.new_cache(3)
    attention(x[order], cache=reordered)
    np.testing.assert_array_equal(attention(step, cache=cache), attention(step, cache=reordered))
    with pytest.raises(mha.AttentionValueError, match=r"indices must lie in \[0, 3\)"):
        cache.reorder([0, 3])


def _unchanged(cache, before):
    for was, now in zip(before, snapshot(cache), strict=True):
        np.testing.assert_array_equal(was, now)


def test_the_cache_state_is_read_only_and_changes_only_through_checked_methods():
    attention = decoder()
    cache = attention.new_cache(2)
    attention(r.standard_normal((2, 4, 24)), cache=cache)
    before = snapshot(cache)
    for name in ("lengths", "first", "k", "v"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(cache, name)[...] = 100
        with pytest.raises(AttributeError):
            setattr(cache, name, np.zeros(2, int))
    _unchanged(cache, before)
    with pytest.raises(mha.AttentionTypeError, match="lengths must be an integer or 2 integers"):
        cache.truncate([1, 2, 3])
    with pytest.raises(mha.AttentionValueError, match="lengths must be >= 0"):
        cache.truncate([-1, 2])
    with pytest.raises(mha.AttentionValueError, match="sequence 1 to 5: it holds 4 tokens"):
        cache.truncate([3, 5])
    _unchanged(cache, before)


def test_truncate_per_sequence_equals_never_having_decoded():
    """Each sequence rolled back to its own length (speculative decoding accepts a different
    number of draft tokens per sequence) is the cache that never saw the rejected ones."""
    attention = decoder(window=5)
    prompt, drafts, step = (r.standard_normal((2, n, 24)) for n in (6, 3, 1))
    speculative = attention.new_cache(2)
    attention(prompt, cache=speculative)
    attention(drafts, cache=speculative)
    speculative.truncate([8, 6])  # sequence 0 keeps 2 drafts, sequence 1 none
    assert speculative.lengths.tolist() == [8, 6]
    got = attention(step, cache=speculative)
    for b, keep in enumerate((2, 0)):
        alone = attention.new_cache(1)
        attention(prompt[b : b + 1], cache=alone)
        if keep:
            attention(drafts[b : b + 1, :keep], cache=alone)
        np.testing.assert_allclose(got[b], attention(step[b : b + 1], cache=alone)[0],
                                   rtol=1e-13, atol=1e-14)  # fmt: skip


def test_reorder_takes_indices_in_range_only():
    """One rule, stated and enforced: indices in [0, B); a negative one does not wrap round."""
    attention = decoder()
    cache = attention.new_cache(2)
    attention(r.standard_normal((2, 3, 24)), cache=cache)
    before = snapshot(cache)
    for indices in ([-1, 0], [0, 2], [0, -3]):
        with pytest.raises(mha.AttentionValueError, match=r"indices must lie in \[0, 2\)"):
            cache.reorder(indices)
    _unchanged(cache, before)


def test_a_window_per_call_combines_with_the_modules():
    """forward(window=) as on every entry point; with the module's own window both hold
    (AND), so the narrower one counts."""
    x = r.standard_normal((2, 9, 24))
    plain, windowed = decoder(), decoder(window=5)
    weights = [plain.W_q, plain.W_k, plain.W_v, plain.W_o]
    options = {"num_kv_heads": 2, "rope_theta": 10000.0, "b_q": plain.b_q, "b_k": plain.b_k,
               "b_v": plain.b_v, "b_o": plain.b_o}  # fmt: skip
    for window in (1, 3, 5, 7):
        expected = mha.multi_head_attention(x, x, x, *weights, 6, causal=True, window=window,
                                            **options)  # fmt: skip
        np.testing.assert_array_equal(plain(x, True, window=window), expected)
        narrower = min(window, 5)
        expected = mha.multi_head_attention(x, x, x, *weights, 6, causal=True, window=narrower,
                                            **options)  # fmt: skip
        np.testing.assert_array_equal(windowed(x, True, window=window), expected)
    with pytest.raises(mha.AttentionValueError, match="window must be a positive integer"):
        plain(x, window=0)
    # with a cache: a call attends within the cache's window or a narrower one
    for module, window in ((plain, 3), (windowed, 3), (windowed, 5), (plain, None)):
        cache = module.new_cache(2, capacity=2)
        steps = [module(x[:, :4], cache=cache, window=window)]
        steps += [module(x[:, t : t + 1], cache=cache, window=window) for t in range(4, 9)]
        np.testing.assert_allclose(np.concatenate(steps, axis=1), module(x, True, window=window),
                                   rtol=1e-12, atol=1e-13)  # fmt: skip
    cache = windowed.new_cache(2)
    windowed(x[:, :4], cache=cache)
    before = snapshot(cache)
    with pytest.raises(mha.AttentionValueError, match="window=5 but the cache keeps only what"):
        windowed.forward(x[:, 4:5], cache=mha.KVCache(2, 2, 4, window=3), window=None)
    _unchanged(cache, before)
    # the function, like the core, attends within a window cache's window when given none
    other = windowed.new_cache(2)
    windowed(x[:, :4], cache=other)
    new = x[:, 4:5]
    got = mha.multi_head_attention(new, new, new, *weights, 6, cache=cache, **options)
    want = mha.multi_head_attention(new, new, new, *weights, 6, cache=other, window=5, **options)
    np.testing.assert_array_equal(got, want)


def test_dropout_p_zero_with_a_generator_is_no_dropout():
    """``dropout_p=p if training else 0.0`` with one generator, as torch and Flax take it:
    no dropout, and the generator is not drawn from. A generator without any dropout_p is
    still refused."""
    x = r.standard_normal((2, 5, 24))
    attention = decoder()
    generator = np.random.default_rng(7)
    state = generator.bit_generator.state
    np.testing.assert_array_equal(attention(x, True, dropout_p=0.0, generator=generator),
                                  attention(x, True))  # fmt: skip
    q = r.standard_normal((2, 3, 5, 8))
    np.testing.assert_array_equal(
        mha.scaled_dot_product_attention(q, q, q, dropout_p=0.0, generator=generator),
        mha.scaled_dot_product_attention(q, q, q),
    )
    assert generator.bit_generator.state == state
    out, backward = attention(x, True, dropout_p=0.0, generator=generator, return_backward=True)
    assert set(backward(np.ones_like(out))) >= {"query", "W_q"}
    with pytest.raises(mha.AttentionValueError, match="generator= is for dropout"):
        attention(x, generator=generator)
    with pytest.raises(mha.AttentionTypeError, match=r"generator must be a np\.random\.Generator"):
        attention(x, dropout_p=0.0, generator=7)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=6),
    st.sampled_from([None, 1, 2, 5]),
    st.integers(1, 3),
    st.integers(0, 2**16),
)
def test_decoding_in_random_chunks_equals_one_call(chunks, window, group, seed):
    g = np.random.default_rng(seed)
    attention = mha.MultiHeadAttention(
        12, 3 * group, num_kv_heads=3, head_dim=4, rope_theta=100.0, window=window, seed=seed
    )
    x = g.standard_normal((2, sum(chunks), 12))
    whole = attention(x, mask=True)
    cache = attention.new_cache(2, capacity=1)
    pieces, at = [], 0
    for n in chunks:
        pieces.append(attention(x[:, at : at + n], cache=cache))
        at += n
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, rtol=1e-12, atol=1e-13)


def test_the_window_bounds_the_cache_and_the_work(monkeypatch):
    attention = decoder(window=8)
    cache = attention.new_cache(1, capacity=4)
    x = r.standard_normal((1, 60, 24))
    outputs = [attention(x[:, t : t + 1], cache=cache) for t in range(60)]
    assert cache.capacity <= 16 and cache.lengths.tolist() == [60]
    np.testing.assert_allclose(
        np.concatenate(outputs, 1), attention(x, mask=True), rtol=1e-12, atol=1e-13
    )
    visited = []
    original = kernel._QueryTile.run

    def counting(tile):
        visited.append((tile.r1 - tile.r0) * (tile.stop - tile.start))
        return original(tile)

    monkeypatch.setattr(kernel._QueryTile, "run", counting)
    L, window = 4096, 64
    q = r.standard_normal((1, 1, L, 8))
    mha.scaled_dot_product_attention(q, q, q, causal=True, window=window, workers=1)
    tile = kernel.plan_tiles(L, L, 1, 8, 8, 8, kernel.DEFAULT_MAX_MEMORY).rows
    assert sum(visited) <= L * (window + tile)  # O(L·window), not O(L²)


def test_split_key_decoding_equals_one_worker(torch, record_error):
    q = r.standard_normal((1, 8, 1, 32))
    k, v = r.standard_normal((2, 1, 2, 20000, 32))
    one = mha.scaled_dot_product_attention(q, k, v, workers=1)
    split = mha.scaled_dot_product_attention(q, k, v, workers=3)
    assert relative_error(split, one) <= 1e-14
    tasks = [work_items.Task((0,), slice(0, 1), None, 0, 1, 0, 20000)]
    parts = work_items.split_keys(tasks, 3, 8192, 4, 1, 32, np.float64)  # a wide tile's keys
    assert parts is not None and len(parts.tasks) == 3  # the keys really are split
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), enable_gqa=True
    ).numpy()
    assert record_error("split-key decoding vs torch", relative_error(split, expected)) <= 1e-12


def test_grouped_queries_never_repeat_the_keys(warm_kernel):
    S, H_kv, group, d = 16384, 4, 8, 64
    k, v = (np.ones((1, H_kv, S, d), np.float32) for _ in range(2))
    q = np.ones((1, H_kv * group, 1, d), np.float32)
    tracemalloc.start()
    mha.scaled_dot_product_attention(q, k, v, workers=1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < k.nbytes / 2  # repeating the keys for the 8 query heads would take 8x


# ---------------------------------------------------------------- refused calls


def snapshot(cache):
    return [a.copy() for a in (cache.k, cache.v, cache.lengths, cache.first)]


def test_refused_calls_name_both_sides_and_leave_the_cache_unchanged():
    attention = decoder()
    cache = attention.new_cache(2)
    attention(r.standard_normal((2, 3, 24)), cache=cache)
    before = snapshot(cache)
    other = mha.MultiHeadAttention(24, 6, num_kv_heads=3, rope_theta=1e4)
    x = r.standard_normal((2, 1, 24))
    float32 = np.zeros((3, 2, 2, 1, 4), np.float32)
    cases = [
        (
            lambda: attention(r.standard_normal((3, 1, 24)), cache=cache),
            mha.ShapeError,
            r"batch 3, 2 key/value heads.*do not fit the cache \(batch 2, 2 key/value heads",
        ),
        (lambda: other(x, cache=cache), mha.ShapeError, r"3 key/value heads.*do not fit"),
        (
            lambda: mha.scaled_dot_product_attention(*float32, cache=cache),
            mha.AttentionTypeError,
            r"the cache holds float64 but this call computes in float32",
        ),
        (  # a mask over positions: after the append each sequence holds 4 keys, not 5
            lambda: attention(x, np.ones((1, 5), bool), cache=cache),
            mha.ShapeError,
            r"mask of shape \(1, 5\) does not broadcast to the scores' shape .* = \(2, 6, 1, 4\)",
        ),
        (
            lambda: attention(x, cache=cache, key_lengths=[1, 1]),
            mha.AttentionValueError,
            r"key_lengths cannot be combined",
        ),
        (
            lambda: attention(x, cache=cache, return_weights=True),
            mha.AttentionValueError,
            r"cache= cannot be combined with return_weights",
        ),
        (
            lambda: attention(x, cache=cache, causal=True, causal_alignment="top_left"),
            mha.AttentionValueError,
            r"top_left' cannot be used with cache=",
        ),
        (
            lambda: attention(x, cache=cache, positions=[0]),
            mha.AttentionValueError,
            r"positions= \(the cache's lengths give the positions\)",
        ),
        (lambda: attention(x[0], cache=cache), mha.AttentionValueError, r"unbatched inputs"),
        (
            lambda: attention(x, cache=cache, query_lengths=[2, 1]),
            mha.AttentionValueError,
            r"query_lengths must be <= 1",
        ),
        (
            lambda: decoder(window=4)(x, cache=mha.KVCache(2, 2, 4, window=2)),
            mha.AttentionValueError,
            r"window=4 but the cache keeps only what window=2 needs",
        ),
        (
            lambda: attention(x, cache="cache"),
            mha.AttentionTypeError,
            r"cache must be an mha.KVCache",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
        for a, b in zip(snapshot(cache), before, strict=True):
            np.testing.assert_array_equal(a, b)


def test_options_without_their_feature_are_refused():
    x = r.standard_normal((1, 3, 8))
    W = r.standard_normal((4, 8, 8))
    with pytest.raises(mha.AttentionValueError, match="positions= has no effect without rope"):
        mha.multi_head_attention(x, x, x, *W, 2, positions=[0, 1, 2])
    with pytest.raises(mha.AttentionValueError, match="rotary_dim has no effect without rope"):
        mha.multi_head_attention(x, x, x, *W, 2, rotary_dim=2)
    with pytest.raises(mha.AttentionValueError, match="have no effect without rope_theta"):
        mha.MultiHeadAttention(8, 2, rotary_interleaved=True)
    with pytest.raises(mha.ShapeError, match="3 key/value heads do not divide 4 query heads"):
        mha.scaled_dot_product_attention(np.ones((4, 2, 2)), np.ones((3, 2, 2)), np.ones((3, 2, 2)))
    with pytest.raises(mha.AttentionValueError, match=r"cannot hold this attention .*grouped"):
        decoder().to_torch_state_dict()


def test_from_llama_refuses_missing_misshapen_and_unknown_keys(torch):
    state = {
        f"p.{name}.weight": torch.zeros(shape)
        for name, shape in (
            ("q_proj", (8, 8)),
            ("k_proj", (4, 8)),
            ("v_proj", (4, 8)),
            ("o_proj", (8, 8)),
        )
    }
    loaded = mha.MultiHeadAttention.from_llama(state, num_heads=4, num_kv_heads=2, prefix="p.")
    assert loaded.W_k.shape == (8, 4) and loaded.rope_theta == 10000.0
    cases = [
        (
            {k: v for k, v in state.items() if "v_proj" not in k},
            r"no 'p.v_proj.weight' of shape \(4, 8\)",
        ),
        (
            state | {"p.k_proj.weight": torch.zeros(8, 8)},
            r"p.k_proj.weight has shape \(8, 8\); expected \(4, 8\)",
        ),
        (
            state | {"p.q_norm.weight": torch.zeros(8)},
            r"the attention at 'p.' has weights mha's Llama layout does not support: "
            r"q_norm.weight \(QK-norm, as in Qwen3",
        ),
        (
            state | {"p.sinks": torch.zeros(4), "p.k_norm.weight": torch.zeros(2)},
            r"does not support: k_norm.weight \(QK-norm[^)]*\); loading",
        ),
        (
            state
            | {"p.rotary_emb.inv_freq": torch.zeros(1), "p.q_proj.lora_A.weight": torch.zeros(1)},
            r"does not support: q_proj\.lora_A\.weight \(a LoRA adapter: merge it",
        ),
        (
            state | {"p.o_proj.bias": torch.zeros(3)},
            r"p.o_proj.bias has shape \(3,\); expected \(8,\)",
        ),
    ]
    for bad, message in cases:
        with pytest.raises(mha.AttentionError, match=message):
            mha.MultiHeadAttention.from_llama(bad, num_heads=4, num_kv_heads=2, prefix="p.")
    # older checkpoints' rotary buffer is derived from the config: read past, as transformers does
    with_buffer = state | {"p.rotary_emb.inv_freq": torch.zeros(2)}
    mha.MultiHeadAttention.from_llama(with_buffer, num_heads=4, num_kv_heads=2, prefix="p.")
    # a prefix that names no attention module says which one to give
    model = {f"model.layers.{i}.self_attn.{k[2:]}": v for i in range(3) for k, v in state.items()}
    for prefix, message in (
        ("model.layers.0.self_attn", r"give prefix='model.layers.0.self_attn.' \(a prefix ends"),
        ("", r"it holds 3 attention modules under 'model.layers.0.self_attn.', 'model.layers.1"),
        ("model.layers.7.self_attn.", r"no 'model.layers.7.self_attn.q_proj.weight'; it holds 3"),
        ("p.", r"no 'p.q_proj.weight'; it holds 3 attention modules"),
    ):
        with pytest.raises(mha.AttentionValueError, match=message):
            mha.MultiHeadAttention.from_llama(model, num_heads=4, num_kv_heads=2, prefix=prefix)
    with pytest.raises(mha.AttentionValueError, match=r"no q_proj\.weight under any prefix"):
        mha.MultiHeadAttention.from_llama({"a.weight": torch.zeros(1)}, num_heads=4)


def test_a_saved_decoder_loads_back_exactly(tmp_path):
    attention = decoder(window=5, head_dim=3, rotary_dim=2)
    attention.b_q = r.standard_normal(18)  # Qwen2-like: some biases only
    path = tmp_path / "decoder.npz"
    attention.save(path)
    loaded = mha.MultiHeadAttention.load(path)
    assert repr(loaded) == repr(attention)
    x = r.standard_normal((2, 4, 24))
    np.testing.assert_array_equal(loaded(x, mask=True), attention(x, mask=True))


# ---------------------------------------------------------------- the example


def test_the_command_line_takes_a_window(tmp_path):
    from test_cli import mha_command

    Q, W = r.standard_normal((2, 6, 8)), r.standard_normal((4, 8, 8))
    np.savez(tmp_path / "in.npz", Q=Q, K=Q, V=Q, W_q=W[0], W_k=W[1], W_v=W[2], W_o=W[3])
    result = mha_command("run", "in.npz", "-o", "o.npy", "--heads", 2, "--causal", "--window", 2,
                         cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = mha.multi_head_attention(Q, Q, Q, *W, 2, causal=True, window=2)
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), expected)


def test_the_numpy_decoder_generates_what_transformers_generates(torch, transformers, tmp_path):
    from generate import Decoder

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    prompt = [5, 17, 42, 3, 99, 7]
    tokens, logits = Decoder(tmp_path).generate(prompt, 24)
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    assert tokens == generated.sequences[0, len(prompt) :].tolist()
    for ours, theirs in zip(logits, generated.logits, strict=True):
        assert relative_error(ours, theirs[0].numpy()) <= 1e-4
    assert math.isfinite(float(np.sum(logits)))


def test_the_decoder_computes_qwen2s_per_layer_windows(torch, transformers, tmp_path):
    """Qwen2 with sliding windows from max_window_layers on: the first layer attends to
    everything, the others to a window shorter than the prompt (as transformers' generate)."""
    from generate import Decoder

    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    decoder = Decoder(tmp_path)
    assert [layer[0].window for layer in decoder.layers] == [None, 4, 4]
    prompt = [5, 17, 42, 3, 91, 7, 60, 11, 2, 33]
    tokens, logits = decoder.generate(prompt, 12)
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    assert tokens == generated.sequences[0, len(prompt) :].tolist()
    for ours, theirs in zip(logits, generated.logits, strict=True):
        assert relative_error(ours, theirs[0].numpy()) <= 1e-4


# ---------------------------------------------------------------- found in review


def test_new_keys_must_be_one_per_query_and_the_cache_stays_as_it_was():
    cache = mha.KVCache(1, 1, 4, window=2, capacity=2)
    for _ in range(3):
        t = r.standard_normal((1, 1, 1, 4))
        mha.scaled_dot_product_attention(t, t, t, cache=cache)
    before = snapshot(cache)
    q, k = r.standard_normal((1, 1, 3, 4)), r.standard_normal((1, 1, 2, 4))
    with pytest.raises(mha.ShapeError, match="3 queries but 2 keys"):
        mha.scaled_dot_product_attention(q, k, k, cache=cache)
    for a, b in zip(snapshot(cache), before, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(mha.AttentionTypeError, match="causal must be True or False"):
        mha.scaled_dot_product_attention(
            q[..., :1, :], k[..., :1, :], k[..., :1, :], cache=cache, causal="yes"
        )
    with pytest.raises(mha.AttentionTypeError, match="window must be a positive integer"):
        mha.scaled_dot_product_attention(
            q[..., :1, :], k[..., :1, :], k[..., :1, :], cache=cache, window=True
        )


def test_an_attention_and_its_cache_must_agree_on_the_window():
    plain = mha.MultiHeadAttention(8, 2, seed=0)
    windowed = mha.KVCache(1, 2, 4, window=1)
    with pytest.raises(
        mha.AttentionValueError, match="window=None but the cache keeps only what window=1 needs"
    ):
        plain(r.standard_normal((1, 3, 8)), cache=windowed)
    with pytest.raises(mha.AttentionValueError, match="key= and value= cannot be combined"):
        plain(
            r.standard_normal((1, 3, 8)), key=r.standard_normal((1, 3, 8)), cache=plain.new_cache(1)
        )


def test_a_windowed_cache_shrinks_back_after_a_long_prompt():
    attention = decoder(window=16)
    cache = attention.new_cache(1)
    attention(r.standard_normal((1, 4000, 24)), cache=cache)
    assert cache.capacity <= 32
    steps = [attention(r.standard_normal((1, 1, 24)), cache=cache) for _ in range(5)]
    assert cache.capacity <= 32 and cache.lengths.tolist() == [4005] and len(steps) == 5
    # one sequence and one key/value head: the shrunk buffers are copies, not views that
    # keep the prompt's 4,000 positions alive
    single = decoder(window=16, num_kv_heads=1)
    cache = single.new_cache(1)
    single(r.standard_normal((1, 4000, 24)), cache=cache)
    assert cache.capacity <= 32
    for buffer in (cache._k, cache._v):
        assert buffer.base is None and buffer.nbytes <= 32 * 4 * 8


def test_decoding_through_the_module_uses_the_workers(monkeypatch, tuned):
    from mha._kernel import team

    sizes = []
    original = team.Team.__init__

    def spy(self, workers):
        sizes.append(workers)
        original(self, workers)

    monkeypatch.setattr(team.Team, "__init__", spy)
    monkeypatch.setattr(team, "default_workers", lambda: 2)
    tuned(serial_below=2**22)  # 8 heads' 20,000 keys cost 2**23.3
    attention = mha.MultiHeadAttention(256, 8, num_kv_heads=2, rope_theta=1e4, seed=0)
    cache = attention.new_cache(1, capacity=20000)
    cache._lengths[:] = 19999  # as after a long prompt (its state set, not computed)
    attention(r.standard_normal((1, 1, 256)), cache=cache)
    assert sizes and max(sizes) == 2  # the cost counts the cached keys


def test_a_small_call_does_not_wait_for_another_calls_queue():
    import threading

    from mha._kernel import team

    release = threading.Event()
    team._helpers().submit(release.wait, 1)  # the one helper is busy elsewhere
    q = r.standard_normal((2, 4, 300, 16))
    done = threading.Event()

    def call():
        mha.scaled_dot_product_attention(q, q, q, workers=2)
        done.set()

    thread = threading.Thread(target=call)
    thread.start()
    finished = done.wait(timeout=30)
    release.set()
    thread.join()
    assert finished  # the caller did the work itself and did not wait for the queue


def test_more_one_line_errors_for_decoder_settings(tmp_path):
    with pytest.raises(mha.AttentionTypeError, match="rope_theta must be a positive number"):
        mha.MultiHeadAttention(8, 2, rope_theta="abc")  # the type the function raises too
    with pytest.raises(mha.AttentionValueError, match="rope_theta must be a positive number"):
        mha.MultiHeadAttention(8, 2, rope_theta=-1.0)
    with pytest.raises(mha.AttentionValueError, match="the head width 3 is odd"):
        mha.MultiHeadAttention(6, 2, rope_theta=10000.0)
    state = {
        f"{n}.weight": np.zeros(s)
        for n, s in (
            ("q_proj", (16, 8)),
            ("k_proj", (16, 8)),
            ("v_proj", (16, 8)),
            ("o_proj", (8, 16)),
        )
    }
    with pytest.raises(
        mha.AttentionValueError, match="num_heads=16 is more than the hidden size 8"
    ):
        mha.MultiHeadAttention.from_llama(state, num_heads=16)
    path = tmp_path / "saved.npz"
    decoder(window=3).save(path)
    data = dict(np.load(path))
    import json

    config = json.loads(str(data["config"]))
    del config["window"]
    np.savez(path, **data | {"config": np.array(json.dumps(config))})
    with pytest.raises(mha.WeightsFileError, match="its config has no 'window'"):
        mha.MultiHeadAttention.load(path)


def relative_bias(H, queries, keys):
    """A T5-style bias: a function of each head and of ``query position - key position``."""
    i, j = np.asarray(queries)[:, None], np.arange(keys)[None]
    return np.stack([np.sin(0.3 * h * (i - j)) - 0.05 * (i - j) for h in range(H)])


@pytest.mark.parametrize("kind", ["KVCache", "PagedKVCache"])
def test_a_bias_and_a_mask_over_positions_decode_as_the_whole_call(kind, record_error):
    """Relative-position decoding: each step's ``bias`` and boolean ``mask`` are over the
    positions after its append (ragged prompts: each sequence reads its own first keys)."""
    H, H_kv, d, prompts, steps = 4, 2, 8, [6, 3], 4
    if kind == "KVCache":
        cache = mha.KVCache(2, H_kv, d, capacity=4)
    else:
        cache = mha.PagedKVCache(20, 4, H_kv, d, dtype=np.float64)
        cache.add(0)
        cache.add(1)
    rng = np.random.default_rng(30)
    tokens = [  # each sequence's q, k, v
        (rng.standard_normal((H, n + steps, d)), *rng.standard_normal((2, H_kv, n + steps, d)))
        for n in prompts
    ]
    keep = rng.random(20) > 0.2  # keys hidden from every query
    keep[0] = True
    L = max(prompts)
    padded = [np.stack([np.pad(x[i][:, :n], ((0, 0), (0, L - n), (0, 0))) for x, n in
                        zip(tokens, prompts, strict=True)]) for i in range(3)]  # fmt: skip
    bias = np.stack([relative_bias(H, range(L), L)] * 2)
    first = mha.scaled_dot_product_attention(*padded, cache=cache, query_lengths=prompts,
                                             bias=bias, mask=keep[:L])  # fmt: skip
    outs = [[first[b, :, :n]] for b, n in enumerate(prompts)]
    for t in range(steps):
        lengths = cache.lengths.copy()
        S = int(lengths.max()) + 1
        new = [np.stack([x[i][:, n + t : n + t + 1] for x, n in zip(tokens, prompts, strict=True)])
               for i in range(3)]  # fmt: skip
        bias = np.stack([relative_bias(H, [lengths[b]], S) for b in range(2)])
        step = mha.scaled_dot_product_attention(*new, cache=cache, bias=bias, mask=keep[:S])
        for b in range(2):
            outs[b].append(step[b])
    for b, n in enumerate(prompts):
        n += steps
        expected = mha.scaled_dot_product_attention(
            *tokens[b], causal=True, bias=relative_bias(H, range(n), n), mask=keep[:n]
        )
        got = np.concatenate(outs[b], 1)
        error = record_error(f"{kind}: bias and mask over positions vs whole call",
                             float(np.abs(got - expected).max()))  # fmt: skip
        assert error <= 1e-13


def test_a_window_cache_refuses_a_bias_over_positions():
    cache = mha.KVCache(1, 1, 8, window=4)
    x = np.ones((1, 1, 1, 8))
    with pytest.raises(mha.AttentionValueError, match="bias with cache= index keys by position"):
        mha.scaled_dot_product_attention(x, x, x, cache=cache, bias=np.zeros((1, 1, 1, 1)))


def _general_route(monkeypatch):
    """Every cached call through :meth:`Visibility.build` and :func:`attend`, as before the
    decoding steps' own route."""
    from mha.api import cached, module

    monkeypatch.setattr(cached, "plain_queries", lambda *args: False)
    monkeypatch.setattr(module, "kept_step", lambda layer: None)  # (a layer's own route)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("workers", [1, 2])
def test_decoding_steps_take_their_own_route_to_the_same_bits(dtype, workers, monkeypatch):
    """A decoding step (one query per sequence, causal, no mask) skips the visibility's
    checks and the walk's choice: the same bits as the general route, over a prompt then
    ragged steps of a batch whose sequences have different lengths, with GQA and rotary,
    and the route is taken (the prompt's call is not a decoding step)."""
    from mha.api import cached

    rng = np.random.default_rng(31)
    layer = mha.MultiHeadAttention(64, 8, num_kv_heads=2, rope_theta=10000.0, seed=3,
                                   dtype=dtype)  # fmt: skip
    prompt = rng.standard_normal((3, 5, 64)).astype(dtype)
    steps = [rng.standard_normal((3, 1, 64)).astype(dtype) for _ in range(6)]
    lengths = np.array([5, 2, 4])

    def run():
        cache = layer.new_cache(3, capacity=8)  # it grows on the way
        outs = [layer(prompt, cache=cache, query_lengths=lengths, workers=workers)]
        outs += [layer(x, cache=cache, workers=workers) for x in steps]
        return outs, cache

    taken = []  # (a layer's kept step on one worker makes the band alone: plain_band)
    for name in ("plain_visibility", "plain_band"):
        real = getattr(cached, name)
        monkeypatch.setattr(cached, name, lambda *a, real=real: taken.append(1) or real(*a))
    own, own_cache = run()
    assert len(taken) == len(steps)
    with monkeypatch.context() as m:
        _general_route(m)
        general, general_cache = run()
    assert len(taken) == len(steps)
    for a, b in zip(own, general, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(own_cache.lengths, general_cache.lengths)
    np.testing.assert_array_equal(own_cache.k, general_cache.k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("workers", [1, 2])
def test_prompts_take_the_plain_route_to_the_same_bits(dtype, workers, monkeypatch):
    """A prompt into a cache, then more of it (the queries after cached keys), then steps:
    through the plain route (:func:`plain_queries`) the general route's bits, and the route
    is taken by every call."""
    from mha.api import cached

    rng = np.random.default_rng(32)
    layer = mha.MultiHeadAttention(64, 8, num_kv_heads=2, rope_theta=10000.0, seed=4,
                                   dtype=dtype)  # fmt: skip
    calls = [rng.standard_normal((2, n, 64)).astype(dtype) for n in (37, 5, 1, 1, 300)]

    def run():
        cache = layer.new_cache(2, capacity=16)  # it grows on the way
        return [layer(x, cache=cache, workers=workers) for x in calls], cache

    taken = []  # (a layer's kept step on one worker makes the band alone: plain_band)
    for name in ("plain_visibility", "plain_band"):
        real = getattr(cached, name)
        monkeypatch.setattr(cached, name, lambda *a, real=real: taken.append(1) or real(*a))
    own, own_cache = run()
    assert len(taken) >= 3  # the prompts' (the steps may take a layer's kept step)
    with monkeypatch.context() as m:
        _general_route(m)
        general, general_cache = run()
    for a, b in zip(own, general, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(own_cache.k, general_cache.k)


@pytest.mark.parametrize("L", [1, 3])
def test_a_plain_cached_calls_visibility_is_the_one_the_checks_build(L):
    """The visibility the plain route makes without checks (:func:`plain_visibility`: a
    decoding step, or a prompt of ``L`` tokens) is field for field the one
    :meth:`Visibility.build` gives the same call (a ragged batch)."""
    from mha._kernel.contract import CachedPositions, MaskArrays, MaskRules, ScoreShape, Visibility
    from mha.api.cached import plain_visibility

    filled, counts = np.array([6, 3, 9]), np.full(3, L, np.int64)
    positions, first = filled - counts, np.zeros(3, np.int64)
    built = Visibility.build(
        MaskRules(causal=True), MaskArrays(None, None, filled, counts), ScoreShape((3,), 4, L, 9),
        np.float32, "", CachedPositions(filled - counts, positions, first, 0),
    )  # fmt: skip
    made = plain_visibility(np.zeros((3, 4, L, 8), np.float32), filled, counts, positions, first)
    for name in Visibility.__dataclass_fields__:
        a, b = getattr(built, name), getattr(made, name)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a == b, name


@pytest.mark.parametrize("seed", range(4))
def test_a_plain_steps_band_is_the_one_its_visibility_gives(seed):
    """The band a layer's kept step makes from the filled slots (:func:`plain_band`) is the
    one :func:`band_of` takes from :func:`plain_visibility`'s visibility: each field's
    values and dtype (a ragged batch, one new token each)."""
    from mha._kernel.walk_inputs import band_of
    from mha.api.cached import plain_band, plain_visibility

    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 5))
    filled, counts = rng.integers(1, 40, B), np.ones(B, np.int64)
    positions, first = filled - counts, np.zeros(B, np.int64)
    visibility = plain_visibility(np.zeros((B, 4, 1, 8)), filled, counts, positions, first)
    expected = band_of(visibility, (B,), 1, int(filled.max()))
    made = plain_band(filled, counts)
    assert made[:2] == expected[:2]
    for a, b in zip(made[2:], expected[2:], strict=True):
        assert a.dtype == b.dtype == np.int64 and a.flags.writeable
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_decoding_step_the_walk_leaves_is_computed_from_the_start(monkeypatch, workers):
    """When the compiled walk leaves a task (as it does a non-finite value at a hidden key)
    the plain route's call (a prompt's, a decoding step's) is computed whole by
    :func:`attend`, which gives the task to the NumPy walk: the general route's output. On
    one worker the step's walk runs without a plan (:func:`.walk.run_lone`), on two from
    :class:`.walk.ForwardPlan`: both hand it on."""
    from mha._kernel import compiled, walk
    from mha._kernel import forward as kernel_forward

    needs_numba(compiled.walk_available(), "the NumPy walk computes every call")
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 1, 16))
    k, v = rng.standard_normal((2, 2, 2, 1, 16))
    prompt = rng.standard_normal((2, 2, 7, 16))

    def run():
        cache = mha.KVCache(2, 2, 16, capacity=16, dtype=np.float64)
        mha.scaled_dot_product_attention(np.repeat(prompt, 2, 1), prompt, prompt, cache=cache)
        return mha.scaled_dot_product_attention(q, k, v, cache=cache, workers=workers)

    expected = run()
    real_walk, real_attend, real_lone = compiled.forward_walk, kernel_forward.attend, walk.run_lone
    attended, lone = [], []

    def leaves_one(dtype, work, *rest):
        real_walk(dtype, work, *rest)
        work[2][:1] = True

    monkeypatch.setattr(compiled, "forward_walk", leaves_one)
    monkeypatch.setattr(kernel_forward, "attend", lambda *a: attended.append(1) or real_attend(*a))
    monkeypatch.setattr(walk, "run_lone", lambda *a: lone.append(1) or real_lone(*a))
    np.testing.assert_allclose(run(), expected, rtol=0, atol=1e-15)
    assert len(attended) == 2  # the prompt's call and the step's, each left one task
    assert len(lone) == (workers == 1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_kept_rotation_rotates_to_the_same_bits(interleaved, dtype):
    """A decoding step's rotation is made once for every layer at its positions (kept,
    read-only) and applied in four passes over whole rows: the same bits as the rotation
    made afresh and applied by halves, partial widths by halves; a refused option is still
    refused after a kept rotation of the equal value (``1`` is not ``True``)."""
    from mha._kernel import runtime
    from mha.api import rotary

    rng = np.random.default_rng(8)
    for shape, at in [((2, 4, 1, 16), [[3], [40]]), ((1, 2, 3, 8), [[0, 1, 2]])]:
        positions = np.array(at)
        x = rng.standard_normal(shape).astype(dtype)
        runtime.DEFAULT.rotations.forget()
        options = {"theta": 500.0, "interleaved": interleaved}
        kept = rotary.rotation(shape, positions, dtype, **options)
        assert kept.whole is not None and not kept.cos.flags.writeable
        assert rotary.rotation(shape, positions.copy(), dtype, **options) is kept
        by_halves = kept._replace(whole=None)
        np.testing.assert_array_equal(rotary.rotate(x, kept), rotary.rotate(x, by_halves))
        np.testing.assert_array_equal(
            rotary.rotate(x, kept),
            mha.apply_rotary(x, positions, theta=500.0, interleaved=interleaved),
        )
        partial = rotary.rotation(shape, positions, dtype, rotary_dim=4, **options)
        assert partial.whole is None  # (the rest of the row passes through)
    with pytest.raises(mha.AttentionTypeError, match="interleaved"):
        rotary.rotation(shape, positions, dtype, theta=500.0, interleaved=int(interleaved))


def test_a_prompts_rotation_is_kept_alone_and_a_longer_one_not_at_all():
    """The rotation of a longer array of positions (a prompt's, which every layer of its
    pass rotates at) is kept as the last one alone, beside the 16 small ones, and rotates
    as one made afresh; one of more than ``LONG`` positions is made afresh every time."""
    from mha._kernel import runtime
    from mha.api import rotary

    runtime.DEFAULT.forget()
    x = np.random.default_rng(9).standard_normal((1, 2, 300, 16))
    positions = np.arange(300)[None]
    kept = rotary.rotation(x.shape, positions, np.float64)
    assert rotary.rotation(x.shape, np.arange(300)[None], np.float64) is kept
    assert not kept.cos.flags.writeable and len(runtime.DEFAULT.rotations) == 0
    assert kept.whole is None  # (applied by halves: whole rows' gather is slower here)
    small = rotary.rotation((1, 2, 3, 16), np.arange(3)[None], np.float64)
    assert rotary.rotation(x.shape, positions, np.float64) is kept  # still kept beside it
    shifted = rotary.rotation(x.shape, positions + 1, np.float64)  # the next prompt's
    assert shifted is not kept and rotary.rotation(x.shape, positions, np.float64) is not kept
    assert rotary.rotation((1, 2, 3, 16), np.arange(3)[None], np.float64) is small
    many = np.arange(rotary.LONG + 1)[None]
    shape = (1, 1, rotary.LONG + 1, 4)
    assert rotary.rotation(shape, many, np.float64) is not rotary.rotation(shape, many, np.float64)
    np.testing.assert_array_equal(rotary.rotate(x, kept), mha.apply_rotary(x, positions))
