"""``mha.KVCache`` and ``mha.PagedKVCache``: a cache made with drawn options (valid or not),
then its operations in random order (attention calls appending to it, truncate, reorder,
add, fork, release, append; refused ones in between), each a call of its own. After every
call the cache's public state (lengths, sequences, the read-only views, the block tables,
``dequantized``) is compared with a model of what it holds, written from the docs; after a
refused call it must be unchanged to the bit (:func:`.outcome.state_of`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha
from support.interleavings import History

from .arrays import chance, drawn_rng, pick
from .cached import attend_call
from .cached_layer import layer_call
from .keywords import NOT_POSITIVE
from .outcome import Call, MismatchError, run
from .rules import BFLOAT16


@dataclass
class Session:
    """A cache and the model of what it holds: each sequence's keys and values as given
    (cast to the cache's dtype), in the order of the batch."""

    cache: Any
    H_kv: int
    d_k: int
    d_v: int
    dtype: np.dtype
    window: int | None = None
    sink_tokens: int = 0
    values_in_keys: bool = False
    quantize: str | None = None
    block_size: int = 0
    model: dict[Any, History] = field(default_factory=dict)
    next_id: int = 0

    @property
    def paged(self) -> bool:
        return isinstance(self.cache, mha.PagedKVCache)

    def new(self) -> History:
        history = History(self.H_kv, self.d_k, self.dtype)
        history.values = np.zeros((self.H_kv, 0, self.d_v), self.dtype)
        return history

    def check(self) -> None:
        """The cache's public state against the model (:class:`MismatchError` if they differ)."""
        cache, ids = self.cache, list(self.model)
        lengths = [h.keys.shape[1] for h in self.model.values()]
        if cache.lengths.tolist() != lengths or cache.lengths.flags.writeable:
            writeable = cache.lengths.flags.writeable
            raise MismatchError(f"lengths {cache.lengths} (writeable {writeable}); the model "
                                f"holds {lengths}")  # fmt: skip
        if self.paged:
            self.check_paged(ids)
        else:
            self.check_contiguous()

    def check_contiguous(self) -> None:
        cache, n = self.cache, self.sink_tokens
        if (
            cache.k.flags.writeable
            or cache.v.flags.writeable
            or cache.batch_size != len(self.model)
        ):
            raise MismatchError("the buffers are writeable, or the batch size is off")
        for b, history in enumerate(self.model.values()):
            length, first = history.keys.shape[1], int(cache.first[b])
            kept = min(length, n)  # the sink tokens' slots, then first..length-1
            if self.window is not None and length > n and not n <= first <= max(
                n, length - (self.window - 1)):  # fmt: skip
                raise MismatchError(f"sequence {b} holds from position {first}: its next token "
                                    f"needs {max(n, length - self.window + 1)} on")  # fmt: skip
            start = first if length > n else length
            slots = list(range(kept)) + list(range(n, n + length - start))
            positions = list(range(kept)) + list(range(start, length))
            for name, buffer, held in (("keys", cache.k, history.keys),
                                       ("values", cache.v, history.values)):  # fmt: skip
                width = held.shape[-1]
                if not np.array_equal(buffer[b][:, slots, :width], held[:, positions],
                                      equal_nan=True):  # fmt: skip
                    raise MismatchError(f"sequence {b}'s {name} are not what was appended")

    def check_paged(self, ids: list[Any]) -> None:
        cache = self.cache
        if list(cache.sequences) != ids:
            raise MismatchError(f"sequences {cache.sequences}; the model holds {ids}")
        table = cache.block_table()
        held = set()
        for row, (s, history) in enumerate(self.model.items()):
            n = -(-history.keys.shape[1] // self.block_size)
            if (table[row, :n] < 0).any() or (table[row, n:] != -1).any():
                raise MismatchError(f"block table row {row} {table[row]} for {n} blocks")
            held |= set(table[row, :n].tolist())
            keys, vals = cache.dequantized(s)
            for name, ours, given in (("keys", keys, history.keys), ("values", vals,
                                                                   history.values)):  # fmt: skip
                if ours.shape != given.shape or not within(ours, given, self.quantize):
                    raise MismatchError(f"sequence {s!r}'s {name} read back off what was appended")
        if cache.num_free_blocks != cache.num_blocks - len(held):
            raise MismatchError(f"{cache.num_free_blocks} free blocks with {len(held)} of "
                                f"{cache.num_blocks} held: blocks lost")  # fmt: skip
        if cache.key_cache.flags.writeable or cache.value_cache.flags.writeable:
            raise MismatchError("the pools are writeable")


def within(ours: np.ndarray, given: np.ndarray, quantize: str | None) -> bool:
    """Exact, or for a quantized cache within two roundings of the coarsest step a group of
    the sequence could have, plus float16's rounding of the scales and zero points."""
    if quantize is None:
        return bool(np.array_equal(ours, given, equal_nan=True))
    if not given.size:
        return True
    spread = np.ptp(given, axis=(1, 2), keepdims=True)  # per head
    step = spread / (2 ** int(quantize[-1]) - 1)
    bound = step + 4e-3 * np.abs(given).max(axis=(1, 2), keepdims=True) + 1e-6
    return bool((np.abs(ours - given) <= bound).all())


# ------------------------------------------------------------------------ making one


@st.composite
def made(draw: Any) -> Session | None:
    """A cache from drawn options, its construction a call of its own (``None`` when it was
    refused)."""
    paged = draw(st.booleans(), label="paged")
    H_kv, d_k = draw(pick([1, 2]), label="H_kv"), draw(
        pick([2, 4, 8, 32, 64]), label="head_dim")  # fmt: skip
    d_v = draw(pick([d_k, d_k, 3, 32]), label="value_dim")
    dtypes = [np.float64, np.float32, np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])
    dtype = np.dtype(draw(pick(dtypes), label="dtype"))
    kwargs: dict[str, Any] = {"dtype": dtype} if draw(chance(0.8), label="dtype given") else {}
    if d_v != d_k:
        kwargs["value_dim"] = d_v
    session = Session(None, H_kv, d_k, d_v, kwargs.get("dtype", np.dtype(
        np.float32 if paged else np.float64)))  # fmt: skip
    refuse: set[str] = set()
    if paged:
        size = draw(pick([1, 2, 4, 16, 32]), label="block_size")
        count = draw(pick([1, 2, 4, 8, 16, 32, 64, 64]), label="num_blocks")
        args: tuple[Any, ...] = (count, size, H_kv, d_k)
        session.block_size = size
        if draw(chance(0.3), label="quantized"):
            kind = draw(pick(["int8", "int4", "kivi8", "kivi4"]), label="quantize")
            group = draw(pick([None, 32, 64]), label="group_size")
            kwargs |= {"quantize": kind, "dtype": np.dtype(np.float32)}
            if group is not None:
                kwargs["group_size"] = group
            session.quantize, session.dtype = kind, np.dtype(np.float32)
            g = group or 32
            if d_k % g or d_v % g or (kind.startswith("kivi") and size % g):
                refuse |= {"group_size", "head_dim", "value_dim", "block_size"}
    else:
        B = draw(st.integers(1, 3), label="batch_size")
        args = (B, H_kv, d_k)
        if draw(chance(0.3), label="capacity given"):
            kwargs["capacity"] = draw(pick([1, 2, 7, 256]), label="capacity")
        if draw(chance(0.3), label="window"):
            session.window = kwargs["window"] = draw(st.integers(1, 5), label="window")
            if draw(chance(0.5), label="sink_tokens given"):
                session.sink_tokens = kwargs["sink_tokens"] = draw(st.integers(0, 3))
        if draw(chance(0.1), label="values_in_keys"):
            session.values_in_keys = kwargs["values_in_keys"] = True
            if d_v > d_k:
                refuse |= {"values_in_keys", "value_dim"}
    spoil = draw(pick(["none"] * 12 + ["sizes", "dtype", "option"]), label="spoil")
    if spoil == "sizes":
        n = draw(st.integers(0, len(args) - 1), label="which size")
        args = (*args[:n], draw(pick(NOT_POSITIVE)), *args[n + 1 :])
        names = ["num_blocks", "block_size"] if paged else ["batch_size"]
        refuse.add([*names, "num_kv_heads", "head_dim"][n])
    elif spoil == "dtype":
        kwargs["dtype"] = draw(pick([np.int64, bool, np.complex64, "half-float"]))
        refuse.add("dtype")
    elif spoil == "option":
        name, bad = draw(pick(
            [("group_size", 0), ("quantize", "int2"), ("value_dim", 0)]
            if paged else [("capacity", 0), ("window", -1), ("sink_tokens", -2),
                           ("values_in_keys", 1)]), label="bad option")  # fmt: skip
        kwargs[name] = bad
        refuse.add(name)
        if name == "group_size" and "quantize" not in kwargs:
            refuse.add("quantize")
    if kwargs.get("sink_tokens") and kwargs.get("window") is None:
        refuse |= {"sink_tokens", "window"}
    kind = mha.PagedKVCache if paged else mha.KVCache
    outcome = run(Call(kind.__name__, kind, args, kwargs, frozenset(refuse) or None))
    if outcome.kind != "result":
        return None
    session.cache = outcome.value
    if not paged:
        session.model = {b: session.new() for b in range(args[0])}
    return session


# ------------------------------------------------------------------- its operations


def fuzz_cache(data: Any) -> None:
    """A cache, then up to 8 operations on it drawn by ``data``, each run and classified;
    the model is compared with the cache after each one that computes."""
    session = data.draw(made(), label="cache")
    if session is None:
        return
    for _ in range(data.draw(st.integers(1, 8), label="operations")):
        kinds = (
            ["attend"] * 3
            + ["layer"]
            + (
                ["add", "add", "append", "fork", "release", "truncate"]
                if session.paged
                else ["truncate", "truncate", "reorder"]
            )
        )
        if session.paged and not session.model:
            kinds = ["add"]
        kind = data.draw(pick(kinds), label="operation")
        if kind == "attend":
            run(data.draw(attend_call(session), label="attention call"))
        elif kind == "layer":
            run(data.draw(layer_call(session), label="layer call"))
        else:
            run(data.draw(OPERATIONS[kind](session), label=kind))


def checked(session: Session, change: Any) -> Any:
    """A result's check: ``change(result)`` advances the model, then the cache must match."""

    def check(result: Any) -> None:
        change(result)
        session.check()

    return check


@st.composite
def truncate_contiguous(draw: Any, session: Session) -> Call:
    """``KVCache.truncate(lengths)``: one length or one per sequence, each at most the
    sequence's; a window's cache may refuse positions it dropped (documented)."""
    held = np.array([h.keys.shape[1] for h in session.model.values()], np.int64)
    if draw(chance(0.5), label="one length"):
        lengths: Any = draw(st.integers(0, int(held.min(initial=0))), label="length")
    else:
        lengths = np.array([draw(st.integers(0, int(n)), label="length") for n in held])
    refuse: set[str] = set()
    if draw(chance(0.1), label="spoil"):
        lengths = draw(pick([held + 1, -1, held.astype(float), np.zeros((1, 2), int),
                                        "2"]), label="bad lengths")  # fmt: skip
        refuse |= {"lengths", "truncate"}
    wanted = np.broadcast_to(np.asarray(lengths), held.shape) if not refuse else None

    def change(result: Any) -> None:
        assert wanted is not None
        for history, n in zip(session.model.values(), wanted, strict=True):
            history.truncate(int(n))

    may = session.window is not None and not refuse
    refuse |= {"truncate"} if may else set()
    return Call("KVCache.truncate", session.cache.truncate, (lengths,),
                refuse=frozenset(refuse) or None, may_refuse=may,
                check=checked(session, change), changes=(session.cache,))  # fmt: skip


@st.composite
def reorder(draw: Any, session: Session) -> Call:
    """``KVCache.reorder(indices)``: the sequences picked, repeats allowed."""
    B = len(session.model)
    indices: Any = np.array(draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=4)))
    refuse = None
    if draw(chance(0.1), label="spoil"):
        bad = [np.array([-1]), np.array([B]), np.array([], int), np.zeros(1), np.zeros((1, 1), int)]
        indices = draw(pick(bad), label="bad indices")
        refuse = frozenset({"indices"})
    elif draw(chance(0.3), label="as a list"):
        indices = indices.tolist()

    def change(result: Any) -> None:
        histories = list(session.model.values())
        session.model = {b: histories[int(i)].copy() for b, i in enumerate(indices)}

    return Call("KVCache.reorder", session.cache.reorder, (indices,), refuse=refuse,
                check=checked(session, change), changes=(session.cache,))  # fmt: skip


