"""Worker threads for one call, with BLAS held to one thread inside them.

NumPy releases the GIL in BLAS calls and ufuncs, so threads run tiles truly in parallel.
BLAS must then run single-threaded: its own threads would compete with ours, and after a
multi-threaded call OpenBLAS keeps its threads spinning for a while, stealing cores from the
next step. So a call's projections, attention and output projection all run inside one
:class:`Team`, which limits BLAS through threadpoolctl (the ``fast`` extra). Without
threadpoolctl the default is one worker, and BLAS keeps its own threads.

Every team holds BLAS to one thread, a team of one worker too. That makes each GEMM's
rounding independent of the BLAS thread setting and of other calls running at the same time
(OpenBLAS rounds some shapes differently on one thread and on two), so a call's result
depends only on its inputs, ``max_memory`` and ``workers``: the reproducibility promise.
One exception, asked for by a caller whose own products run on BLAS's threads anyway
(:func:`one_worker_on_blas_threads`): a team of one worker then leaves BLAS its threads.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from . import blas, compiled, runtime

__all__ = [
    "Team",
    "cores",
    "default_workers",
    "one_worker_on_blas_threads",
    "rows_per_task",
    "workers_for",
]

Task = TypeVar("Task")


def cores() -> int:
    """The number of cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """All cores when BLAS can be held to one thread per worker, otherwise one."""
    return cores() if _blas_controller() is not None else 1


def workers_for(cost: float, requested: int | None) -> int:
    """The caller's choice, or the default for a call of ``cost`` multiply-adds: one worker
    below ``serial_below`` (:mod:`.runtime`), where a thread pool costs more than it saves.
    Measured on 2 cores of a shared AMD EPYC (Zen 5), steady runs of one worker against
    two: a helper took 13-120 us to start (milliseconds after a pause), and two workers
    reading keys at once each ran at about 2/3 of one's speed (a decoding step, 1,024 keys
    of 8 heads: 55 against 36 us per task). Two workers lost below 2**25 (decoding 1,024
    keys, 2**23: 0.36 ms against 0.34; 2,048: 1.00 against 0.92; the float32 core, 4 heads
    of 64 tokens, 2**21: 0.13 against 0.10) and won from there (4,096 keys, 2**25: 1.61
    against 3.07; 4 heads of 512 tokens, 2**27: 1.71 against 3.20). Where idle cores wake
    faster the crossover is lower, and ``workers=`` chooses. The same threshold decides a
    layer's call (its projections' cost added), its gradients and ``mha.dask``'s tasks."""
    if requested is not None:
        return requested
    return 1 if cost < runtime.DEFAULT.thresholds.serial_below else default_workers()


@functools.cache
def _blas_controller() -> Any:
    try:
        from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]
    except ImportError:
        return None
    return ThreadpoolController()


