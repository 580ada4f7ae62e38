"""Attention maps: one heat map per head and their average, masked cells drawn apart.

matplotlib is an optional extra (``pip install ".[cli]"`` in the mha checkout, or
``pip install matplotlib``), imported only when a plot is made.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import numpy as np

from .._files import atomic_write
from ..errors import AttentionTypeError, AttentionValueError, ShapeError

__all__ = ["check_weights", "plot_attention"]

MASKED_COLOR = "#d9d9d9"


def plot_attention(
    weights: Any,
    path: Any,
    *,
    visible: Any = None,
    query_tokens: list[str] | None = None,
    key_tokens: list[str] | None = None,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Save a grid of heat maps of ``weights (H, L, S)`` (or ``(L, S)``) to ``path``.

    ``weights`` must be attention weights (:func:`check_weights`). The last panel is the
    average over heads. Cells where ``visible (…, L, S)`` (where the masks let each query
    see each key) is False are drawn in light grey with a hatch, so masked keys stand apart
    from keys that merely got little weight. Without ``visible`` the hatch marks cells whose
    weight is exactly 0 in every head (masked, or so small it underflowed), and the figure
    says so. ``query_tokens`` and ``key_tokens`` label the axes (``key_tokens`` defaults to
    ``query_tokens`` when ``L == S``), ``title`` heads the figure and ``dpi`` sets a PNG's
    resolution. The format follows the file name (``.png`` or ``.svg``); the file is
    written atomically.

    >>> import numpy as np, tempfile, os
    >>> from mha.cli.plots import plot_attention
    >>> weights = np.tril(np.ones((2, 3, 3))) / np.arange(1, 4)[:, None]  # causal, uniform
    >>> path = plot_attention(weights, os.path.join(tempfile.mkdtemp(), "map.png"),
    ...                       query_tokens=["the", "cat", "sat"])
    >>> path.name, path.stat().st_size > 0
    ('map.png', True)
    """
    _save_format(path)
    array = np.asarray(weights)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3:
        raise ShapeError(f"weights must have shape (H, L, S) or (L, S); got {array.shape}")
    check_weights(array)
    matplotlib = _matplotlib()
    H, L, S = array.shape
    if visible is None:
        seen = (array != 0).any(axis=0)
        note = "hatched: weight exactly 0 in every head (masked, or underflowed)"
    else:
        seen = np.broadcast_to(np.asarray(visible, dtype=bool), array.shape).any(axis=0)
        note = "hatched: masked"
    for name, tokens, n in (("query_tokens", query_tokens, L), ("key_tokens", key_tokens, S)):
        if tokens is not None and len(tokens) != n:
            raise ShapeError(f"{name} has {len(tokens)} tokens but the weights have {n} positions")
    key_tokens = key_tokens if key_tokens is not None else query_tokens if S == L else None
    panels = [(f"head {h}", array[h]) for h in range(H)]
    if H > 1:
        panels.append(("average", array.mean(axis=0)))
    figure, hatched = _draw(matplotlib, panels, seen, (query_tokens, key_tokens))
    if title:
        figure.suptitle(title)
    if hatched:
        figure.supxlabel(note, fontsize=8)
    return _save(figure, path, dpi)


