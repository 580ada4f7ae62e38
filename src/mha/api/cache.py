"""``KVCache``: the keys and values of earlier tokens, so each new token costs O(S·d).

One cache serves one attention layer: preallocated ``(B, H_kv, capacity, d)`` buffers for
keys and values, and ``lengths (B,)``, how many tokens each sequence has seen (the position
of its next token). Calls that append (``scaled_dot_product_attention(..., cache=)``,
``MultiHeadAttention.forward(x, cache=)``) write the new tokens' keys and values after each
sequence's own length and attend causally over everything cached: the last new token sees
every cached key. Appending past the capacity grows the buffers (doubling, so appends cost
amortised O(1) copies per token). With ``window`` only the last ``window - 1`` positions are
needed by the next token; older ones are dropped when room is needed, so memory stays
within about twice the window. With ``sink_tokens`` too (StreamingLLM), the first
``sink_tokens`` positions are kept as well, in the first slots. A call that is refused
leaves the cache unchanged.
"""

from __future__ import annotations

import reprlib
from typing import Any

import numpy as np

from .._arrays import (
    as_array,
    compute_dtype_of,
    flag,
    is_storage_dtype,
    non_negative_int,
    positive_int,
)
from ..errors import AttentionTypeError, AttentionValueError, ShapeError

__all__ = ["KVCache", "cache_dtype", "read_only"]


