"""PyTorch's ``F.multi_head_attention_forward`` on NumPy arrays: same parameters, same order.

This is the one place where PyTorch's mask polarity lives: a boolean ``attn_mask`` or
``key_padding_mask`` marks with True the keys that may **not** be attended to, and float masks
are added to the logits. Everything else in mha says True = may attend.

The single deliberate difference: where torch returns NaN for a query row that can see no
key, this returns zeros (zero attention output, so the row equals the output bias).

>>> import numpy as np
>>> from mha.torch_compat import multi_head_attention_forward
>>> rng = np.random.default_rng(0)
>>> x = rng.standard_normal((5, 2, 8))                      # (L, N, E), sequence first
>>> W_in, W_out = rng.standard_normal((24, 8)), rng.standard_normal((8, 8))
>>> out, weights = multi_head_attention_forward(x, x, x, 8, 2, W_in, None, None, None, False,
...                                             0.0, W_out, None)
>>> out.shape, weights.shape                                # weights averaged over heads
((5, 2, 8), (2, 5, 5))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._arrays import as_array, as_float_array, flag, positive_int, result_and_compute_dtypes
from ..api.split_heads import scaled_dot_product_attention
from ..errors import AttentionTypeError, AttentionValueError, ShapeError

__all__ = ["multi_head_attention_forward"]


def multi_head_attention_forward(
    query: Any,
    key: Any,
    value: Any,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Any,
    in_proj_bias: Any,
    bias_k: Any,
    bias_v: Any,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Any,
    out_proj_bias: Any,
    training: bool = True,
    key_padding_mask: Any = None,
    need_weights: bool = True,
    attn_mask: Any = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Any = None,
    k_proj_weight: Any = None,
    v_proj_weight: Any = None,
    static_k: Any = None,
    static_v: Any = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    *,
    generator: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``torch.nn.functional.multi_head_attention_forward`` for NumPy arrays.

    The parameters, their order, defaults and meaning are torch's, including its mask
    polarity (True = **may not** attend), which lives only in this module:

    * ``query (L, N, E)``, ``key (S, N, kdim)``, ``value (S, N, vdim)``: sequence first, or
      unbatched ``(L, E)``/``(S, kdim)``.
    * ``embed_dim_to_check``: must equal ``E``; ``num_heads``: ``H``, dividing ``E``.
    * ``in_proj_weight (3E, E)`` and ``in_proj_bias (3E,)``: the packed q, k, v projections
      in torch's ``(out, in)`` layout; or, with ``use_separate_proj_weight=True``,
      ``q_proj_weight (E, E)``, ``k_proj_weight (E, kdim)``, ``v_proj_weight (E, vdim)``.
      Weights of the layout not chosen are refused rather than ignored.
    * ``bias_k``, ``bias_v (1, 1, E)`` and ``add_zero_attn``: extra key/value pairs.
    * ``dropout_p`` and ``training``: dropout on the weights, when ``training`` (torch's
      default True) and ``dropout_p > 0``, drawing from ``generator`` (a
      ``np.random.Generator``; a fresh one when ``None``).
    * ``out_proj_weight (E_out, E)``, ``out_proj_bias (E_out,)``: the output projection.
    * ``key_padding_mask (N, S)``: True (or a float ``-inf``) marks padding.
    * ``attn_mask (L, S)`` or ``(N*H, L, S)``: True (or a float ``-inf``) hides a key;
      ``is_causal`` is torch's hint that ``attn_mask`` is causal.
    * ``static_k``, ``static_v (N*H, S, E/H)``: already projected keys and values.
    * ``need_weights`` and ``average_attn_weights``: return the weights ``(N, L, S)``
      averaged over heads, ``(N, H, L, S)`` with ``average_attn_weights=False``, or
      ``None`` without ``need_weights``.

    Returns ``(output (L, N, E_out), weights)``.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal((3, 1, 4))   # (L, N, E)
    >>> padding = np.array([[False, False, True]])                # torch: True = padding
    >>> out, weights = multi_head_attention_forward(
    ...     x, x, x, 4, 2, np.eye(12, 4), None, None, None, False, 0.0, np.eye(4), None,
    ...     key_padding_mask=padding)
    >>> weights[0, :, 2]                                          # no query sees key 2
    array([0., 0., 0.])
    """
    given = _Given(
        in_proj_weight, in_proj_bias, bias_k, bias_v, out_proj_weight, out_proj_bias,
        q_proj_weight, k_proj_weight, v_proj_weight, static_k, static_v,
    )  # fmt: skip
    options = _Options(
        embed_dim_to_check, num_heads, add_zero_attn, dropout_p, training, need_weights,
        use_separate_proj_weight, average_attn_weights, is_causal, generator,
    )  # fmt: skip
    inputs = _Inputs.check(query, key, value, key_padding_mask, attn_mask)
    return _forward(inputs, given, options)


