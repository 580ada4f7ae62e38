"""Qwen4-Exp's QSA indexer: top-k sparse attention over blocks of averaged keys, one choice
for every head of a layer (:class:`mha.BlockSparseAttention` with a :class:`QSAIndexerSpec`).

The indexer has ``n`` query heads and one key of ``d`` features, from one projection of
``x``; its keys are kept raw (the cache holds them so), and averaged over blocks of ``c``
consecutive tokens (``compress_ratio``)::

    q_i  = Norm(x_i @ W_q')              (n heads of d; the first r rotated at p_i)
    K_j  = Norm(mean of the raw keys of tokens j c, ..., j c + c - 1)
                                         (rotated at the block's first position, j c)
    s_ij = sum_h relu(q_ih . K_j) / sqrt(d)

where ``Norm`` is an RMSNorm times ``offset + weight`` (``offset`` 1) and ``r`` the layer's
rotated width. Query ``i`` at position ``p_i`` sees ``m_i = (p_i + 1) // c`` complete blocks;
it keeps the ``budget // c`` of them of the highest ``s_ij`` (all when there are fewer),
chosen as ``torch.topk`` chooses over those ``m_i`` scores, ties included (:mod:`.topk`), and
always the tokens past its last complete block up to itself. The keys are those at positions
``0 .. S - 1`` (a key's position its slot, as transformers' blocks are).

>>> spec = QSAIndexerSpec(budget=6, compress_ratio=3, num_heads=2, head_dim=8)
>>> spec.shapes(16)["W_index_qk"], spec.groups
((16, 24), 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import positive_int
from ..errors import AttentionValueError
from .rotary import apply_rotary, positive_real
from .topk import top_k

__all__ = ["QSA_WEIGHTS", "QSAIndexerSpec"]

QSA_WEIGHTS = ("W_index_qk", "index_q_norm", "index_k_norm")
"""The indexer's weights, in the "x @ W" layout (transformers' names:
``indexer.index_qk_proj``, ``indexer.q_layernorm`` and ``indexer.k_layernorm`` weights)."""


def norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float) -> np.ndarray:
    """RMSNorm of the last axis of ``x`` times ``offset + weight``."""
    scale = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    normed: np.ndarray = x * scale * (offset + weight)
    return normed


def rotated(x: np.ndarray, at: Any, rotary: Mapping[str, Any] | None) -> np.ndarray:
    """``x (..., L, d)`` with its first ``rotary["rotary_dim"]`` features rotated at ``at``."""
    if rotary is None:
        return x
    r = rotary["rotary_dim"]
    return np.concatenate([apply_rotary(x[..., :r], at, **rotary), x[..., r:]], axis=-1)


def indexer_head(spec: Any, rotated: int, who: str) -> tuple[int, float]:
    """An indexer's ``head_dim`` and ``norm_offset`` checked: the head as wide as the layer's
    rotated width ``rotated`` at least (the indexer rotates it), the offset a number."""
    d = positive_int("head_dim", spec.head_dim)
    if d < rotated:
        raise AttentionValueError(
            f"{who}'s head_dim={d} is narrower than the layer's rotated width {rotated}, "
            "which it rotates"
        )
    offset = spec.norm_offset
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise AttentionValueError(f"norm_offset must be a number; got {offset!r}")
    return d, float(offset)


@dataclass(frozen=True)
class QSAIndexerSpec:
    """A QSA indexer's settings: ``budget`` tokens of complete blocks kept a query
    (``indexer_budget``), blocks of ``compress_ratio`` tokens (``indexer_compress_ratio``,
    dividing the budget), ``num_heads`` query heads (``indexer_n_heads``) of ``head_dim``
    features (``indexer_head_dim``), its RMSNorms' epsilon ``norm_eps`` and the offset of
    their weights ``norm_offset``."""

    budget: Any
    compress_ratio: Any
    num_heads: Any
    head_dim: Any
    norm_eps: Any = 1e-6
    norm_offset: Any = 1.0

    names = QSA_WEIGHTS
    groups = 1
    """One choice for every head of the layer."""

    def checked(self, num_heads: int, rotated: int) -> QSAIndexerSpec:
        """The settings checked against the layer's rotated width ``rotated``."""
        budget, c = (
            positive_int("budget", self.budget),
            positive_int("compress_ratio", self.compress_ratio),
        )
        if budget % c:
            raise AttentionValueError(
                f"the QSA indexer's budget={budget} is not a multiple of its "
                f"compress_ratio={c} (it keeps whole blocks)"
            )
        d, offset = indexer_head(self, rotated, "the QSA indexer")
        n, eps = positive_int("num_heads", self.num_heads), positive_real("norm_eps", self.norm_eps)
        return QSAIndexerSpec(budget, c, n, d, eps, offset)

    def shapes(self, d_model: int) -> dict[str, tuple[int, ...]]:
        """Each indexer weight's shape, for inputs ``d_model`` wide."""
        d = self.head_dim
        return {
            "W_index_qk": (d_model, (self.num_heads + 1) * d),
            "index_q_norm": (d,),
            "index_k_norm": (d,),
        }

    def keys(
        self, x: np.ndarray, W: Mapping[str, np.ndarray], at: np.ndarray, rotary: Any
    ) -> np.ndarray:
        """The raw keys of the tokens ``x (B, L, E)``: ``(B, 1, L, d)``, as the cache holds
        them (normalised and rotated once averaged)."""
        k: np.ndarray = (x @ W["W_index_qk"][:, self.num_heads * self.head_dim :])[:, None]
        return k

    def choose(
        self,
        x: np.ndarray,
        W: Mapping[str, np.ndarray],
        at: np.ndarray,
        keys: np.ndarray,
        rotary: Mapping[str, Any] | None,
    ) -> np.ndarray:
        """Which keys each query of ``x (B, L, E)`` at positions ``at (B, L)`` attends to:
        ``(B, 1, L, S)`` over the raw ``keys (B, 1, S, d)``."""
        n, d, c = self.num_heads, self.head_dim, self.compress_ratio
        B, L = x.shape[0], x.shape[-2]
        S = keys.shape[-2]
        eps, offset = self.norm_eps, self.norm_offset
        q = (x @ W["W_index_qk"][:, : n * d]).reshape(B, L, n, d)
        q = rotated(np.moveaxis(norm(q, W["index_q_norm"], eps, offset), -2, -3), at, rotary)
        blocks = S // c
        pooled = keys[:, 0, : blocks * c].reshape(B, blocks, c, d).mean(-2)
        pooled = rotated(
            norm(pooled, W["index_k_norm"], eps, offset), np.arange(blocks) * c, rotary
        )
        products = np.maximum(q @ np.swapaxes(pooled, -1, -2)[:, None], 0.0)  # (B, n, L, blocks)
        scores = products.sum(1) / float(np.sqrt(d))  # (B, L, blocks)
        seen = np.minimum((at + 1) // c, blocks)  # complete blocks each query sees
        chosen = np.zeros((B, L, S), bool)
        for m in np.unique(seen[seen > 0]).tolist():  # rows of m scores, as torch.topk has them
            rows = seen == m
            kept = top_k(scores[rows][:, :m], self.budget // c)
            picked = np.zeros((int(rows.sum()), S), bool)
            picked[:, : m * c] = np.repeat(kept, c, axis=-1)
            chosen[rows] = picked
        j = np.arange(S)
        chosen |= (j >= (seen * c)[..., None]) & (j <= at[..., None])  # the tail, always
        return chosen[:, None]
