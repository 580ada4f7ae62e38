"""Attention with a learned relative-position bias by segment (CPM-Ant's), not causal: a
:class:`~mha.MultiHeadAttention` that holds the bias table ``relative_bias (H,
num_buckets + num_segments**2)`` and makes from each call's ``segments`` the bias
:func:`mha.relative_position_bias` computes (``"segments"``: a query and a key of one segment
by their bucketed distance in both directions, of two segments by the pair's own entry).

Every token sees every token (mha's default without a mask), and through a cache too: a
call with ``cache=`` attends to every cached key and every new one (``causal=False``), as
CPM-Ant's prefill does, unless the call asks for the causal mask. A prefill's outputs are
then those of its tokens alone, and each later call's those of the whole sequence so far.
:meth:`token_inputs` gives a call's ``segments`` and ``mask`` from CPM-Ant's token ids as
its model's forward makes them: ``prompt_length`` prompt tokens prepended in segment 0, the
text in segment 2 but for token id 0 (segment 0), and the left padding (the text before the
last as many tokens as are not 0) hidden from every token and seeing none.

>>> import numpy as np
>>> layer = SegmentBiasAttention(16, 2, num_buckets=8, max_distance=20, num_segments=3,
...                              prompt_length=2, seed=0)
>>> layer.relative_bias.shape
(2, 17)
>>> ids = np.array([[0, 5, 7, 9]])
>>> inputs = layer.token_inputs(ids)
>>> inputs["segments"].tolist()
[[0, 0, 0, 2, 2, 2]]
>>> x = np.random.default_rng(0).standard_normal((1, 6, 16))
>>> whole = layer(x, **inputs)
>>> cache = layer.new_cache(1)
>>> prefill = layer(x[:, :4], cache=cache, **layer.token_inputs(ids[:, :2]))
>>> step = layer(x[:, 4:], cache=cache, segments=inputs["segments"], mask=inputs["mask"][:, 4:])
>>> bool(np.allclose(step, whole[:, 4:], rtol=1e-12))
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np

from .._arrays import positive_int
from ..errors import AttentionValueError, ShapeError
from .checks import random_generator
from .configuration import LayerSpec, float_dtype
from .module import MultiHeadAttention
from .relative_bias import relative_position_bias

if TYPE_CHECKING:
    from typing import Self

__all__ = ["SegmentBiasAttention", "SegmentBiasSpec"]


@dataclass(frozen=True)
class SegmentBiasSpec(LayerSpec):
    """What a :class:`SegmentBiasAttention` computes besides its weights: the keywords of
    :class:`~mha.LayerSpec` (``num_heads``, ``num_kv_heads``, ``head_dim``, ``rope_theta``,
    ``rotary_dim``, ``rotary_interleaved``, ``rope_scaling``, ``window``, ``sink_tokens``,
    ``softcap``, ``alibi``, ``chunk``, ``scale``, ``qk_norm``, ``qk_norm_eps``,
    ``qk_norm_offset``, ``add_zero_attn``, ``output_gate``, ``output_gate_per_head``,
    ``query_temperature``, ``v_head_dim``, ``clip_qkv``, ``qk_layernorm``,
    ``qk_norm_after_rope``, ``v_norm``, ``shares_kv_with``, ``output_norm``,
    ``output_norm_eps``) with ``num_buckets``, ``max_distance`` and ``num_segments`` (the
    bias's buckets, :func:`mha.relative_position_bias`) and ``prompt_length`` (the prompt
    tokens :meth:`SegmentBiasAttention.token_inputs` prepends).

    >>> SegmentBiasSpec(num_heads=4, num_buckets=32).kind
    'segment_bias'
    """

    num_buckets: Any = 32
    max_distance: Any = 128
    num_segments: Any = 1
    prompt_length: Any = 0

    kind = "segment_bias"


_OWN = ("num_buckets", "max_distance", "num_segments", "prompt_length")


class SegmentBiasAttention(MultiHeadAttention):
    """A self-attention :class:`~mha.MultiHeadAttention` of ``d_model`` and ``num_heads``
    (``options``: its other keywords; ``seed`` draws every weight) with the bias table
    ``relative_bias (H, num_buckets + num_segments**2)`` and the bias's ``num_buckets``,
    ``max_distance``, ``num_segments``, and ``prompt_length`` (the module's docstring). A
    call takes ``segments (B, S)`` (each position's segment, the cached ones included) and
    attends without the causal mask, with a cache too, unless given ``mask=True`` or
    ``causal=True``; ``backward`` returns the table's gradient as ``relative_bias``.

    >>> import numpy as np
    >>> layer = SegmentBiasAttention(8, 2, num_buckets=4, num_segments=2, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((1, 3, 8))
    >>> out, backward = layer(x, segments=[[0, 1, 1]], return_backward=True)
    >>> backward(np.ones_like(out))["relative_bias"].shape
    (2, 8)
    """

    not_saved = "relative_bias and its buckets"
    not_torch = "a relative-position bias by segment"

    relative_bias: np.ndarray
    num_buckets: int
    max_distance: int
    num_segments: int
    prompt_length: int
    kind = "segment_bias"
    """What a reader's spec builds (:class:`SegmentBiasSpec`'s kind)."""

    def __init__(
        self,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        num_segments: int = 1,
        prompt_length: int = 0,
        seed: int | np.random.Generator | None = None,
        **options: Any,
    ) -> None:
        rng = random_generator(seed)
        super().__init__(d_model, num_heads, seed=rng, **options)
        self._configure_bias(num_buckets, max_distance, num_segments, prompt_length)
        shape = self._shapes()["relative_bias"]
        self.relative_bias = rng.normal(0.0, 1.0, shape).astype(self.dtype)

    def _configure_bias(self, buckets: Any, distance: Any, segments: Any, prompt: Any) -> None:
        self.num_buckets = positive_int("num_buckets", buckets)
        self.max_distance = positive_int("max_distance", distance)
        self.num_segments = positive_int("num_segments", segments)
        if isinstance(prompt, bool) or not isinstance(prompt, (int, np.integer)) or prompt < 0:
            raise AttentionValueError(f"prompt_length must be an int >= 0; got {prompt!r}")
        self.prompt_length = int(prompt)

    def weights(self) -> dict[str, np.ndarray | None]:
        """The weights by attribute name, ``relative_bias`` last.

        >>> list(SegmentBiasAttention(8, 2, seed=0).weights())[-1]
        'relative_bias'
        """
        return {**super().weights(), "relative_bias": self.relative_bias}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        if not hasattr(self, "num_buckets"):  # from_spec's plain layer: the table comes next
            return super()._shapes()
        table = (self.num_heads, self.num_buckets + self.num_segments**2)
        return super()._shapes() | {"relative_bias": table}

    @property
    def spec(self) -> SegmentBiasSpec:
        """What this layer computes besides its weights (:meth:`from_spec` takes it back).

        >>> SegmentBiasAttention(8, 2, num_segments=3).spec.num_segments
        3
        """
        plain = super().spec
        given = {f.name: getattr(plain, f.name) for f in fields(plain)}
        return SegmentBiasSpec(**given, **{name: getattr(self, name) for name in _OWN})

    @classmethod
    def from_spec(
        cls, spec: LayerSpec, weights: Mapping[str, Any], source: str = "weights"
    ) -> Self:
        """A layer computing ``spec`` (a :class:`SegmentBiasSpec`) with ``weights``,
        ``relative_bias`` among them (``source`` names them in messages).

        >>> layer = SegmentBiasAttention(8, 2, num_buckets=4, seed=0)
        >>> SegmentBiasAttention.from_spec(layer.spec, layer.weights()).relative_bias.shape
        (2, 5)
        """
        plain = LayerSpec(**{f.name: getattr(spec, f.name) for f in fields(LayerSpec)})
        others = {name: x for name, x in weights.items() if name != "relative_bias"}
        self = super().from_spec(plain, others, source)
        default = SegmentBiasSpec(num_heads=1)
        self._configure_bias(*(getattr(spec, name, getattr(default, name)) for name in _OWN))
        table, shape = weights.get("relative_bias"), self._shapes()["relative_bias"]
        if table is None or np.shape(table) != shape:
            raise ShapeError(
                f"{source}: relative_bias must have shape {shape} (heads, num_buckets + "
                f"num_segments**2); got {None if table is None else np.shape(table)}"
            )
        self.relative_bias = np.array(table, dtype=float_dtype(self.dtype))
        return self

    def position_bias(self, segments: Any) -> Any:
        """The ``score_mod`` of this layer's bias for ``segments (B, S)`` (or ``(S,)``):
        :func:`mha.relative_position_bias` of its table.

        >>> layer = SegmentBiasAttention(8, 2, num_buckets=4, num_segments=2, seed=0)
        >>> layer.position_bias([[0, 0, 1]]).table.shape
        (2, 8)
        """
        return relative_position_bias(
            self.relative_bias, "segments", num_buckets=self.num_buckets,
            max_distance=self.max_distance, segments=segments, num_segments=self.num_segments,
        )  # fmt: skip

    def token_inputs(self, ids: Any) -> dict[str, np.ndarray]:
        """``segments (B, P + L)`` and ``mask (B, P + L, P + L)`` of CPM-Ant's token ids
        ``ids (B, L)``, its prompt's ``P = prompt_length`` tokens prepended (the module's
        docstring): a whole sequence's keywords; a cached call takes the mask's rows of its
        new tokens.

        >>> layer = SegmentBiasAttention(8, 2, num_segments=3, prompt_length=1)
        >>> inputs = layer.token_inputs([[0, 4, 0, 6]])   # 2 tokens not 0: the last 2 real
        >>> inputs["segments"].tolist(), inputs["mask"][0, :, 0].tolist()
        ([[0, 0, 2, 0, 2]], [True, False, False, True, True])
        """
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ShapeError(f"ids must be integer token ids (B, L); got {ids.dtype} {ids.shape}")
        B, L = ids.shape
        P = self.prompt_length
        text = np.where(ids != 0, 2, 0)
        segments = np.concatenate([np.zeros((B, P), np.int64), text], axis=1)
        length = (ids != 0).sum(-1)
        real = np.arange(L)[::-1] < length[:, None]  # the last `length` tokens: left padding
        real = np.concatenate([np.ones((B, P), bool), real], axis=1)
        return {"segments": segments, "mask": real[:, :, None] & real[:, None, :]}

    def forward(
        self,
        query: Any,
        mask: Any = None,
        *misplaced: Any,
        segments: Any = None,
        causal: Any = None,
        score_mod: Any = None,
        **options: Any,
    ) -> Any:
        """:meth:`mha.MultiHeadAttention.forward` of ``query`` with this layer's bias of
        ``segments`` (each position's segment, the cached ones included) as its
        ``score_mod`` (which cannot be given too), and without the causal mask unless
        ``mask=True`` or ``causal=True`` (``mask``: an array hides the keys it marks False);
        ``options``: the other keywords of :meth:`mha.MultiHeadAttention.forward`.

        >>> import numpy as np
        >>> layer = SegmentBiasAttention(8, 2, num_segments=2, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((1, 3, 8))
        >>> layer(x, segments=[[0, 1, 1]]).shape
        (1, 3, 8)
        """
        if segments is None:
            raise AttentionValueError(
                "this layer's bias depends on each position's segment: pass segments= (B, S), "
                "or token_inputs(ids) of CPM-Ant's token ids"
            )
        if score_mod is not None:
            raise AttentionValueError(
                "score_mod= cannot be given with this layer: its score_mod is the bias of "
                "segments= (position_bias)"
            )
        if causal is None and not isinstance(mask, (bool, np.bool_)):
            causal = False  # through a cache too
        return super().forward(
            query, mask, *misplaced, causal=causal, score_mod=self.position_bias(segments),
            **options,
        )  # fmt: skip

    __call__ = forward

    def __repr__(self) -> str:
        plain = super().__repr__().removeprefix("MultiHeadAttention(")
        own = ", ".join(f"{name}={getattr(self, name)}" for name in _OWN)
        return f"SegmentBiasAttention({own}, {plain}"
