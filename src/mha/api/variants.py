"""The attention of today's models, as keywords of every entry point: learned sinks
(gpt-oss), soft-capping (Gemma 2), ALiBi (BLOOM, MPT) and FlexAttention's ``score_mod``,
checked here into the kernel's :class:`~mha._kernel.scores.Scores`; sink tokens, chunks and
``mask_mod`` are part of the mask contract (:mod:`mha._kernel.contract`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .relative_bias import RelativeBias, check_relative_bias
from .rotary import positive_real

__all__ = [
    "SymmetricAlibi",
    "alibi_slopes",
    "check_query_temperature",
    "check_scores",
    "symmetric_alibi",
]


@dataclass(frozen=True)
class SymmetricAlibi:
    """ALiBi's symmetric form, ``-slope_h * |position_i - position_j|``, as ``alibi=``
    takes it (:func:`symmetric_alibi`): ``slopes`` ``True`` (:func:`alibi_slopes`),
    ``(H,)``, or one row per sequence ``(*batch, H)``."""

    slopes: Any = True


def symmetric_alibi(slopes: Any = True) -> SymmetricAlibi:
    """ALiBi with the distance on both sides, ``-slope_h * |position_i - position_j|``
    (FlashAttention's ALiBi for a call whose queries see keys after them, MosaicBERT's):
    give it as ``alibi=symmetric_alibi(slopes)`` to a call. The default ``alibi=slopes``
    adds ``-slope_h * (position_i - position_j)``, the same for the keys at or before each
    query (every causal call), and a growing bonus for keys after it. ``slopes``: ``True``
    for :func:`alibi_slopes` of the call's heads, ``(H,)``, or ``(*batch, H)``, each
    sequence's own (FlashAttention's ``(batch, nheads)``).

    >>> import numpy as np, mha
    >>> q = k = v = np.eye(3)[None, None]            # one head, 3 positions
    >>> both = mha.scaled_dot_product_attention(q, k, v, alibi=mha.symmetric_alibi([1.0]))
    >>> both[0, 0, 1].round(3)                         # keys 0 and 2 equally far from 1
    array([0.146, 0.708, 0.146])
    """
    if slopes is None or (isinstance(slopes, (bool, np.bool_)) and not slopes):
        raise AttentionValueError(
            f"symmetric_alibi takes the slopes (True for alibi_slopes', an (H,) or (*batch, H) "
            f"array); got {slopes!r}: to leave ALiBi out, leave alibi= out"
        )
    return SymmetricAlibi(slopes)


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
    batch_shape: tuple[int, ...] | None = None,
) -> Scores | None:
    """The call's changes to the scores, checked (``None`` when it has none). The arrays
    are copied: a caller changing theirs later changes nothing here. ``temperature`` is the
    keyword ``query_temperature`` (:func:`check_query_temperature`); ``batch_shape``: the
    call's batch axes, which ALiBi slopes of each sequence ``(*batch, H)`` must have
    (``None``: a layer's own variants, one slope per head)."""
    sink_logits = None if sinks is None else _per_head("sinks", sinks, H, "one logit")
    cap = None if softcap is None else positive_real("softcap", softcap)
    symmetric = isinstance(alibi, SymmetricAlibi)
    given = alibi.slopes if isinstance(alibi, SymmetricAlibi) else alibi
    slopes = None
    if isinstance(given, (bool, np.bool_)):
        slopes = (alibi_slopes(H) if H else np.zeros(0)) if given else None  # 0 heads: none
    elif given is not None:
        slopes = _slopes(given, H, batch_shape)
    relative = None
    if isinstance(score_mod, RelativeBias):  # a learned relative-position bias
        relative, score_mod = check_relative_bias(score_mod, H), None
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
    transforms: list[ScoreTransform] = []  # in this order: soft-capping, score_mod, ALiBi
    if cap is not None:
        transforms.append(SoftCap(cap))
    if score_mod is not None:
        transforms.append(ScoreMod(score_mod, score_mod_grad))
    if slopes is not None:
        transforms.append(Alibi(slopes, symmetric))
    if relative is not None:  # last: its gradient is the final scores'
        transforms.append(relative)
    folded = None if temperature is None else check_query_temperature(temperature)
    if sink_logits is None and not transforms and folded is None:
        return None
    return Scores(tuple(transforms), sink_logits, folded)


def check_query_temperature(value: Any) -> QueryTemperature:
    """``query_temperature=(beta, floor)``, ``(beta, floor, offset)`` or ``(beta, floor,
    offset, law)``, checked: the scores of the query at position ``p`` times ``1 + beta *
    log(1 + floor((p + offset) / floor))`` (``law="log"``, the default) or ``(1 + (p +
    offset) / floor) ** beta`` (``law="power"``) (:class:`~mha._kernel.scores.QueryTemperature`;
    Llama 4: ``(attn_scale, floor_scale, 1)``, Ministral 3: ``(llama_4_scaling_beta,
    original_max_position_embeddings)``, Beam: ``(0.1, 2048, 1, "power")``)."""
    if (
        isinstance(value, np.ndarray)
        or not isinstance(value, (tuple, list))
        or not (2 <= len(value) <= 4)
        or (len(value) == 4 and not isinstance(value[3], str))
    ):
        raise AttentionTypeError(
            "query_temperature must be (beta, floor), (beta, floor, offset) or (beta, floor, "
            "offset, law), numbers and a law 'log' or 'power': the scores of the query at "
            "position p times 1 + beta * log(1 + floor((p + offset) / floor)) ('log') or "
            f"(1 + (p + offset) / floor) ** beta ('power'); got {value!r}"
        )
    given: tuple[Any, ...] = (*tuple(value), *(0.0, "log")[len(value) - 2 :])
    beta, floor, offset, law = given
    for name, number in (("beta", beta), ("offset", offset)):
        real = isinstance(number, (int, float, np.integer, np.floating))
        if not real or isinstance(number, (bool, np.bool_)) or not np.isfinite(number):
            raise AttentionValueError(
                f"query_temperature's {name} must be a finite number; got {value!r}"
            )
    if law not in ("log", "power"):
        raise AttentionValueError(
            f"query_temperature's law must be 'log' or 'power'; got {law!r} in {value!r}"
        )
    floor = positive_real("query_temperature's floor", floor)
    if law == "power" and not float(offset) > -floor:
        raise AttentionValueError(
            "query_temperature's power law needs offset > -floor (1 + (p + offset) / floor "
            f"positive at every position p >= 0); got {value!r}"
        )
    return QueryTemperature(float(beta), floor, float(offset), str(law))


def _slopes(value: Any, H: int, batch_shape: tuple[int, ...] | None) -> np.ndarray:
    """ALiBi's slopes ``(H,)``, or each sequence's ``(*batch, H)`` flattened to
    ``(sequences, H)``."""
    array = as_float_array("alibi", value)
    if array.ndim <= 1 or batch_shape is None:
        return _per_head("alibi", array, H, "one slope")
    if array.shape != (*batch_shape, H):
        raise ShapeError(
            f"alibi must hold one slope per query head, shape ({H},), or one row of them per "
            f"sequence, shape {(*batch_shape, H)}; got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise AttentionValueError(f"alibi must be finite; got {array!r}")
    return np.array(array.reshape(-1, H), dtype=np.float64)


def _per_head(name: str, value: Any, H: int, what: str) -> np.ndarray:
    array = as_float_array(name, value)
    if array.shape != (H,):
        raise ShapeError(
            f"{name} must hold {what} per query head, shape ({H},); got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise AttentionValueError(f"{name} must be finite; got {array!r}")
    return np.array(array, dtype=np.float64)
