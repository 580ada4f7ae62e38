"""mha.torch_compat.multi_head_attention_forward against torch's own function."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from support.configs import relative_error

from mha import AttentionError
from mha.torch_compat import multi_head_attention_forward


def compat_case(seed):
    """Random arguments in the spirit of PyTorch's own multi-head attention tests."""
    rng = np.random.default_rng(seed)
    N, L, S = int(rng.integers(1, 6)), int(rng.integers(1, 10)), int(rng.integers(1, 10))
    H = int(rng.choice([2, 4, 6, 8]))
    head_dim = int(rng.integers(1, 7))
    E = H * head_dim
    separate = rng.random() < 0.4
    kdim, vdim = (int(rng.integers(1, 12)), int(rng.integers(1, 12))) if separate else (E, E)
    unbatched = rng.random() < 0.15
    if unbatched:
        N = 1
    static = rng.random() < 0.15
    bias_kv = (not static) and rng.random() < 0.3
    args = {
        "query": rng.standard_normal((L, N, E)),
        "key": rng.standard_normal((S, N, kdim)),
        "value": rng.standard_normal((S, N, vdim)),
        "embed_dim_to_check": E,
        "num_heads": H,
        "in_proj_weight": None if separate else rng.standard_normal((3 * E, E)) / np.sqrt(E),
        "in_proj_bias": rng.standard_normal(3 * E) if rng.random() < 0.7 else None,
        "bias_k": rng.standard_normal((1, 1, E)) if bias_kv else None,
        "bias_v": rng.standard_normal((1, 1, E)) if bias_kv else None,
        "add_zero_attn": bool(rng.random() < 0.3),
        "dropout_p": 0.0,
        "out_proj_weight": rng.standard_normal((E, E)) / np.sqrt(E),
        "out_proj_bias": rng.standard_normal(E) if rng.random() < 0.7 else None,
        "training": bool(rng.random() < 0.5),
        "need_weights": bool(rng.random() < 0.7),
        "average_attn_weights": bool(rng.random() < 0.5),
        "use_separate_proj_weight": separate,
    }
    if separate:
        args["q_proj_weight"] = rng.standard_normal((E, E)) / np.sqrt(E)
        args["k_proj_weight"] = rng.standard_normal((E, kdim)) / np.sqrt(kdim)
        args["v_proj_weight"] = rng.standard_normal((E, vdim)) / np.sqrt(vdim)
    S_keys = S  # static keys may be longer or shorter than the projected ones (a cache)
    if static:
        S_keys = S if rng.random() < 0.5 else int(rng.integers(1, 10))
        args["static_k"] = rng.standard_normal((N * H, S_keys, head_dim))
        args["static_v"] = rng.standard_normal((N * H, S_keys, head_dim))
    if rng.random() < 0.4:
        padded = rng.random((N, S_keys)) < 0.3
        if rng.random() < 0.5:
            args["key_padding_mask"] = padded  # torch polarity: True = padding
        else:
            args["key_padding_mask"] = np.where(padded, -np.inf, rng.standard_normal((N, S_keys)))
    if rng.random() < 0.5 and S_keys == S:  # torch checks attn_mask against the key's S
        kind = int(rng.integers(4))
        if kind == 0:
            args["attn_mask"] = rng.random((L, S)) < 0.3  # True = may not attend
        elif kind == 1:
            args["attn_mask"] = rng.random((N * H, L, S)) < 0.3
        elif kind == 2:
            args["attn_mask"] = rng.standard_normal((L, S))  # a float mask is added
        else:
            args["attn_mask"] = np.triu(np.ones((L, S), dtype=bool), k=1)
            args["is_causal"] = True
    if unbatched:
        for name in ("query", "key", "value"):
            args[name] = args[name][:, 0]
        if "key_padding_mask" in args:
            args["key_padding_mask"] = args["key_padding_mask"][0]
    return args


def torch_forward(args, torch):
    def tensor(value):
        return (
            torch.from_numpy(np.ascontiguousarray(value))
            if isinstance(value, np.ndarray)
            else value
        )

    converted = {name: tensor(value) for name, value in args.items()}
    with warnings.catch_warnings():  # torch deprecates mixing bool and float masks
        warnings.filterwarnings("ignore", message="Support for mismatched", category=UserWarning)
        out, weights = torch.nn.functional.multi_head_attention_forward(**converted)
    return out.numpy(), None if weights is None else weights.numpy()


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("seed", range(200))
def test_matches_torch_multi_head_attention_forward(seed, dtype, torch, record_error):
    args = compat_case(seed)

    def cast(value):
        return (
            value.astype(dtype) if isinstance(value, np.ndarray) and value.dtype != bool else value
        )

    args = {name: cast(value) for name, value in args.items()}
    expected_out, expected_weights = torch_forward(args, torch)
    out, weights = multi_head_attention_forward(**args)
    assert out.shape == expected_out.shape and out.dtype == dtype
    assert np.isfinite(out).all()
    rows = np.isfinite(expected_out).all(axis=-1)  # torch: NaN where a row sees no key
    tolerance = 1e-10 if dtype == np.float64 else 2e-5
    name = np.dtype(dtype).name
    assert (
        record_error(
            f"torch_compat vs torch, output, {name}", relative_error(out[rows], expected_out[rows])
        )
        <= tolerance
    )
    if expected_weights is None:
        assert weights is None
    else:
        assert weights.shape == expected_weights.shape
        finite = np.isfinite(expected_weights)
        assert relative_error(weights[finite], expected_weights[finite]) <= tolerance
        assert np.all(weights[~finite] == 0)


