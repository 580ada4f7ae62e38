"""One call of the public API, run and classified.

Every call the fuzzer makes is a :class:`Call`: the function, its arguments, what the
documented contract says of it (it must compute, it must be refused naming one of some
arguments, or either) and how to check a result. :func:`classify` runs it and sorts the
outcome into

* **result**: the call returned; ``check`` found the shapes and dtypes the docs give,
  finite values where the inputs are finite and (where a reference applies) the dense
  reference's numbers, and no input changed;
* **refusal**: an :class:`mha.AttentionError` (or a documented refusal type) whose message
  names one of the arguments the call got wrong, with every input, cache, module and
  generator as it was;
* **failure**: anything else: another exception (a raw NumPy, numba or Python error), a
  warning, an input changed, a cache or module changed by a refused call, a valid call
  refused, an invalid one accepted, a result off the reference.

:func:`run` also counts the outcome (:mod:`.tally`) and raises :class:`FuzzAssertionError` on a
failure, with a reproducer, so that hypothesis shrinks it and pytest reports it.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import mha

from . import tally


class MismatchError(Exception):
    """Raised by a result's check: the result is not what the contract says."""


class UserCallbackError(Exception):
    """Raised on purpose by one of the fuzzer's own ``mask_mod`` or ``score_mod`` functions:
    mha must let it through unchanged, with every cache as it was."""


class FuzzAssertionError(AssertionError):
    """A failure outcome: the message says what happened and how to reproduce it."""


@dataclass
class Call:
    """A call of ``function(*args, **kwargs)`` and what the contract says of it.

    ``refuse`` is ``None`` when the call must compute, else the argument names one of which
    a refusal's message must contain; ``may_refuse`` makes both outcomes documented (a full
    pool, say), a refusal still naming one of ``refuse``. ``check(result)`` raises
    :class:`MismatchError` when the result is wrong and returns its error against the reference
    as a fraction of the tolerance (``None`` when no reference applies). ``changes`` are the
    arguments a result may change (a cache appended to, a generator drawn from): every other
    argument must keep its bits, and after a refusal every one. ``refusals`` are the
    exception types that count as a refusal."""

    entry: str
    function: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    refuse: frozenset[str] | None = None
    may_refuse: bool = False
    check: Callable[[Any], float | None] | None = None
    changes: tuple[Any, ...] = ()
    refusals: tuple[type[BaseException], ...] = (mha.AttentionError,)
    note: str = ""  # what was drawn that the arguments do not show (a layout, say)


@dataclass
class Outcome:
    kind: str  # "result", "refusal" or "failure"
    detail: str = ""
    error: float | None = None  # against the reference, as a fraction of the tolerance
    value: Any = None  # the result, or the exception


def run(call: Call) -> Outcome:
    """:func:`classify` ``call``, count its outcome, and raise :class:`FuzzAssertionError` on a
    failure."""
    outcome = classify(call)
    tally.record(call.entry, outcome.kind, outcome.error)
    if outcome.kind == "failure":
        raise FuzzAssertionError(f"{call.entry}: {outcome.detail}\n{reproducer(call)}")
    return outcome


