"""Dynamic mask attention (Doge's): a bias of each key/value head and key computed from the
values, added to the scores, and each query's ``keep_window_size`` keys of the largest bias
kept of those it sees.

For the joined values ``v (*B, S, H_kv*d_v)`` of the keys (a cache's and the call's), the
bias of key/value head ``g`` and key ``j`` is ``exp(A_g * softplus(v_j @ W_dt + b_dt)_g)``,
``W_dt (H_kv*d_v, H_kv)``, ``b_dt (H_kv,)`` (or none) and ``A (H_kv,)`` learned. It is the
same for every query: the kernel takes it as the call's additive ``bias (B, H, 1, S)`` (each
key/value head's over its query heads), and its gradient, summed over the queries, is the
kernel's too. When a query sees more than ``keep_window_size`` keys (causal), only the
``keep_window_size`` of the largest bias stay visible (the call's ``mask``), as
transformers' ``torch.topk`` keeps them (a choice with no gradient).

The values' gradient has two paths: the attention's and the bias's, ``d bias -> d (v @ W_dt
+ b_dt) -> d v``, added to the gradients of ``W_v``, ``b_v`` and the value input; ``W_dt``,
``b_dt`` and ``A`` get theirs.

>>> import numpy as np
>>> layer = DynamicMaskAttention(16, 4, num_kv_heads=2, keep_window_size=3, seed=0)
>>> layer.W_dt.shape, layer.A.shape
((8, 2), (2,))
>>> x = np.random.default_rng(0).standard_normal((2, 5, 16))
>>> cache = layer.new_cache(2)
>>> steps = [layer(x[:, a:b], cache=cache) for a, b in ((0, 3), (3, 4), (4, 5))]
>>> bool(np.allclose(np.concatenate(steps, axis=1), layer(x, mask=True), rtol=1e-12))
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np

from .._arrays import positive_int
from ..errors import AttentionValueError, ShapeError
from .cache import KVCache
from .checks import random_generator
from .configuration import LayerSpec, float_dtype
from .module import MultiHeadAttention

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "DYNAMIC_WEIGHTS",
    "DynamicMaskAttention",
    "DynamicMaskSpec",
    "key_bias",
    "key_bias_backward",
]

DYNAMIC_WEIGHTS = ("W_dt", "b_dt", "A")
"""The dynamic mask's weights (``b_dt`` may be ``None``)."""


@dataclass(frozen=True)
class DynamicMaskSpec(LayerSpec):
    """What a :class:`DynamicMaskAttention` computes besides its weights: the keywords of
    :class:`~mha.LayerSpec` (``num_heads``, ``num_kv_heads``, ``head_dim``, ``rope_theta``,
    ``rotary_dim``, ``rotary_interleaved``, ``rope_scaling``, ``window``, ``sink_tokens``,
    ``softcap``, ``alibi``, ``chunk``, ``scale``, ``qk_norm``, ``qk_norm_eps``,
    ``qk_norm_offset``, ``add_zero_attn``, ``output_gate``, ``output_gate_per_head``,
    ``query_temperature``, ``v_head_dim``, ``clip_qkv``, ``qk_layernorm``,
    ``qk_norm_after_rope``, ``v_norm``, ``shares_kv_with``, ``output_norm``,
    ``output_norm_eps``), with ``keep_window_size``
    (``None``: every key kept).

    >>> DynamicMaskSpec(num_heads=4, keep_window_size=8).kind
    'dynamic_mask'
    """

    keep_window_size: Any = None

    kind = "dynamic_mask"


