"""The checked spec of an attention call, built once at the public boundary.

Every entry point gathers its keywords, as given, into one record of its signature
(:class:`SdpaKeywords`, :class:`MhaKeywords`), and :func:`check_sdpa` or :func:`check_mha`
turns the record into three checked objects handed down whole:

* :class:`AttentionSpec`: what the attention computes (vLLM's ``AttentionImpl``): the mask
  rules (causal and its alignment, window, sink tokens, chunks, ``mask_mod``), the changes to
  the scores (soft-capping, ALiBi, ``score_mod``, learned sinks), the scale, dropout, and for
  a layer its heads, rotary positions, QK-norm and extra keys;
* :class:`CallInputs`: what this one call carries (the mask and bias arrays, the lengths, the
  positions, the cache, the padding side, the generator), vLLM's per-step metadata;
* :class:`Request`: what the caller asks back (weights, log-sum-exp, backward) and the
  kernel's budget and threads.

What depends on the arrays (the head count, the head width, the dtype) is checked when the
spec meets them (:meth:`ScoreRules.fit`, ``scale`` in :func:`mha._arrays.resolve_scale`).
A record of hashable values checks to the same objects every time, so the checked objects
are kept per record (and per the exact types of its values: ``window=5.0`` is refused even
after ``window=5`` was taken): a program that calls with the same keywords again and again
pays for the checks once, as einops keeps its recipes.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol

import numpy as np

from .._arrays import flag, positive_int
from .._kernel import runtime
from .._kernel.call import DEFAULT_MAX_MEMORY
from .._kernel.contract import MaskArrays, MaskRules
from .._kernel.scores import Scores
from ..errors import AttentionTypeError, AttentionValueError
from .clip import check_clip_qkv
from .gates import check_gate_activation
from .output_norm import check_output_norm
from .padding import check_padding_side
from .v_norm import check_v_norm
from .variants import check_scores

__all__ = [
    "AttentionSpec",
    "CallInputs",
    "Checked",
    "KeySelection",
    "MhaKeywords",
    "OutputStage",
    "QKNormRules",
    "Request",
    "RotaryRules",
    "ScoreRules",
    "SdpaKeywords",
    "check_dropout",
    "check_mha",
    "check_sdpa",
    "kernel_options",
    "with_cache",
]


class SdpaKeywords(NamedTuple):
    """:func:`mha.scaled_dot_product_attention`'s keywords, as given, in its order."""

    mask: Any = None
    causal: Any = None
    causal_alignment: Any = None
    key_lengths: Any = None
    query_lengths: Any = None
    bias: Any = None
    window: Any = None
    sink_tokens: Any = None
    chunk: Any = None
    mask_mod: Any = None
    sinks: Any = None
    softcap: Any = None
    alibi: Any = None
    score_mod: Any = None
    score_mod_grad: Any = None
    query_temperature: Any = None
    scale: Any = None
    return_weights: Any = False
    return_lse: Any = False
    return_backward: Any = False
    dropout_p: Any = None
    generator: Any = None
    cache: Any = None
    padding_side: Any = None
    max_memory: Any = None
    workers: Any = None
    lse_base: Any = None


class MhaKeywords(NamedTuple):
    """:func:`mha.multi_head_attention`'s keywords, as given, in its order (the layer's
    weights and head counts are checked apart, against the inputs)."""

    mask: Any = None
    causal: Any = None
    causal_alignment: Any = None
    key_lengths: Any = None
    query_lengths: Any = None
    bias: Any = None
    scale: Any = None
    return_weights: Any = False
    max_memory: Any = None
    workers: Any = None
    add_zero_attn: Any = False
    num_kv_heads: Any = None
    window: Any = None
    sink_tokens: Any = None
    chunk: Any = None
    mask_mod: Any = None
    sinks: Any = None
    softcap: Any = None
    alibi: Any = None
    score_mod: Any = None
    score_mod_grad: Any = None
    query_temperature: Any = None
    rope_theta: Any = None
    rotary_dim: Any = None
    rotary_interleaved: Any = False
    rope_scaling: Any = None
    positions: Any = None
    qk_norm: Any = None
    qk_norm_eps: Any = None
    qk_norm_offset: Any = None
    cache: Any = None
    padding_side: Any = None
    return_backward: Any = False
    dropout_p: Any = None
    generator: Any = None
    output_gate: Any = None
    clip_qkv: Any = None
    qk_layernorm: Any = False
    qk_norm_after_rope: Any = False
    v_norm: Any = None
    output_norm: Any = None
    output_norm_eps: Any = None


