"""Properties that must hold for every input, searched with hypothesis."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import mha

settings.register_profile("mha", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("mha")

shapes = st.fixed_dictionaries(
    {
        "B": st.integers(1, 3),
        "H": st.integers(1, 4),
        "d": st.integers(1, 5),
        "L": st.integers(1, 7),
        "S": st.integers(1, 7),
        "seed": st.integers(0, 2**32 - 1),
    }
)
masking = st.fixed_dictionaries(
    {
        "mask": st.booleans(),
        "causal": st.booleans(),
        "alignment": st.sampled_from(["bottom_right", "top_left"]),
        "key_lengths": st.booleans(),
        "query_lengths": st.booleans(),
        "bias": st.booleans(),
    }
)


def draw_heads(s):
    rng = np.random.default_rng(s["seed"])
    q = rng.standard_normal((s["B"], s["H"], s["L"], s["d"])) * 2
    k = rng.standard_normal((s["B"], s["H"], s["S"], s["d"])) * 2
    v = rng.standard_normal((s["B"], s["H"], s["S"], s["d"]))
    return rng, q, k, v


def draw_masking(rng, s, m):
    kw = {"causal": m["causal"]}
    if m["causal"]:
        kw["causal_alignment"] = m["alignment"]
    if m["mask"]:
        kw["mask"] = rng.random((s["B"], s["L"], s["S"])) < 0.6
    if m["key_lengths"]:
        kw["key_lengths"] = rng.integers(0, s["S"] + 1, size=s["B"])
    if m["query_lengths"]:
        kw["query_lengths"] = rng.integers(0, s["L"] + 1, size=s["B"])
    if m["bias"]:
        bias = rng.standard_normal((s["B"], s["H"], s["L"], s["S"]))
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        kw["bias"] = bias
    return kw


@given(shapes, masking)
def test_weight_rows_sum_to_one_or_zero(s, m):
    rng, q, k, v = draw_heads(s)
    out, weights = mha.scaled_dot_product_attention(
        q, k, v, **draw_masking(rng, s, m), return_weights=True
    )
    sums = weights.sum(axis=-1)
    empty = ~(weights > 0).any(axis=-1)
    np.testing.assert_allclose(sums[~empty], 1.0, rtol=1e-12)
    assert np.all(sums[empty] == 0) and np.all(out[empty] == 0)
    assert np.all(weights >= 0) and np.isfinite(out).all()


@given(shapes, masking)
def test_permuting_keys_and_values_together_changes_nothing(s, m):
    rng, q, k, v = draw_heads(s)
    kw = draw_masking(rng, s, m)
    for name in ("causal", "causal_alignment", "key_lengths"):
        kw.pop(name, None)  # position-dependent: not permutation invariant
    out = mha.scaled_dot_product_attention(q, k, v, **kw)
    perm = rng.permutation(s["S"])
    permuted = {
        name: (value[..., perm] if name in ("mask", "bias") else value)
        for name, value in kw.items()
    }
    out_permuted = mha.scaled_dot_product_attention(q, k[..., perm, :], v[..., perm, :], **permuted)
    np.testing.assert_allclose(out_permuted, out, rtol=1e-12, atol=1e-14)


@given(shapes, st.integers(0, 6), st.sampled_from(["bottom_right", "top_left"]))
def test_causality_later_tokens_never_change_earlier_outputs(s, t, alignment):
    rng = np.random.default_rng(s["seed"])
    E = s["H"] * s["d"]
    X = rng.standard_normal((s["B"], s["L"], E))
    W = [rng.standard_normal((E, E)) for _ in range(4)]
    t = min(t, s["L"])
    changed = X.copy()
    changed[:, t:] = rng.standard_normal(changed[:, t:].shape) * 10
    before = mha.multi_head_attention(X, X, X, *W, s["H"], causal=True, causal_alignment=alignment)
    after = mha.multi_head_attention(
        changed, changed, changed, *W, s["H"], causal=True, causal_alignment=alignment
    )
    np.testing.assert_array_equal(after[:, :t], before[:, :t])


@given(shapes)
def test_one_head_is_plain_attention(s):
    rng = np.random.default_rng(s["seed"])
    Q, K = rng.standard_normal((s["B"], s["L"], 6)), rng.standard_normal((s["B"], s["S"], 5))
    V = rng.standard_normal((s["B"], s["S"], 3))
    W_q, W_k = rng.standard_normal((6, s["d"])), rng.standard_normal((5, s["d"]))
    W_v, W_o = rng.standard_normal((3, 4)), rng.standard_normal((4, 7))
    scores = (Q @ W_q) @ (K @ W_k).transpose(0, 2, 1) / np.sqrt(s["d"])
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    expected = weights @ (V @ W_v) @ W_o
    out = mha.multi_head_attention(Q, K, V, W_q, W_k, W_v, W_o, 1)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


@given(shapes, masking, st.booleans())
def test_the_class_equals_the_function(s, m, bias):
    rng = np.random.default_rng(s["seed"])
    E = s["H"] * s["d"]
    attention = mha.MultiHeadAttention(E, s["H"], kdim=3, vdim=5, bias=bias, seed=s["seed"])
    X, Km, Vm = (
        rng.standard_normal((s["B"], n, w)) for n, w in ((s["L"], E), (s["S"], 3), (s["S"], 5))
    )
    kw = draw_masking(rng, s, m)
    expected = mha.multi_head_attention(
        X,
        Km,
        Vm,
        attention.W_q,
        attention.W_k,
        attention.W_v,
        attention.W_o,
        s["H"],
        b_q=attention.b_q,
        b_k=attention.b_k,
        b_v=attention.b_v,
        b_o=attention.b_o,
        **kw,
    )
    np.testing.assert_array_equal(attention(X, key=Km, value=Vm, **kw), expected)
