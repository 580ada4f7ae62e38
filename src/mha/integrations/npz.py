"""mha's own weights file: an ``.npz`` of named arrays and a JSON config, never a pickle.

Written atomically; read back with every entry and shape checked against the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from .._arrays import bfloat16_from_bits, is_bfloat16
from .._files import UnreadableFileError, atomic_write, read_arrays, writable_problem
from ..errors import WeightsFileError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATENT_FORMAT",
    "WEIGHT_NAMES",
    "load",
    "load_latent",
    "save",
    "save_latent",
]

FORMAT = "mha.MultiHeadAttention"
FORMAT_VERSION = 2  # 2 added grouped-query heads, head_dim, rotary, window, single biases
# (the variants' settings and sinks, rope scaling, the scale, QK-norm, the output gate and
# the output norm came later as optional keys: files without them load). bfloat16 weights
# are stored as their uint16 bits.
WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v",
                "sinks", "q_norm", "k_norm", "W_g", "b_g", "q_norm_bias",
                "k_norm_bias", "o_norm", "q_scale")  # fmt: skip


LATENT_FORMAT = "mha.LatentAttention"
"""A :class:`mha.LatentAttention`'s file: its spec's keywords and its weights by name, each
checked by :meth:`mha.LatentAttention.from_spec` when read back."""


def save(path: Any, config: dict[str, Any], weights: dict[str, np.ndarray | None]) -> None:
    """``config`` and the ``weights`` that are not ``None`` as ``.npz``, written atomically."""
    _save(path, {"format": FORMAT, "version": FORMAT_VERSION, **config}, weights)


def save_latent(path: Any, config: dict[str, Any], weights: dict[str, np.ndarray | None]) -> None:
    """A latent-attention layer's ``config`` and ``weights``, as :func:`save` writes them."""
    _save(path, {"format": LATENT_FORMAT, "version": 1, **config}, weights)


