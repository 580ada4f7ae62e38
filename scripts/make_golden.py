"""Write the golden fixtures: random configurations and PyTorch's answers for them.

    python scripts/make_golden.py        # needs torch==2.13.0; rewrites tests/golden/

The suite compares mha against these files, so it checks the oracle's answers even where
torch is not installed. Inputs and answers are stored in float64; masks as booleans;
everything is read back with allow_pickle=False.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.configs import random_config  # noqa: E402
from support.torch_oracle import sdpa_oracle  # noqa: E402

SEEDS = range(5000, 5080)
OUTPUT = ROOT / "tests" / "golden" / "torch_sdpa_golden.npz"


def main() -> None:
    entries: dict[str, np.ndarray] = {}
    for seed in SEEDS:
        config = random_config(seed)
        out, weights = sdpa_oracle(config, torch)
        prefix = f"{seed}/"
        for name, array in config["arrays"].items():
            entries[prefix + "arrays/" + name] = array
        meta = {"num_heads": config["num_heads"], "layout": config["layout"]}
        for name, value in config["kwargs"].items():
            if isinstance(value, np.ndarray):
                entries[prefix + "kwargs/" + name] = value
            else:
                meta.setdefault("scalar_kwargs", {})[name] = value
        entries[prefix + "meta"] = np.array(json.dumps(meta))
        entries[prefix + "expected/out"] = out
        entries[prefix + "expected/weights"] = weights
    entries["about"] = np.array(
        json.dumps({"torch": torch.__version__, "numpy": np.__version__, "seeds": list(SEEDS)})
    )
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=OUTPUT.parent, suffix=".npz", delete=False) as handle:
        np.savez_compressed(handle, **entries)
    os.replace(handle.name, OUTPUT)
    print(
        f"wrote {len(SEEDS)} configurations to {OUTPUT.relative_to(ROOT)} "
        f"({OUTPUT.stat().st_size / 1024:.0f} KiB) with torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
