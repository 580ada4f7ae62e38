"""The thread team: BLAS held to one thread only inside it, errors surface, the fallback."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import mha
from mha._kernel import runtime
from mha._kernel import team as parallel


def blas_threads():
    from threadpoolctl import threadpool_info

    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_blas_is_limited_inside_the_team_and_restored_after():
    before = blas_threads()
    with parallel.Team(2):
        assert all(n == 1 for n in blas_threads())
    assert blas_threads() == before


def test_a_team_of_one_leaves_blas_its_threads_only_where_asked():
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=2, user_api="blas"):
        with parallel.Team(1):
            assert blas_threads() == [1]  # held: the reproducibility promise
        with parallel.one_worker_on_blas_threads():
            with parallel.Team(1):
                assert blas_threads() == [2]
            with parallel.Team(2):  # a team of more workers still holds it
                assert blas_threads() == [1]
            assert blas_threads() == [2]
            seen = []
            other = threading.Thread(target=lambda: seen.append(held_in_a_team_of_one()))
            other.start()
            other.join()
            assert seen == [[1]]  # another thread's teams are not this thread's
        with parallel.Team(1):
            assert blas_threads() == [1]
        assert blas_threads() == [2]


def held_in_a_team_of_one():
    with parallel.Team(1):
        return blas_threads()


def test_a_worker_error_reaches_the_caller():
    def make_worker():
        def work(task):
            if task == 3:
                raise ValueError("task 3 failed")

        return work

    with parallel.Team(2) as team, pytest.raises(ValueError, match="task 3 failed"):
        team.run(list(range(6)), make_worker)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_team_matmul_equals_numpy(workers, tuned):
    tuned(matmul_rows=7, matmul_max_rows=7)  # many ragged row blocks
    r = np.random.default_rng(0)
    x, W, b = r.standard_normal((3, 20, 9)), r.standard_normal((9, 5)), r.standard_normal(5)
    with parallel.Team(workers) as team:
        np.testing.assert_allclose(team.matmul(x, W, b), x @ W + b, rtol=1e-14, atol=1e-14)
        assert team.matmul(x[:0], W).shape == (0, 20, 5)


def test_without_threadpoolctl_the_default_is_one_worker(monkeypatch):
    monkeypatch.setattr(parallel, "_blas_controller", lambda: None)
    assert parallel.default_workers() == 1
    assert parallel.workers_for(1e12, None) == 1
    assert parallel.workers_for(1e12, 3) == 3


def test_small_calls_stay_serial_and_large_ones_use_the_cores():
    below = runtime.DEFAULT.thresholds.serial_below
    assert parallel.workers_for(below - 1, None) == 1
    assert parallel.workers_for(below, None) == parallel.default_workers()


def test_results_do_not_depend_on_workers():
    r = np.random.default_rng(1)
    X = r.standard_normal((2, 300, 64))
    W = list(r.standard_normal((4, 64, 64)) / 8)
    one = mha.multi_head_attention(X, X, X, *W, 4, causal=True, workers=1, max_memory=2**16)
    for workers in (2, 3):
        many = mha.multi_head_attention(
            X, X, X, *W, 4, causal=True, workers=workers, max_memory=2**16
        )
        np.testing.assert_allclose(many, one, rtol=1e-13, atol=1e-13)


def test_overlapping_calls_from_two_threads_restore_the_blas_threads():
    import threading

    before = blas_threads()
    r = np.random.default_rng(2)
    big, small = r.standard_normal((2, 700, 64)), r.standard_normal((2, 300, 64))
    errors = []

    def call(x, pause):
        try:
            for _ in range(3):
                mha.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], workers=2)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(x, 0)) for x in (big, small, big)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert blas_threads() == before


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_no_warning_from_worker_threads_when_hidden_keys_hold_inf(workers):
    """np.errstate is per thread; the workers must carry the caller's settings over."""
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal((1, 2, 64, 16)) for _ in range(3))
    k[..., 5, :] = np.inf
    k[..., 5, 0] = -np.inf
    v[..., 5, :] = np.nan
    mask = np.ones(64, dtype=bool)
    mask[5] = False
    out = mha.scaled_dot_product_attention(q, k, v, mask=mask, workers=workers, max_memory=5000)
    assert np.isfinite(out).all()
    X = r.standard_normal((1, 600, 64))
    M = X.copy()
    M[0, 500:] = np.inf
    W = list(r.standard_normal((4, 64, 64)) / 8)
    out = mha.multi_head_attention(X, M, M, *W, 4, key_lengths=[500], workers=workers)
    assert np.isfinite(out).all()