def unknown(session: Session) -> int:
    return session.next_id + 1000


@st.composite
def add(draw: Any, session: Session) -> Call:
    seq_id: Any = session.next_id if draw(st.booleans(), label="int id") else f"s{session.next_id}"
    refuse = None
    if session.model and draw(chance(0.1), label="spoil"):
        seq_id = draw(pick(sorted(session.model, key=str)), label="held id")
        refuse = frozenset({f"sequence {seq_id!r}"})
    elif draw(chance(0.05), label="unhashable"):
        seq_id, refuse = [session.next_id], frozenset({"seq_id"})

    def change(result: Any) -> None:
        session.model[seq_id] = session.new()
        session.next_id += 1

    return Call("PagedKVCache.add", session.cache.add, (seq_id,), refuse=refuse,
                check=checked(session, change), changes=(session.cache,))  # fmt: skip


@st.composite
def release(draw: Any, session: Session) -> Call:
    seq_id = draw(pick(sorted(session.model, key=str)), label="released")
    refuse = None
    if draw(chance(0.1), label="spoil"):
        seq_id = unknown(session)
        refuse = frozenset({f"sequence {seq_id!r}"})
    return Call("PagedKVCache.release", session.cache.release, (seq_id,), refuse=refuse,
                check=checked(session, lambda _: session.model.pop(seq_id)),
                changes=(session.cache,))  # fmt: skip


