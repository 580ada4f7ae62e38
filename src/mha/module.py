"""``MultiHeadAttention``: configuration and weights around :func:`mha.multi_head_attention`."""

from __future__ import annotations

import reprlib
from typing import Any

import numpy as np

from ._arrays import as_array, as_float_array, flag, positive_int
from .errors import AttentionTypeError, AttentionValueError, ShapeError, WeightsFileError
from .functional import multi_head_attention

__all__ = ["MultiHeadAttention"]

_WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")


class MultiHeadAttention:
    """Multi-head attention that owns its weights; ``forward`` calls the function.

    ``d_model`` is the model width and ``num_heads`` divides it. The weights are attributes
    in the function's "x @ W" layout: ``W_q (d_model, d_model)``, ``W_k (kdim, d_model)``,
    ``W_v (vdim, d_model)``, ``W_o (d_model, d_model)``, and with ``bias=True`` also
    ``b_q``, ``b_k``, ``b_v``, ``b_o`` (``None`` otherwise).

    **bias defaults to False** (the specification's weights-only layer), where
    ``torch.nn.MultiheadAttention`` defaults to ``bias=True``: pass ``bias=True`` for
    torch's layout. ``kdim``/``vdim`` are the key and value input widths (default
    ``d_model``); ``add_bias_kv`` and ``add_zero_attn`` are torch's extra keys; ``dtype``
    is the weights' floating dtype (default float64). The random initialisation follows
    torch's: Xavier/Glorot uniform over the packed ``(3*d_model, d_model)`` in-projection
    (or over each of W_q, W_k, W_v when ``kdim``/``vdim`` differ), ``U(-1/sqrt(d_model),
    1/sqrt(d_model))`` for ``W_o`` and zero biases; ``seed`` (an int or a
    ``np.random.Generator``) makes it reproducible.

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
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = False,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        dtype: Any = np.float64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        self.d_model = positive_int("d_model", d_model)
        self.num_heads = positive_int("num_heads", num_heads)
        if self.d_model % self.num_heads:
            raise AttentionValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "each head needs an equal share of the width"
            )
        self.kdim = self.d_model if kdim is None else positive_int("kdim", kdim)
        self.vdim = self.d_model if vdim is None else positive_int("vdim", vdim)
        if not isinstance(bias, (bool, np.bool_)):
            raise AttentionTypeError(f"bias must be True or False; got {bias!r}")
        self.has_bias = bool(bias)
        self.dtype = _float_dtype(dtype)
        rng = _random_generator(seed)

        E = self.d_model
        if self.kdim == E and self.vdim == E:
            in_proj = _uniform(rng, (3 * E, E), _xavier_bound(E, 3 * E), self.dtype)
            self.W_q, self.W_k, self.W_v = (part.T.copy() for part in np.split(in_proj, 3))
        else:
            self.W_q, self.W_k, self.W_v = (
                _uniform(rng, (E, d_in), _xavier_bound(d_in, E), self.dtype).T.copy()
                for d_in in (E, self.kdim, self.vdim)
            )
        self.W_o = _uniform(rng, (E, E), 1.0 / float(np.sqrt(E)), self.dtype).T.copy()
        biases: list[np.ndarray | None] = [
            np.zeros(E, dtype=self.dtype) if self.has_bias else None for _ in range(4)
        ]
        self.b_q, self.b_k, self.b_v, self.b_o = biases
        self.bias_k: np.ndarray | None = None
        self.bias_v: np.ndarray | None = None
        if flag("add_bias_kv", add_bias_kv):  # torch: xavier_normal_ on (1, 1, E)
            self.bias_k, self.bias_v = (
                rng.normal(0.0, 1.0 / float(np.sqrt(E)), E).astype(self.dtype) for _ in range(2)
            )
        self.add_zero_attn = flag("add_zero_attn", add_zero_attn)

    @property
    def head_dim(self) -> int:
        """The per-head width ``d_model // num_heads``.

        >>> MultiHeadAttention(8, 2).head_dim
        4
        """
        return self.d_model // self.num_heads

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
        ``max_memory`` and ``workers``. ``attention(...)`` is ``attention.forward(...)``.

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
        return multi_head_attention(
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
        )

    __call__ = forward

    def __repr__(self) -> str:
        dims = "".join(
            f", {name}={value}"
            for name, value in (("kdim", self.kdim), ("vdim", self.vdim))
            if value != self.d_model
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
            f"bias={self.has_bias}{extras}, dtype={self.dtype.name})"
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
        try:
            module = cls._from_weights(
                weights, config["num_heads"], config["add_zero_attn"], "the weights"
            )
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
            "d_model": self.d_model, "num_heads": self.num_heads, "kdim": self.kdim,
            "vdim": self.vdim, "bias": self.has_bias, "add_bias_kv": self.bias_k is not None,
            "add_zero_attn": self.add_zero_attn, "dtype": self.dtype.name,
        }  # fmt: skip

    @classmethod
    def _from_weights(
        cls,
        weights: dict[str, np.ndarray | None],
        num_heads: int,
        add_zero_attn: bool = False,
        source: str = "weights",
    ) -> MultiHeadAttention:
        """A module holding ``weights`` (keys W_q, ..., b_o, bias_k, bias_v), checked."""
        W_q, W_k, W_v, W_o = (weights[name] for name in ("W_q", "W_k", "W_v", "W_o"))
        if W_q is None or W_k is None or W_v is None or W_o is None:
            raise AttentionValueError(f"{source}: W_q, W_k, W_v and W_o are all needed")
        E = W_q.shape[1] if W_q.ndim == 2 else -1
        expected: dict[str, tuple[int | None, ...]] = {
            "W_q": (E, E), "W_k": (None, E), "W_v": (None, E), "W_o": (E, E),
        }  # fmt: skip
        for name in ("b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v"):
            expected[name] = (E,)
        for name, shape in expected.items():
            array = weights.get(name)
            if array is None:
                continue
            fits = array.ndim == len(shape) and all(
                want is None or got == want for got, want in zip(array.shape, shape, strict=True)
            )
            if not fits or E <= 0:
                raise ShapeError(
                    f"{source}: {name} has shape {array.shape}, which does not fit d_model={E} "
                    f"(W_q {W_q.shape})"
                )
        biases = [weights.get(name) for name in ("b_q", "b_k", "b_v", "b_o")]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise AttentionValueError(f"{source}: b_q, b_k, b_v and b_o go together")
        if (weights.get("bias_k") is None) != (weights.get("bias_v") is None):
            raise AttentionValueError(f"{source}: bias_k and bias_v go together")
        self = cls.__new__(cls)
        self.d_model = E
        self.num_heads = positive_int("num_heads", num_heads)
        if E % self.num_heads:
            raise AttentionValueError(
                f"{source}: d_model={E} is not divisible by num_heads={self.num_heads}"
            )
        self.kdim, self.vdim = W_k.shape[0], W_v.shape[0]
        self.has_bias = biases[0] is not None
        present = [a for a in weights.values() if a is not None]
        self.dtype = _float_dtype(np.result_type(*present))
        self.W_q, self.W_k, self.W_v, self.W_o = (
            np.array(W, dtype=self.dtype) for W in (W_q, W_k, W_v, W_o)
        )
        self.b_q, self.b_k, self.b_v, self.b_o = (
            None if b is None else np.array(b, dtype=self.dtype) for b in biases
        )
        self.bias_k, self.bias_v = (
            None if weights.get(name) is None else np.array(weights[name], dtype=self.dtype)
            for name in ("bias_k", "bias_v")
        )
        self.add_zero_attn = flag("add_zero_attn", add_zero_attn)
        return self


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
