"""Differential attention (DiffLlama; Ye et al., "Differential Transformer", 2024): the
difference of two softmaxes weighted by a learned ``lambda``, each head's result through a
group norm (an RMSNorm of the head, without weights) times ``1 - lambda_init``.

It is two pieces of what mha has. The ``H`` query heads are ``H/2`` pairs, heads ``i`` and
``i + H/2``: two softmaxes of the same tiled kernel, in one call, over values ``2d`` wide (a
head's two value heads joined, as DiffLlama concatenates them: ``v_head_dim = 2 *
head_dim``). Then an output stage (:class:`DifferentialOutput`, the spec's
:class:`~mha.api.spec.OutputStage`) takes the joined heads ``(*B, L, H*2d)`` to
``o_i - lambda * o_{i + H/2}``, normalises each of the ``H/2`` results over its ``2d``
features and scales it by ``1 - lambda_init``: ``(*B, L, H*d)``, what ``W_o`` reads. Its
backward gives the gradients of the joined heads and of the four vectors of
``lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init``; caches
hold the keys and the ``2d``-wide values as any layer's.

:class:`DifferentialAttention` is the layer that owns them: a
:class:`~mha.MultiHeadAttention` whose values are ``2 * head_dim`` wide by default and whose
``W_o`` reads ``H * v_head_dim / 2`` features.

>>> import numpy as np
>>> layer = DifferentialAttention(16, 4, num_kv_heads=2, lambda_init=0.2, seed=0)
>>> layer.W_v.shape, layer.W_o.shape, layer.lambda_q1.shape
((16, 16), (16, 16), (4,))
>>> x = np.random.default_rng(0).standard_normal((2, 5, 16))
>>> cache = layer.new_cache(2)
>>> steps = [layer(x[:, :3], cache=cache), layer(x[:, 3:], cache=cache)]
>>> bool(np.allclose(np.concatenate(steps, axis=1), layer(x, mask=True), rtol=1e-13))
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np

from .._arrays import as_float_array, positive_int
from ..errors import AttentionValueError, ShapeError
from .checks import random_generator
from .configuration import LayerSpec, float_dtype
from .module import MultiHeadAttention
from .rotary import positive_real
from .spec import Checked

if TYPE_CHECKING:
    from typing import Self

__all__ = ["LAMBDAS", "DifferentialAttention", "DifferentialOutput", "DifferentialSpec"]

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
"""The learned vectors of ``lambda``, each ``head_dim`` wide."""


@dataclass(frozen=True, eq=False)
class DifferentialOutput:
    """The output stage of differential attention over ``heads`` heads whose values are
    ``d_v`` wide: head ``i``'s result minus ``lambda`` times head ``i + heads/2``'s, each
    normalised over its ``d_v`` features (``eps``) and times ``1 - lambda_init``."""

    lambdas: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    lambda_init: float
    eps: float
    heads: int
    d_v: int

    @classmethod
    def check(
        cls, lambdas: Mapping[str, Any], lambda_init: Any, eps: Any, H: int, d_k: int, d_v: int
    ) -> DifferentialOutput:
        """The stage of the vectors ``lambdas`` (by name, each ``d_k`` wide), checked
        against the layer's ``H`` query heads (an even number) and value width ``d_v``."""
        if H % 2:
            raise AttentionValueError(
                f"differential attention pairs heads i and i + H/2: num_heads={H} must be even"
            )
        vectors = []
        for name in LAMBDAS:
            if lambdas.get(name) is None:
                raise AttentionValueError(f"differential attention needs {', '.join(LAMBDAS)}")
            x = as_float_array(name, lambdas[name])
            if x.shape != (d_k,):
                raise ShapeError(f"{name} must have shape ({d_k},) (head_dim); got {x.shape}")
            vectors.append(x)
        init = _real("lambda_init", lambda_init)
        q1, k1, q2, k2 = vectors
        return cls((q1, k1, q2, k2), init, positive_real("eps", eps), H, d_v)

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The stage's weights, by parameter name (``backward`` gives their gradients)."""
        return dict(zip(LAMBDAS, self.lambdas, strict=True))

    def staged_width(self, H: int, d_v: int) -> int:
        """The width of what ``W_o`` reads: ``H/2`` results of ``d_v`` features."""
        return H // 2 * d_v

    def _lambda(self, dtype: np.dtype) -> tuple[float, float, float]:
        q1, k1, q2, k2 = (x.astype(dtype, copy=False) for x in self.lambdas)
        e1, e2 = math.exp(float(q1 @ k1)), math.exp(float(q2 @ k2))
        return e1 - e2 + self.lambda_init, e1, e2

    def forward(self, joined: np.ndarray, inputs: np.ndarray) -> tuple[np.ndarray, Any]:
        """``(*B, L, H*d_v)`` to ``(*B, L, H/2*d_v)``, and what the backward reads."""
        half = self.heads // 2
        heads = joined.reshape(*joined.shape[:-1], self.heads, self.d_v)
        first, second = heads[..., :half, :], heads[..., half:, :]
        lam, e1, e2 = self._lambda(joined.dtype)
        diff = first - lam * second
        r = 1.0 / np.sqrt(np.mean(diff * diff, axis=-1, keepdims=True) + self.eps)
        y = diff * r
        out = (1.0 - self.lambda_init) * y
        return out.reshape(*joined.shape[:-1], half * self.d_v), (second, y, r, lam, e1, e2)

    def backward(
        self, d_out: np.ndarray, saved: Any
    ) -> tuple[np.ndarray, None, dict[str, np.ndarray]]:
        """The gradients of the joined heads and of the four vectors of ``lambda``."""
        second, y, r, lam, e1, e2 = saved
        g = (1.0 - self.lambda_init) * d_out.reshape(y.shape)
        d_diff = r * (g - y * np.mean(g * y, axis=-1, keepdims=True))  # the RMSNorm's
        d_lam = -float(np.sum(d_diff * second))
        d_joined = np.concatenate([d_diff, -lam * d_diff], axis=-2)
        q1, k1, q2, k2 = (x.astype(d_out.dtype, copy=False) for x in self.lambdas)
        grads = {
            "lambda_q1": d_lam * e1 * k1,
            "lambda_k1": d_lam * e1 * q1,
            "lambda_q2": -d_lam * e2 * k2,
            "lambda_k2": -d_lam * e2 * q2,
        }
        return d_joined.reshape(*d_out.shape[:-1], -1), None, grads


