"""The dtype policy: float64 stays float64, float32 is computed in float32, float16 in float32."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from support.configs import relative_error

import mha

r = np.random.default_rng(3)


def inputs(dtype=np.float64, B=2, L=4, S=6, d=8):
    arrays = [
        r.standard_normal((B, L, d)),
        r.standard_normal((B, S, d)),
        r.standard_normal((B, S, d)),
    ]
    arrays += [r.standard_normal((d, d)) / np.sqrt(d) for _ in range(4)]
    return [a.astype(dtype) for a in arrays]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_output_dtype_follows_the_input(dtype):
    out, weights = mha.multi_head_attention(*inputs(dtype), 2, causal=True, return_weights=True)
    assert out.dtype == dtype and weights.dtype == dtype
    q = r.standard_normal((2, 3, 4, 5)).astype(dtype)
    assert mha.scaled_dot_product_attention(q, q, q).dtype == dtype


def test_lists_and_integers_become_float64():
    args = [a.round().astype(np.int64) for a in inputs()]
    out = mha.multi_head_attention(*args, 2)
    assert out.dtype == np.float64
    from_lists = mha.multi_head_attention(*[a.tolist() for a in args], 2)
    np.testing.assert_array_equal(from_lists, out)
    np.testing.assert_array_equal(
        out, mha.multi_head_attention(*[a.astype(float) for a in args], 2)
    )


@pytest.mark.parametrize(
    ("first", "rest", "expected"),
    [
        (np.float32, np.float64, np.float64),
        (np.float16, np.float32, np.float32),
        (np.float16, np.float64, np.float64),
        (np.int32, np.float32, np.float64),
    ],
)
def test_mixed_inputs_follow_result_type(first, rest, expected):
    args = inputs()
    args = [args[0].astype(first)] + [a.astype(rest) for a in args[1:]]
    assert mha.multi_head_attention(*args, 2).dtype == expected


def test_float32_matches_float64_within_float32_rounding():
    args = inputs(B=3, L=16, S=24, d=32)
    exact = mha.multi_head_attention(*args, 4, causal=True)
    single = mha.multi_head_attention(*[a.astype(np.float32) for a in args], 4, causal=True)
    assert relative_error(single, exact) <= 2e-5


def test_float16_is_computed_in_float32_without_overflow():
    Q, K, V, *W = inputs(B=1, L=3, S=5, d=4)
    Q16, K16 = (300 * Q).astype(np.float16), (300 * K).astype(np.float16)  # logits >> 65504
    V16 = V.astype(np.float16)
    W16 = [w.astype(np.float16) for w in W]
    out = mha.multi_head_attention(Q16, K16, V16, *W16, 1)
    assert out.dtype == np.float16 and np.isfinite(out).all()
    in_float32 = mha.multi_head_attention(*[a.astype(np.float32) for a in (Q16, K16, V16, *W16)], 1)
    np.testing.assert_array_equal(out, in_float32.astype(np.float16))
    scores = Q16.astype(np.float32) @ W16[0].astype(np.float32)
    assert (
        np.abs(
            scores @ (K16.astype(np.float32) @ W16[1].astype(np.float32)).transpose(0, 2, 1)
        ).max()
        > 65504
    )


def test_float64_bias_does_not_promote_float32_work():
    args = [a.astype(np.float32) for a in inputs()]
    bias = np.zeros((4, 6))  # float64
    bias[:, -1] = -np.inf
    assert mha.multi_head_attention(*args, 2, bias=bias).dtype == np.float32


def float64_arrays_seen_inside_mha(call, given=()) -> list[str]:
    """Run ``call`` tracing every frame of mha's source: the float64 arrays its locals hold,
    other than the caller's own arrays ``given`` and views of them."""
    source = str(Path(mha.__file__).parent)
    theirs = {id(array) for array in given}
    seen = []

    def is_theirs(array):
        while array is not None:
            if id(array) in theirs:
                return True
            array = array.base
        return False

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(source):
            return tracer
        for name, value in frame.f_locals.items():
            if isinstance(value, np.ndarray) and value.dtype == np.float64 and not is_theirs(value):
                seen.append(f"{frame.f_code.co_name}: {name} {value.shape}")
        return tracer

    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return seen


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float32_work_makes_no_float64_temporaries(dtype, workers):
    args = inputs(dtype, B=2, L=64, S=80, d=16)
    bias = np.zeros((64, 80))  # float64 on purpose: it is cast to the compute dtype
    mask = r.random((2, 64, 80)) < 0.9

    def calls():
        mha.multi_head_attention(
            *args,
            2,
            causal=True,
            bias=bias,
            mask=mask,
            key_lengths=[80, 50],
            workers=workers,
            max_memory=2**14,
            return_weights=True,
        )
        mha.multi_head_attention(*args, 2, causal=True, workers=workers, max_memory=2**14)
        q = args[0].reshape(2, 2, 64, 8)
        mha.scaled_dot_product_attention(
            q, q, q, bias=bias[:, :64], return_lse=True, workers=workers, max_memory=2**13
        )

    assert float64_arrays_seen_inside_mha(calls, given=[bias]) == []


def test_the_float64_tracer_can_see_float64_work():
    args = inputs(np.float64)
    assert float64_arrays_seen_inside_mha(lambda: mha.multi_head_attention(*args, 2))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_inputs_are_never_modified(dtype):
    args = inputs(dtype)
    mask = r.random((2, 4, 6)) < 0.8
    bias = r.standard_normal((4, 6))
    key_lengths = np.array([6, 3])
    frozen = [a.copy() for a in (*args, mask, bias, key_lengths)]
    for a in (*args, mask, bias, key_lengths):
        a.flags.writeable = False  # any write into an input raises
    mha.multi_head_attention(
        *args, 2, mask=mask, bias=bias, key_lengths=key_lengths, causal=True, return_weights=True
    )
    q = args[0].reshape(2, 1, 4, 8)
    mha.scaled_dot_product_attention(q, q, q, bias=bias[:, :4], return_weights=True)
    for before, after in zip(frozen, (*args, mask, bias, key_lengths), strict=True):
        np.testing.assert_array_equal(before, after)


def test_the_module_modifies_neither_inputs_nor_weights():
    attention = mha.MultiHeadAttention(8, 2, bias=True, seed=0)
    weights = [attention.W_q, attention.W_k, attention.W_v, attention.W_o, attention.b_o]
    X = r.standard_normal((2, 4, 8))
    for a in (*weights, X):
        a.flags.writeable = False
    attention(X, mask=True, key_lengths=[4, 2])
    attention(X, key=X + 1.0, return_weights=True)