class _BlasLimit:
    """BLAS held to one thread while any team runs. The setting is process-wide, so teams
    running at once in several threads share one limit: the first applies it and the last
    restores what was there before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._restore: Any = None

    def __enter__(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._restore = self._limit()
            self._holders += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._restore is not None:
                self._restore()
                self._restore = None

    @staticmethod
    def _limit() -> Callable[[], None] | None:
        """Hold BLAS to one thread; returns what undoes it (``None``: nothing to undo).
        NumPy's OpenBLAS is set through its own functions (a microsecond: mha's GEMMs are
        all NumPy's BLAS's); any other BLAS through threadpoolctl (tens of microseconds)."""
        direct = blas.thread_setting()
        if direct is not None:
            get, set_ = direct
            before = get()
            if before == 1:
                return None
            set_(1)
            return lambda: set_(before)
        controller = _blas_controller()
        if controller is None:
            return None
        with _blas_control():
            limits = controller.limit(limits=1, user_api="blas")

        def restore() -> None:
            with _blas_control():
                limits.restore_original_limits()

        return restore


@contextlib.contextmanager
def _blas_control() -> Iterator[None]:
    """Let this thread change OpenBLAS's thread count, and give the right up afterwards.

    threadpoolctl 3.6 and later let only one thread (the first to ask, usually the main
    thread) change the thread count of an OpenBLAS built on pthreads, and silently ignore
    every other thread. mha is called from any thread, and the first and the last holder of
    the limit may be different threads, so without this a call from a worker thread of the
    caller's ran BLAS multi-threaded inside its team (and rounded differently). The holder
    count above already keeps mha's own changes from fighting each other.
    """
    try:
        from threadpoolctl import OpenBLASController
    except ImportError:  # older threadpoolctl: any thread may change the limits
        yield
        return
    OpenBLASController.clear_controlling_thread(force=True)
    try:
        yield
    finally:
        OpenBLASController.clear_controlling_thread(force=True)


_BLAS_LIMIT = _BlasLimit()

_ON_BLAS_THREADS = threading.local()  # this thread's teams of one worker leave BLAS alone


@contextlib.contextmanager
def one_worker_on_blas_threads() -> Iterator[None]:
    """Within it, this thread's teams of one worker leave NumPy's BLAS its own threads
    instead of holding it to one: their GEMMs (a layer's projections, say) run on BLAS's
    threads and round as BLAS's threads do, like every other product of a caller that runs
    on them (:mod:`mha.models`' passes of few tokens: a 37-token prompt's projections took
    twice as long on one thread). Teams of more workers still hold BLAS to one thread."""
    outer = getattr(_ON_BLAS_THREADS, "on", False)
    _ON_BLAS_THREADS.on = True
    try:
        yield
    finally:
        _ON_BLAS_THREADS.on = outer


class Team:
    """``workers`` threads for the length of a ``with`` block (none when ``workers`` is 1).

    While a team runs (of one worker too, but where :func:`one_worker_on_blas_threads`
    asks otherwise), NumPy's BLAS is held to one thread in the whole process (when
    threadpoolctl is installed; another BLAS library that NumPy does not use, SciPy's say,
    keeps its setting when NumPy's is OpenBLAS), so another thread's large NumPy matmul runs
    single-threaded for that time too.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._entered = False
        self._holds = False  # whether this team holds BLAS to one thread

    def __enter__(self) -> Team:
        self._holds = self.workers != 1 or not getattr(_ON_BLAS_THREADS, "on", False)
        if self._holds:
            _BLAS_LIMIT.__enter__()
        self._entered = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._entered:
            self._entered = False
            if self._holds:
                _BLAS_LIMIT.__exit__()

    def run(self, tasks: Sequence[Task], make_worker: Callable[[], Callable[[Task], None]]) -> None:
        """Run every task. Each thread calls ``make_worker()`` once (for its own buffers) and
        then takes tasks in order, so put the longest first."""
        if self.workers == 1 or not self._entered or len(tasks) <= 1:
            worker = make_worker()
            for task in tasks:
                worker(task)
            return
        take = _taker(iter(tasks))
        failed = [False]  # (not a threading.Event: making one costs a decoding step 10 us)
        floating_point = np.geterr()  # np.errstate is per thread: carry the caller's over

        def loop() -> None:
            with np.errstate(**floating_point):
                worker = make_worker()
                while not failed[0] and (task := take()) is not None:
                    try:
                        worker(task)
                    except BaseException:
                        failed[0] = True  # the other workers stop taking tasks
                        raise

        threads = min(self.workers, len(tasks))
        jobs: list[_Job] = []
        try:
            for _ in range(threads - 1):
                jobs.append(_helpers().submit(loop, self.workers - 1))
            loop()  # the calling thread is one of the workers
            for job in jobs:  # every task is taken: jobs still queued (behind another
                error = job.settle()  # call's work, say) are withdrawn, not waited for
                if error is not None:
                    raise error  # a helper's exception
        except BaseException:  # an error, or Ctrl-C in the caller: stop the rest
            failed[0] = True
            for job in jobs:  # nothing of this call may run on after it returns
                job.settle()
            raise

    def matmul(
        self,
        x: np.ndarray,
        W: np.ndarray,
        b: np.ndarray | None = None,
        overwrite: bool = False,
        then: Callable[[slice, np.ndarray], None] | None = None,
    ) -> np.ndarray:
        """``x @ W (+ b)`` for ``x (..., n)``, shared among the workers by blocks of rows, or
        by blocks of ``W``'s columns when there are too few rows to go round. ``overwrite``:
        the result may take ``x``'s memory (block by block through a small buffer), when
        ``W`` is square and ``x`` contiguous in the result's dtype; ``x`` is then lost.
        ``then(rows, block)``: called on each block of the result's rows (``rows`` a slice
        of the flattened rows) by the worker that made it, while it is in cache (on the
        whole result, once, when the blocks are of columns)."""
        n, m = math.prod(x.shape[:-1]), W.shape[1]
        rows = x.reshape(n, x.shape[-1])  # not (-1, width): the width may be 0
        dtype = np.result_type(x, W)
        by_rows = n >= self.workers * runtime.DEFAULT.thresholds.matmul_rows or self.workers == 1
        square = W.shape[0] == m
        if (
            overwrite
            and by_rows
            and square
            and b is None
            and x.dtype == dtype
            and x.flags.c_contiguous
        ):
            return self._matmul_over(x, rows, W)  # (not with then: never asked together)
        if by_rows and then is None and n <= self._rows_per_task(n):
            product: np.ndarray = np.matmul(rows, W)  # one product (the tasks' own, without
            if b is not None:  # their Python)
                product += b
            return product.reshape((*x.shape[:-1], m))
        out = np.empty((n, m), dtype=dtype)
        if by_rows:
            step = self._rows_per_task(n)
            spans = [(slice(i, min(i + step, n)), slice(None)) for i in range(0, n, step)]
        else:
            width = max(64, -(-m // (2 * self.workers)))
            spans = [(slice(None), slice(j, min(j + width, m))) for j in range(0, m, width)]

        def make_worker() -> Callable[[tuple[slice, slice]], None]:
            def multiply(span: tuple[slice, slice]) -> None:
                lo, cols = span
                np.matmul(rows[lo], W[:, cols], out=out[lo, cols])
                if b is not None:
                    out[lo, cols] += b[cols]
                if then is not None and by_rows:
                    then(lo, out[lo])

            return multiply

        self.run(spans, make_worker)
        if then is not None and not by_rows:
            then(slice(None), out)
        return out.reshape((*x.shape[:-1], m))

    def matmul_heads(
        self,
        x: np.ndarray,
        W: np.ndarray,
        b: np.ndarray | None,
        parts: Sequence[tuple[int, int]],
        first_times: Any = None,
    ) -> list[np.ndarray]:
        """``x @ W (+ b)`` for ``x (..., L, n)``, its columns cut into ``parts`` of ``H``
        heads of ``d`` features each (``(H, d)`` in order), each part returned head-major
        and contiguous, ``(..., H, L, d)``. ``first_times``: a factor the first part is
        multiplied by as it is copied (the queries' scale: the bits of multiplying the part
        afterwards, without another pass over it).

        Each task multiplies a block of rows into a buffer of its own and copies it into
        the parts while it is in cache: whole sequences, or a part of one when a sequence
        is long. The attention walk reads contiguous heads faster than views of the
        product (measured on a layer of 32 sequences of 128 tokens, 256 features: 40 ms
        with views, 30 with contiguous heads, the copy included), and beside them each
        worker holds one block of the product, not all of it (one worker too; below
        ``workers * matmul_rows`` rows, the product is made whole and copied)."""
        *batch, L, _ = x.shape
        sequences = math.prod(batch)
        dtype = np.result_type(x, W)
        outs = [np.empty((sequences, H, L, d), dtype) for H, d in parts]
        cuts = list(itertools.accumulate((H * d for H, d in parts), initial=0))
        n = sequences * L
        rows = x.reshape(n, x.shape[-1])

        def scatter(block: np.ndarray, s0: int, s1: int, l0: int, l1: int) -> None:
            """``block`` holds rows ``l0:l1`` of sequences ``s0:s1``."""
            for i, (out, (H, d), c) in enumerate(zip(outs, parts, cuts, strict=False)):
                heads = block[:, c : c + H * d].reshape(s1 - s0, l1 - l0, H, d)
                if i == 0 and first_times is not None:
                    np.multiply(heads.transpose(0, 2, 1, 3), first_times, out=out[s0:s1, :, l0:l1])
                else:
                    out[s0:s1, :, l0:l1] = heads.transpose(0, 2, 1, 3)

        if n < self.workers * runtime.DEFAULT.thresholds.matmul_rows or not L:  # one product
            scatter(self.matmul(rows, W, b), 0, sequences, 0, L)
        else:
            step = self._rows_per_task(n)
            per = max(1, step // L)  # whole sequences per task, or rows of one
            if step >= L:
                spans = [(s, min(s + per, sequences), 0, L) for s in range(0, sequences, per)]
            else:
                spans = [
                    (s, s + 1, r, min(r + step, L))
                    for s in range(sequences)
                    for r in range(0, L, step)
                ]

            def make_worker() -> Callable[[tuple[int, int, int, int]], None]:
                buffer = np.empty((min(n, step), W.shape[1]), dtype)

                def multiply(span: tuple[int, int, int, int]) -> None:
                    s0, s1, l0, l1 = span
                    these = rows[s0 * L + l0 : (s1 - 1) * L + l1]
                    block = buffer[: len(these)]
                    np.matmul(these, W, out=block)
                    if b is not None:
                        block += b
                    scatter(block, s0, s1, l0, l1)

                return multiply

            self.run(spans, make_worker)
        return [out.reshape(*batch, H, L, d) for out, (H, d) in zip(outs, parts, strict=True)]

    def each_product(
        self,
        x: np.ndarray,
        W: np.ndarray,
        b: np.ndarray | None,
        then: Callable[[slice, np.ndarray], None],
    ) -> None:
        """``then(rows, block)`` on each block of rows of ``x @ W (+ b)`` (``rows`` a slice of
        ``x``'s flattened rows), the block made in a buffer of its worker's own: the product
        is never held whole (nor is new memory touched for it, a call after another)."""
        n = math.prod(x.shape[:-1])
        rows = x.reshape(n, x.shape[-1])
        step = self._rows_per_task(n)
        spans = [slice(i, min(i + step, n)) for i in range(0, n, step)]
        dtype = np.result_type(x, W)

        def make_worker() -> Callable[[slice], None]:
            buffer = np.empty((min(step, n), W.shape[1]), dtype=dtype)

            def multiply(lo: slice) -> None:
                block = buffer[: lo.stop - lo.start]
                np.matmul(rows[lo], W, out=block)
                if b is not None:
                    block += b
                then(lo, block)

            return multiply

        self.run(spans, make_worker)

    def _rows_per_task(self, n: int) -> int:
        return rows_per_task(n, self.workers)

    def _matmul_over(self, x: np.ndarray, rows: np.ndarray, W: np.ndarray) -> np.ndarray:
        n, step = len(rows), self._rows_per_task(len(rows))
        spans = [slice(i, min(i + step, n)) for i in range(0, n, step)]

        def make_worker() -> Callable[[slice], None]:
            buffer = np.empty((min(step, n), W.shape[1]), dtype=rows.dtype)

            def multiply(lo: slice) -> None:
                block = buffer[: lo.stop - lo.start]
                np.matmul(rows[lo], W, out=block)
                rows[lo] = block

            return multiply

        self.run(spans, make_worker)
        return x


def rows_per_task(n: int, workers: int) -> int:
    """The rows of each task of a team's product of ``n`` rows by rows (the last task's: the
    rest): an even share of the rows, within [matmul_rows, matmul_max_rows]: larger GEMMs
    run faster (5-12% from 256 to 1024 rows); the cap bounds overwrite's buffer."""
    tuned = runtime.DEFAULT.thresholds
    return max(tuned.matmul_rows, min(tuned.matmul_max_rows, -(-n // workers)), 1)


class _Helpers:
    """Helper threads kept between calls, taking jobs in turn from one queue, started as
    calls ask for more of them. Calls running at once share them, so together they never
    run more helpers than the largest of them asked for (their jobs queue instead).

    A ``ThreadPoolExecutor`` did this before; handing a job over and collecting it through
    its futures cost a decoding step about 30 microseconds (``submit`` alone 14, measured
    with ``benchmarks/calls.py``'s machine), against a few for a queue and two locks."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.threads = 0
        self._signal = np.zeros(1, np.int64)  # raised with each job queued

    def submit(self, work: Callable[[], None], threads: int) -> _Job:
        """Queue ``work`` for the first of at least ``threads`` helpers that is free."""
        if self.threads < threads:
            with self._lock:
                wait = compiled.job_wait()  # (made here: a new helper serves at once)
                while self.threads < threads:
                    name = f"mha-{self.threads + 1}"
                    serve = functools.partial(self._serve, wait)
                    threading.Thread(target=serve, name=name, daemon=True).start()
                    self.threads += 1
        job = _Job(work)
        self._jobs.put(job)
        self._signal[0] += 1  # (a change is what a helper watches for: a lost count is one)
        return job

    def _serve(self, wait: Callable[[np.ndarray, int], bool] | None) -> None:
        """Run jobs as they come: between them, watch for the next one awake for a while
        (``wait``, :func:`.compiled.job_wait`, where it can), then sleep on the queue."""
        signal = self._signal
        while True:
            seen = int(signal[0])  # (read first: a job queued after it changes it)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                if wait is not None and wait(signal, seen):
                    continue
                job = self._jobs.get()
            job.run()


class _Job:
    """One helper's share of a call: run once by a helper, unless its caller withdrew it
    first (the caller took every task itself while the helpers were busy elsewhere)."""

    __slots__ = ("done", "error", "start", "work")

    def __init__(self, work: Callable[[], None]) -> None:
        self.work: Callable[[], None] | None = work
        self.start = threading.Lock()  # taken by whoever comes first: a helper or the caller
        self.done = threading.Lock()  # held until the work has run
        self.done.acquire()
        self.error: BaseException | None = None

    def run(self) -> None:
        if not self.start.acquire(blocking=False):
            return  # withdrawn
        work, self.work = self.work, None
        try:
            if work is not None:
                work()
        except BaseException as error:  # for the caller to raise
            self.error = error
        finally:
            self.done.release()

    def settle(self) -> BaseException | None:
        """Withdraw the job if no helper has started it, else wait until it has run (again
        and again if need be); returns the error it raised, if any."""
        if self.start.acquire(blocking=False):
            self.work = None  # (not kept, with the call's arrays, while the job waits queued)
            self.done.release()  # nothing to wait for, now or when settled again
            return None
        with self.done:
            return self.error


def _helpers() -> _Helpers:
    """The runtime's helper threads (:mod:`.runtime`), made on first use."""
    pool = runtime.DEFAULT.helpers
    if pool is None:
        with _MAKING:
            if runtime.DEFAULT.helpers is None:
                runtime.DEFAULT.helpers = _Helpers()
            pool = runtime.DEFAULT.helpers
    return pool  # type: ignore[no-any-return]


_MAKING = threading.Lock()


def _forget_pool_after_fork() -> None:
    runtime.DEFAULT.helpers = None  # the child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _taker(tasks: Iterator[Task]) -> Callable[[], Task | None]:
    """A thread-safe function handing out the next task, or ``None`` when there are none."""
    lock = threading.Lock()

    def take() -> Task | None:
        with lock:
            return next(tasks, None)

    return take
