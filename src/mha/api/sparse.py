"""Sparse top-k attention: DeepSeek-V3.2's lightning indexer (DSA), which picks the keys each
query of a :class:`mha.LatentAttention` attends to, and the cache of its keys.

The indexer has ``n`` heads of ``d`` features of its own. Its queries come from the layer's
normalised query latent ``q_low (*B, L, q_lora_rank)``, its one key per token from ``x``::

    q_i   = q_low_i @ W_index_q                (n heads of d; the first p rotated)
    k_j   = LayerNorm(x_j @ W_index_k)         (d; the first p rotated)
    w_i   = (x_i @ W_index_weights) / sqrt(n)  (one weight per indexer head)
    s_ij  = sum_h w_ih * relu(q_ih . k_j / sqrt(d))

where ``p`` is the layer's ``qk_rope_head_dim``, rotated at the tokens' positions by the
layer's rope, in pairs ``(i, i + p/2)`` (DeepSeek-V3.2) or ``(2i, 2i + 1)`` (GLM-MoE-DSA);
HY-V4's indexer rotates its last ``p`` features instead (``rotate_last``).
Query ``i`` attends to the ``topk`` keys of the highest ``s_ij`` among those its mask lets
it see (all of them when it sees fewer), chosen as ``torch.topk`` chooses, ties included
(:mod:`.topk`). The choice is a boolean mask over the keys, ANDed with the layer's own, so
the attention is the library's one kernel over exactly the chosen keys; it is piecewise
constant in the weights, and the layer's gradient is the attention's given the choice (as
transformers' indexer runs without gradient).

A layer may reuse an earlier layer's choice instead (HY-V4's ``"shared"``
layers: ``shares_choice_with``, that layer's index): it has no indexer, and each call takes
the choice as its ``mask``, the chooser's :attr:`SparseKVCache.chosen` after the chooser's
call on the same tokens (a whole sequence: a call with a new cache).

>>> import numpy as np
>>> spec = IndexerSpec(topk=2, num_heads=2, head_dim=4)
>>> spec.shapes(d_model=8, q_lora_rank=6)["W_index_q"]
(6, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .._arrays import flag, positive_int
from ..errors import AttentionValueError, ShapeError
from .cache import KVCache, read_only
from .rotary import apply_rotary, positive_real
from .topk import top_k

__all__ = ["INDEXER_WEIGHTS", "IndexerSpec", "SparseKVCache", "check_shared_choice", "choose_keys"]

INDEXER_WEIGHTS = ("W_index_q", "W_index_k", "index_k_norm", "b_index_k_norm", "W_index_weights")
"""The indexer's weights, in the "x @ W" layout (transformers' names: ``indexer.wq_b``,
``indexer.wk``, ``indexer.k_norm`` weight and bias, ``indexer.weights_proj``)."""


INDEX_TILE_BYTES = 1 << 22
"""The indexer's products of query heads and keys held at once: 4 MiB."""


class LayerRope(Protocol):
    """What the indexer reads of its layer's plan (:class:`~.latent_math.LatentPlan`): the
    rotated width ``p`` and the rope's keywords (:func:`mha.apply_rotary`'s)."""

    @property
    def p(self) -> int: ...

    @property
    def rotary(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class IndexerSpec:
    """A lightning indexer's settings: ``topk`` keys per query (``index_topk``),
    ``num_heads`` heads (``index_n_heads``) of ``head_dim`` features (``index_head_dim``),
    whose first ``qk_rope_head_dim`` (its last with ``rotate_last``, HY-V4's) are rotated in
    pairs ``(2i, 2i + 1)`` when ``rotary_interleaved`` (GLM-MoE-DSA's), else ``(i, i + p/2)``
    (DeepSeek-V3.2's); ``norm_eps`` is its key LayerNorm's."""

    topk: Any
    num_heads: Any
    head_dim: Any
    rotary_interleaved: Any = False
    norm_eps: Any = 1e-6
    rotate_last: Any = False

    def checked(self, rope_dim: int, q_lora_rank: int | None) -> IndexerSpec:
        """The settings checked against the layer's (its rotary width, its query latent)."""
        topk, heads = positive_int("topk", self.topk), positive_int("num_heads", self.num_heads)
        d = positive_int("head_dim", self.head_dim)
        if q_lora_rank is None:
            raise AttentionValueError(
                "the indexer's queries come from the query latent (q_lora_rank): a layer "
                "with an indexer needs q_lora_rank"
            )
        if d < rope_dim:
            raise AttentionValueError(
                f"the indexer's head_dim={d} is narrower than the rotated "
                f"qk_rope_head_dim={rope_dim} it starts with"
            )
        return IndexerSpec(
            topk,
            heads,
            d,
            flag("rotary_interleaved", self.rotary_interleaved),
            positive_real("norm_eps", self.norm_eps),
            flag("rotate_last", self.rotate_last),
        )

    def shapes(self, d_model: int, q_lora_rank: int) -> dict[str, tuple[int, ...]]:
        """Each indexer weight's shape."""
        n, d = self.num_heads, self.head_dim
        return {
            "W_index_q": (q_lora_rank, n * d),
            "W_index_k": (d_model, d),
            "index_k_norm": (d,),
            "b_index_k_norm": (d,),
            "W_index_weights": (d_model, n),
        }


def index_keys(
    plan: LayerRope, spec: IndexerSpec, x: np.ndarray, W: dict[str, np.ndarray], at: np.ndarray
) -> np.ndarray:
    """The indexer's keys of the tokens ``x (*B, L, E)`` at positions ``at``: ``(*B, 1, L,
    d)``, LayerNorm then the rope on the first ``p``."""
    k = x @ W["W_index_k"]
    mean = k.mean(-1, keepdims=True)
    centred = k - mean
    k = centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + spec.norm_eps)
    k = k * W["index_k_norm"]
    if "b_index_k_norm" in W:
        k = k + W["b_index_k_norm"]
    k = k[..., None, :, :]
    return _rotated(plan, spec, k, at)


