"""Rope scaling: the inverse frequencies and attention scaling of rotary embeddings stretched
past their training length, for the rope types of transformers' ``ROPE_INIT_FUNCTIONS``.

Each type changes the frequencies ``theta^(-2i/r)`` of the ``r/2`` rotated pairs:

* ``linear`` (position interpolation): all divided by ``factor``;
* ``dynamic`` (NTK-aware): the base grows with the sequence past ``max_position_embeddings``;
* ``llama3``: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between;
* ``yarn``: a ramp over the pairs from kept (fast) to divided by ``factor`` (slow), and the
  cosines and sines multiplied by an attention factor (``0.1 ln(factor) + 1`` by default);
* ``longrope`` (Phi-3): each pair divided by its own ``short_factor``, or ``long_factor``
  past ``original_max_position_embeddings``, with an attention factor;
* ``proportional``: the first ``partial_rotary_factor`` of the pairs rotate, the others keep
  frequency 0, all divided by ``factor``.

The parameters come as transformers' ``rope_parameters`` dict plus the model's
``max_position_embeddings``; the frequencies are computed in float64, as our own NumPy code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ..errors import AttentionTypeError, AttentionValueError

__all__ = [
    "ROPE_TYPES",
    "RopeScaling",
    "check_base",
    "check_rope_scaling",
    "default_frequencies",
]

_OMPE = "original_max_position_embeddings"
# The keys each type takes besides rope_type (or its old spelling type), rope_theta (the base
# is given apart), partial_rotary_factor and max_position_embeddings, which all types take.
_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", _OMPE),
    "yarn": (
        "factor",
        _OMPE,
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "longrope": ("short_factor", "long_factor", _OMPE, "factor", "attention_factor"),
    "proportional": ("factor",),
}
_EVERY_TYPE = (
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "max_position_embeddings",
)
ROPE_TYPES = tuple(_KEYS)


@dataclass(frozen=True)
class RopeScaling:
    """A checked rope scaling for ``rotary_dim`` rotated features (made by
    :func:`check_rope_scaling`; ``attention_factor`` holds the resolved value).

    Only ``dynamic`` and ``longrope`` depend on the sequence length, which is
    ``max(positions) + 1`` as in transformers' ``dynamic_rope_update``. transformers' dynamic
    rotary module keeps state: it grows its frequencies to the longest sequence seen so far and
    goes back to the original ones below ``max_position_embeddings``. mha has no state, so the
    one case where the two differ is a sequence of at least ``max_position_embeddings``
    positions after a longer one: transformers keeps the longer one's frequencies, mha uses
    this sequence's own.

    >>> scaling = check_rope_scaling({"rope_type": "linear", "factor": 4.0}, rotary_dim=4)
    >>> frequencies, attention = scaling.frequencies(theta=100.0, seq_len=8)
    >>> frequencies, attention
    (array([0.25 , 0.025]), 1.0)
    """

    rope_type: str
    rotary_dim: int
    factor: float = 1.0
    attention_factor: float = 1.0
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    partial_rotary_factor: float | None = None

    def __post_init__(self) -> None:  # what the frequencies need, when made directly
        if self.rope_type not in _KEYS:
            raise AttentionValueError(
                f"RopeScaling: rope_type {self.rope_type!r} is not supported: use one of "
                f"{', '.join(ROPE_TYPES)}"
            )
        needs = {
            "dynamic": ("max_position_embeddings",),
            "llama3": (_OMPE,),
            "yarn": (_OMPE,),
            "longrope": (_OMPE, "short_factor", "long_factor"),
        }
        for key in needs.get(self.rope_type, ()):
            value = getattr(self, key)
            if value is None or (isinstance(value, tuple) and len(value) != self.rotary_dim // 2):
                raise AttentionValueError(
                    f"RopeScaling({self.rope_type!r}) needs {key} (of rotary_dim/2 numbers for "
                    f"the factors): make it with check_rope_scaling"
                )

    def frequencies(self, theta: float, seq_len: float) -> tuple[np.ndarray, float]:
        """The inverse frequencies ``(rotary_dim/2,)`` in float64 for base ``theta``, and the
        attention scaling that multiplies the cosines and sines, for a call whose largest
        position is ``seq_len - 1``."""
        if not _is_real(theta):
            raise AttentionTypeError(f"theta must be a positive number; got {theta!r}")
        if not 0 < float(theta) < math.inf:
            raise AttentionValueError(f"theta must be a positive number; got {theta!r}")
        frequencies = _FREQUENCIES[self.rope_type](self, float(theta), float(seq_len))
        return frequencies, self.attention_factor


@functools.lru_cache(maxsize=64)
def default_frequencies(theta: float, r: int) -> np.ndarray:
    """``theta^(-2i/r)`` for the ``r/2`` pairs, in float64 (unscaled rotary embeddings):
    read-only, made once for each ``theta`` and ``r`` (a layer's calls share them)."""
    frequencies: np.ndarray = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    frequencies.flags.writeable = False
    return frequencies


def _default(s: RopeScaling, theta: float, seq_len: float) -> np.ndarray:
    return default_frequencies(theta, s.rotary_dim)


def _linear(s: RopeScaling, theta: float, seq_len: float) -> np.ndarray:
    return default_frequencies(theta, s.rotary_dim) / s.factor


def _dynamic(s: RopeScaling, theta: float, seq_len: float) -> np.ndarray:
    r, trained = s.rotary_dim, s.max_position_embeddings
    assert trained is not None  # check_rope_scaling requires it
    grown = s.factor * max(seq_len, trained) / trained - (s.factor - 1)  # 1 up to `trained`
    return default_frequencies(theta * grown ** (r / (r - 2)), r)


def _llama3(s: RopeScaling, theta: float, seq_len: float) -> np.ndarray:
    frequencies = default_frequencies(theta, s.rotary_dim)
    context = s.original_max_position_embeddings
    assert context is not None
    low, high = s.low_freq_factor, s.high_freq_factor
    wavelengths = 2 * math.pi / frequencies
    # 0 for wavelengths past context/low (divided by factor), 1 below context/high (kept)
    smooth = np.clip((context / wavelengths - low) / (high - low), 0.0, 1.0)
    scaled: np.ndarray = (1 - smooth) * frequencies / s.factor + smooth * frequencies
    return scaled


def _yarn(s: RopeScaling, theta: float, seq_len: float) -> np.ndarray:
    r, context = s.rotary_dim, s.original_max_position_embeddings
    assert context is not None

    def pair_turning(rotations: float) -> float:  # the pair that turns `rotations` times
        return r * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    # 0: the fast pairs below `low` keep their frequency; 1: the slow ones past `high` interpolate
    ramp = np.clip((np.arange(r // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    frequencies = default_frequencies(theta, r)
    return frequencies / s.factor * ramp + frequencies * (1 - ramp)


def _longrope(s: RopeScaling, theta: float, seq_len: float) -> np.ndarray:
    context = s.original_max_position_embeddings
    assert context is not None
    factors = s.long_factor if seq_len > context else s.short_factor
    return default_frequencies(theta, s.rotary_dim) / np.array(factors, dtype=np.float64)


def _proportional(s: RopeScaling, theta: float, seq_len: float) -> np.ndarray:
    r = s.rotary_dim
    proportion = 1.0 if s.partial_rotary_factor is None else s.partial_rotary_factor
    rotated = int(proportion * r // 2)  # pairs that rotate; the others keep frequency 0
    frequencies = np.zeros(r // 2, dtype=np.float64)
    frequencies[:rotated] = default_frequencies(theta, r)[:rotated]
    return frequencies / s.factor


_FREQUENCIES: dict[str, Callable[[RopeScaling, float, float], np.ndarray]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "proportional": _proportional,
}


def check_rope_scaling(
    scaling: Any, rotary_dim: int, subject: str = "rope scaling", name: str = "scaling"
) -> RopeScaling | None:
    """``scaling`` checked for ``rotary_dim`` rotated features: ``None`` (no scaling), a
    :class:`RopeScaling`, or a dict in transformers' ``rope_parameters`` form, such as
    ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}``, with the model's ``max_position_embeddings``
    as one more key: ``dynamic`` needs it, ``yarn`` and ``longrope`` derive ``factor`` from it
    when it is not given, and ``original_max_position_embeddings`` defaults to it (as
    transformers standardises its configs). ``type`` is the old spelling of ``rope_type``; a
    key set to None counts as absent. ``rope_theta`` is ignored (the base is given apart), and
    ``partial_rotary_factor`` is only used by ``proportional`` (:func:`mha.apply_rotary`
    checks it against ``rotary_dim`` for the others). ``subject`` names what the caller gave
    in messages.

    >>> check_rope_scaling({"rope_type": "linear", "factor": 4.0, "ntk": True}, 8)
    Traceback (most recent call last):
    ...
    mha.AttentionValueError: scaling has the key 'ntk', which rope_type 'linear' does not
    take (it takes factor) (rope scaling)
    """
    if scaling is None:
        return None
    if isinstance(scaling, RopeScaling):
        if scaling.rotary_dim != rotary_dim:
            raise AttentionValueError(
                f"{name} was made for rotary_dim={scaling.rotary_dim}, not {rotary_dim} ({subject})"
            )
        return scaling
    if not isinstance(scaling, Mapping):
        raise AttentionTypeError(
            f"{name} must be a dict of rope parameters, a RopeScaling or None; got "
            f"{type(scaling).__name__} ({subject})"
        )
    given = _Given(scaling, subject, name)
    kind = given.kind
    trained = given.integer("max_position_embeddings")
    settings: dict[str, Any] = {
        "max_position_embeddings": trained,
        "partial_rotary_factor": given.number("partial_rotary_factor", above=0.0, most=1.0),
    }
    if kind in ("linear", "dynamic", "llama3", "proportional"):
        settings["factor"] = given.number("factor", at_least=1.0, required=kind != "proportional")
    if kind == "dynamic":
        if trained is None:
            given.missing("max_position_embeddings")
        if rotary_dim == 2:
            raise AttentionValueError(
                f"rope_type 'dynamic' needs rotary_dim > 2 (its base grows by a power "
                f"r/(r - 2)); got rotary_dim=2 ({subject})"
            )
    context = 0
    if kind in ("llama3", "yarn", "longrope"):
        original = given.integer(_OMPE, default=trained)
        if original is None:
            given.missing(_OMPE, "or 'max_position_embeddings', its default")
        settings[_OMPE] = context = original
    if kind == "llama3":
        low = given.number("low_freq_factor", above=0.0, required=True)
        high = given.number("high_freq_factor", above=0.0, required=True)
        if not high > low:
            raise AttentionValueError(
                f"{name}['high_freq_factor'] must be greater than {name}['low_freq_factor']; "
                f"got {high} and {low} ({subject})"
            )
        settings |= {"low_freq_factor": low, "high_freq_factor": high}
    elif kind == "yarn":
        settings |= _yarn_settings(given, trained, context)
    elif kind == "longrope":
        settings |= _longrope_settings(given, rotary_dim, trained, context)
    return RopeScaling(kind, rotary_dim, **{k: v for k, v in settings.items() if v is not None})


def _yarn_settings(given: _Given, trained: int | None, context: int) -> dict[str, Any]:
    factor = given.number("factor", at_least=1.0)
    if factor is None:  # transformers: the ratio of the extended context to the original
        if trained is None:
            given.missing("factor", "or 'max_position_embeddings', to derive it")
        factor = trained / context
    fast = given.number("beta_fast", above=0.0, default=32.0)
    slow = given.number("beta_slow", above=0.0, default=1.0)
    if fast < slow:
        raise AttentionValueError(
            f"{given.name}['beta_fast'] must be at least {given.name}['beta_slow']; got {fast} and "
            f"{slow} ({given.subject})"
        )
    truncate = given.values.get("truncate", True)
    if not isinstance(truncate, (bool, np.bool_)):
        raise AttentionTypeError(
            f"{given.name}['truncate'] must be True or False; got {truncate!r} ({given.subject})"
        )
    mscale = given.number("mscale", at_least=0.0)
    mscale_all_dim = given.number("mscale_all_dim", at_least=0.0)
    attention = given.number("attention_factor", above=0.0)
    if attention is None:

        def magnitude(weight: float) -> float:  # YaRN's sqrt(1/t) = 0.1 ln(s) + 1
            return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

        if mscale and mscale_all_dim:  # as transformers: both given (and not 0), or neither used
            attention = magnitude(mscale) / magnitude(mscale_all_dim)
        else:
            attention = magnitude(1.0)
    return {
        "factor": factor,
        "attention_factor": attention,
        "beta_fast": fast,
        "beta_slow": slow,
        "truncate": bool(truncate),
    }


def _longrope_settings(
    given: _Given, rotary_dim: int, trained: int | None, context: int
) -> dict[str, Any]:
    factors = {key: given.factors(key, rotary_dim // 2) for key in ("short_factor", "long_factor")}
    factor = given.number("factor", at_least=1.0)
    attention = given.number("attention_factor", above=0.0)
    if attention is None:
        if factor is None:  # transformers: the ratio of the extended context to the original
            if trained is None:
                given.missing("factor", "or 'attention_factor', or 'max_position_embeddings'")
            factor = trained / context
        # LongRoPE's sqrt(1 + ln(s) / ln(L_train))
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(context))
    return {"factor": factor, "attention_factor": attention, **factors}


class _Given:
    """The caller's dict for one rope type, each key checked as it is read (messages name
    the key). A key set to None counts as absent."""

    def __init__(self, scaling: Mapping[Any, Any], subject: str, name: str) -> None:
        self.subject, self.name = subject, name
        for key in scaling:
            if not isinstance(key, str):
                raise AttentionTypeError(f"{name}'s keys must be strings; got {key!r} ({subject})")
        self.values = {key: value for key, value in scaling.items() if value is not None}
        kind, old = self.values.get("rope_type"), self.values.get("type")
        if kind is not None and old is not None and kind != old:
            raise AttentionValueError(
                f"{name}['rope_type'] {kind!r} and {name}['type'] {old!r} (its old spelling) "
                f"disagree: give one ({subject})"
            )
        kind = kind if kind is not None else old if old is not None else "default"
        if kind not in _KEYS:
            raise AttentionValueError(
                f"{self.name}['rope_type'] {kind!r} is not supported: use one of "
                f"{', '.join(ROPE_TYPES)} ({subject})"
            )
        self.kind = str(kind)
        for key in self.values:
            if key not in _KEYS[self.kind] and key not in _EVERY_TYPE:
                takes = ", ".join(_KEYS[self.kind]) or "no key of its own"
                raise AttentionValueError(
                    f"{self.name} has the key {key!r}, which rope_type {self.kind!r} does not take "
                    f"(it takes {takes}) ({subject})"
                )

    def missing(self, key: str, alternative: str = "") -> NoReturn:
        alternative = f" ({alternative})" if alternative else ""
        raise AttentionValueError(
            f"{self.name} needs the key {key!r}{alternative} for rope_type {self.kind!r} "
            f"({self.subject})"
        )

    def number(
        self,
        key: str,
        *,
        above: float | None = None,
        at_least: float | None = None,
        most: float | None = None,
        default: float | None = None,
        required: bool = False,
    ) -> Any:
        """The key's value as a float (``default`` when it is absent)."""
        if key not in self.values:
            if required:
                self.missing(key)
            return default
        value = self.values[key]
        bounds = [
            f"> {above}" if above is not None else "",
            f">= {at_least}" if at_least is not None else "",
            f"<= {most}" if most is not None else "",
        ]
        wanted = " ".join(["a number", " and ".join(bound for bound in bounds if bound)]).strip()
        if not _is_real(value):
            raise AttentionTypeError(
                f"{self.name}[{key!r}] must be {wanted}; got {value!r} ({self.subject})"
            )
        number = float(value)
        if not (
            math.isfinite(number)
            and (above is None or number > above)
            and (at_least is None or number >= at_least)
            and (most is None or number <= most)
        ):
            raise AttentionValueError(
                f"{self.name}[{key!r}] must be {wanted} for rope_type {self.kind!r}; got {value!r} "
                f"({self.subject})"
            )
        return number

    def integer(self, key: str, default: int | None = None) -> int | None:
        if key not in self.values:
            return default
        value = self.values[key]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise AttentionTypeError(
                f"{self.name}[{key!r}] must be a positive integer; got {value!r} ({self.subject})"
            )
        if value <= 0:
            raise AttentionValueError(
                f"{self.name}[{key!r}] must be a positive integer; got {value} ({self.subject})"
            )
        return int(value)

    def factors(self, key: str, n: int) -> tuple[float, ...]:
        """A list of ``n`` positive numbers (one per rotated pair)."""
        if key not in self.values:
            self.missing(key)
        value = self.values[key]
        wanted = f"a list of rotary_dim/2 = {n} positive numbers"
        if isinstance(value, np.ndarray) and value.ndim == 1:
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or not all(_is_real(f) for f in value):
            raise AttentionTypeError(
                f"{self.name}[{key!r}] must be {wanted}; got {value!r:.60} ({self.subject})"
            )
        if len(value) != n:
            raise AttentionValueError(
                f"{self.name}[{key!r}] must be {wanted}; got {len(value)} numbers ({self.subject})"
            )
        if not all(0 < float(f) < math.inf for f in value):
            raise AttentionValueError(
                f"{self.name}[{key!r}] must be {wanted}; got one <= 0 or not finite "
                f"({self.subject})"
            )
        return tuple(float(f) for f in value)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def check_base(rope: RopeScaling | None, theta: float, names: tuple[str, str]) -> None:
    """Refuse a base that ``rope``'s type cannot take: yarn's correction divides by
    ``log(theta)``, so it needs ``theta > 1``. ``names`` are the caller's names of the base
    and the scaling."""
    if rope is not None and rope.rope_type == "yarn" and theta <= 1.0:
        raise AttentionValueError(
            f"{names[1]} of rope_type 'yarn' needs {names[0]} above 1 (its correction "
            f"divides by log({names[0]})); got {names[0]}={theta}"
        )