@dataclass(frozen=True, eq=False)
class ScoreRules:
    """The changes to the scores as given (learned ``sinks``, ``softcap``, ``alibi``,
    ``score_mod`` and its derivative, the query ``temperature``), made into the kernel's
    pipeline of transforms for a call's head count by :meth:`fit`."""

    sinks: Any = None
    softcap: Any = None
    alibi: Any = None
    score_mod: Any = None
    score_mod_grad: Any = None
    temperature: Any = None  # query_temperature: (beta, floor) or (beta, floor, offset)

    def fit(
        self, H: int, want_backward: bool, batch_shape: tuple[int, ...] | None = None
    ) -> Scores | None:
        """The kernel's :class:`~mha._kernel.scores.Scores` for ``H`` query heads and the
        call's ``batch_shape`` (each sequence's ALiBi slopes have it), checked (``None``
        when the call changes nothing)."""
        return check_scores(
            sinks=self.sinks,
            softcap=self.softcap,
            alibi=self.alibi,
            score_mod=self.score_mod,
            score_mod_grad=self.score_mod_grad,
            H=H,
            want_backward=want_backward,
            temperature=self.temperature,
            batch_shape=batch_shape,
        )

    @functools.cached_property
    def empty(self) -> bool:
        return all(getattr(self, f.name) in (None, False) for f in fields(self))


class RotaryRules(NamedTuple):
    """A layer's rotary positions as given (checked against its head width by
    :mod:`.checks`): the base ``theta`` (``None``: no rotation), the rotated features, the
    pairing, and transformers' ``rope_parameters``."""

    theta: Any = None
    rotary_dim: Any = None
    interleaved: Any = False
    scaling: Any = None


class QKNormRules(NamedTuple):
    """A layer's QK-norm as given (its weights are the layer's): ``"head"``, ``"all"`` or
    ``"each_head"``, epsilon, the gain's offset, whether it is a LayerNorm and whether it
    follows the rotation (checked with the weights, :mod:`.qk_norm`)."""

    kind: Any = None
    eps: Any = None
    offset: Any = None
    layer: bool = False
    after_rope: bool = False


class OutputStage(Protocol):
    """A change to a layer's attention output before ``W_o`` (an output gate, say): the
    joined heads ``(*B, L, H*d_v)`` in, the changed ones out, with what its backward
    needs; and its backward: the gradient of its input and of its own weights, by name."""

    def forward(self, joined: np.ndarray, inputs: np.ndarray) -> tuple[np.ndarray, Any]:
        """``joined`` changed, for the layer's queries' inputs ``inputs (*B, L, d_q)``. A
        stage whose ``uses_matmul`` is true is also given the layer's thread team (its
        matrix products: ``team.matmul``, ``team.each_product``) and whether it may
        overwrite ``joined`` (no backward reads it), as a third and fourth argument."""

    def backward(
        self, d_out: np.ndarray, saved: Any
    ) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        """From the gradient of its output: that of ``joined``, that of ``inputs`` (or
        ``None``: the stage does not read them) and those of the stage's weights, by name."""


