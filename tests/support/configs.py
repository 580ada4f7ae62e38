"""Random, non-degenerate attention configurations shared by the oracle tests and fixtures.

A configuration is a plain dict: ``arrays`` (inputs and weights, float64), ``num_heads``,
``kwargs`` (the masking keywords and ``scale``) and ``layout`` facts used by the oracles.
Every mask kind is drawn independently, so their combinations appear too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MASK_SHAPES = ("L,S", "B,L,S", "B,H,L,S", "1,H,L,S", "B,1,1,S", "S")


def random_config(
    seed: int, *, torch_module_layout: bool = False, tiny: bool = False, long: bool = False
) -> dict[str, Any]:
    """One random configuration.

    ``torch_module_layout`` keeps to what nn.MultiheadAttention takes (one width E for the
    query, the heads and the output); ``tiny`` keeps sizes small enough for plain loops;
    ``long`` draws sequences up to 48 positions, for tiling.
    """
    rng = np.random.default_rng(seed)
    top = (
        {"B": 4, "H": 4, "d": 4, "L": 6, "width": 8}
        if tiny
        else {"B": 9, "H": 17, "d": 9, "L": 13, "width": 25}
    )
    if torch_module_layout:
        top["H"] = min(top["H"], 9)
    if long:  # many tiles: longer sequences, fewer heads
        top.update({"L": 49, "H": 5, "B": 4})
    B = int(rng.integers(1, top["B"]))
    H = int(rng.integers(1, top["H"]))
    d_k = int(rng.integers(1, top["d"]))
    d_v = d_k if torch_module_layout else int(rng.integers(1, top["d"]))
    L = int(rng.integers(1, top["L"]))
    S = int(rng.integers(1, top["L"]))
    E = H * d_k
    d_q = E if torch_module_layout else int(rng.integers(1, top["width"]))
    d_kin = int(rng.integers(1, top["width"]))
    d_vin = d_kin if rng.random() < 0.3 else int(rng.integers(1, top["width"]))
    d_out = E if torch_module_layout else int(rng.integers(1, top["width"]))
    unbatched = (not torch_module_layout) and rng.random() < 0.15
    batch = () if unbatched else (B,)

    arrays = {
        "Q": rng.standard_normal((*batch, L, d_q)),
        "K": rng.standard_normal((*batch, S, d_kin)),
        "V": rng.standard_normal((*batch, S, d_vin)),
        "W_q": rng.standard_normal((d_q, E)) / np.sqrt(d_q),
        "W_k": rng.standard_normal((d_kin, E)) / np.sqrt(d_kin),
        "W_v": rng.standard_normal((d_vin, H * d_v)) / np.sqrt(d_vin),
        "W_o": rng.standard_normal((H * d_v, d_out)) / np.sqrt(H * d_v),
    }
    if rng.random() < 0.5:
        arrays["b_q"] = rng.standard_normal(E)
        arrays["b_k"] = rng.standard_normal(E)
        arrays["b_v"] = rng.standard_normal(H * d_v)
        arrays["b_o"] = rng.standard_normal(d_out)

    kwargs: dict[str, Any] = {}
    if rng.random() < 0.4:
        shape_name = MASK_SHAPES[int(rng.integers(len(MASK_SHAPES)))]
        if unbatched and (shape_name.startswith("B") or shape_name.count(",") == 3):
            shape_name = shape_name.split(",", 1)[1]  # no batch axis without a batch
        sizes = {"B": B, "H": H, "L": L, "S": S, "1": 1}
        shape = tuple(sizes[axis] for axis in shape_name.split(","))
        kwargs["mask"] = rng.random(shape) < 0.75
    if rng.random() < 0.4:
        kwargs["causal"] = True
        kwargs["causal_alignment"] = ("bottom_right", "top_left")[int(rng.integers(2))]
    if rng.random() < 0.4:
        kwargs["key_lengths"] = rng.integers(0 if rng.random() < 0.3 else 1, S + 1, size=batch)
    if rng.random() < 0.3 and not torch_module_layout:
        kwargs["query_lengths"] = rng.integers(0, L + 1, size=batch)
    if rng.random() < 0.3:
        bias_shape = (*batch, H, L, S) if rng.random() < 0.5 else (L, S)
        bias = rng.standard_normal(bias_shape)
        if rng.random() < 0.5:
            bias[rng.random(bias_shape) < 0.2] = -np.inf
        kwargs["bias"] = bias
    if rng.random() < 0.2 and not torch_module_layout:  # the module has no scale
        kwargs["scale"] = float(rng.uniform(0.05, 2.0))

    return {
        "seed": seed,
        "arrays": arrays,
        "num_heads": H,
        "kwargs": kwargs,
        "layout": {"B": B, "H": H, "L": L, "S": S, "d_k": d_k, "d_v": d_v, "unbatched": unbatched},
    }


def with_dtype(config: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """The same configuration with every data array cast to ``dtype`` (masks untouched)."""
    arrays = {name: array.astype(dtype) for name, array in config["arrays"].items()}
    return {**config, "arrays": arrays}


def call_args(config: dict[str, Any]) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Positional arguments and keywords for ``mha.multi_head_attention``."""
    a = config["arrays"]
    positional = [a["Q"], a["K"], a["V"], a["W_q"], a["W_k"], a["W_v"], a["W_o"]]
    keywords = dict(config["kwargs"])
    keywords.update({name: a[name] for name in ("b_q", "b_k", "b_v", "b_o") if name in a})
    return positional, keywords


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max |actual - expected| / max |expected|`` (1 when ``expected`` is all zero)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.size == 0:
        return 0.0
    scale = float(np.max(np.abs(expected)))
    return float(np.max(np.abs(actual - expected))) / (scale if scale > 0 else 1.0)
