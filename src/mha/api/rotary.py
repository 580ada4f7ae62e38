"""Rotary position embeddings (Su et al., 2021), as Llama, Qwen, GPT-NeoX and GPT-J apply them.

Each pair of features ``(x_a, x_b)`` of a head is rotated by the angle ``p * theta^(-2i/r)``
for position ``p`` and pair ``i`` of the ``r = rotary_dim`` rotated features. Which features
pair up is the convention: transformers' ``rotate_half`` pairs feature ``i`` with ``i + r/2``
(Llama, Qwen, GPT-NeoX); GPT-J's ``rotate_every_two`` (``interleaved=True``) pairs ``2i``
with ``2i + 1``. Features past ``rotary_dim`` pass through unchanged. Angles are computed in
float64 and their cosines and sines cast to the data's dtype. ``scaling`` stretches the
frequencies past the training length as transformers' rope types do (:mod:`.rope_scaling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .._arrays import as_array, as_float_array, flag, positive_int, result_and_compute_dtypes
from .._kernel import runtime
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .rope_scaling import RopeScaling, check_base, check_rope_scaling, default_frequencies

__all__ = [
    "apply_rotary",
    "check_positions",
    "check_rotary",
    "check_rotary_options",
    "positive_real",
]


def apply_rotary(
    x: Any,
    positions: Any,
    *,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: Mapping[str, Any] | RopeScaling | None = None,
    inverse: bool = False,
    seq_len: float | None = None,
    cos: Any = None,
    sin: Any = None,
) -> np.ndarray:
    """``x (..., L, d)`` rotated at ``positions``: a new array, ``x`` is not modified.

    * ``positions``: ``(L,)`` for every sequence, or ``(B, L)`` with ``x`` of shape
      ``(B, ..., L, d)``: one row per sequence, lined up with ``x``'s first axis (so with
      ``x (B, H, L, d)`` every head of sequence ``b`` uses ``positions[b]``, as in
      transformers). Integers or real numbers.
    * ``theta``: the base of the frequencies (``rope_theta``; 10000 by default).
    * ``rotary_dim``: how many leading features of each head are rotated (even, at most
      ``d``; default all), as GPT-NeoX's and GPT-J's partial rotary.
    * ``interleaved``: pair features ``(2i, 2i + 1)`` (GPT-J) instead of ``(i, i + r/2)``.
    * ``scaling``: rope scaling, as a dict in transformers' ``rope_parameters`` form
      (``{"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}``,
      plus the model's ``max_position_embeddings`` where the type needs it) or a
      :class:`~mha.api.rope_scaling.RopeScaling`; see
      :func:`~mha.api.rope_scaling.check_rope_scaling`. The cosines and sines are multiplied
      by its attention scaling (yarn's and longrope's).
    * ``seq_len``: the sequence length that picks the ``dynamic`` and ``longrope``
      frequencies; by default ``max(positions) + 1`` over all the positions given, as
      transformers does per forward call. Give the whole call's when rotating it in parts.
    * ``inverse``: apply the transpose of the rotation instead (the angle negated, the same
      frequencies and attention scaling): the backward pass of the forward one.
    * ``cos``, ``sin``: the cosines and sines given as tables ``(P, r/2)`` of positions
      ``0..P-1`` (FlashAttention's ``rotary_cos``/``rotary_sin``, an engine's own cache of
      them) instead of computed from ``theta`` and ``scaling``: position ``p`` turns pair
      ``i`` by ``cos[p, i]``, ``sin[p, i]``, the first ``r = 2 * (r/2)`` features rotated
      (``rotary_dim``, if given, must say the same); ``positions`` are then integers below
      ``P``, and ``theta``, ``scaling`` and ``seq_len`` are left out.

    >>> import numpy as np
    >>> x = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])   # (L=2, d=4)
    >>> apply_rotary(x, [0, 1], theta=1.0).round(3)     # position 1 turns pair 0 by 1 rad
    array([[1.   , 0.   , 0.   , 0.   ],
           [0.54 , 0.   , 0.841, 0.   ]])
    >>> linear = {"rope_type": "linear", "factor": 2.0}        # positions interpolated: 1 -> 0.5
    >>> apply_rotary(x, [0, 1], theta=1.0, scaling=linear).round(3)
    array([[1.   , 0.   , 0.   , 0.   ],
           [0.878, 0.   , 0.479, 0.   ]])
    >>> y = apply_rotary(x, [0, 1], theta=1.0, scaling=linear)
    >>> np.allclose(apply_rotary(y, [0, 1], theta=1.0, scaling=linear, inverse=True), x)
    True
    """
    array = as_float_array("x", x)
    result_dtype, dtype = result_and_compute_dtypes(array)
    if cos is not None or sin is not None:
        if theta != 10000.0 or scaling is not None or seq_len is not None:
            raise AttentionValueError(
                "cos= and sin= are the rotation's tables: theta, scaling and seq_len compute "
                "them instead; give one or the other"
            )
        turn = table_rotation(
            array.shape, positions, dtype, cos, sin, rotary_dim=rotary_dim,
            interleaved=interleaved, inverse=inverse,
        )  # fmt: skip
        return rotate(array, turn).astype(result_dtype, copy=False)
    turn = rotation(
        array.shape, positions, dtype, theta=theta, rotary_dim=rotary_dim,
        interleaved=interleaved, scaling=scaling, inverse=inverse, seq_len=seq_len,
    )  # fmt: skip
    return rotate(array, turn).astype(result_dtype, copy=False)


class Rotation(NamedTuple):
    """The rotation of :func:`apply_rotary` for one shape and its positions: the rotated
    width, whether pairs interleave, and the cosines and sines ``(..., L, r/2)`` in the
    compute dtype (the attention scaling, and the inverse's sign, in them)."""

    r: int
    interleaved: bool
    cos: np.ndarray
    sin: np.ndarray
    whole: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """For a rotation of whole rows (``r`` the width): ``x``'s features in the order each
    is rotated with (its pair's other half), and the cosines and sines ``(..., L, r)`` at
    every feature, the sines negative where :func:`rotate` subtracts: ``x * cos +
    x[..., order] * sin``, the same products and sums, the same bits, in four passes."""


def rotation(
    shape: tuple[int, ...],
    positions: Any,
    dtype: Any,
    *,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: Mapping[str, Any] | RopeScaling | None = None,
    inverse: bool = False,
    seq_len: float | None = None,
) -> Rotation:
    """:func:`apply_rotary`'s checks and angles for an ``x`` of ``shape`` computing in
    ``dtype`` (its keywords), made once for every array of that shape at those positions
    (a layer's queries and keys at the cache's positions: :func:`rotate` each). A rotation
    at an array of integer positions without scaling is kept, read-only: of up to
    :data:`FEW` positions in ``runtime.DEFAULT.rotations`` (the last 16), of up to
    :data:`LONG` in ``runtime.DEFAULT.long_rotation`` (the last one). A decoding step's
    every layer rotates at the same positions, and so does a prompt's pass: the first
    layer's angles serve the rest (a 512-token pass of SmolLM2 took its cosines and sines
    30 times, 10 ms), and for up to :data:`WHOLE` positions their whole rows
    (:attr:`Rotation.whole`; 9 heads of 64 features in float32 at 1 position: 11 us
    against 16 by halves, at 16: 15.7 against 16.3, at 37: 49 against 42, at 512: 1.15 ms
    against 0.36, its gather of the pairs' other halves slow)."""
    key = _rotation_key(shape, positions, dtype, theta, rotary_dim, interleaved, inverse)
    kept_in = None
    if key is not None and scaling is None and seq_len is None:
        few = positions is None or positions.size <= FEW
        kept_in = runtime.DEFAULT.rotations if few else runtime.DEFAULT.long_rotation
        kept: Rotation | None = kept_in.get(key)
        if kept is not None:
            return kept
    r, angles, interleaved, attention = check_rotary(
        shape, positions, theta, rotary_dim, interleaved, scaling=scaling, seq_len=seq_len
    )
    cos, sin = np.cos(angles), np.sin(angles)
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    if flag("inverse", inverse):  # the transpose: rotation by minus the angle
        sin = -sin
    turn = Rotation(r, interleaved, cos.astype(dtype), sin.astype(dtype))
    if kept_in is not None:
        whole = r == shape[-1] and (positions is None or positions.size <= WHOLE)
        turn = turn._replace(whole=_whole(turn) if whole else None)
        for table in (turn.cos, turn.sin, *(turn.whole or ())):
            table.flags.writeable = False
        kept_in.keep(key, turn)
    return turn


def table_rotation(
    shape: tuple[int, ...],
    positions: Any,
    dtype: Any,
    cos: Any,
    sin: Any,
    *,
    rotary_dim: Any = None,
    interleaved: Any = False,
    inverse: Any = False,
) -> Rotation:
    """The rotation of an ``x`` of ``shape`` at integer ``positions`` by given tables ``cos``
    and ``sin`` ``(P, r/2)`` (:func:`apply_rotary`'s ``cos=``, ``sin=``), checked."""
    subject = f"x {shape}"
    if len(shape) < 2:
        raise ShapeError(f"x must have shape (..., L, d); got shape {shape}")
    if cos is None or sin is None:
        raise AttentionValueError("cos= and sin= come together: give both tables, or neither")
    tables = [as_float_array(name, t) for name, t in (("cos", cos), ("sin", sin))]
    if tables[0].ndim != 2 or tables[0].shape != tables[1].shape:
        raise ShapeError(
            f"cos and sin must be tables of the same shape (P, r/2); got cos "
            f"{tables[0].shape}, sin {tables[1].shape}"
        )
    if not all(np.isfinite(t).all() for t in tables):
        raise AttentionValueError("cos and sin must be finite tables")
    r = 2 * tables[0].shape[1]
    if r > shape[-1] or (rotary_dim is not None and positive_int("rotary_dim", rotary_dim) != r):
        raise ShapeError(
            f"cos and sin {tables[0].shape} rotate {r} features: at most the head width "
            f"{shape[-1]}, and rotary_dim={rotary_dim} if given ({subject})"
        )
    given = as_array("positions", positions)
    if given.dtype.kind not in "iu":
        raise AttentionTypeError(
            f"positions must be integers with cos= and sin= (rows of the tables); got dtype "
            f"{given.dtype}"
        )
    at = check_positions(given, shape, subject).astype(np.int64)
    if at.size and (at.min() < 0 or at.max() >= len(tables[0])):
        raise AttentionValueError(
            f"positions must lie in [0, {len(tables[0])}), the rows of cos and sin; got "
            f"{int(at.min())}..{int(at.max())} ({subject})"
        )
    cosines, sines = (t[at].astype(dtype) for t in tables)  # (..., L, r/2)
    if flag("inverse", inverse):
        sines = -sines
    return Rotation(r, flag("interleaved", interleaved), cosines, sines)


FEW, LONG, WHOLE = 64, 4096, 16
"""The most positions of a rotation kept among the last 16, of the one long one kept, and
of a kept rotation applied to whole rows."""


def _rotation_key(
    shape: tuple[int, ...], positions: Any, dtype: Any, *options: Any
) -> tuple[Any, ...] | None:
    """What :func:`rotation`'s result depends on, as a key, for positions given as a NumPy
    array of at most :data:`LONG` integers (or none); ``None`` for anything else (kept from
    nothing)."""
    if positions is None:
        held: Any = None
    elif type(positions) is np.ndarray and positions.dtype.kind in "iu" and positions.size <= LONG:
        held = (positions.shape, positions.dtype.str, positions.tobytes())
    else:
        return None
    key = (shape, held, dtype, *((type(o), o) for o in options))  # (1 is not True here)
    try:
        hash(key)
    except TypeError:  # an option the checks will refuse
        return None
    return key


def _whole(turn: Rotation) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:attr:`Rotation.whole` of a rotation of whole rows."""
    r, cos, sin = turn.r, turn.cos, turn.sin
    half = np.arange(r // 2)
    if turn.interleaved:  # pairs (0, 1), (2, 3), ...
        order = np.stack([2 * half + 1, 2 * half], -1).reshape(r)
        cosines = np.stack([cos, cos], -1).reshape((*cos.shape[:-1], r))
        sines = np.stack([-sin, sin], -1).reshape((*sin.shape[:-1], r))
    else:  # pairs (i, i + r/2)
        order = np.concatenate([half + r // 2, half])
        cosines, sines = np.concatenate([cos, cos], -1), np.concatenate([-sin, sin], -1)
    return order, cosines, sines


def rotate(x: np.ndarray, turn: Rotation) -> np.ndarray:
    """``x (..., L, d)`` rotated by ``turn`` (:func:`rotation` of its shape), in the
    rotation's dtype: a new array."""
    r, cos, sin = turn.r, turn.cos, turn.sin
    dtype = cos.dtype
    if turn.whole is not None and x.shape[-1] == r:  # (a kept rotation of whole rows)
        order, cosines, sines = turn.whole
        x = x.astype(dtype, copy=False)
        whole: np.ndarray = x * cosines
        whole += x[..., order] * sines
        return whole
    out = x.astype(dtype, copy=True)
    if turn.interleaved:
        a, b = x[..., 0:r:2].astype(dtype), x[..., 1:r:2].astype(dtype)
        out[..., 0:r:2] = a * cos - b * sin
        out[..., 1:r:2] = b * cos + a * sin
    else:
        a, b = x[..., : r // 2].astype(dtype), x[..., r // 2 : r].astype(dtype)
        out[..., : r // 2] = a * cos - b * sin
        out[..., r // 2 : r] = b * cos + a * sin
    return out


def check_rotary(
    shape: tuple[int, ...],
    positions: Any,
    theta: Any,
    rotary_dim: Any,
    interleaved: Any,
    *,
    scaling: Any = None,
    seq_len: Any = None,
    subject: str | None = None,
) -> tuple[int, np.ndarray, bool, float]:
    """Every check of :func:`apply_rotary` for an ``x`` of ``shape``: the rotated width,
    the angles ``(..., L, r/2)`` in float64, ``interleaved`` and the attention scaling of the
    cosines and sines (shared with :mod:`mha.dask`, which checks before any data exists).
    ``subject`` names what the caller gave in messages (default ``x`` and its shape)."""
    subject = f"x {shape}" if subject is None else subject
    if len(shape) < 2:
        raise ShapeError(f"x must have shape (..., L, d); got shape {shape}")
    d = shape[-1]
    r, base, interleaved = check_rotary_options(d, theta, rotary_dim, interleaved, subject)
    at = check_positions(positions, shape, subject)
    rope = check_rope_scaling(scaling, r, subject)
    if seq_len is not None:
        seq_len = positive_real("seq_len", seq_len)
    if rope is None:
        frequencies, attention = default_frequencies(base, r), 1.0
    else:
        share = rope.partial_rotary_factor
        if share is not None and rope.rope_type != "proportional" and int(d * share) != r:
            raise AttentionValueError(
                f"scaling['partial_rotary_factor'] {share} rotates {int(d * share)} of the "
                f"{d} features, but rotary_dim is {r}: give rotary_dim={int(d * share)} or "
                f"leave partial_rotary_factor out ({subject})"
            )
        check_base(rope, base, ("theta", "scaling"))
        if seq_len is None:  # as transformers' dynamic_rope_update: the largest position + 1
            seq_len = float(at.max()) + 1 if at.size else 0.0
        frequencies, attention = rope.frequencies(base, seq_len)
    return r, at[..., None] * frequencies, interleaved, attention  # angles (..., L, r/2)


def check_rotary_options(
    d: int, theta: Any, rotary_dim: Any, interleaved: Any, subject: str, theta_name: str = "theta"
) -> tuple[int, float, bool]:
    """The rotated width, the base and ``interleaved`` for heads ``d`` wide (``theta_name``:
    what the caller calls the base)."""
    r = d if rotary_dim is None else positive_int("rotary_dim", rotary_dim)
    if rotary_dim is None and d % 2:
        raise AttentionValueError(
            f"the head width {d} is odd, so its features cannot all pair up for rotary "
            f"embeddings; give an even rotary_dim ({subject})"
        )
    if r % 2 or r > d:
        raise AttentionValueError(
            f"rotary_dim must be even and at most the head width {d}; got {r} ({subject})"
        )
    return r, positive_real(theta_name, theta), flag("interleaved", interleaved)


def check_positions(positions: Any, shape: tuple[int, ...], subject: str) -> np.ndarray:
    """``positions`` as float64, shaped to broadcast against ``shape[:-1]``: ``(L,)``, or
    ``(B, L)`` lined up with the first axis of an ``x`` with a batch axis."""
    array = as_array("positions", positions)
    if array.dtype.kind not in "iuf" or array.dtype.kind == "b":
        raise AttentionTypeError(
            f"positions must hold integers or real numbers; got dtype {array.dtype}"
        )
    L = shape[-2]
    if array.ndim == 1 and array.shape == (L,):
        return array.astype(np.float64)
    if array.ndim == 2 and len(shape) >= 3 and array.shape == (shape[0], L):
        return array.astype(np.float64).reshape(shape[0], *(1,) * (len(shape) - 3), L)
    expected = f"(L,) = ({L},)"
    if len(shape) >= 3:
        expected += f" or (B, L) = ({shape[0]}, {L}) lined up with the batch"
    raise ShapeError(f"positions must have shape {expected}; got shape {array.shape} ({subject})")


def positive_real(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise AttentionTypeError(f"{name} must be a positive number; got {value!r}")
    number = float(value)
    if not number > 0 or not np.isfinite(number):
        raise AttentionValueError(f"{name} must be a positive number; got {value!r}")
    return number
