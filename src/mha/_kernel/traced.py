"""A ``score_mod`` traced into one compiled pass over a tile, as FlexAttention compiles its
own (with numba, the ``fast`` extra).

A score function written with NumPy (``s + slopes[h] * (kv - q).astype(np.float32)``) makes
a few passes over each tile, each through memory: ALiBi written so cost 1.6-1.8 times the
built-in, most of it the function's own passes. :func:`traced` calls the function once per
tile with stand-ins for the score and the two positions (:class:`Node`), and the sequence
and head indices as they are (so ``slopes[h]`` is a small array of the tile's heads). Each
NumPy operation on a stand-in is recorded with the dtypes NumPy's own rules give it
(``ufunc.resolve_dtypes``), and the record becomes one loop over the tile's pairs, compiled
once per shape of the record and the types of its constants (their values, arrays and
scalars, are the loop's arguments: an array changed between calls is read as it is, a new
value compiles nothing).

It takes what the loop's Python computes as NumPy does, each operand cast to the dtype
NumPy's loop computes in: ``+ - * /``, negation, ``abs``, ``tanh`` (the walks' own, within
4 ulp of NumPy's), ``exp``, ``log``, ``sqrt``, ``sin``, ``cos`` and integer ``//`` and ``%``
of numbers; comparisons of numbers; ``& | ~`` and ``np.logical_*`` of booleans;
``np.where`` of a boolean between numbers; ``astype`` to float32, float64 or (of integers)
int64; constants that are booleans, Python floats, Python ints of at most ``2**24``, or
NumPy float32, float64 and int64. Anything else ends the trace (arithmetic on booleans,
``&`` of integers, a cast to booleans or narrow integers, a Python branch on a value, an
attribute, indexing by a position, writing in place, an array that varies along the rows
or keys), and the function is called on the tile itself, as without numba. The first tile
of each sequence and run of heads a compiled record computes for a function is checked
against the function's own result (the same NaNs, within 16 ulp of the scores): a record
that differs is never used again for that function.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import compiled

__all__ = ["Node", "traced"]


class UntraceableError(Exception):
    """What a trace cannot record: the function is called on the tile instead."""


class Node:
    """A stand-in for an array of a tile's pairs in a traced score function: the operation
    that makes it, its arguments (nodes, or constants: scalars and arrays of the tile's
    sequence and heads) and its dtype."""

    __array_priority__ = 1000

    def __init__(self, op: str, args: tuple[Any, ...], dtype: np.dtype) -> None:
        self.op, self.args, self.dtype = op, args, np.dtype(dtype)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Node:
        if method != "__call__" or kwargs or ufunc.__name__ not in _UFUNCS:
            raise UntraceableError(f"{ufunc.__name__}.{method}")
        if ufunc.__name__ in _INTEGER_ONLY and any(
            _dtype_of(x).kind == "f" for x in inputs if not isinstance(x, (int, float))
        ):
            raise UntraceableError(f"{ufunc.__name__} of floats")
        given = tuple(type(x) if type(x) in (int, float, bool) else _dtype_of(x) for x in inputs)
        loop = ufunc.resolve_dtypes((*given, None))
        if not _typed_as_written(ufunc.__name__, loop, len(inputs)):
            raise UntraceableError(f"{ufunc.__name__} of {[str(d) for d in loop]}")
        args = tuple(_operand(x) for x in inputs)
        return Node(ufunc.__name__, (*args, loop[: len(inputs)]), loop[-1])

    def __array_function__(self, function: Any, types: Any, args: Any, kwargs: Any) -> Node:
        if function is np.where and len(args) == 3 and not kwargs:
            condition, a, b = (_operand(x) for x in args)
            if _dtype_of(args[0]) != np.bool_:
                raise UntraceableError("np.where of a condition that is not boolean")
            dtype = np.result_type(*(_dtype_of(x) if isinstance(x, Node) else x for x in args[1:]))
            if dtype.kind not in "if":
                raise UntraceableError(f"np.where of {dtype}")
            return Node("where", (condition, a, b, dtype), dtype)
        raise UntraceableError(getattr(function, "__name__", "a function"))

    def astype(self, dtype: Any, copy: bool = True) -> Node:
        target = np.dtype(dtype)
        exact = target in (np.float32, np.float64) or target == self.dtype
        if not (exact or (target == np.int64 and self.dtype.kind in "iub")):
            raise UntraceableError(f"astype from {self.dtype} to {target}")
        return Node("astype", (self,), target)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise UntraceableError("conversion to an array")

    def __bool__(self) -> bool:
        raise UntraceableError("a Python branch on a traced value")

    def __iadd__(self, other: Any) -> Any:
        raise UntraceableError("writing in place")

    __isub__ = __imul__ = __itruediv__ = __iadd__

    # The operators, as the ufuncs they are (each recorded by __array_ufunc__).
    def __add__(self, other: Any) -> Any:
        return np.add(self, other)

    def __radd__(self, other: Any) -> Any:
        return np.add(other, self)

    def __sub__(self, other: Any) -> Any:
        return np.subtract(self, other)

    def __rsub__(self, other: Any) -> Any:
        return np.subtract(other, self)

    def __mul__(self, other: Any) -> Any:
        return np.multiply(self, other)

    def __rmul__(self, other: Any) -> Any:
        return np.multiply(other, self)

    def __truediv__(self, other: Any) -> Any:
        return np.true_divide(self, other)

    def __rtruediv__(self, other: Any) -> Any:
        return np.true_divide(other, self)

    def __floordiv__(self, other: Any) -> Any:
        return np.floor_divide(self, other)

    def __rfloordiv__(self, other: Any) -> Any:
        return np.floor_divide(other, self)

    def __mod__(self, other: Any) -> Any:
        return np.remainder(self, other)

    def __rmod__(self, other: Any) -> Any:
        return np.remainder(other, self)

    def __and__(self, other: Any) -> Any:
        return np.bitwise_and(self, other)

    __rand__ = __and__

    def __or__(self, other: Any) -> Any:
        return np.bitwise_or(self, other)

    __ror__ = __or__

    def __lt__(self, other: Any) -> Any:
        return np.less(self, other)

    def __le__(self, other: Any) -> Any:
        return np.less_equal(self, other)

    def __gt__(self, other: Any) -> Any:
        return np.greater(self, other)

    def __ge__(self, other: Any) -> Any:
        return np.greater_equal(self, other)

    def __eq__(self, other: Any) -> Any:
        return np.equal(self, other)

    def __ne__(self, other: Any) -> Any:
        return np.not_equal(self, other)

    def __neg__(self) -> Any:
        return np.negative(self)

    def __abs__(self) -> Any:
        return np.absolute(self)

    def __invert__(self) -> Any:
        return np.invert(self)

    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (NumPy's probes: not there)
            raise AttributeError(name)
        raise UntraceableError(f"attribute {name}")


_OPERATORS = {
    "add": "({0} + {1})", "subtract": "({0} - {1})", "multiply": "({0} * {1})",
    "divide": "({0} / {1})", "floor_divide": "({0} // {1})", "remainder": "({0} % {1})",
    "less": "({0} < {1})", "less_equal": "({0} <= {1})", "greater": "({0} > {1})",
    "greater_equal": "({0} >= {1})", "equal": "({0} == {1})", "not_equal": "({0} != {1})",
    "logical_and": "({0} and {1})", "logical_or": "({0} or {1})", "logical_not": "(not {0})",
    "negative": "(-{0})", "absolute": "abs({0})", "tanh": "tanh({0})", "exp": "np.exp({0})",
    "log": "np.log({0})", "sqrt": "np.sqrt({0})", "sin": "np.sin({0})", "cos": "np.cos({0})",
}  # fmt: skip
_UFUNCS = frozenset(_OPERATORS) | {"bitwise_and", "bitwise_or", "invert"}
_INTEGER_ONLY = frozenset({"floor_divide", "remainder"})
_BOOLEAN = frozenset({"bitwise_and", "bitwise_or", "invert", "logical_and", "logical_or",
                      "logical_not"})  # fmt: skip
_COMPARISONS = frozenset({"less", "less_equal", "greater", "greater_equal", "equal", "not_equal"})


def _typed_as_written(name: str, loop: tuple[np.dtype, ...], count: int) -> bool:
    """Whether the loop's source computes ``name`` over ``loop``'s dtypes as NumPy does:
    the boolean operations of booleans alone (Python's ``and``, ``or``, ``not`` then give
    NumPy's; of integers they would not), comparisons of numbers, and arithmetic and
    functions of numbers (``True + True`` is 2 in the loop, True in NumPy)."""
    kinds = [np.dtype(d).kind for d in loop]
    if name in _BOOLEAN:
        return all(kind == "b" for kind in kinds)
    if name in _COMPARISONS:
        return "b" not in kinds[:count]
    return "b" not in kinds


def _dtype_of(x: Any) -> np.dtype:
    return x.dtype if isinstance(x, (Node, np.ndarray, np.generic)) else np.asarray(x).dtype


def _operand(x: Any) -> Any:
    """A node, or a constant: a Python or NumPy scalar, or an array of the tile's sequence
    and heads (shape ``(1 or B, 1 or G, 1, 1)``)."""
    if isinstance(x, Node) or type(x) in (int, float, bool) or isinstance(x, np.generic):
        return x
    if isinstance(x, np.ndarray) and x.ndim == 4 and x.shape[0] == 1 and x.shape[2:] == (1, 1):
        return _Array(x)
    raise UntraceableError("an array that is not of the sequence and heads alone")


def _scalar(x: Any) -> Any:
    """A constant scalar as the loop takes it, in a type whose conversion to the loop's
    dtype is NumPy's: booleans, Python floats and NumPy's float32, float64 and int64, and
    Python ints that every one of those holds exactly (``|x| <= 2**24``)."""
    if type(x) is bool or type(x) is float:
        return x
    if type(x) is int:
        if abs(x) > 2**24:
            raise UntraceableError(f"the integer {x}: beyond what float32 holds exactly")
        return x
    if isinstance(x, (np.float32, np.float64, np.int64, np.bool_)):
        return x
    raise UntraceableError(f"a constant of {type(x).__name__}")


class _Array:
    """A constant array of a traced function (its values are the compiled loop's arguments)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values.reshape((1,) * (4 - values.ndim) + values.shape)
        self.dtype = values.dtype


def trace(
    function: Callable[..., Any], dtype: np.dtype, b: np.ndarray, h: np.ndarray
) -> Node | None:
    """The record of ``function(score, b, h, q_idx, kv_idx)`` for scores of ``dtype``, the
    sequence ``b`` and heads ``h`` as they are; ``None`` where it cannot be recorded."""
    score = Node("score", (), dtype)
    q, kv = Node("q", (), np.dtype(np.int64)), Node("kv", (), np.dtype(np.int64))
    try:
        result = function(score, b, h, q, kv)
    except Exception:  # (UntraceableError, or what a stand-in makes the function raise)
        return None
    if not isinstance(result, Node) or result.dtype.kind != "f":
        return None
    return result


class _Source:
    """The loop's source of a record: one line per node, and the constant arrays it reads."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.arrays: list[Any] = []  # the loop's arguments after its own: arrays and scalars
        self.named: dict[int, str] = {}
        self.eps = 0.0  # the largest epsilon of the floats it computes in

    def name(self, x: Any, cast: np.dtype | None = None) -> str:
        """The expression of ``x`` (a node, or a constant), cast to ``cast``."""
        if isinstance(x, Node):
            text = self._node(x)
        elif isinstance(x, _Array):  # (1, 1 or G, 1, 1): one value per head of the tile
            self.arrays.append(x.values)
            head = "g" if x.values.shape[1] > 1 else "0"
            text = f"c{len(self.arrays) - 1}[0, {head}, 0, 0]"
        else:  # a scalar: an argument of the loop (a new value compiles nothing)
            self.arrays.append(_scalar(x))
            text = f"c{len(self.arrays) - 1}"
        if cast is None or np.dtype(cast) == np.bool_:
            return text
        return f"np.{np.dtype(cast).name}({text})"

    def _node(self, node: Node) -> str:
        if id(node) in self.named:
            return self.named[id(node)]
        op, args = node.op, node.args
        if op in ("score", "q", "kv"):
            text = {"score": "s[g, i, j]", "q": "q[i]", "kv": "kv[j]"}[op]
        elif op == "astype":
            text = self.name(args[0], node.dtype)
        elif op == "where":
            condition, a, b, dtype = args
            text = f"({self.name(a, dtype)} if {self.name(condition)} else {self.name(b, dtype)})"
        else:
            operands, loop = args[:-1], args[-1]
            if op in ("bitwise_and", "bitwise_or", "invert") and not all(
                d == np.bool_ for d in loop
            ):
                raise UntraceableError(f"{op} of integers")
            op = {"bitwise_and": "logical_and", "bitwise_or": "logical_or"}.get(op, op)
            op = "logical_not" if op == "invert" else op
            names = [self.name(x, d) for x, d in zip(operands, loop, strict=True)]
            text = _OPERATORS[op].format(*names)
            if node.dtype != np.bool_:
                text = f"np.{node.dtype.name}({text})"
        if node.dtype.kind == "f":
            self.eps = max(self.eps, float(np.finfo(node.dtype).eps))
        name = f"t{len(self.named)}"
        self.lines.append(f"{name} = {text}")
        self.named[id(node)] = name
        return name


class _Kernels:
    """The compiled loops, by their source and the types of their arguments; and for each
    function, which of its records were checked against it, for which sequence and heads
    (``True``), or found to differ (``False``, under the record alone: never used again for
    that function). At most ``MOST`` of each are kept: then everything is forgotten."""

    MOST = 256

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loops: dict[Any, Any] = {}
        self.checked: dict[int, tuple[Any, dict[Any, bool]]] = {}  # by id: (function, checks)

    def keep_loops(self, key: Any, loops: Any) -> None:
        if len(self.loops) >= self.MOST:
            self.loops.clear()
        self.loops[key] = loops

    def checks(self, function: Any) -> dict[Any, bool]:
        """``function``'s checks (made empty when new), found by its identity (a function
        may not be hashable; the entry holds it, so its id is not another's)."""
        found = self.checked.get(id(function))
        if found is None or found[0] is not function:
            if len(self.checked) >= self.MOST:
                self.checked.clear()
            found = self.checked[id(function)] = (function, {})
        return found[1]


_KERNELS = _Kernels()


def traced(
    function: Callable[..., Any],
    view: np.ndarray,
    indices: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    out: np.ndarray | None = None,
) -> np.ndarray | None:
    """``function(view, *indices)`` computed by its traced loop (``view (1, G, n, w)`` the
    tile's scores, ``indices`` the sequence, heads, query and key positions as
    :meth:`.item.ItemVisibility.indices` gives them), into ``out`` (``(G, n, w)``, which may
    be ``view``'s own memory: each pair is read before it is written; cast to its dtype as
    ``np.copyto`` casts) or a new array; ``None`` where the function cannot be traced,
    numba is missing, or its loop was found to differ (``out`` then unchanged)."""
    if not compiled.available():
        return None
    b, h, q, kv = indices
    record = trace(function, view.dtype, b, h)
    if record is None:
        return None
    source = _Source()
    try:
        result = source.name(record, record.dtype)
    except UntraceableError:
        return None
    body = "\n".join(f"                {line}" for line in source.lines)
    arrays = tuple(a if np.ndim(a) == 0 else np.ascontiguousarray(a) for a in source.arrays)
    types = (tuple(_type_of(a) for a in arrays), view.dtype.str, record.dtype.str)
    key = (body, result, *types)
    G, n, w = view.shape[1:]
    if any(np.ndim(a) and a.shape[1] not in (1, G) for a in arrays):
        return None
    seen = (key, b.tobytes(), h.tobytes())  # the check: each sequence and heads once
    with _KERNELS.lock:
        checks = _KERNELS.checks(function)
        if checks.get(key) is False:
            return None
        loops = _KERNELS.loops.get(key)
        if loops is None:  # a new array, and over the scores themselves (one array:
            # LLVM vectorises a loop whose reads and writes it knows do not overlap)
            loops = tuple(_compile(body, result, len(arrays), into) for into in (True, False))
            _KERNELS.keep_loops(key, loops)
        check = seen not in checks and n * w > 0
    expected = None
    if check:  # (before the loop: it may write over the scores)
        try:
            expected = np.array(function(view, b, h, q, kv), copy=True)
        except Exception:  # (called on each tile instead, it raises there as itself)
            _differs(checks, key)
            return None
        if expected.shape != (1, G, n, w) or expected.dtype != record.dtype:
            _differs(checks, key)
            return None
    scores, rows, keys = view.reshape(G, n, w), q.reshape(n), kv.reshape(w)
    try:  # (numba types and compiles a loop at its first call: a record it cannot, refused)
        if expected is None and out is not None and _same_memory(out, scores):
            loops[1](out, rows, keys, *arrays)  # over the scores, in place
            return out.reshape(1, G, n, w)
        computed = np.empty((G, n, w), record.dtype) if expected is not None or out is None else out
        loops[0](scores, rows, keys, computed, *arrays)
    except Exception:
        _differs(checks, key)
        return None
    if expected is not None:
        if not _close(computed, expected.reshape(G, n, w), scores, source.eps):
            _differs(checks, key)
            return None
        with _KERNELS.lock:
            checks[seen] = True  # (a failure of another thread's, under key, stays)
        if out is not None:
            np.copyto(out, computed, casting="same_kind")
            computed = out
    return computed.reshape(1, computed.shape[0], n, w)


def _differs(checks: dict[Any, bool], key: Any) -> None:
    """Mark a record as differing from its function, for good."""
    with _KERNELS.lock:
        checks[key] = False


def _type_of(argument: Any) -> str:
    """What the compiled loop is specialised on of an argument: its dtype or scalar type."""
    return (
        argument.dtype.str
        if isinstance(argument, (np.ndarray, np.generic))
        else type(argument).__name__
    )


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same elements (the same start, shape and strides)."""
    at = a.__array_interface__["data"][0], b.__array_interface__["data"][0]
    return at[0] == at[1] and a.shape == b.shape and a.strides == b.strides


def _close(ours: np.ndarray, theirs: np.ndarray, given: np.ndarray, eps: float) -> bool:
    """The same NaNs and infinities, and elsewhere within 16 ``eps`` (the record's least
    precise float's) of the largest of the two values and the ``given`` score (a sum that
    cancels keeps the given score's error)."""
    if ours.dtype != theirs.dtype or not (np.isnan(ours) == np.isnan(theirs)).all():
        return False
    finite = np.isfinite(theirs)
    if not (ours[~finite & ~np.isnan(theirs)] == theirs[~finite & ~np.isnan(theirs)]).all():
        return False
    scale = np.maximum(np.abs(ours[finite]), np.abs(theirs[finite]))
    scale = np.maximum(scale, np.abs(np.broadcast_to(given, ours.shape)[finite]))
    bound = 16 * eps * np.maximum(scale, np.finfo(ours.dtype).tiny)
    return bool((np.abs(ours[finite] - theirs[finite]) <= bound).all())


def _compile(body: str, result: str, count: int, into: bool) -> Any:
    """The loop of a record: ``out[g, i, j] = result`` after ``body``, over a tile; ``into``
    false: into ``s`` itself (``loop(s, q, kv, *constants)``)."""
    from numba import njit

    from ._numba_step import tanh

    constants = "".join(f", c{k}" for k in range(count))
    target = "out" if into else "s"
    source = (
        f"def loop(s, q, kv{', out' if into else ''}{constants}):\n"
        "    G, n, w = s.shape\n"
        "    for g in range(G):\n"
        "        for i in range(n):\n"
        "            for j in range(w):\n"
        f"{body}\n"
        f"                {target}[g, i, j] = {result}\n"
    )
    space: dict[str, Any] = {"np": np, "tanh": tanh}
    exec(compile(source, "<traced score_mod>", "exec"), space)
    return njit(boundscheck=False, nogil=True, error_model="numpy")(space["loop"])
