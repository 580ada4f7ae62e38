"""mha.dask against the in-memory functions: every chunking, every mask, on the synchronous,
threaded and distributed schedulers (a real LocalCluster with worker processes), with a
worker's memory below the keys' and values' size and with a worker killed mid-compute.

The oracle is the in-memory ``mha.multi_head_attention`` (itself checked against torch);
the memory-limited run is checked against a reference computed key chunk by key chunk in
this process and merged with ``mha.merge_attention``. CI installs the ``dask`` extra and
sets MHA_REQUIRE_DASK=1, making its absence a failure.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mha

if os.environ.get("MHA_REQUIRE_DASK") == "1":
    import dask  # noqa: F401  (a missing dask fails the run)
da = pytest.importorskip("dask.array", reason="the dask extra is not installed")
distributed = pytest.importorskip("distributed", reason="the dask extra is not installed")

import mha.dask  # noqa: E402

B, L, S, D, H = 3, 23, 29, 16, 4
rng = np.random.default_rng(12)
Q, K, V = (
    rng.standard_normal((B, L, D)),
    rng.standard_normal((B, S, D)),
    rng.standard_normal((B, S, D)),
)
X = rng.standard_normal((B, L, D))  # self-attention, L = S
WEIGHTS = [rng.standard_normal((D, D)) / 4 for _ in range(4)]
BIASES = {name: rng.standard_normal(D) for name in ("b_q", "b_k", "b_v", "b_o")}

# Chunks of (batch, queries, keys); sizes that do not divide the lengths.
CHUNKINGS = {"batch": (1, L, S), "queries": (B, 7, S), "keys": (B, L, 6), "all": (2, 7, 6)}


def masking(name, L=L, S=S):
    r = np.random.default_rng(hash(name) % 2**32)
    bias = r.standard_normal((1, H, L, S))
    bias[r.random(bias.shape) < 0.15] = -np.inf
    return {
        "none": {},
        "causal": {"causal": True},
        "causal top-left": {"causal": True, "causal_alignment": "top_left"},
        "window": {"causal": True, "window": 5},
        "window top-left": {"causal": True, "window": 4, "causal_alignment": "top_left"},
        "window only": {"window": 6},
        "lengths": {"key_lengths": [S, 0, 11], "query_lengths": [L - 3, L, 6]},
        "mask": {"mask": r.random((B, L, S)) < 0.7},
        "dask mask": {"mask": da.from_array(r.random((B, 1, L, S)) < 0.7, chunks=(2, 1, 9, 10))},
        "bias": {"bias": bias},
        "dask bias": {"bias": da.from_array(bias, chunks=(1, 2, 10, 13))},
        "everything": {
            "causal": True, "window": 9, "key_lengths": [S, 17, 25],
            "query_lengths": [L, 20, 2], "mask": r.random((L, S)) < 0.8, "bias": bias,
        },
    }[name]  # fmt: skip


MASKINGS = [
    "none", "causal", "causal top-left", "window", "window top-left", "window only", "lengths",
    "mask", "dask mask", "bias", "dask bias", "everything",
]  # fmt: skip


def chunked(x, chunks):
    return da.from_array(x, chunks=(*chunks, x.shape[-1]))


def relative(got, want):
    scale = np.abs(want).max(initial=0.0)
    return float(np.abs(got - want).max(initial=0.0) / (scale if scale else 1.0))


def check(got, want, record_error, family="mha.dask vs in-memory, float64", tol=1e-12):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert relative(got, want) <= record_error(family, relative(got, want)) <= tol


@pytest.mark.parametrize("scheduler", ["sync", "threads", "distributed"])
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("name", MASKINGS)
def test_every_chunking_and_mask_equals_in_memory(chunking, name, scheduler, request, record_error):
    b, lq, lk = CHUNKINGS[chunking]
    args = {**masking(name), **BIASES}
    want = mha.multi_head_attention(Q, K, V, *WEIGHTS, H, **_computed(args))
    lazy = mha.dask.multi_head_attention(
        chunked(Q, (b, lq)), chunked(K, (b, lk)), chunked(V, (b, lk)), *WEIGHTS, H, **args
    )
    assert lazy.chunks[:2] == chunked(Q, (b, lq)).chunks[:2]
    (got,) = dask_compute(lazy, scheduler=_scheduler(scheduler, request))
    check(got, want, record_error)


def _scheduler(name, request):
    """ "sync" or "threads", or the two-process LocalCluster's client."""
    return request.getfixturevalue("client") if name == "distributed" else name


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("name", ["causal", "causal top-left", "window", "everything"])
def test_self_attention_equals_in_memory(chunking, name, record_error):
    b, lq, _ = CHUNKINGS[chunking]
    args = masking(name, L, L)
    if "key_lengths" in args:
        args["key_lengths"] = [L, 17, 20]
    want = mha.multi_head_attention(X, X, X, *WEIGHTS, H, **_computed(args))
    Xd = chunked(X, (b, lq))
    check(mha.dask.multi_head_attention(Xd, Xd, Xd, *WEIGHTS, H, **args).compute(
        scheduler="sync"), want, record_error)  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {"num_kv_heads": 2, "causal": True},
        {"num_kv_heads": 1, "window": 3},
        {"rope_theta": 50.0, "causal": True},
        {"rope_theta": 50.0, "rotary_dim": 2, "rotary_interleaved": True,
         "positions": np.arange(3 * L).reshape(3, L) % 17},
        {"bias_k": rng.standard_normal(D), "bias_v": rng.standard_normal(D), "causal": True,
         "query_lengths": [L, 3, 0]},
        {"add_zero_attn": True, "key_lengths": [0, 5, L]},
        {"bias_k": rng.standard_normal(D), "bias_v": rng.standard_normal(D),
         "add_zero_attn": True, "mask": rng.random((L, L)) < 0.5},
        {"scale": 0.37, "causal": True},
    ],
    ids=["gqa", "mqa-window", "rotary", "rotary-positions", "bias_kv", "zero_attn", "both-extra",
         "scale"],
)  # fmt: skip
@pytest.mark.parametrize("chunking", ["batch", "all"])
def test_projection_options_equal_in_memory(extra, chunking, record_error):
    b, lq, _ = CHUNKINGS[chunking]
    Wk, Wv = WEIGHTS[1], WEIGHTS[2]
    if "num_kv_heads" in extra:
        width = extra["num_kv_heads"] * (D // H)
        Wk, Wv = Wk[:, :width], Wv[:, :width]
    weights = [WEIGHTS[0], Wk, Wv, WEIGHTS[3]]
    want = mha.multi_head_attention(X, X, X, *weights, H, **extra)
    Xd = chunked(X, (b, lq))
    lazy = mha.dask.multi_head_attention(Xd, chunked(X, (b, 5)), X, *weights, H, **extra)
    check(lazy.compute(scheduler="sync"), want, record_error)


@pytest.mark.parametrize("chunking", ["batch", "all"])
def test_rotary_cross_attention_with_default_positions(chunking, record_error):
    b, lq, lk = CHUNKINGS[chunking]
    want = mha.multi_head_attention(Q, K, V, *WEIGHTS, H, rope_theta=100.0, causal=True)
    lazy = mha.dask.multi_head_attention(
        chunked(Q, (b, lq)), chunked(K, (b, lk)), V, *WEIGHTS, H, rope_theta=100.0, causal=True
    )
    check(lazy.compute(scheduler="sync"), want, record_error)


def test_calls_that_differ_in_any_argument_get_different_graphs(record_error):
    Xd = chunked(X, (1, 6))
    calls = [
        {}, {"add_zero_attn": True}, {"causal": True}, {"causal": True, "window": 3},
        {"scale": 0.37}, {"b_o": np.ones(D)}, {"rope_theta": 10.0}, {"split_every": 2},
    ]  # fmt: skip
    lazies = [mha.dask.multi_head_attention(Xd, Xd, Xd, *WEIGHTS, H, **c) for c in calls]
    assert len({lazy.name for lazy in lazies[:-1]}) == len(calls) - 1
    import dask

    for c, got in zip(calls, dask.compute(*lazies, scheduler="sync"), strict=True):
        c.pop("split_every", None)
        check(got, mha.multi_head_attention(X, X, X, *WEIGHTS, H, **c), record_error)


def test_unbatched_float32_float16_and_integer_inputs(record_error):
    got = mha.dask.multi_head_attention(
        da.from_array(X[0], chunks=(5, D)), X[0], X[0], *WEIGHTS, H, causal=True
    )
    want = mha.multi_head_attention(X[0], X[0], X[0], *WEIGHTS, H, causal=True)
    check(got.compute(scheduler="sync"), want, record_error)
    for dtype, tol in ((np.float32, 1e-6), (np.float16, 1e-3)):
        x, W = X.astype(dtype), [w.astype(dtype) for w in WEIGHTS]
        want = mha.multi_head_attention(x, x, x, *W, H, causal=True)
        xd = chunked(x, (2, 6))
        got = mha.dask.multi_head_attention(xd, xd, xd, *W, H, causal=True).compute(
            scheduler="sync"
        )
        check(got, want, record_error, f"mha.dask vs in-memory, {np.dtype(dtype).name}", tol)
    ints = np.arange(B * L * D).reshape(B, L, D) % 7
    want = mha.multi_head_attention(ints, ints, ints, *WEIGHTS, H)
    got = mha.dask.multi_head_attention(chunked(ints, (1, 6)), ints, ints, *WEIGHTS, H)
    check(got.compute(scheduler="sync"), want, record_error)


@pytest.mark.parametrize("chunking", [(1, 1, 7, 6), (2, 2, 23, 29), (1, 2, 5, 29), (2, 1, 23, 4)])
@pytest.mark.parametrize("name", ["none", "causal", "window top-left", "lengths", "everything"])
def test_sdpa_with_batch_axes_gqa_and_lse_equals_in_memory(chunking, name, record_error):
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal((B, 2, 4, L, 8)), r.standard_normal((B, 2, 2, S, 8)),
               r.standard_normal((B, 2, 2, S, 5)))  # fmt: skip
    args = masking(name)
    for lengths in ("key_lengths", "query_lengths"):
        if lengths in args:
            args[lengths] = np.stack([args[lengths], args[lengths][::-1]], axis=1)
    args.pop("bias", None)
    b0, b1, lq, lk = chunking
    out, lse = mha.dask.scaled_dot_product_attention(
        da.from_array(q, chunks=(b0, b1, 4, lq, 8)), da.from_array(k, chunks=(b0, b1, 2, lk, 8)),
        v, return_lse=True, **args,
    )  # fmt: skip
    want, want_lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True, **args)
    got, got_lse = dask_compute(out, lse)
    check(got, want, record_error)
    seen = np.isfinite(want_lse)
    assert np.array_equal(seen, np.isfinite(got_lse))
    if seen.any():
        check(got_lse[seen], want_lse[seen], record_error, "mha.dask lse vs in-memory")


