"""Block-sparse top-k attention: MiniMax-M3's lightning indexer, which picks, for each query
and each group of heads, the blocks of keys it attends to (:class:`BlockSparseAttention`).

The indexer has ``n`` heads of ``d`` features of its own (``n`` divides the query heads: head
``h`` takes indexer head ``h // (H / n)``), one key a token, and blocks of ``b`` keys::

    q_i    = Norm(x_i @ W_index_q)       (n heads of d; the first r rotated)
    k_j    = Norm(x_j @ W_index_k)       (d; the first r rotated)
    s_ij   = q_i . k_j                   (-inf where j is past query i's position p_i)
    t_ic   = max over the keys j of block c (j // b = c) of s_ij

where ``Norm`` is an RMSNorm times ``offset + weight`` (Gemma's, ``offset`` 1) and ``r`` the
layer's rotated width, rotated as the layer's keys are, at the tokens' positions. The
``local_blocks`` blocks ending with the query's own (``p_i // b``, ``p_i // b - 1``, ...,
floored at block 0) score ``+inf``; query ``i`` keeps the ``topk_blocks`` blocks of the
highest ``t_ic`` (all of them when there are fewer), chosen as ``torch.topk`` chooses, ties
included (:mod:`.topk`), but a block of no visible key. It attends to the keys of its kept
blocks at or before its position: the choice ``(B, n, L, S)`` is the layer's ``mask_mod``
(:class:`ChosenKeys`), so that the attention is the library's one kernel over exactly those
keys, and the kernel's block map of it lets the walk skip every tile of keys that no query
of the tile's rows chose (with blocks of 128 keys, MiniMax-M3's, the map's). The choice is
piecewise constant in the weights: the layer's gradient is the attention's given the choice
(transformers' indexer has none that reaches its output). With a cache
(:class:`~.sparse.SparseKVCache`, from :meth:`BlockSparseAttention.new_cache`) the indexer's
keys grow beside the layer's.

>>> import numpy as np
>>> spec = BlockIndexerSpec(block_size=4, topk_blocks=2, local_blocks=1, num_heads=2,
...                         head_dim=8)
>>> spec.shapes(16)["W_index_q"]
(16, 16)
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Self, SupportsIndex

import numpy as np

from .._arrays import as_float_array, non_negative_int, positive_int
from ..errors import AttentionValueError, ShapeError
from .configuration import LayerSpec, float_dtype
from .module import MultiHeadAttention
from .qsa import QSA_WEIGHTS, QSAIndexerSpec, indexer_head
from .rotary import apply_rotary, positive_real
from .sparse import SparseKVCache
from .topk import top_k

__all__ = [
    "BLOCK_INDEXER_WEIGHTS",
    "BlockIndexerSpec",
    "BlockSparseAttention",
    "BlockSparseSpec",
    "choose_blocks",
]

BLOCK_INDEXER_WEIGHTS = ("W_index_q", "W_index_k", "index_q_norm", "index_k_norm")
"""The indexer's weights, in the "x @ W" layout (transformers' names: ``indexer.q_proj``,
``indexer.k_proj``, ``indexer.q_norm`` and ``indexer.k_norm`` weights)."""


@dataclass(frozen=True)
class BlockIndexerSpec:
    """A block indexer's settings: blocks of ``block_size`` keys (``index_block_size``),
    ``topk_blocks`` of them kept a query (``index_topk_blocks``), the ``local_blocks``
    ending with the query's own always kept (``index_local_blocks``), ``num_heads`` heads
    (``index_n_heads``) of ``head_dim`` features (``index_head_dim``), its RMSNorms'
    epsilon ``norm_eps`` and the offset of their weights ``norm_offset``.

    >>> BlockIndexerSpec(128, 16, 1, 4, 128).checked(64, 64).norm_offset
    1.0
    """

    block_size: Any
    topk_blocks: Any
    local_blocks: Any
    num_heads: Any
    head_dim: Any
    norm_eps: Any = 1e-6
    norm_offset: Any = 1.0

    def checked(self, num_heads: int, rotated: int) -> BlockIndexerSpec:
        """The settings checked against the layer's ``num_heads`` query heads and its
        rotated width ``rotated`` (0: no rotation).

        >>> BlockIndexerSpec(4, 2, 1, 3, 8).checked(4, 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mha.AttentionValueError: the block indexer's num_heads=3 does not divide ...
        """
        n = positive_int("num_heads", self.num_heads)
        if num_heads % n:
            raise AttentionValueError(
                f"the block indexer's num_heads={n} does not divide the layer's {num_heads} "
                "query heads (each indexer head chooses for a group of them)"
            )
        d, offset = indexer_head(self, rotated, "the block indexer")
        return BlockIndexerSpec(
            positive_int("block_size", self.block_size),
            positive_int("topk_blocks", self.topk_blocks),
            non_negative_int("local_blocks", self.local_blocks),
            n,
            d,
            positive_real("norm_eps", self.norm_eps),
            offset,
        )

    names = BLOCK_INDEXER_WEIGHTS

    @property
    def groups(self) -> int:
        """The choices a query makes: one an indexer head.

        >>> BlockIndexerSpec(4, 2, 1, 2, 8).groups
        2
        """
        return int(self.num_heads)

    def keys(
        self, x: np.ndarray, W: Mapping[str, np.ndarray], at: np.ndarray, rotary: Any
    ) -> np.ndarray:
        """The indexer's keys of the tokens ``x`` at positions ``at`` (``W`` its weights,
        ``rotary`` the layer's rope: :func:`index_keys`).

        >>> import numpy as np
        >>> spec = BlockIndexerSpec(2, 1, 1, 1, 4)
        >>> W = {"W_index_k": np.eye(4), "index_k_norm": np.zeros(4)}
        >>> spec.keys(np.ones((1, 3, 4)), W, np.arange(3)[None], None)[0, 0, 0].round(3)
        array([1., 1., 1., 1.])
        """
        return index_keys(self, x, W, at, rotary)

    def choose(
        self,
        x: np.ndarray,
        W: Mapping[str, np.ndarray],
        at: np.ndarray,
        keys: np.ndarray,
        rotary: Any,
    ) -> np.ndarray:
        """The keys each query of ``x`` at positions ``at`` keeps among ``keys`` (``W``
        the indexer's weights, ``rotary`` the layer's rope: :func:`choose_blocks`).

        >>> import numpy as np
        >>> spec = BlockIndexerSpec(2, 1, 1, 1, 4)
        >>> W = {"W_index_q": np.eye(4), "W_index_k": np.eye(4),
        ...      "index_q_norm": np.zeros(4), "index_k_norm": np.zeros(4)}
        >>> x, at = np.random.default_rng(0).standard_normal((1, 4, 4)), np.arange(4)[None]
        >>> keys = spec.keys(x, W, at, None)
        >>> spec.choose(x, W, at, keys, None)[0, 0, 3].tolist()  # its own block alone
        [False, False, True, True]
        """
        return choose_blocks(self, x, W, at, keys, rotary)

    def shapes(self, d_model: int) -> dict[str, tuple[int, ...]]:
        """Each indexer weight's shape, for inputs ``d_model`` wide.

        >>> BlockIndexerSpec(4, 2, 1, 2, 8).shapes(16)["W_index_k"]
        (16, 8)
        """
        n, d = self.num_heads, self.head_dim
        return {
            "W_index_q": (d_model, n * d),
            "W_index_k": (d_model, d),
            "index_q_norm": (d,),
            "index_k_norm": (d,),
        }


def _norm(x: np.ndarray, weight: np.ndarray, spec: BlockIndexerSpec) -> np.ndarray:
    """RMSNorm of the last axis of ``x`` times ``offset + weight``."""
    scale = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + spec.norm_eps)
    normed: np.ndarray = x * scale * (spec.norm_offset + weight)
    return normed


def _rotated(x: np.ndarray, at: np.ndarray, rotary: Mapping[str, Any] | None) -> np.ndarray:
    """``x (..., L, d)`` with its first ``rotary["rotary_dim"]`` features rotated at ``at``."""
    if rotary is None:
        return x
    r = rotary["rotary_dim"]
    turned = apply_rotary(x[..., :r], at, **rotary)
    return np.concatenate([turned, x[..., r:]], axis=-1)


def index_keys(
    spec: BlockIndexerSpec,
    x: np.ndarray,
    W: Mapping[str, np.ndarray],
    at: np.ndarray,
    rotary: Mapping[str, Any] | None,
) -> np.ndarray:
    """The indexer's keys of the tokens ``x (B, L, E)`` at positions ``at``: ``(B, 1, L,
    d)``."""
    k = _norm(x @ W["W_index_k"], W["index_k_norm"], spec)[:, None]
    return _rotated(k, at, rotary)


def choose_blocks(
    spec: BlockIndexerSpec,
    x: np.ndarray,
    W: Mapping[str, np.ndarray],
    at: np.ndarray,
    keys: np.ndarray,
    rotary: Mapping[str, Any] | None,
) -> np.ndarray:
    """Which keys each query of ``x (B, L, E)`` at positions ``at (B, L)`` attends to, for
    each indexer head: ``(B, n, L, S)`` over the indexer's ``keys (B, 1, S, d)`` (key ``j``
    at position ``j``), the keys past each query hidden."""
    n, d, b = spec.num_heads, spec.head_dim, spec.block_size
    B, L = x.shape[0], x.shape[-2]
    S = keys.shape[-2]
    q = _norm((x @ W["W_index_q"]).reshape(B, L, n, d), W["index_q_norm"], spec)
    q = _rotated(np.moveaxis(q, -2, -3), at, rotary)  # (B, n, L, d)
    past = np.arange(S) <= at[:, None, :, None]  # (B, 1, L, S)
    scores = np.where(past, q @ np.swapaxes(keys, -1, -2), -np.inf)
    blocks = -(-S // b)
    padded = np.full((B, n, L, blocks * b), -np.inf, scores.dtype)
    padded[..., :S] = scores
    block_scores = padded.reshape(B, n, L, blocks, b).max(-1)  # (B, n, L, blocks)
    own = at // b  # (B, L)
    for back in range(spec.local_blocks):  # the local blocks always win
        local = np.broadcast_to(np.maximum(own - back, 0)[:, None, :, None], (B, n, L, 1))
        np.put_along_axis(block_scores, local, np.inf, axis=-1)
    kept = top_k(block_scores, spec.topk_blocks) & (block_scores > -np.inf)
    chosen: np.ndarray = np.repeat(kept, b, axis=-1)[..., :S] & past
    return chosen


class ChosenKeys:
    """The indexer's choice ``chosen (B, n, L, S)`` as the layer's ``mask_mod``: query
    position ``q`` of sequence ``b`` (row ``q - start[b]``) keeps key ``kv`` in head ``h``
    where its indexer head ``h // group`` chose it. The kernel's block map of it skips the
    tiles of keys no query of the tile's rows chose. (An object, not a function: a call's
    keywords holding one are checked afresh, never kept.)"""

    def __init__(self, chosen: np.ndarray, start: np.ndarray, group: int) -> None:
        self.chosen, self.start, self.group = chosen, start, group

    def __call__(self, b: np.ndarray, h: np.ndarray, q: np.ndarray, kv: np.ndarray) -> np.ndarray:
        kept: np.ndarray = self.chosen[b, h // self.group, q - self.start[b], kv]
        return kept


@dataclass(frozen=True)
class BlockSparseSpec(LayerSpec):
    """What a :class:`BlockSparseAttention` computes besides its weights: the keywords of
    :class:`~mha.LayerSpec` (``num_heads``, ``num_kv_heads``, ``head_dim``, ``rope_theta``,
    ``rotary_dim``, ``rotary_interleaved``, ``rope_scaling``, ``window``, ``sink_tokens``,
    ``softcap``, ``alibi``, ``chunk``, ``scale``, ``qk_norm``, ``qk_norm_eps``,
    ``qk_norm_offset``, ``add_zero_attn``, ``output_gate``, ``output_gate_per_head``,
    ``query_temperature``, ``v_head_dim``, ``clip_qkv``, ``qk_layernorm``,
    ``qk_norm_after_rope``, ``v_norm``, ``shares_kv_with``, ``output_norm``,
    ``output_norm_eps``), with its indexer
    ``block_indexer`` (a :class:`BlockIndexerSpec` or a
    :class:`~mha.api.qsa.QSAIndexerSpec`).

    >>> BlockSparseSpec(num_heads=4, block_indexer=BlockIndexerSpec(4, 2, 1, 2, 8)).kind
    'block_sparse'
    """

    block_indexer: Any = None

    kind = "block_sparse"


class BlockSparseAttention(MultiHeadAttention):
    """A :class:`~mha.MultiHeadAttention` of ``d_model`` and ``num_heads`` heads whose
    queries attend to the blocks of keys its indexer picks (MiniMax-M3's sparse layers; the
    module's docstring has the formulas):
    ``indexer`` a :class:`BlockIndexerSpec`, its weights ``W_index_q``, ``W_index_k``,
    ``index_q_norm`` and ``index_k_norm`` (normal, by ``seed``); or Qwen4-Exp's QSA
    indexer, a :class:`~mha.api.qsa.QSAIndexerSpec` (weights ``W_index_qk``,
    ``index_q_norm``, ``index_k_norm``). The other keywords (``options``) are
    :class:`~mha.MultiHeadAttention`'s. The attention is causal
    (the indexer hides the keys past each query); a boolean ``mask`` combines with the
    choice by AND. :meth:`new_cache` keeps the indexer's keys beside the layer's.
    ``backward`` is the attention's given the choice: the indexer's weights have no
    gradient. It is not saved to ``.npz`` files nor held by ``torch.nn.MultiheadAttention``.

    >>> import numpy as np
    >>> indexer = BlockIndexerSpec(block_size=2, topk_blocks=1, local_blocks=1,
    ...                            num_heads=2, head_dim=8)
    >>> layer = BlockSparseAttention(16, 4, indexer=indexer, rope_theta=100.0, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((1, 6, 16))
    >>> out, weights = layer(x, mask=True, return_weights=True)
    >>> (weights[0, :, 5] > 0).sum(-1).tolist()  # its own block alone: keys 4 and 5
    [2, 2, 2, 2]
    """

    not_saved = "its indexer"
    not_torch = "block-sparse attention (an indexer picks the keys)"

    W_index_q: np.ndarray
    W_index_k: np.ndarray
    index_q_norm: np.ndarray
    index_k_norm: np.ndarray
    indexer: BlockIndexerSpec | QSAIndexerSpec
    kind = "block_sparse"
    """What a reader's spec builds (:class:`BlockSparseSpec`'s kind)."""

    def __init__(
        self,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        *,
        indexer: BlockIndexerSpec | QSAIndexerSpec,
        seed: int | np.random.Generator | None = None,
        **options: Any,
    ) -> None:
        rng = np.random.default_rng(seed)
        super().__init__(d_model, num_heads, seed=rng, **options)
        self._configure_indexer(indexer)
        for name, shape in self.indexer.shapes(self.d_model).items():
            if name.startswith("W_"):
                W = rng.normal(0.0, shape[0] ** -0.5, shape)
            else:
                W = rng.normal(0.0, 0.1, shape)
            setattr(self, name, W.astype(self.dtype))

    def _configure_indexer(self, indexer: Any) -> None:
        if not isinstance(indexer, (BlockIndexerSpec, QSAIndexerSpec)):
            raise AttentionValueError(
                f"indexer must be a BlockIndexerSpec or a QSAIndexerSpec; got "
                f"{reprlib.repr(indexer)}"
            )
        if self.rotary_interleaved:
            raise AttentionValueError(
                "a block indexer rotates its features in pairs (i, i + r/2): "
                "rotary_interleaved=True is not taken"
            )
        self.indexer = indexer.checked(self.num_heads, self._rotated_width())

    def _rotated_width(self) -> int:
        if self.rope_theta is None:
            return 0
        return int(self.rotary_dim or self.head_dim)

    def _rotary(self) -> dict[str, Any] | None:
        if self.rope_theta is None:
            return None
        return {
            "theta": self.rope_theta,
            "rotary_dim": self._rotated_width(),
            "scaling": self.rope_scaling,
        }

    def weights(self) -> dict[str, np.ndarray | None]:
        """The weights by attribute name, the indexer's last.

        >>> layer = BlockSparseAttention(8, 2, indexer=BlockIndexerSpec(2, 1, 1, 2, 4))
        >>> list(layer.weights())[-2:]
        ['index_q_norm', 'index_k_norm']
        """
        return {**super().weights(), **{n: getattr(self, n) for n in self.indexer.names}}

    @property
    def spec(self) -> BlockSparseSpec:
        """What this layer computes besides its weights (:meth:`from_spec` takes it back).

        >>> layer = BlockSparseAttention(8, 2, indexer=BlockIndexerSpec(2, 1, 1, 2, 4))
        >>> layer.spec.block_indexer.topk_blocks
        1
        """
        plain = super().spec
        given = {f.name: getattr(plain, f.name) for f in fields(plain)}
        return BlockSparseSpec(**given, block_indexer=self.indexer)

    @classmethod
    def from_spec(
        cls, spec: LayerSpec, weights: Mapping[str, Any], source: str = "weights"
    ) -> Self:
        """A layer computing ``spec`` (a :class:`BlockSparseSpec`) with ``weights``, the
        indexer's among them (``source`` names them in messages).

        >>> layer = BlockSparseAttention(8, 2, indexer=BlockIndexerSpec(2, 1, 1, 2, 4), seed=0)
        >>> BlockSparseAttention.from_spec(layer.spec, layer.weights()).W_index_q.shape
        (8, 8)
        """
        indexer = getattr(spec, "block_indexer", None)
        if indexer is None:
            raise AttentionValueError(f"{source}: block-sparse attention needs block_indexer")
        plain = LayerSpec(**{f.name: getattr(spec, f.name) for f in fields(LayerSpec)})
        others = {n: x for n, x in weights.items() if n not in BLOCK_INDEXER_WEIGHTS + QSA_WEIGHTS}
        self = super().from_spec(plain, others, source)
        self._configure_indexer(indexer)
        for name, shape in self.indexer.shapes(self.d_model).items():
            x = weights.get(name)
            if x is None or np.shape(x) != shape:
                raise ShapeError(
                    f"{source}: {name} must have shape {shape}; got "
                    f"{None if x is None else np.shape(x)}"
                )
            setattr(self, name, np.array(x, dtype=float_dtype(self.dtype)))
        return self

    def new_cache(
        self, batch_size: int, *, capacity: int = 256, dtype: Any = None
    ) -> SparseKVCache:
        """An empty :class:`~mha.api.sparse.SparseKVCache` for ``batch_size`` sequences: the
        layer's keys and values and the indexer's keys, which grow together (``capacity``
        and ``dtype`` as :meth:`mha.MultiHeadAttention.new_cache` takes them).

        >>> import numpy as np
        >>> layer = BlockSparseAttention(8, 2, indexer=BlockIndexerSpec(2, 1, 1, 2, 4), seed=0)
        >>> cache = layer.new_cache(1)
        >>> _ = layer(np.ones((1, 3, 8)), cache=cache)
        >>> cache.index_keys.shape
        (1, 3, 4)
        """
        return SparseKVCache(
            batch_size,
            self.num_kv_heads,
            self.head_dim,
            index_head_dim=self.indexer.head_dim,
            value_dim=self.v_head_dim,
            capacity=capacity,
            dtype=self.dtype if dtype is None else float_dtype(dtype),
        )

    def forward(self, query: Any, mask: Any = None, *misplaced: Any, **keywords: Any) -> Any:
        """:meth:`mha.MultiHeadAttention.forward` of ``query`` (with ``mask`` and the
        ``keywords`` it takes) over the keys the indexer picks for each query
        (self-attention, causal; ``key_lengths``, ``query_lengths``, ``padding_side``
        and ``mask_mod`` are not taken: give a boolean mask, or call each sequence on its
        own).

        >>> import numpy as np
        >>> layer = BlockSparseAttention(8, 2, indexer=BlockIndexerSpec(2, 1, 1, 2, 4), seed=0)
        >>> layer.forward(np.ones((1, 5, 8)), True).shape
        (1, 5, 8)
        """
        for name in ("key", "value", "key_lengths", "query_lengths", "padding_side"):
            if keywords.get(name) is not None:
                raise AttentionValueError(
                    f"{name}= is not taken by block-sparse attention (its indexer picks keys "
                    "among the query's own tokens, by position)"
                )
        if keywords.pop("mask_mod", None) is not None:
            raise AttentionValueError(
                "mask_mod= is not taken by block-sparse attention: its indexer's choice is the "
                "layer's mask_mod; give a boolean mask"
            )
        x = as_float_array("query", query)
        if x.ndim not in (2, 3) or x.shape[-1] != self.d_model:
            raise ShapeError(
                f"query must have shape (B, L, {self.d_model}) or (L, {self.d_model}); "
                f"got shape {x.shape}"
            )
        x3 = x[None] if x.ndim == 2 else x
        dtype = np.result_type(x3.dtype, self.dtype, np.float32)
        x3 = x3.astype(dtype, copy=False)
        W = {name: getattr(self, name).astype(dtype, copy=False) for name in self.indexer.names}
        cache, positions = keywords.get("cache"), keywords.get("positions")
        array = mask is not None and not isinstance(mask, (bool, np.bool_))
        if array and isinstance(self.indexer, QSAIndexerSpec):
            raise AttentionValueError(
                "a mask array is not taken by a QSA indexer's layer: its blocks are of the "
                "tokens each query sees causally; give mask=True"
            )
        B, L = x3.shape[:2]
        if cache is None:
            start = np.zeros(B, np.int64)
            at = np.broadcast_to(np.arange(L) if positions is None else positions, (B, L))
            keys = self.indexer.keys(x3, W, at, self._rotary())
        else:
            if not isinstance(cache, SparseKVCache) or cache.index_keys.shape[-1] != (
                self.indexer.head_dim
            ):
                raise AttentionValueError(
                    "a block-sparse layer keeps its indexer's keys beside its own: give the "
                    f"cache its new_cache makes, not {cache!r}"
                )
            if mask is not None and not isinstance(mask, (bool, np.bool_)):
                raise AttentionValueError(
                    "a mask array cannot be combined with cache= in block-sparse attention: "
                    "the cached tokens are attended causally"
                )
            start = cache.lengths.astype(np.int64)
            at = np.broadcast_to(start[:, None] + np.arange(L) if positions is None else positions,
                                 (B, L))  # fmt: skip
            new = self.indexer.keys(x3, W, at, self._rotary())
            counts = np.full(B, L, np.int64)
            filled = cache._index._append(new, new, counts)
            keys = cache._index._attended(int(filled.max(initial=0)))[0]
        chosen = self.indexer.choose(x3, W, np.asarray(at), keys, self._rotary())
        group = self.num_heads // self.indexer.groups
        choice = ChosenKeys(chosen, start, group)
        result = super().forward(query, mask, *misplaced, **keywords, mask_mod=choice)
        if cache is not None:
            cache._index._commit(counts)
        return result

    __call__ = forward

    def __repr__(self) -> str:
        plain = super().__repr__().removeprefix("MultiHeadAttention(")
        return f"BlockSparseAttention(indexer={self.indexer}, {plain}"