def index_scores(
    plan: LayerRope,
    spec: IndexerSpec,
    q_low: np.ndarray,
    x: np.ndarray,
    W: dict[str, np.ndarray],
    at: np.ndarray,
    keys: np.ndarray,
) -> np.ndarray:
    """``s (*B, L, S)``: the scores of the queries of ``q_low (*B, L, q_lora_rank)`` and
    ``x`` at positions ``at`` against ``keys (*B, 1, S, d)``."""
    n, d = spec.num_heads, spec.head_dim
    q = q_low @ W["W_index_q"]
    q = np.moveaxis(q.reshape(*q.shape[:-1], n, d), -2, -3)  # (*B, n, L, d)
    q = _rotated(plan, spec, q, at)
    weights = x @ W["W_index_weights"] * n**-0.5  # (*B, L, n)
    batch, L = q.shape[:-3], q.shape[-2]
    heads = np.moveaxis(q, -3, -2)  # (*B, L, n, d)
    k = keys[..., 0, :, :]  # (*B, S, d)
    S = k.shape[-2]
    scores = np.empty((*batch, L, S), np.result_type(q, k))
    # Tiles of queries and keys: every head's products of a tile in one GEMM, the keys read
    # once per tile of queries, at most INDEX_TILE_BYTES of products at a time.
    rows = min(L, 64)
    step = max(64, INDEX_TILE_BYTES // (rows * n * scores.itemsize))
    for i in range(0, L, rows):
        stop_i = min(L, i + rows)
        tile_q = heads[..., i:stop_i, :, :].reshape(*batch, (stop_i - i) * n, d)
        per_query = weights[..., i:stop_i, :, None]  # (*B, rows, n, 1)
        for j in range(0, S, step):
            stop_j = min(S, j + step)
            dots = k[..., j:stop_j, :] @ np.swapaxes(tile_q, -1, -2)  # (*B, keys, rows * n)
            dots *= d**-0.5
            np.maximum(dots, 0.0, out=dots)
            per_head = np.swapaxes(dots.reshape(*dots.shape[:-1], stop_i - i, n), -2, -3)
            scores[..., i:stop_i, j:stop_j] = (per_head @ per_query)[..., 0]  # sum over heads
    return scores


def _rotated(plan: LayerRope, spec: IndexerSpec, x: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``x (..., L, d)`` with its first ``p`` features (its last, ``rotate_last``) rotated by
    the layer's rope, paired as the indexer pairs them."""
    rotary = {**plan.rotary, "interleaved": spec.rotary_interleaved}
    p = plan.p
    if spec.rotate_last:
        cut = x.shape[-1] - p
        return np.concatenate([x[..., :cut], apply_rotary(x[..., cut:], at, **rotary)], axis=-1)
    return np.concatenate([apply_rotary(x[..., :p], at, **rotary), x[..., p:]], axis=-1)


class SparseKVCache(KVCache):
    """The :class:`mha.KVCache` of a :class:`mha.LatentAttention` with an indexer: the
    latent cache, and beside it the indexer's key of every token (``index_keys``, ``(B,
    length, index_head_dim)``), which grow together; ``truncate`` and ``reorder`` act on
    both. Made by the layer's ``new_cache``.

    >>> import mha
    >>> cache = SparseKVCache(2, 1, 10, index_head_dim=6, value_dim=8, values_in_keys=True)
    >>> cache.index_keys.shape
    (2, 0, 6)
    """

    def __init__(self, *args: Any, index_head_dim: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        d = positive_int("index_head_dim", index_head_dim)
        self._index = KVCache(
            self.batch_size,
            1,
            d,
            capacity=self.capacity,
            dtype=self.dtype,
            values_in_keys=True,
        )
        self._chosen = np.zeros((self.batch_size, 0, 0), bool)

    @property
    def chosen(self) -> np.ndarray:
        """The keys each query of the last call attended to, ``(B, L, S)`` (its ``L``
        queries, the ``S`` positions the cache held then), read-only: the ``mask`` of a
        layer that reuses this layer's choice, for its call on the same tokens."""
        return read_only(self._chosen)

    @property
    def index_keys(self) -> np.ndarray:
        """The indexer's keys of the tokens held, ``(B, max length, index_head_dim)`` (past a
        sequence's length: not its tokens), read-only."""
        return read_only(self._index._attended(int(self.lengths.max(initial=0)))[0][:, 0])

    def truncate(self, lengths: Any) -> None:
        super().truncate(lengths)
        self._index.truncate(lengths)

    truncate.__doc__ = KVCache.truncate.__doc__

    def reorder(self, indices: Any) -> None:
        super().reorder(indices)
        self._index.reorder(indices)

    reorder.__doc__ = KVCache.reorder.__doc__


@dataclass
class Choice:
    """What :func:`choose_keys` gives the attention: its keywords (the chosen keys' mask in
    place of the call's) and, with a cache, the indexer keys to commit once it succeeded."""

    attention: dict[str, Any]
    commit: Callable[[], None]


def choose_keys(
    plan: LayerRope,
    spec: IndexerSpec,
    x: np.ndarray,
    q_low: np.ndarray,
    W: dict[str, np.ndarray],
    at: np.ndarray,
    attention: dict[str, Any],
) -> Choice:
    """The keys each query of ``x (*B, L, E)`` attends to, as the attention's mask
    (``(*B, 1, L, S)``, the layer's own mask and window ANDed in, the top-k taken among
    the keys they show, as transformers' indexer takes its layer's mask): over ``x``
    itself, or over the cache's tokens and ``x``'s, whose indexer keys it appends
    (committed by the choice's ``commit`` once the attention succeeded)."""
    for name in ("query_lengths", "key_lengths"):
        if attention.get(name) is not None:
            raise AttentionValueError(
                f"{name}= is not taken by sparse top-k attention (a layer with an indexer): "
                "give a boolean mask, or call each sequence on its own"
            )
    mask, causal, cache = attention["mask"], bool(attention["causal"]), attention["cache"]
    new = index_keys(plan, spec, x, W, at)  # (*B, 1, L, d)
    L = x.shape[-2]
    if cache is None:
        keys, visible = new, _visible(mask, causal, x.shape[:-2], L)
        commit: Callable[[], None] = _nothing
    else:
        if not isinstance(cache, SparseKVCache):
            raise AttentionValueError(
                f"a layer with an indexer (sparse top-k attention) keeps its indexer's keys "
                f"beside the latent: give the cache its new_cache makes, not {cache!r}"
            )
        if mask is not None and not isinstance(mask, (bool, np.bool_)):
            raise AttentionValueError(
                "a mask array cannot be combined with cache= in sparse top-k attention: the "
                "cached tokens are attended causally"
            )
        counts = np.full(x.shape[0], L, np.int64)
        filled = cache._index._append(new, new, counts)
        S = int(filled.max(initial=0))
        keys = cache._index._attended(S)[0]
        visible = np.arange(S) <= at[..., None]  # (B, L, S): causal over the positions

        def commit() -> None:
            cache._index._commit(counts)
            cache._chosen = chosen

    window = attention.get("window")
    if window is not None:  # a sliding window's keys alone compete (transformers' mask)
        rows = np.arange(L)[:, None] if cache is None else at[..., None]
        visible = visible & (rows - np.arange(visible.shape[-1]) < window)
    scores = index_scores(plan, spec, q_low, x, W, at, keys)
    chosen = top_k(np.where(visible, scores, -np.inf), spec.topk) & visible

    return Choice({**attention, "mask": chosen[..., None, :, :], "causal": None}, commit)


def _nothing() -> None:
    return None


def _visible(mask: Any, causal: bool, batch: tuple[int, ...], L: int) -> np.ndarray:
    """Which keys each query may see, ``(*B, L, L)``: the layer's mask and ``causal``."""
    visible = np.ones((*batch, L, L), bool)
    if mask is True or causal:
        visible &= np.tri(L, dtype=bool)
    if mask is None or isinstance(mask, (bool, np.bool_)):
        return visible
    given = np.asarray(mask)
    if given.ndim == 4 and given.shape[1] != 1:
        raise ShapeError(
            f"sparse top-k attention picks one set of keys for every head: its mask must "
            f"not differ by head (got shape {given.shape}; give (B, 1, L, L) or (B, L, L))"
        )
    if given.ndim == 4:
        given = given[:, 0]
    try:
        seen: np.ndarray = visible & np.broadcast_to(given, visible.shape)
    except ValueError:
        raise ShapeError(
            f"the mask of shape {given.shape} does not fit the queries and keys "
            f"{visible.shape} of this call"
        ) from None
    return seen


def check_shared_choice(mask: Any, layer: int) -> None:
    """``mask`` checked as the choice of layer ``layer``, which a layer reusing that layer's
    choice attends with: a boolean array (:attr:`SparseKVCache.chosen`)."""
    if isinstance(mask, np.ndarray) and mask.dtype == bool and mask.ndim >= 2:
        return
    raise AttentionValueError(
        f"this layer attends to the keys layer {layer}'s indexer chose (it reuses that "
        f"layer's top-k choice): give mask= that choice, layer {layer}'s cache.chosen after "
        f"layer {layer}'s call on the same tokens (got mask={mask!r:.40})"
    )