def _draw(
    matplotlib: Any,
    panels: list[tuple[str, np.ndarray]],
    seen: np.ndarray,
    tokens: tuple[list[str] | None, list[str] | None],
) -> tuple[Any, bool]:
    """A figure of the ``panels`` (label, ``(L, S)`` map), cells not ``seen`` masked (and
    hatched, for maps small enough), axes labelled by the query and key ``tokens``; and
    whether it hatched any."""
    L, S = seen.shape
    columns = min(len(panels), 4)
    rows = -(-len(panels) // columns)
    cell = 0.45 if max(L, S) <= 12 else 5.0 / max(L, S)
    width = columns * (1.6 + max(S * cell, 1.2))  # a panel is at least 1.2 inches a side
    height = rows * (1.2 + max(L * cell, 1.2))
    # A bare Figure, not pyplot: no global state, no change to the caller's backend.
    figure = matplotlib.figure.Figure(figsize=(width, height), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    colormap = matplotlib.colormaps["viridis"].with_extremes(bad=MASKED_COLOR)
    hatches = None  # masked cells: one hatched collection, copied into every panel
    if (~seen).any() and L * S <= 16384:  # large maps keep the grey alone
        hatches = matplotlib.collections.PatchCollection(
            [
                matplotlib.patches.Rectangle((j - 0.5, i - 0.5), 1, 1)
                for i, j in zip(*np.nonzero(~seen), strict=True)
            ],
            facecolor="none",
            edgecolor="#8c8c8c",
            hatch="///",
            linewidth=0,
        )
    image = None
    for ax, (label, panel) in zip(axes.flat, panels, strict=False):
        shown = np.ma.masked_where(~seen, panel)
        image = ax.imshow(
            shown, cmap=colormap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto"
        )
        if hatches is not None:
            ax.add_collection(copy.copy(hatches))
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
        _ticks(ax.set_xticks, ax.set_xticklabels, S, tokens[1], rotation=90)
        _ticks(ax.set_yticks, ax.set_yticklabels, L, tokens[0])
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if image is not None:
        figure.colorbar(image, ax=list(axes.flat), shrink=0.8, label="attention weight")
    return figure, hatches is not None


def check_weights(weights: Any, name: str = "weights") -> None:
    """Refuse ``weights`` that cannot be attention weights: those are finite numbers in
    ``[0, 1]`` and each row (last axis) sums to 1, or to 0 for a query that sees no key.
    ``name`` is how messages refer to the array.

    >>> import numpy as np
    >>> check_weights(np.array([[0.25, 0.75], [0.0, 0.0]]))       # fine: returns None
    >>> check_weights(np.array([[-1.0, 2.0]]), "x")
    Traceback (most recent call last):
    mha.AttentionValueError: x cannot be attention weights: they hold -1 (weights lie in [0, 1])
    """
    array = np.asarray(weights)
    if array.dtype.kind not in "fiu":
        raise AttentionTypeError(f"{name} must be numbers; got dtype {array.dtype}")
    if array.size == 0:
        return
    if array.ndim < 1 or not np.isfinite(array).all():
        raise AttentionValueError(f"{name} cannot be attention weights: they hold NaN or inf")
    low, high = float(array.min()), float(array.max())
    tolerance = 1e-3 if array.dtype.kind != "f" else 64 * float(np.finfo(array.dtype).eps)
    if low < -tolerance or high > 1 + tolerance:
        value = low if low < -tolerance else high
        raise AttentionValueError(
            f"{name} cannot be attention weights: they hold {value:.4g} (weights lie in [0, 1])"
        )
    sums = array.sum(axis=-1, dtype=np.float64)
    bad = ~((np.abs(sums - 1) <= array.shape[-1] * tolerance) | (sums == 0))
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AttentionValueError(
            f"{name} cannot be attention weights: row {index} sums to {sums[index]:.4g}, "
            f"not 1 or 0 (shape {array.shape}; is it the attention output rather than the "
            "weights?)"
        )


def _ticks(set_ticks: Any, set_labels: Any, n: int, tokens: list[str] | None, **style: Any) -> None:
    if tokens is not None:
        set_ticks(range(n))
        set_labels(tokens, fontsize=8, **style)
    elif n <= 16:
        set_ticks(range(n))
        set_labels([str(i) for i in range(n)], fontsize=7)


def _save_format(path: Any) -> str:
    suffix = Path(os.fspath(path)).suffix.lower()
    if suffix not in (".png", ".svg"):
        raise AttentionValueError(f"plots are written as .png or .svg; got {os.fspath(path)!r}")
    return suffix[1:]


def _save(figure: Any, path: Any, dpi: int) -> Path:
    target = Path(os.fspath(path))
    kind = _save_format(target)
    return atomic_write(target, lambda handle: figure.savefig(handle, format=kind, dpi=dpi))


def _matplotlib() -> Any:
    try:
        import matplotlib
        import matplotlib.collections
        import matplotlib.figure
        import matplotlib.patches
        import matplotlib.ticker
    except ImportError:
        raise ImportError(
            'plots need matplotlib: pip install ".[cli]" in the mha checkout, '
            "or pip install matplotlib"
        ) from None
    return matplotlib
