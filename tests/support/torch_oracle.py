"""PyTorch as the oracle: the same computation done by torch, from the configuration alone.

The visibility mask is rebuilt here with torch operations (``tril`` for causality, ``arange``
comparisons for lengths), independently of ``mha._kernel.contract``. Rows that can see no
key are set to the contract's answer (zero attention output) because torch gives NaN there.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def allowed_mask(config: dict[str, Any], torch: Any, *, with_key_lengths: bool = True) -> Any:
    """The boolean visibility ``(B, H, L, S)`` (True = may attend), batch axis always present."""
    layout, kw = config["layout"], config["kwargs"]
    B, H, L, S = (1 if layout["unbatched"] else layout["B"]), layout["H"], layout["L"], layout["S"]
    allowed = torch.ones(B, H, L, S, dtype=torch.bool)
    if "mask" in kw:
        allowed = allowed & _with_head_axis(torch.from_numpy(kw["mask"]), layout)
    if kw.get("causal"):
        ones = torch.ones(L, S, dtype=torch.bool)
        top_left = kw.get("causal_alignment", "bottom_right") == "top_left"
        allowed = allowed & torch.tril(ones, diagonal=0 if top_left else S - L)
    if with_key_lengths and "key_lengths" in kw:
        lengths = torch.as_tensor(np.atleast_1d(kw["key_lengths"]))
        allowed = allowed & (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    if "query_lengths" in kw:
        lengths = torch.as_tensor(np.atleast_1d(kw["query_lengths"]))
        allowed = allowed & (torch.arange(L)[None, :] < lengths[:, None])[:, None, :, None]
    if "bias" in kw:
        allowed = allowed & ~torch.isneginf(_with_head_axis(torch.from_numpy(kw["bias"]), layout))
    return allowed


def sdpa_oracle(config: dict[str, Any], torch: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(out, weights)`` from torch projections and ``F.scaled_dot_product_attention``."""
    layout, kw = config["layout"], config["kwargs"]
    t = {
        name: torch.from_numpy(np.asarray(x, dtype=np.float64))
        for name, x in config["arrays"].items()
    }
    if layout["unbatched"]:
        t.update({name: t[name][None] for name in ("Q", "K", "V")})
    H, d_k = layout["H"], layout["d_k"]

    def heads(x: Any, W: str, b: str) -> Any:
        y = x @ t[W] + (t.get(b, 0.0))
        return y.reshape(y.shape[0], y.shape[1], H, -1).transpose(1, 2)

    q, k, v = heads(t["Q"], "W_q", "b_q"), heads(t["K"], "W_k", "b_k"), heads(t["V"], "W_v", "b_v")
    allowed = allowed_mask(config, torch)
    bias = _bias(config, torch)
    additive = torch.where(allowed, bias, -math.inf)
    scale = kw.get("scale", 1.0 / math.sqrt(d_k))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)
    weights = torch.softmax(q @ k.transpose(-1, -2) * scale + additive, dim=-1)
    sees_a_key = allowed.any(dim=-1, keepdim=True)
    out = torch.where(sees_a_key, out, 0.0)
    weights = torch.where(sees_a_key, weights, 0.0)
    joined = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
    final = joined @ t["W_o"] + (t.get("b_o", 0.0))
    if layout["unbatched"]:
        final, weights = final[0], weights[0]
    return final.numpy(), weights.numpy()


