"""``LatentAttention``: DeepSeek-V2/V3's multi-head latent attention (MLA), on the library's
one kernel, with a cache of the latent alone.

Each token is compressed to a latent ``c`` (``kv_lora_rank`` wide, RMS-normalised) and one
rotary key ``k_pe`` (``qk_rope_head_dim`` wide) shared by every head; the queries come
from ``x`` directly or through their own low-rank latent. The layer computes by the
absorbed form (:mod:`.latent_math`): each head's query is multiplied into the latent's
space, so all ``H`` query heads attend over the rows ``[c, k_pe]`` of one shared key/value
head, and a cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token (576 at
DeepSeek-V3's sizes, where the expanded keys and values would take 40,960).
"""

from __future__ import annotations

import dataclasses
import reprlib
from typing import Any, Literal, SupportsIndex, overload

import numpy as np

from .._arrays import (
    as_float_array,
    cast_result,
    flag,
    non_negative_int,
    positive_int,
    resolve_scale,
    result_and_compute_dtypes,
)
from ..errors import AttentionTypeError, AttentionValueError, ShapeError, WeightsFileError
from . import formats
from .cache import KVCache
from .checks import check_mask_argument, random_generator
from .configuration import float_dtype
from .gates import check_gate_activation
from .latent_cache import latent_cache, latent_paged_cache
from .latent_math import LatentPlan, latent_forward
from .latent_spec import LatentSpec
from .paged_cache import PagedKVCache
from .rotary import check_positions, check_rotary_options, positive_real
from .signatures import Backward, Flag
from .sparse import INDEXER_WEIGHTS, IndexerSpec, check_shared_choice
from .variants import check_query_temperature

__all__ = ["LatentAttention", "LatentSpec"]

PARAMETER_NAMES = (
    "W_q",
    "W_q_a",
    "b_q_a",
    "q_a_norm",
    "W_q_b",
    "W_kv_a",
    "b_kv_a",
    "kv_a_norm",
    "W_kv_b",
    "W_o",
    "b_o",
    "W_g",
    "sinks",
    "k_pe_norm",
)
"""The weights' attribute names, in the order the layer applies them."""