def _real(name: str, value: Any) -> float:
    number = isinstance(value, (int, float, np.integer, np.floating))
    if not number or isinstance(value, (bool, np.bool_)) or not math.isfinite(value):
        raise AttentionValueError(f"{name} must be a finite number; got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DifferentialSpec(LayerSpec):
    """What a :class:`DifferentialAttention` computes besides its weights: the keywords of
    :class:`~mha.LayerSpec` (``num_heads``, ``num_kv_heads``, ``head_dim``, ``rope_theta``,
    ``rotary_dim``, ``rotary_interleaved``, ``rope_scaling``, ``window``, ``sink_tokens``,
    ``softcap``, ``alibi``, ``chunk``, ``scale``, ``qk_norm``, ``qk_norm_eps``,
    ``qk_norm_offset``, ``add_zero_attn``, ``output_gate``, ``output_gate_per_head``,
    ``query_temperature``, ``v_head_dim``, ``clip_qkv``, ``qk_layernorm``,
    ``qk_norm_after_rope``, ``v_norm``, ``shares_kv_with``, ``output_norm``,
    ``output_norm_eps``), with ``lambda_init`` and the group norm's epsilon
    ``differential_eps``.

    >>> DifferentialSpec(num_heads=4, lambda_init=0.2).kind
    'differential'
    """

    lambda_init: Any = None
    differential_eps: Any = None

    kind = "differential"


class DifferentialAttention(MultiHeadAttention):
    """Differential attention that owns its weights (DiffLlama's): a
    :class:`~mha.MultiHeadAttention` of ``d_model`` and an even number ``num_heads`` of
    heads, values ``v_head_dim`` wide (``2 * head_dim`` by default), ``W_o``
    ``(num_heads * v_head_dim / 2, d_model)``, the vectors ``lambda_q1``, ``lambda_k1``,
    ``lambda_q2``, ``lambda_k2`` (``head_dim`` wide, normal, ``lambda_std`` their spread, by
    ``seed``), ``lambda_init`` and the group norm's epsilon ``eps``. The other keywords
    (``options``) are :class:`~mha.MultiHeadAttention`'s (but ``output_gate``, whose stage
    this layer's takes the place of). ``backward`` returns the four vectors' gradients too.
    It is not saved to ``.npz`` files nor held by ``torch.nn.MultiheadAttention``.

    >>> import numpy as np
    >>> layer = DifferentialAttention(16, 4, lambda_init=0.2, rope_theta=100.0, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((1, 6, 16))
    >>> out, backward = layer(x, mask=True, return_backward=True)
    >>> out.shape, backward(np.ones_like(out))["lambda_q1"].shape
    ((1, 6, 16), (4,))
    """

    not_saved = "its lambda vectors and lambda_init"
    not_torch = "differential attention (two softmaxes weighted by lambda, a group norm)"

    lambda_q1: np.ndarray
    lambda_k1: np.ndarray
    lambda_q2: np.ndarray
    lambda_k2: np.ndarray
    lambda_init: float
    differential_eps: float
    kind = "differential"
    """What a reader's spec builds (:class:`DifferentialSpec`'s kind)."""

    def __init__(
        self,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        *,
        lambda_init: float = 0.2,
        eps: float = 1e-5,
        lambda_std: float = 0.1,
        seed: int | np.random.Generator | None = None,
        **options: Any,
    ) -> None:
        for name in ("output_gate", "output_norm"):
            if options.get(name) is not None:
                raise AttentionValueError(
                    f"{name}: a DifferentialAttention's output stage is its own (the "
                    "difference of its heads' pairs, normalised)"
                )
        H, E = positive_int("num_heads", num_heads), positive_int("d_model", d_model)
        if options.get("v_head_dim") is None:
            d = options.get("head_dim") or (E // H if E % H == 0 else None)
            options["v_head_dim"] = None if d is None else 2 * positive_int("head_dim", d)
        rng = random_generator(seed)
        super().__init__(E, H, seed=rng, **options)
        self._configure_differential(lambda_init, eps)
        joined = self._shapes()["W_o"][0]
        bound = 1.0 / float(np.sqrt(joined))
        self.W_o = rng.uniform(-bound, bound, (E, joined)).astype(self.dtype).T.copy()
        std = positive_real("lambda_std", lambda_std)
        for name in LAMBDAS:
            setattr(self, name, rng.normal(0.0, std, self.head_dim).astype(self.dtype))

    def _configure_differential(self, lambda_init: Any, eps: Any) -> None:
        if self.num_heads % 2:
            raise AttentionValueError(
                f"differential attention pairs heads i and i + H/2: num_heads={self.num_heads} "
                "must be even"
            )
        self.lambda_init = _real("lambda_init", lambda_init)
        self.differential_eps = positive_real("eps", eps)

    def _checked(self, checked: Checked) -> Checked:
        """The call's keywords with this layer's output stage (not kept: its weights are
        read afresh each call, as an optimiser may have changed them)."""
        stage = DifferentialOutput.check(
            {name: getattr(self, name) for name in LAMBDAS},
            self.lambda_init,
            self.differential_eps,
            self.num_heads,
            self.head_dim,
            self.v_head_dim,
        )
        return checked._replace(spec=replace(checked.spec, output=stage), kept=False)

    def weights(self) -> dict[str, np.ndarray | None]:
        """The weights by attribute name, the four vectors of ``lambda`` last.

        >>> list(DifferentialAttention(8, 2, seed=0).weights())[-2:]
        ['lambda_q2', 'lambda_k2']
        """
        return {**super().weights(), **{name: getattr(self, name) for name in LAMBDAS}}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super()._shapes()
        shapes["W_o"] = (self.num_heads // 2 * self.v_head_dim, self.d_model)
        return shapes | dict.fromkeys(LAMBDAS, (self.head_dim,))

    @property
    def spec(self) -> DifferentialSpec:
        """What this layer computes besides its weights (:meth:`from_spec` takes it back).

        >>> DifferentialAttention(8, 2, lambda_init=0.5).spec.lambda_init
        0.5
        """
        plain = super().spec
        given = {f.name: getattr(plain, f.name) for f in fields(plain)}
        return DifferentialSpec(
            **given, lambda_init=self.lambda_init, differential_eps=self.differential_eps
        )

    @classmethod
    def from_spec(
        cls, spec: LayerSpec, weights: Mapping[str, Any], source: str = "weights"
    ) -> Self:
        """A layer computing ``spec`` (a :class:`DifferentialSpec`) with ``weights``, the
        four vectors of ``lambda`` among them (``source`` names them in messages).

        >>> layer = DifferentialAttention(8, 2, lambda_init=0.5, seed=0)
        >>> DifferentialAttention.from_spec(layer.spec, layer.weights()).W_o.shape
        (8, 8)
        """
        lambda_init = getattr(spec, "lambda_init", None)
        if lambda_init is None:
            raise AttentionValueError(f"{source}: differential attention needs lambda_init")
        for name in ("output_gate", "output_norm"):
            if getattr(spec, name) is not None:
                raise AttentionValueError(f"{source}: {name}: differential attention has none")
        plain = LayerSpec(**{f.name: getattr(spec, f.name) for f in fields(LayerSpec)})
        others = {name: x for name, x in weights.items() if name not in LAMBDAS}
        self = super().from_spec(plain, others, source)
        self._configure_differential(lambda_init, getattr(spec, "differential_eps", 1e-5))
        for name in LAMBDAS:
            x = weights.get(name)
            if x is None or np.shape(x) != (self.head_dim,):
                raise ShapeError(
                    f"{source}: {name} must have shape ({self.head_dim},); got "
                    f"{None if x is None else np.shape(x)}"
                )
            setattr(self, name, np.array(x, dtype=float_dtype(self.dtype)))
        return self

    def __repr__(self) -> str:
        plain = super().__repr__().removeprefix("MultiHeadAttention(")
        return f"DifferentialAttention(lambda_init={self.lambda_init}, {plain}"