def dask_compute(*arrays, **kwargs):
    import dask

    return dask.compute(*arrays, scheduler=kwargs.pop("scheduler", "sync"), **kwargs)


@pytest.fixture(scope="module")
def client():
    """Two worker processes with one thread each, as on the benchmark's cluster."""
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


@pytest.mark.parametrize("scheduler", ["threads", "distributed"])
@pytest.mark.parametrize("name", ["causal", "window top-left", "everything"])
def test_sdpa_on_every_scheduler(scheduler, name, request, record_error):
    r = np.random.default_rng(4)
    q, k, v = r.standard_normal((3, B, 4, L, 8))[:, :, :, : min(L, S)]
    args = masking(name, min(L, S), min(L, S))
    for lengths in ("key_lengths", "query_lengths"):
        if lengths in args:
            args[lengths] = np.minimum(args[lengths], min(L, S))
    out, lse = mha.dask.scaled_dot_product_attention(
        da.from_array(q, chunks=(2, 4, 6, 8)), da.from_array(k, chunks=(1, 4, 5, 8)), v,
        return_lse=True, **args,
    )  # fmt: skip
    want, want_lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True, **args)
    got, got_lse = dask_compute(out, lse, scheduler=_scheduler(scheduler, request))
    check(got, want, record_error)
    seen = np.isfinite(want_lse)
    assert np.array_equal(seen, np.isfinite(got_lse))
    check(got_lse[seen], want_lse[seen], record_error, "mha.dask lse vs in-memory")


