"""Weights from elsewhere and weights on disk: PyTorch state dicts, GPT-2, ``.npz`` files.

PyTorch keeps weights as ``(out, in)`` for ``x @ W.T``; mha keeps ``(in, out)`` for
``x @ W``, so every matrix is transposed on the way in and out. torch is imported only to
read a module (``from_torch(module)``); state dicts of tensors are read through their
``.detach().cpu().numpy()`` and NumPy arrays are taken as they are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._arrays import as_float_array, positive_int
from ._files import UnreadableFileError, atomic_write, read_arrays, writable_problem
from .errors import AttentionValueError, ShapeError, WeightsFileError

if TYPE_CHECKING:
    from .module import MultiHeadAttention

FORMAT = "mha.MultiHeadAttention"
FORMAT_VERSION = 1
WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")


def from_torch(
    cls: type[MultiHeadAttention], source: Any, num_heads: int | None, add_zero_attn: bool | None
) -> MultiHeadAttention:
    if hasattr(source, "state_dict") and hasattr(source, "num_heads"):  # an nn.Module
        if num_heads is not None and num_heads != source.num_heads:
            raise AttentionValueError(
                f"num_heads={num_heads} but the module has num_heads={source.num_heads}"
            )
        num_heads = source.num_heads
        if add_zero_attn is None:
            add_zero_attn = bool(source.add_zero_attn)
        state = source.state_dict()
    elif isinstance(source, dict):
        state = source
        if num_heads is None:
            raise AttentionValueError(
                "a state dict does not record the number of heads: pass num_heads="
            )
    else:
        raise AttentionValueError(
            "from_torch takes a torch.nn.MultiheadAttention or its state_dict(); "
            f"got {type(source).__name__}"
        )
    weights = _weights_from_state(state)
    return cls._from_weights(weights, num_heads, bool(add_zero_attn), "state dict")


def _weights_from_state(state: dict[str, Any]) -> dict[str, np.ndarray | None]:
    """Check a ``nn.MultiheadAttention`` state dict and turn it into mha's layout."""
    arrays = {name: _numpy(name, value) for name, value in state.items()}
    packed = {"in_proj_weight"}
    separate = {"q_proj_weight", "k_proj_weight", "v_proj_weight"}
    known = packed | separate | {"in_proj_bias", "out_proj.weight", "out_proj.bias"}
    known |= {"bias_k", "bias_v"}
    unknown = sorted(set(arrays) - known)
    if unknown:
        raise AttentionValueError(
            f"state dict has keys that nn.MultiheadAttention does not: {unknown}"
        )
    if "out_proj.weight" not in arrays:
        raise AttentionValueError("state dict has no 'out_proj.weight'")
    W_o = _matrix(arrays, "out_proj.weight", None)
    E = W_o.shape[1]
    if "in_proj_weight" in arrays:
        if separate & set(arrays):
            raise AttentionValueError(
                "state dict has both 'in_proj_weight' and separate q/k/v_proj_weight"
            )
        packed_weight = _matrix(arrays, "in_proj_weight", (3 * E, E))
        W_q, W_k, W_v = packed_weight[:E], packed_weight[E : 2 * E], packed_weight[2 * E :]
    elif separate <= set(arrays):
        W_q = _matrix(arrays, "q_proj_weight", (E, E))
        W_k = _matrix(arrays, "k_proj_weight", (E, None))
        W_v = _matrix(arrays, "v_proj_weight", (E, None))
    else:
        missing = sorted(separate - set(arrays))
        raise AttentionValueError(
            f"state dict has neither 'in_proj_weight' nor all of q/k/v_proj_weight "
            f"(missing {missing})"
        )
    if W_o.shape != (E, E):
        raise ShapeError(f"state dict: out_proj.weight has shape {W_o.shape}; expected {(E, E)}")
    weights: dict[str, np.ndarray | None] = {
        "W_q": W_q.T, "W_k": W_k.T, "W_v": W_v.T, "W_o": W_o.T,
    }  # fmt: skip
    has_in_bias, has_out_bias = "in_proj_bias" in arrays, "out_proj.bias" in arrays
    if has_in_bias != has_out_bias:
        raise AttentionValueError(
            "state dict has only one of 'in_proj_bias' and 'out_proj.bias'; "
            "nn.MultiheadAttention has both or neither"
        )
    if has_in_bias:
        in_bias = _vector(arrays, "in_proj_bias", 3 * E)
        weights.update(b_q=in_bias[:E], b_k=in_bias[E : 2 * E], b_v=in_bias[2 * E :])
        weights["b_o"] = _vector(arrays, "out_proj.bias", E)
    if ("bias_k" in arrays) != ("bias_v" in arrays):
        raise AttentionValueError("state dict has only one of 'bias_k' and 'bias_v'")
    for name in ("bias_k", "bias_v"):
        if name in arrays:
            if arrays[name].shape != (1, 1, E):
                raise ShapeError(
                    f"state dict: {name} has shape {arrays[name].shape}; expected {(1, 1, E)}"
                )
            weights[name] = arrays[name].reshape(E)
    return weights


