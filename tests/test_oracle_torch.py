"""mha against PyTorch on hundreds of random configurations, float64 and float32.

Every mask kind and their combinations, biases, L != S, different input widths, batch 1-8,
heads 1-16. The oracles are ``F.scaled_dot_product_attention`` with an explicit mask and
``torch.nn.MultiheadAttention`` with the weights copied in.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import call_args, random_config, relative_error, with_dtype
from support.torch_oracle import module_oracle, sdpa_oracle

import mha

SDPA_SEEDS = range(300)
MODULE_SEEDS = range(1000, 1150)
TOLERANCE = {np.float64: 1e-12, np.float32: 2e-5}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("seed", SDPA_SEEDS)
def test_matches_torch_sdpa(torch, record_error, seed, dtype):
    config = with_dtype(random_config(seed), dtype)
    expected_out, expected_weights = sdpa_oracle(config, torch)  # float64, from the same inputs
    positional, keywords = call_args(config)
    out, weights = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_weights=True
    )
    assert out.dtype == dtype and weights.dtype == dtype
    name = np.dtype(dtype).name
    assert (
        record_error(f"torch SDPA, output, {name}", relative_error(out, expected_out))
        <= (TOLERANCE[dtype])
    )
    assert (
        record_error(f"torch SDPA, weights, {name}", relative_error(weights, expected_weights))
        <= TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("seed", MODULE_SEEDS)
def test_matches_torch_multihead_attention_module(torch, record_error, seed, dtype):
    config = with_dtype(random_config(seed, torch_module_layout=True), dtype)
    expected_out, expected_weights, sees_a_key = module_oracle(config, torch)
    positional, keywords = call_args(config)
    out, weights = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_weights=True
    )
    # torch gives NaN for a query row that sees no key (in any head); the contract says
    # zero weights there, and a zero attention output for that head.
    rows = sees_a_key.all(axis=1)  # (B, L): every head of this row sees a key
    name = np.dtype(dtype).name
    assert (
        record_error(
            f"torch nn.MultiheadAttention, output, {name}",
            relative_error(out[rows], expected_out[rows]),
        )
        <= TOLERANCE[dtype]
    )
    visible = np.broadcast_to(sees_a_key[..., None], weights.shape)
    assert (
        record_error(
            f"torch nn.MultiheadAttention, weights, {name}",
            relative_error(weights[visible], expected_weights[visible]),
        )
        <= TOLERANCE[dtype]
    )
    assert np.all(weights[~visible] == 0)
    assert not np.isnan(out).any()
