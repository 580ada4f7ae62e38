"""The mask contract: polarity, alignment, shapes, AND-combination, empty rows, isolation."""

from __future__ import annotations

import numpy as np
import pytest

import mha

rng = np.random.default_rng(7)


def project_inputs(B=2, L=5, S=7, d=8, d_out=6, bias=True, seed=0):
    r = np.random.default_rng(seed)
    Q, K, V = (
        r.standard_normal((B, L, d)),
        r.standard_normal((B, S, d)),
        r.standard_normal((B, S, d)),
    )
    W = [r.standard_normal((d, d)) for _ in range(3)] + [r.standard_normal((d, d_out))]
    biases = {}
    if bias:
        biases = {
            "b_q": r.standard_normal(d),
            "b_k": r.standard_normal(d),
            "b_v": r.standard_normal(d),
            "b_o": r.standard_normal(d_out),
        }
    return (Q, K, V, *W), biases


def heads(B=2, H=3, L=5, S=7, d=4, seed=1):
    r = np.random.default_rng(seed)
    return (
        r.standard_normal((B, H, L, d)),
        r.standard_normal((B, H, S, d)),
        r.standard_normal((B, H, S, d)),
    )


@pytest.mark.parametrize(("alignment", "diagonal"), [("bottom_right", None), ("top_left", 0)])
@pytest.mark.parametrize(("L", "S"), [(4, 4), (3, 6), (6, 3)])
def test_causal_alignment_hides_exactly_the_keys_above_its_diagonal(alignment, diagonal, L, S):
    q, k, v = heads(L=L, S=S)
    _, weights = mha.scaled_dot_product_attention(
        q, k, v, causal=True, causal_alignment=alignment, return_weights=True
    )
    visible = np.tril(np.ones((L, S), dtype=bool), k=S - L if diagonal is None else diagonal)
    assert np.all(weights[..., ~visible] == 0)
    assert np.all(weights[..., visible] > 0)


def test_bottom_right_lets_the_last_query_see_every_key():
    q, k, v = heads(L=2, S=6)
    _, weights = mha.scaled_dot_product_attention(q, k, v, causal=True, return_weights=True)
    assert np.all(weights[..., -1, :] > 0)
    assert np.all(weights[..., 0, -1] == 0) and np.all(weights[..., 0, :-1] > 0)


def test_mask_true_is_causal_and_mask_false_is_no_mask():
    args, biases = project_inputs(L=6, S=6)
    causal = mha.multi_head_attention(*args, 2, causal=True, **biases)
    np.testing.assert_array_equal(mha.multi_head_attention(*args, 2, mask=True, **biases), causal)
    plain = mha.multi_head_attention(*args, 2, **biases)
    np.testing.assert_array_equal(mha.multi_head_attention(*args, 2, mask=False, **biases), plain)
    assert not np.array_equal(causal, plain)


@pytest.mark.parametrize(
    "shape", [(5, 7), (2, 5, 7), (2, 1, 5, 7), (2, 3, 5, 7), (1, 3, 5, 7), (7,)]
)
def test_boolean_mask_shapes_equal_the_explicit_full_mask(shape):
    q, k, v = heads()
    mask = rng.random(shape) < 0.7
    full = mask[:, None] if len(shape) == 3 else mask  # a (B, L, S) mask applies to every head
    full = np.broadcast_to(full, (2, 3, 5, 7))
    expected = mha.scaled_dot_product_attention(q, k, v, mask=np.ascontiguousarray(full))
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, mask=mask), expected)


def test_true_means_may_attend():
    q, k, v = heads()
    mask = np.zeros((5, 7), dtype=bool)
    mask[:, 2] = True  # every query may attend to key 2 only
    out, weights = mha.scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    np.testing.assert_array_equal(weights[..., 2], 1.0)
    np.testing.assert_allclose(out, np.broadcast_to(v[..., 2:3, :], out.shape), rtol=1e-15)


def test_every_kind_combines_with_and():
    args, biases = project_inputs(L=5, S=7)
    mask = rng.random((2, 5, 7)) < 0.8
    bias = rng.standard_normal((2, 1, 5, 7))
    bias[rng.random(bias.shape) < 0.15] = -np.inf
    key_lengths, query_lengths = np.array([7, 4]), np.array([3, 5])
    combined = mask[:, None] & np.tril(np.ones((5, 7), dtype=bool), k=2)
    combined = combined & (np.arange(7) < key_lengths[:, None, None, None])
    combined = combined & (np.arange(5)[:, None] < query_lengths[:, None, None, None])
    combined = combined & (bias != -np.inf)
    out = mha.multi_head_attention(
        *args,
        4,
        mask=mask,
        causal=True,
        key_lengths=key_lengths,
        query_lengths=query_lengths,
        bias=bias,
        **biases,
    )
    expected = mha.multi_head_attention(
        *args, 4, mask=combined, bias=np.where(combined, bias, 0.0), **biases
    )
    np.testing.assert_array_equal(out, expected)


