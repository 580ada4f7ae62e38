"""``clip_qkv``: the projected queries, keys and values clamped to ``[-c, c]`` before
attention (DBRX, OLMo, OLMoE, MPT with ``clip_qkv`` set). The clamp follows the QK-norm
where a layer has one (OLMoE normalises, then clamps) and precedes the rotation and the
softmax scale.

The backward of ``y = clip(x, -c, c)`` passes the gradient where ``-c <= x <= c`` (torch's
``clamp``) and is zero elsewhere.

>>> import numpy as np
>>> y, inside = clip(np.array([-3.0, 0.5, 2.0]), 1.0)
>>> y, inside
(array([-1. ,  0.5,  1. ]), array([False,  True, False]))
>>> clip_backward(np.ones(3), inside)
array([0., 1., 0.])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .rotary import positive_real

__all__ = ["check_clip_qkv", "clip", "clip_backward"]


def check_clip_qkv(clip_qkv: Any) -> float | None:
    """``clip_qkv`` checked: ``None`` (no clamp) or a positive finite number."""
    return None if clip_qkv is None else positive_real("clip_qkv", clip_qkv)


def clip(x: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
    """``x`` clamped to ``[-c, c]`` (in place: ``x`` is a buffer of the call's own), and
    where it was inside, for the backward."""
    inside: np.ndarray = np.abs(x) <= c
    np.clip(x, -c, c, out=x)
    return x, inside


def clip_backward(dy: np.ndarray, inside: np.ndarray) -> np.ndarray:
    """The gradient before the clamp: ``dy`` where the input was inside, zero elsewhere."""
    dx: np.ndarray = np.where(inside, dy, 0.0).astype(dy.dtype, copy=False)
    return dx
