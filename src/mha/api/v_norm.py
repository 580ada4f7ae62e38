"""``v_norm``: an RMSNorm without weights of each value head (Gemma 3n, Gemma 4).

The projected values of each key/value head are divided by their root mean square,
``y = v / sqrt(mean(v²) + eps)``, before they are attended to (and, in a cached call, before
they are cached: the cache holds the normalised values, as transformers' does). ``v_norm``
is the norm's epsilon (``None``: no norm).

The backward of ``y = v·r``, ``r = (mean(v²) + eps)^(-1/2)``, is
``dv = r·(dy - y·mean(dy·y))``.

>>> import numpy as np
>>> y, normed, r = v_norm(np.array([[3.0, 4.0]]), 0.0)
>>> y, float(np.mean(y * y))
(array([[0.84852814, 1.13137085]]), 1.0)
>>> v_norm_backward(y, normed, r)                 # along y itself: nothing changes y
array([[0., 0.]])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import AttentionTypeError
from .rotary import positive_real

__all__ = ["check_v_norm", "v_norm", "v_norm_backward"]


def check_v_norm(eps: Any) -> float | None:
    """``v_norm`` checked: ``None`` (no norm) or the norm's epsilon, a positive number."""
    if eps is None:
        return None
    if isinstance(eps, (bool, np.bool_)):
        raise AttentionTypeError(
            f"v_norm is the epsilon of the values' RMSNorm (1e-6 for Gemma), not a flag; "
            f"got {eps!r}"
        )
    return positive_real("v_norm", eps)


def v_norm(v: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The heads ``v (*B, H_kv, S, d_v)`` normalised, with what the backward needs: ``(y,
    y, r)`` (the normalised rows are the output: there is no weight)."""
    r = 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    normed = v * r
    return normed, normed, r


def v_norm_backward(dy: np.ndarray, normed: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The gradient of the values before the norm, from that of the normalised ``dy``."""
    dv: np.ndarray = r * (dy - normed * np.mean(dy * normed, axis=-1, keepdims=True))
    return dv