@st.composite
def fork(draw: Any, session: Session) -> Call:
    parent = draw(pick(sorted(session.model, key=str)), label="parent")
    child = session.next_id
    refuse = None
    if draw(chance(0.1), label="spoil"):
        if draw(st.booleans(), label="unknown parent"):
            parent = unknown(session)
            refuse = frozenset({f"sequence {parent!r}"})
        else:
            child = draw(pick(sorted(session.model, key=str)), label="held child")
            refuse = frozenset({f"sequence {child!r}"})

    def change(result: Any) -> None:
        session.model[child] = session.model[parent].copy()
        session.next_id += 1

    return Call("PagedKVCache.fork", session.cache.fork, (parent, child), refuse=refuse,
                check=checked(session, change), changes=(session.cache,))  # fmt: skip


@st.composite
def truncate_paged(draw: Any, session: Session) -> Call:
    seq_id = draw(pick(sorted(session.model, key=str)), label="truncated")
    held = session.model[seq_id].keys.shape[1]
    length: Any = draw(st.integers(0, held), label="length")
    refuse = None
    if draw(chance(0.1), label="spoil"):
        length = draw(pick([held + 1, -1, 1.0, True, np.int64(held + 2)]))
        refuse = frozenset({"length", "truncate"})
    return Call("PagedKVCache.truncate", session.cache.truncate, (seq_id, length),
                refuse=refuse, check=checked(session, lambda _: session.model[seq_id].truncate(
                    int(length))), changes=(session.cache,))  # fmt: skip