EMPTY_ROW_CASES = {
    "mask": {"mask": np.array([[True] * 7, [False] * 7, [True] * 7, [True] * 7, [True] * 7])},
    "key_lengths=0": {"key_lengths": np.array([0, 7])},
    "query_lengths": {"query_lengths": np.array([1, 5])},
    "bias -inf": {"bias": np.where(np.arange(5)[:, None] == 1, -np.inf, np.zeros((5, 7)))},
    "causal L > S": {"causal": True},
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("case", EMPTY_ROW_CASES, ids=str)
def test_rows_that_see_no_key_are_zero_never_nan(case, return_weights, dtype):
    L, S = (9, 7) if case == "causal L > S" else (5, 7)
    args, biases = project_inputs(L=L, S=S)
    args = [a.astype(dtype) for a in args]
    biases = {name: b.astype(dtype) for name, b in biases.items()}
    result = mha.multi_head_attention(
        *args, 2, **EMPTY_ROW_CASES[case], **biases, return_weights=return_weights
    )
    out, weights = result if return_weights else (result, None)
    _, weights = mha.multi_head_attention(
        *args, 2, **EMPTY_ROW_CASES[case], **biases, return_weights=True
    )
    empty = ~weights.any(axis=-1)  # (B, H, L): rows whose weights are all zero
    assert empty.any(), "the case must produce a row that sees no key"
    assert not np.isnan(out).any()
    rows = empty.all(axis=1)  # (B, L): no head of the row sees a key
    np.testing.assert_array_equal(out[rows], np.broadcast_to(biases["b_o"], out[rows].shape))
    np.testing.assert_allclose(
        weights.sum(-1)[~empty], 1.0, rtol=1e-3 if dtype == np.float16 else 1e-6
    )


def test_empty_rows_without_output_bias_are_exactly_zero():
    q, k, v = heads()
    out, weights = mha.scaled_dot_product_attention(
        q, k, v, key_lengths=np.array([0, 3]), return_weights=True
    )
    assert np.all(out[0] == 0) and np.all(weights[0] == 0)
    assert np.all(out[1] != 0)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("how", ["key_lengths", "mask", "bias", "query_lengths"])
def test_non_finite_values_at_hidden_positions_never_reach_a_visible_output(poison, how):
    args, biases = project_inputs(B=2, L=5, S=7)
    Q, K, V = args[:3]
    Q, K, V = Q.copy(), K.copy(), V.copy()
    if how == "query_lengths":
        keywords = {"query_lengths": np.array([5, 3])}
        Q[1, 3:] = poison
        valid = (slice(None), slice(0, 3))  # the first three rows of each entry
    else:
        keywords = {
            "key_lengths": {"key_lengths": np.array([7, 4])},
            "mask": {
                "mask": np.broadcast_to(np.arange(7) < np.array([7, 4])[:, None, None], (2, 5, 7))
            },
            "bias": {
                "bias": np.where(np.arange(7) < np.array([7, 4])[:, None, None, None], 0.0, -np.inf)
            },
        }[how]
        K[1, 4:] = poison
        V[1, 4:] = poison
        valid = (slice(None),)
    clean = mha.multi_head_attention(*args, 2, **keywords, **biases)
    dirty = mha.multi_head_attention(Q, K, V, *args[3:], 2, **keywords, **biases)
    np.testing.assert_array_equal(dirty[valid], clean[valid])
    assert np.isfinite(dirty).all()


def test_value_poison_hidden_from_some_queries_only_reaches_the_queries_that_see_it():
    q, k, v = heads(B=1, H=1, L=4, S=4)
    v = v.copy()
    v[..., 3, 1] = np.nan  # key 3 is visible only to query 3 under a causal mask
    out = mha.scaled_dot_product_attention(q, k, v, causal=True)
    assert np.isfinite(out[..., :3, :]).all()
    assert np.isnan(out[..., 3, 1]).all() and np.isfinite(out[..., 3, [0, 2, 3]]).all()


def test_nan_at_a_visible_position_propagates():
    args, biases = project_inputs()
    K = args[1].copy()
    K[0, 2, 0] = np.nan
    out = mha.multi_head_attention(args[0], K, *args[2:], 2, **biases)
    assert np.isnan(out[0]).all()
    assert np.isfinite(out[1]).all()


def test_zero_length_sequences():
    q, k, v = heads(L=0, S=7)
    out, weights = mha.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert out.shape == (2, 3, 0, 4) and weights.shape == (2, 3, 0, 7)
    args, biases = project_inputs(S=0)
    out, weights = mha.multi_head_attention(*args, 2, **biases, return_weights=True)
    assert out.shape == (2, 5, 6) and weights.shape == (2, 2, 5, 0)
    np.testing.assert_array_equal(out, np.broadcast_to(biases["b_o"], out.shape))
    args, _ = project_inputs(L=0)
    assert mha.multi_head_attention(*args, 2, causal=True).shape == (2, 0, 6)


def test_unbatched_masks_use_head_query_key_axes():
    args, biases = project_inputs(B=1)
    unbatched = [a[0] for a in args[:3]] + list(args[3:])
    mask = rng.random((2, 5, 7)) < 0.7  # (H, L, S) for an unbatched call
    out = mha.multi_head_attention(*unbatched, 2, mask=mask, key_lengths=5, **biases)
    batched = mha.multi_head_attention(*args, 2, mask=mask[None], key_lengths=[5], **biases)
    assert out.shape == (5, 6)
    np.testing.assert_array_equal(out, batched[0])


def test_zero_dimensional_boolean_arrays_are_masks_and_scalars_are_the_causal_flag():
    q, k, v = heads(L=4, S=4)
    plain = mha.scaled_dot_product_attention(q, k, v)
    causal = mha.scaled_dot_product_attention(q, k, v, causal=True)
    np.testing.assert_allclose(  # the same up to rounding: with numba, a boolean array takes
        mha.scaled_dot_product_attention(q, k, v, mask=np.array(True)),
        plain,
        rtol=1e-14,
        atol=1e-15 * np.abs(plain).max(),
    )  # the Python walk and no mask the compiled one
    assert np.all(mha.scaled_dot_product_attention(q, k, v, mask=np.array(False)) == 0)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, mask=np.True_), causal)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, mask=True), causal)