class KVCache:
    """Keys and values of ``batch_size`` sequences for one attention layer.

    * ``batch_size``, ``num_kv_heads``, ``head_dim``: the buffers' ``(B, H_kv, ., d)``;
      ``value_dim`` is the values' width (default ``head_dim``).
    * ``capacity``: positions preallocated per sequence (default 256); more are added
      when needed. With ``window``, at most about ``2 * window`` are ever held.
    * ``dtype``: the dtype the buffers store: float64 or float32, which the calls that use
      the cache compute in, or the storage dtypes bfloat16 (``ml_dtypes.bfloat16``) and
      float16, half the memory of float32, which calls computing in float32 use (each key
      tile is read in float32 as the kernel reaches it; nothing else is converted).
    * ``values_in_keys``: the values are the first ``value_dim`` features of each key row,
      held once (multi-head latent attention's cache of the latent: its keys are the latent
      and its rotary part, its values the latent); appends then write the keys alone.
    * ``window``: the sliding window of the attention that uses it, if any.
    * ``sink_tokens``: with ``window``, the first positions that stay visible beside it
      (StreamingLLM's attention sinks), kept in the first slots.

    ``lengths`` holds each sequence's filled length. It and the buffers are read-only views:
    the cache's state changes only through the attention calls and two checked methods,
    ``truncate`` (roll sequences back: rejected speculative tokens) and ``reorder`` (pick
    sequences: beam search).

    >>> import numpy as np, mha
    >>> cache = mha.KVCache(batch_size=1, num_kv_heads=1, head_dim=4, capacity=8)
    >>> rng = np.random.default_rng(0)
    >>> for step in range(3):                               # one token at a time
    ...     q, k, v = rng.standard_normal((3, 1, 1, 1, 4))
    ...     out = mha.scaled_dot_product_attention(q, k, v, cache=cache)
    >>> cache.lengths, out.shape
    (array([3]), (1, 1, 1, 4))
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        capacity: int = 256,
        dtype: Any = np.float64,
        window: int | None = None,
        sink_tokens: int | None = None,
        values_in_keys: bool = False,
    ) -> None:
        B = positive_int("batch_size", batch_size)
        H_kv = positive_int("num_kv_heads", num_kv_heads)
        d_k = positive_int("head_dim", head_dim)
        d_v = d_k if value_dim is None else positive_int("value_dim", value_dim)
        self._window = None if window is None else positive_int("window", window)
        self._sink_tokens = (
            0 if sink_tokens is None else non_negative_int("sink_tokens", sink_tokens)
        )
        if self._sink_tokens and self._window is None:
            raise AttentionValueError(
                f"sink_tokens={sink_tokens} keeps the first positions beside a sliding window, "
                "but no window= was given: give window= too (a cache without a window keeps "
                "every position)"
            )
        room = positive_int("capacity", capacity)
        if self._window is not None:
            room = min(room, self._most())
        self._dtype: np.dtype = cache_dtype(dtype)
        self._shared = flag("values_in_keys", values_in_keys)
        if self._shared and d_v > d_k:
            raise AttentionValueError(
                f"values_in_keys=True reads the values as the first value_dim features of "
                f"each key: value_dim={d_v} cannot exceed head_dim={d_k}"
            )
        self._d_v = d_v
        # The state; outside the cache it is seen through read-only views (the properties
        # below) and changed only by the methods, which check what they are given.
        self._k = np.zeros((B, H_kv, room, d_k), self._dtype)
        self._v = self._values_of(
            self._k, None if self._shared else np.zeros((B, H_kv, room, d_v), self._dtype)
        )
        self._lengths = np.zeros(B, np.int64)  # tokens seen: the next token's position
        # the position held in the first slot after the sink tokens' (slot 0 without them)
        self._first = np.full(B, self._sink_tokens, np.int64)

    def _read_only(self, name: str) -> np.ndarray:
        """The read-only view of the state array ``name``, made once for each array the
        state holds there (a view sees the array's changes; a call reads the lengths a few
        times, and each view costs microseconds)."""
        array = getattr(self, name)
        views = self.__dict__.setdefault("_views", {})
        held = views.get(name)
        if held is None or held[0] is not array:
            held = views[name] = (array, read_only(array))
        view: np.ndarray = held[1]
        return view

    @property
    def window(self) -> int | None:
        """The sliding window the cache was made for: it keeps the last ``window - 1``
        positions of each sequence, so a call may attend within it or a narrower window.

        >>> KVCache(1, 1, 4, window=8).window
        8
        """
        return self._window

    @property
    def sink_tokens(self) -> int:
        """The first positions kept beside the window (0: none).

        >>> KVCache(1, 1, 4, window=8, sink_tokens=4).sink_tokens
        4
        """
        return self._sink_tokens

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the buffers.

        >>> KVCache(1, 1, 4, dtype=np.float32).dtype
        dtype('float32')
        """
        return self._dtype

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype of the calls that use the cache: float32 for a bfloat16 or float16 one.

        >>> KVCache(1, 1, 4, dtype=np.float16).compute_dtype
        dtype('float32')
        """
        return compute_dtype_of(self._dtype)

    @property
    def values_in_keys(self) -> bool:
        """Whether the values are the first ``value_dim`` features of the keys, held once.

        >>> cache = KVCache(1, 1, 576, value_dim=512, values_in_keys=True)
        >>> cache.values_in_keys, cache.v.shape, np.shares_memory(cache.k, cache.v)
        (True, (1, 1, 256, 512), True)
        """
        return self._shared

    @property
    def nbytes(self) -> int:
        """The bytes the buffers take (the values once when they live in the keys).

        >>> KVCache(1, 2, 64, capacity=128, dtype=np.float32).nbytes   # keys and values
        131072
        """
        return int(self._k.nbytes + (0 if self._shared else self._v.nbytes))

    @property
    def lengths(self) -> np.ndarray:
        """Each sequence's length: the tokens it has seen, the position of its next token
        (read-only; :meth:`truncate` and :meth:`reorder` change it).

        >>> KVCache(2, 1, 4).lengths
        array([0, 0])
        """
        return self._read_only("_lengths")

    @property
    def first(self) -> np.ndarray:
        """Each sequence's first position still held after the sink tokens (after a window
        dropped older ones; read-only).

        >>> KVCache(2, 1, 4, window=8).first
        array([0, 0])
        """
        return self._read_only("_first")

    @property
    def k(self) -> np.ndarray:
        """The key buffer ``(B, H_kv, capacity, d)`` (read-only): sequence ``b`` holds
        positions ``first[b]`` to ``lengths[b] - 1`` in its first slots (after the
        ``sink_tokens`` slots of positions ``0..sink_tokens-1``, when it keeps some).

        >>> cache = KVCache(2, 1, 4, capacity=8)
        >>> cache.k.shape, cache.k.flags.writeable
        ((2, 1, 8, 4), False)
        """
        return read_only(self._k)

    @property
    def v(self) -> np.ndarray:
        """The value buffer ``(B, H_kv, capacity, d_v)`` (read-only), laid out as :attr:`k`.

        >>> KVCache(2, 1, 4, value_dim=6, capacity=8).v.shape
        (2, 1, 8, 6)
        """
        return read_only(self._v)

    @property
    def batch_size(self) -> int:
        """``B``, the number of sequences.

        >>> KVCache(3, 2, 4).batch_size
        3
        """
        return int(self._k.shape[0])

    @property
    def capacity(self) -> int:
        """Positions the buffers hold per sequence now.

        >>> KVCache(1, 1, 4, capacity=16).capacity
        16
        """
        return int(self._k.shape[2])

    def __repr__(self) -> str:
        B, H_kv, _, d_k = self._k.shape
        window = "" if self._window is None else f", window={self._window}"
        if self._sink_tokens:
            window += f", sink_tokens={self._sink_tokens}"
        values = "" if self._d_v == d_k else f", value_dim={self._d_v}"
        if self._shared:
            values += ", values_in_keys=True"
        return (
            f"KVCache(batch_size={B}, num_kv_heads={H_kv}, head_dim={d_k}{values}, "
            f"lengths={reprlib.repr(self._lengths.tolist())}, capacity={self.capacity}, "
            f"dtype={self._dtype.name}{window})"
        )

    def truncate(self, lengths: Any) -> None:
        """Set each sequence's length back, as if its later tokens had never been appended
        (rejected speculative tokens): ``lengths`` is one integer for every sequence or one
        per sequence ``(B,)``, each at most that sequence's length. A refused call changes
        nothing.

        >>> import numpy as np, mha
        >>> cache = KVCache(2, 1, 4)
        >>> k = np.ones((2, 1, 5, 4))
        >>> _ = mha.scaled_dot_product_attention(k, k, k, cache=cache)   # five tokens each
        >>> cache.truncate(3); cache.lengths
        array([3, 3])
        >>> cache.truncate([3, 1]); cache.lengths
        array([3, 1])
        """
        B = self.batch_size
        array = as_array("lengths", lengths)
        whole = array.dtype.kind in "iu" or (  # Python ints past int64 come as objects
            array.dtype.kind == "O"
            and all(isinstance(n, int) and not isinstance(n, bool) for n in array.ravel())
        )
        if not whole or array.shape not in ((), (B,)):
            raise AttentionTypeError(
                f"lengths must be an integer or {B} integers, one per sequence; got "
                f"{reprlib.repr(lengths)} (dtype {array.dtype}, shape {array.shape})"
            )
        wanted = [int(n) for n in np.broadcast_to(array, (B,))]  # Python ints: no wrapping
        if min(wanted) < 0:
            raise AttentionValueError(f"lengths must be >= 0; got {reprlib.repr(lengths)}")
        past = [b for b in range(B) if wanted[b] > int(self._lengths[b])]
        if past:
            b = past[0]
            raise AttentionValueError(
                f"cannot truncate sequence {b} to {wanted[b]}: it holds "
                f"{int(self._lengths[b])} tokens (lengths "
                f"{reprlib.repr(self._lengths.tolist())}); truncate only shortens"
            )
        target = np.array(wanted, np.int64)
        need = target
        if self._window is not None:  # the next token's window, past the sink tokens
            need = np.maximum(self._sink_tokens, target - (self._window - 1))
        within_sink_tokens = target <= self._sink_tokens  # it sees the sink tokens alone
        dropped = np.flatnonzero((self._first > need) & ~within_sink_tokens)
        if dropped.size:
            b = int(dropped[0])
            raise AttentionValueError(
                f"cannot truncate sequence {b} to {int(target[b])}: the window's cache dropped "
                f"its positions before {int(self._first[b])}, which the next token at "
                f"{int(target[b])} would see"
            )
        self._lengths[:] = target
        self._first[within_sink_tokens] = self._sink_tokens  # nothing held after the sink tokens

    def reorder(self, indices: Any) -> None:
        """Keep the sequences ``indices`` (a 1-D array of integers in ``[0, B)``; repeats
        allowed, negative indices refused), in that order: beam search's reordering. The
        batch size becomes ``len(indices)``.

        >>> cache = KVCache(3, 1, 4)
        >>> cache.truncate(0)
        >>> cache.reorder([2, 2, 0]); cache.batch_size
        3
        """
        picked = as_array("indices", indices)
        if picked.dtype.kind not in "iu" or picked.ndim != 1 or picked.size == 0:
            raise AttentionTypeError(
                "indices must be a non-empty 1-D array of integers; got "
                f"{reprlib.repr(indices)} (dtype {picked.dtype}, shape {picked.shape})"
            )
        B = self.batch_size
        if picked.min() < 0 or picked.max() >= B:
            raise AttentionValueError(
                f"indices must lie in [0, {B}) for a cache of {B} sequences (negative "
                f"indices are refused); got {reprlib.repr(picked.tolist())}"
            )
        self._k = self._k[picked]
        self._v = self._values_of(self._k, None if self._shared else self._v[picked])
        self._lengths, self._first = self._lengths[picked], self._first[picked]

    # Used by the attention calls ------------------------------------------------------

    def _check_fit(self, batch: int, heads: int, d_k: int, d_v: int, where: str) -> None:
        B, H_kv, _, width = self._k.shape
        if (batch, heads, d_k, d_v) != (B, H_kv, width, self._v.shape[-1]):
            raise ShapeError(
                f"the new keys and values (batch {batch}, {heads} key/value heads, widths "
                f"{d_k} and {d_v}) do not fit the cache (batch {B}, {H_kv} key/value heads, "
                f"widths {width} and {self._v.shape[-1]}): {self!r}{where}"
            )

    def _values_of(self, k: np.ndarray, v: np.ndarray | None) -> np.ndarray:
        """The value buffer that goes with the key buffer ``k``: a view of its first
        ``value_dim`` features when the values live in the keys, else ``v``."""
        if self._shared:
            return k[..., : self._d_v]
        assert v is not None
        return v

    def _most(self) -> int:
        """The slots a window's cache needs at most: twice the window, and the sink tokens."""
        return 2 * (self._window or 0) + self._sink_tokens

    def _held(self) -> np.ndarray:
        """Each sequence's filled slots."""
        held: np.ndarray = self._lengths - self._first + self._sink_tokens
        return held

    def _append(self, k: np.ndarray, v: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Write the first ``counts[b]`` new rows of sequence ``b`` after what it holds, and
        return each sequence's filled slots. ``lengths`` is not advanced: :meth:`_commit`
        does that once the attention is computed, so a failure leaves the cache as it was."""
        held = self._held()
        if (held + counts).max(initial=0) > self.capacity and self._window is not None:
            self._drop_outside_window()
            held = self._held()
        need = int((held + counts).max(initial=0))
        if need > self.capacity:
            self._grow(need)
        for b in range(self.batch_size):
            n, at = int(counts[b]), int(held[b])
            self._k[b, :, at : at + n] = k[b, :, :n]
            if not self._shared:  # a view of the keys otherwise, written with them
                self._v[b, :, at : at + n] = v[b, :, :n]
        filled: np.ndarray = held + counts
        return filled

    def _commit(self, counts: np.ndarray) -> None:
        self._lengths += counts
        if self._window is not None and self.capacity > self._most():  # after a long prompt
            self._drop_outside_window()
            held = int(self._held().max(initial=0))
            keep = max(held, self._most())  # copies: a view would keep the long prompt's buffer
            self._k = self._k[:, :, :keep].copy()
            self._v = self._values_of(
                self._k, None if self._shared else self._v[:, :, :keep].copy()
            )

    def _grow(self, need: int) -> None:
        room = max(need, 2 * self.capacity)
        if self._window is not None:
            room = max(need, min(room, self._most()))
        B, H_kv, held, d_k = self._k.shape
        k = np.zeros((B, H_kv, room, d_k), self._dtype)
        k[:, :, :held] = self._k
        v = None
        if not self._shared:
            v = np.zeros((B, H_kv, room, self._d_v), self._dtype)
            v[:, :, :held] = self._v
        self._k, self._v = k, self._values_of(k, v)

    def _attended(self, S: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values of every sequence's first ``S`` slots, for the kernel."""
        return self._k[:, :, :S], self._v[:, :, :S]

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The state an append changes: restored by :meth:`_restore` when its call fails
        (appends write only past each sequence's length, and drop into new buffers)."""
        return self._k, self._v, self._first.copy()

    def _restore(self, state: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        self._k, self._v, self._first = state

    def _drop_outside_window(self) -> None:
        """Move each sequence's last ``window - 1`` positions to the front of its slots
        (after the sink tokens' slots), in new buffers: a failed call restores the old."""
        window, n = self._window or 1, self._sink_tokens
        self._k = self._k.copy()
        self._v = self._values_of(self._k, None if self._shared else self._v.copy())
        for b in range(self.batch_size):
            held = int(self._lengths[b] - self._first[b])  # positions after the sinks
            keep = min(held, window - 1)
            if 0 <= keep < held:
                at = held + n - keep
                self._k[b, :, n : n + keep] = self._k[b, :, at : at + keep].copy()
                if not self._shared:
                    self._v[b, :, n : n + keep] = self._v[b, :, at : at + keep].copy()
                self._first[b] = self._lengths[b] - keep


def cache_dtype(dtype: Any) -> np.dtype:
    """A cache's storage dtype, checked: float64, float32, bfloat16 or float16."""
    kinds = "float64, float32, bfloat16 or float16"
    try:
        checked: np.dtype = np.dtype(dtype)
    except TypeError:
        raise AttentionTypeError(f"dtype must be {kinds}; got {dtype!r}") from None
    if checked not in (np.float32, np.float64) and not is_storage_dtype(checked):
        raise AttentionTypeError(f"dtype must be {kinds}; got {checked}")
    return checked


def read_only(array: np.ndarray) -> np.ndarray:
    """A view of ``array`` that cannot be written, nor made writable again."""
    view: np.ndarray = np.lib.stride_tricks.as_strided(array, writeable=False)
    return view