def test_a_failing_task_stops_the_others():
    taken = []

    def make_worker():
        def work(task):
            taken.append(task)
            if task == 0:
                raise RuntimeError("first task failed")

        return work

    with parallel.Team(2) as team, pytest.raises(RuntimeError, match="first task failed"):
        team.run(list(range(1000)), make_worker)
    assert len(taken) < 1000


@pytest.mark.parametrize("workers", [2, 3])
def test_team_matmul_splits_columns_when_rows_are_few(workers):
    r = np.random.default_rng(4)
    x, W, b = r.standard_normal((5, 40)), r.standard_normal((40, 300)), r.standard_normal(300)
    with parallel.Team(workers) as team:
        np.testing.assert_allclose(team.matmul(x, W, b), x @ W + b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize(
    ("batch", "L", "rows"),
    [
        ((4,), 6, 7),
        ((7,), 3, 7),
        ((2, 3), 10, 7),
        ((), 23, 7),
        ((3,), 40, 16),
        ((5,), 1, 256),
        ((2,), 0, 7),
        ((0,), 5, 7),
    ],
)
def test_team_matmul_heads_is_the_product_split_into_contiguous_heads(
    workers, batch, L, rows, tuned
):
    """Tasks of whole sequences (L <= rows), of parts of one (L > rows), and few rows."""
    tuned(matmul_rows=rows, matmul_max_rows=rows)
    r = np.random.default_rng(5)
    x, W, b = r.standard_normal((*batch, L, 9)), r.standard_normal((9, 22)), r.standard_normal(22)
    parts = [(2, 3), (4, 2), (1, 8)]
    x_before = x.copy()
    with parallel.Team(workers) as team:
        heads = team.matmul_heads(x, W, b, parts)
        plain = team.matmul_heads(x, W[:, :6], None, parts[:1])[0]
    product, at = x @ W + b, 0
    for got, (H, d) in zip(heads, parts, strict=True):
        expected = product[..., at : at + H * d].reshape(*batch, L, H, d)
        np.testing.assert_allclose(got, np.moveaxis(expected, -2, -3), rtol=1e-13, atol=1e-13)
        assert got.shape == (*batch, H, L, d) and got.flags.c_contiguous
        at += H * d
    no_bias = heads[0] - b[:6].reshape(2, 1, 3)  # (H, 1, d) against (..., H, L, d)
    np.testing.assert_allclose(plain, no_bias, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(x, x_before)


@pytest.mark.parametrize("workers", [1, 2])
def test_team_matmul_heads_holds_blocks_of_the_product_not_all_of_it(workers):
    import tracemalloc

    x = np.ones((1, 16384, 16))
    W = np.ones((16, 96))
    with parallel.Team(workers) as team:
        tracemalloc.start()
        heads = team.matmul_heads(x, W, None, [(2, 16)] * 3)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    outputs = sum(h.nbytes for h in heads)  # as large as the product
    assert peak - outputs < outputs / 2, (peak, outputs)
    np.testing.assert_array_equal(heads[2], 16.0)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_team_matmul_may_overwrite_its_input(workers):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 700, 48))
    W = rng.standard_normal((48, 48))
    expected = x @ W
    with parallel.Team(workers) as team:
        kept = x.copy()
        result = team.matmul(kept, W, overwrite=True)
        assert np.shares_memory(result, kept)  # the input's buffer now holds the result
        np.testing.assert_allclose(result, expected, rtol=1e-13)
        strided = x.transpose(1, 0, 2)  # not contiguous: a new array, the input untouched
        before = strided.copy()
        other = team.matmul(strided, W, overwrite=True)
        assert not np.shares_memory(other, x)
        np.testing.assert_array_equal(strided, before)
        wide = team.matmul(x.copy(), rng.standard_normal((48, 20)), overwrite=True)
        assert wide.shape == (3, 700, 20)  # not square: a new array


