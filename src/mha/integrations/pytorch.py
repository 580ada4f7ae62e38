"""PyTorch's ``nn.MultiheadAttention`` layout, in and out.

PyTorch keeps weights as ``(out, in)`` for ``x @ W.T``; mha keeps ``(in, out)`` for
``x @ W``, so every matrix is transposed on the way in and out. torch is imported only to
build tensors or a module; a module or a state dict of tensors is read through
``.detach().cpu().numpy()``, and NumPy arrays are taken as they are. These functions work
on dicts of mha's weight names (``W_q``, ..., ``bias_v``); ``MultiHeadAttention`` builds
itself from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import positive_int
from ..errors import AttentionValueError, ShapeError
from ._tensors import as_numpy, as_tensor

__all__ = ["as_tensors", "torch_module", "torch_state_dict", "weights_from_torch"]


def weights_from_torch(
    source: Any, num_heads: int | None, add_zero_attn: bool | None
) -> tuple[dict[str, np.ndarray | None], int, bool]:
    """mha's weights, head count and ``add_zero_attn`` from an ``nn.MultiheadAttention`` or
    its state dict (tensors or NumPy arrays), every key and shape checked."""
    if hasattr(source, "state_dict") and hasattr(source, "num_heads"):  # an nn.Module
        if num_heads is not None and num_heads != source.num_heads:
            raise AttentionValueError(
                f"num_heads={num_heads} but the module has num_heads={source.num_heads}"
            )
        num_heads = source.num_heads
        if add_zero_attn is not None and add_zero_attn != bool(source.add_zero_attn):
            raise AttentionValueError(
                f"add_zero_attn={add_zero_attn} but the module has "
                f"add_zero_attn={bool(source.add_zero_attn)}"
            )
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
    return _weights_from_state(state), positive_int("num_heads", num_heads), bool(add_zero_attn)


def _weights_from_state(state: dict[str, Any]) -> dict[str, np.ndarray | None]:
    """Check a ``nn.MultiheadAttention`` state dict and turn it into mha's layout."""
    arrays = {name: as_numpy(f"state dict entry {name!r}", value) for name, value in state.items()}
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
        "W_q": W_q.T,
        "W_k": W_k.T,
        "W_v": W_v.T,
        "W_o": W_o.T,
    }
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


def torch_state_dict(weights: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """``weights`` (mha's names and layout) as an ``nn.MultiheadAttention`` state dict."""
    W_q, W_k, W_v, W_o = (_present(weights, name) for name in ("W_q", "W_k", "W_v", "W_o"))
    E = W_q.shape[1]
    state: dict[str, np.ndarray] = {}
    if W_k.shape[0] == E and W_v.shape[0] == E:
        state["in_proj_weight"] = np.concatenate([W_q.T, W_k.T, W_v.T])
    else:
        state["q_proj_weight"] = W_q.T.copy()
        state["k_proj_weight"] = W_k.T.copy()
        state["v_proj_weight"] = W_v.T.copy()
    b_q, b_k, b_v, b_o = (weights.get(name) for name in ("b_q", "b_k", "b_v", "b_o"))
    if b_q is not None and b_k is not None and b_v is not None:
        state["in_proj_bias"] = np.concatenate([b_q, b_k, b_v])
    bias_k, bias_v = weights.get("bias_k"), weights.get("bias_v")
    if bias_k is not None and bias_v is not None:
        state["bias_k"] = bias_k.reshape(1, 1, E).copy()
        state["bias_v"] = bias_v.reshape(1, 1, E).copy()
    state["out_proj.weight"] = W_o.T.copy()
    if b_o is not None:
        state["out_proj.bias"] = b_o.copy()
    return state


def as_tensors(state: dict[str, np.ndarray]) -> dict[str, Any]:
    """The same state dict with torch tensors (copies), for ``load_state_dict``."""
    return {name: as_tensor(array) for name, array in state.items()}


def torch_module(
    weights: dict[str, np.ndarray | None], num_heads: int, add_zero_attn: bool, batch_first: bool
) -> Any:
    """A ``torch.nn.MultiheadAttention`` in eval mode holding ``weights``, built to match."""
    import torch

    W_q, W_k, W_v = (_present(weights, name) for name in ("W_q", "W_k", "W_v"))
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        W_q.dtype.name, torch.float64
    )
    module = torch.nn.MultiheadAttention(
        W_q.shape[1],
        num_heads,
        bias=weights.get("b_q") is not None,
        add_bias_kv=weights.get("bias_k") is not None,
        add_zero_attn=add_zero_attn,
        kdim=W_k.shape[0],
        vdim=W_v.shape[0],
        batch_first=batch_first,
        dtype=dtype,
    )
    module.load_state_dict(as_tensors(torch_state_dict(weights)))
    return module.eval()


def _present(weights: dict[str, np.ndarray | None], name: str) -> np.ndarray:
    array = weights.get(name)
    if array is None:
        raise AttentionValueError(f"the weights have no {name}")
    return array


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