def load_latent(path: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The config and weights of a file written by :func:`save_latent` (the layer checks
    every weight's presence and shape against the config)."""
    target = Path(os.fspath(path))
    contents = _contents(target, "an .npz file written by LatentAttention.save()")
    try:
        config = json.loads(str(contents.pop("config")))
        if config.get("format") != LATENT_FORMAT or config.get("version") != 1:
            raise ValueError(
                f"format is {config.get('format')!r} version {config.get('version')!r}, not "
                f"{LATENT_FORMAT!r} version 1"
            )
    except (ValueError, TypeError, AttributeError) as error:
        raise WeightsFileError(f"cannot load {target}: bad config entry ({error})") from None
    return config, _with_bfloat16(target, config, contents)


def _contents(target: Path, what: str) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file ``target``, with its ``config`` entry."""
    try:
        contents = read_arrays(target, what)
    except UnreadableFileError as error:
        raise WeightsFileError(f"cannot load {error}") from None
    if not isinstance(contents, dict):
        raise WeightsFileError(
            f"cannot load {target}: it holds a single array, not an .npz file written by save()"
        )
    if "config" not in contents:
        raise WeightsFileError(f"cannot load {target}: it has no 'config' entry")
    return contents


def _with_bfloat16(
    target: Path, config: dict[str, Any], contents: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``contents`` with the arrays the config names as bfloat16 read back from their bits."""
    held = config.get("bfloat16", [])  # the names of the arrays stored as bfloat16 bits
    if not isinstance(held, list) or not set(held) <= set(contents):
        raise WeightsFileError(f"cannot load {target}: bad config entry (bfloat16={held!r})")
    return contents | {name: _bfloat16(target, contents[name]) for name in held}


def _save(path: Any, config: dict[str, Any], weights: dict[str, np.ndarray | None]) -> None:
    target = Path(os.fspath(path))
    config["bfloat16"] = sorted(  # stored as their bits: NumPy files cannot name the dtype
        name for name, W in weights.items() if W is not None and is_bfloat16(W.dtype)
    )
    entries: dict[str, Any] = {
        name: W.view(np.uint16) if is_bfloat16(W.dtype) else W
        for name, W in weights.items()
        if W is not None
    }
    entries["config"] = np.array(json.dumps(config))
    problem = writable_problem(target)
    if problem:
        raise WeightsFileError(f"cannot save to {target}: {problem}")
    try:
        atomic_write(target, lambda handle: np.savez(handle, **entries))
    except OSError as error:
        raise WeightsFileError(f"cannot save to {target}: {error.strerror or error}") from None


def load(path: Any) -> tuple[dict[str, Any], dict[str, np.ndarray | None]]:
    """The config and weights of a file written by :func:`save`, each entry's presence and
    shape checked against the config, which a damaged array cannot change."""
    target = Path(os.fspath(path))
    contents = _contents(target, "an .npz file written by MultiHeadAttention.save()")
    try:
        config = json.loads(str(contents.pop("config")))
        if config.get("format") != FORMAT:
            raise ValueError(f"format is {config.get('format')!r}, not {FORMAT!r}")
        if config.get("version") not in (1, FORMAT_VERSION):
            raise ValueError(f"format version {config.get('version')} is not 1 or 2")
        config = _upgraded(config)
        expected = _expected_shapes(config)
        missing = [key for key in ("num_heads", "add_zero_attn") if key not in config]
        if missing:
            raise KeyError(f"no {', '.join(missing)}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise WeightsFileError(f"cannot load {target}: bad config entry ({error})") from None
    unknown = sorted(set(contents) - set(WEIGHT_NAMES))
    if unknown:
        raise WeightsFileError(f"cannot load {target}: unexpected entries {unknown}")
    summary = ", ".join(
        f"{key}={config[key]}"
        for key in ("d_model", "num_heads", "num_kv_heads", "head_dim", "kdim", "vdim")
    )
    for name in WEIGHT_NAMES:  # against the config, which a damaged array cannot change
        shape = expected.get(name)
        if (name in contents) != (shape is not None):
            state = "has" if name in contents else "lacks"
            raise WeightsFileError(
                f"cannot load {target}: it {state} {name}, which its config "
                f"(biases={config['biases']}, add_bias_kv={config['add_bias_kv']}) "
                f"{'does not call for' if name in contents else 'calls for'}"
            )
        if shape is not None and contents[name].shape != shape:
            raise WeightsFileError(
                f"cannot load {target}: {name} has shape {contents[name].shape} but its config "
                f"({summary}) calls for {shape}"
            )
    contents = _with_bfloat16(target, config, contents)
    return config, {name: contents.get(name) for name in WEIGHT_NAMES}


def _bfloat16(target: Path, bits: np.ndarray) -> np.ndarray:
    """bfloat16 weights from their stored bits (ml_dtypes holds them in NumPy)."""
    try:
        import ml_dtypes  # noqa: F401  (a file of bfloat16 weights loads as bfloat16 or not at all)
    except ImportError:
        raise WeightsFileError(
            f"cannot load {target}: its weights are bfloat16, which NumPy holds only with "
            "ml_dtypes (pip install ml_dtypes)"
        ) from None
    if bits.dtype != np.uint16:
        raise WeightsFileError(f"cannot load {target}: bfloat16 weights stored as {bits.dtype}")
    return bfloat16_from_bits(bits)


def _upgraded(config: dict[str, Any]) -> dict[str, Any]:
    """A version-1 config with version 2's keys at the values version 1 implied."""
    if config["version"] != 1:
        return config
    heads = int(config["num_heads"])
    return {
        **config,
        "num_kv_heads": heads,
        "head_dim": int(config["d_model"]) // heads,
        "biases": ["b_q", "b_k", "b_v", "b_o"] if config["bias"] else [],
        "rope_theta": None,
        "rotary_dim": None,
        "rotary_interleaved": False,
        "window": None,
    }


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every weight a file with this config holds."""
    E, kdim, vdim = (int(config[key]) for key in ("d_model", "kdim", "vdim"))
    qdim = int(config.get("qdim") or E)  # (later files: optional)
    inner = int(config["num_heads"]) * int(config["head_dim"])
    kv_inner = int(config["num_kv_heads"]) * int(config["head_dim"])
    v_head_dim = int(config.get("v_head_dim") or config["head_dim"])  # (later files: optional)
    v_inner, joined = (
        int(config["num_kv_heads"]) * v_head_dim,
        int(config["num_heads"]) * v_head_dim,
    )
    shapes = {
        "W_q": (qdim, inner),
        "W_k": (kdim, kv_inner),
        "W_v": (vdim, v_inner),
        "W_o": (joined, E),
    }
    widths = {"b_q": inner, "b_k": kv_inner, "b_v": v_inner, "b_o": E}
    vectors: dict[str, tuple[int, ...]] = {
        name: (widths[name],) for name in config["biases"] if name in widths
    }
    if config["add_bias_kv"]:
        vectors |= {"bias_k": (kv_inner,), "bias_v": (v_inner,)}
    if config.get("sinks"):
        vectors["sinks"] = (int(config["num_heads"]),)
    if config.get("qk_norm") is not None:
        d, H, H_kv = (int(config[key]) for key in ("head_dim", "num_heads", "num_kv_heads"))
        q, k = {"all": ((inner,), (kv_inner,)), "each_head": ((H, d), (H_kv, d))}.get(
            config["qk_norm"], ((d,), (d,))
        )
        vectors |= {"q_norm": q, "k_norm": k}
        if "q_norm_bias" in config.get("biases", []):
            vectors |= {"q_norm_bias": q, "k_norm_bias": k}
    if config.get("output_gate") is not None:
        gates = int(config["num_heads"]) if config.get("output_gate_per_head") else joined
        shapes["W_g"] = (qdim, gates)
        if "b_g" in config.get("biases", []):
            vectors["b_g"] = (gates,)
    if config.get("output_norm") == "rms":
        vectors["o_norm"] = (joined,)
    if config.get("q_scale"):
        vectors["q_scale"] = (inner,)
    return {**shapes, **vectors}
