"""Dropout on the attention weights, with the same mask in the forward and backward passes.

The mask does not depend on the tiling or the workers: the keep/drop decision for weight
``(b, h, i, j)`` is the ``j``-th number of a Philox stream keyed by ``(seed, row)``, row
being the flat index of ``(b, h, i)``, and any run of a row's keys is read from its stream
by advancing the counter (NumPy's ``Philox.advance``). ``seed`` is drawn once per call from
the caller's generator, so the caller's generator alone makes a run reproducible.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Dropout"]


@dataclass(frozen=True)
class Dropout:
    p: float  # the probability of dropping a weight, in [0, 1)
    seed: int
    heads: int  # H, the query heads
    rows: int  # L, the queries

    @classmethod
    def draw(cls, p: float, generator: Any, heads: int, rows: int) -> Dropout:
        """A dropout whose seed is drawn from ``generator`` (one draw)."""
        return cls(p, int(generator.integers(2**63)), heads, rows)

    def scale(
        self, batch: int, h0: int, heads: int, r0: int, r1: int, c0: int, c1: int, dtype: Any
    ) -> np.ndarray:
        """``(heads, r1 - r0, c1 - c0)``: 0 for a dropped weight, ``1 / (1 - p)`` for a kept
        one, for query heads ``h0 ..`` of batch index ``batch`` (flat)."""
        out = np.empty((heads, r1 - r0, c1 - c0), dtype)
        skip, kept = c0 % 4, 1.0 / (1.0 - self.p)
        for g in range(heads):
            for i in range(r0, r1):
                bits = np.random.Philox(
                    key=[self.seed, (batch * self.heads + h0 + g) * self.rows + i]
                )
                bits.advance(c0 // 4)  # each step of the counter makes 4 numbers
                u = np.random.Generator(bits).random(c1 - c0 + skip)[skip:]
                np.multiply(u >= self.p, kept, out=out[g, i - r0])
        return out


@contextlib.contextmanager
def drawn(p: float, generator: Any, heads: int, rows: int) -> Iterator[Dropout | None]:
    """A call's dropout (``None`` when ``p`` is 0), its seed drawn from ``generator``; if
    the call then fails (a ``mask_mod`` or ``score_mod`` refused as the kernel reaches it),
    the generator is put back as it was: a refused call leaves the generator be."""
    if not p:
        yield None
        return
    state = generator.bit_generator.state
    try:
        yield Dropout.draw(p, generator, heads, rows)
    except BaseException:
        generator.bit_generator.state = state
        raise