def classify(call: Call) -> Outcome:
    """Run ``call`` and say which outcome it had (nothing is counted or raised here)."""
    inputs = [*call.args, *call.kwargs.values()]
    before = [state_of(x) for x in inputs]
    raised: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, from any thread, is recorded
        try:
            result = call.function(*call.args, **call.kwargs)
        except Exception as error:
            raised, result = error, None
    if caught:
        shown = "; ".join(f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
                          for w in caught[:3])  # fmt: skip
        return Outcome("failure", f"a warning escaped: {shown}", value=raised)
    refused = raised is not None
    # A failing callback of the caller's own may leave a generator drawn from (nothing says
    # otherwise); mha's refusals leave every argument as it was, caches after either.
    free = call.changes if not refused else tuple(
        x for x in call.changes if isinstance(raised, UserCallbackError)
        and isinstance(x, np.random.Generator))  # fmt: skip
    changed = [
        _label(call, n)
        for n, (x, state) in enumerate(zip(inputs, before, strict=True))
        if not any(x is c for c in free) and state_of(x) != state
    ]
    if raised is not None and not isinstance(raised, call.refusals):
        trace = "".join(traceback.format_exception(raised)[-6:])
        return Outcome("failure", f"raised {type(raised).__name__} outside mha's errors:\n"
                                  f"{trace}", value=raised)  # fmt: skip
    if changed:
        what = "a refused call changed" if refused else "the call changed its input"
        return Outcome("failure", f"{what} {', '.join(changed)}", value=raised)
    if raised is not None:
        return _refusal(call, raised)
    if call.refuse is not None and not call.may_refuse:
        return Outcome("failure", f"accepted what the contract refuses ({_names(call.refuse)})",
                       value=result)  # fmt: skip
    try:
        error = None if call.check is None else call.check(result)
    except MismatchError as mismatch:
        return Outcome("failure", f"wrong result: {mismatch}", value=result)
    return Outcome("result", error=error, value=result)


def _refusal(call: Call, error: BaseException) -> Outcome:
    message = str(error)
    if isinstance(error, UserCallbackError):
        return Outcome("refusal", message, value=error)
    if call.refuse is None:
        return Outcome("failure", f"refused a valid call: {type(error).__name__}: {message}",
                       value=error)  # fmt: skip
    if isinstance(error, mha.PoolExhaustedError) or names_any(message, call.refuse):
        return Outcome("refusal", message, value=error)
    return Outcome(
        "failure",
        f"the refusal names none of {_names(call.refuse)}: {type(error).__name__}: {message}",
        value=error,
    )


def names_any(message: str, names: frozenset[str]) -> bool:
    """Whether ``message`` names one of ``names`` as a word (``mask``, not ``mask_mod``)."""
    return any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message) for name in names)


def _names(names: frozenset[str]) -> str:
    return ", ".join(sorted(names))


def _label(call: Call, n: int) -> str:
    if n < len(call.args):
        return f"argument {n}"
    return list(call.kwargs)[n - len(call.args)]


# ------------------------------------------------------------------------- snapshots


def state_of(x: Any) -> Any:
    """What ``x`` holds, comparable with ``==``: an array's dtype, shape, flags and bits, a
    list's items, a generator's state, a cache's or a module's public state. ``None`` for
    what a call cannot change (numbers, strings, functions)."""
    if isinstance(x, np.ndarray):
        return ("array", x.dtype, x.shape, x.flags.writeable, np.ascontiguousarray(x).tobytes())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [state_of(item) for item in x])
    if isinstance(x, dict):
        return ("dict", [(repr(key), state_of(value)) for key, value in x.items()])
    if isinstance(x, np.random.Generator):
        return ("generator", repr(x.bit_generator.state))
    if isinstance(x, mha.KVCache):  # what the docs say it holds (slots past a length: nothing)
        held = [state_of([held_slots(x.k, x, b), held_slots(x.v, x, b)])
                for b in range(x.batch_size)]  # fmt: skip
        return ("KVCache", state_of(x.lengths), state_of(x.first), held)
    if isinstance(x, mha.PagedKVCache):  # every sequence as it reads (free blocks: nothing)
        held = [state_of(list(x.dequantized(s))) for s in x.sequences]
        return ("PagedKVCache", x.sequences, state_of(x.lengths), x.num_free_blocks,
                state_of(x.block_table()), held)  # fmt: skip
    if isinstance(x, mha.MultiHeadAttention):
        return ("module", repr(x), [(k, state_of(v)) for k, v in sorted(vars(x).items())])
    return None


def held_slots(buffer: np.ndarray, cache: Any, b: int) -> np.ndarray:
    """The slots of ``buffer`` (``cache.k`` or ``cache.v``) holding sequence ``b``'s
    positions (:func:`held_positions`), in order."""
    slots, _ = held_positions(cache, b)
    return buffer[b][:, slots]