class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3) that owns its weights.

    ``d_model`` is the model width ``E`` and ``num_heads`` the number of query heads ``H``.
    Each head's query is ``qk_nope_head_dim`` unrotated features then ``qk_rope_head_dim``
    rotary ones; keys and values come from a latent ``kv_lora_rank`` wide. The weights are
    attributes in the "x @ W" layout (transformers' names in brackets):

    * the query: ``W_q (E, H*(nope + rope))`` [q_proj] when ``q_lora_rank`` is None, else
      ``W_q_a (E, q_lora_rank)`` [q_a_proj], ``q_a_norm (q_lora_rank,)`` [q_a_layernorm]
      and ``W_q_b (q_lora_rank, H*(nope + rope))`` [q_b_proj];
    * the latent and the shared rotary key: ``W_kv_a (E, kv_lora_rank + rope)``
      [kv_a_proj_with_mqa], ``kv_a_norm (kv_lora_rank,)`` [kv_a_layernorm];
    * each head's key and value from the latent: ``W_kv_b (kv_lora_rank, H*(nope +
      v_head_dim))`` [kv_b_proj], per head its ``nope`` key columns then its ``v_head_dim``
      value columns;
    * ``W_o (H*v_head_dim, E)`` [o_proj]; with ``bias=True`` also ``b_q_a``, ``b_kv_a`` and
      ``b_o`` (transformers' ``attention_bias``), ``None`` otherwise;
    * with ``output_gate`` (``"sigmoid"``), ``W_g (E, H)`` [g_proj]: each head's output
      times ``sigmoid(x @ W_g)`` before ``W_o`` (:class:`mha.api.gates.OutputGate`); with
      ``output_gate_per_head=False``, ``W_g (E, H*v_head_dim)`` [gate_proj], one a feature;
    * with ``sinks=True``, ``sinks (H,)`` [sinks]: one learned logit a head in every
      softmax's denominator (gpt-oss's attention sinks; zero to start).
    * with ``query_gate`` (A.X-K2's ``q_gate_proj``, with ``q_lora_rank``), the query and a
      gate per feature both read ``[norm(a), a]``, the query latent ``a = x @ W_q_a`` after
      and before its RMSNorm: ``W_q_b (2*q_lora_rank, H*(nope + rope))`` the query and
      ``W_g (2*q_lora_rank, H*v_head_dim)`` the gate's logits, ``output_gate`` its
      activation (``"sigmoid"`` by default);
    * with ``rope_key_norm``, ``k_pe_norm (qk_rope_head_dim,)`` [k_rope_only_layernorm]: the
      shared rotary key RMS-normalised (``norm_eps``) before its rotation (dots3's).

    ``window`` makes the attention a sliding window, as ``MultiHeadAttention``'s: query
    ``i`` sees key ``j`` only if ``i - j < window`` (the cache keeps every token); with an
    indexer, the top-k keys are those of the highest scores within the window (the
    indexer's scores masked by the window, as transformers masks them).

    The rotary embedding has base ``rope_theta`` and ``rope_scaling``, transformers'
    ``rope_parameters`` for a scaled rope (yarn, say; None for the default), and pairs
    features ``(2i, 2i + 1)`` with ``rotary_interleaved=True`` (DeepSeek's ``rope_interleave``,
    whose permuted layout gives the same dot products) or ``(i, i + rope/2)``. The RMSNorms
    take ``norm_eps``. ``scale`` is the softmax scale, ``(nope + rope) ** -0.5`` by default
    (DeepSeek's yarn checkpoints correct it by their ``mscale``: give it here).
    ``rotate=False`` leaves the ``qk_rope_head_dim`` features of the queries and of the
    shared key unrotated: attention without positions (Kimi-Linear's NoPE).
    ``query_temperature`` scales each query by its position (Mistral 4's; the keyword of
    :func:`mha.scaled_dot_product_attention`); ``rotate=False`` leaves the
    ``qk_rope_head_dim`` features unrotated (Kimi-Linear's NoPE).
    ``indexer`` (an :class:`~mha.api.sparse.IndexerSpec`, with ``q_lora_rank``) makes the
    attention sparse, DeepSeek-V3.2's: each query attends to the ``topk`` keys a lightning
    indexer scores highest (its weights ``W_index_q``, ``W_index_k``, ``index_k_norm``,
    ``b_index_k_norm`` and ``W_index_weights``, see :mod:`mha.api.sparse`), and
    :meth:`new_cache` keeps the indexer's keys beside the latent. ``shares_choice_with=j``
    makes a layer without an indexer attend to the keys layer ``j``'s indexer chose: each
    call takes that choice as its ``mask`` (layer ``j``'s cache's ``chosen``).
    ``dtype`` is the weights' floating dtype (default float64; bfloat16 and float16 are
    computed in float32). The initialisation is torch's ``nn.Linear`` one,
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, with zero biases and unit norm weights; ``seed``
    makes it reproducible.

    >>> import numpy as np
    >>> from mha import LatentAttention
    >>> attention = LatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8,
    ...                             qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 32))
    >>> attention(x, mask=True).shape                    # causal self-attention
    (2, 5, 32)
    >>> cache = attention.new_cache(2)                   # 16 + 4 numbers per token
    >>> prompt = attention(x, cache=cache)               # then one token at a time
    >>> attention(x[:, :1], cache=cache).shape, cache.lengths, cache.k.shape[-1]
    ((2, 1, 32), array([6, 6]), 20)
    """

    def __init__(
        self,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        *,
        kv_lora_rank: SupportsIndex,
        qk_nope_head_dim: SupportsIndex,
        qk_rope_head_dim: SupportsIndex,
        v_head_dim: SupportsIndex,
        q_lora_rank: SupportsIndex | None = None,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        rotary_interleaved: Flag = True,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        indexer: IndexerSpec | None = None,
        output_gate: str | None = None,
        query_temperature: tuple[float | str, ...] | None = None,
        output_gate_per_head: Flag = True,
        shares_choice_with: SupportsIndex | None = None,
        sinks: Flag = False,
        rotate: Flag = True,
        query_gate: Flag = False,
        window: SupportsIndex | None = None,
        rope_key_norm: Flag = False,
        bias: Flag = False,
        dtype: Any = np.float64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        self._configure(
            LatentSpec(
                d_model,
                num_heads,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                q_lora_rank,
                rope_theta,
                rope_scaling,
                rotary_interleaved,
                norm_eps,
                scale,
                indexer,
                output_gate,
                query_temperature,
                output_gate_per_head,
                shares_choice_with,
                rotate,
                query_gate,
                window,
                rope_key_norm,
            )
        )
        with_bias, with_sinks = flag("bias", bias), flag("sinks", sinks)
        self.dtype = float_dtype(dtype)
        rng = random_generator(seed)
        shapes = self._shapes()
        weights: dict[str, np.ndarray | None] = dict.fromkeys(PARAMETER_NAMES + INDEXER_WEIGHTS)
        for name in weights:
            if name not in shapes or (name.startswith("b_") and not with_bias):
                continue
            if name == "sinks" and not with_sinks:
                continue
            shape = shapes[name]
            if name.startswith("b_") or name == "sinks":
                weights[name] = np.zeros(shape, self.dtype)
            elif name.endswith("_norm"):
                weights[name] = np.ones(shape, self.dtype)
            else:
                bound = 1.0 / float(np.sqrt(shape[0]))
                weights[name] = rng.uniform(-bound, bound, size=shape).astype(self.dtype)
        self._set_weights(weights)

    @property
    def spec(self) -> LatentSpec:
        """What this layer computes besides its weights, as its constructor's keywords name
        it (``from_spec(attention.spec, attention.weights())`` is an equal layer).

        >>> from mha import LatentAttention
        >>> LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
        ...                 v_head_dim=4).spec.kv_lora_rank
        8
        """
        return LatentSpec(
            self.d_model,
            self.num_heads,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.q_lora_rank,
            self.rope_theta,
            self.rope_scaling,
            self.rotary_interleaved,
            self.norm_eps,
            self._given_scale,
            self.indexer,
            self.output_gate,
            self.query_temperature,
            self.output_gate_per_head,
            self.shares_choice_with,
            self.rotate,
            self.query_gate,
            self.window,
            self.rope_key_norm,
        )

    @classmethod
    def from_spec(
        cls, spec: LatentSpec, weights: dict[str, Any], dtype: Any = None
    ) -> LatentAttention:
        """A layer computing ``spec`` with the given ``weights`` (by attribute name, in the
        "x @ W" layout; each is copied), in ``dtype`` (by default the weights' common
        dtype). Every weight is checked against the spec, and names that the layer would not
        use are refused.

        >>> from mha import LatentAttention
        >>> attention = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4,
        ...                             qk_rope_head_dim=2, v_head_dim=4, seed=0)
        >>> copy = LatentAttention.from_spec(attention.spec, attention.weights())
        >>> bool((copy.W_o == attention.W_o).all())
        True
        """
        attention = cls.__new__(cls)
        attention._configure(spec)
        shapes = attention._shapes()
        unknown = sorted(
            name for name, W in weights.items() if W is not None and name not in shapes
        )
        if unknown:
            raise AttentionValueError(
                f"weights {', '.join(unknown)} are not used by this layer (q_lora_rank="
                f"{attention.q_lora_rank}); its weights are {', '.join(sorted(shapes))}"
            )
        arrays = {name: as_float_array(name, W) for name, W in weights.items() if W is not None}
        missing = [name for name in shapes if name not in arrays and not _optional(name)]
        if missing:
            raise AttentionValueError(
                f"weights {', '.join(missing)} are missing (q_lora_rank={attention.q_lora_rank})"
            )
        for name, W in arrays.items():
            if W.shape != shapes[name]:
                raise ShapeError(
                    f"{name} has shape {W.shape} but this layer needs {shapes[name]} "
                    f"({attention._sizes_of(name)})"
                )
        attention.dtype = float_dtype(
            result_and_compute_dtypes(*arrays.values())[0] if dtype is None else dtype
        )
        attention._set_weights(
            {
                name: arrays[name].astype(attention.dtype, copy=True) if name in arrays else None
                for name in PARAMETER_NAMES + INDEXER_WEIGHTS
            }
        )
        return attention

    @classmethod
    def from_pretrained(cls, path: Any, layer: int = 0, dtype: Any = None) -> LatentAttention:
        """Layer ``layer``'s attention of a DeepSeek-V2/V3 checkpoint at ``path`` (a
        transformers ``save_pretrained`` directory), in ``dtype`` (default: the
        checkpoint's), with its settings, its yarn rope and its corrected softmax scale, as
        :func:`mha.integrations.pretrained.read_layer` reads them; only that layer's
        attention tensors are read. A layer of any other kind of attention is refused.

        >>> from mha import LatentAttention
        >>> LatentAttention.from_pretrained("no-such-checkpoint")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mha.WeightsFileError: no-such-checkpoint does not exist; it should be a folder ...
        """
        spec, weights = formats.get("pretrained")(path, layer, dtype)
        if getattr(spec, "kind", None) != "latent":
            raise AttentionValueError(
                f"layer {layer} of {path} is not multi-head latent attention: load it with "
                f"mha.MultiHeadAttention.from_pretrained(path, layer={layer})"
            )
        return cls.from_spec(spec, weights)

    # fmt: off
    @overload
    def forward(
        self, x: Any, mask: Any = ..., *, causal: Flag = ..., positions: Any = ...,
        cache: KVCache | PagedKVCache | None = ..., query_lengths: Any = ...,
        key_lengths: Any = ...,
        return_backward: Literal[False] = ..., max_memory: SupportsIndex | None = ...,
        workers: SupportsIndex | None = ...,
    ) -> np.ndarray: ...
    @overload
    def forward(
        self, x: Any, mask: Any = ..., *, causal: Flag = ..., positions: Any = ...,
        cache: KVCache | PagedKVCache | None = ..., query_lengths: Any = ...,
        key_lengths: Any = ...,
        return_backward: Literal[True], max_memory: SupportsIndex | None = ...,
        workers: SupportsIndex | None = ...,
    ) -> tuple[np.ndarray, Backward]: ...
    @overload
    def forward(
        self, x: Any, mask: Any = ..., *, causal: Flag = ..., positions: Any = ...,
        cache: KVCache | PagedKVCache | None = ..., query_lengths: Any = ...,
        key_lengths: Any = ...,
        return_backward: Flag = ..., max_memory: SupportsIndex | None = ...,
        workers: SupportsIndex | None = ...,
    ) -> np.ndarray | tuple[np.ndarray, Backward]: ...
    # fmt: on

    def forward(
        self,
        x: Any,
        mask: Any = None,
        *,
        causal: Flag | None = None,
        positions: Any = None,
        cache: KVCache | PagedKVCache | None = None,
        query_lengths: Any = None,
        key_lengths: Any = None,
        return_backward: Flag = False,
        max_memory: SupportsIndex | None = None,
        workers: SupportsIndex | None = None,
    ) -> np.ndarray | tuple[np.ndarray, Backward]:
        """Self-attention of ``x (B, L, d_model)`` (or ``(L, d_model)``): the output in
        the inputs' dtype (``x``'s and the weights' common one), shaped like ``x``.

        ``mask`` is the second positional argument, as in ``MultiHeadAttention.forward``:
        ``None`` attends everywhere, ``True`` is causal, a boolean array marks where
        attention is allowed (True = may attend; ``(L, L)``, or ``(B, L, L)`` for every
        head, or ``(B, H, L, L)``). ``causal``, ``query_lengths`` and ``key_lengths`` (one
        per sequence) combine with it by AND. ``positions`` (``(L,)`` or ``(B, L)``,
        default ``0..L-1``) place the tokens for the rotary embedding. ``cache`` (from
        :meth:`new_cache`, or a paged one from :meth:`new_paged_cache`) makes ``x`` the next
        tokens of each sequence: their latents and
        rotary keys are appended, at the cache's positions, and they attend causally over
        everything cached (with ``query_lengths``, only the first ``query_lengths[b]`` rows
        of sequence ``b`` are real tokens). ``return_backward=True`` adds ``backward``, a
        function of the output's gradient that returns the gradients keyed by attribute
        name for the weights (those present; see :meth:`parameters`) and ``"query"`` for
        ``x``; not with a cache. ``max_memory`` and ``workers`` are the kernel's, as in
        :func:`mha.scaled_dot_product_attention`.

        >>> import numpy as np
        >>> from mha import LatentAttention
        >>> attention = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4,
        ...                             qk_rope_head_dim=2, v_head_dim=4, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((1, 3, 16))
        >>> out, backward = attention(x, mask=True, return_backward=True)
        >>> grads = backward(np.ones_like(out))
        >>> grads["query"].shape, grads["W_kv_b"].shape
        ((1, 3, 16), (8, 16))
        """
        x = as_float_array("x", x)
        if x.ndim not in (2, 3) or x.shape[-1] != self.d_model:
            raise ShapeError(
                f"x must have shape (B, L, {self.d_model}) or (L, {self.d_model}) "
                f"(d_model={self.d_model}); got shape {x.shape}"
            )
        want_backward = flag("return_backward", return_backward)
        at = self._positions(x, positions, cache, want_backward)
        check_mask_argument(mask)
        if self.shares_choice_with is not None:
            check_shared_choice(mask, self.shares_choice_with)
        given = {name: W for name, W in self.weights().items() if W is not None}
        shapes = self._shapes()
        for name, W in given.items():  # attributes may have been reassigned since
            if W.shape != shapes[name]:
                raise ShapeError(
                    f"{name} has shape {W.shape} but this layer needs {shapes[name]} "
                    f"({self._sizes_of(name)})"
                )
        result_dtype, dtype = result_and_compute_dtypes(x, *given.values())
        attention = {
            "mask": mask,
            "causal": causal,
            "query_lengths": query_lengths,
            "key_lengths": key_lengths,
            "cache": cache,
            "max_memory": max_memory,
            "workers": workers,
            "window": self.window,
        }
        if self.query_temperature is not None:  # at the kernel's positions: checked above
            attention["query_temperature"] = self.query_temperature
        threads = None if workers is None else positive_int("workers", workers)
        out, backward = latent_forward(
            self._plan(), x, given, dtype, at, attention, want_backward, threads
        )
        result = cast_result(out, result_dtype)
        return result if backward is None else (result, backward)

    def _positions(
        self,
        x: np.ndarray,
        positions: Any,
        cache: KVCache | PagedKVCache | None,
        want_backward: bool,
    ) -> np.ndarray:
        """Where the tokens of ``x`` sit: the cache's next positions, ``positions`` (checked),
        or ``0..L-1``; what a cached call cannot take is refused."""
        L = x.shape[-2]
        if cache is None:
            if positions is None:
                return np.arange(L)
            check_positions(positions, x.shape, f"x {x.shape}")
            given = np.asarray(positions)
            if self.query_temperature is not None and not (given == np.arange(L)).all():
                raise AttentionValueError(
                    f"positions= other than 0..{L - 1} cannot be combined with this layer's "
                    f"query_temperature={self.query_temperature}, which scales each query at "
                    "its row's position (a cache's length plus its row): give a cache instead"
                )
            return given
        refused = [
            why
            for why, given in (
                ("return_backward (call without the cache to train)", want_backward),
                (f"unbatched x {x.shape} (give (B, L, d_model))", x.ndim != 3),
                ("positions= (the cache's lengths give the positions)", positions is not None),
            )
            if given
        ]
        if refused:
            raise AttentionValueError(f"cache= cannot be combined with {'; '.join(refused)}")
        if not isinstance(cache, (KVCache, PagedKVCache)):
            raise AttentionTypeError(
                f"cache must be an mha.KVCache or mha.PagedKVCache; got {type(cache).__name__}"
            )
        if isinstance(cache, PagedKVCache) and self.indexer is not None:
            raise AttentionTypeError(
                "this layer's indexer keeps its keys in the cache of new_cache(); a "
                f"PagedKVCache cannot hold them ({cache!r})"
            )
        if cache.batch_size != x.shape[0]:
            raise ShapeError(
                f"x has {x.shape[0]} sequences but the cache holds {cache.batch_size}: "
                f"{cache!r} (x {x.shape})"
            )
        at: np.ndarray = cache.lengths[:, None] + np.arange(L)  # each sequence's own next
        return at

    __call__ = forward

    def new_cache(self, batch_size: int, capacity: int = 256, dtype: Any = None) -> KVCache:
        """An empty :class:`mha.KVCache` of the latent for ``batch_size`` sequences:
        ``kv_lora_rank + qk_rope_head_dim`` numbers per token in one buffer, whose first
        ``kv_lora_rank`` are the values (a view, ``values_in_keys=True``); with an indexer, a
        :class:`~mha.api.sparse.SparseKVCache` that also holds its keys. ``capacity``
        positions are preallocated; more are added as needed. ``dtype`` is what it stores,
        by default the weights' dtype.

        >>> import numpy as np
        >>> from mha import LatentAttention
        >>> attention = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4,
        ...                             qk_rope_head_dim=2, v_head_dim=4)
        >>> cache = attention.new_cache(3, capacity=32)
        >>> cache.k.shape, cache.v.shape, bool(np.shares_memory(cache.k, cache.v))
        ((3, 1, 32, 10), (3, 1, 32, 8), True)
        """
        return latent_cache(self, batch_size, capacity, dtype)

    def new_paged_cache(
        self, num_blocks: int, block_size: int, dtype: Any = None, **options: Any
    ) -> PagedKVCache:
        """An empty :class:`mha.PagedKVCache` of the latent, ``num_blocks`` blocks of
        ``block_size`` positions (sequences added, forked and released on it, as for
        :class:`mha.MultiHeadAttention`): each token's ``kv_lora_rank + qk_rope_head_dim``
        numbers in the key pool, its first ``kv_lora_rank`` (the values) in the value pool
        (1.9x the contiguous cache's bytes at DeepSeek's 512 + 64). ``dtype`` as
        :meth:`new_cache`; ``options``: the paged cache's (``quantize=``, ...). Not with an
        indexer, whose keys live in :meth:`new_cache`'s cache.

        >>> import numpy as np
        >>> from mha import LatentAttention
        >>> attention = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4,
        ...                             qk_rope_head_dim=2, v_head_dim=4, seed=0)
        >>> cache = attention.new_paged_cache(num_blocks=16, block_size=4)
        >>> cache.add("prompt")
        >>> out = attention(np.ones((1, 6, 16)), cache=cache)
        >>> cache.lengths
        array([6])
        """
        return latent_paged_cache(self, num_blocks, block_size, dtype, options)

    def parameters(self) -> dict[str, np.ndarray]:
        """The weights an optimiser updates, by attribute name: the arrays themselves (update
        them in place), only those present; their gradients have the same names. An
        indexer's weights are not among them (its choice of keys has no gradient).

        >>> from mha import LatentAttention
        >>> sorted(LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4,
        ...                        qk_rope_head_dim=2, v_head_dim=4).parameters())
        ['W_kv_a', 'W_kv_b', 'W_o', 'W_q', 'kv_a_norm']
        """
        return {
            name: W
            for name, W in self.weights().items()
            if W is not None and name not in INDEXER_WEIGHTS
        }

    def weights(self) -> dict[str, np.ndarray | None]:
        """Every weight by attribute name, ``None`` where absent: the arrays, not copies (an
        indexer's after the layer's).

        >>> from mha import LatentAttention
        >>> attention = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4,
        ...                             qk_rope_head_dim=2, v_head_dim=4, q_lora_rank=6)
        >>> {name: None if W is None else W.shape for name, W in attention.weights().items()}
        ... # doctest: +NORMALIZE_WHITESPACE
        {'W_q': None, 'W_q_a': (16, 6), 'b_q_a': None, 'q_a_norm': (6,), 'W_q_b': (6, 12),
         'W_kv_a': (16, 10), 'b_kv_a': None, 'kv_a_norm': (8,), 'W_kv_b': (8, 16),
         'W_o': (8, 16), 'b_o': None, 'W_g': None, 'sinks': None, 'k_pe_norm': None}
        """
        names = PARAMETER_NAMES + (INDEXER_WEIGHTS if self.indexer is not None else ())
        return {name: getattr(self, name) for name in names}

    def save(self, path: Any) -> None:
        """Write the spec and the weights to ``path`` as ``.npz`` (no pickle), atomically:
        a complete file replaces any existing one, or nothing changes.

        >>> from mha import LatentAttention
        >>> import os, tempfile, numpy as np
        >>> path = os.path.join(tempfile.mkdtemp(), "latent.npz")
        >>> saved = LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4,
        ...                         qk_rope_head_dim=2, v_head_dim=4, seed=0)
        >>> saved.save(path)
        >>> bool(np.array_equal(LatentAttention.load(path).W_kv_b, saved.W_kv_b))
        True
        """
        config = {**dataclasses.asdict(self.spec), "dtype": np.dtype(self.dtype).name}
        formats.get("npz.save_latent")(path, config, self.weights())

    @classmethod
    def load(cls, path: Any) -> LatentAttention:
        """Read ``path``, a file written by :meth:`save` (never unpickling anything): each
        weight's presence and shape checked against the spec it records.

        >>> from mha import LatentAttention
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "latent.npz")
        >>> LatentAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
        ...                 v_head_dim=4, q_lora_rank=6, seed=0).save(path)
        >>> LatentAttention.load(path).q_lora_rank
        6
        """
        config, weights = formats.get("npz.load_latent")(path)
        try:
            fields = {field.name for field in dataclasses.fields(LatentSpec)}
            unknown = sorted(set(config) - fields - {"format", "version", "dtype", "bfloat16"})
            if unknown:
                raise AttentionValueError(f"its config has unknown keys {unknown}")
            given = {key: value for key, value in config.items() if key in fields}
            if isinstance(given.get("indexer"), dict):  # saved as its fields
                given["indexer"] = IndexerSpec(**given["indexer"])
            spec = LatentSpec(**given)
            return cls.from_spec(spec, weights, config.get("dtype"))
        except (AttentionValueError, TypeError) as error:
            raise WeightsFileError(f"cannot load {path}: {error}") from None

    def __repr__(self) -> str:
        shown: dict[str, Any] = {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }
        for name, value, default in (
            ("rope_theta", self.rope_theta, 10000.0),
            ("rope_scaling", self.rope_scaling, None),
            ("rotary_interleaved", self.rotary_interleaved, True),
            ("norm_eps", self.norm_eps, 1e-6),
            ("scale", self._given_scale, None),
            ("indexer", self.indexer, None),
            ("output_gate", self.output_gate, None),
            ("query_temperature", self.query_temperature, None),
            ("output_gate_per_head", self.output_gate_per_head, True),
            ("shares_choice_with", self.shares_choice_with, None),
            ("rotate", self.rotate, True),
            ("query_gate", self.query_gate, False),
            ("window", self.window, None),
            ("rope_key_norm", self.rope_key_norm, False),
        ):
            if value != default:
                shown[name] = value
        if self.sinks is not None:
            shown["sinks"] = True
        settings = "".join(f", {name}={value!r}" for name, value in shown.items())
        return (
            f"LatentAttention(d_model={self.d_model}, num_heads={self.num_heads}{settings}, "
            f"bias={self.b_o is not None or self.b_kv_a is not None}, dtype={self.dtype.name})"
        )

    # Configuration -------------------------------------------------------------------

    def _configure(self, spec: LatentSpec) -> None:
        """Check and keep the settings (everything but the weights)."""
        d_model, num_heads, kv_lora_rank = spec.d_model, spec.num_heads, spec.kv_lora_rank
        qk_nope_head_dim, qk_rope_head_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        v_head_dim, q_lora_rank, rope_theta = spec.v_head_dim, spec.q_lora_rank, spec.rope_theta
        rope_scaling, rotary_interleaved = spec.rope_scaling, spec.rotary_interleaved
        norm_eps, scale, indexer = spec.norm_eps, spec.scale, spec.indexer
        self.d_model = positive_int("d_model", d_model)
        self.num_heads = positive_int("num_heads", num_heads)
        self.kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = positive_int("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = positive_int("qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = positive_int("v_head_dim", v_head_dim)
        self.q_lora_rank = None if q_lora_rank is None else positive_int("q_lora_rank", q_lora_rank)
        if indexer is not None and not isinstance(indexer, IndexerSpec):
            raise AttentionTypeError(
                f"indexer must be None or an IndexerSpec; got {reprlib.repr(indexer)}"
            )
        self.indexer = (
            None if indexer is None else indexer.checked(self.qk_rope_head_dim, self.q_lora_rank)
        )
        self.rotate = flag("rotate", spec.rotate)
        if self.indexer is not None and not self.rotate:
            raise AttentionValueError(
                "rotate=False (no positions) cannot be combined with an indexer, whose keys "
                "are rotated"
            )
        _, self.rope_theta, self.rotary_interleaved = check_rotary_options(
            self.qk_rope_head_dim if self.rotate else 2,  # unrotated features need not pair
            rope_theta,
            None,
            rotary_interleaved,
            f"qk_rope_head_dim={self.qk_rope_head_dim}",
            "rope_theta",
        )
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise AttentionTypeError(
                f"rope_scaling must be None or a dict of rope parameters (transformers' "
                f"rope_parameters); got {reprlib.repr(rope_scaling)}"
            )
        self.rope_scaling = None if rope_scaling is None else dict(rope_scaling)
        self.norm_eps = positive_real("norm_eps", norm_eps)
        self.output_gate = check_gate_activation(spec.output_gate)
        self.query_temperature = (
            None
            if spec.query_temperature is None
            else check_query_temperature(spec.query_temperature).keyword()
        )
        self.output_gate_per_head = flag("output_gate_per_head", spec.output_gate_per_head)
        shared, self.shares_choice_with = spec.shares_choice_with, None
        if shared is not None:
            self.shares_choice_with = non_negative_int("shares_choice_with", shared)
            if self.indexer is not None:
                raise AttentionValueError(
                    f"a layer that reuses layer {self.shares_choice_with}'s choice of keys "
                    "(shares_choice_with) has no indexer of its own: give indexer=None"
                )
        self.query_gate = flag("query_gate", spec.query_gate)
        if self.query_gate:
            if self.q_lora_rank is None:
                raise AttentionValueError(
                    "query_gate needs q_lora_rank: its query and gate read the query latent"
                )
            self.output_gate = self.output_gate or "sigmoid"
        self.window = None if spec.window is None else positive_int("window", spec.window)
        self.rope_key_norm = flag("rope_key_norm", spec.rope_key_norm)
        self._given_scale = None if scale is None else resolve_scale(scale, 1, np.dtype(np.float64))
        self.scale = (
            resolve_scale(None, self.qk_nope_head_dim + self.qk_rope_head_dim, np.dtype(np.float64))
            if self._given_scale is None
            else self._given_scale
        )
        if self.rope_scaling is not None and self.rotate:  # checked now, as calls will
            self._plan().rotate(np.zeros((1, self.qk_rope_head_dim)), np.zeros(1))

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """Each weight's shape (the biases included), for these settings."""
        E, H, r = self.d_model, self.num_heads, self.kv_lora_rank
        n, p, d_v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        if self.q_lora_rank is None:
            shapes["W_q"] = (E, H * (n + p))
        else:
            q = self.q_lora_rank
            q_in = 2 * q if self.query_gate else q  # [norm(a), a] with a query gate
            shapes.update(W_q_a=(E, q), b_q_a=(q,), q_a_norm=(q,), W_q_b=(q_in, H * (n + p)))
        shapes.update(
            W_kv_a=(E, r + p),
            b_kv_a=(r + p,),
            kv_a_norm=(r,),
            W_kv_b=(r, H * (n + d_v)),
            W_o=(H * d_v, E),
            b_o=(E,),
            sinks=(H,),
        )
        if self.indexer is not None and self.q_lora_rank is not None:
            shapes.update(self.indexer.shapes(E, self.q_lora_rank))
        if self.rope_key_norm:
            shapes["k_pe_norm"] = (p,)
        if self.query_gate:
            shapes["W_g"] = (2 * (self.q_lora_rank or 0), H * d_v)
        elif self.output_gate is not None:
            shapes["W_g"] = (E, H) if self.output_gate_per_head else (E, H * d_v)
        return shapes

    def _sizes_of(self, name: str) -> str:
        """The settings that fix weight ``name``'s shape, for its message."""
        E, H, q = f"d_model={self.d_model}", f"num_heads={self.num_heads}", self.q_lora_rank
        r, n = f"kv_lora_rank={self.kv_lora_rank}", f"qk_nope_head_dim={self.qk_nope_head_dim}"
        p, d_v = f"qk_rope_head_dim={self.qk_rope_head_dim}", f"v_head_dim={self.v_head_dim}"
        return {
            "W_q": f"{E}; {H} heads of {n} + {p}",
            "W_q_a": f"{E}, q_lora_rank={q}",
            "b_q_a": f"q_lora_rank={q}",
            "q_a_norm": f"q_lora_rank={q}",
            "W_q_b": f"q_lora_rank={q}{' (twice: query_gate)' * self.query_gate}; "
            f"{H} heads of {n} + {p}",
            "W_kv_a": f"{E}, {r} + {p}",
            "b_kv_a": f"{r} + {p}",
            "kv_a_norm": r,
            "k_pe_norm": f"{p}: rope_key_norm",
            "W_kv_b": f"{r}; {H} heads of {n} + {d_v}",
            "W_o": f"{H} heads of {d_v}, {E}",
            "b_o": E,
            "W_g": f"twice q_lora_rank={q}, {H} heads of {d_v}: query_gate, a gate a feature"
            if self.query_gate
            else f"{E}, {H} heads"
            + (" of one gate" if self.output_gate_per_head else f" of {d_v}: one gate a feature"),
            "sinks": f"{H}: one sink a head",
        }.get(name, f"{E}, q_lora_rank={q}, indexer {self.indexer}")

    def _set_weights(self, weights: dict[str, np.ndarray | None]) -> None:
        self.W_q, self.W_q_a, self.b_q_a, self.q_a_norm, self.W_q_b = (
            weights[name] for name in PARAMETER_NAMES[:5]
        )
        self.W_kv_a, self.b_kv_a, self.kv_a_norm, self.W_kv_b, self.W_o, self.b_o = (
            weights[name] for name in PARAMETER_NAMES[5:11]
        )
        self.W_g, self.sinks = weights["W_g"], weights["sinks"]
        self.k_pe_norm = weights["k_pe_norm"]
        for name in INDEXER_WEIGHTS:
            setattr(self, name, weights.get(name))

    def _plan(self) -> LatentPlan:
        rotary: dict[str, Any] = {"theta": self.rope_theta, "interleaved": self.rotary_interleaved}
        if self.rope_scaling is not None:
            rotary["scaling"] = self.rope_scaling
        return LatentPlan(
            self.num_heads,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.norm_eps,
            self.scale,
            rotary,
            self.indexer,
            self.output_gate,
            self.rotate,
            self.query_gate,
        )


def _optional(name: str) -> bool:
    """Whether weight ``name`` may be absent from a spec's weights: the biases and the sinks."""
    return name.startswith("b_") or name == "sinks"
