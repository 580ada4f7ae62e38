"""The attention kernel: softmax(q k^T * scale + bias, masked) v, for already split heads.

Every public entry point ends here, so every path computes the same function. The softmax
is the stable one: subtract the row maximum, exponentiate, and divide the weighted sum of
values by the row's sum once at the end (``out = (e @ v) / l``), which is also the form a
tiled, online-softmax kernel accumulates.

Rows with no visible key have maximum ``-inf``; their maximum is taken as 0 so that every
``exp`` is ``exp(-inf) = 0``, their sum is 0, and their output and weights are 0 -- never
NaN. Non-finite values stored at hidden key positions cannot reach a visible output: hidden
scores are overwritten (not added to) with ``-inf``, and non-finite values are taken out of
``v`` before the product, then added back only where a query actually attends.
"""

from __future__ import annotations

import numpy as np

from .masks import Visibility

__all__ = ["attend"]


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    visibility: Visibility,
    scale: float,
    return_weights: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Attention of queries over keys and values, per head.

    ``q (*batch, H, L, d_k)``, ``k (*batch, H, S, d_k)``, ``v (*batch, H, S, d_v)`` share
    one floating dtype, which every temporary keeps; ``scale`` is a Python float so that it
    never promotes float32 work to float64. Returns ``(out, weights)`` with
    ``out (*batch, H, L, d_v)`` and ``weights (*batch, H, L, S)`` or ``None``. Call it under
    ``np.errstate(invalid="ignore")``: NaN or Inf at visible positions propagates silently,
    as the IEEE rules say.
    """
    L, S = q.shape[-2], k.shape[-2]
    if L == 0 or S == 0:
        out = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
        weights = np.zeros((*q.shape[:-1], S), dtype=q.dtype) if return_weights else None
        return out, weights

    scores = (q * scale) @ np.swapaxes(k, -1, -2)  # (*batch, H, L, S)
    bias = visibility.bias_block()
    if bias is not None:
        scores += bias
    allowed = visibility.allowed()
    if allowed is not None:
        np.copyto(scores, -np.inf, where=~allowed)

    v_finite = bool(np.isfinite(v).all())
    attended = None if v_finite else scores != -np.inf

    row_max = scores.max(axis=-1, keepdims=True)
    row_max[row_max == -np.inf] = 0.0  # rows with no visible key
    scores -= row_max
    exp_scores = np.exp(scores, out=scores)
    row_sum = exp_scores.sum(axis=-1, keepdims=True)

    if attended is None:
        out = exp_scores @ v
    else:
        out = _product_isolating_non_finite(exp_scores, v, attended)

    row_sum[row_sum == 0.0] = 1.0  # rows with no visible key: 0 / 1 = 0
    out /= row_sum
    weights = exp_scores / row_sum if return_weights else None
    return out, weights


def _product_isolating_non_finite(
    exp_scores: np.ndarray, v: np.ndarray, attended: np.ndarray
) -> np.ndarray:
    """``exp_scores @ v`` where ``0 * inf`` and ``0 * nan`` from hidden keys count as 0.

    BLAS would turn a zero weight times a NaN value into NaN. Multiply by ``v`` with its
    non-finite entries zeroed, then add each non-finite entry's product back only for the
    rows that attend to its key. The extra work is proportional to the number of key
    positions holding a non-finite value, usually none.
    """
    non_finite = ~np.isfinite(v)
    out = exp_scores @ np.where(non_finite, 0.0, v)
    other_axes = (*tuple(range(v.ndim - 2)), v.ndim - 1)
    for j in np.flatnonzero(non_finite.any(axis=other_axes)):
        v_j = np.where(non_finite[..., j, :], v[..., j, :], 0.0)  # (*batch, H, d_v)
        term = exp_scores[..., :, j, None] * v_j[..., None, :]  # (*batch, H, L, d_v)
        out += np.where(attended[..., :, j, None], term, 0.0)
    return out
