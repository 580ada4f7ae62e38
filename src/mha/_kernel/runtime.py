"""What mha keeps between calls, owned by one object: :data:`DEFAULT`, a :class:`Runtime`.

* ``thresholds``: the sizes the kernel's choices turn on (when a call takes more than one
  worker, how many rows a parallel GEMM takes, the tiles and work items of the walks),
  each measured and explained where it is used;
* ``plans``: the plans of plain calls, kept per checked spec and shapes (:mod:`mha.api.plans`);
* ``records``: the checked keywords, kept per record of plain values (:mod:`mha.api.spec`);
* ``layer_checks``: each layer's last checked call, by the layer (weakly: a layer dropped
  drops its own; :mod:`mha.api.plans`);
* ``layer_steps``: each layer's decoding step, by the layer (weakly; :mod:`mha.api.decoding`);
* ``layer_plans``: each layer's plain call, by the layer (weakly; :mod:`mha.api.layer_plan`);
* ``function_plans``: :func:`mha.multi_head_attention`'s plain calls, per signature of
  shapes and dtypes (holding no array of the caller's; :mod:`mha.api.layer_plan`);
* ``rotations``: the rotary angles of the last positions rotated (:mod:`mha.api.rotary`: a
  decoding step's, which every layer rotates at), and ``long_rotation``: the last of a
  longer array of positions (a prompt's, which every layer of its pass rotates at);
* ``compiled``: the compiled kernels and what their first calls cost (:mod:`.compiled`);
* ``helpers``: the team's helper threads (:mod:`.team`), made on first use.

Every part is thread-safe: the kept dicts under a lock of their own, the helpers behind
theirs. Tests change the thresholds for a block with :meth:`Runtime.tuned` and forget
what was kept with :meth:`Runtime.forget`, instead of patching module globals.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["DEFAULT", "Compiled", "Kept", "Runtime", "Thresholds"]


@dataclass(frozen=True)
class Thresholds:
    """The sizes the kernel's choices turn on (the numbers are explained where used)."""

    serial_below: float = 2**25  # multiply-adds under which a call runs on one worker
    matmul_rows: int = 256  # the fewest rows of a parallel GEMM's task
    matmul_max_rows: int = 2048  # the most
    evaluated_at_once: int = 2**21  # pairs per call of a mask_mod while its map is built
    key_tile: int = 512  # keys per tile when the budget allows
    wide_key_tile: int = 8192  # keys per tile of few rows (decoding)
    wide_below_rows: int = 64  # stacked rows under which a tile takes wide_key_tile keys
    product_chunk: int = 1024  # keys per BLAS call of p @ v for few rows
    compiled_above: int = 2**18  # scores from which the NumPy walk takes the compiled step
    walk_rows: int = 256  # query rows of a compiled forward work item, at most
    backward_rows: int = 512  # query rows of a compiled backward tile, at most
    split_min_keys: int = 2048  # the fewest keys worth a chunk when keys are split
    helper_wait_us: int = 1000  # how long an idle helper watches for a job before it sleeps


class Kept:
    """A bounded dict of what calls work out once (plans, checked keywords), safe to share
    between threads: when full, everything is forgotten and keeping starts over."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._items: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.get = self._items.get  # (the dict's own: no Python call per lookup)

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[Any]:
        return list(self._items.values())

    def keep(self, key: Any, value: Any) -> None:
        with self._lock:
            if len(self._items) >= self.most and key not in self._items:
                self._items.clear()
            self._items[key] = value

    def forget(self) -> None:
        with self._lock:
            self._items.clear()


@dataclass
class Compiled:
    """The compiled kernels (:mod:`.compiled`): numba's modules once imported (``steps``,
    ``walks``; ``failed`` when numba is missing), the walks compiled per (name, dtype) under
    ``lock`` (a call's workers may all ask for one first), each ready with its GEMM's
    address, and the seconds each kernel's first call took."""

    steps: Any = None
    walks: Any = None
    failed: bool = False
    functions: dict[tuple[str, str, bool], Any] = field(default_factory=dict)
    ready: dict[tuple[Any, ...], tuple[Any, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    wait: Any = None  # the helpers' wait and its reads per microsecond (compiled.job_wait)


class Runtime:
    """What mha keeps between calls (see the module's docstring)."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self.plans = Kept(64)
        self.records = Kept(256)
        self.compiled = Compiled()
        self.helpers: Any = None  # mha._kernel.team's pool, made on first use
        self.layer_checks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.layer_steps: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.layer_plans: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.function_plans = Kept(16)
        self.rotations = Kept(16)
        self.long_rotation = Kept(1)
        self._tuning = threading.Lock()

    def forget(self) -> None:
        """Forget the plans and the checked keywords (the compiled kernels stay)."""
        self.plans.forget()
        self.records.forget()
        self.layer_checks.clear()
        self.layer_steps.clear()
        self.layer_plans.clear()
        self.function_plans.forget()
        self.rotations.forget()
        self.long_rotation.forget()

    @contextlib.contextmanager
    def tuned(self, **changes: Any) -> Iterator[Thresholds]:
        """The thresholds changed for the block (``key_tile=64``, ...), and the plans made
        under the old ones forgotten, before and after."""
        unknown = set(changes) - {f.name for f in fields(Thresholds)}
        if unknown:
            raise TypeError(f"no thresholds named {sorted(unknown)}")
        with self._tuning:
            before = self.thresholds
            self.thresholds = replace(before, **changes)
            self.forget()
        try:
            yield self.thresholds
        finally:
            with self._tuning:
                self.thresholds = before
                self.forget()


DEFAULT = Runtime()
"""The runtime every call uses."""
