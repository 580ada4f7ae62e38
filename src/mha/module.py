"""``MultiHeadAttention``: configuration and weights around :func:`mha.multi_head_attention`."""

from __future__ import annotations

import reprlib
from typing import Any

import numpy as np

from ._arrays import as_array, as_float_array, flag, positive_int
from .cache import KVCache
from .errors import AttentionTypeError, AttentionValueError, ShapeError, WeightsFileError
from .functional import multi_head_attention
from .rotary import apply_rotary

__all__ = ["MultiHeadAttention"]

_WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")


class MultiHeadAttention:
    """Multi-head attention that owns its weights; ``forward`` calls the function.

    ``d_model`` is the model width and ``num_heads`` the number of query heads, each
    ``head_dim`` wide (default ``d_model // num_heads``). The weights are attributes in the
    function's "x @ W" layout: ``W_q (d_model, H*head_dim)``, ``W_k (kdim, H_kv*head_dim)``,
    ``W_v (vdim, H_kv*head_dim)``, ``W_o (H*head_dim, d_model)``, and with ``bias=True``
    also ``b_q``, ``b_k``, ``b_v``, ``b_o`` (``None`` otherwise; weights loaded from a
    model may have some of them, as Qwen2 has ``b_q``, ``b_k``, ``b_v`` only).

    **bias defaults to False** (the specification's weights-only layer), where
    ``torch.nn.MultiheadAttention`` defaults to ``bias=True``: pass ``bias=True`` for
    torch's layout. ``kdim``/``vdim`` are the key and value input widths (default
    ``d_model``); ``add_bias_kv`` and ``add_zero_attn`` are torch's extra keys; ``dtype``
    is the weights' floating dtype (default float64). The random initialisation follows
    torch's: Xavier/Glorot uniform over the packed ``(3*d_model, d_model)`` in-projection
    (or over each of W_q, W_k, W_v when their shapes differ), ``U(-1/sqrt(d_model),
    1/sqrt(d_model))`` for ``W_o`` and zero biases; ``seed`` (an int or a
    ``np.random.Generator``) makes it reproducible.

    For decoder models: ``num_kv_heads`` (grouped-query attention, default ``num_heads``),
    ``rope_theta`` (rotary position embeddings of q and k after projection, with
    ``rotary_dim`` and ``rotary_interleaved`` as in :func:`mha.apply_rotary`) and
    ``window`` (a sliding window); :meth:`new_cache` makes a :class:`mha.KVCache` for
    ``forward(x, cache=...)``, and :meth:`from_llama` reads transformers' layout.

    >>> import numpy as np
    >>> from mha import MultiHeadAttention
    >>> attention = MultiHeadAttention(d_model=8, num_heads=2, seed=0)
    >>> attention
    MultiHeadAttention(d_model=8, num_heads=2, bias=False, dtype=float64)
    >>> X = np.random.default_rng(1).standard_normal((2, 5, 8))
    >>> attention.forward(X, mask=True).shape            # causal self-attention
    (2, 5, 8)
    >>> memory = np.random.default_rng(2).standard_normal((2, 7, 8))
    >>> attention(X, key=memory, key_lengths=[7, 3]).shape   # cross-attention, padding
    (2, 5, 8)
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = False,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        rope_theta: float | None = None,
        rotary_dim: int | None = None,
        rotary_interleaved: bool = False,
        window: int | None = None,
        dtype: Any = np.float64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        E = positive_int("d_model", d_model)
        H = positive_int("num_heads", num_heads)
        if head_dim is None and E % H:
            raise AttentionValueError(
                f"d_model={E} is not divisible by num_heads={H}; each head needs an equal "
                "share of the width (or give head_dim=)"
            )
        self._configure(
            d_model=E, num_heads=H, num_kv_heads=num_kv_heads,
            head_dim=E // H if head_dim is None else head_dim,
            kdim=E if kdim is None else kdim, vdim=E if vdim is None else vdim,
            add_zero_attn=add_zero_attn, rope_theta=rope_theta, rotary_dim=rotary_dim,
            rotary_interleaved=rotary_interleaved, window=window,
        )  # fmt: skip
        if not isinstance(bias, (bool, np.bool_)):
            raise AttentionTypeError(f"bias must be True or False; got {bias!r}")
        self.dtype = _float_dtype(dtype)
        rng = _random_generator(seed)

        inner, kv_inner = H * self.head_dim, self.num_kv_heads * self.head_dim
        if self.kdim == E and self.vdim == E and inner == E and kv_inner == E:
            in_proj = _uniform(rng, (3 * E, E), _xavier_bound(E, 3 * E), self.dtype)
            self.W_q, self.W_k, self.W_v = (part.T.copy() for part in np.split(in_proj, 3))
        else:
            self.W_q, self.W_k, self.W_v = (
                _uniform(rng, (width, d_in), _xavier_bound(d_in, width), self.dtype).T.copy()
                for d_in, width in ((E, inner), (self.kdim, kv_inner), (self.vdim, kv_inner))
            )
        bound = 1.0 / float(np.sqrt(inner))
        self.W_o = _uniform(rng, (E, inner), bound, self.dtype).T.copy()
        self.b_q, self.b_k, self.b_v, self.b_o = (
            np.zeros(width, dtype=self.dtype) if bias else None
            for width in (inner, kv_inner, kv_inner, E)
        )
        self.bias_k: np.ndarray | None = None
        self.bias_v: np.ndarray | None = None
        if flag("add_bias_kv", add_bias_kv):  # torch: xavier_normal_ on (1, 1, E)
            self.bias_k, self.bias_v = (
                rng.normal(0.0, 1.0 / float(np.sqrt(E)), kv_inner).astype(self.dtype)
                for _ in range(2)
            )

    def _configure(
        self, *, d_model: int, num_heads: int, num_kv_heads: Any, head_dim: Any, kdim: Any,
        vdim: Any, add_zero_attn: Any, rope_theta: Any, rotary_dim: Any,
        rotary_interleaved: Any, window: Any,
    ) -> None:  # fmt: skip
        """Check and keep the configuration (everything but the weights)."""
        self.d_model, self.num_heads = d_model, num_heads
        self.num_kv_heads = (
            num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        )
        if num_heads % self.num_kv_heads:
            raise AttentionValueError(
                f"num_kv_heads={self.num_kv_heads} does not divide num_heads={num_heads}; "
                "each key/value head serves an equal group of query heads"
            )
        self.head_dim = positive_int("head_dim", head_dim)
        self.kdim, self.vdim = positive_int("kdim", kdim), positive_int("vdim", vdim)
        self.add_zero_attn = flag("add_zero_attn", add_zero_attn)
        if rope_theta is not None and (
            isinstance(rope_theta, (bool, np.bool_))
            or not isinstance(rope_theta, (int, float, np.integer, np.floating))
            or not 0 < float(rope_theta) < float("inf")
        ):
            raise AttentionValueError(f"rope_theta must be a positive number; got {rope_theta!r}")
        self.rope_theta = None if rope_theta is None else float(rope_theta)
        if self.rope_theta is not None:  # checked by the function that uses them
            apply_rotary(np.zeros((1, self.head_dim)), [0], theta=self.rope_theta,
                         rotary_dim=rotary_dim, interleaved=rotary_interleaved)  # fmt: skip
        elif rotary_dim is not None or rotary_interleaved:
            raise AttentionValueError(
                "rotary_dim and rotary_interleaved have no effect without rope_theta="
            )
        self.rotary_dim = None if rotary_dim is None else int(rotary_dim)
        self.rotary_interleaved = flag("rotary_interleaved", rotary_interleaved)
        self.window = None if window is None else positive_int("window", window)

    @property
    def has_bias(self) -> bool:
        """Whether all four projection biases are present (torch's ``bias=True``).

        >>> MultiHeadAttention(8, 2, bias=True).has_bias
        True
        """
        return all(b is not None for b in (self.b_q, self.b_k, self.b_v, self.b_o))

    def forward(
        self,
        query: Any,
        mask: Any = None,
        *misplaced: Any,
        key: Any = None,
        value: Any = None,
        causal: bool = False,
        causal_alignment: str | None = None,
        key_lengths: Any = None,
        query_lengths: Any = None,
        bias: Any = None,
        scale: float | None = None,
        return_weights: bool = False,
        positions: Any = None,
        cache: KVCache | None = None,
        return_backward: bool = False,
        dropout_p: float = 0.0,
        generator: np.random.Generator | None = None,
        max_memory: int | None = None,
        workers: int | None = None,
    ) -> Any:
        """Attention of ``query (B, L, d_model)`` (or ``(L, d_model)``) over itself, or over
        ``key``/``value`` given by name.

        The rule for arguments: **the second positional argument is always the mask**, as
        in the specification's ``forward(X, mask)``. ``mask`` (positional or by name):
        ``None`` attends everywhere, ``True``
        is causal, a boolean array marks where attention is allowed (True = may attend).
        Anything else there (a float array, say) is refused, never guessed at. For
        cross-attention pass ``key=`` (``(B, S, kdim)``) and ``value=`` (``(B, S, vdim)``,
        default: ``key``) by name. The other keywords are those of
        :func:`mha.multi_head_attention`: ``causal``, ``causal_alignment``,
        ``key_lengths``, ``query_lengths``, ``bias``, ``scale``, ``return_weights``,
        ``max_memory`` and ``workers``; the module's own ``num_kv_heads``, ``window`` and
        rotary settings apply. ``positions`` (``(L,)`` or ``(B, L)``) places the tokens for
        the rotary embedding. ``cache`` (from :meth:`new_cache`) makes ``query`` the next
        tokens of each sequence: they are projected, rotated at their true positions,
        appended, and attend causally over everything cached; with ``query_lengths`` only
        the first ``query_lengths[b]`` rows of sequence ``b`` are real tokens.
        ``return_backward=True`` adds ``backward``, a function of the output's gradient that
        returns the gradients keyed by attribute name for the weights (``W_q``, ...,
        ``b_o``, ``bias_k``, ``bias_v``: those present) and by argument name for the inputs
        (``query``, ``key``, ``value``, separately even for self-attention; their sum is the
        gradient of a shared input), and ``bias`` when given; see :meth:`parameters`.
        ``dropout_p`` with ``generator`` drops attention weights in training, the same mask
        in ``backward``.
        ``attention(...)`` is ``attention.forward(...)``.

        >>> import numpy as np
        >>> attention = MultiHeadAttention(4, 2, seed=0)
        >>> X = np.random.default_rng(0).standard_normal((1, 3, 4))
        >>> causal = attention.forward(X, True)       # the specification's forward(X, mask)
        >>> bool((causal == attention(X, causal=True)).all())
        True
        >>> memory = np.random.default_rng(1).standard_normal((1, 6, 4))
        >>> attention(X, key=memory).shape                # cross-attention: key= by name
        (1, 3, 4)
        """
        if cache is not None and (key is not None or value is not None):
            raise AttentionValueError(
                "cache= appends the query tokens' own keys and values: key= and value= "
                "cannot be combined with it"
            )
        if misplaced:
            raise AttentionTypeError(
                f"forward takes at most two positional arguments, the query and the mask; "
                f"got {2 + len(misplaced)}. For cross-attention pass key= and value= by name"
            )
        _check_mask_argument(mask)
        query = as_float_array("query", query)
        if key is None and value is not None:
            raise AttentionValueError(
                "forward got value= without key=: give key= too (value defaults to key)"
            )
        key = query if key is None else as_float_array("key", key)
        value = key if value is None else as_float_array("value", value)
        for name, array, width, label in (
            ("query", query, self.d_model, "d_model"),
            ("key", key, self.kdim, "kdim"),
            ("value", value, self.vdim, "vdim"),
        ):
            if array.ndim not in (2, 3):
                raise ShapeError(
                    f"{name} must have shape (B, L, {label}) or (L, {label}); "
                    f"got shape {array.shape}"
                )
            if array.shape[-1] != width:
                raise ShapeError(
                    f"{name} has width {array.shape[-1]} but this MultiHeadAttention has "
                    f"{label}={width} ({name} {array.shape})"
                )
        result = multi_head_attention(
            query,
            key,
            value,
            self.W_q,
            self.W_k,
            self.W_v,
            self.W_o,
            self.num_heads,
            mask=mask,
            causal=causal,
            causal_alignment=causal_alignment,
            key_lengths=key_lengths,
            query_lengths=query_lengths,
            bias=bias,
            b_q=self.b_q,
            b_k=self.b_k,
            b_v=self.b_v,
            b_o=self.b_o,
            scale=scale,
            return_weights=return_weights,
            max_memory=max_memory,
            workers=workers,
            bias_k=self.bias_k,
            bias_v=self.bias_v,
            add_zero_attn=self.add_zero_attn,
            num_kv_heads=self.num_kv_heads,
            window=self.window,
            rope_theta=self.rope_theta,
            rotary_dim=self.rotary_dim,
            rotary_interleaved=self.rotary_interleaved,
            positions=positions,
            cache=cache,
            return_backward=return_backward,
            dropout_p=dropout_p,
            generator=generator,
        )
        if not return_backward:
            return result
        *outputs, backward = result
        return (*outputs, _Renamed(backward))

    def parameters(self) -> dict[str, np.ndarray]:
        """The weights an optimiser updates, by attribute name: the arrays themselves (update
        them in place), only those present.

        >>> attention = MultiHeadAttention(8, 2, bias=True, seed=0)
        >>> X = np.random.default_rng(0).standard_normal((2, 3, 8))
        >>> out, backward = attention(X, mask=True, return_backward=True)
        >>> grads = backward(np.ones_like(out))
        >>> for name, W in attention.parameters().items():   # one step of gradient descent
        ...     W -= 0.1 * grads[name]
        >>> sorted(grads)[:4], grads["query"].shape
        (['W_k', 'W_o', 'W_q', 'W_v'], (2, 3, 8))
        """
        return {name: W for name, W in self.weights().items() if W is not None}

    def new_cache(self, batch_size: int, *, capacity: int = 256) -> KVCache:
        """An empty :class:`mha.KVCache` for ``batch_size`` sequences, made for this
        attention's key/value heads, head width, window and compute dtype (float32 for
        float16 weights). ``capacity`` positions are preallocated; more are added as needed.

        >>> attention = MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0, seed=0)
        >>> cache = attention.new_cache(2, capacity=32)
        >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))
        >>> attention(x, cache=cache).shape, cache.lengths   # a prompt of 5 tokens
        ((2, 5, 16), array([5, 5]))
        >>> attention(x[:, :1], cache=cache).shape, cache.lengths   # then one more
        ((2, 1, 16), array([6, 6]))
        """
        dtype = np.float32 if self.dtype == np.float16 else self.dtype
        return KVCache(
            batch_size, self.num_kv_heads, self.head_dim, capacity=capacity, dtype=dtype,
            window=self.window,
        )  # fmt: skip

    __call__ = forward

    def __repr__(self) -> str:
        defaults = {
            "num_kv_heads": self.num_heads, "head_dim": self.d_model // self.num_heads,
            "kdim": self.d_model, "vdim": self.d_model, "rope_theta": None,
            "rotary_dim": None, "rotary_interleaved": False, "window": None,
        }  # fmt: skip
        dims = "".join(
            f", {name}={getattr(self, name)}"
            for name, default in defaults.items()
            if getattr(self, name) != default
        )
        extras = "".join(
            f", {name}=True"
            for name, on in (
                ("add_bias_kv", self.bias_k is not None),
                ("add_zero_attn", self.add_zero_attn),
            )
            if on
        )
        return (
            f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}{dims}, "
            f"bias={self.has_bias}{extras}{self._partial_biases()}, dtype={self.dtype.name})"
        )

    # Weights trained elsewhere, and files. The layouts are converted in mha.integrations,
    # which works on plain dicts of weights and never imports this module.

    def weights(self) -> dict[str, np.ndarray | None]:
        """The weights by attribute name (``W_q``, ..., ``b_o``, ``bias_k``, ``bias_v``;
        ``None`` where absent): the arrays themselves, not copies.

        >>> sorted(name for name, W in MultiHeadAttention(4, 2).weights().items() if W is not None)
        ['W_k', 'W_o', 'W_q', 'W_v']
        """
        return {name: getattr(self, name) for name in _WEIGHT_NAMES}

    @classmethod
    def from_torch(
        cls, source: Any, *, num_heads: int | None = None, add_zero_attn: bool | None = None
    ) -> MultiHeadAttention:
        """Load ``source``: a ``torch.nn.MultiheadAttention``, or its ``state_dict`` (then
        ``num_heads`` is needed; ``add_zero_attn``, a module setting that a state dict does
        not hold, defaults to False there and to the module's setting for a module).

        Every key and shape is checked. The result's ``forward`` takes batch-first arrays
        whatever the module's ``batch_first``; dropout is not carried over (inference).

        >>> import numpy as np
        >>> state = {"in_proj_weight": np.eye(12, 4), "out_proj.weight": np.eye(4)}
        >>> MultiHeadAttention.from_torch(state, num_heads=2)
        MultiHeadAttention(d_model=4, num_heads=2, bias=False, dtype=float64)
        """
        from .integrations.pytorch import weights_from_torch

        weights, heads, zero = weights_from_torch(source, num_heads, add_zero_attn)
        return cls._from_weights(weights, heads, zero, "state dict")

    def to_torch_state_dict(self, *, tensors: bool = False) -> dict[str, Any]:
        """The weights as a ``torch.nn.MultiheadAttention`` state dict: NumPy arrays, or with
        ``tensors=True`` torch tensors, ready for ``load_state_dict`` in one line::

            torch_module.load_state_dict(attention.to_torch_state_dict(tensors=True))

        The torch module must be built with the same ``bias`` (torch's default is True,
        mha's False), ``kdim``, ``vdim`` and ``add_bias_kv``; :meth:`to_torch` builds it.

        >>> sorted(MultiHeadAttention(4, 2, bias=True).to_torch_state_dict())
        ['in_proj_bias', 'in_proj_weight', 'out_proj.bias', 'out_proj.weight']
        """
        from .integrations.pytorch import as_tensors, torch_state_dict

        self._check_torch_layout()
        state = torch_state_dict(self.weights())
        return as_tensors(state) if flag("tensors", tensors) else dict(state)

    def to_torch(self, *, batch_first: bool = True) -> Any:
        """A ``torch.nn.MultiheadAttention`` in eval mode holding these weights, built with
        the matching ``bias``, ``kdim``, ``vdim``, ``add_bias_kv``, ``add_zero_attn`` and
        dtype, and ``batch_first`` as given (default True, like mha's arrays). Needs torch.

        >>> attention = MultiHeadAttention(8, 2, seed=0)
        >>> module = attention.to_torch()                  # doctest: +SKIP
        >>> module.bias_k is None, module.in_proj_bias is None   # doctest: +SKIP
        (True, True)
        """
        from .integrations.pytorch import torch_module

        self._check_torch_layout()
        first = flag("batch_first", batch_first)
        return torch_module(self.weights(), self.num_heads, self.add_zero_attn, first)

    @classmethod
    def from_gpt2(
        cls, c_attn_weight: Any, c_attn_bias: Any, c_proj_weight: Any, c_proj_bias: Any,
        num_heads: int,
    ) -> MultiHeadAttention:  # fmt: skip
        """GPT-2's attention from its Conv1D weights, which are "x @ W" already:
        ``c_attn_weight (E, 3E)`` and ``c_attn_bias (3E,)`` (q, k, v fused), and
        ``c_proj_weight (E, E)`` with ``c_proj_bias (E,)``; ``num_heads`` is the model's
        ``n_head``. GPT-2 is causal: call ``forward(X, mask=True)``.

        >>> import numpy as np
        >>> E = 4
        >>> MultiHeadAttention.from_gpt2(np.ones((E, 3 * E)), np.zeros(3 * E), np.eye(E),
        ...                              np.zeros(E), num_heads=2)
        MultiHeadAttention(d_model=4, num_heads=2, bias=True, dtype=float64)
        """
        from .integrations.transformers import weights_from_gpt2

        weights = weights_from_gpt2(c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias)
        return cls._from_weights(weights, positive_int("num_heads", num_heads), False, "GPT-2")

    @classmethod
    def from_llama(
        cls,
        state_dict: Any,
        *,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_theta: float | None = 10000.0,
        rotary_dim: int | None = None,
        rotary_interleaved: bool = False,
        window: int | None = None,
        prefix: str = "",
    ) -> MultiHeadAttention:
        """A Llama-style attention (Llama, Mistral, Qwen2, ...) from transformers' layout:
        ``state_dict`` holds ``{prefix}q_proj.weight``, ``k_proj``, ``v_proj``, ``o_proj``
        (``(out, in)``, NumPy arrays or torch tensors) and their ``.bias`` where present.
        ``num_heads``, ``num_kv_heads`` and ``head_dim`` are the config's ``num_attention_heads``,
        ``num_key_value_heads`` and ``head_dim`` (default ``hidden_size // num_heads``);
        ``rope_theta``, ``rotary_dim`` (partial rotary) and ``rotary_interleaved`` set the
        rotary embedding (``rope_theta=None``: none); ``window`` is Mistral's
        ``sliding_window``. ``prefix`` selects one layer of a whole model's state dict, such
        as ``"model.layers.0.self_attn."``. Missing or misshapen keys are refused with the
        key's name and the expected shape. Llama attention is causal: call
        ``forward(x, mask=True)``, or use a cache.

        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> state = {"q_proj.weight": rng.standard_normal((8, 8)),
        ...          "k_proj.weight": rng.standard_normal((4, 8)),
        ...          "v_proj.weight": rng.standard_normal((4, 8)),
        ...          "o_proj.weight": rng.standard_normal((8, 8))}
        >>> attention = MultiHeadAttention.from_llama(state, num_heads=4, num_kv_heads=2)
        >>> attention.num_kv_heads, attention.head_dim, attention.W_k.shape   # W_k = k_proj.T
        (2, 2, (8, 4))
        """
        from .integrations.transformers import weights_from_llama

        H = positive_int("num_heads", num_heads)
        H_kv = H if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if head_dim is not None:
            head_dim = positive_int("head_dim", head_dim)
        weights = weights_from_llama(state_dict, prefix, H, H_kv, head_dim)  # checks state_dict
        W_q = weights["W_q"]
        return cls._from_weights(
            weights, H, False, "Llama weights", num_kv_heads=H_kv,
            head_dim=head_dim or (0 if W_q is None else W_q.shape[1] // H),
            rope_theta=rope_theta, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
            window=window,
        )  # fmt: skip

    def save(self, path: Any) -> None:
        """Write configuration and weights to ``path`` as ``.npz``, atomically: a complete
        file replaces any existing one, or nothing changes. A path that cannot be written
        is refused before anything is written.

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "attention.npz")
        >>> MultiHeadAttention(8, 2, seed=0).save(path)
        >>> os.listdir(os.path.dirname(path))
        ['attention.npz']
        """
        from .integrations import npz

        npz.save(path, self._config(), self.weights())

    @classmethod
    def load(cls, path: Any) -> MultiHeadAttention:
        """Read ``path``, a file written by :meth:`save` (never unpickling anything),
        checking every entry and shape against the configuration it records.

        >>> import os, tempfile, numpy as np
        >>> path = os.path.join(tempfile.mkdtemp(), "attention.npz")
        >>> saved = MultiHeadAttention(8, 2, bias=True, seed=0)
        >>> saved.save(path)
        >>> loaded = MultiHeadAttention.load(path)
        >>> loaded, bool(np.array_equal(loaded.W_q, saved.W_q))
        (MultiHeadAttention(d_model=8, num_heads=2, bias=True, dtype=float64), True)
        """
        from .integrations import npz

        config, weights = npz.load(path)
        extras = ("num_kv_heads", "head_dim", "rope_theta", "rotary_dim", "rotary_interleaved",
                  "window")  # fmt: skip
        try:
            module = cls._from_weights(
                weights, config["num_heads"], config["add_zero_attn"], "the weights",
                **{key: config[key] for key in extras},
            )  # fmt: skip
        except KeyError as error:
            raise WeightsFileError(f"cannot load {path}: its config has no {error}") from None
        except (AttentionValueError, TypeError) as error:
            raise WeightsFileError(f"cannot load {path}: {error}") from None
        found = module._config()
        differences = [
            f"{key}={config.get(key)!r} but the weights give {found[key]!r}"
            for key in found
            if config.get(key) != found[key]
        ]
        if differences:
            raise WeightsFileError(f"cannot load {path}: its config says " + "; ".join(differences))
        return module

    def _config(self) -> dict[str, Any]:
        """What a saved file records besides the weights, checked again when it is loaded."""
        return {
            "d_model": self.d_model, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "kdim": self.kdim,
            "vdim": self.vdim, "bias": self.has_bias,
            "biases": [name for name in ("b_q", "b_k", "b_v", "b_o")
                       if getattr(self, name) is not None],
            "add_bias_kv": self.bias_k is not None, "add_zero_attn": self.add_zero_attn,
            "rope_theta": self.rope_theta, "rotary_dim": self.rotary_dim,
            "rotary_interleaved": self.rotary_interleaved, "window": self.window,
            "dtype": self.dtype.name,
        }  # fmt: skip

    @classmethod
    def _from_weights(
        cls,
        weights: dict[str, np.ndarray | None],
        num_heads: int,
        add_zero_attn: bool = False,
        source: str = "weights",
        **config: Any,
    ) -> MultiHeadAttention:
        """A module holding ``weights`` (keys W_q, ..., b_o, bias_k, bias_v), checked against
        each other and ``config`` (``num_kv_heads``, ``head_dim``, rotary settings,
        ``window``)."""
        W_q, W_k, W_v, W_o = (weights.get(name) for name in ("W_q", "W_k", "W_v", "W_o"))
        if W_q is None or W_k is None or W_v is None or W_o is None:
            raise AttentionValueError(f"{source}: W_q, W_k, W_v and W_o are all needed")
        for name, W in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o)):
            if W.ndim != 2 or 0 in W.shape:
                raise ShapeError(f"{source}: {name} must be a non-empty matrix; got {W.shape}")
        H = positive_int("num_heads", num_heads)
        H_kv = config.get("num_kv_heads") or H
        if W_q.shape[1] % H:
            raise AttentionValueError(
                f"{source}: num_heads={H} does not divide the {W_q.shape[1]} columns of W_q "
                f"{W_q.shape}"
            )
        self = cls.__new__(cls)
        self._configure(
            d_model=W_q.shape[0], num_heads=H, num_kv_heads=H_kv,
            head_dim=config.get("head_dim") or W_q.shape[1] // H, kdim=W_k.shape[0],
            vdim=W_v.shape[0], add_zero_attn=add_zero_attn,
            rope_theta=config.get("rope_theta"), rotary_dim=config.get("rotary_dim"),
            rotary_interleaved=config.get("rotary_interleaved", False),
            window=config.get("window"),
        )  # fmt: skip
        for name, shape in self._shapes().items():
            array = weights.get(name)
            if array is not None and array.shape != shape:
                raise ShapeError(
                    f"{source}: {name} has shape {array.shape} but {self._describe()} calls "
                    f"for {shape}"
                )
        if (weights.get("bias_k") is None) != (weights.get("bias_v") is None):
            raise AttentionValueError(f"{source}: bias_k and bias_v go together")
        present = [a for a in weights.values() if a is not None]
        self.dtype = _float_dtype(np.result_type(*present))
        for name in _WEIGHT_NAMES:
            array = weights.get(name)
            setattr(self, name, None if array is None else np.array(array, dtype=self.dtype))
        return self

    def _check_torch_layout(self) -> None:
        """Refuse what ``torch.nn.MultiheadAttention`` cannot hold."""
        beyond = [
            what
            for what, present in (
                ("grouped key/value heads", self.num_kv_heads != self.num_heads),
                ("head_dim * num_heads != d_model", self.head_dim * self.num_heads != self.d_model),
                ("rotary embeddings", self.rope_theta is not None),
                ("a sliding window", self.window is not None),
                ("only some of the biases", self._partial_biases() != ""),
            )
            if present
        ]
        if beyond:
            raise AttentionValueError(
                f"torch.nn.MultiheadAttention cannot hold this attention ({', '.join(beyond)}): "
                f"{self!r}"
            )

    def _partial_biases(self) -> str:
        names = [n for n in ("b_q", "b_k", "b_v", "b_o") if getattr(self, n) is not None]
        return "" if self.has_bias or not names else f", biases=({', '.join(names)})"

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every weight this configuration holds, present or not."""
        E, inner = self.d_model, self.num_heads * self.head_dim
        kv_inner = self.num_kv_heads * self.head_dim
        return {
            "W_q": (E, inner), "W_k": (self.kdim, kv_inner), "W_v": (self.vdim, kv_inner),
            "W_o": (inner, E), "b_q": (inner,), "b_k": (kv_inner,), "b_v": (kv_inner,),
            "b_o": (E,), "bias_k": (kv_inner,), "bias_v": (kv_inner,),
        }  # fmt: skip

    def _describe(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, kdim={self.kdim}, "
            f"vdim={self.vdim}"
        )


_INPUT_NAMES = {"Q": "query", "K": "key", "V": "value"}


class _Renamed:
    """A module's ``backward``: the function's gradients under the module's names."""

    def __init__(self, backward: Any) -> None:
        self.backward = backward

    def __call__(self, grad_out: Any) -> dict[str, np.ndarray]:
        return {_INPUT_NAMES.get(name, name): g for name, g in self.backward(grad_out).items()}


def _check_mask_argument(mask: Any) -> None:
    """The mask slot takes None, True/False or a boolean array; a float array there is a key
    or an additive mask given in the wrong place, so say which keyword it belongs to."""
    if mask is None or isinstance(mask, (bool, np.bool_)):
        return
    given = reprlib.repr(mask)
    if isinstance(mask, (np.ndarray, list, tuple)):
        array = as_array("mask", mask)
        if array.dtype.kind == "b":
            return
        given = f"an array of dtype {array.dtype} and shape {array.shape}"
    raise AttentionTypeError(
        f"the mask (forward's second argument, or mask=) must be None, True/False (causal) "
        f"or a boolean array with True = may attend; got {given}. For cross-attention pass "
        "key= (and value=) by name; for an additive mask of 0 and -inf pass bias="
    )


def _random_generator(seed: Any) -> np.random.Generator:
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as error:
        raise AttentionTypeError(
            f"seed must be None, a non-negative integer or a np.random.Generator; "
            f"got {reprlib.repr(seed)} ({error})"
        ) from None


def _float_dtype(dtype: Any) -> np.dtype:
    try:
        result: np.dtype = np.dtype(dtype)
    except TypeError:
        raise AttentionTypeError(f"dtype must be a floating dtype; got {dtype!r}") from None
    if result.kind != "f":
        raise AttentionTypeError(
            f"dtype must be a floating dtype (float16, float32, float64); got {result}"
        )
    return result


def _xavier_bound(fan_in: int, fan_out: int) -> float:
    return float(np.sqrt(6.0 / (fan_in + fan_out)))


def _uniform(
    rng: np.random.Generator, shape: tuple[int, int], bound: float, dtype: np.dtype
) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(dtype)
