"""What a :class:`mha.MultiHeadAttention` holds: its configuration, checked once, and its
weights in the "x @ W" layout, checked against it.

:class:`Configuration` is the base of the layer: it keeps the settings, names and shapes
the weights, builds a module around weights from elsewhere (:meth:`from_spec`) and
writes its ``repr``. The layer's computation is in :mod:`.module`, the other layouts of its
weights (torch, GPT-2, Llama, files) in :mod:`.layouts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .._arrays import flag, is_bfloat16, non_negative_int, positive_int, resolve_scale
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .checks import WEIGHT_NAMES
from .clip import check_clip_qkv
from .gates import check_gate_activation
from .output_norm import check_output_norm
from .qk_norm import KIND_NAMES as QK_NORM_NAMES
from .qk_norm import KINDS as QK_NORM_KINDS
from .qk_norm import check_offset
from .rope_scaling import check_base, check_rope_scaling
from .rotary import check_rotary_options, positive_real
from .v_norm import check_v_norm
from .variants import SymmetricAlibi, alibi_slopes, check_query_temperature, check_scores

if TYPE_CHECKING:
    from typing import Self

__all__ = ["PARAMETER_NAMES", "Configuration", "LayerSpec", "float_dtype"]

PARAMETER_NAMES = (*WEIGHT_NAMES, "sinks", "q_norm", "k_norm", "W_g", "b_g", "q_norm_bias",
                   "k_norm_bias", "o_norm", "q_scale")  # fmt: skip
"""The module's learned arrays: the weights of the function, gpt-oss's sink logits, the
QK-norm's weights, the output gate's, the output norm's and the queries' factors."""


@dataclass(frozen=True)
class LayerSpec:
    """What a :class:`mha.MultiHeadAttention` computes besides its weights, as its
    constructor's keywords name it: ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``rope_theta``, ``rotary_dim``, ``rotary_interleaved``, ``rope_scaling``, ``window``,
    ``sink_tokens``, ``softcap``, ``alibi``, ``chunk``, ``scale``, ``qk_norm``,
    ``qk_norm_eps``, ``qk_norm_offset``, ``add_zero_attn``, ``output_gate``,
    ``output_gate_per_head``, ``query_temperature``, ``v_head_dim`` (the values' head
    width, when it differs from the keys': MiMo-V2-Flash), ``clip_qkv``, ``qk_layernorm``,
    ``qk_norm_after_rope``, ``v_norm``, ``shares_kv_with``, ``output_norm`` and
    ``output_norm_eps`` (each ``None``, or ``False``, for its default; ``head_dim`` then
    comes from the weights). The pair ``(spec, weights)`` is what a reader of another
    format produces (:mod:`mha.integrations.readers`) and :meth:`Configuration.from_spec`
    builds a layer from.

    >>> import mha
    >>> mha.LayerSpec(num_heads=4, num_kv_heads=2, window=16).window
    16
    """

    num_heads: int
    num_kv_heads: Any = None
    head_dim: Any = None
    rope_theta: Any = None
    rotary_dim: Any = None
    rotary_interleaved: Any = False
    rope_scaling: Any = None
    window: Any = None
    sink_tokens: Any = None
    softcap: Any = None
    alibi: Any = None
    chunk: Any = None
    scale: Any = None
    qk_norm: Any = None
    qk_norm_eps: Any = None
    qk_norm_offset: Any = None
    add_zero_attn: Any = False
    output_gate: Any = None
    output_gate_per_head: Any = False
    query_temperature: Any = None
    v_head_dim: Any = None
    clip_qkv: Any = None
    qk_layernorm: Any = False
    qk_norm_after_rope: Any = False
    v_norm: Any = None
    shares_kv_with: Any = None
    output_norm: Any = None
    output_norm_eps: Any = None

    kind = "attention"
    """What a reader's spec builds (:meth:`Configuration.from_spec`)."""

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The keywords a spec holds, in order.

        >>> import mha
        >>> mha.LayerSpec.fields()[:3]
        ('num_heads', 'num_kv_heads', 'head_dim')
        """
        return tuple(field.name for field in fields(cls))


class Configuration:
    """A multi-head attention's settings and weights (see :class:`mha.MultiHeadAttention`)."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int  # the values' head width (head_dim unless the spec says otherwise)
    kdim: int
    vdim: int
    qdim: int  # the queries' input width (d_model unless the weights say otherwise)
    add_zero_attn: bool
    rope_theta: float | None
    rotary_dim: int | None
    rotary_interleaved: bool
    rope_scaling: dict[str, Any] | None  # transformers' rope_parameters
    scale: float | None  # None: 1/sqrt(head_dim)
    qk_norm: str | None  # "head", "all" or "each_head"
    qk_norm_eps: float
    qk_norm_offset: float
    window: int | None
    sink_tokens: int | None
    softcap: float | None
    alibi: np.ndarray | None  # the slopes
    chunk: int | None
    dtype: np.dtype
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray
    b_q: np.ndarray | None
    b_k: np.ndarray | None
    b_v: np.ndarray | None
    b_o: np.ndarray | None
    bias_k: np.ndarray | None
    bias_v: np.ndarray | None
    sinks: np.ndarray | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    output_gate: str | None  # "sigmoid" or "softplus"
    output_gate_per_head: bool
    query_temperature: tuple[float | str, ...] | None  # (beta, floor, offset[, law])
    W_g: np.ndarray | None
    b_g: np.ndarray | None
    clip_qkv: float | None  # the projections clamped to [-clip_qkv, clip_qkv]
    qk_layernorm: bool  # the QK-norm a LayerNorm
    qk_norm_after_rope: bool  # the QK-norm after the rotation (HunYuan)
    v_norm: float | None  # the epsilon of the values' RMSNorm without weights (Gemma 3n, 4)
    shares_kv_with: int | None  # the layer whose keys and values it attends with (shared_kv.py)
    q_norm_bias: np.ndarray | None
    k_norm_bias: np.ndarray | None
    output_norm: str | None  # the joined heads' norm before W_o: "rms" or "l2" (output_norm.py)
    output_norm_eps: float | None
    o_norm: np.ndarray | None  # the weight of an output_norm="rms"
    q_scale: np.ndarray | None  # each query feature's factor after the rotation (Dory's sqk)

    def _configure(self, spec: LayerSpec, widths: tuple[Any, Any, Any, Any]) -> None:
        """Check and keep the configuration (everything but the weights): ``spec`` (its
        ``head_dim`` given), and the widths ``(d_model, kdim, vdim, qdim)``."""
        self._configure_heads(spec, widths)
        self._configure_rotary(spec)
        self._configure_variants(spec)

    def _configure_heads(self, spec: LayerSpec, widths: tuple[Any, Any, Any, Any]) -> None:
        d_model, kdim, vdim, qdim = widths
        num_heads, num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.d_model, self.num_heads = d_model, num_heads
        self.num_kv_heads = (
            num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        )
        if num_heads % self.num_kv_heads:
            raise AttentionValueError(
                f"num_kv_heads={self.num_kv_heads} does not divide num_heads={num_heads}; "
                "each key/value head serves an equal group of query heads"
            )
        self.head_dim = positive_int("head_dim", spec.head_dim)
        self.v_head_dim = self.head_dim
        if spec.v_head_dim is not None:
            self.v_head_dim = positive_int("v_head_dim", spec.v_head_dim)
        self.kdim, self.vdim = positive_int("kdim", kdim), positive_int("vdim", vdim)
        self.qdim = positive_int("qdim", qdim)
        self.add_zero_attn = flag("add_zero_attn", spec.add_zero_attn)
        self.scale = None
        if spec.scale is not None:
            self.scale = resolve_scale(spec.scale, self.head_dim, np.dtype(np.float64))

    def _configure_rotary(self, spec: LayerSpec) -> None:
        rope_theta, rotary_dim, rotary_interleaved = (
            spec.rope_theta,
            spec.rotary_dim,
            spec.rotary_interleaved,
        )
        rope_scaling = spec.rope_scaling
        self.rope_theta = None if rope_theta is None else positive_real("rope_theta", rope_theta)
        if self.rope_theta is not None:  # checked as the calls will check them
            check_rotary_options(
                self.head_dim,
                self.rope_theta,
                rotary_dim,
                rotary_interleaved,
                f"head_dim={self.head_dim}",
            )
        elif rotary_dim is not None or rotary_interleaved or rope_scaling is not None:
            raise AttentionValueError(
                "rotary_dim, rotary_interleaved and rope_scaling have no effect without rope_theta="
            )
        self.rope_scaling = None
        if rope_scaling is not None:  # checked now as the calls check it, kept as given
            if not isinstance(rope_scaling, Mapping):
                raise AttentionTypeError(
                    f"rope_scaling must be a dict of transformers' rope_parameters; got "
                    f"{type(rope_scaling).__name__}"
                )
            check_base(
                check_rope_scaling(
                    rope_scaling, rotary_dim or self.head_dim, "rope_scaling", "rope_scaling"
                ),
                self.rope_theta or 1e4,
                ("rope_theta", "rope_scaling"),
            )
            self.rope_scaling = _plain(rope_scaling)
        self.rotary_dim = None if rotary_dim is None else int(rotary_dim)
        self.rotary_interleaved = flag("rotary_interleaved", rotary_interleaved)

    def _configure_variants(self, spec: LayerSpec) -> None:
        qk_norm, qk_norm_eps = spec.qk_norm, spec.qk_norm_eps
        qk_norm_offset = spec.qk_norm_offset
        window, sink_tokens, chunk = spec.window, spec.sink_tokens, spec.chunk
        if qk_norm is not None and qk_norm not in QK_NORM_KINDS:
            raise AttentionValueError(f"qk_norm must be None, {QK_NORM_NAMES}; got {qk_norm!r}")
        self.qk_norm = qk_norm
        self.qk_layernorm = flag("qk_layernorm", spec.qk_layernorm)
        self.qk_norm_after_rope = flag("qk_norm_after_rope", spec.qk_norm_after_rope)
        for name in ("qk_layernorm", "qk_norm_after_rope"):
            if getattr(self, name) and qk_norm is None:
                raise AttentionValueError(f"{name} needs qk_norm= ('head', 'all' or 'each_head')")
        if qk_norm is None and (qk_norm_eps is not None or qk_norm_offset is not None):
            raise AttentionValueError("qk_norm_eps and qk_norm_offset need qk_norm=")
        self.qk_norm_eps = 1e-6
        if qk_norm_eps is not None:
            self.qk_norm_eps = positive_real("qk_norm_eps", qk_norm_eps)
        self.qk_norm_offset = 0.0
        if qk_norm_offset is not None:  # checked as the calls check it
            self.qk_norm_offset = check_offset(qk_norm_offset)
        self.window = None if window is None else positive_int("window", window)
        tokens = 0 if sink_tokens is None else non_negative_int("sink_tokens", sink_tokens)
        self.sink_tokens = tokens or None
        if self.sink_tokens is not None and self.window is None:
            raise AttentionValueError(
                "sink_tokens keeps the first positions beside a sliding window: give window= too"
            )
        self.chunk = None if chunk is None else positive_int("chunk", chunk)
        if isinstance(spec.alibi, SymmetricAlibi):
            raise AttentionValueError(
                "alibi=symmetric_alibi(...) is a call's (scaled_dot_product_attention, "
                "paged_attention, ...): a layer's ALiBi is BLOOM's and MPT's, alibi=True or "
                "its slopes"
            )
        scores = check_scores(
            sinks=None,
            softcap=spec.softcap,
            alibi=spec.alibi,
            score_mod=None,
            score_mod_grad=None,
            H=self.num_heads,
            want_backward=False,
        )
        self.softcap = None if scores is None else scores.softcap
        self.alibi = None if scores is None else scores.alibi
        self.output_gate = check_gate_activation(spec.output_gate)
        self.output_gate_per_head = flag("output_gate_per_head", spec.output_gate_per_head)
        if self.output_gate_per_head and self.output_gate is None:
            raise AttentionValueError("output_gate_per_head needs output_gate= ('sigmoid', ...)")
        self.query_temperature = None
        if spec.query_temperature is not None:
            self.query_temperature = check_query_temperature(spec.query_temperature).keyword()
        self.clip_qkv = check_clip_qkv(spec.clip_qkv)
        self.v_norm = check_v_norm(spec.v_norm)
        self.shares_kv_with = None
        if spec.shares_kv_with is not None:
            self.shares_kv_with = non_negative_int("shares_kv_with", spec.shares_kv_with)
        norm = check_output_norm(spec.output_norm, spec.output_norm_eps)
        self.output_norm, self.output_norm_eps = (None, None) if norm is None else norm

    @property
    def has_bias(self) -> bool:
        """Whether all four projection biases are present (torch's ``bias=True``).

        >>> import mha
        >>> mha.MultiHeadAttention(8, 2, bias=True).has_bias
        True
        """
        return all(b is not None for b in (self.b_q, self.b_k, self.b_v, self.b_o))

    def weights(self) -> dict[str, np.ndarray | None]:
        """The weights by attribute name (``W_q``, ..., ``b_o``, ``bias_k``, ``bias_v``,
        ``sinks``; ``None`` where absent): the arrays themselves, not copies.

        >>> import mha
        >>> sorted(name for name, W in mha.MultiHeadAttention(4, 2).weights().items()
        ...        if W is not None)
        ['W_k', 'W_o', 'W_q', 'W_v']
        """
        return {name: getattr(self, name) for name in PARAMETER_NAMES}

    def variants(self) -> dict[str, Any]:
        """The keywords of the function that this module's variants set (none by default).

        >>> import mha
        >>> mha.MultiHeadAttention(8, 2, softcap=50.0, chunk=16).variants()
        {'softcap': 50.0, 'chunk': 16}
        """
        given = {
            "sinks": self.sinks,
            "sink_tokens": self.sink_tokens,
            "softcap": self.softcap,
            "alibi": self.alibi,
            "chunk": self.chunk,
            "query_temperature": self.query_temperature,
        }
        return {name: value for name, value in given.items() if value is not None}

    def __repr__(self) -> str:
        defaults = {
            "num_kv_heads": self.num_heads,
            "head_dim": self.d_model // self.num_heads,
            "v_head_dim": self.head_dim,
            "kdim": self.d_model,
            "vdim": self.d_model,
            "qdim": self.d_model,
            "rope_theta": None,
            "rotary_dim": None,
            "rotary_interleaved": False,
            "window": None,
            "sink_tokens": None,
            "softcap": None,
            "chunk": None,
            "rope_scaling": None,
            "scale": None,
            "qk_norm": None,
            "query_temperature": None,
            "clip_qkv": None,
            "v_norm": None,
            "shares_kv_with": None,
            "output_norm": None,
            "output_norm_eps": None,
        }
        dims = "".join(
            f", {name}={getattr(self, name)!r}"
            for name, default in defaults.items()
            if getattr(self, name) != default
        )
        if self.output_gate is not None:
            dims += f", output_gate={self.output_gate!r}"
            dims += ", output_gate_per_head=True" if self.output_gate_per_head else ""
        if self.qk_norm is not None:
            dims += ", qk_layernorm=True" if self.qk_layernorm else ""
            dims += ", qk_norm_after_rope=True" if self.qk_norm_after_rope else ""
            dims += "".join(
                f", {name}={value}"
                for name, value, default in (
                    ("qk_norm_eps", self.qk_norm_eps, 1e-6),
                    ("qk_norm_offset", self.qk_norm_offset, 0.0),
                )
                if value != default
            )
        extras = "".join(
            f", {name}=True"
            for name, on in (
                ("add_bias_kv", self.bias_k is not None),
                ("add_zero_attn", self.add_zero_attn),
                ("sinks", self.sinks is not None),
                ("query_scale", self.q_scale is not None),
                ("alibi", self.alibi is not None and self._standard_slopes()),
            )
            if on
        )
        if self.alibi is not None and not self._standard_slopes():
            extras += f", alibi={self.alibi.tolist()}"
        return (
            f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}{dims}, "
            f"bias={self.has_bias}{extras}{self._partial_biases()}, dtype={self.dtype.name})"
        )

    def _config(self) -> dict[str, Any]:
        """What a saved file records besides the weights, checked again when it is loaded."""
        return {
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self._own_v_head_dim(),
            "kdim": self.kdim,
            "vdim": self.vdim,
            "qdim": self.qdim,
            "bias": self.has_bias,
            "biases": [
                name
                for name in ("b_q", "b_k", "b_v", "b_o", "b_g", "q_norm_bias", "k_norm_bias")
                if getattr(self, name) is not None
            ],
            "add_bias_kv": self.bias_k is not None,
            "add_zero_attn": self.add_zero_attn,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "rotary_interleaved": self.rotary_interleaved,
            "window": self.window,
            "sinks": self.sinks is not None,
            "q_scale": self.q_scale is not None,
            "sink_tokens": self.sink_tokens,
            "softcap": self.softcap,
            "chunk": self.chunk,
            "alibi": None if self.alibi is None else self.alibi.tolist(),
            "rope_scaling": self.rope_scaling,
            "scale": self.scale,
            "qk_norm": self.qk_norm,
            "qk_norm_eps": None if self.qk_norm is None else self.qk_norm_eps,
            "qk_norm_offset": None if self.qk_norm is None else self.qk_norm_offset,
            "output_gate": self.output_gate,
            "output_gate_per_head": self.output_gate_per_head,
            "query_temperature": (
                None if self.query_temperature is None else list(self.query_temperature)
            ),
            "clip_qkv": self.clip_qkv,
            "qk_layernorm": self.qk_layernorm,
            "qk_norm_after_rope": self.qk_norm_after_rope,
            "v_norm": self.v_norm,
            "shares_kv_with": self.shares_kv_with,
            "output_norm": self.output_norm,
            "output_norm_eps": self.output_norm_eps,
            "dtype": self._held_dtype().name,
        }

    @property
    def spec(self) -> LayerSpec:
        """What this layer computes besides its weights, as its constructor's keywords name
        it: ``MultiHeadAttention.from_spec(attention.spec, attention.weights())`` is an equal
        layer.

        >>> import mha
        >>> mha.MultiHeadAttention(8, 2, num_kv_heads=1, window=16).spec.window
        16
        """
        norm = self.qk_norm is not None
        return LayerSpec(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.rope_theta,
            self.rotary_dim,
            self.rotary_interleaved,
            self.rope_scaling,
            self.window,
            self.sink_tokens,
            self.softcap,
            self.alibi,
            self.chunk,
            self.scale,
            self.qk_norm,
            self.qk_norm_eps if norm else None,
            self.qk_norm_offset if norm else None,
            self.add_zero_attn,
            self.output_gate,
            self.output_gate_per_head,
            self.query_temperature,
            self._own_v_head_dim(),
            self.clip_qkv,
            self.qk_layernorm,
            self.qk_norm_after_rope,
            self.v_norm,
            self.shares_kv_with,
            self.output_norm,
            self.output_norm_eps,
        )

    @classmethod
    def from_spec(
        cls, spec: LayerSpec, weights: Mapping[str, Any], source: str = "weights"
    ) -> Self:
        """A layer computing ``spec`` with ``weights`` (by attribute name: ``W_q``, ...,
        ``b_o``, ``bias_k``, ``bias_v``, ``sinks``, ``q_norm``, ``k_norm``; those absent
        may be left out), each checked against the spec and the others (``source`` names
        them in messages). The widths are the weights': ``d_model`` ``W_o``'s columns, ``kdim``,
        ``vdim`` and ``qdim`` the rows of ``W_k``, ``W_v`` and ``W_q``.

        >>> import numpy as np, mha
        >>> W = {name: np.eye(4) for name in ("W_q", "W_k", "W_v", "W_o")}
        >>> mha.MultiHeadAttention.from_spec(mha.LayerSpec(num_heads=2, window=8), W)
        MultiHeadAttention(d_model=4, num_heads=2, window=8, bias=False, dtype=float64)
        """
        weights = {name: None if x is None else np.asarray(x) for name, x in weights.items()}
        W_q, W_k, W_v, W_o = (weights.get(name) for name in ("W_q", "W_k", "W_v", "W_o"))
        if W_q is None or W_k is None or W_v is None or W_o is None:
            raise AttentionValueError(f"{source}: W_q, W_k, W_v and W_o are all needed")
        for name, W in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o)):
            if W.ndim != 2 or 0 in W.shape:
                raise ShapeError(f"{source}: {name} must be a non-empty matrix; got {W.shape}")
        H = positive_int("num_heads", spec.num_heads)
        if W_q.shape[1] % H:
            raise AttentionValueError(
                f"{source}: num_heads={H} does not divide the {W_q.shape[1]} columns of W_q "
                f"{W_q.shape}"
            )
        self = cls.__new__(cls)
        spec = replace(
            spec,
            num_heads=H,
            num_kv_heads=spec.num_kv_heads or H,
            head_dim=spec.head_dim or W_q.shape[1] // H,
        )
        if spec.v_head_dim is None and W_v.shape[1] != W_k.shape[1]:  # the values' own width
            spec = replace(spec, v_head_dim=W_v.shape[1] // (spec.num_kv_heads or H))
        self._configure(spec, (W_o.shape[1], W_k.shape[0], W_v.shape[0], W_q.shape[0]))
        for name, shape in self._shapes().items():
            array = weights.get(name)
            if array is not None and array.shape != shape:
                raise ShapeError(
                    f"{source}: {name} has shape {array.shape} but {self._describe()} calls "
                    f"for {shape}"
                )
        if (weights.get("bias_k") is None) != (weights.get("bias_v") is None):
            raise AttentionValueError(f"{source}: bias_k and bias_v go together")
        has_norm = [weights.get(name) is not None for name in ("q_norm", "k_norm")]
        if any(has_norm) and not (all(has_norm) and self.qk_norm is not None):
            raise AttentionValueError(
                f"{source}: q_norm and k_norm go together, with qk_norm= ('head' or 'all')"
            )
        if self.qk_norm is not None and not all(has_norm):
            raise AttentionValueError(f"{source}: qk_norm={self.qk_norm!r} needs q_norm and k_norm")
        biases = [weights.get(name) is not None for name in ("q_norm_bias", "k_norm_bias")]
        if any(biases) and not (all(biases) and self.qk_layernorm):
            raise AttentionValueError(
                f"{source}: q_norm_bias and k_norm_bias go together, with qk_layernorm=True"
            )
        gated = weights.get("W_g") is not None
        b_g = weights.get("b_g") is not None
        if gated != (self.output_gate is not None) or (b_g and not gated):
            raise AttentionValueError(
                f"{source}: W_g (with b_g, if any) and output_gate= ('sigmoid' or 'softplus') "
                "go together"
            )
        if (weights.get("o_norm") is not None) != (self.output_norm == "rms"):
            raise AttentionValueError(f"{source}: o_norm and output_norm='rms' go together")
        present = [a for a in weights.values() if a is not None]
        self.dtype = float_dtype(np.result_type(*present))
        for name in PARAMETER_NAMES:
            array = weights.get(name)
            setattr(self, name, None if array is None else np.array(array, self.dtype, order="C"))
        self._side_by_side()
        return self

    def _side_by_side(self) -> None:
        """``W_q``, ``W_k`` and ``W_v`` as views of one matrix ``[W_q | W_k | W_v]`` (when they
        have as many rows), which a call reads in one product (:func:`.checks.
        side_by_side`); every layer mha makes holds its projections so, the same bits
        whichever way it was made. Replacing one of them by another array undoes it."""
        W_q, W_k, W_v = self.W_q, self.W_k, self.W_v
        if W_q.shape[0] == W_k.shape[0] == W_v.shape[0]:
            joined = np.concatenate([W_q, W_k, W_v], axis=1)
            q_end, k_end = W_q.shape[1], W_q.shape[1] + W_k.shape[1]
            self.W_q, self.W_k = joined[:, :q_end], joined[:, q_end:k_end]
            self.W_v = joined[:, k_end:]

    def _held_dtype(self) -> np.dtype:
        """The weights' common dtype (the module's, unless an array was replaced by one of
        another dtype): what a module built from them again has."""
        present = [W for W in self.weights().values() if W is not None]
        return float_dtype(np.result_type(*present)) if present else self.dtype

    def _standard_slopes(self) -> bool:
        """Whether the ALiBi slopes are :func:`mha.alibi_slopes`' for the head count."""
        return self.alibi is not None and bool(
            np.array_equal(self.alibi, alibi_slopes(self.num_heads))
        )

    def _partial_biases(self) -> str:
        names = [n for n in ("b_q", "b_k", "b_v", "b_o") if getattr(self, n) is not None]
        return "" if self.has_bias or not names else f", biases=({', '.join(names)})"

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every weight this configuration holds, present or not."""
        E, inner = self.d_model, self.num_heads * self.head_dim
        kv_inner = self.num_kv_heads * self.head_dim
        v_inner, joined = self.num_kv_heads * self.v_head_dim, self.num_heads * self.v_head_dim
        return {
            "W_q": (self.qdim, inner),
            "W_k": (self.kdim, kv_inner),
            "W_v": (self.vdim, v_inner),
            "W_o": (joined, E),
            "b_q": (inner,),
            "b_k": (kv_inner,),
            "b_v": (v_inner,),
            "b_o": (E,),
            "bias_k": (kv_inner,),
            "bias_v": (v_inner,),
            "sinks": (self.num_heads,),
            **self._norm_shapes(),
            "W_g": (self.qdim, self.num_heads if self.output_gate_per_head else joined),
            "b_g": (self.num_heads if self.output_gate_per_head else joined,),
            "o_norm": (joined,),
            "q_scale": (inner,),
        }

    def _own_v_head_dim(self) -> int | None:
        """The values' head width where it differs from the keys' (else ``None``)."""
        return None if self.v_head_dim == self.head_dim else self.v_head_dim

    def _norm_shapes(self) -> dict[str, tuple[int, ...]]:
        """The QK-norm's weights' and biases' shapes, by its kind."""
        d, H, H_kv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k = {"all": ((H * d,), (H_kv * d,)), "each_head": ((H, d), (H_kv, d))}.get(
            str(self.qk_norm), ((d,), (d,))
        )
        return {"q_norm": q, "k_norm": k, "q_norm_bias": q, "k_norm_bias": k}

    def _describe(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, kdim={self.kdim}, "
            f"vdim={self.vdim}" + (f", qdim={self.qdim}" if self.qdim != self.d_model else "")
        )


def _plain(value: Any) -> Any:
    """A copy of ``value`` in plain Python types (NumPy numbers and arrays too), as a saved
    file's JSON holds it; nothing shared with the caller's."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def float_dtype(dtype: Any) -> np.dtype:
    """A floating dtype, or a clear refusal."""
    try:
        result: np.dtype = np.dtype(dtype)
    except TypeError:
        raise AttentionTypeError(f"dtype must be a floating dtype; got {dtype!r}") from None
    if result.kind != "f" and not is_bfloat16(result):
        raise AttentionTypeError(
            f"dtype must be a floating dtype (bfloat16, float16, float32, float64); got {result}"
        )
    return result
