"""``PagedKVCache``: the keys and values of many sequences in one pool of fixed-size blocks.

Sequences come and go by id: each has a block table (the pool's blocks holding its
positions, in order) and a length. An append fills a sequence's last block and takes a free
block when it is full; releasing a sequence returns its blocks to the free list. A sequence
forked from another shares all its blocks (a shared prompt, beam search, parallel
sampling); a block is copied only when a sequence writes into one it shares (copy on
write). The pools are ``(num_blocks, block_size, H_kv, d)``, vLLM's FlashAttention layout,
and :meth:`PagedKVCache.block_table` gives the tables :func:`mha.paged_attention` takes.

The attention calls that take ``cache=`` take a paged cache for all its sequences, in the
order they were added, as the batch; the kernel reads each sequence's blocks where they
lie, tile by tile. A call the cache refuses (a full pool, say) changes nothing.
"""

from __future__ import annotations

import reprlib
from collections.abc import Hashable, Iterable
from typing import Any

import numpy as np

from .._arrays import as_float_array, compute_dtype_of, positive_int
from .._kernel.paged import PagedKV, Residual
from .._kernel.quantized import Quantization, _float8
from ..errors import AttentionTypeError, AttentionValueError, PoolExhaustedError, ShapeError
from .cache import cache_dtype, read_only

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """A pool of ``num_blocks`` blocks of ``block_size`` positions, each holding
    ``num_kv_heads`` keys of ``head_dim`` (values of ``value_dim``, default ``head_dim``)
    in ``dtype`` (float64, float32, or the storage dtypes bfloat16 and float16, computed
    in float32). ``quantize="int8"`` or ``"int4"`` stores each token's vector of each head
    in 8 or 4 bits per channel, with a float16 scale and zero point per ``group_size``
    channels (32 or 64 for int4), read back in float32 tile by tile (:mod:`mha._kernel.quantized`
    states the formulas): 0.28 and 0.16 of float32's bytes at ``head_dim=128``, groups of 32.
    ``quantize="kivi8"`` or ``"kivi4"`` (KIVI) stores the values so, and the keys per
    channel: each channel of a head has its scale and zero point over ``group_size``
    consecutive tokens (``block_size`` a multiple of it), which suits keys with a few large
    channels. A key group that has not filled yet (a sequence's last ``0`` to ``group_size
    - 1`` tokens) stays in float32 until it fills; a truncate into a quantized group keeps
    its codes, and the next append reads them back and quantizes the group again when it
    fills (those tokens then carry two roundings). The same bytes a token as int8 and int4,
    plus that residual: ``group_size * num_kv_heads * head_dim * 4`` bytes a sequence.
    ``quantize="fp8"`` stores each value as the nearest float8 e4m3 number of its group
    scaled to float8's range (a float16 scale per ``group_size`` channels; int8's bytes; it
    needs ml_dtypes).

    >>> import numpy as np, mha
    >>> cache = mha.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2,
    ...                          dtype=np.float64)
    >>> cache.add("a"); cache.add("b")
    >>> k = np.ones((2, 1, 6, 2))                      # six tokens for each sequence
    >>> out = mha.scaled_dot_product_attention(k, k, k, cache=cache)
    >>> cache.lengths, cache.num_free_blocks           # two blocks each
    (array([6, 6]), 4)
    >>> cache.fork("a", "c")                           # "c" shares a's blocks
    >>> cache.num_free_blocks, cache.block_table(["a", "c"]).tolist()
    (4, [[0, 1], [0, 1]])
    >>> cache.release("a"); cache.release("b"); cache.release("c")
    >>> cache.num_free_blocks
    8
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: Any = np.float32,
        quantize: str | None = None,
        group_size: int | None = None,
    ) -> None:
        count = positive_int("num_blocks", num_blocks)
        size = positive_int("block_size", block_size)
        H_kv = positive_int("num_kv_heads", num_kv_heads)
        d_k = positive_int("head_dim", head_dim)
        d_v = d_k if value_dim is None else positive_int("value_dim", value_dim)
        self._dtype: np.dtype = cache_dtype(dtype)
        keys, values = _quantization(quantize, group_size, size, d_k, d_v, self._dtype)
        self._quantize = quantize
        self._keys = _Pool(count, size, H_kv, d_k, self._dtype, keys)
        self._values = _Pool(count, size, H_kv, d_v, self._dtype, values)
        self._k, self._v = self._keys.arrays[0], self._values.arrays[0]
        self._widths = (H_kv, d_k, d_v)
        self._refs = np.zeros(count, np.int64)  # sequences holding each block
        self._free = list(range(count - 1, -1, -1))  # taken from the end: lowest first
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    # What it holds ------------------------------------------------------------------

    @property
    def sequences(self) -> tuple[Hashable, ...]:
        """The ids of the sequences it holds, in the order they were added: the batch of the
        attention calls that take the cache.

        >>> cache = PagedKVCache(4, 16, 1, 8); cache.add(7); cache.add("x"); cache.sequences
        (7, 'x')
        """
        return tuple(self._tables)

    @property
    def lengths(self) -> np.ndarray:
        """Each sequence's length (in :attr:`sequences`' order): its next token's position.

        >>> cache = PagedKVCache(4, 16, 1, 2); cache.add("a"); cache.add("b")
        >>> cache.append("b", np.ones((1, 3, 2)), np.ones((1, 3, 2))); cache.lengths
        array([0, 3])
        """
        lengths = np.array([self._lengths[s] for s in self._tables], np.int64)
        lengths.flags.writeable = False
        return lengths

    def length(self, seq_id: Hashable) -> int:
        """The length of sequence ``seq_id``.

        >>> cache = PagedKVCache(4, 16, 1, 2); cache.add("a")
        >>> cache.append("a", np.ones((1, 3, 2)), np.ones((1, 3, 2))); cache.length("a")
        3
        """
        return self._lengths[self._known(seq_id)]

    @property
    def num_blocks(self) -> int:
        """The blocks of the pool.

        >>> PagedKVCache(64, 16, 8, 128).num_blocks
        64
        """
        return int(self._k.shape[0])

    @property
    def block_size(self) -> int:
        """Positions per block.

        >>> PagedKVCache(64, 16, 8, 128).block_size
        16
        """
        return int(self._k.shape[1])

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds.

        >>> cache = PagedKVCache(4, 2, 1, 2); cache.add(0)
        >>> cache.append(0, np.ones((1, 3, 2)), np.ones((1, 3, 2))); cache.num_free_blocks
        2
        """
        return len(self._free)

    @property
    def dtype(self) -> np.dtype:
        """The dtype the pools store.

        >>> PagedKVCache(4, 16, 1, 8).dtype
        dtype('float32')
        """
        return self._dtype

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype of the calls that use the cache: float32 for a bfloat16 or float16 one.

        >>> PagedKVCache(4, 16, 1, 8, dtype=np.float16).compute_dtype
        dtype('float32')
        """
        return compute_dtype_of(self._dtype)

    @property
    def nbytes(self) -> int:
        """The bytes of the two pools (the whole pool, used or not), and of the float32
        keys a KIVI cache holds now for the unfilled groups of its sequences.

        >>> PagedKVCache(4, 16, 2, 8).nbytes     # 4 blocks x 16 x 2 heads x 8 x 4 bytes x 2
        8192
        """
        return self._keys.nbytes + self._values.nbytes

    @property
    def bytes_per_token(self) -> int:
        """The bytes one position of a sequence takes: its keys and values of every head
        (codes, scales and zero points in a quantized cache; for KIVI's keys, each channel's
        scale and zero point shared by ``group_size`` tokens, the same bytes a token). A
        KIVI cache holds besides, for each sequence whose last group has not filled, that
        group's keys in float32 (``group_size * num_kv_heads * head_dim * 4`` bytes, in
        :attr:`nbytes`).

        >>> kinds = (None, "int8", "int4", "kivi8", "kivi4")
        >>> [PagedKVCache(4, 32, 8, 128, quantize=q).bytes_per_token for q in kinds]
        [8192, 2304, 1280, 2304, 1280]
        """
        H_kv, d_k, d_v = self._widths
        keys, values = self._keys.quantization, self._values.quantization
        if keys is None or values is None:
            return H_kv * (d_k + d_v) * self._dtype.itemsize
        return H_kv * (keys.bytes_per_vector(d_k) + values.bytes_per_vector(d_v))

    @property
    def key_cache(self) -> np.ndarray:
        """The key pool ``(num_blocks, block_size, H_kv, head_dim)`` (read-only; a quantized
        cache's holds the codes, KIVI's unfilled groups lie apart in float32, and
        :meth:`dequantized` reads a sequence back).

        >>> pool = PagedKVCache(4, 16, 2, 8).key_cache; pool.shape, pool.flags.writeable
        ((4, 16, 2, 8), False)
        """
        return read_only(self._k)

    @property
    def value_cache(self) -> np.ndarray:
        """The value pool ``(num_blocks, block_size, H_kv, value_dim)`` (read-only).

        >>> PagedKVCache(4, 16, 2, 8, value_dim=6).value_cache.shape
        (4, 16, 2, 6)
        """
        return read_only(self._v)

    def block_table(self, seq_ids: Iterable[Hashable] | None = None) -> np.ndarray:
        """The blocks of ``seq_ids`` (default: every sequence), one row each, padded with
        -1 to the longest: :func:`mha.paged_attention`'s ``block_table`` (with
        ``seq_lens`` from :meth:`length`).

        >>> cache = PagedKVCache(8, 2, 1, 2); cache.add("a"); cache.add("b")
        >>> cache.append("a", np.ones((1, 5, 2)), np.ones((1, 5, 2)))
        >>> cache.append("b", np.ones((1, 1, 2)), np.ones((1, 1, 2)))
        >>> cache.block_table().tolist()
        [[0, 1, 2], [3, -1, -1]]
        """
        ids = list(self._tables) if seq_ids is None else [self._known(s) for s in seq_ids]
        width = max((len(self._tables[s]) for s in ids), default=0)
        table = np.full((len(ids), width), -1, np.int64)
        for row, s in enumerate(ids):
            table[row, : len(self._tables[s])] = self._tables[s]
        return table

    def dequantized(self, seq_id: Hashable) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``seq_id``'s keys and values ``(H_kv, n, d)`` as the kernel reads them
        (read back from their codes in a quantized cache; a KIVI cache's keys of the last,
        unfilled group as they were given): a copy, for checks.

        >>> cache = PagedKVCache(4, 16, 1, 32, quantize="int8"); cache.add(0)
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 2, 32)
        >>> cache.append(0, x, x); k, _ = cache.dequantized(0)
        >>> bool(np.abs(k - x).max() <= 1 / 255)           # half a step of 2/255 at most
        True
        """
        seq_id = self._known(seq_id)
        blocks, n = self._tables[seq_id], self._lengths[seq_id]
        return self._keys.read(blocks, n), self._values.read(blocks, n)

    def __repr__(self) -> str:
        count, size = self._k.shape[:2]
        H_kv, d_k, d_v = self._widths
        values = "" if d_v == d_k else f", value_dim={d_v}"
        quantization = self._keys.quantization
        if quantization is not None:
            values += f", quantize={self._quantize!r}, group_size={quantization.group}"
        return (
            f"PagedKVCache(num_blocks={count}, block_size={size}, num_kv_heads={H_kv}, "
            f"head_dim={d_k}{values}, dtype={self._dtype.name}, free blocks {len(self._free)}, "
            f"sequences {reprlib.repr(dict(self._lengths))})"
        )

    # Sequences coming and going ---------------------------------------------------------

    def add(self, seq_id: Hashable) -> None:
        """Start an empty sequence ``seq_id`` (any hashable id not already held).

        >>> cache = PagedKVCache(4, 16, 1, 8); cache.add("request-17"); cache.sequences
        ('request-17',)
        """
        try:
            hash(seq_id)
        except TypeError:
            raise AttentionTypeError(f"seq_id must be hashable; got {seq_id!r}") from None
        if seq_id in self._tables:
            raise AttentionValueError(f"sequence {seq_id!r} is already in the cache: {self!r}")
        self._tables[seq_id], self._lengths[seq_id] = [], 0

    def release(self, seq_id: Hashable) -> None:
        """Drop sequence ``seq_id``; its blocks that no other sequence shares become free.

        >>> cache = PagedKVCache(4, 2, 1, 2); cache.add(0)
        >>> cache.append(0, np.ones((1, 3, 2)), np.ones((1, 3, 2)))
        >>> cache.release(0); cache.num_free_blocks, cache.sequences
        (4, ())
        """
        seq_id = self._known(seq_id)
        self._let_go(self._tables.pop(seq_id))
        del self._lengths[seq_id]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Start sequence ``child`` as a copy of ``parent`` that shares its blocks (none is
        copied until one of them writes into a shared block).

        >>> cache = PagedKVCache(4, 2, 1, 2); cache.add("prompt")
        >>> cache.append("prompt", np.ones((1, 3, 2)), np.ones((1, 3, 2)))
        >>> cache.fork("prompt", "sample"); cache.block_table().tolist(), cache.num_free_blocks
        ([[0, 1], [0, 1]], 2)
        """
        parent = self._known(parent)
        self.add(child)
        blocks = list(self._tables[parent])
        self._refs[blocks] += 1
        self._tables[child], self._lengths[child] = blocks, self._lengths[parent]

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Shorten sequence ``seq_id`` to ``length`` tokens (rejected speculative tokens);
        the blocks past it are let go. (In a KIVI cache the rows kept are read as before:
        a group cut short keeps its codes until an append reaches it.)

        >>> cache = PagedKVCache(4, 2, 1, 2); cache.add(0)
        >>> cache.append(0, np.ones((1, 5, 2)), np.ones((1, 5, 2)))
        >>> cache.truncate(0, 2); cache.length(0), cache.num_free_blocks
        (2, 3)
        """
        seq_id = self._known(seq_id)
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise AttentionTypeError(f"length must be an integer; got {length!r}")
        held = self._lengths[seq_id]
        if not 0 <= length <= held:
            raise AttentionValueError(
                f"cannot truncate sequence {seq_id!r} to {length}: it holds {held} tokens; "
                "truncate only shortens"
            )
        blocks = self._tables[seq_id]
        keep = -(-int(length) // self.block_size)
        self._let_go(blocks[keep:])
        del blocks[keep:]
        self._lengths[seq_id] = int(length)

    def append(self, seq_id: Hashable, k: Any, v: Any) -> None:
        """Write the keys ``k (H_kv, n, head_dim)`` and values ``v (H_kv, n, value_dim)``
        of ``n`` new tokens after sequence ``seq_id``'s, without attending (a prompt
        computed elsewhere, say). Refused, changing nothing, if the pool has too few free
        blocks.

        >>> import mha
        >>> cache = PagedKVCache(2, 2, 1, 2); cache.add(0)
        >>> cache.append(0, np.ones((1, 3, 2)), np.ones((1, 3, 2))); cache.length(0)
        3
        >>> try:                                            # 2 more need a third block
        ...     cache.append(0, np.ones((1, 2, 2)), np.ones((1, 2, 2)))
        ... except mha.PoolExhaustedError:
        ...     print("refused; still", cache.length(0))
        refused; still 3
        """
        seq_id = self._known(seq_id)
        k, v = as_float_array("k", k), as_float_array("v", v)
        H_kv, d_k, d_v = self._widths
        if (
            k.ndim != 3
            or v.ndim != 3
            or k.shape[0] != H_kv
            or k.shape[2] != d_k
            or (v.shape != (H_kv, k.shape[1], d_v))
        ):
            raise ShapeError(
                f"k and v must be (H_kv, n, d) = ({H_kv}, n, {d_k}) and ({H_kv}, n, {d_v}) "
                f"for this cache; got k {k.shape}, v {v.shape}"
            )
        order = list(self._tables).index(seq_id)
        counts = np.zeros(len(self._tables), np.int64)
        counts[order] = k.shape[1]
        # Every sequence's rows are these views (without copies): only seq_id's are read.
        B = len(self._tables)
        self._append(np.broadcast_to(k, (B, *k.shape)), np.broadcast_to(v, (B, *v.shape)), counts)
        self._commit(counts)

    # Used by the attention calls (the protocol KVCache keeps too) -----------------------

    @property
    def window(self) -> int | None:
        """``None``: a paged cache keeps every position (a call may still attend within a
        window, which skips the tiles outside it).

        >>> PagedKVCache(4, 16, 1, 8).window is None
        True
        """
        return None

    @property
    def sink_tokens(self) -> int:
        """0: without a window, no positions are kept apart.

        >>> PagedKVCache(4, 16, 1, 8).sink_tokens
        0
        """
        return 0

    @property
    def values_in_keys(self) -> bool:
        """``False``: keys and values have pools of their own.

        >>> PagedKVCache(4, 16, 1, 8).values_in_keys
        False
        """
        return False

    @property
    def batch_size(self) -> int:
        """The sequences held: the batch of the calls that take the cache.

        >>> cache = PagedKVCache(4, 16, 1, 8); cache.add(1); cache.add(2); cache.batch_size
        2
        """
        return len(self._tables)

    @property
    def first(self) -> np.ndarray:
        """The first position each sequence holds: 0 (a paged cache drops nothing).

        >>> cache = PagedKVCache(4, 16, 1, 8); cache.add(1); cache.first
        array([0])
        """
        return np.zeros(len(self._tables), np.int64)

    def _known(self, seq_id: Hashable) -> Hashable:
        try:
            if seq_id in self._tables:
                return seq_id
        except TypeError:
            pass
        raise AttentionValueError(
            f"no sequence {seq_id!r} in the cache (it holds {reprlib.repr(list(self._tables))})"
        )

    def _let_go(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
                self._keys.forget(block)

    def _check_fit(self, batch: int, heads: int, d_k: int, d_v: int, where: str) -> None:
        H_kv, width, value_width = self._widths
        if (batch, heads, d_k, d_v) != (len(self._tables), H_kv, width, value_width):
            raise ShapeError(
                f"the new keys and values (batch {batch}, {heads} key/value heads, widths "
                f"{d_k} and {d_v}) do not fit the cache ({len(self._tables)} sequences, "
                f"{H_kv} key/value heads, widths {width} and {value_width}): {self!r}{where}"
            )

    def _append(self, k: np.ndarray, v: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Write the first ``counts[b]`` new rows of sequence ``b`` after its length, taking
        free blocks (and copying a shared last block before writing into it); returns each
        sequence's filled length. The lengths advance only at :meth:`_commit`. Refused before
        anything changes when the pool has too few free blocks."""
        size = self.block_size
        ids = list(self._tables)
        if self._keys.quantization is not None:  # codes hold finite numbers of float16's range
            for name, x in (("keys", k), ("values", v)):
                if counts.size and (counts == counts[0]).all():  # (a decoding step: at once)
                    given = [x[:, :, : int(counts[0])]]
                else:
                    given = [x[b, :, : int(n)] for b, n in enumerate(counts) if n]
                if not all(_within_float16(g) for g in given):
                    raise AttentionValueError(
                        f"a quantized cache holds finite {name} within float16's range "
                        f"(|x| <= 65504), scaled per group: these are not ({self!r})"
                    )
        plans = []
        needed = 0
        for b, s in enumerate(ids):
            n, held, blocks = int(counts[b]), self._lengths[s], self._tables[s]
            first = held // size  # the block the first new token goes in
            last = -(-(held + n) // size)  # blocks the sequence then needs
            # A block shared when the call began is never written, even by its last holder:
            # another holder may hold the rows written (after a truncate), and a call that
            # fails afterwards gives the blocks back as they were.
            shared = bool(n > 0 and held % size and self._refs[blocks[first]] > 1)
            # Nor is one whose rows before the length the append would change (KIVI's keys,
            # a quantized group reopened after a truncate): it is copied too.
            copy = shared or bool(
                n > 0 and held % size and self._keys.rewrites(blocks[first], held % size)
            )
            needed += max(0, last - len(blocks)) + copy
            plans.append((n, held, first, last, copy))
        if needed > len(self._free):
            raise PoolExhaustedError(
                f"the pool has {len(self._free)} free blocks but this append needs {needed} "
                f"(tokens per sequence {counts.tolist()}): {self!r}; release sequences or "
                "make a larger pool"
            )
        writes: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # quantized at once
        replaced = []  # given back only once every block is taken: a block freed here and
        # taken again by the next sequence would be written, and a call that then fails
        # would give the table back a block whose rows are lost
        for b, (s, (n, held, first, last, copy)) in enumerate(zip(ids, plans, strict=True)):
            if n == 0:
                continue
            blocks = self._tables[s]
            if copy:  # copy on write: this sequence's own copy of the block
                fresh = self._free.pop()
                self._keys.copy_block(blocks[first], fresh)
                self._values.copy_block(blocks[first], fresh)
                replaced.append(blocks[first])
                self._refs[fresh] = 1
                blocks[first] = fresh
            while len(blocks) < last:
                fresh = self._free.pop()
                self._refs[fresh] = 1
                blocks.append(fresh)
            at = held
            while at < held + n:  # block by block: (H_kv, rows, d) into (rows, H_kv, d)
                block, offset = divmod(at, size)
                rows = min(size - offset, held + n - at)
                target = blocks[block]
                new = slice(at - held, at - held + rows)
                writes.append((target, offset, k[b, :, new], v[b, :, new]))
                at += rows
        self._keys.write_many([(t, o, rows) for t, o, rows, _ in writes])
        self._values.write_many([(t, o, rows) for t, o, _, rows in writes])
        self._let_go(replaced)
        filled: np.ndarray = np.array([self._lengths[s] for s in ids], np.int64) + counts
        return filled

    def _commit(self, counts: np.ndarray) -> None:
        for s, n in zip(list(self._tables), counts, strict=True):
            self._lengths[s] += int(n)

    def _snapshot(self) -> tuple[Any, ...]:
        """What an append changes (tables, reference counts, the free list, KIVI's
        residual); the rows it writes lie in blocks only their sequence held when the call
        began (past its length) or in blocks taken from the free list."""
        return (
            {s: list(t) for s, t in self._tables.items()},
            self._refs.copy(),
            list(self._free),
            self._keys.state(),
        )

    def _restore(self, state: tuple[Any, ...]) -> None:
        self._tables, self._refs, self._free = state[0], state[1], state[2]
        self._keys.restore(state[3])

    def _attended(self, S: int) -> tuple[PagedKV, PagedKV]:
        """The keys and values of every sequence, ``(B, H_kv, S, d)`` as the kernel reads
        them: from the blocks, tile by tile."""
        table = self.block_table()
        if table.shape[1] == 0:
            table = np.zeros((table.shape[0], 1), np.int64)
        return self._keys.tiles(table, S), self._values.tiles(table, S)


def _within_float16(x: np.ndarray) -> bool:
    """Whether every value of ``x`` is finite and within float16's range."""
    return bool(np.isfinite(x).all()) and float(np.abs(x).max(initial=0)) <= 65504


KINDS = ("int8", "int4", "kivi8", "kivi4", "fp8")
"""The quantized caches: per token in 8 or 4 bits, KIVI's (keys per channel, values per
token) in 8 or 4 bits, or per token in float8 e4m3 (a scale per group of channels)."""


def _quantization(
    quantize: Any, group_size: Any, block_size: int, d_k: int, d_v: int, dtype: np.dtype
) -> tuple[Quantization | None, Quantization | None]:
    """The keys' and the values' quantization for the cache's ``quantize`` and
    ``group_size`` (default 32), checked against its block size and widths."""
    if quantize is None:
        if group_size is not None:
            raise AttentionValueError(
                f"group_size={group_size!r} sets the groups of a quantized cache, but no "
                "quantize= was given: give quantize= too ('int8', 'int4', 'kivi8', 'kivi4' "
                "or 'fp8'), or leave group_size out"
            )
        return None, None
    if group_size is None:
        group_size = 32
    if quantize not in KINDS:
        raise AttentionValueError(
            f"quantize must be None, 'int8', 'int4', 'kivi8', 'kivi4' or 'fp8'; got {quantize!r}"
        )
    bits = int(quantize[-1])
    group = positive_int("group_size", group_size)
    if bits == 4 and group not in (32, 64):
        raise AttentionValueError(f"quantize={quantize!r} takes group_size 32 or 64; got {group}")
    if d_k % group or d_v % group:
        raise AttentionValueError(
            f"group_size={group} must divide head_dim={d_k} and value_dim={d_v}: each group "
            "of channels shares one scale and zero point"
        )
    per_channel = quantize.startswith("kivi")
    if per_channel and block_size % group:
        raise AttentionValueError(
            f"quantize={quantize!r} quantizes each key channel over groups of "
            f"group_size={group} tokens, which lie within blocks: block_size={block_size} "
            "must be a multiple of group_size"
        )
    if dtype != np.float32:
        raise AttentionValueError(
            f"a quantized cache is read back in float32: give dtype=float32 (got {dtype})"
        )
    float8 = quantize == "fp8"
    if float8:
        _float8()  # ml_dtypes is there, or the cache is refused with the extra to install
    values = Quantization(bits=bits, group=group, float8=float8)
    return Quantization(bits=bits, group=group, per_channel=per_channel, float8=float8), values


class _Pool:
    """The keys' (or the values') blocks: float arrays, or a quantized cache's codes with
    their scales and zero points. Each is ``(blocks, block_size, H_kv, width)`` as vLLM lays
    its pool out (per channel, the scales ``(blocks, block_size / group, H_kv, d)``), stored
    head-major, as the kernel reads them (one head at a time; heads interleaved row by row
    took 3.6 times as long for a decoding step of 64 sequences): the rows (values or codes)
    of each head across the whole pool, a head's rows of consecutive blocks one after
    another; the scales and zero points so too. A sequence whose blocks follow each other
    (a prompt appended at once into a fresh cache) is then one stream per head; measured on
    the Zen 5 EPYC (znver5) against rows kept block by block (a block's heads
    together), a decoding step of 64 sequences of 128 to 4,096 tokens took 0.79-0.85 of the
    time (float32, bfloat16, int8; int4 the same) with each sequence's blocks in a row,
    0.80-0.90 with its last 256 tokens' blocks taken in turn with the others', and 0.94-1.06
    with every block so (the same bits each time). The scales and zero points were kept
    block by block (faster by 1.14-1.23 times while the walk read each tile back first);
    since the products read them in place, head-major is the faster: a step at four rows
    per head over 32 sequences, int8 8.9 -> 7.6 ms, int4 8.9 -> 7.7, kivi8 8.5 -> 7.1. Per
    channel (KIVI's keys), the rows of each block's unfilled group lie in a
    :class:`.Residual` in float32 until it fills."""

    def __init__(
        self,
        count: int,
        size: int,
        H_kv: int,
        d: int,
        dtype: np.dtype,
        quantization: Quantization | None,
    ) -> None:
        self.quantization = quantization
        self.residual: Residual | None = None
        if quantization is None:
            widths = [(size, d, dtype)]
        else:
            rows, width = size, d // quantization.group  # a scale per group of channels
            if quantization.per_channel:  # a scale per channel and group of tokens
                rows, width = size // quantization.group, d
                self.residual = Residual(quantization.group, np.zeros(count, np.int64))
            half = np.dtype(np.float16)
            widths = [
                (size, quantization.code_width(d), np.dtype(np.uint8)),
                (rows, width, half),
                (rows, width, half),
            ]
        # each (blocks, block_size or groups, H_kv, width) as it is seen, head-major in memory
        # (a head's 128 bytes of scales of a block were 1 KiB from its next block's before)
        self.arrays = [
            np.zeros((H_kv, count, n, w), kind).transpose(1, 2, 0, 3) for n, w, kind in widths
        ]

    @property
    def nbytes(self) -> int:
        held = 0 if self.residual is None else sum(r.nbytes for r in self.residual.rows.values())
        return sum(int(array.nbytes) for array in self.arrays) + held

    def write(self, block: int, offset: int, rows: np.ndarray) -> None:
        """Rows ``(H_kv, n, d)`` at ``offset`` of ``block`` (quantized first, if so)."""
        if self.residual is not None:
            self._write_per_channel(block, offset, rows)
            return
        parts = [rows] if self.quantization is None else self.quantization.quantize(rows)
        for array, part in zip(self.arrays, parts, strict=True):
            array[block, offset : offset + rows.shape[1]] = part.transpose(1, 0, 2)

    def write_many(self, writes: list[tuple[int, int, np.ndarray]]) -> None:
        """Each ``(block, offset, rows (H_kv, n, d))`` of ``writes`` in turn, as
        :meth:`write`; a quantized pool's rows per token quantized in one call (a decoding
        step of 64 sequences quantized its 128 rows in 0.5 ms one by one, NumPy's cost per
        call)."""
        if self.residual is not None or self.quantization is None or len(writes) < 2:
            for block, offset, rows in writes:
                self.write(block, offset, rows)
            return
        parts = self.quantization.quantize(np.concatenate([w[2] for w in writes], axis=1))
        counts = [rows.shape[1] for _, _, rows in writes]
        blocks = np.repeat([block for block, _, _ in writes], counts)
        starts = np.repeat([offset for _, offset, _ in writes], counts)
        offsets = starts + np.arange(len(blocks)) - np.repeat(np.cumsum(counts) - counts, counts)
        for array, part in zip(self.arrays, parts, strict=True):
            array[blocks, offsets] = part.transpose(1, 0, 2)

    def _write_per_channel(self, block: int, offset: int, rows: np.ndarray) -> None:
        """KIVI's keys: rows into the block's residual, each group of tokens quantized per
        channel when it fills. A write inside a quantized group (after a truncate) first
        reads the group back into the residual: its rows before ``offset`` as the values
        their codes stand for, quantized again with the new rows when it fills."""
        residual, quantization = self.residual, self.quantization
        assert residual is not None and quantization is not None
        T, (H_kv, n, d) = residual.group, rows.shape
        if offset < residual.sealed[block]:
            self._reopen(block, offset)
        at = 0
        while at < n:
            start = int(residual.sealed[block])  # the first row of the group filling
            recent = residual.rows.get(block)
            if recent is None:
                recent = residual.rows[block] = np.zeros((H_kv, T, d), np.float32)
            row = offset + at - start
            take = min(T - row, n - at)
            recent[:, row : row + take] = rows[:, at : at + take]
            at += take
            if row + take == T:  # the group is full: its codes replace the residual
                codes, scale, zero = quantization.quantize(recent)
                self.arrays[0][block, start : start + T] = codes.transpose(1, 0, 2)
                self.arrays[1][block, start // T] = scale[:, 0]
                self.arrays[2][block, start // T] = zero[:, 0]
                residual.sealed[block] = start + T
                del residual.rows[block]  # a new array for the next group: see _snapshot

    def _reopen(self, block: int, offset: int) -> None:
        """The quantized group of ``block`` holding row ``offset`` back in the residual, as
        the values its codes stand for (the rows from ``offset`` on are overwritten)."""
        residual, quantization = self.residual, self.quantization
        assert residual is not None and quantization is not None
        T = residual.group
        start = offset // T * T
        codes = self.arrays[0][block, start : start + T].transpose(1, 0, 2)
        scale, zero = (array[block, start // T][:, None] for array in self.arrays[1:])
        residual.rows[block] = quantization.dequantize(codes, scale, zero)
        residual.sealed[block] = start

    def rewrites(self, block: int, row: int) -> bool:
        """Whether writing at ``row`` of ``block`` changes the rows before it: KIVI's keys,
        inside a quantized group past its first row (after a truncate), whose rows are
        quantized again when it fills. Such a write goes to a copy of the block."""
        residual = self.residual
        return residual is not None and row < residual.sealed[block] and row % residual.group > 0

    def copy_block(self, source: int, target: int) -> None:
        for array in self.arrays:
            array[target] = array[source]
        if self.residual is not None:
            residual = self.residual
            residual.sealed[target] = residual.sealed[source]
            recent = residual.rows.get(source)
            if recent is None:
                residual.rows.pop(target, None)
            else:
                residual.rows[target] = recent.copy()

    def forget(self, block: int) -> None:
        """``block`` is free: its residual, if any, is dropped."""
        if self.residual is not None:
            self.residual.sealed[block] = 0
            self.residual.rows.pop(block, None)

    def state(self) -> tuple[np.ndarray, dict[int, np.ndarray]] | None:
        """What an append changes besides the rows past the lengths: which rows of each
        block are codes and the residual's arrays (each written only past a length, and
        replaced, not rewritten, when its group fills)."""
        if self.residual is None:
            return None
        return self.residual.sealed.copy(), dict(self.residual.rows)

    def restore(self, state: tuple[np.ndarray, dict[int, np.ndarray]] | None) -> None:
        if self.residual is not None and state is not None:
            self.residual.sealed[:] = state[0]
            self.residual.rows.clear()
            self.residual.rows.update(state[1])

    def tiles(self, table: np.ndarray, S: int) -> PagedKV:
        if self.quantization is None:
            return PagedKV(self.arrays[0], table, S)
        codes, scales, zeros = self.arrays
        return PagedKV(codes, table, S, self.quantization, scales, zeros, self.residual)

    def read(self, blocks: list[int], n: int) -> np.ndarray:
        """The first ``n`` positions of ``blocks`` ``(H_kv, n, d)`` as the kernel reads them
        (in float32 when quantized)."""
        table = np.array([blocks or [0]], np.int64)
        rows: np.ndarray = self.tiles(table, n)[0].tile(0, n)
        return rows
