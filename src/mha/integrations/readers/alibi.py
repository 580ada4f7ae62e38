"""ALiBi as each family computes its slopes (transformers 5.24): BLOOM's and MPT's
(:func:`bloom`, mha's :func:`mha.alibi_slopes`; MPT's ``build_mpt_alibi_tensor`` with the
``alibi_bias_max`` of 8 that transformers always gives it orders the same slopes as BLOOM
does), Falcon's (:func:`falcon`: BLOOM's, its bias divided by the scale's
``sqrt(head_dim)`` as the scores are, where transformers' bfloat16 bias is exact). A bias
``slope * (j - i)`` on the scores, the same in every row as transformers' ``slope * j`` up to
a constant the softmax ignores.

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> read = Settings(SimpleNamespace(path="ckpt", config={}), "bloom", {})
>>> (bloom(read, 6, 8) * 2**8).tolist()
[64.0, 16.0, 4.0, 1.0, 128.0, 32.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...api.variants import alibi_slopes
from .config import Settings

__all__ = ["Alibi", "bloom", "falcon"]

Slopes = Callable[[Settings, int, int], np.ndarray]
"""A family's slopes from its config, its heads and their width."""


@dataclass(frozen=True)
class Alibi:
    """ALiBi's ``slopes`` for a family; on when the config key ``key`` is true (always when
    ``None``)."""

    slopes: Slopes
    key: str | None = None

    def on(self, read: Settings) -> bool:
        return self.key is None or bool(read.get(self.key))


def bloom(read: Settings, H: int, d: int) -> np.ndarray:
    """BLOOM's ``_get_alibi_slopes``: :func:`mha.alibi_slopes`."""
    return alibi_slopes(H)


BFLOAT16_EXACT = 256
"""The positions below which a power of two times the position is a bfloat16 (8 bits)."""


def falcon(read: Settings, H: int, d: int) -> np.ndarray:
    """Falcon's: BLOOM's, divided by ``sqrt(head_dim)`` (its scores' scale, which applies to
    the bias too). transformers computes its bias in bfloat16 (``slopes.bfloat16() *
    position``): exact where every slope is a power of two and every position below 256,
    else rounded, position by position, which mha does not compute: refused."""
    slopes = alibi_slopes(H)
    positions = read.positive("max_position_embeddings")
    if not np.all(np.log2(slopes) == np.round(np.log2(slopes))) or positions > BFLOAT16_EXACT:
        raise read.refuse(
            f"alibi=True, {read.name('num_attention_heads')}={H} and "
            f"max_position_embeddings={positions} (Falcon's ALiBi, which transformers "
            "computes in bfloat16, rounded unless every slope is a power of two and every "
            f"position below {BFLOAT16_EXACT})"
        )
    return slopes / math.sqrt(d)