def to_torch_state_dict(module: MultiHeadAttention) -> dict[str, np.ndarray]:
    state: dict[str, np.ndarray] = {}
    E = module.d_model
    if module.kdim == E and module.vdim == E:
        state["in_proj_weight"] = np.concatenate([module.W_q.T, module.W_k.T, module.W_v.T])
    else:
        state["q_proj_weight"] = module.W_q.T.copy()
        state["k_proj_weight"] = module.W_k.T.copy()
        state["v_proj_weight"] = module.W_v.T.copy()
    if module.b_q is not None and module.b_k is not None and module.b_v is not None:
        state["in_proj_bias"] = np.concatenate([module.b_q, module.b_k, module.b_v])
    if module.bias_k is not None and module.bias_v is not None:
        state["bias_k"] = module.bias_k.reshape(1, 1, E).copy()
        state["bias_v"] = module.bias_v.reshape(1, 1, E).copy()
    state["out_proj.weight"] = module.W_o.T.copy()
    if module.b_o is not None:
        state["out_proj.bias"] = module.b_o.copy()
    return state


def to_torch(module: MultiHeadAttention, batch_first: bool) -> Any:
    import torch

    dtype = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}.get(
        module.dtype, torch.float64
    )
    target = torch.nn.MultiheadAttention(
        module.d_model, module.num_heads, bias=module.has_bias,
        add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn,
        kdim=module.kdim, vdim=module.vdim, batch_first=batch_first, dtype=dtype,
    )  # fmt: skip
    target.load_state_dict(module.to_torch_state_dict(tensors=True))
    return target.eval()


def from_gpt2(
    cls: type[MultiHeadAttention],
    c_attn_weight: Any,
    c_attn_bias: Any,
    c_proj_weight: Any,
    c_proj_bias: Any,
    num_heads: int,
) -> MultiHeadAttention:
    W = as_float_array("c_attn_weight", c_attn_weight)
    if W.ndim != 2 or W.shape[1] != 3 * W.shape[0]:
        raise ShapeError(f"c_attn_weight must have shape (E, 3E); got {W.shape}")
    E = W.shape[0]
    b = as_float_array("c_attn_bias", c_attn_bias)
    W_o = as_float_array("c_proj_weight", c_proj_weight)
    b_o = as_float_array("c_proj_bias", c_proj_bias)
    for name, array, shape in (
        ("c_attn_bias", b, (3 * E,)), ("c_proj_weight", W_o, (E, E)), ("c_proj_bias", b_o, (E,)),
    ):  # fmt: skip
        if array.shape != shape:
            raise ShapeError(
                f"{name} must have shape {shape} to match c_attn_weight {W.shape}; "
                f"got {array.shape}"
            )
    weights: dict[str, np.ndarray | None] = {
        "W_q": W[:, :E], "W_k": W[:, E : 2 * E], "W_v": W[:, 2 * E :], "W_o": W_o,
        "b_q": b[:E], "b_k": b[E : 2 * E], "b_v": b[2 * E :], "b_o": b_o,
    }  # fmt: skip
    return cls._from_weights(weights, positive_int("num_heads", num_heads), source="GPT-2 weights")


def save(module: MultiHeadAttention, path: Any) -> None:
    """Configuration and weights as ``.npz``, written atomically."""
    target = Path(os.fspath(path))
    config = _config(module)
    arrays = {name: getattr(module, name) for name in WEIGHT_NAMES}
    present = {name: array for name, array in arrays.items() if array is not None}
    problem = writable_problem(target)
    if problem:
        raise WeightsFileError(f"cannot save to {target}: {problem}")
    try:
        atomic_write(
            target, lambda handle: np.savez(handle, config=np.array(json.dumps(config)), **present)
        )
    except OSError as error:
        raise WeightsFileError(f"cannot save to {target}: {error.strerror or error}") from None


