"""The functional API: ``scaled_dot_product_attention`` and ``multi_head_attention``.

Weights use the "x @ W" layout: ``W_q (d_q, H*d_k)`` maps a query of width ``d_q`` to the
``H`` heads' concatenated queries. Shapes are named as in the paper: ``B`` batch, ``H``
heads, ``L`` query positions, ``S`` key positions, ``d_k``/``d_v`` per-head widths.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import (
    as_float_array,
    check_rank,
    positive_int,
    resolve_scale,
    result_and_compute_dtypes,
)
from .errors import ShapeError
from .kernel import attend
from .masks import Visibility

__all__ = ["multi_head_attention", "scaled_dot_product_attention"]


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: bool = False,
    causal_alignment: str = "bottom_right",
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Any:
    """Attention over already split heads: ``softmax(q k^T * scale + bias) v`` per head.

    ``q (..., H, L, d_k)``, ``k (..., H, S, d_k)``, ``v (..., H, S, d_v)`` with the same
    leading axes. Returns ``(..., H, L, d_v)``, or ``(out, weights)`` with weights
    ``(..., H, L, S)`` when ``return_weights=True``. ``scale`` defaults to ``1/sqrt(d_k)``.
    The masking keywords follow the contract in :mod:`mha.masks` (True = may attend).

    >>> import numpy as np
    >>> from mha import scaled_dot_product_attention
    >>> q = k = np.eye(2)[None]                      # one head, two positions
    >>> v = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    >>> scaled_dot_product_attention(q, k, v, causal=True).round(3)  # e^(1/sqrt 2) = 2.028
    array([[[1.  , 0.  ],
            [0.33, 0.67]]])
    """
    q = as_float_array("q", q)
    k = as_float_array("k", k)
    v = as_float_array("v", v)
    for name, array in (("q", q), ("k", k), ("v", v)):
        if array.ndim < 3:
            raise ShapeError(
                f"{name} must have shape (..., H, {'L' if name == 'q' else 'S'}, d) with a "
                f"head axis; got shape {array.shape}"
            )
    _same("q", q, "k", k, "leading (batch..., H) axes {}", q.shape[:-2], k.shape[:-2])
    _same("k", k, "v", v, "leading (batch..., H) axes {}", k.shape[:-2], v.shape[:-2])
    _same("q", q, "k", k, "head width {}", q.shape[-1], k.shape[-1])
    _same("k", k, "v", v, "{} positions", k.shape[-2], v.shape[-2])
    result_dtype, compute_dtype = result_and_compute_dtypes(q, k, v)
    visibility = Visibility.build(
        batch_shape=q.shape[:-3],
        H=q.shape[-3],
        L=q.shape[-2],
        S=k.shape[-2],
        mask=mask,
        causal=causal,
        causal_alignment=causal_alignment,
        key_lengths=key_lengths,
        query_lengths=query_lengths,
        bias=bias,
        dtype=compute_dtype,
    )
    scale = resolve_scale(scale, q.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"):
        out, weights = attend(
            q.astype(compute_dtype, copy=False),
            k.astype(compute_dtype, copy=False),
            v.astype(compute_dtype, copy=False),
            visibility,
            scale,
            return_weights,
        )
    return _finish(out, weights, result_dtype)


def multi_head_attention(
    Q: Any,
    K: Any,
    V: Any,
    W_q: Any,
    W_k: Any,
    W_v: Any,
    W_o: Any,
    num_heads: int,
    *,
    mask: Any = None,
    causal: bool = False,
    causal_alignment: str = "bottom_right",
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    b_q: Any = None,
    b_k: Any = None,
    b_v: Any = None,
    b_o: Any = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Any:
    """Multi-head attention (Vaswani et al., 2017) with "x @ W" weights.

    ``Q (B, L, d_q)``, ``K (B, S, d_kin)``, ``V (B, S, d_vin)`` (or unbatched ``(L, d)``),
    ``W_q (d_q, H*d_k)``, ``W_k (d_kin, H*d_k)``, ``W_v (d_vin, H*d_v)``,
    ``W_o (H*d_v, d_out)``. Projects, splits the width evenly across ``num_heads`` heads,
    runs :func:`scaled_dot_product_attention` per head (scale ``1/sqrt(d_k)``), joins the
    heads and applies ``W_o``. Returns ``(B, L, d_out)``, or ``(out, weights)`` with
    per-head weights ``(B, H, L, S)`` when ``return_weights=True``. The optional
    ``b_q``, ``b_k``, ``b_v``, ``b_o`` are added after their projections.

    >>> import numpy as np
    >>> from mha import multi_head_attention
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((1, 3, 4))
    >>> W_q, W_k, W_v, W_o = rng.standard_normal((4, 4, 4))
    >>> out, weights = multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, 2, causal=True,
    ...                                     return_weights=True)
    >>> out.shape, out.dtype, weights.shape
    ((1, 3, 4), dtype('float64'), (1, 2, 3, 3))
    >>> weights[0, 0, 0]                             # the first query sees only itself
    array([1., 0., 0.])
    >>> weights.sum(axis=-1)                         # every row of weights sums to 1
    array([[[1., 1., 1.],
            [1., 1., 1.]]])
    """
    Q = as_float_array("Q", Q)
    K = as_float_array("K", K)
    V = as_float_array("V", V)
    check_rank("Q", Q, "(B, L, d_q) or (L, d_q)", (2, 3))
    check_rank("K", K, f"{'(B, S, d_kin)' if Q.ndim == 3 else '(S, d_kin)'}, like Q", (Q.ndim,))
    check_rank("V", V, f"{'(B, S, d_vin)' if Q.ndim == 3 else '(S, d_vin)'}, like Q", (Q.ndim,))
    _same("Q", Q, "K", K, "batch shape {}", Q.shape[:-2], K.shape[:-2])
    _same("K", K, "V", V, "batch shape {}", K.shape[:-2], V.shape[:-2])
    _same("K", K, "V", V, "{} positions", K.shape[-2], V.shape[-2])

    W_q, W_k, W_v, W_o = (
        as_float_array(name, W) for name, W in zip(_WEIGHTS, (W_q, W_k, W_v, W_o), strict=True)
    )
    for name, W in zip(_WEIGHTS, (W_q, W_k, W_v, W_o), strict=True):
        check_rank(name, W, "(rows, columns) in the x @ W layout", (2,))
    _chain("Q", Q, "W_q", W_q)
    _chain("K", K, "W_k", W_k)
    _chain("V", V, "W_v", W_v)
    _same("W_q", W_q, "W_k", W_k, "{} columns", W_q.shape[1], W_k.shape[1])
    if W_o.shape[0] != W_v.shape[1]:
        raise ShapeError(
            f"W_o has {W_o.shape[0]} rows but W_v has {W_v.shape[1]} columns "
            f"(W_v {W_v.shape}, W_o {W_o.shape}); the joined heads of width H*d_v feed W_o"
        )
    H = positive_int("num_heads", num_heads)
    for name, W in (("W_q", W_q), ("W_v", W_v)):
        if W.shape[1] % H:
            raise ShapeError(
                f"num_heads={H} does not divide the {W.shape[1]} columns of {name} "
                f"({name} {W.shape}); each head needs an equal share of the width"
            )
    b_q, b_k, b_v, b_o = (
        _projection_bias(name, b, W.shape[1], W)
        for name, b, W in zip(
            ("b_q", "b_k", "b_v", "b_o"), (b_q, b_k, b_v, b_o), (W_q, W_k, W_v, W_o), strict=True
        )
    )

    result_dtype, compute_dtype = result_and_compute_dtypes(
        Q, K, V, W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o
    )
    B, L, S = Q.shape[:-2], Q.shape[-2], K.shape[-2]  # B is () for unbatched input
    visibility = Visibility.build(
        batch_shape=B,
        H=H,
        L=L,
        S=S,
        mask=mask,
        causal=causal,
        causal_alignment=causal_alignment,
        key_lengths=key_lengths,
        query_lengths=query_lengths,
        bias=bias,
        dtype=compute_dtype,
    )
    scale = resolve_scale(scale, W_q.shape[1] // H)

    def cast(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else array.astype(compute_dtype, copy=False)

    with np.errstate(invalid="ignore", over="ignore"):
        q = _split_heads(_project(cast(Q), cast(W_q), cast(b_q)), H)  # (*B, H, L, d_k)
        k = _split_heads(_project(cast(K), cast(W_k), cast(b_k)), H)  # (*B, H, S, d_k)
        v = _split_heads(_project(cast(V), cast(W_v), cast(b_v)), H)  # (*B, H, S, d_v)
        heads, weights = attend(q, k, v, visibility, scale, return_weights)
        out = _project(_merge_heads(heads), cast(W_o), cast(b_o))  # (*B, L, d_out)
    return _finish(out, weights, result_dtype)


_WEIGHTS = ("W_q", "W_k", "W_v", "W_o")


def _project(x: Any, W: Any, b: np.ndarray | None) -> np.ndarray:
    out: np.ndarray = x @ W
    if b is not None:
        out += b
    return out


def _split_heads(x: np.ndarray, H: int) -> np.ndarray:
    """``(*B, L, H*d)`` to ``(*B, H, L, d)``."""
    return np.moveaxis(x.reshape((*x.shape[:-1], H, x.shape[-1] // H)), -2, -3)


def _merge_heads(x: np.ndarray) -> np.ndarray:
    """``(*B, H, L, d)`` to ``(*B, L, H*d)``."""
    x = np.moveaxis(x, -3, -2)
    return x.reshape((*x.shape[:-2], x.shape[-2] * x.shape[-1]))


def _finish(out: np.ndarray, weights: np.ndarray | None, dtype: np.dtype) -> Any:
    with np.errstate(over="ignore"):
        out = out.astype(dtype, copy=False)
        if weights is None:
            return out
        return out, weights.astype(dtype, copy=False)


def _same(
    name_a: str, a: np.ndarray, name_b: str, b: np.ndarray, what: str, value_a: Any, value_b: Any
) -> None:
    """Raise unless ``value_a == value_b``; ``what`` is a phrase such as "{} positions"."""
    if value_a != value_b:
        raise ShapeError(
            f"{name_a} has {what.format(value_a)} but {name_b} has {value_b} "
            f"({name_a} {a.shape}, {name_b} {b.shape})"
        )


def _chain(name_x: str, x: np.ndarray, name_W: str, W: np.ndarray) -> None:
    """``x @ W`` needs ``x``'s width to equal ``W``'s rows."""
    if x.shape[-1] != W.shape[0]:
        raise ShapeError(
            f"{name_x} has width {x.shape[-1]} but {name_W} has {W.shape[0]} rows "
            f"({name_x} {x.shape}, {name_W} {W.shape}); x @ W needs them equal"
        )


def _projection_bias(name: str, b: Any, width: int, W: np.ndarray) -> np.ndarray | None:
    if b is None:
        return None
    array = as_float_array(name, b)
    if array.shape != (width,):
        raise ShapeError(
            f"{name} must have shape ({width},) to match the columns of its weight {W.shape}; "
            f"got shape {array.shape}"
        )
    return array
