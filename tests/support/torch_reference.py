"""Pieces of the torch references the tests write from the definitions."""

from __future__ import annotations

from typing import Any


def rope(torch: Any, x: Any, positions: Any, theta: float) -> Any:
    """Rotary positions of ``x (..., L, d)`` at ``positions``, each head's halves rotated
    (transformers' Llama ``rotate_half``), in float64."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def dense_autograd(
    torch: Any,
    q: Any,
    k: Any,
    v: Any,
    grad: Any,
    scale: float,
    *,
    bias: Any = None,
    allowed: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Attention written out in torch, ``softmax(q k^T * scale + bias)`` with the pairs not
    ``allowed`` at ``-inf`` (a row that sees nothing: zero weights), and its autograd:
    ``(out, {"q": dq, "k": dk, "v": dv})`` as NumPy arrays."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    scores = tq @ tk.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + torch.as_tensor(bias)
    if allowed is not None:
        scores = scores.masked_fill(~torch.as_tensor(allowed), -torch.inf)
    result = torch.softmax(scores, -1).nan_to_num(0.0) @ tv
    result.backward(torch.tensor(grad))
    grads = {name: tensor.grad.numpy() for name, tensor in zip("qkv", (tq, tk, tv), strict=True)}
    return result.detach().numpy(), grads