def test_a_withdrawn_share_settles_again_at_once():
    job = parallel._Job(lambda: None)
    assert job.settle() is None  # no helper started it: withdrawn
    again = threading.Thread(target=job.settle, daemon=True)
    again.start()
    again.join(timeout=5)
    assert not again.is_alive()
    job.run()  # a helper reaching the withdrawn job later does not run it
    assert job.error is None


def test_a_helpers_error_reaches_the_caller_after_another_share_was_withdrawn(monkeypatch):
    """The first share's helper is slow to start it (as if descheduled), so the caller
    withdraws it; the second share's helper raises. The caller raises that error instead of
    waiting again for the withdrawn share."""
    parallel._helpers().submit(lambda: None, 2).settle()  # two helpers exist
    made, slow = [], set()
    real_init, real_run = parallel._Job.__init__, parallel._Job.run

    def init(job, work):
        real_init(job, work)
        made.append(job)
        if len(made) == 1:
            slow.add(id(job))

    def run(job):
        if id(job) in slow:
            time.sleep(0.3)
        real_run(job)

    monkeypatch.setattr(parallel._Job, "__init__", init)
    monkeypatch.setattr(parallel._Job, "run", run)

    def make_worker():
        helper = threading.current_thread().name.startswith("mha-")

        def work(task):
            if helper:
                raise ValueError("a helper's task failed")
            time.sleep(0.05)

        return work

    outcome = []

    def call():
        try:
            with parallel.Team(3) as team:
                team.run(list(range(3)), make_worker)
        except ValueError as error:
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=10)
    assert not caller.is_alive() and len(outcome) == 1


def test_an_idle_helper_watches_for_the_next_job_awake_then_sleeps():
    """:func:`compiled.job_wait`: a change of the signal ends the wait at once; without one
    the wait ends after ``helper_wait_us`` (none at 0); where the compiled code cannot run
    there is no wait (the helpers sleep on their queue, as without numba)."""
    from mha._kernel import compiled

    wait = compiled.job_wait()
    if wait is None:
        if compiled.walk_available() or os.environ.get("MHA_REQUIRE_NUMBA") == "1":
            pytest.fail("the helpers' wait is missing where numba is required")
        pytest.skip("numba missing: helpers sleep on their queue")
    signal = np.zeros(1, np.int64)
    with runtime.DEFAULT.tuned(helper_wait_us=20_000_000):  # 20 s unless the signal changes
        raise_later = threading.Timer(0.05, lambda: signal.__setitem__(0, 1))
        raise_later.start()
        start = time.perf_counter()
        assert wait(signal, 0)
        assert time.perf_counter() - start < 5
        assert wait(signal, 0)  # changed already: at once
    with runtime.DEFAULT.tuned(helper_wait_us=20_000):
        start = time.perf_counter()
        assert not wait(signal, 1)
        assert 0.002 < time.perf_counter() - start < 5  # (a clock of counted reads)
    with runtime.DEFAULT.tuned(helper_wait_us=0):
        assert not wait(signal, 1)


@pytest.mark.parametrize("wait_us", [0, 1000])
def test_helpers_serve_every_job_waiting_awake_or_asleep(wait_us):
    """Jobs handed over one after another, with and without the helpers' awake wait, with
    pauses past it: each call's tasks all run, the helpers' share among them."""
    ran_by = []
    with runtime.DEFAULT.tuned(helper_wait_us=wait_us), parallel.Team(2) as team:
        for call in range(40):
            done = []

            def make_worker(done=done):
                def work(task):
                    time.sleep(0.001)
                    done.append(task)
                    ran_by.append(threading.current_thread().name)

                return work

            team.run(list(range(6)), make_worker)
            assert sorted(done) == list(range(6))
            if call % 10 == 9:
                time.sleep(0.01)  # past the wait: the helper sleeps, and is woken
    assert any(name.startswith("mha-") for name in ran_by)
