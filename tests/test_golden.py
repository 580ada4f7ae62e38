"""mha against PyTorch's answers stored by scripts/make_golden.py: runs without torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.configs import call_args, relative_error, with_dtype

import mha

GOLDEN = Path(__file__).parent / "golden" / "torch_sdpa_golden.npz"


def load_golden() -> list[dict]:
    with np.load(GOLDEN, allow_pickle=False) as data:
        seeds = json.loads(str(data["about"]))["seeds"]
        configs = []
        for seed in seeds:
            prefix = f"{seed}/"
            meta = json.loads(str(data[prefix + "meta"]))
            arrays = {
                key[len(prefix + "arrays/") :]: data[key]
                for key in data.files
                if key.startswith(prefix + "arrays/")
            }
            kwargs = {
                key[len(prefix + "kwargs/") :]: data[key]
                for key in data.files
                if key.startswith(prefix + "kwargs/")
            }
            kwargs.update(meta.get("scalar_kwargs", {}))
            configs.append(
                {
                    "seed": seed,
                    "arrays": arrays,
                    "kwargs": kwargs,
                    "num_heads": meta["num_heads"],
                    "layout": meta["layout"],
                    "expected": (data[prefix + "expected/out"], data[prefix + "expected/weights"]),
                }
            )
    return configs


CONFIGS = load_golden()


def test_golden_file_covers_the_mask_kinds():
    kinds = {kind for config in CONFIGS for kind in config["kwargs"]}
    assert {"mask", "causal", "key_lengths", "query_lengths", "bias", "scale"} <= kinds
    assert any(config["layout"]["unbatched"] for config in CONFIGS)
    assert any(not config["expected"][1].any(axis=-1).all() for config in CONFIGS), (
        "some configuration should have a query row that sees no key"
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: str(config["seed"]))
def test_matches_golden_torch_answers(config, dtype, record_error):
    tolerance = 1e-12 if dtype == np.float64 else 2e-5
    expected_out, expected_weights = config["expected"]
    positional, keywords = call_args(with_dtype(config, dtype))
    out, weights = mha.multi_head_attention(
        *positional, config["num_heads"], **keywords, return_weights=True
    )
    name = np.dtype(dtype).name
    assert record_error(f"golden, output, {name}", relative_error(out, expected_out)) <= tolerance
    assert (
        record_error(f"golden, weights, {name}", relative_error(weights, expected_weights))
        <= tolerance
    )