class KeySelection(Protocol):
    """A choice of the keys each query attends to, ahead of the walk (sparse top-k
    attention, say): ``True`` where query ``i`` keeps key ``j``, a boolean array that
    broadcasts to the scores ``(*B, H, L, S)``; the keys it drops are hidden, as a mask
    hides them."""

    def select(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """For the projected ``q (*B, H, L, d_k)`` and ``k (*B, H_kv, S, d_k)``."""


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """What an attention call computes, checked: the mask rules, the changes to the scores,
    the scale as given (checked against the head width and dtype when they are known), the
    dropout probability; and for a layer (:func:`mha.multi_head_attention`) its key/value
    heads, rotary positions, QK-norm, the clamp of its projections and torch's zero key. The
    ``output`` and ``selection`` stages are where a change before ``W_o`` and a selection of
    keys go: the layer's output gate (``output_gate``, its activation, with weights ``W_g``)
    becomes its output stage when its weights are checked."""

    mask: MaskRules = field(default_factory=MaskRules)
    scores: ScoreRules = field(default_factory=ScoreRules)
    scale: Any = None
    dropout_p: float = 0.0
    num_kv_heads: Any = None
    rotary: RotaryRules = field(default_factory=RotaryRules)
    qk_norm: QKNormRules = field(default_factory=QKNormRules)
    add_zero_attn: bool = False
    output: OutputStage | None = None
    selection: KeySelection | None = None
    output_gate: str | None = None  # the activation of a gate of weights W_g (api/gates.py)
    clip_qkv: float | None = None  # the projections clamped to [-clip_qkv, clip_qkv] (clip.py)
    v_norm: float | None = None  # the epsilon of the values' RMSNorm without weights (v_norm.py)
    output_norm: tuple[str, float] | None = None  # the joined heads' norm (output_norm.py)


@dataclass(frozen=True, eq=False)
class CallInputs:
    """What one call carries besides its operands: the mask contract's arrays (checked
    against the scores when they are known), the rotary ``positions``, the ``cache`` the new
    tokens are appended to (``left_padded``: their real rows are the last ones), and the
    dropout's ``generator``."""

    arrays: MaskArrays = field(default_factory=MaskArrays)
    positions: Any = None
    cache: Any = None
    left_padded: bool = False
    generator: Any = None

    @functools.cached_property
    def empty(self) -> bool:
        """Whether the call carries nothing (its spec alone says what it computes); worked
        out once (a kept record's inputs serve every call)."""
        plain = all(getattr(self.arrays, f.name) is None for f in fields(self.arrays))
        return plain and all(
            getattr(self, f.name) in (None, False) for f in fields(self) if f.name != "arrays"
        )


@dataclass(frozen=True, eq=False)
class Request:
    """What the caller asks back besides the output, and the kernel's keywords: scratch
    bytes per worker (``budget``) and threads (``None``: the default)."""

    weights: bool = False
    lse: bool = False
    backward: bool = False
    budget: int = DEFAULT_MAX_MEMORY
    threads: int | None = None
    lse_base2: bool = False  # the returned log-sum-exp in base 2 (FlashInfer's)

    @classmethod
    def check(
        cls,
        weights: Any,
        lse: Any,
        backward: Any,
        budget: Any,
        threads: Any,
        lse_base: Any = None,
    ) -> Request:
        """The flags and the kernel's keywords, checked."""
        want_weights = flag("return_weights", weights)
        budget, threads = kernel_options(budget, threads)
        want_lse = flag("return_lse", lse)
        return cls(
            want_weights,
            want_lse,
            flag("return_backward", backward),
            budget,
            threads,
            check_lse_base(lse_base, want_lse),
        )

    def returned_lse(self, lse: Any) -> Any:
        """A natural log-sum-exp in the base asked for (divided by ``ln 2`` for base 2, the
        inverse of :func:`mha.merge_attention`'s reading of ``base=2``)."""
        return lse / np.log(2.0) if self.lse_base2 else lse


def check_lse_base(lse_base: Any, return_lse: bool) -> bool:
    """Whether ``lse_base`` asks the log-sum-exp in base 2: ``None`` (natural) or 2, and
    only with ``return_lse``."""
    if lse_base is None:
        return False
    number = isinstance(lse_base, (int, float, np.integer, np.floating))
    if not number or isinstance(lse_base, (bool, np.bool_)) or lse_base != 2:
        raise AttentionValueError(
            f"lse_base must be None (natural logarithms) or 2 (FlashInfer's); got {lse_base!r}"
        )
    if not return_lse:
        raise AttentionValueError(
            "lse_base=2 is the base of the returned log-sum-exp: give return_lse=True with it"
        )
    return True


class Checked(NamedTuple):
    """A call's keywords, checked: what it computes, what it carries, what it asks back;
    ``kept``: the same object serves every call with these keywords (:mod:`.plans` keeps
    plans for it)."""

    spec: AttentionSpec
    given: CallInputs
    request: Request
    kept: bool = False


def check_sdpa(keywords: SdpaKeywords) -> Checked:
    """:func:`mha.scaled_dot_product_attention`'s keywords, checked (kept per record)."""
    checked: Checked = _kept(_check_sdpa, keywords)
    return checked


def _check_sdpa(kw: SdpaKeywords) -> Checked:
    request = Request.check(
        kw.return_weights, kw.return_lse, kw.return_backward, kw.max_memory, kw.workers,
        kw.lse_base,
    )  # fmt: skip
    window = kw.window
    if window is None and kw.cache is not None:  # the cache's, unless the call names one
        window = getattr(kw.cache, "window", None)
    placed = (kw.alibi is not None and kw.alibi is not False) or kw.query_temperature is not None
    rules = MaskRules.check(
        kw.mask, kw.causal, kw.causal_alignment, window, kw.sink_tokens, kw.chunk, kw.mask_mod,
        placed,
    )  # fmt: skip
    arrays = MaskArrays.of(kw.mask, kw.bias, kw.key_lengths, kw.query_lengths)
    drop_p = check_dropout(kw.dropout_p, kw.generator)
    scores = ScoreRules(
        kw.sinks, kw.softcap, kw.alibi, kw.score_mod, kw.score_mod_grad, kw.query_temperature
    )
    left = check_padding_side(kw.padding_side, kw.cache, arrays)
    spec = AttentionSpec(rules, scores, kw.scale, drop_p)
    return Checked(spec, CallInputs(arrays, None, kw.cache, left, kw.generator), request)


def check_mha(keywords: MhaKeywords) -> Checked:
    """:func:`mha.multi_head_attention`'s keywords, checked (kept per record; a record with
    a cache by the cache's kind and window, all that the checks read of it, the cache itself
    put back into the checked inputs: a decoding loop's calls check their keywords once)."""
    cache = keywords.cache
    if cache is None or not hasattr(cache, "_append"):  # (not a cache: refused by the checks)
        checked: Checked = _kept(_check_mha, keywords)
        return checked
    kind = CacheKind(type(cache), getattr(cache, "window", None))
    checked = _kept(_check_mha, keywords._replace(cache=kind))
    return checked._replace(given=with_cache(checked.given, cache))


def with_cache(given: CallInputs, cache: Any) -> CallInputs:
    """``given`` with ``cache`` (``dataclasses.replace`` without its checks, which cost
    microseconds a decoding step)."""
    again: CallInputs = object.__new__(CallInputs)
    again.__dict__.update(given.__dict__, cache=cache)
    again.__dict__.pop("empty", None)  # (worked out again, for this cache)
    return again


class CacheKind(NamedTuple):
    """What the keyword checks read of a cache (:func:`check_mha`): its type and window
    (the call's own checks take the cache itself)."""

    kind: type
    window: Any


def same_keywords(checked: Checked, kept: Checked, kind: type | None) -> bool:
    """Whether ``checked`` has the keywords of ``kept``: the same kept object, or the same
    kept record with a cache of type ``kind`` put back in (:func:`check_mha`; ``kept``
    itself holds no cache)."""
    if checked is kept:
        return True
    given, other = checked.given, kept.given
    return (
        checked.kept
        and kept.kept
        and checked.spec is kept.spec
        and checked.request is kept.request
        and given.arrays is other.arrays
        and given.positions is other.positions
        and given.left_padded is other.left_padded
        and given.generator is other.generator
        and type(given.cache) is kind
    )


def _check_mha(kw: MhaKeywords) -> Checked:
    request = Request.check(kw.return_weights, False, kw.return_backward, kw.max_memory, kw.workers)
    window = kw.window
    if window is None and kw.cache is not None:  # the cache's, as the core takes it
        window = getattr(kw.cache, "window", None)
    placed = (kw.alibi is not None and kw.alibi is not False) or kw.query_temperature is not None
    rules = MaskRules.check(
        kw.mask, kw.causal, kw.causal_alignment, window, kw.sink_tokens, kw.chunk, kw.mask_mod,
        placed,
    )  # fmt: skip
    arrays = MaskArrays.of(kw.mask, kw.bias, kw.key_lengths, kw.query_lengths)
    drop_p = check_dropout(kw.dropout_p, kw.generator)
    scores = ScoreRules(
        kw.sinks, kw.softcap, kw.alibi, kw.score_mod, kw.score_mod_grad, kw.query_temperature
    )
    rotary = RotaryRules(kw.rope_theta, kw.rotary_dim, kw.rotary_interleaved, kw.rope_scaling)
    norm = QKNormRules(
        kw.qk_norm,
        kw.qk_norm_eps,
        kw.qk_norm_offset,
        flag("qk_layernorm", kw.qk_layernorm),
        flag("qk_norm_after_rope", kw.qk_norm_after_rope),
    )
    zero = flag("add_zero_attn", kw.add_zero_attn)
    left = check_padding_side(kw.padding_side, kw.cache, arrays)
    gate = check_gate_activation(kw.output_gate)
    output_norm = check_output_norm(kw.output_norm, kw.output_norm_eps)
    spec = AttentionSpec(rules, scores, kw.scale, drop_p, kw.num_kv_heads, rotary, norm, zero,
                         output_gate=gate, clip_qkv=check_clip_qkv(kw.clip_qkv),
                         v_norm=check_v_norm(kw.v_norm),
                         output_norm=output_norm)  # fmt: skip
    given = CallInputs(arrays, kw.positions, kw.cache, left, kw.generator)
    return Checked(spec, given, request)


_KEEPABLE = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        str,
        np.bool_,
        np.int64,
        np.float64,
        np.float32,
        types.FunctionType,
        CacheKind,
    }
)
"""The types of the values a kept record may hold: small and stateless (an array, a cache
or a generator is the call's own, never kept alive here)."""


