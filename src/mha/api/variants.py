"""The attention of today's models, as keywords of every entry point: learned sinks
(gpt-oss), soft-capping (Gemma 2), ALiBi (BLOOM, MPT) and FlexAttention's ``score_mod``,
checked here into the kernel's :class:`~mha._kernel.scores.Scores`; sink tokens, chunks and
``mask_mod`` are part of the mask contract (:mod:`mha._kernel.contract`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._arrays import as_float_array, check_function
from .._kernel.scores import (
    Alibi,
    QueryTemperature,
    ScoreMod,
    Scores,
    ScoreTransform,
    SoftCap,
)
from ..errors import AttentionValueError, ShapeError
from .rotary import positive_real

__all__ = ["alibi_slopes", "check_scores"]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's slopes for ``num_heads`` heads (Press et al., 2022), as BLOOM and MPT use
    them: for a power of two ``n``, the geometric sequence ``2^(-8/n), 2^(-16/n), ...,
    2^(-8)``; otherwise those of the largest power of two below, then every other slope of
    the next power of two. float64, ``(num_heads,)``.

    >>> import mha
    >>> mha.alibi_slopes(4) * 256    # 2^-2, 2^-4, 2^-6, 2^-8
    array([64., 16.,  4.,  1.])
    >>> mha.alibi_slopes(6)[4:]       # 2^(-1), 2^(-3) from the slopes of 8 heads
    array([0.5  , 0.125])
    """
    from .._arrays import positive_int

    n = positive_int("num_heads", num_heads)
    closest = 2 ** math.floor(math.log2(n))
    slopes: np.ndarray = 2.0 ** (-8.0 / closest * np.arange(1, closest + 1))
    if closest < n:
        extra = 2.0 ** (-4.0 / closest * np.arange(1, 2 * (n - closest), 2))
        slopes = np.concatenate([slopes, extra])
    return slopes


def check_scores(
    *,
    sinks: Any,
    softcap: Any,
    alibi: Any,
    score_mod: Any,
    score_mod_grad: Any,
    H: int,
    want_backward: bool,
    temperature: Any = None,
) -> Scores | None:
    """The call's changes to the scores, checked (``None`` when it has none). The arrays
    are copied: a caller changing theirs later changes nothing here. ``temperature`` is
    Llama 4's ``(floor_scale, attn_scale)`` (:class:`~mha._kernel.scores.QueryTemperature`)."""
    sink_logits = None if sinks is None else _per_head("sinks", sinks, H, "one logit")
    cap = None if softcap is None else positive_real("softcap", softcap)
    slopes = None
    if isinstance(alibi, (bool, np.bool_)):
        slopes = (alibi_slopes(H) if H else np.zeros(0)) if alibi else None  # 0 heads: none
    elif alibi is not None:
        slopes = _per_head("alibi", alibi, H, "one slope")
    for name, function in (("score_mod", score_mod), ("score_mod_grad", score_mod_grad)):
        if function is not None:
            check_function(name, function, "(score, b, h, q_idx, kv_idx) -> score", 5)
    if score_mod_grad is not None and score_mod is None:
        raise AttentionValueError("score_mod_grad= is score_mod's derivative: give score_mod=")
    if want_backward and score_mod is not None and score_mod_grad is None:
        raise AttentionValueError(
            "return_backward=True with a score_mod needs score_mod_grad=, its derivative "
            "d score_mod / d score, a function of the same arguments: give it, or call "
            "without return_backward"
        )
    transforms: list[ScoreTransform] = []  # in this order: the temperature, soft-capping,
    if temperature is not None:  # score_mod, ALiBi
        floor_scale, attn_scale = temperature
        transforms.append(
            QueryTemperature(
                positive_real("floor_scale", floor_scale), positive_real("attn_scale", attn_scale)
            )
        )
    if cap is not None:
        transforms.append(SoftCap(cap))
    if score_mod is not None:
        transforms.append(ScoreMod(score_mod, score_mod_grad))
    if slopes is not None:
        transforms.append(Alibi(slopes))
    if sink_logits is None and not transforms:
        return None
    return Scores(tuple(transforms), sink_logits)


def _per_head(name: str, value: Any, H: int, what: str) -> np.ndarray:
    array = as_float_array(name, value)
    if array.shape != (H,):
        raise ShapeError(
            f"{name} must hold {what} per query head, shape ({H},); got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise AttentionValueError(f"{name} must be finite; got {array!r}")
    return np.array(array, dtype=np.float64)
