"""Which walk computes a call, and the compiled walks' Python side: the arrays as the
compiled code takes them, the plan of work items and the thread team. The walks themselves
are numba code (:mod:`._numba_walk`, run through :mod:`.compiled`); whatever they cannot do
goes to the NumPy walk (:mod:`.forward`, :mod:`.backward`).

**The choice.** Each walk declares the features of a call it supports (:class:`Walk`), and
:func:`choose` takes the first that supports all of a call's. A call's features are derived
from its objects (:func:`features`): every field of its :class:`.call.KernelCall`, its
visibility, its scores and dropout, and its :class:`.call.Outputs` or
:class:`.call.Gradients`, that is set to other than its default, by name, and what its
operands are. A new option is a new field, so a walk that does not declare it never takes
the calls that set it. The compiled walks support a band of hidden keys (the causal mask,
the window, the lengths, each sequence's alignment), chunks, a ``mask_mod`` through its
block map, soft-capping and ALiBi computed in their score loop (:func:`variants_of`), sinks
added after (as everywhere), float32 or float64 throughout; the NumPy walk supports every
call. A call the compiled walk supports still goes to the NumPy walk when its arrays are
not ones the compiled code can read as they are (:func:`walk_views`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import compiled, runtime, tasks
from .call import Gradients, KernelCall, Outputs
from .paged import FLOAT, FLOAT_FORM, LANES, PagedKV, stored_kind, stored_pool
from .scores import Alibi, SoftCap
from .tasks import Parts, Task, batch_index
from .team import Team
from .walk_inputs import band_of, narrow_rows, no_variants, variants_of

__all__ = [
    "COMPILED_BACKWARD",
    "COMPILED_FORWARD",
    "NUMPY",
    "ForwardPlan",
    "Walk",
    "backward_walkable",
    "choose",
    "dtype_feature",
    "features",
    "forward_walkable",
    "run_backward",
    "run_forward",
    "run_lone",
    "scratch_shapes",
    "walk_views",
]

# thresholds.walk_rows: query rows (per query head) of a compiled walk's work item, at
# most (256). Its tile of scores, 256 x 512 (512 KiB in float32), stays close to a core's
# L2 cache between the two GEMMs and the softmax step, and BLAS packs each key tile for
# twice the rows it did at 128: S2 and S4 ran 5-7% faster in float32 (1.20 -> 1.14 and
# 1.12 -> 1.05 of torch's SDPA, interleaved, on the Zen 5 EPYC; float64 3-8%), as
# torch's own kernel tiles them (256 query rows for long sequences).


@dataclass(frozen=True)
class Walk:
    """A tile walk: the features of a call it supports (:func:`features`; ``None``: every
    one), and whether it can run in this process."""

    name: str
    supports: frozenset[str] | None
    available: Callable[[], bool] = lambda: True

    def takes(self, needs: Iterable[str]) -> bool:
        """Whether this walk computes a call with the features ``needs`` (read until the
        first it does not support)."""
        supports = self.supports
        return (supports is None or all(need in supports for need in needs)) and self.available()


_BAND = frozenset(
    {
        "visibility.causal",
        "visibility.window",
        "visibility.causal_offset",
        "visibility.offsets",
        "visibility.ahead",
        "visibility.key_lengths",
        "visibility.query_lengths",
        # the positions (chunks, mask_mod, ALiBi: :func:`variants_of`)
        "visibility.query_index",
        "visibility.key_index",
        "visibility.sequences",
    }
)
_VARIANTS = frozenset(
    {
        "visibility.chunk",
        "visibility.mask_mod",  # with its block map and partial blocks' masks kept
        "visibility.blocks",
        "visibility.partial",
        "visibility.memo",
        "scores.transforms",  # of these kinds (:func:`_transform_features`)
        "score softcap",
        "score alibi",
    }
)
_PLAIN = frozenset({"scores", "scores.sinks", "budget", "dtype float32", "dtype float64"})

COMPILED_FORWARD = Walk(
    "compiled forward",
    _BAND | _VARIANTS | _PLAIN | {"lse", "paged keys and values", "stored keys and values"},
    lambda: compiled.walk_available(),
)
"""The compiled forward walk: a band and the variants it computes itself, float32 or float64,
arrays or a paged cache's pools; keys and values stored narrower (bfloat16, float16, a
quantized cache's codes) read back in float32 as it goes."""

