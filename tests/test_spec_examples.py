"""The specification's example configurations: (1, 3, 4) with 2 heads, (1, 2, 4) with 1 head,
(2, 2, 4) with 2 heads. Its text gives outputs but not inputs, so these check shape, dtype and
the computation against both oracles on seeded inputs."""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import relative_error
from support.reference import loop_multi_head_attention
from support.torch_oracle import sdpa_oracle

import mha

EXAMPLES = [((1, 3, 4), 2), ((1, 2, 4), 1), ((2, 2, 4), 2)]


def example(shape, heads, causal):
    rng = np.random.default_rng(sum(shape) * 10 + heads)
    Q, K, V = (rng.standard_normal(shape) for _ in range(3))
    W = {name: rng.standard_normal((4, 4)) for name in ("W_q", "W_k", "W_v", "W_o")}
    B, L, _ = shape
    return {
        "arrays": {"Q": Q, "K": K, "V": V, **W},
        "num_heads": heads,
        "kwargs": {"causal": True} if causal else {},
        "layout": {
            "B": B,
            "H": heads,
            "L": L,
            "S": L,
            "d_k": 4 // heads,
            "d_v": 4 // heads,
            "unbatched": False,
        },
    }


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("shape", "heads"), EXAMPLES, ids=str)
def test_specification_example(shape, heads, causal, record_error):
    config = example(shape, heads, causal)
    a = config["arrays"]
    out = mha.multi_head_attention(
        a["Q"],
        a["K"],
        a["V"],
        a["W_q"],
        a["W_k"],
        a["W_v"],
        a["W_o"],
        heads,
        mask=True if causal else None,
    )
    assert out.shape == shape and out.dtype == np.float64
    loop_out, _ = loop_multi_head_attention(config)
    assert record_error("spec examples vs plain loops", relative_error(out, loop_out)) <= 1e-12


@pytest.mark.parametrize(("shape", "heads"), EXAMPLES, ids=str)
def test_specification_example_against_torch(shape, heads, torch, record_error):
    for causal in (False, True):
        config = example(shape, heads, causal)
        a = config["arrays"]
        out = mha.multi_head_attention(*a.values(), heads, causal=causal)
        torch_out, _ = sdpa_oracle(config, torch)
        assert record_error("spec examples vs torch", relative_error(out, torch_out)) <= 1e-12


@pytest.mark.parametrize(("shape", "heads"), EXAMPLES, ids=str)
def test_specification_class_form(shape, heads):
    attention = mha.MultiHeadAttention(4, heads, seed=0)
    X = np.random.default_rng(1).standard_normal(shape)
    out = attention.forward(X, mask=True)
    assert out.shape == shape and out.dtype == np.float64
    # the first position attends only to itself, so its output is its own value, projected
    v0 = X[:, 0] @ attention.W_v @ attention.W_o
    np.testing.assert_allclose(out[:, 0], v0, rtol=1e-13)