def test_the_cases_cover_every_option():
    cases = [compat_case(seed) for seed in range(200)]
    for name in ("static_k", "key_padding_mask", "attn_mask", "is_causal", "q_proj_weight"):
        assert any(name in case for case in cases), name
    assert any(
        "static_k" in case and case["static_k"].shape[1] != case["key"].shape[0] for case in cases
    )
    assert any(case["bias_k"] is not None for case in cases)
    assert any(case["add_zero_attn"] for case in cases)
    assert any(case["query"].ndim == 2 for case in cases)
    assert any("attn_mask" in case and case["attn_mask"].dtype.kind == "f" for case in cases)


def test_dropout_uses_the_generator_and_keeps_the_output_consistent():
    rng = np.random.default_rng(0)
    L, N, E, H = 30, 4, 16, 4
    x = rng.standard_normal((L, N, E))
    W_in, W_out = rng.standard_normal((3 * E, E)) / 4, rng.standard_normal((E, E)) / 4
    args = {
        "query": x, "key": x, "value": x, "embed_dim_to_check": E, "num_heads": H,
        "in_proj_weight": W_in, "in_proj_bias": None, "bias_k": None, "bias_v": None,
        "add_zero_attn": False, "dropout_p": 0.4, "out_proj_weight": W_out,
        "out_proj_bias": None, "training": True, "average_attn_weights": False,
    }  # fmt: skip
    out, dropped = multi_head_attention_forward(**args, generator=np.random.default_rng(7))
    again, _ = multi_head_attention_forward(**args, generator=np.random.default_rng(7))
    np.testing.assert_array_equal(out, again)
    _, kept = multi_head_attention_forward(**(args | {"training": False}))
    assert abs((dropped == 0).mean() - 0.4) < 0.02  # every weight here is positive
    survivors = dropped > 0
    np.testing.assert_allclose(dropped[survivors], kept[survivors] / 0.6, rtol=1e-12)
    v = (x @ W_in[2 * E :].T).reshape(L, N, H, E // H).transpose(1, 2, 0, 3)  # (N, H, L, d)
    heads = (dropped @ v).transpose(2, 0, 1, 3).reshape(L, N, E)
    np.testing.assert_allclose(out, heads @ W_out.T, rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_are_zero_where_torch_gives_nan(torch):
    args = next(case for case in map(compat_case, range(100)) if "static_k" not in case)
    L, S = args["query"].shape[0], args["key"].shape[0]
    args.pop("is_causal", None)
    mask = np.zeros((L, S), dtype=bool)
    mask[0] = True  # the first query may attend to nothing
    args.update(attn_mask=mask, bias_k=None, bias_v=None, add_zero_attn=False, need_weights=True)
    expected, _ = torch_forward(args, torch)
    out, _ = multi_head_attention_forward(**args)
    assert np.isnan(expected[0]).all() and np.isfinite(out).all()
    bias = args["out_proj_bias"] if args["out_proj_bias"] is not None else 0.0
    np.testing.assert_allclose(out[0], np.broadcast_to(bias, out[0].shape), rtol=1e-12)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"embed_dim_to_check": 5}, r"embed_dim_to_check is 5"),
        ({"num_heads": 0}, r"num_heads must be a positive integer"),
        ({"attn_mask": np.ones((2, 2), dtype=np.int64)}, r"attn_mask must have shape"),
        ({"attn_mask": np.ones((3, 4), dtype=np.int64)}, r"attn_mask must be boolean .* polarity"),
        ({"key_padding_mask": np.zeros((1, 5), bool)}, r"key_padding_mask must have shape"),
        ({"is_causal": True}, r"is_causal is a hint .* pass attn_mask"),
        ({"bias_k": np.zeros((1, 1, 8))}, r"bias_k and bias_v go together"),
        ({"in_proj_weight": np.zeros((8, 8))}, r"in_proj_weight must have shape \(24, 8\)"),
        ({"dropout_p": 1.5}, r"dropout_p must be between 0 and 1"),
    ],
)
def test_errors(change, message):
    rng = np.random.default_rng(0)
    args = {
        "query": rng.standard_normal((3, 2, 8)), "key": rng.standard_normal((4, 2, 8)),
        "value": rng.standard_normal((4, 2, 8)), "embed_dim_to_check": 8, "num_heads": 2,
        "in_proj_weight": rng.standard_normal((24, 8)), "in_proj_bias": None, "bias_k": None,
        "bias_v": None, "add_zero_attn": False, "dropout_p": 0.0,
        "out_proj_weight": rng.standard_normal((8, 8)), "out_proj_bias": None,
    }  # fmt: skip
    with pytest.raises(AttentionError, match=message):
        multi_head_attention_forward(**(args | change))