COMPILED_BACKWARD = Walk(
    "compiled backward",
    _BAND | _VARIANTS | _PLAIN | {"dsinks", "dq_factor"},
    lambda: compiled.walk_available(),
)
"""The compiled backward walk: the forward's calls, of arrays."""

NUMPY = Walk("numpy", None)
"""The NumPy walk (:mod:`.forward`, :mod:`.backward`): every call."""


def choose(
    walks: tuple[Walk, ...],
    call: KernelCall,
    destination: Outputs | Gradients,
    arrays: tuple[Any, ...],
) -> Walk:
    """The first of ``walks`` that takes the call (:meth:`Walk.takes` of its
    :func:`features`, found one by one: the first a walk lacks ends the search); the NumPy
    walk when none does."""
    for walk in walks:
        if walk.takes(_features(call, destination, arrays)):
            return walk
    return NUMPY


def features(
    call: KernelCall, destination: Outputs | Gradients, arrays: tuple[Any, ...]
) -> frozenset[str]:
    """What a call asks of a walk: the name of each field of ``call`` and of ``destination``
    set to other than its default (``"dropout"``, ``"lse"``), and of the fields of those
    that are objects of this kind in turn (``"visibility.window"``, ``"scores.sinks"``);
    fields without a default (the operands, the shapes) are every call's. Then what its
    operands are: ``"paged keys and values"`` (or ``"paged keys or values"``), ``"stored
    keys and values"`` when both are stored narrower than float32, the compute dtype of the
    rest (bfloat16, float16, quantized: :func:`stored`); and of the walk's ``arrays``,
    ``"empty"`` when one is, and ``"dtype float32"`` when all are float32 (``"dtypes mixed"``
    when they differ, or one of keys and values alone is stored)."""
    return frozenset(_features(call, destination, arrays))


def _features(
    call: KernelCall, destination: Outputs | Gradients, arrays: tuple[Any, ...]
) -> Iterator[str]:
    yield from _set_fields(call, "")
    yield from _set_fields(destination, "")
    if call.scores is not None and call.scores.transforms:
        yield from _transform_features(call.scores.transforms)
    visibility = call.visibility
    if visibility.mask_mod is not None and visibility.partial is None:
        yield "mask_mod unmapped"  # not classified, or too many partial blocks to keep
    k_paged, v_paged = isinstance(call.k, PagedKV), isinstance(call.v, PagedKV)
    if k_paged or v_paged:
        yield "paged keys and values" if k_paged and v_paged else "paged keys or values"
    dtypes, narrow = set(), 0
    for x in arrays:
        read = x.pool if isinstance(x, PagedKV) else x
        if read.size == 0:
            yield "empty"
        if (x is call.k or x is call.v) and stored(x):
            narrow += 1
        else:
            dtypes.add(read.dtype)
    if narrow:
        yield "stored keys and values"
        if narrow != 2 or dtypes != {np.dtype(np.float32)}:
            dtypes.add(None)  # read back in float32 only, keys and values both
        elif not (_vectors_fit(call.k) and _vectors_fit(call.v)):
            yield "stored groups apart from vectors"
    yield dtype_feature(dtypes.pop()) if len(dtypes) == 1 else "dtypes mixed"


def _vectors_fit(x: np.ndarray | PagedKV) -> bool:
    """Whether stored keys or values ``x`` are read back whole vectors at a time by the
    compiled walk: rows, and groups of channels sharing a scale, of a multiple of its
    vectors' values (:data:`.paged.LANES`)."""
    quantization = x.quantization if isinstance(x, PagedKV) else None
    groups = quantization is None or quantization.per_channel or quantization.group % LANES == 0
    return x.shape[-1] % LANES == 0 and groups


def stored(x: np.ndarray | PagedKV) -> bool:
    """Whether keys or values ``x`` are stored narrower than float32 (bfloat16, float16,
    a quantized cache's codes), for the compiled forward walk to read back as it goes."""
    if isinstance(x, PagedKV):
        return stored_kind(x.quantization, x.pool.dtype) != FLOAT
    dtype = x.dtype
    return not (dtype.kind == "f" and dtype.itemsize >= 4) and stored_kind(None, dtype) != FLOAT


def _transform_features(transforms: tuple[Any, ...]) -> Iterator[str]:
    """A feature for each change to the scores: ``"score softcap"``, ``"score alibi"`` (its
    signed form), else the transform's kind (``"score ScoreMod"``, ``"score symmetric
    alibi"``), which no compiled walk supports."""
    for transform in transforms:
        if isinstance(transform, SoftCap):
            yield "score softcap"
        elif isinstance(transform, Alibi):
            yield "score symmetric alibi" if transform.symmetric else "score alibi"
        else:
            yield f"score {type(transform).__name__}"


