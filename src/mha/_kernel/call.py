"""What one call of the kernel is given, as objects handed down whole.

:class:`KernelCall` is what the tiles compute (the operands, what each query may see, the
scale, the changes to the scores, the dropout and the scratch budget); :class:`Outputs`
where the forward writes; :class:`Gradients` where the backward writes. The entry points
build them once from their checked arguments (:mod:`mha.api`), and every walk reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .contract import Visibility
from .dropout import Dropout
from .scores import Scores

__all__ = ["DEFAULT_MAX_MEMORY", "Gradients", "KernelCall", "Outputs"]

DEFAULT_MAX_MEMORY = 6 * 2**20
"""Bytes of scratch each worker may use for its tiles, unless the caller says otherwise."""


@dataclass(frozen=True)
class KernelCall:
    """Attention of ``q (*batch, H, L, d_k)`` over ``k (*batch, H_kv, S, d_k)`` and ``v
    (*batch, H_kv, S, d_v)`` (strided views of any floating dtype, or a paged cache's
    blocks, :class:`.paged.PagedKV`): query head ``h`` uses key/value head ``h // (H //
    H_kv)``, what it may see is ``visibility``, its scores are ``q k^T * scale`` (a Python
    float, so that float32 work stays float32) changed by ``scores``, its weights dropped
    by ``dropout``; each worker's scratch is at most ``budget`` bytes."""

    q: np.ndarray
    k: Any
    v: Any
    visibility: Visibility
    scale: float
    scores: Scores | None = None
    dropout: Dropout | None = None
    budget: int = DEFAULT_MAX_MEMORY

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return int(self.q.shape[-3] // self.k.shape[-3])

    def folded(self) -> tuple[KernelCall, np.ndarray | None]:
        """This call with its query temperature (:class:`.scores.QueryTemperature`) folded
        into ``q``: ``q * t (*batch, 1, L, 1)``, a new array, at each row's position (the
        visibility's, :meth:`.contract.Visibility.query_positions`), and ``t``, which the
        queries' gradient takes; the call itself and ``None`` when it has none."""
        scores = self.scores
        if scores is None or scores.temperature is None:
            return self, None
        t = scores.temperature.factors(self.visibility.query_positions())
        factor = t.astype(self.q.dtype)[..., None]
        rest = None
        if scores.transforms or scores.sinks is not None:
            rest = Scores(scores.transforms, scores.sinks)
        return replace(self, q=self.q * factor, scores=rest), factor


@dataclass
class Outputs:
    """Where the forward writes: ``out (*batch, H, L, d_v)``, and when asked for the
    weights ``(*batch, H, L, S)`` and the log-sum-exp ``(*batch, H, L)``, arriving filled
    with 0, 0 and ``-inf`` (rows and items that see no key are not visited); tiles are
    computed in ``out.dtype``, float32 or wider."""

    out: np.ndarray
    weights: np.ndarray | None = None
    lse: np.ndarray | None = None


@dataclass
class Gradients:
    """Where the backward writes: ``dq`` (written; it may be the output's gradient itself),
    ``dk``, ``dv`` and ``dbias`` (shaped like the visibility's bias: the bias's own size,
    never the scores'), arriving zeroed and accumulated, and ``dsinks (H,)`` when the
    sinks' gradient is wanted, ``dtable (H, T)`` when a relative-position bias's table's
    is. ``dq`` comes out times ``dq_factor`` (the chain rule of a scale the caller folded
    into ``q``)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias: np.ndarray | None = None
    dsinks: np.ndarray | None = None
    dq_factor: float = 1.0
    dtable: np.ndarray | None = None  # a relative-position bias's table (relative.py)