def test_masks_with_two_batch_axes():
    r = np.random.default_rng(5)
    q, k, v = (r.standard_normal((2, 3, 4, n, 5)) for n in (6, 7, 7))  # (B1, B2, H, L/S, d)
    mask = r.random((2, 3, 1, 6, 7)) < 0.7
    per_entry = np.stack([
        np.stack([mha.scaled_dot_product_attention(q[i, j], k[i, j], v[i, j], mask=mask[i, j])
                  for j in range(3)])
        for i in range(2)
    ])  # fmt: skip
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, mask=mask), per_entry)
    no_head_axis = mask[:, :, 0]  # (B1, B2, L, S): applies to every head
    np.testing.assert_array_equal(
        mha.scaled_dot_product_attention(q, k, v, mask=no_head_axis), per_entry
    )


def test_empty_batch():
    args, biases = project_inputs(B=0)
    out, weights = mha.multi_head_attention(
        *args, 2, **biases, key_lengths=[], causal=True, return_weights=True
    )
    assert out.shape == (0, 5, 6) and weights.shape == (0, 2, 5, 7)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_non_finite_bias_at_hidden_positions_never_reaches_a_visible_output(poison):
    args, biases = project_inputs()
    bias = np.zeros((2, 1, 5, 7))
    mask = np.ones((2, 5, 7), dtype=bool)
    mask[:, :, 5:] = False
    clean = mha.multi_head_attention(*args, 2, bias=bias, mask=mask, **biases)
    dirty_bias = bias.copy()
    dirty_bias[..., 5:] = poison  # hidden by the mask
    dirty_bias[1, ..., 3:] = poison  # hidden by the key lengths below
    dirty = mha.multi_head_attention(
        *args, 2, bias=dirty_bias, mask=mask, key_lengths=[7, 3], **biases
    )
    np.testing.assert_array_equal(dirty[0], clean[0])
    assert np.isfinite(dirty).all()


def test_a_block_of_the_visibility_sees_what_the_whole_sees_there():
    """Visibility.block, which mha.dask cuts per chunk pair, against the full visibility."""
    from mha._kernel.contract import MaskArrays, MaskRules, ScoreShape, Visibility

    r = np.random.default_rng(11)
    for _ in range(200):
        B, H, L, S = int(r.integers(1, 4)), 2, int(r.integers(1, 12)), int(r.integers(1, 12))
        kwargs = {"causal": bool(r.integers(2))}
        if r.integers(2):
            kwargs["window"] = int(r.integers(1, 5))
        if (kwargs["causal"] or "window" in kwargs) and r.integers(2):
            kwargs["causal_alignment"] = "top_left"
        if r.integers(2):
            kwargs["key_lengths"] = r.integers(0, S + 1, B)
        if r.integers(2):
            kwargs["query_lengths"] = r.integers(0, L + 1, B)
        if r.integers(2):
            kwargs["mask"] = r.random((B, 1, L, S)) < 0.7
        rules = MaskRules.check(None, kwargs["causal"], kwargs.get("causal_alignment"),
                                kwargs.get("window"), None, None, None)  # fmt: skip
        arrays = MaskArrays(kwargs.get("mask"), None, kwargs.get("key_lengths"),
                            kwargs.get("query_lengths"))  # fmt: skip
        whole = Visibility.build(rules, arrays, ScoreShape((B,), H, L, S))
        allowed = whole.allowed()
        for _ in range(4):
            b0, r0, c0 = int(r.integers(0, B)), int(r.integers(0, L)), int(r.integers(0, S))
            b1, r1 = int(r.integers(b0 + 1, B + 1)), int(r.integers(r0 + 1, L + 1))
            c1 = int(r.integers(c0 + 1, S + 1))
            block = whole.block((slice(b0, b1),), slice(r0, r1), slice(c0, c1))
            want = allowed[b0:b1, :, r0:r1, c0:c1]
            assert np.array_equal(block.allowed(), want)
            if not block.sees_any():  # skipped blocks hide everything
                assert not want.any()