def _config(module: MultiHeadAttention) -> dict[str, Any]:
    """What a file records besides the weights, checked again when it is loaded."""
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "d_model": module.d_model,
        "num_heads": module.num_heads, "kdim": module.kdim, "vdim": module.vdim,
        "bias": module.has_bias, "add_bias_kv": module.bias_k is not None,
        "add_zero_attn": module.add_zero_attn, "dtype": module.dtype.name,
    }  # fmt: skip


def load(cls: type[MultiHeadAttention], path: Any) -> MultiHeadAttention:
    target = Path(os.fspath(path))
    try:
        contents = read_arrays(target, "an .npz file written by MultiHeadAttention.save()")
    except UnreadableFileError as error:
        raise WeightsFileError(f"cannot load {error}") from None
    if not isinstance(contents, dict):
        raise WeightsFileError(
            f"cannot load {target}: it holds a single array, not an .npz file written by save()"
        )
    if "config" not in contents:
        raise WeightsFileError(f"cannot load {target}: it has no 'config' entry")
    try:
        config = json.loads(str(contents.pop("config")))
        if config.get("format") != FORMAT:
            raise ValueError(f"format is {config.get('format')!r}, not {FORMAT!r}")
        if config.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {config.get('version')} is not {FORMAT_VERSION}")
        expected = _expected_shapes(config)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise WeightsFileError(f"cannot load {target}: bad config entry ({error})") from None
    unknown = sorted(set(contents) - set(WEIGHT_NAMES))
    if unknown:
        raise WeightsFileError(f"cannot load {target}: unexpected entries {unknown}")
    summary = ", ".join(f"{key}={config[key]}" for key in ("d_model", "kdim", "vdim"))
    for name in WEIGHT_NAMES:  # against the config, which a damaged array cannot change
        shape = expected.get(name)
        if (name in contents) != (shape is not None):
            state = "has" if name in contents else "lacks"
            raise WeightsFileError(
                f"cannot load {target}: it {state} {name}, which its config "
                f"(bias={config['bias']}, add_bias_kv={config['add_bias_kv']}) "
                f"{'does not call for' if name in contents else 'calls for'}"
            )
        if shape is not None and contents[name].shape != shape:
            raise WeightsFileError(
                f"cannot load {target}: {name} has shape {contents[name].shape} but its config "
                f"({summary}) calls for {shape}"
            )
    weights: dict[str, np.ndarray | None] = {name: contents.get(name) for name in WEIGHT_NAMES}
    try:
        module = cls._from_weights(
            weights, config["num_heads"], config["add_zero_attn"], source="the weights"
        )
    except (AttentionValueError, TypeError) as error:
        raise WeightsFileError(f"cannot load {target}: {error}") from None
    found = _config(module)
    differences = [
        f"{key}={config.get(key)!r} but the weights give {found[key]!r}"
        for key in found
        if config.get(key) != found[key]
    ]
    if differences:
        raise WeightsFileError(f"cannot load {target}: its config says " + "; ".join(differences))
    return module


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every weight a file with this config holds."""
    E, kdim, vdim = (int(config[key]) for key in ("d_model", "kdim", "vdim"))
    shapes = {"W_q": (E, E), "W_k": (kdim, E), "W_v": (vdim, E), "W_o": (E, E)}
    vectors = [*("b_q", "b_k", "b_v", "b_o")] if config["bias"] else []
    vectors += ["bias_k", "bias_v"] if config["add_bias_kv"] else []
    return {**shapes, **{name: (E,) for name in vectors}}


def _numpy(name: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        tensor = value.detach().cpu()
        try:
            value = tensor.numpy()
        except TypeError:  # bfloat16 and other dtypes NumPy lacks: read them as float32
            value = tensor.float().numpy()
    return as_float_array(f"state dict entry {name!r}", value)


def _matrix(arrays: dict[str, np.ndarray], name: str, shape: tuple[int | None, ...] | None) -> Any:
    array = arrays[name]
    if array.ndim != 2 or (
        shape is not None
        and any(
            want is not None and got != want for got, want in zip(array.shape, shape, strict=True)
        )
    ):
        expected = "a matrix" if shape is None else str(shape).replace("None", "any")
        raise ShapeError(f"state dict: {name} has shape {array.shape}; expected {expected}")
    return array


def _vector(arrays: dict[str, np.ndarray], name: str, length: int) -> np.ndarray:
    array = arrays[name]
    if array.shape != (length,):
        raise ShapeError(f"state dict: {name} has shape {array.shape}; expected ({length},)")
    return array