def _kept(check: Any, record: tuple[Any, ...]) -> Any:
    """``check(record)``, kept for a record of plain values (keyed by them and their exact
    types, so that ``5`` and ``5.0``, ``1`` and ``True`` stay apart); a record holding an
    array, a cache or a generator is checked afresh."""
    kinds = tuple(map(type, record))
    if not _KEEPABLE.issuperset(kinds):
        return check(record)
    key = (check, record, kinds)
    kept = runtime.DEFAULT.records  # at most 256: when full, keeping starts over
    found = kept.get(key)
    if found is None:
        found = check(record)._replace(kept=True)  # (a refused record raises: not kept)
        kept.keep(key, found)
    return found


def kernel_options(max_memory: Any, workers: Any) -> tuple[int, int | None]:
    """Check the kernel's keywords: ``(max_memory, workers)``."""
    budget = DEFAULT_MAX_MEMORY if max_memory is None else positive_int("max_memory", max_memory)
    return budget, None if workers is None else positive_int("workers", workers)


def check_dropout(p: Any, generator: Any) -> float:
    """``dropout_p`` checked with ``generator``: required with dropout, refused when no
    dropout was asked for at all (``dropout_p`` left out). ``dropout_p=0.0`` with a
    generator is accepted (``p if training else 0.0`` with one generator)."""
    if p is None:
        if generator is not None:
            raise AttentionValueError(
                "generator= is for dropout, but no dropout_p= was given: give dropout_p= "
                "too (0.0 turns dropout off), or leave the generator out"
            )
        return 0.0
    real = isinstance(p, (int, float, np.integer, np.floating)) and not isinstance(
        p, (bool, np.bool_)
    )
    if not real or not 0.0 <= float(p) < 1.0:
        raise AttentionValueError(f"dropout_p must be a number in [0, 1); got {p!r}")
    if float(p) == 0.0:
        if generator is not None and not isinstance(generator, np.random.Generator):
            raise AttentionTypeError(f"generator must be a np.random.Generator; got {generator!r}")
        return 0.0
    if not isinstance(generator, np.random.Generator):
        raise AttentionTypeError(
            f"dropout_p={p} needs generator=, a np.random.Generator (for example "
            f"np.random.default_rng(0)), so that runs can be repeated; got {generator!r}"
        )
    return float(p)