def test_keys_and_values_larger_than_a_workers_memory(record_error):
    """K and V together (2 GiB) are four times one worker's memory limit and twice the
    cluster's: each task holds one chunk of them, and no worker is killed or restarted."""
    Hs, Lq, Sk, d, chunk = 4, 256, 2**19, 64, 2**14
    gen = da.random.default_rng(5)
    q = gen.standard_normal((1, Hs, Lq, d), chunks=(1, Hs, 128, d))
    k = gen.standard_normal((1, Hs, Sk, d), chunks=(1, Hs, chunk, d))
    v = gen.standard_normal((1, Hs, Sk, d), chunks=(1, Hs, chunk, d))
    limit = 512 * 2**20
    assert k.nbytes + v.nbytes >= 4 * limit
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, memory_limit=limit,
        dashboard_address=":0",
    ) as cluster, distributed.Client(cluster) as client:  # fmt: skip
        before = set(client.scheduler_info()["workers"])
        future = client.compute(mha.dask.scaled_dot_product_attention(q, k, v, causal=True))
        got = future.result(timeout=600)
        assert set(client.scheduler_info()["workers"]) == before  # nobody killed or restarted
    # The reference: the in-memory function per key chunk, merged, in this process.
    q_local = q.compute(scheduler="sync")
    outs, lses = [], []
    for j in range(Sk // chunk):
        kj = k.blocks[0, 0, j, 0].compute(scheduler="sync")
        vj = v.blocks[0, 0, j, 0].compute(scheduler="sync")
        last = j == Sk // chunk - 1  # only the last chunk holds the diagonal
        out, lse = mha.scaled_dot_product_attention(q_local, kj, vj, causal=last, return_lse=True)
        outs.append(out)
        lses.append(lse)
    want, _ = mha.merge_attention(outs, lses)
    check(got, want, record_error, "mha.dask, K+V over a worker's memory")


def test_a_worker_killed_mid_compute_changes_nothing(record_error):
    """The keys arrive slowly; once some parts are computed one worker process is killed.
    Its nanny restarts it and Dask recomputes what was lost."""
    r = np.random.default_rng(8)
    x = r.standard_normal((1, 1024, 32))
    W = [r.standard_normal((32, 32)) / 6 for _ in range(4)]
    # A lambda travels by value: worker processes cannot import this test module.
    slow = da.from_array(x, chunks=(1, 64, 32)).map_blocks(
        lambda block: time.sleep(0.15) or block, dtype=x.dtype
    )
    want = mha.multi_head_attention(x, x, x, *W, 4, causal=True)
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster, distributed.Client(cluster) as client:  # fmt: skip
        before = set(client.scheduler_info()["workers"])
        future = client.compute(mha.dask.multi_head_attention(slow, slow, slow, *W, 4, causal=True))
        # Parts are merged (and released) as they come, so how many are held at one poll
        # depends on the machine's load: the kill waits for three seen, or one after 60 s.
        start, seen = time.monotonic(), 0
        while seen < 3 and time.monotonic() - start < (60 if seen else 90):
            seen = max(seen, _parts_done(client))
            time.sleep(0.02)
        assert not future.done() and seen >= 1
        victim = sorted(before)[0]
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        got = future.result(timeout=120)
        assert victim not in set(client.scheduler_info()["workers"])  # it really was lost
    check(got, want, record_error, "mha.dask, a worker killed")


def _parts_done(client):
    def count(dask_scheduler):
        return sum(
            1 for key, ts in dask_scheduler.tasks.items()
            if "mha-part" in str(key) and ts.state == "memory"
        )  # fmt: skip

    return client.run_on_scheduler(count)


# --- the graph --------------------------------------------------------------------------


def graph_of(lazy):
    return dict(lazy.__dask_graph__())


def count(graph, kind):
    return sum(1 for key in graph if isinstance(key, tuple) and f"-{kind}-" in key[0])


def test_causal_graph_has_about_half_the_tasks_and_no_quadratic_objects():
    L_long, chunk, d = 8192, 512, 64
    x = da.random.default_rng(0).standard_normal((1, L_long, d), chunks=(1, chunk, d))
    W = [np.eye(d)] * 4
    full = graph_of(mha.dask.multi_head_attention(x, x, x, *W, 4))
    causal = graph_of(mha.dask.multi_head_attention(x, x, x, *W, 4, causal=True))
    n = L_long // chunk
    assert count(full, "part") == n * n
    assert count(causal, "part") == n * (n + 1) // 2
    attention = [count(graph, "part") + count(graph, "merge") for graph in (causal, full)]
    assert 0.45 < attention[0] / attention[1] < 0.6  # the parts and their merges: about half
    assert len(causal) / len(full) < 0.7  # with the projections, one per chunk, the same in both
    window = graph_of(mha.dask.multi_head_attention(x, x, x, *W, 4, causal=True, window=chunk))
    assert count(window, "part") == 2 * n - 1  # the diagonal and the one before it
    # Every object in the graph is small: nothing of size L^2, nor L x d beyond the inputs'.
    ours = {key: task for key, task in causal.items() if "mha-" in str(key)}
    assert len(pickle.dumps(ours)) < 2 * 2**20 < 8 * L_long * L_long


def test_weights_are_in_the_graph_once():
    x = da.random.default_rng(0).standard_normal((4, 256, 128), chunks=(1, 64, 128))
    W = [np.random.default_rng(i).standard_normal((128, 128)) for i in range(4)]
    graph = graph_of(mha.dask.multi_head_attention(x, x, x, *W, 8, causal=True))
    holders = [key for key, task in graph.items() if W[0].tobytes() in pickle.dumps(task)]
    assert len(holders) == 1
    assert len(pickle.dumps(graph)) < 2 * sum(w.nbytes for w in W) + 2**20


def test_inputs_are_not_modified_and_numpy_inputs_are_wrapped(record_error):
    copies = [a.copy() for a in (Q, K, V, *WEIGHTS)]
    mask = np.random.default_rng(1).random((B, L, S)) < 0.6
    mask_copy = mask.copy()
    lazy = mha.dask.multi_head_attention(Q, chunked(K, (2, 6)), V, *WEIGHTS, H, mask=mask)
    want = mha.multi_head_attention(Q, K, V, *WEIGHTS, H, mask=mask)
    check(lazy.compute(scheduler="sync"), want, record_error)
    for a, b in zip((Q, K, V, *WEIGHTS, mask), (*copies, mask_copy), strict=True):
        assert np.array_equal(a, b)
    only_numpy = mha.dask.multi_head_attention(Q, K, V, *WEIGHTS, H, mask=mask)
    assert isinstance(only_numpy, da.Array)
    check(only_numpy.compute(scheduler="sync"), want, record_error)


def test_chunks_along_the_features_are_rechunked(record_error):
    Qd = da.from_array(Q, chunks=(1, 7, 5))  # d_model cut in four
    got = mha.dask.multi_head_attention(Qd, K, V, *WEIGHTS, H, causal=True)
    assert got.chunks[-1] == (D,)
    want = mha.multi_head_attention(Q, K, V, *WEIGHTS, H, causal=True)
    check(got.compute(scheduler="sync"), want, record_error)


@pytest.mark.parametrize(
    ("B0", "L0", "S0"),
    [(B, n, s) for B in (0, 2) for n in (0, 5) for s in (0, 6) if 0 in (B, n, s)],
)
@pytest.mark.parametrize(
    "chunking",
    [(1, 5, 6), (2, 2, 6), (2, 5, 3), (1, 2, 3)],
    ids=["batch", "queries", "keys", "all"],
)
def test_zero_size_inputs_give_what_memory_gives(B0, L0, S0, chunking, record_error):
    """No sequences, no queries or no keys, chunked every way: the in-memory answer (zeros
    of the right shape, b_o on rows that see no key), from the graph as from memory."""
    Qz, Kz = rng.standard_normal((B0, L0, D)), rng.standard_normal((B0, S0, D))
    b, n, s = chunking
    Qd, Kd = da.from_array(Qz, chunks=(b, n, D)), da.from_array(Kz, chunks=(b, s, D))
    grouped = [WEIGHTS[0], WEIGHTS[1][:, :8], WEIGHTS[2][:, :8], WEIGHTS[3]]
    for weights, kwargs in (
        (WEIGHTS, {}), (WEIGHTS, {"causal": True, "b_o": BIASES["b_o"]}),
        (WEIGHTS, {"window": 2, "causal": True, "add_zero_attn": True}),
        (grouped, {"num_kv_heads": 2, "rope_theta": 10.0}),
    ):  # fmt: skip
        want = mha.multi_head_attention(Qz, Kz, Kz, *weights, H, **kwargs)
        got = mha.dask.multi_head_attention(Qd, Kd, Kd, *weights, H, **kwargs)
        check(got.compute(scheduler="sync"), want, record_error)
    q, k = rng.standard_normal((B0, H, L0, 4)), rng.standard_normal((B0, 2, S0, 4))
    want, want_lse = mha.scaled_dot_product_attention(q, k, k, causal=True, return_lse=True)
    got, lse = mha.dask.scaled_dot_product_attention(
        da.from_array(q, chunks=(b, H, n, 4)), da.from_array(k, chunks=(b, 2, s, 4)), k,
        causal=True, return_lse=True,
    )  # fmt: skip
    got, lse = dask_compute(got, lse)
    check(got, want, record_error)
    np.testing.assert_array_equal(lse, want_lse)


# --- errors: the in-memory function's, raised when the graph is built ---------------------


def _exploding(x):
    """A Dask array that fails if anything computes it: errors must come before."""
    return da.from_array(x, chunks=x.shape).map_blocks(_explode, dtype=x.dtype)


def _explode(block):
    raise AssertionError("computed while building the graph")


BAD_CALLS = {
    "K positions": lambda: ((Q, K, V[:, :-1], *WEIGHTS, H), {}),
    "batch": lambda: ((Q, K[:2], V[:2], *WEIGHTS, H), {}),
    "W_q rows": lambda: ((Q, K, V, WEIGHTS[0][:-1], *WEIGHTS[1:], H), {}),
    "heads": lambda: ((Q, K, V, *WEIGHTS, 3), {}),
    "mask dtype": lambda: ((Q, K, V, *WEIGHTS, H), {"mask": np.ones((L, S), int)}),
    "mask shape": lambda: ((Q, K, V, *WEIGHTS, H), {"mask": np.ones((L, S + 1), bool)}),
    "bias shape": lambda: ((Q, K, V, *WEIGHTS, H), {"bias": np.zeros((2, L, S))}),
    "bias dtype": lambda: ((Q, K, V, *WEIGHTS, H), {"bias": np.zeros((L, S), complex)}),
    "key_lengths": lambda: ((Q, K, V, *WEIGHTS, H), {"key_lengths": [1, 2, S + 1]}),
    "query_lengths shape": lambda: ((Q, K, V, *WEIGHTS, H), {"query_lengths": [1, 2]}),
    "alignment": lambda: ((Q, K, V, *WEIGHTS, H), {"causal_alignment": "top_left"}),
    "window": lambda: ((Q, K, V, *WEIGHTS, H), {"window": 0}),
    "scale": lambda: ((Q, K, V, *WEIGHTS, H), {"scale": -1.0}),
    "complex Q": lambda: ((Q.astype(complex), K, V, *WEIGHTS, H), {}),
    "b_o": lambda: ((Q, K, V, *WEIGHTS, H), {"b_o": np.zeros(D + 1)}),
    "positions": lambda: ((Q, K, V, *WEIGHTS, H), {"rope_theta": 10.0, "positions": [0, 1]}),
    "rotary_dim": lambda: ((X, X, X, *WEIGHTS, H), {"rope_theta": 10.0, "rotary_dim": 3}),
    "num_kv_heads": lambda: ((Q, K, V, *WEIGHTS, H), {"num_kv_heads": 3}),
    "mask not an array": lambda: ((Q, K, V, *WEIGHTS, H), {"mask": 1}),
    "return_weights type": lambda: ((Q, K, V, *WEIGHTS, H), {"return_weights": 0}),
    "return_backward type": lambda: ((Q, K, V, *WEIGHTS, H), {"return_backward": "x"}),
    "dropout_p range": lambda: ((Q, K, V, *WEIGHTS, H), {"dropout_p": 2.0}),
    "generator alone": lambda: ((Q, K, V, *WEIGHTS, H), {"generator": np.random.default_rng()}),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_errors_are_the_in_memory_ones_raised_at_graph_build(case):
    args, kwargs = BAD_CALLS[case]()
    with pytest.raises(mha.AttentionError) as expected:
        mha.multi_head_attention(*args, **kwargs)
    lazy_args = [_exploding(a) if i < 3 else a for i, a in enumerate(args)]
    lazy_kwargs = {
        name: _exploding(value) if name in ("mask", "bias") and hasattr(value, "shape") else value
        for name, value in kwargs.items()
    }
    with pytest.raises(type(expected.value)) as got:
        mha.dask.multi_head_attention(*lazy_args, **lazy_kwargs)
    assert str(got.value) == str(expected.value)


def test_sdpa_errors_are_the_in_memory_ones():
    q, k = np.ones((2, 4, 5, 8)), np.ones((2, 3, 6, 8))
    with pytest.raises(mha.ShapeError) as expected:
        mha.scaled_dot_product_attention(q, k, k)
    with pytest.raises(mha.ShapeError) as got:
        mha.dask.scaled_dot_product_attention(_exploding(q), _exploding(k), k)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"return_weights": True}, {"return_backward": True},
     {"cache": mha.KVCache(B, H, D // H)},
     {"dropout_p": 0.1, "generator": np.random.default_rng(0)}],
    ids=["weights", "backward", "cache", "dropout"],
)  # fmt: skip
def test_in_memory_only_options_are_refused_by_name(kwargs):
    """Calls the in-memory function takes (self-attention: a cache's new tokens), refused
    by mha.dask by name, in a sentence that reads right for one option or several."""
    name = next(iter(kwargs))
    lengths = kwargs["cache"].lengths.copy() if "cache" in kwargs else None
    with pytest.raises(mha.AttentionValueError, match=f"; {name} is available in the in-memory"):
        mha.dask.multi_head_attention(chunked(X, (1, 7)), X, X, *WEIGHTS, H, **kwargs)
    if lengths is not None:
        np.testing.assert_array_equal(kwargs["cache"].lengths, lengths)  # nothing appended
    with pytest.raises(mha.AttentionValueError, match="return_weights and return_backward are"):
        mha.dask.multi_head_attention(chunked(Q, (1, 7)), K, V, *WEIGHTS, H, return_weights=True,
                                      return_backward=True)  # fmt: skip


def test_unknown_chunk_sizes_and_bad_split_every_are_refused():
    unknown = chunked(Q, (1, 7))
    unknown = unknown[unknown[:, 0, 0] > -100]  # a boolean index: unknown batch chunks
    with pytest.raises(mha.AttentionValueError, match="compute_chunk_sizes"):
        mha.dask.multi_head_attention(unknown, K, V, *WEIGHTS, H)
    mask = da.ones((B, L, S), dtype=bool, chunks=(1, L, S))
    mask = mask[mask[:, 0, 0]]
    with pytest.raises(mha.AttentionValueError, match="mask has unknown chunk sizes"):
        mha.dask.multi_head_attention(Q, K, V, *WEIGHTS, H, mask=mask)
    with pytest.raises(mha.AttentionValueError, match="split_every"):
        mha.dask.multi_head_attention(chunked(Q, (1, 7)), K, V, *WEIGHTS, H, split_every=1)


def test_core_never_imports_dask_and_a_missing_dask_is_named():
    code = (
        "import sys; sys.modules['dask'] = None; import mha, numpy as np\n"
        "X = np.ones((1, 2, 4)); W = np.eye(4)\n"
        "mha.multi_head_attention(X, X, X, W, W, W, W, 2)\n"
        "assert 'dask.array' not in sys.modules\n"
        "import mha.dask\n"
        "try:\n    mha.dask.multi_head_attention(X, X, X, W, W, W, W, 2)\n"
        "except ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert 'pip install ".[dask]"' in result.stdout


def _computed(args):
    return {
        name: np.asarray(value) if hasattr(value, "dask") else value for name, value in args.items()
    }


# --- docs/dask.md: its examples and its cluster commands, run as written ------------------

DOCS = (Path(__file__).parent.parent / "docs" / "dask.md").read_text()


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", DOCS, flags=re.DOTALL)


def test_the_docs_first_example_runs_and_equals_in_memory(record_error):
    namespace = {}
    exec(_blocks("python")[0], namespace)
    X = namespace["X"].compute()
    W = [namespace[name] for name in ("W_q", "W_k", "W_v", "W_o")]
    want = mha.multi_head_attention(X, X, X, *W, 8, causal=True)
    check(namespace["result"], want, record_error, "mha.dask vs in-memory, float32", 1e-6)


def test_the_docs_cluster_commands_and_script_run_as_written(tmp_path, record_error):
    """The scheduler and worker commands of docs/dask.md, started as separate processes
    (a cluster of one machine) while Dask's default ports 8786 and 8787 are taken, as on a
    Dask user's machine, and the client script against them. Every wait has a bound: a
    process that cannot start fails the test with its own last words."""
    (commands,) = [block for block in _blocks("bash") if "dask scheduler" in block]
    path = tmp_path / "scheduler.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    processes: list[tuple[subprocess.Popen, Path]] = []
    with _taken(8786), _taken(8787):
        try:
            for n, line in enumerate(commands.strip().splitlines()):
                argv = shlex.split(line.replace("~/scheduler.json", str(path)))
                log = tmp_path / f"command-{n}.log"
                with log.open("w") as out:
                    process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
                processes.append((process, log))
                _wait_for(path.exists, processes, 60, path.name)
            script = next(block for block in _blocks("python") if "scheduler_file" in block)
            with distributed.Client(scheduler_file=str(path), timeout=30) as client:
                client.wait_for_workers(2, timeout=60)
            namespace = {}
            exec(script.replace("~/scheduler.json", str(path)), namespace)
            check(namespace["result"], namespace["exact"], record_error)
        finally:
            for process, _ in reversed(processes):
                process.terminate()
            for process, _ in processes:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=30)


@contextlib.contextmanager
def _taken(port):
    """``port`` held by a listening socket while the block runs (already taken by another
    program: left as it is, which is the state wanted)."""
    with socket.socket() as holder:
        try:
            holder.bind(("", port))
            holder.listen()
        except OSError:
            pass
        yield


def _wait_for(done, processes, seconds, what):
    """Wait until ``done()``, at most ``seconds``; fail at once if a process has ended."""
    deadline = time.monotonic() + seconds
    while not done():
        ended = [(p, log) for p, log in processes if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            process, log = (ended or processes)[-1]
            last = log.read_text().strip().splitlines()[-5:]
            pytest.fail(
                f"no {what} after {seconds} s" if not ended else
                f"{process.args[:2]} ended with code {process.returncode} before {what} came"
                + ": " + " | ".join(last)
            )  # fmt: skip
        time.sleep(0.1)