@st.composite
def append(draw: Any, session: Session) -> Call:
    """``PagedKVCache.append(seq_id, k, v)``: tokens written without attending."""
    rng = drawn_rng(draw, "seed")
    seq_id = draw(pick(sorted(session.model, key=str)), label="appended to")
    n = draw(st.integers(0, 5), label="tokens")
    k = rng.standard_normal((session.H_kv, n, session.d_k)).astype(session.dtype)
    v = rng.standard_normal((session.H_kv, n, session.d_v)).astype(session.dtype)
    refuse: set[str] = set()
    may = False
    spoil = draw(pick(["none"] * 8 + ["shape", "not finite"]), label="spoil")
    if spoil == "shape":
        k = np.zeros((session.H_kv + 1, n, session.d_k))
        refuse |= {"k", "v"}
    elif spoil == "not finite" and session.quantize is not None and n:
        k = k.copy()
        k[0, 0, 0] = draw(pick([np.inf, np.nan, 1e6]), label="bad key")
        refuse |= {"k", "keys"}
    held = session.model[seq_id].keys.shape[1]
    size = session.block_size
    if (
        not refuse
        and n
        and -(-(held + n) // size) - held // size + 1 > session.cache.num_free_blocks
    ):
        refuse.add("num_blocks")
        may = True
    return Call("PagedKVCache.append", session.cache.append, (seq_id, k, v),
                refuse=frozenset(refuse) or None, may_refuse=may,
                check=checked(session, lambda _: session.model[seq_id].append(k, v)),
                changes=(session.cache,))  # fmt: skip


OPERATIONS = {"truncate": lambda s: (truncate_paged if s.paged else truncate_contiguous)(s),
              "reorder": reorder, "add": add, "release": release, "fork": fork,
              "append": append}  # fmt: skip
