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