class _Given(NamedTuple):
    """The weights and the static keys and values, as given."""

    in_proj_weight: Any
    in_proj_bias: Any
    bias_k: Any
    bias_v: Any
    out_proj_weight: Any
    out_proj_bias: Any
    q_proj_weight: Any
    k_proj_weight: Any
    v_proj_weight: Any
    static_k: Any
    static_v: Any


class _Options(NamedTuple):
    """The other arguments, as given."""

    embed_dim_to_check: Any
    num_heads: Any
    add_zero_attn: Any
    dropout_p: Any
    training: Any
    need_weights: Any
    use_separate_proj_weight: Any
    average_attn_weights: Any
    is_causal: Any
    generator: Any


class _Inputs(NamedTuple):
    """The query, key and value as batched ``(T, N, width)`` arrays, the masks as given
    (an unbatched key padding mask with its batch axis), and whether the input was batched."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    key_padding_mask: Any
    attn_mask: Any
    batched: bool

    @classmethod
    def check(
        cls, query: Any, key: Any, value: Any, key_padding_mask: Any, attn_mask: Any
    ) -> _Inputs:
        query = as_float_array("query", query)
        key = as_float_array("key", key)
        value = as_float_array("value", value)
        if query.ndim not in (2, 3):
            raise ShapeError(
                f"query must be (L, N, E) or unbatched (L, E); got shape {query.shape}"
            )
        batched = query.ndim == 3
        for name, array in (("key", key), ("value", value)):
            if array.ndim != query.ndim:
                raise ShapeError(
                    f"{name} must have as many axes as query (query {query.shape}, {name} "
                    f"{array.shape})"
                )
        if not batched:  # work batched, as torch does
            query, key, value = query[:, None], key[:, None], value[:, None]
            if key_padding_mask is not None:
                key_padding_mask = as_array("key_padding_mask", key_padding_mask)
                if key_padding_mask.ndim != 1:
                    raise ShapeError(
                        f"for unbatched input key_padding_mask must have shape (S,); "
                        f"got {key_padding_mask.shape}"
                    )
                key_padding_mask = key_padding_mask[None]
        return cls(query, key, value, key_padding_mask, attn_mask, batched)


def _forward(
    inputs: _Inputs, given: _Given, options: _Options
) -> tuple[np.ndarray, np.ndarray | None]:
    """The checked call: the heads projected, torch's extra keys, the attention, the
    output projection."""
    query, key = inputs.query, inputs.key
    L, N, E = query.shape
    H = positive_int("num_heads", options.num_heads)
    if options.embed_dim_to_check != E:
        raise ShapeError(
            f"query has width {E} but embed_dim_to_check is {options.embed_dim_to_check}"
        )
    if E % H:
        raise ShapeError(f"embed_dim {E} is not divisible by num_heads {H}")
    value = inputs.value
    if key.shape[:2] != value.shape[:2] or (
        not options.use_separate_proj_weight and key.shape != value.shape
    ):
        raise ShapeError(f"key and value do not match (key {key.shape}, value {value.shape})")
    if key.shape[1] != N:
        raise ShapeError(f"key has batch {key.shape[1]} but query has {N}")
    q, k, v, W_o, b_o = _heads(inputs, given, options, H)
    masks = _TorchMasks(inputs.attn_mask, inputs.key_padding_mask, L, k.shape[2], N, H, q.dtype)
    k, v = _extra_keys(k, v, masks, given, options)
    heads, weights = _attend(q, k, v, masks, inputs, options)
    joined = heads.transpose(2, 0, 1, 3).reshape(L, N, E)  # (L, N, H*head_dim)
    output = joined @ W_o.T.astype(q.dtype, copy=False)
    if b_o is not None:
        output += b_o.astype(q.dtype, copy=False)
    if weights is not None and flag("average_attn_weights", options.average_attn_weights):
        weights = weights.mean(axis=1)
    if not inputs.batched:
        output = output[:, 0]
        weights = None if weights is None else weights[0]
    return output, weights


def _heads(
    inputs: _Inputs, given: _Given, options: _Options, H: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The projected heads ``(N, H, T, head_dim)`` (or the static keys and values) and the
    output projection ``(W_o, b_o)``, in the compute dtype of the inputs and weights."""
    query, key, value = inputs.query, inputs.key, inputs.value
    N, E = query.shape[1:]
    head_dim = E // H
    separate = flag("use_separate_proj_weight", options.use_separate_proj_weight)
    W_q, W_k, W_v = _in_projection_weights(
        E,
        key.shape[-1],
        value.shape[-1],
        separate,
        given.in_proj_weight,
        given.q_proj_weight,
        given.k_proj_weight,
        given.v_proj_weight,
    )
    b_q = b_k = b_v = None
    if given.in_proj_bias is not None:
        bias = _weight("in_proj_bias", given.in_proj_bias, (3 * E,))
        b_q, b_k, b_v = bias[:E], bias[E : 2 * E], bias[2 * E :]
    W_o = _weight("out_proj_weight", given.out_proj_weight, (None, E))
    b_o = given.out_proj_bias
    b_o = None if b_o is None else _weight("out_proj_bias", b_o, (W_o.shape[0],))
    _, dtype = result_and_compute_dtypes(query, key, value, W_q, W_k, W_v, W_o)

    def project(x: np.ndarray, W: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        """``(T, N, in)`` to heads ``(N, H, T, head_dim)``, torch's ``x @ W.T + b``."""
        y: np.ndarray = x.astype(dtype, copy=False) @ W.T.astype(dtype, copy=False)
        if b is not None:
            y += b.astype(dtype, copy=False)
        return y.reshape(x.shape[0], N, H, head_dim).transpose(1, 2, 0, 3)

    q = project(query, W_q, b_q)
    k = (
        project(key, W_k, b_k)
        if given.static_k is None
        else _static("static_k", given.static_k, N, H, head_dim)
    )
    v = (
        project(value, W_v, b_v)
        if given.static_v is None
        else _static("static_v", given.static_v, N, H, head_dim)
    )
    if k.shape[2] != v.shape[2]:
        raise ShapeError(
            f"keys and values have different lengths ({k.shape[2]} and {v.shape[2]}): "
            "static_k and static_v must match each other and the projected keys"
        )
    return q, k, v, W_o, b_o


def _extra_keys(
    k: np.ndarray, v: np.ndarray, masks: _TorchMasks, given: _Given, options: _Options
) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values with torch's learned pair (``bias_k``, ``bias_v``) and its zero
    pair appended, the masks padded to them."""
    H, head_dim, E = k.shape[1], k.shape[-1], k.shape[1] * k.shape[-1]
    if (given.bias_k is None) != (given.bias_v is None):
        raise AttentionValueError("bias_k and bias_v go together: give both or neither")
    if given.bias_k is not None:
        if given.static_k is not None or given.static_v is not None:
            raise AttentionValueError("bias_k/bias_v cannot be added to static_k/static_v")
        k = _append(k, _weight("bias_k", given.bias_k, (1, 1, E)).reshape(H, 1, head_dim))
        v = _append(v, _weight("bias_v", given.bias_v, (1, 1, E)).reshape(H, 1, head_dim))
        masks.pad()
    if flag("add_zero_attn", options.add_zero_attn):
        k = _append(k, np.zeros((H, 1, head_dim), k.dtype))
        v = _append(v, np.zeros((H, 1, head_dim), v.dtype))
        masks.pad()
    return k, v


def _attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    masks: _TorchMasks,
    inputs: _Inputs,
    options: _Options,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The heads, and the weights ``(N, H, L, S)`` when asked for (dropped in training)."""
    causal = flag("is_causal", options.is_causal)
    if causal and inputs.attn_mask is None:
        raise AttentionValueError("is_causal is a hint that attn_mask is causal: pass attn_mask")
    want_weights = flag("need_weights", options.need_weights)
    keywords: dict[str, Any] = {"mask": masks.mask, "bias": masks.bias}
    if causal and inputs.key_padding_mask is None and not want_weights:
        keywords = {"causal": True, "causal_alignment": "top_left"}  # torch ignores the mask
    dropout = float(options.dropout_p) if flag("training", options.training) else 0.0
    if not 0.0 <= dropout <= 1.0:
        raise AttentionValueError(f"dropout_p must be between 0 and 1; got {options.dropout_p}")
    if not (dropout > 0.0 or want_weights):
        return scaled_dot_product_attention(q, k, v, **keywords), None
    _, weights = scaled_dot_product_attention(q, k, v, **keywords, return_weights=True)
    if dropout > 0.0:
        rng = options.generator if options.generator is not None else np.random.default_rng()
        keep = rng.random(weights.shape) >= dropout  # never kept when dropout_p is 1
        weights = np.where(keep, weights * (1.0 / (1.0 - dropout) if keep.any() else 0.0), 0.0)
    return weights @ v, weights if want_weights else None


class _TorchMasks:
    """torch's ``attn_mask`` and ``key_padding_mask`` as mha's boolean mask and bias."""

    def __init__(
        self, attn_mask: Any, key_padding_mask: Any, L: int, S: int, N: int, H: int, dtype: Any
    ) -> None:
        self.S = S
        self.mask: np.ndarray | None = None  # (N or 1, H or 1, L or 1, S), True = may attend
        self.bias: np.ndarray | None = None
        if attn_mask is not None:
            array = as_array("attn_mask", attn_mask)
            if array.shape == (L, S):
                array = array[None, None]
            elif array.shape == (N * H, L, S):
                array = array.reshape(N, H, L, S)
            else:
                raise ShapeError(
                    f"attn_mask must have shape (L, S) = {(L, S)} or (N*num_heads, L, S) = "
                    f"{(N * H, L, S)}; got {array.shape}"
                )
            self._add("attn_mask", array, dtype)
        if key_padding_mask is not None:
            array = as_array("key_padding_mask", key_padding_mask)
            if array.shape != (N, S):
                raise ShapeError(
                    f"key_padding_mask must have shape (N, S) = {(N, S)}; got {array.shape}"
                )
            self._add("key_padding_mask", array[:, None, None, :], dtype)

    def _add(self, name: str, array: np.ndarray, dtype: Any) -> None:
        if array.dtype.kind == "b":
            allowed = ~array  # torch: True = may NOT attend
            self.mask = allowed if self.mask is None else self.mask & allowed
        elif array.dtype.kind == "f":
            added = array.astype(dtype)
            self.bias = added if self.bias is None else self.bias + added
        else:
            raise AttentionTypeError(
                f"{name} must be boolean (True = may not attend, torch's polarity) or float "
                f"(added to the logits); got dtype {array.dtype}"
            )

    def pad(self) -> None:
        """One more key, visible to every query (torch pads its masks with zeros)."""
        self.S += 1
        if self.mask is not None:
            self.mask = np.concatenate([self.mask, np.ones((*self.mask.shape[:-1], 1), bool)], -1)
        if self.bias is not None:
            zero = np.zeros((*self.bias.shape[:-1], 1), self.bias.dtype)
            self.bias = np.concatenate([self.bias, zero], -1)


def _in_projection_weights(
    E: int, kdim: int, vdim: int, separate: bool, packed: Any, W_q: Any, W_k: Any, W_v: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    given = [
        name
        for name, W in (("q_proj_weight", W_q), ("k_proj_weight", W_k), ("v_proj_weight", W_v))
        if W is not None
    ]
    if not separate and given:
        raise AttentionValueError(
            f"{', '.join(given)} given with use_separate_proj_weight=False, where torch would "
            "ignore them: pass use_separate_proj_weight=True to use them, or leave them out"
        )
    if separate and packed is not None:
        raise AttentionValueError(
            "in_proj_weight given with use_separate_proj_weight=True, where torch would ignore "
            "it: pass in_proj_weight=None, or use_separate_proj_weight=False to use it"
        )
    if not separate:
        if packed is None:
            raise AttentionValueError(
                "use_separate_proj_weight is False but in_proj_weight is None"
            )
        weight = _weight("in_proj_weight", packed, (3 * E, E))
        return weight[:E], weight[E : 2 * E], weight[2 * E :]
    if W_q is None or W_k is None or W_v is None:
        raise AttentionValueError(
            "use_separate_proj_weight=True needs q_proj_weight, k_proj_weight and v_proj_weight"
        )
    return (
        _weight("q_proj_weight", W_q, (E, E)),
        _weight("k_proj_weight", W_k, (E, kdim)),
        _weight("v_proj_weight", W_v, (E, vdim)),
    )


def _weight(name: str, value: Any, shape: tuple[int | None, ...]) -> np.ndarray:
    array = as_float_array(name, value)
    fits = array.ndim == len(shape) and all(
        want is None or got == want for got, want in zip(array.shape, shape, strict=True)
    )
    if not fits:
        expected = "(" + ", ".join("any" if n is None else str(n) for n in shape) + ")"
        raise ShapeError(f"{name} must have shape {expected}; got {array.shape}")
    return array


def _static(name: str, value: Any, N: int, H: int, head_dim: int) -> np.ndarray:
    array = as_float_array(name, value)
    if array.ndim != 3 or array.shape[0] != N * H or array.shape[2] != head_dim:
        raise ShapeError(
            f"{name} must have shape (N*num_heads, S, head_dim) = ({N * H}, S, {head_dim}); "
            f"got {array.shape}"
        )
    return array.reshape(N, H, array.shape[1], head_dim)


def _append(x: np.ndarray, row: np.ndarray) -> np.ndarray:
    """``x (N, H, S, d)`` with ``row (H, 1, d)`` appended to every batch entry's keys."""
    return np.concatenate([x, np.broadcast_to(row, (x.shape[0], *row.shape)).astype(x.dtype)], 2)
