"""What a model changes in the scores and the softmax, each with its gradient beside it.

Each tile's scores ``s = (q * scale) @ k_tile.T`` pass, in this order, through

* soft-capping (Gemma 2): ``s = c * tanh(s / c)``, derivative ``1 - tanh(s / c)^2``;
* ``score_mod(s, b, h, q_idx, kv_idx)`` (FlexAttention's), derivative ``score_mod_grad``;
* ALiBi (BLOOM, MPT): ``s += -slope_h * (position_i - position_j)``, computed per tile from
  the positions (:meth:`ItemVisibility.query_positions`), never as an ``(L, S)`` array;

before the bias and the masks. Learned sinks (gpt-oss) add ``exp(sink_h)`` to each row's
softmax denominator: a key with logit ``sink_h`` and no value. The kernel computes the
rows without it and :func:`add_sinks` folds it in at the end, the log-sum-exp merge of
the rows with a part whose output is zero; so split keys, merged partials and every tile
size add it exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .item import ItemVisibility

__all__ = ["Scores", "add_sinks", "sink_gradient"]


@dataclass(frozen=True)
class Scores:
    """A call's changes to the scores (``None`` where absent): ``alibi`` and ``sinks`` are
    ``(H,)`` float64 arrays of slopes and logits per query head."""

    softcap: float | None = None
    score_mod: Callable[..., Any] | None = None
    score_mod_grad: Callable[..., Any] | None = None
    alibi: np.ndarray | None = None
    sinks: np.ndarray | None = None

    @property
    def changes_scores(self) -> bool:
        return self.softcap is not None or self.score_mod is not None or self.alibi is not None

    def without_sinks(self) -> Scores | None:
        """These changes less the sinks (for parts that a merge adds them to once)."""
        rest = replace(self, sinks=None)
        return rest if rest.changes_scores else None

    @property
    def nonlinear(self) -> bool:
        """Whether the backward pass needs the raw scores and a derivative."""
        return self.softcap is not None or self.score_mod is not None

    def apply(
        self, s: np.ndarray, item: ItemVisibility, r0: int, r1: int, c0: int, c1: int,
        derivative: bool = False, alibi: bool = True,
    ) -> np.ndarray | None:  # fmt: skip
        """Change the scaled scores ``s (G, group * n, w)`` of rows ``[r0, r1)`` and keys
        ``[c0, c1)`` of ``item``'s query heads (``group`` stacked per key/value head) in
        place; with ``derivative``, return d(changed)/d(scaled), or ``None`` where it is 1.
        ``alibi=False`` leaves ALiBi to the compiled softmax step (:meth:`alibi_rows`)."""
        n, w = r1 - r0, c1 - c0
        heads = s.size // max(1, n * w)
        factor = None
        if self.softcap is not None:
            s *= 1.0 / self.softcap
            np.tanh(s, out=s)
            if derivative:
                factor = 1.0 - s * s
            s *= self.softcap
        if self.score_mod is not None:
            view = s.reshape(1, heads, n, w)
            view.flags.writeable = False  # the function returns its result
            b, h, q, k = item.indices(r0, r1, c0, c1)
            if derivative:
                assert self.score_mod_grad is not None  # checked with the call
                slope = _result("score_mod_grad", _call(self.score_mod_grad, view, b, h, q, k),
                                view)  # fmt: skip
                factor = slope if factor is None else factor * slope.reshape(factor.shape)
            changed = _result("score_mod", _call(self.score_mod, view, b, h, q, k), view)
            np.copyto(s, changed.reshape(s.shape), casting="same_kind")
        if self.alibi is not None and alibi:
            distance = item.key_positions(c0, c1)[None, :] - item.query_positions(r0, r1)[:, None]
            distance = distance.astype(s.dtype)  # exact: whole numbers
            slopes = self.alibi[item.heads].astype(s.dtype)
            stacked = s.reshape(heads, n, w)
            for g in range(heads):  # one pass per head over an (n, w) tile
                stacked[g] += slopes[g] * distance
        return None if factor is None else factor.reshape(s.shape)

    def alibi_rows(
        self, item: ItemVisibility, r0: int, r1: int, c0: int, G: int, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        """ALiBi for the compiled step: each stacked row's slope ``(G, group * n)`` and its
        query position less key ``c0``'s (the tile's keys have consecutive positions)."""
        assert self.alibi is not None
        n = r1 - r0
        slopes = np.repeat(self.alibi[item.heads].astype(dtype), n).reshape(G, -1)
        base = item.query_positions(r0, r1) - int(item.key_positions(c0, c0 + 1)[0])
        return slopes, np.tile(base, slopes.shape[1] // max(n, 1))


def _call(function: Callable[..., Any], score: np.ndarray, *indices: np.ndarray) -> Any:
    """A score function at read-only scores: one that writes into them is told to return."""
    try:
        return function(score, *indices)
    except ValueError as error:
        if "read-only" not in str(error):
            raise
        raise AttentionValueError(
            f"{getattr(function, '__name__', 'score_mod')} changed the scores it was given in "
            "place; return the changed scores instead (score + bias, not score += bias)"
        ) from None


def _result(name: str, value: Any, score: np.ndarray) -> np.ndarray:
    result = np.asarray(value)
    if result.shape != score.shape:
        raise ShapeError(
            f"{name} must return an array of the score's shape {score.shape}; it returned "
            f"shape {result.shape}"
        )
    if result.dtype.kind != "f":
        raise AttentionTypeError(
            f"{name} must return real floating scores; it returned dtype {result.dtype}"
        )
    return result


def add_sinks(out: np.ndarray, lse: np.ndarray, sinks: np.ndarray) -> None:
    """Fold each head's sink logit into the rows' softmax, in place: ``out (*batch, H, L,
    d)`` and ``lse (*batch, H, L)`` computed without it become those with it (``lse`` the
    log of the whole denominator; a row that saw no key keeps a zero output, with lse the
    sink's logit)."""
    sink = sinks.astype(lse.dtype)[:, None]  # (H, 1): broadcast over rows
    total = np.logaddexp(lse, sink)
    out *= np.exp(lse - total)[..., None]
    lse[...] = total


def sink_gradient(
    out: np.ndarray, lse: np.ndarray, grad_out: np.ndarray, sinks: np.ndarray
) -> np.ndarray:
    """The gradient of ``sum(grad_out * out)`` for each head's sink logit, ``(H,)``: a sink
    takes the share ``p = exp(sink - lse)`` of each row's softmax from its keys, so
    ``d out_i / d sink = -p_i * out_i``."""
    share = np.exp(sinks.astype(lse.dtype)[:, None] - lse)  # (*batch, H, L)
    D = np.einsum("...d,...d->...", grad_out, out.astype(grad_out.dtype, copy=False))
    total = -(share * D)  # (*batch, H, L)
    per_head: np.ndarray = total.sum(
        axis=tuple(a for a in range(total.ndim) if a != total.ndim - 2)
    )
    return per_head
