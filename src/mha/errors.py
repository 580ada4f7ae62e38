"""The exception family raised for mistakes a caller can make.

Every error subclasses :class:`AttentionError` and also ``ValueError`` or
``TypeError``, so callers can catch it either way:

>>> import numpy as np, mha
>>> try:
...     mha.scaled_dot_product_attention(np.ones((1, 2, 4)), np.ones((1, 3, 4)), np.ones((1, 5, 4)))
... except ValueError as error:
...     print(error)
k has 3 positions but v has 5 (k (1, 3, 4), v (1, 5, 4))
"""

from __future__ import annotations

__all__ = [
    "AttentionError",
    "AttentionTypeError",
    "AttentionValueError",
    "PoolExhaustedError",
    "ShapeError",
    "WeightsFileError",
]


class AttentionError(Exception):
    """Base class of every error that mha raises for a caller's mistake."""


class AttentionValueError(AttentionError, ValueError):
    """An argument has an unusable value (a length out of range, a bad scale, ...)."""


class ShapeError(AttentionValueError):
    """Arrays whose shapes do not fit together; the message names both shapes."""


class PoolExhaustedError(AttentionValueError):
    """A paged cache's pool has too few free blocks for an append; nothing was changed."""


class AttentionTypeError(AttentionError, TypeError):
    """An argument has an unusable type or dtype (complex data, an integer mask, ...)."""


class WeightsFileError(AttentionError, OSError):
    """A weights file that is missing, truncated, or does not hold what it should."""


# The public names are mha.ShapeError and so on (re-exported by the package): tracebacks and
# reprs show those, not this module's path.
for _error in (
    AttentionError,
    AttentionValueError,
    ShapeError,
    PoolExhaustedError,
    AttentionTypeError,
    WeightsFileError,
):
    _error.__module__ = "mha"
del _error