def held_positions(cache: Any, b: int) -> tuple[list[int], list[int]]:
    """Which slots of a ``KVCache`` hold sequence ``b``'s positions, and which positions:
    the sink tokens' slots, then positions ``first[b]`` to ``lengths[b] - 1`` (the ``k``
    property's docstring)."""
    n, length, first = cache.sink_tokens, int(cache.lengths[b]), int(cache.first[b])
    sinks = min(length, n)
    later = list(range(max(first, n), length)) if length > n else []
    return list(range(sinks)) + list(range(n, n + len(later))), list(range(sinks)) + later


# ------------------------------------------------------------------------ checks


def expect_array(name: str, x: Any, shape: tuple[int, ...], dtype: Any, finite: bool) -> None:
    """``x`` must be an array of ``shape`` and ``dtype``, finite when ``finite``."""
    if not isinstance(x, np.ndarray):
        raise MismatchError(f"{name} is a {type(x).__name__}, not an array")
    if x.shape != tuple(shape) or x.dtype != np.dtype(dtype):
        raise MismatchError(
            f"{name} is {x.dtype} {x.shape}; the contract gives {np.dtype(dtype)} {tuple(shape)}"
        )
    if finite and not np.isfinite(x.astype(np.float64)).all():
        raise MismatchError(f"{name} is not finite where the inputs are: {x!r}")


def expect_close(name: str, actual: Any, expected: np.ndarray, tolerance: float,
                 scale: float | None = None) -> float:  # fmt: skip
    """The error of ``actual`` against ``expected``, ``max |a - e| / max(max |e|, 1)`` (or
    over ``scale``, what rounding errors scale with), as a fraction of ``tolerance``;
    :class:`MismatchError` past it. ``-inf`` entries (rows that see no key) must be ``-inf`` on
    both sides."""
    ours = np.asarray(actual, dtype=np.float64)
    ninf = np.isneginf(expected)
    if not np.array_equal(np.isneginf(ours), ninf):
        where = np.argwhere(np.isneginf(ours) != ninf)[:3].tolist()
        raise MismatchError(f"{name}: -inf where the reference has a number, or not, at {where}")
    if not ninf.all():
        if scale is None:
            scale = max(float(np.max(np.abs(expected[~ninf]))), 1.0)
        error = float(np.max(np.abs(ours[~ninf] - expected[~ninf]))) / max(scale, 1e-300)
    else:
        error = 0.0
    if not error <= tolerance:
        raise MismatchError(
            f"{name} is off the reference by {error:.3e} (tolerance {tolerance:.1e})"
        )
    return error / tolerance


# ---------------------------------------------------------------------- reproducers


def reproducer(call: Call) -> str:
    """Python that makes the call again (arrays written out when small; their layout in
    ``call.note``)."""
    args = [_literal(x) for x in call.args]
    args += [f"{name}={_literal(x)}" for name, x in call.kwargs.items()]
    name = getattr(call.function, "__qualname__", repr(call.function))
    lines = [f"# {call.note}" if call.note else "", f"{name}(", *(f"    {a}," for a in args), ")"]
    return "\n".join(line for line in lines if line)


def _literal(x: Any) -> str:
    if isinstance(x, np.ndarray):
        flags = "" if x.flags.writeable else ", read-only"
        if x.size <= 64 and x.dtype.kind in "biuf":
            return f"np.array({x.tolist()!r}, dtype=np.{x.dtype.name}).reshape({x.shape})"
        return f"<array {x.dtype} {x.shape}, strides {x.strides}{flags}>"
    if isinstance(x, (list, tuple)) and len(repr(x)) > 400:
        return f"<{type(x).__name__} of {len(x)}>"
    if callable(x) and not isinstance(x, type):
        return f"<function {getattr(x, '__doc__', None) or getattr(x, '__name__', x)!s}>"
    return repr(x)
