"""mha against the plain-loop reference (one batch entry, head and query at a time)."""

from __future__ import annotations

import pytest
from support.configs import call_args, random_config, relative_error
from support.reference import loop_multi_head_attention

import mha


@pytest.mark.parametrize("seed", range(2000, 2060))
def test_matches_plain_loops(seed, record_error):
    config = random_config(seed, tiny=True)
    expected_out, expected_weights = loop_multi_head_attention(config)
    positional, keywords = call_args(config)
    out, weights = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_weights=True
    )
    assert record_error("plain loops, output, float64", relative_error(out, expected_out)) <= 1e-12
    assert (
        record_error("plain loops, weights, float64", relative_error(weights, expected_weights))
        <= 1e-12
    )


def test_plain_loops_agree_with_torch_on_the_same_configurations(torch):
    """The two oracles check each other, so neither can drift unnoticed."""
    from support.torch_oracle import sdpa_oracle

    for seed in range(2000, 2020):
        config = random_config(seed, tiny=True)
        loop_out, loop_weights = loop_multi_head_attention(config)
        torch_out, torch_weights = sdpa_oracle(config, torch)
        assert relative_error(loop_out, torch_out) <= 1e-12
        assert relative_error(loop_weights, torch_weights) <= 1e-12