@functools.cache
def dtype_feature(dtype: np.dtype) -> str:
    """The feature of arrays all of ``dtype`` (:func:`features`)."""
    return f"dtype {dtype.name}"


def _set_fields(obj: Any, prefix: str) -> list[str]:
    """``prefix + name`` of each field of the dataclass ``obj`` set to other than its default,
    and of the set fields of those that are dataclasses, in turn. (A list, each class's
    fields read once: a small call's scan costs a microsecond or two.)"""
    found = []
    for name, default, named in _fields_of(obj.__class__, prefix):
        value = getattr(obj, name)
        if value is default:  # most are: None, 0, False
            continue
        if default is not _NO_DEFAULT and (isinstance(value, np.ndarray) or value != default):
            found.append(named)
        if _is_dataclass(value.__class__):
            found += _set_fields(value, named + ".")
    return found


_NO_DEFAULT = dataclasses.MISSING


@functools.cache
def _fields_of(kind: Any, prefix: str) -> tuple[tuple[str, Any, str], ...]:
    """Each field of the dataclass ``kind``: its name, its default (``MISSING``: none), and
    its name after ``prefix``."""
    return tuple((f.name, f.default, prefix + f.name) for f in dataclasses.fields(kind))


@functools.cache
def _is_dataclass(kind: Any) -> bool:
    return dataclasses.is_dataclass(kind)


def forward_walkable(call: KernelCall, outputs: Outputs) -> list[np.ndarray] | None:
    """The arrays as the compiled walk takes them (:func:`walk_views`; a paged cache's
    pools as they are) when it computes this call (:func:`choose`), else ``None``."""
    lse = outputs.lse
    written = (outputs.out,) if lse is None else (outputs.out, lse[..., None])
    q, k, v = call.q, call.k, call.v
    arrays = (q, k, v, *written)  # (lse's view: its dtype and size)
    if choose((COMPILED_FORWARD, NUMPY), call, outputs, arrays) is NUMPY:
        return None
    if not isinstance(k, PagedKV):
        return walk_views((q, k, v), written, operands=(q, k, v))
    if not all(map(_pool_rows, (k.pool, v.pool))):
        return None
    views = walk_views((q,), written, operands=(q,))
    return None if views is None else [views[0], k.pool, v.pool, *views[1:]]


def walk_views(
    inputs: tuple[np.ndarray, ...],
    outputs: tuple[np.ndarray, ...],
    operands: tuple[np.ndarray, ...],
) -> list[np.ndarray] | None:
    """``inputs`` and ``outputs`` ``(*batch, a, b, c)`` as views ``(B, a, b, c)`` with one
    batch axis, for the compiled walks; ``None`` when one cannot be taken as it is: not
    aligned, an output not writeable, a stride not a whole number of elements, batch axes
    that do not merge without a copy, or a GEMM operand (of ``operands``) whose matrices'
    rows BLAS cannot read (:func:`_blas_rows`)."""
    views = []
    for x in (*inputs, *outputs):
        size = x.itemsize
        if not x.flags.aligned or not all(stride % size == 0 for stride in x.strides):
            return None
        view = _merged_batch(x)
        if view is None:
            return None
        views.append(view)
    if not all(x.flags.writeable for x in outputs) or not all(map(_blas_rows, operands)):
        return None
    return views


def _pool_rows(pool: np.ndarray) -> bool:
    """Whether a pool ``(blocks, block, H_kv, d)``'s rows are ones BLAS can read: aligned,
    each row contiguous, a block's rows in order and apart."""
    size = pool.itemsize
    return (
        pool.flags.aligned
        and all(stride % size == 0 for stride in pool.strides)
        and pool.strides[3] == size
        and (pool.shape[1] == 1 or pool.strides[1] >= pool.shape[3] * size)
    )


def _blas_rows(x: np.ndarray) -> bool:
    """Whether the matrices of ``x (..., n, d)`` are rows BLAS can read and write: each row
    contiguous, rows in order (not broadcast, not reversed, not overlapping)."""
    return x.strides[-1] == x.itemsize and (
        x.shape[-2] == 1 or x.strides[-2] >= x.shape[-1] * x.itemsize
    )