def _softplus(z: np.ndarray) -> np.ndarray:
    softplus: np.ndarray = np.logaddexp(0.0, z)
    return softplus


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def key_bias(
    v: np.ndarray, W_dt: np.ndarray, b_dt: np.ndarray | None, A: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The bias ``(B, S, H_kv)`` of the joined values ``v (B, S, H_kv*d_v)``, and what its
    gradient reads (:func:`key_bias_backward`)."""
    z = v @ W_dt
    if b_dt is not None:
        z = z + b_dt
    u = _softplus(z)
    e = np.exp(A * u)
    return e, (v, z, u, e)


def key_bias_backward(
    d_e: np.ndarray, saved: tuple[np.ndarray, ...], W_dt: np.ndarray, A: np.ndarray, biased: bool
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The gradient of the joined values and of ``W_dt`` (``b_dt`` when ``biased``) and ``A``,
    given the bias's ``d_e (B, S, H_kv)``."""
    v, z, u, e = saved
    d_exp = d_e * e
    grads = {"A": (d_exp * u).sum(axis=(0, 1))}
    d_z = d_exp * A * _sigmoid(z)
    rows = d_z.reshape(-1, d_z.shape[-1])
    grads["W_dt"] = v.reshape(-1, v.shape[-1]).T @ rows
    if biased:
        grads["b_dt"] = rows.sum(axis=0)
    return d_z @ W_dt.T, grads


class DynamicMaskAttention(MultiHeadAttention):
    """Dynamic mask attention that owns its weights (Doge's): a self-attention
    :class:`~mha.MultiHeadAttention` of ``d_model`` and ``num_heads`` (``options``: its other
    keywords; ``seed`` draws every weight) with ``W_dt (H_kv*v_head_dim, H_kv)``, ``b_dt
    (H_kv,)`` when ``dt_bias``, ``A (H_kv,)`` and ``keep_window_size`` (``None``: every key
    kept; the module's docstring). Of keys of equal bias, the earlier ones are kept
    (transformers' ``torch.topk`` keeps some of them, which it does not specify). Called
    causally (``mask=True``), or on a :class:`mha.KVCache` of sequences of one length;
    ``backward`` returns the three weights' gradients too. It is not saved to ``.npz`` files
    nor held by ``torch.nn.MultiheadAttention``.

    >>> import numpy as np
    >>> layer = DynamicMaskAttention(8, 2, keep_window_size=2, dt_bias=True, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((1, 4, 8))
    >>> out, backward = layer(x, mask=True, return_backward=True)
    >>> sorted(backward(np.ones_like(out)))[:3]
    ['A', 'W_dt', 'W_k']
    """

    not_saved = "W_dt, b_dt, A and keep_window_size"
    not_torch = "dynamic mask attention (a bias of each key computed from the values)"

    W_dt: np.ndarray
    b_dt: np.ndarray | None
    A: np.ndarray
    keep_window_size: int | None
    kind = "dynamic_mask"
    """What a reader's spec builds (:class:`DynamicMaskSpec`'s kind)."""

    def __init__(
        self,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        *,
        keep_window_size: int | None = None,
        dt_bias: bool = False,
        seed: int | np.random.Generator | None = None,
        **options: Any,
    ) -> None:
        rng = random_generator(seed)
        super().__init__(d_model, num_heads, seed=rng, **options)
        self._configure_dynamic(keep_window_size)
        H_kv, joined = self.num_kv_heads, self.num_kv_heads * self.v_head_dim
        bound = 1.0 / float(np.sqrt(joined))
        self.W_dt = rng.uniform(-bound, bound, (joined, H_kv)).astype(self.dtype)
        self.b_dt = rng.uniform(-bound, bound, H_kv).astype(self.dtype) if dt_bias else None
        self.A = rng.normal(0.0, 1.0, H_kv).astype(self.dtype)

    def _configure_dynamic(self, keep_window_size: Any) -> None:
        if self.window is not None or self.sink_tokens:
            raise AttentionValueError(
                "dynamic mask attention with a window or sink tokens: its top-k over the keys "
                "each query sees is computed for causal attention alone"
            )
        keep = keep_window_size
        self.keep_window_size = None if keep is None else positive_int("keep_window_size", keep)

    def weights(self) -> dict[str, np.ndarray | None]:
        """The weights by attribute name, ``W_dt``, ``b_dt`` and ``A`` last.

        >>> list(DynamicMaskAttention(8, 2, seed=0).weights())[-3:]
        ['W_dt', 'b_dt', 'A']
        """
        return {**super().weights(), **{name: getattr(self, name) for name in DYNAMIC_WEIGHTS}}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        H_kv = self.num_kv_heads
        own = {"W_dt": (H_kv * self.v_head_dim, H_kv), "b_dt": (H_kv,), "A": (H_kv,)}
        return super()._shapes() | own

    @property
    def spec(self) -> DynamicMaskSpec:
        """What this layer computes besides its weights (:meth:`from_spec` takes it back).

        >>> DynamicMaskAttention(8, 2, keep_window_size=4).spec.keep_window_size
        4
        """
        plain = super().spec
        given = {f.name: getattr(plain, f.name) for f in fields(plain)}
        return DynamicMaskSpec(**given, keep_window_size=self.keep_window_size)

    @classmethod
    def from_spec(
        cls, spec: LayerSpec, weights: Mapping[str, Any], source: str = "weights"
    ) -> Self:
        """A layer computing ``spec`` (a :class:`DynamicMaskSpec`) with ``weights``, ``W_dt``
        and ``A`` (and ``b_dt``) among them (``source`` names them in messages).

        >>> layer = DynamicMaskAttention(8, 2, keep_window_size=4, seed=0)
        >>> DynamicMaskAttention.from_spec(layer.spec, layer.weights()).W_dt.shape
        (8, 2)
        """
        plain = LayerSpec(**{f.name: getattr(spec, f.name) for f in fields(LayerSpec)})
        others = {name: x for name, x in weights.items() if name not in DYNAMIC_WEIGHTS}
        self = super().from_spec(plain, others, source)
        self._configure_dynamic(getattr(spec, "keep_window_size", None))
        shapes = self._shapes()
        for name in DYNAMIC_WEIGHTS:
            x = weights.get(name)
            if x is None and name == "b_dt":
                self.b_dt = None
                continue
            if x is None or np.shape(x) != shapes[name]:
                raise ShapeError(
                    f"{source}: {name} must have shape {shapes[name]}; got "
                    f"{None if x is None else np.shape(x)}"
                )
            setattr(self, name, np.array(x, dtype=float_dtype(self.dtype)))
        return self

    def forward(  # type: ignore[override]
        self,
        query: Any,
        mask: Any = None,
        *,
        cache: Any = None,
        return_backward: bool = False,
    ) -> Any:
        """The layer's output for ``query (B, L, d_model)``: causal (``mask=True``), or the
        next tokens of each sequence of ``cache`` (a :class:`mha.KVCache`, every sequence of
        one length); with ``return_backward``, and ``backward``.

        >>> import numpy as np
        >>> layer = DynamicMaskAttention(8, 2, keep_window_size=2, seed=0)
        >>> layer(np.ones((1, 3, 8)), mask=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mha.AttentionValueError: dynamic mask attention is causal: ...
        """
        x = np.asarray(query)
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ShapeError(
                f"query must have shape (B, L, {self.d_model}) for dynamic mask attention; "
                f"got shape {x.shape}"
            )
        if cache is None and mask is not True:
            raise AttentionValueError(
                "dynamic mask attention is causal: call it with mask=True, or with cache="
            )
        n = 0
        if cache is not None:
            if not isinstance(cache, KVCache) or cache.window is not None:
                raise AttentionValueError(
                    "dynamic mask attention reads its cache's values for the bias: give a "
                    f"mha.KVCache from new_cache; got {cache!r}"
                )
            lengths = cache.lengths
            if len(lengths) and (lengths != lengths[0]).any():
                raise AttentionValueError(
                    "dynamic mask attention on a cache of sequences of different lengths "
                    f"({lengths.tolist()}) is not computed: decode sequences of one length"
                )
            n = int(lengths[0]) if len(lengths) else 0
        dtype = np.result_type(float_dtype(self.dtype), np.float32)
        W_v, W_dt, A = (np.asarray(w, dtype) for w in (self.W_v, self.W_dt, self.A))
        b_v = None if self.b_v is None else np.asarray(self.b_v, dtype)
        b_dt = None if self.b_dt is None else np.asarray(self.b_dt, dtype)
        v = x.astype(dtype) @ W_v
        if b_v is not None:
            v = v + b_v
        B, L = x.shape[:2]
        S, H, H_kv = n + L, self.num_heads, self.num_kv_heads
        values = v
        if n:  # the cached values, joined: (B, n, H_kv*d_v)
            held = np.asarray(cache.v[:, :, :n], dtype).transpose(0, 2, 1, 3).reshape(B, n, -1)
            values = np.concatenate([held, v], axis=1)
        e, saved = key_bias(values, W_dt, b_dt, A)  # (B, S, H_kv)
        group = H // H_kv
        bias = np.repeat(e.transpose(0, 2, 1)[:, :, None, :], group, axis=1)  # (B, H, 1, S)
        seen = np.arange(S)[None, :] <= (n + np.arange(L))[:, None]  # (L, S): causal
        allowed = self._kept(e, seen)
        result = super().forward(
            x,
            np.repeat(allowed, group, axis=1),
            cache=cache,
            bias=bias,
            return_backward=return_backward,
        )
        if not return_backward:
            return result
        *outputs, backward = result

        def with_bias_path(grad_out: Any) -> dict[str, np.ndarray]:
            grads = backward(grad_out)
            d_bias = grads.pop("bias").reshape(B, H_kv, group, S).sum(axis=(2,))  # (B, H_kv, S)
            d_values, own = key_bias_backward(
                d_bias.transpose(0, 2, 1), saved, W_dt, A, b_dt is not None
            )
            d_v = d_values[:, n:]  # the call's own tokens' values
            rows = d_v.reshape(-1, d_v.shape[-1])
            grads["W_v"] = grads["W_v"] + x.reshape(-1, x.shape[-1]).astype(dtype).T @ rows
            if b_v is not None:
                grads["b_v"] = grads["b_v"] + rows.sum(axis=0)
            grads["value"] = grads["value"] + d_v @ W_v.T
            result: dict[str, np.ndarray] = {**grads, **own}
            return result

        return (*outputs, with_bias_path)

    __call__ = forward  # type: ignore[assignment]

    def _kept(self, e: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """Which keys each query of each key/value head attends ``(B, H_kv, L, S)``: those it
        sees, and of them the ``keep_window_size`` of the largest bias ``e (B, S, H_kv)``
        when the keys are more."""
        B, S, H_kv = e.shape
        allowed = np.broadcast_to(seen, (B, H_kv, *seen.shape))
        keep = self.keep_window_size
        if keep is None or keep >= S:
            return allowed
        scores = np.where(allowed, e.transpose(0, 2, 1)[:, :, None, :], -np.inf)
        # the largest first, of equal ones the earlier key (torch.topk's order is unspecified)
        top = np.argsort(-scores, axis=-1, kind="stable")[..., :keep]
        kept = np.zeros(scores.shape, dtype=bool)
        np.put_along_axis(kept, top, True, axis=-1)
        kept &= allowed
        return kept

    def __repr__(self) -> str:
        plain = super().__repr__().removeprefix("MultiHeadAttention(")
        return f"DynamicMaskAttention(keep_window_size={self.keep_window_size}, {plain}"