def module_oracle(config: dict[str, Any], torch: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(out, weights, rows_that_see_a_key)`` from ``torch.nn.MultiheadAttention``.

    The weights are copied into a float64 module (batch_first); masks are given in torch's
    polarity as float masks. Rows that see no key are NaN in torch and are reported so the
    caller can compare them against the contract instead.
    """
    a, layout, kw = config["arrays"], config["layout"], config["kwargs"]
    H, L, S, B = layout["H"], layout["L"], layout["S"], layout["B"]
    E = a["W_q"].shape[1]
    has_bias = "b_q" in a
    module = torch.nn.MultiheadAttention(
        E,
        H,
        bias=has_bias,
        kdim=a["W_k"].shape[0],
        vdim=a["W_v"].shape[0],
        batch_first=True,
        dtype=torch.float64,
    )
    module.eval()
    T = {name: torch.from_numpy(np.asarray(x, dtype=np.float64)) for name, x in a.items()}
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            module.in_proj_weight.copy_(torch.cat([T["W_q"].T, T["W_k"].T, T["W_v"].T]))
        else:
            module.q_proj_weight.copy_(T["W_q"].T)
            module.k_proj_weight.copy_(T["W_k"].T)
            module.v_proj_weight.copy_(T["W_v"].T)
        module.out_proj.weight.copy_(T["W_o"].T)
        if has_bias:
            module.in_proj_bias.copy_(torch.cat([T["b_q"], T["b_k"], T["b_v"]]))
            module.out_proj.bias.copy_(T["b_o"])

    allowed = allowed_mask(config, torch, with_key_lengths=False)
    bias = _bias(config, torch)
    attn_mask = torch.where(allowed, bias, -math.inf).expand(B, H, L, S).reshape(B * H, L, S)
    key_padding_mask = None
    if "key_lengths" in kw:
        padded = torch.arange(S)[None, :] >= torch.as_tensor(kw["key_lengths"])[:, None]
        key_padding_mask = torch.zeros(padded.shape, dtype=torch.float64).masked_fill(
            padded, -math.inf
        )
    with torch.no_grad():
        out, weights = module(
            T["Q"],
            T["K"],
            T["V"],
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            need_weights=True,
            average_attn_weights=False,
        )
    sees_a_key = allowed_mask(config, torch).any(dim=-1)  # (B, H, L)
    return out.numpy(), weights.numpy(), sees_a_key.numpy()


def _bias(config: dict[str, Any], torch: Any) -> Any:
    """The additive bias as a float64 tensor with a head axis (0 when there is none)."""
    kw, layout = config["kwargs"], config["layout"]
    if "bias" not in kw:
        return torch.zeros((), dtype=torch.float64)
    return _with_head_axis(torch.from_numpy(np.asarray(kw["bias"], dtype=np.float64)), layout)


def _with_head_axis(array: Any, layout: dict[str, Any]) -> Any:
    """A (B, L, S) mask or bias applies to every head; other shapes broadcast as they are."""
    if not layout["unbatched"] and array.ndim == 3:
        return array[:, None]
    return array


def gradient_oracle(
    config: dict[str, Any], torch: Any, grad_out: np.ndarray
) -> dict[str, np.ndarray]:
    """The gradients of ``sum(grad_out * out)`` by ``torch.autograd`` for every array of the
    configuration (and ``bias``), through plain torch operations: projections, scores,
    ``masked`` softmax, weights @ values, output projection. Rows that see no key have zero
    weights, as in mha's contract (computed without NaN, so no NaN reaches a gradient)."""
    layout, kw = config["layout"], config["kwargs"]
    t = {
        name: torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
        for name, x in config["arrays"].items()
    }
    bias = None
    if "bias" in kw:
        bias = torch.tensor(np.asarray(kw["bias"], dtype=np.float64), requires_grad=True)
    batched = {n: (t[n][None] if layout["unbatched"] else t[n]) for n in ("Q", "K", "V")}
    H, d_k = layout["H"], layout["d_k"]

    def heads(x: Any, W: str, b: str) -> Any:
        y = x @ t[W] + t.get(b, 0.0)
        return y.reshape(y.shape[0], y.shape[1], H, -1).transpose(1, 2)

    q, k, v = (heads(batched[x], W, b) for x, W, b in
               (("Q", "W_q", "b_q"), ("K", "W_k", "b_k"), ("V", "W_v", "b_v")))  # fmt: skip
    scale = kw.get("scale", 1.0 / math.sqrt(d_k))
    logits = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        logits = logits + _with_head_axis(bias, layout)
    allowed = allowed_mask(config, torch)
    sees = allowed.any(dim=-1, keepdim=True)
    logits = torch.where(allowed, logits, -math.inf)
    logits = torch.where(sees, logits, 0.0)
    weights = torch.softmax(logits, dim=-1) * allowed
    joined = (weights @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    out = joined @ t["W_o"] + t.get("b_o", 0.0)
    if layout["unbatched"]:
        out = out[0]
    (out * torch.from_numpy(grad_out)).sum().backward()
    grads = {name: x.grad.numpy() for name, x in t.items()}
    if bias is not None:
        grads["bias"] = bias.grad.numpy()
    return grads