PACK_FROM_TILES = 4
"""Tiles of query rows from which keys and values whose rows lie apart are copied first."""

PACK_MOST = 16 * 2**20
"""The largest keys (and values) copied so: beyond, the copies' memory would outgrow the
64 MiB the kernel promises to stay within beside the call's inputs and outputs."""


def _packed(x: np.ndarray, L: int, rows: int) -> np.ndarray:
    """Keys or values ``x (B, H, S, d)`` with each head's rows adjacent: a copy when they lie
    apart (as a fused projection leaves them, between the queries') and ``L`` queries in
    tiles of ``rows`` read them at least ``PACK_FROM_TILES`` times. Rows thousands of bytes
    apart cost BLAS's packing more than one copy does (measured on S4: 15% of the attention's
    time); read once or twice (S3), the copy costs more than it saves. At most
    ``PACK_MOST`` bytes are copied."""
    if x.shape[-2] == 1 or x.strides[-2] == x.shape[-1] * x.itemsize or x.nbytes > PACK_MOST:
        return x
    return np.ascontiguousarray(x) if -(-L // rows) >= PACK_FROM_TILES else x


def _merged_batch(array: np.ndarray) -> np.ndarray | None:
    """``array (*batch, a, b, c)`` as a view ``(B, a, b, c)`` (the last three axes as they
    are: a transposed view stays one), or ``None`` when the batch axes do not merge without
    a copy."""
    if array.ndim == 4:
        return array
    if array.ndim == 3:
        return array[None]
    sized = [
        (n, stride)
        for n, stride in zip(array.shape[:-3], array.strides[:-3], strict=True)
        if n != 1
    ]
    if any(s0 != s1 * n1 for (_, s0), (n1, s1) in itertools.pairwise(sized)):
        return None
    shape = (math.prod(array.shape[:-3]), *array.shape[-3:])
    strides = (sized[-1][1] if sized else 0, *array.strides[-3:])
    merged: np.ndarray = np.lib.stride_tricks.as_strided(
        array, shape, strides, writeable=array.flags.writeable
    )
    return merged


def run_forward(
    call: KernelCall,
    views: list[np.ndarray],
    tiles: Any,
    team: Team,
    flip_below: int,
    product_chunk: int,
) -> tuple[list[Task], Parts | None]:
    """Run the call's work items as compiled code, one call of it per worker, on ``views``
    (:func:`forward_walkable`'s); returns the items it left to the NumPy walk and the split
    keys' partial results, if any. Tiles of fewer than ``flip_below`` rows take ``k @
    q^T``, and ``p @ v`` in runs of ``product_chunk`` keys (the NumPy walk's choices,
    :mod:`.forward`)."""
    plan = ForwardPlan(call, tiles, team.workers, flip_below, product_chunk)
    failed, parts = plan.run(views, call.k, team, call.v)
    left: list[Task] = []
    group = call.group
    for t in plan.table[failed] if failed.any() else ():
        batch = batch_index(t[0], plan.batch_shape)
        kv = slice(int(t[1]), int(t[1]) + 1)
        item = call.visibility.item(batch, slice(kv.start * group, kv.stop * group))
        part = None if t[6] < 0 else int(t[6])
        left.append(Task(batch, kv, item, int(t[2]), int(t[3]), int(t[4]), int(t[5]), part))
    return left, parts


class ForwardPlan:
    """What the compiled forward walk does for a call, worked out from the shapes and the
    visibility alone: its table of tasks, longest first, and, when there are fewer than
    ``workers``, the split of their keys. It keeps no array of the call's, so a call of the
    same shapes, dtype and options runs the same plan again (:mod:`mha.api.plans` keeps
    them); :meth:`run` takes the arrays. ``flip_below`` and ``product_chunk`` as
    :func:`run_forward`'s."""

    def __init__(
        self, call: KernelCall, tiles: Any, workers: int, flip_below: int, product_chunk: int
    ) -> None:
        q_shape, k = call.q.shape, call.k
        L, self.d_k = q_shape[-2:]
        H_kv, S = k.shape[-3], k.shape[-2]
        self.batch_shape = batch_shape = q_shape[:-3]
        self.d_v, self.dtype, self.scale = call.v.shape[-1], call.q.dtype, call.scale
        self.band = band_of(call.visibility, batch_shape, L, S)
        self.variants = variants_of(call, batch_shape)
        self.rows = max(1, min(tiles.rows, runtime.DEFAULT.thresholds.walk_rows))
        self.rows = min(self.rows, narrow_rows(call.visibility))
        self.L, self.group, self.cols = L, call.group, tiles.cols
        self.R, self.paged = self.group * self.rows, isinstance(k, PagedKV)
        self.stored = stored(k)  # read back as the walk goes (then stored(call.v) too)
        self.flip_below = flip_below
        self.sizes = (self.scale, self.cols, flip_below, product_chunk)
        B = math.prod(batch_shape)
        table = compiled.plan_walk(
            self.dtype, B, H_kv, L, self.rows, self.band, self.variants, self.group
        )
        self.split: tuple[list[Task], list[list[Task]]] | None = None
        if 0 < len(table) < workers:  # few items (decoding): split their keys
            table = self._split_keys(table, workers)
        self.table = table
        size = sum(math.prod(shape) for shape in self._scratch_shapes())
        small = size * self.dtype.itemsize <= SPARE_MOST
        self.spare: list[tuple[np.ndarray, ...]] | None = [] if small else None

    def _split_keys(self, table: np.ndarray, workers: int) -> np.ndarray:
        """The table with each task's keys split into chunks for ``workers`` (when that
        gives every worker work), longest first; the split kept for :meth:`run`."""
        no_item: Any = None  # the split reads the tasks' rows and keys alone
        whole = [
            Task(
                batch_index(t[0], self.batch_shape),
                slice(int(t[1]), int(t[1]) + 1),
                no_item,
                *(int(x) for x in t[2:6]),
            )
            for t in table
        ]
        group, L, d_v, dtype = self.group, self.L, self.d_v, self.dtype
        parts = tasks.split_keys(whole, workers, self.cols, group, L, d_v, dtype)
        if parts is not None:
            self.split = parts.whole, parts.chunks
            flat = {id(task): row for task, row in zip(whole, table[:, 0], strict=True)}
            pieces = [
                [flat[id(task)], p.kv.start, p.r0, p.r1, p.start, p.stop, p.part]
                for task, chunks in zip(parts.whole, parts.chunks, strict=True)
                for p in chunks
            ]
            table = np.array(pieces, np.int64).reshape(-1, 7)
        cost = (table[:, 2] - table[:, 3]) * (table[:, 5] - table[:, 4])
        return table[np.argsort(cost, kind="stable")]  # longest first

    def run(
        self,
        views: list[np.ndarray],
        k: np.ndarray | PagedKV,
        team: Team,
        v: np.ndarray | PagedKV | None = None,
    ) -> tuple[np.ndarray, Parts | None]:
        """Run the tasks on ``views`` (:func:`forward_walkable`'s, of a call of the plan's
        shapes; ``k`` and ``v`` the call's keys and values, for a paged cache's block table
        and a stored pool's form) on ``team``: which tasks were left undone (a non-finite
        value at a hidden key), and the split keys' partial results, to merge."""
        dtype, parts = self.dtype, None
        if self.split is not None:
            parts = Parts(*self.split, self.group, self.L, self.d_v, dtype)
        lse, part_out, part_lse = _no_outputs(dtype)  # (empty: not wanted)
        if len(views) > 4:
            lse = views[4][..., 0]
        if parts is not None:
            part_out, part_lse = parts.all_out, parts.all_lse
        outputs = (views[3], lse, part_out, part_lse)
        operands = (views[0], *self._pools(views, k, k if v is None else v))
        sizes = self.sizes
        walk_call = compiled.stored_forward_walk if self.stored else compiled.forward_walk
        # per run, not per plan: concurrent calls of one plan each have their own
        work = (self.table, np.zeros(1, np.int64), np.zeros(len(self.table), bool))

        taken: list[tuple[np.ndarray, ...]] = []

        def make_walk() -> Callable[[], None]:
            scratch = self._scratch()
            taken.append(scratch)

            def walk() -> None:
                walk_call(dtype, work, operands, outputs, self.band, self.variants, sizes, scratch)

            return walk

        _walk_once_per_worker(team, work, make_walk)
        if self.spare is not None:  # (list.append and pop: one thread at a time each)
            self.spare += taken[: team.workers - len(self.spare)]
        return work[2], parts

    def bind(self, views: list[np.ndarray]) -> Callable[[], bool] | None:
        """A run of this plan on the calling thread over ``views = [q, k, v, out]`` (arrays
        of the plan's shapes, as :meth:`run` takes them), its arguments made once, for
        arrays a caller fills anew before each run (a layer's small planned call,
        :mod:`mha.api.layer_plan`): the walk and the tasks :meth:`run` gives one worker.
        The run says whether every task was done. ``None`` where :meth:`run` does more
        (split keys, paged or stored keys, keys or values it would copy first)."""
        if self.split is not None or self.paged or self.stored:
            return None
        keys, values = self._pools(views, views[1], views[2])
        if keys[0].base is not views[1] or values[0].base is not views[2]:
            return None  # (copied: a run would read the copy, not the arrays refilled)
        dtype, (lse, part_out, part_lse) = self.dtype, _no_outputs(self.dtype)
        counter, failed = np.zeros(1, np.int64), np.zeros(len(self.table), bool)
        work = (self.table, counter, failed)
        outputs = (views[3], lse, part_out, part_lse)
        arguments = (work, (views[0], keys, values), outputs, self.band, self.variants)
        sizes, scratch = self.sizes, self._new_scratch()

        def run() -> bool:
            counter[0] = 0
            failed[:] = False
            compiled.forward_walk(dtype, *arguments, sizes, scratch)
            return not failed.any()

        return run

    def _pools(
        self, views: list[np.ndarray], k: np.ndarray | PagedKV, v: np.ndarray | PagedKV
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The keys and values as the compiled walk takes them: each a pool ``(data, table,
        block, scales, zeros, form)``: a float pool's ``scales`` and ``zeros`` empty, a
        stored pool's data its bytes (:func:`.paged.stored_pool`)."""
        if isinstance(k, PagedKV) and isinstance(v, PagedKV):  # the pools as they are
            keys, values, table, block = views[1], views[2], k.table, k.block_size
            if self.stored:
                return (
                    stored_pool(keys, table, block, self.d_k, *k.stored_parts()),
                    stored_pool(values, table, block, self.d_v, *v.stored_parts()),
                )
        elif self.stored:  # bfloat16 or float16 arrays
            return _array_pools(views[1], views[2], stored=True)
        else:
            L, rows = self.L, self.rows
            return _array_pools(_packed(views[1], L, rows), _packed(views[2], L, rows))
        none = _NO_SCALES
        return (
            (keys, table, block, none, none, FLOAT_FORM),
            (values, table, block, none, none, FLOAT_FORM),
        )

    def _scratch(self) -> tuple[np.ndarray, ...]:
        """One worker's buffers: a spare one of an earlier run of this plan, or new."""
        if self.spare:
            try:
                return self.spare.pop()
            except IndexError:  # another thread's run took the last
                pass
        return self._new_scratch()

    def _new_scratch(self) -> tuple[np.ndarray, ...]:
        """One worker's buffers: ``(s, flipped, stacked, acc, m, ref, total, partial,
        k_tile, v_tile)``."""
        return tuple(np.empty(shape, self.dtype) for shape in self._scratch_shapes())

    def _scratch_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of :meth:`_new_scratch`'s buffers."""
        copied = self.paged or self.stored
        return scratch_shapes(self.R, self.cols, self.d_k, self.d_v, copied, self.flip_below)


def scratch_shapes(
    R: int, cols: int, d_k: int, d_v: int, copied: bool, flip_below: int
) -> tuple[tuple[int, ...], ...]:
    """The shapes of a forward walk's buffers for tiles of ``R`` stacked rows by ``cols``
    keys: ``(s, flipped, stacked, acc, m, ref, total, partial, k_tile, v_tile)``; tiles
    ``copied`` (from blocks apart, or read back from a stored pool) need the last two."""
    width = max(cols, 32) if copied else 0  # (a decoding step's stored rows: 32 at a time)
    return (
        (R, cols),
        (cols * min(R, flip_below),),  # few rows' tiles, transposed
        (R, d_k),
        (R, d_v),
        (R,),  # the running maximum
        (R,),  # the maximum used for exp
        (R,),  # the running sum
        (R, d_v),  # a decoding step's sums
        (width, d_k),
        (width, d_v),
    )


def run_lone(views: list[np.ndarray], band: tuple[Any, ...], scale: float, cols: int) -> bool:
    """A decoding step's compiled walk on the calling thread alone: ``views = (q, keys,
    values, out)`` (:func:`walk_views`: ``q (B, H, 1, d_k)``, ``keys`` and ``values``
    ``(B, H_kv, S, d)``, ``out (B, H, 1, d_v)``), within ``band`` (:func:`band_of`), in
    tiles of ``cols`` keys. The tasks, sizes and buffers a :class:`ForwardPlan` of one
    worker gives a call of one query row per head (its rows are one tile; its keys and
    values are read where they lie): the same walk, the same bits, without the plan's
    Python (a few of a decoding step's tens of microseconds). ``False`` when a task was
    left undone (a non-finite value at a hidden key): the caller then computes the call
    afresh (:func:`.forward.attend`)."""
    q, keys, values, out = views
    B, H, _, d_k = q.shape
    H_kv, d_v = keys.shape[1], values.shape[-1]
    dtype, tuned = q.dtype, runtime.DEFAULT.thresholds
    variants = no_variants(B, dtype)
    table = compiled.plan_walk(dtype, B, H_kv, 1, 1, band, variants, H // H_kv)
    work = (table, np.zeros(1, np.int64), np.zeros(len(table), bool))
    flip_below = tuned.wide_below_rows
    shapes = scratch_shapes(H // H_kv, cols, d_k, d_v, False, flip_below)
    scratch = tuple(np.empty(shape, dtype) for shape in shapes)
    lse, part_out, part_lse = _no_outputs(dtype)
    sizes = (scale, cols, flip_below, tuned.product_chunk)
    outputs = (out, lse, part_out, part_lse)
    operands = (q, *_array_pools(keys, values))
    compiled.forward_walk(dtype, work, operands, outputs, band, variants, sizes, scratch)
    return not work[2].any()


def _array_pools(
    keys: np.ndarray, values: np.ndarray, stored: bool = False
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Keys and values ``(B, H_kv, S, d)`` as the compiled walk's pools: one block per
    sequence, ``(B, S, H_kv, d)`` views of the arrays (float pools: no scales), or of their
    bytes when ``stored`` (bfloat16, float16: :func:`.paged.stored_pool`)."""
    B, S = keys.shape[0], keys.shape[2]
    blocks, block, none = np.arange(B, dtype=np.int64)[:, None], max(S, 1), _NO_SCALES
    k, v = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
    if stored:
        return (
            stored_pool(k, blocks, block, keys.shape[-1]),
            stored_pool(v, blocks, block, values.shape[-1]),
        )
    return (k, blocks, block, none, none, FLOAT_FORM), (v, blocks, block, none, none, FLOAT_FORM)


SPARE_MOST = 256 * 2**10
"""The largest buffers of a worker (bytes) that a plan keeps between its runs, one set per
worker: allocating them costs a small call (one head of 16 queries) about 2 us of its 25,
and a plan kept holds them (:mod:`mha.api.plans` keeps at most 64)."""

_NO_SCALES = np.empty((0, 0, 0, 0), np.uint16)
"""A float pool's scales and zero points (a quantized pool's, float16 as their bits)."""


@functools.cache
def _no_outputs(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The outputs a compiled forward walk is not given, empty: the log-sum-exp, and the
    split keys' partial results (never written: the walk writes no element of them)."""
    return np.empty((1, 1, 0), dtype), np.empty((0, 1, 1, 1), dtype), np.empty((0, 1, 1), dtype)


# thresholds.backward_rows: query rows (per query head) of a tile of the compiled backward
# walk, at most (512; the backward benchmark's figures are at this size).


def _walk_once_per_worker(
    team: Team, work: tuple[np.ndarray, ...], make_walk: Callable[[], Callable[[], None]]
) -> None:
    """Run a compiled walk once on each of ``team``'s workers (``make_walk()`` makes a
    worker's, with its buffers); each takes tasks from the counter of ``work = (tasks,
    counter, failed)`` until none are left (longest first), so a worker that starts late,
    or runs slower, takes fewer, and none waits on Python's lock between tasks. A worker
    that finds them all taken runs no walk. (Runs of tasks dealt out in advance, two per
    worker in the forward and four in the backward, lost up to a whole run's time whenever
    one core ran slow, and a helper woken late found the caller busy on a run it could have
    shared.)"""
    table, counter = work[0], work[1]
    if team.workers == 1 or len(table) <= 1:  # one walk, in this thread (Team.run's)
        walk = make_walk()
        if counter[0] < len(table):
            walk()
        return

    def make_worker() -> Callable[[int], None]:
        walk = make_walk()

        def run(_: int) -> None:
            if counter[0] < len(table):  # else the other workers took every task
                walk()

        return run

    team.run(list(range(max(1, min(team.workers, len(table))))), make_worker)


def backward_walkable(
    call: KernelCall, forward: Outputs, grad_out: np.ndarray, grads: Gradients
) -> bool:
    """Whether the compiled walk computes these gradients (:func:`choose`, and arrays it can
    read as they are)."""
    arrays = _backward_arrays(call, forward, grad_out, grads)
    return (
        choose((COMPILED_BACKWARD, NUMPY), call, grads, arrays) is not NUMPY
        and _backward_views(call, forward, grad_out, grads) is not None
    )


def _backward_arrays(
    call: KernelCall, forward: Outputs, grad_out: np.ndarray, grads: Gradients
) -> tuple[Any, ...]:
    """The arrays the compiled backward walk reads and writes."""
    operands, gradients = (call.q, call.k, call.v), (grads.dq, grads.dk, grads.dv)
    return (*operands, forward.out, forward.lse, grad_out, *gradients)


def _backward_views(
    call: KernelCall, forward: Outputs, grad_out: np.ndarray, grads: Gradients
) -> list[np.ndarray] | None:
    """:func:`walk_views` of the backward's arrays: ``q, k, v, out, lse[..., None],
    grad_out`` and ``dq, dk, dv``."""
    q, k, v, out, lse = call.q, call.k, call.v, forward.out, forward.lse
    assert lse is not None  # the backward reads the forward's log-sum-exp
    inputs, outputs = (q, k, v, out, lse[..., None], grad_out), (grads.dq, grads.dk, grads.dv)
    return walk_views(inputs, outputs, operands=(q, k, v, grads.dk, grads.dv))


def run_backward(
    call: KernelCall,
    forward: Outputs,
    grad_out: np.ndarray,
    grads: Gradients,
    tiles: Any,
    team: Team,
) -> list[tuple[tuple[int, ...], slice]]:
    """The gradients as compiled code, one task per ``(sequence, key/value head)``; returns
    the items it left to the NumPy walk."""
    q = call.q
    L, d_k, d_v, S = q.shape[-2], q.shape[-1], call.v.shape[-1], call.k.shape[-2]
    views = _backward_views(call, forward, grad_out, grads)
    assert views is not None  # checked by backward_walkable
    q4, k4, v4, out4, lse4, do4, dq4, dk4, dv4 = views
    band = band_of(call.visibility, q.shape[:-3], L, S)
    variants = variants_of(call, q.shape[:-3])
    capped = variants[4] != 0.0
    rows = max(1, min(tiles.rows, runtime.DEFAULT.thresholds.backward_rows))
    rows = min(rows, narrow_rows(call.visibility))
    operands = (q4, _packed(k4, L, rows), _packed(v4, L, rows), out4, lse4[..., 0], do4)
    sizes = (call.scale, call.scale * grads.dq_factor, rows, tiles.cols)
    table = _backward_tasks(k4.shape[1], band)
    # Per run, never on a plan: concurrent calls each have their own.
    work = (table, np.zeros(1, np.int64), np.zeros(len(table), bool))
    R, cols, dtype = call.group * rows, tiles.cols, grads.dq.dtype

    def make_walk() -> Callable[[], None]:
        stacked, do, dq_t = (np.empty((R, d), dtype) for d in (d_k, d_v, d_k))
        D, row_lse = np.empty(R, dtype), np.empty(R, dtype)
        p, ds = np.empty((R, cols), dtype), np.empty((R, cols), dtype)
        slope = np.empty((R, cols) if capped else (0, 0), dtype)  # soft-capping's derivative
        scratch = (stacked, do, D, row_lse, dq_t, p, ds, slope)

        def walk() -> None:
            grads4 = (dq4, dk4, dv4)
            compiled.backward_walk(dtype, work, operands, grads4, band, variants, sizes, scratch)

        return walk

    _walk_once_per_worker(team, work, make_walk)
    failed = table[work[2]]
    return [(batch_index(b, q.shape[:-3]), slice(int(g), int(g) + 1)) for b, g in failed]


def _backward_tasks(H_kv: int, band: tuple[Any, ...]) -> np.ndarray:
    """The backward's tasks ``(b, g)``, every sequence and key/value head, longest first (by
    their query and key lengths, ties in order)."""
    key_end, query_end = band[3], band[4]
    B = len(key_end)
    table = np.stack(np.meshgrid(np.arange(B), np.arange(H_kv), indexing="ij"), -1).reshape(-1, 2)
    pairs = query_end[table[:, 0]] * key_end[table[:, 0]]  # about each task's work
    return table[np.argsort(-pairs, kind="stable")]
