"""The thread team: BLAS held to one thread only inside it, errors surface, the fallback."""

from __future__ import annotations

import numpy as np
import pytest

import mha
from mha import parallel


def blas_threads():
    from threadpoolctl import threadpool_info

    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_blas_is_limited_inside_the_team_and_restored_after():
    before = blas_threads()
    with parallel.Team(2):
        assert all(n == 1 for n in blas_threads())
    assert blas_threads() == before


def test_a_worker_error_reaches_the_caller():
    def make_worker():
        def work(task):
            if task == 3:
                raise ValueError("task 3 failed")

        return work

    with parallel.Team(2) as team, pytest.raises(ValueError, match="task 3 failed"):
        team.run(list(range(6)), make_worker)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_team_matmul_equals_numpy(workers, monkeypatch):
    monkeypatch.setattr(parallel, "MATMUL_ROWS", 7)  # many ragged row blocks
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
    assert parallel.workers_for(parallel.SERIAL_BELOW - 1, None) == 1
    assert parallel.workers_for(parallel.SERIAL_BELOW, None) == parallel.default_workers()


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
