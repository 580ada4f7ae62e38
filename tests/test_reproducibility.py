"""The reproducibility promise: for the same inputs, ``max_memory`` and ``workers``, mha
returns the same bits, call after call, whatever other threads are doing at the same time
and whatever the process's BLAS thread setting is."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import mha
from mha.cli import bench

r = np.random.default_rng(11)
X = r.standard_normal((2, 300, 64))
W = list(r.standard_normal((4, 64, 64)) / 8)
# Split heads whose tile GEMMs (4, 300, 16) @ (4, 16, 300) OpenBLAS rounds differently on
# one BLAS thread and on two (its SkylakeX kernel, float64).
q, k, v = (r.standard_normal((1, 4, 300, 16)) for _ in range(3))


def calls():
    """Calls covering the projections, the kernel's tiles and the output projection."""
    made = {}
    for workers in (1, 2, 3):
        made[f"mha workers={workers}"] = lambda w=workers: mha.multi_head_attention(
            X, X, X, *W, 4, causal=True, workers=w
        )
        made[f"mha float32 workers={workers}"] = lambda w=workers: mha.multi_head_attention(
            X.astype(np.float32), X, X, *W, 4, workers=w, max_memory=2**16
        )
        made[f"split heads workers={workers}"] = lambda w=workers: mha.scaled_dot_product_attention(
            q, k, v, workers=w, max_memory=2**24
        )
        made[f"split heads tiled workers={workers}"] = lambda w=workers: (
            mha.scaled_dot_product_attention(q, k, v, causal=True, workers=w, max_memory=2**14)
        )
    return made


def test_repeated_calls_give_the_same_bits():
    for name, call in calls().items():
        first = call()
        for _ in range(5):
            assert np.array_equal(call(), first), name


def test_the_blas_thread_setting_changes_no_bit():
    for name, call in calls().items():
        with threadpool_limits(limits=1, user_api="blas"):
            one = call()
        with threadpool_limits(limits=2, user_api="blas"):
            two = call()
        assert np.array_equal(one, two), name


def test_concurrent_calls_give_the_bits_of_serial_calls():
    """Four threads call mha in shuffled order while a fifth keeps NumPy's BLAS busy; every
    result must equal, bit for bit, the same call made alone."""
    made = calls()
    serial = {name: call() for name, call in made.items()}
    mismatches, errors = [], []
    stop = threading.Event()

    def caller(seed):
        order = np.random.default_rng(seed)
        try:
            for _ in range(3):
                for name in order.permutation(list(made)):
                    if not np.array_equal(made[name](), serial[name]):
                        mismatches.append(name)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    def load():
        a = r.standard_normal((400, 400))
        while not stop.is_set():
            a @ a

    loader = threading.Thread(target=load)
    loader.start()
    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    loader.join()
    assert errors == []
    assert mismatches == [], f"{len(mismatches)} of {4 * 3 * len(made)} calls differed"
    assert time.perf_counter() - started < 120


def test_the_benchmark_leaves_torch_on_the_threads_it_found(torch, tmp_path):
    torch.set_num_threads(1)
    bench.run(bench.plan("smoke"), tmp_path, None, lambda line: None)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("caller", ["main thread", "another thread"])
def test_every_call_holds_blas_to_one_thread_while_it_runs(workers, caller, monkeypatch):
    """threadpoolctl lets only one thread change OpenBLAS's limit and silently ignores the
    others; a call made from any thread must still run its GEMMs on one BLAS thread."""
    from threadpoolctl import threadpool_info

    from mha._kernel import team as parallel

    seen = []

    def spied(name):  # the team's products, and its tasks (a block of sequences' products)
        original = getattr(parallel.Team, name)

        def spy(self, *args, **kwargs):
            seen.extend(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(parallel.Team, name, spy)

    spied("matmul")
    spied("run")
    before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    with threadpool_limits(limits=2, user_api="blas"):  # the main thread now controls BLAS
        if caller == "main thread":
            mha.multi_head_attention(X, X, X, *W, 4, workers=workers)
        else:
            thread = threading.Thread(
                target=lambda: mha.multi_head_attention(X, X, X, *W, 4, workers=workers)
            )
            thread.start()
            thread.join()
        after = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    assert seen and set(seen) == {1}
    assert after == [2]  # restored, and the caller's own limit still in force
    assert [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"] == before
