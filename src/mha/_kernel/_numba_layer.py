# mypy: ignore-errors
# (compiled code: numba types it, and numba ships no stubs; as for its siblings in pyproject)
"""numba code of a layer's small planned call (:mod:`mha.api.layer_plan`): the q, k, v
projection into heads (one product of joined weights, or three of separate ones) and the
output's product, each one compiled call, with the bits of the NumPy code they replace;
importing it needs numba.

Each product is NumPy's own: ``matmul`` of two C-contiguous matrices of at least two rows
and columns, and an inner dimension of at least two, calls ``cblas_?gemm`` (row-major, no
transposition, ``alpha = 1``, ``beta = 0``, the leading dimensions the widths); the same
call through its address (:func:`._numba_walk._gemm`) rounds as it does. The bias is then
added, and the queries multiplied by the late scale as they are copied into heads: one
IEEE operation each, as NumPy's ``+=`` and ``multiply`` make them (no fastmath here: no
operation is fused or reordered). A product written into columns of a wider buffer is the
same GEMM call with that buffer's width as its leading dimension: the same arithmetic, each
result stored at its place. Compiled for one signature per dtype by :mod:`.compiled`
(:func:`.compiled.layer_project`, :func:`.compiled.layer_project_apart`,
:func:`.compiled.layer_output`)."""

from __future__ import annotations

from numba import njit

from ._numba_walk import NO_TRANS, _gemm

__all__ = ["output", "project", "project_apart"]


def project(gemm, x, W, b, scaled, first, heads, joined, product):  # pragma: no cover
    """``product = x @ W (+ b)`` (``b`` of size 0: none), cut into ``heads = (q, k, v)``
    (each ``(B, H, L, d)``, C-contiguous: the columns of ``W`` are q's heads, then k's, then
    v's), q's times ``first`` when ``scaled``; ``joined`` (what the walk writes) zeroed."""
    _product(gemm, x, W, b, product, 0)
    _into_heads(product, scaled, first, heads, x.shape[0])
    joined[:] = 0.0


def project_apart(  # pragma: no cover
    gemm, x, W_q, W_k, W_v, b_q, b_k, b_v, scaled, first, heads, joined, product
):
    """:func:`project` by three products, as NumPy makes them for separate weights: ``x @
    W_q (+ b_q)`` into the first columns of ``product``, then k's and v's beside it (the
    same GEMM calls, each writing its own columns)."""
    _product(gemm, x, W_q, b_q, product, 0)
    _product(gemm, x, W_k, b_k, product, W_q.shape[1])
    _product(gemm, x, W_v, b_v, product, W_q.shape[1] + W_k.shape[1])
    _into_heads(product, scaled, first, heads, x.shape[0])
    joined[:] = 0.0


def output(gemm, joined, W, b, out):  # pragma: no cover
    """``out = joined @ W (+ b)`` (``b`` of size 0: none), ``joined (n, e)``."""
    _product(gemm, joined, W, b, out, 0)


@njit(boundscheck=False, nogil=True, inline="always")
def _into_heads(product, scaled, first, heads, n):  # pragma: no cover
    """``product``'s ``n`` rows cut into ``heads`` (q's columns first), q's times ``first``
    when ``scaled``."""
    L = heads[0].shape[2]
    at = 0
    for p in range(3):
        part = heads[p]
        H, d = part.shape[1], part.shape[3]
        times = scaled and p == 0
        for r in range(n):
            s, i = r // L, r % L
            for h in range(H):
                for j in range(d):
                    value = product[r, at + h * d + j]
                    part[s, h, i, j] = value * first if times else value
        at += H * d


@njit(boundscheck=False, nogil=True, inline="always")
def _product(gemm, x, W, b, out, at):  # pragma: no cover
    """``out[:, at:at + m] = x @ W`` by ``cblas_?gemm`` as NumPy's ``matmul`` calls it (the
    leading dimension ``out``'s width), then ``+= b`` (``b`` of size 0: none)."""
    n, e, m, ld = x.shape[0], x.shape[1], W.shape[1], out.shape[1]
    _gemm(gemm, (NO_TRANS, NO_TRANS, n, m, e, 1.0, 0.0), (x, 0, e), (W, 0, m), (out, at, ld))
    if b.shape[0] > 0:
        for r in range(n):
            for c in range(m):
                out[r, at + c] += b[c]
