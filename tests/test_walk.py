"""The compiled tile walks (numba, the ``fast`` extra; GEMMs through NumPy's own BLAS) against
a float64 dense computation written here, against the NumPy walk they replace, and on the
cases they hand back to it. CI installs numba and sets MHA_REQUIRE_NUMBA=1, making their
absence a failure; the NumPy-only tiers and CI's MHA_COMPILED=0 pass run the NumPy walk
through the same calls."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from support.extras import needs_numba

import mha
from mha._kernel import blas, compiled, team, walk
from mha._kernel.call import Gradients, KernelCall, Outputs
from mha._kernel.contract import MaskArrays, MaskRules, ScoreShape, Visibility
from mha._kernel.dropout import Dropout
from mha._kernel.scores import ScoreMod, Scores, SoftCap


@pytest.fixture(scope="module")
def walks():
    needs_numba(compiled.walk_available(), "the NumPy walk runs alone (or no BLAS entry points)")


class _Counts(dict):
    """Runs of each walk, and (``"left"``, ``"forward left"``, ``"backward left"``) the
    tasks they left to NumPy's: the flags of each call's tasks, which its workers share,
    read once per call."""

    def __init__(self):
        super().__init__(forward=0, backward=0)
        self.flags = {}  # id -> (walk, the call's flags)

    def __getitem__(self, key):
        if key.endswith("left"):
            return sum(
                int(flags.sum())
                for name, flags in self.flags.values()
                if key in ("left", f"{name} left")
            )
        return super().__getitem__(key)


@pytest.fixture
def counted(monkeypatch):
    """How many times each compiled walk ran (once per worker of a call), and how many
    tasks the calls left to NumPy's walk."""
    counts = _Counts()
    for name in ("forward", "backward"):
        real = getattr(compiled, f"{name}_walk")

        def spy(dtype, work, *args, _real=real, _name=name):
            counts[_name] += 1
            _real(dtype, work, *args)
            flags = work[2]  # (tasks, counter, failed)
            counts.flags[id(flags)] = (_name, flags)  # kept: the id stays theirs

        monkeypatch.setattr(compiled, f"{name}_walk", spy)
    return counts


def numpy_walk(monkeypatch):
    """The NumPy walk for the rest of a ``monkeypatch.context()``."""
    monkeypatch.setattr(compiled, "walk_available", lambda: False)


def on_both_walks(monkeypatch, q, k, v, grad, **keywords):
    """``(out, lse, dq, dk, dv)`` of one call, first on the compiled walks, then on the
    NumPy walk."""
    results = []
    for path in ("compiled", "numpy"):
        with monkeypatch.context() as patch:
            if path == "numpy":
                numpy_walk(patch)
            out, lse, backward = mha.scaled_dot_product_attention(
                q, k, v, return_lse=True, return_backward=True, **keywords
            )
            results.append((out, lse, *backward(grad).values()))
    return results


def dense(q, k, v, *, causal=False, window=None, key_lengths=None, query_lengths=None):
    """Attention in float64 with the full score matrix, the mask written out."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    L, S = q.shape[-2], k.shape[-2]
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    allowed = np.ones((q.shape[0], 1, L, S), bool)
    if causal:
        allowed &= j <= i + S - L
    if window is not None:
        allowed &= (i + S - L) - j < window
    for b in range(q.shape[0]):
        if key_lengths is not None:
            allowed[b, :, :, key_lengths[b] :] = False
        if query_lengths is not None:
            allowed[b, :, query_lengths[b] :] = False
    s = np.where(allowed, q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), -np.inf)
    top = s.max(axis=-1, keepdims=True)
    top[~np.isfinite(top)] = 0.0
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    return (e / np.where(total == 0, 1, total)) @ v


CONFIGS = [  # B, H, H_kv, L, S, d, keywords
    (2, 4, 2, 130, 300, 16, {"causal": True}),
    (1, 8, 2, 1, 9000, 64, {}),  # decoding: few rows, wide key tiles
    (3, 2, 2, 300, 300, 32, {"causal": True, "window": 70}),
    (2, 6, 3, 17, 600, 8, {"key_lengths": [600, 41], "causal": True}),
    (2, 2, 1, 260, 260, 16, {"query_lengths": [260, 5], "window": 7}),
    (1, 1, 1, 3, 5, 4, {"causal": True}),
    (1, 7, 1, 1, 700, 24, {}),  # decoding: seven stacked rows, four and then three
    (2, 6, 2, 2, 500, 20, {"causal": True, "key_lengths": [500, 3]}),  # six rows, banded
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("workers", "max_memory"), [(1, 2**16), (3, 6 * 2**20)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
def test_walk_matches_a_dense_float64_computation(
    walks, counted, record_error, dtype, workers, max_memory, config
):
    B, H, H_kv, L, S, d, keywords = config
    rng = np.random.default_rng(L + S)
    q = rng.standard_normal((B, H, L, d)).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, S, d)).astype(dtype) for _ in range(2))
    out = mha.scaled_dot_product_attention(
        q, k, v, workers=workers, max_memory=max_memory, **keywords
    )
    assert counted["forward"] >= 1 and counted["left"] == 0
    expected = dense(q, k, v, **keywords)
    error = np.abs(out - expected).max() / np.abs(expected).max()
    record_error(f"compiled walk vs dense float64, {np.dtype(dtype).name}", error)
    assert error <= (1e-14 if dtype == np.float64 else 2e-6)


@pytest.mark.parametrize("config", CONFIGS[:5], ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
def test_walk_agrees_with_the_numpy_walk_forward_and_backward(walks, counted, monkeypatch, config):
    B, H, H_kv, L, S, d, keywords = config
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, H, L, d))
    k, v = (rng.standard_normal((B, H_kv, S, d)) for _ in range(2))
    grad = rng.standard_normal((B, H, L, d))
    results = on_both_walks(monkeypatch, q, k, v, grad, workers=2, **keywords)
    assert counted["forward"] >= 1 and counted["backward"] >= 1 and counted["left"] == 0
    for ours, theirs in zip(*results, strict=True):
        finite = np.isfinite(theirs)
        np.testing.assert_array_equal(np.isfinite(ours), finite)
        scale = max(np.abs(theirs[finite]).max(initial=0.0), 1e-300)
        assert np.abs(ours[finite] - theirs[finite]).max(initial=0.0) <= 1e-13 * scale


DOCUMENTS = np.repeat(np.arange(6), [70, 200, 1, 129, 150, 50])  # 600 positions


def _documents(b, h, i, j):
    return (DOCUMENTS[i] == DOCUMENTS[j]) & (i >= j)


def _all_but_row_3(b, h, i, j):
    return i != 3


def _per_head(b, h, i, j):  # a different mask for each head, most blocks partial
    return ((i - j) % (h + 2) == 0) | (j == 0)


VARIANTS = {  # computed in the compiled walks' score loops: B, H, H_kv, L, S, keywords
    "alibi": (2, 4, 2, 300, 450, {"causal": True, "alibi": True}),
    "alibi per sequence": (2, 2, 1, 200, 200, {"alibi": np.array([[0.5, 0.25], [0.1, 1.0]])}),
    "softcap": (2, 4, 4, 130, 600, {"softcap": 3.0, "key_lengths": [600, 77]}),
    "softcap and alibi": (1, 4, 2, 260, 260, {"causal": True, "softcap": 2.0, "alibi": True}),
    "chunk": (2, 4, 2, 600, 600, {"causal": True, "chunk": 100, "query_lengths": [600, 333]}),
    "chunk and window": (1, 2, 2, 257, 700, {"causal": True, "chunk": 160, "window": 90}),
    "chunk, top left": (1, 2, 1, 300, 500, {"causal": True, "chunk": 64,
                                             "causal_alignment": "top_left"}),
    "documents": (2, 4, 2, 600, 600, {"mask_mod": _documents}),
    "a mask per head": (1, 4, 2, 300, 600, {"mask_mod": _per_head, "causal": True}),
    "soft-capping and a row that sees nothing": (  # its lse -inf, no sinks to lift it
        1, 2, 1, 200, 200, {"softcap": 1.0, "mask_mod": _all_but_row_3}),
    "everything": (2, 4, 2, 400, 400, {"causal": True, "chunk": 128, "softcap": 4.0,
                                        "alibi": True, "mask_mod": _per_head,
                                        "sinks": np.array([0.5, -1.0, 2.0, 0.0])}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", VARIANTS)
def test_variants_take_the_compiled_walks_and_agree_with_the_numpy_walk(
    walks, counted, monkeypatch, record_error, case, dtype
):
    """ALiBi, soft-capping, chunks and a mask_mod's block map computed in the compiled
    walks, forward and backward, against the NumPy walk (which applies them as its own
    passes over each tile): the same up to rounding (soft-capping's tanh is the walks' own,
    within 4 ulp of NumPy's)."""
    B, H, H_kv, L, S, keywords = VARIANTS[case]
    rng = np.random.default_rng(L + S)
    q = rng.standard_normal((B, H, L, 32)).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, S, 32)).astype(dtype) for _ in range(2))
    grad = rng.standard_normal(q.shape).astype(dtype)
    for name in ("forward", "backward"):  # their buffers dirty: a walk reads what it wrote
        real = getattr(compiled, f"{name}_walk")

        def dirty(*args, _real=real):
            for buffer in args[-1]:
                buffer.fill(np.nan)
            _real(*args)

        monkeypatch.setattr(compiled, f"{name}_walk", dirty)
    results = on_both_walks(monkeypatch, q, k, v, grad, max_memory=2**19, **keywords)
    assert counted["forward"] >= 1 and counted["backward"] >= 1 and counted["left"] == 0
    bound = 1e-13 if dtype == np.float64 else 2e-5
    for name, ours, theirs in zip(("out", "lse", "q", "k", "v"), *results, strict=False):
        finite = np.isfinite(theirs)
        np.testing.assert_array_equal(np.isfinite(ours), finite, err_msg=name)
        scale = max(np.abs(theirs[finite]).max(initial=0.0), 1e-300)
        error = np.abs(ours[finite] - theirs[finite]).max(initial=0.0) / scale
        record_error(f"variants, compiled vs NumPy walk, {np.dtype(dtype).name}", error)
        assert error <= bound, name


def test_backward_walk_matches_autograd(walks, counted, torch, record_error):
    rng = np.random.default_rng(8)
    B, H, H_kv, L, S, d = 2, 4, 2, 150, 290, 16
    q = rng.standard_normal((B, H, L, d))
    k, v = (rng.standard_normal((B, H_kv, S, d)) for _ in range(2))
    grad = rng.standard_normal((B, H, L, d))
    out, backward = mha.scaled_dot_product_attention(
        q, k, v, causal=True, window=100, return_backward=True
    )
    ours = backward(grad)
    assert counted["backward"] >= 1 and counted["left"] == 0
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    allowed = torch.from_numpy((j <= i + S - L) & ((i + S - L) - j < 100))
    expected = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=allowed, enable_gqa=True
    )
    expected.backward(torch.from_numpy(grad))
    assert np.abs(out - expected.detach().numpy()).max() <= 1e-13
    for name, tensor in zip("qkv", (tq, tk, tv), strict=True):
        theirs = tensor.grad.numpy()
        error = np.abs(ours[name] - theirs).max() / np.abs(theirs).max()
        assert record_error("compiled backward walk vs torch.autograd", error) <= 1e-12


@pytest.mark.parametrize("where", ["values", "keys"])
def test_non_finite_hidden_keys_are_left_to_the_numpy_walk(walks, counted, monkeypatch, where):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((1, 2, 200, 16)) for _ in range(3))
    (v if where == "values" else k)[0, :, 150] = np.inf  # hidden from rows before 150
    grad = rng.standard_normal(q.shape)
    results = []
    for path in ("compiled", "numpy"):
        with monkeypatch.context() as patch:
            if path == "numpy":
                numpy_walk(patch)
            out, backward = mha.scaled_dot_product_attention(
                q, k, v, causal=True, return_backward=True, max_memory=2**16
            )
            grads = backward(grad)
            results.append((out, grads["q"], grads["k"], grads["v"]))
    # The forward hands back the tiles whose hidden values are not finite (0 * inf); the
    # backward, those whose hidden keys are not (its dq sums ds * k).
    assert counted["forward left" if where == "values" else "backward left"] >= 1
    for ours, theirs in zip(*results, strict=True):  # the rows that see key 150 are not
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-13, equal_nan=True)
    for ours in results[0][:2]:  # out and dq of the rows before it are
        assert np.isfinite(ours[:, :, :150]).all()


def test_split_keys_on_the_walk(walks, counted, record_error):
    rng = np.random.default_rng(10)
    q = rng.standard_normal((1, 1, 1, 32))
    k, v = (rng.standard_normal((1, 1, 20_000, 32)) for _ in range(2))
    out, lse = mha.scaled_dot_product_attention(q, k, v, workers=3, return_lse=True)
    # the keys were split into tasks for the workers (however many of them came in time)
    assert [len(flags) for _, flags in counted.flags.values()] == [3]
    expected = dense(q, k, v)
    s = (q @ np.swapaxes(k, -1, -2))[..., 0, :] / np.sqrt(32)
    expected_lse = s.max() + np.log(np.exp(s - s.max()).sum())
    assert record_error("split keys on the walk", np.abs(out - expected).max()) <= 1e-14
    assert abs(lse.item() - expected_lse) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_decoding_keys_whose_rows_lie_apart(walks, counted, record_error, dtype):
    """A decoding step's scores read each key row where it lies: here every other row of a
    wider array, and each row's first 40 of 56 entries (as a fused projection leaves them)."""
    rng = np.random.default_rng(13)
    q = rng.standard_normal((2, 8, 1, 40)).astype(dtype)
    wide = rng.standard_normal((2, 2, 2 * 777, 56)).astype(dtype)
    k, v = wide[:, :, ::2, :40], wide[:, :, 1::2, 16:]
    out = mha.scaled_dot_product_attention(q, k, v, key_lengths=[777, 300])
    assert counted["forward"] >= 1 and counted["left"] == 0
    expected = dense(q.astype(float), k.astype(float), v.astype(float), key_lengths=[777, 300])
    error = np.abs(out - expected).max() / np.abs(expected).max()
    record_error(f"decoding keys apart vs dense float64, {np.dtype(dtype).name}", error)
    assert error <= (1e-14 if dtype == np.float64 else 2e-6)


@pytest.mark.parametrize(
    "keywords",
    [
        {"mask": np.tril(np.ones((64, 64), bool))},
        {"bias": np.zeros((64, 64))},
        {"score_mod": lambda s, b, h, i, j: s * 0.5,
         "score_mod_grad": lambda s, b, h, i, j: np.full_like(s, 0.5)},
        {"alibi": mha.symmetric_alibi(mha.alibi_slopes(2))},
        {"mask_mod": lambda b, h, i, j: i >= j, "kept": 0},  # its partial blocks not kept
        {"return_weights": True},
        {"window": 8, "sink_tokens": 2},
        {"dropout_p": 0.1, "generator": np.random.default_rng(0)},
        {"dtype": np.float16},
        {"dtype": "mixed"},
    ],
    ids=["mask", "bias", "score_mod", "symmetric alibi", "mask_mod beyond its budget",
         "weights", "sink_tokens", "dropout", "float16", "mixed"],
)  # fmt: skip
def test_what_a_band_cannot_say_takes_the_numpy_walk(walks, counted, monkeypatch, keywords):
    from mha._kernel import block_mask

    keywords = dict(keywords)
    if "kept" in keywords:
        monkeypatch.setattr(block_mask, "PARTIAL_MOST", keywords.pop("kept"))
    dtype = keywords.pop("dtype", np.float64)
    q = np.random.default_rng(11).standard_normal((1, 2, 64, 8))
    k = v = q.astype(np.float32 if dtype == "mixed" else dtype)
    q = q if dtype == "mixed" else k
    results = mha.scaled_dot_product_attention(q, k, v, **keywords, return_backward=True)
    if not keywords.get("return_weights"):
        results[-1](np.ones_like(results[0]))  # the backward too
    assert counted["forward"] == 0 and counted["backward"] == 0


def test_the_walk_serves_decoding_with_a_cache_and_sinks(walks, counted):
    """Ragged prompts: each sequence has its own length, offset and keys."""
    attention = mha.MultiHeadAttention(
        32, 4, num_kv_heads=2, rope_theta=10000.0, sinks=True, seed=0
    )
    X = np.random.default_rng(12).standard_normal((2, 9, 32))
    cache = attention.new_cache(batch_size=2)
    attention(X[:, :5], cache=cache, query_lengths=[5, 3])
    for i in range(4):
        attention(X[:, 5 + i : 6 + i], cache=cache)
    assert counted["forward"] >= 5 and counted["left"] == 0
    for b, (prompt, n) in enumerate([(5, 9), (3, 7)]):
        tokens = np.concatenate([X[b, :prompt], X[b, 5 : 5 + n - prompt]])[None]
        fresh = attention.new_cache(batch_size=1)
        steps = [attention(tokens[:, :prompt], cache=fresh)]
        steps += [attention(tokens[:, i : i + 1], cache=fresh) for i in range(prompt, n)]
        whole = attention(tokens, mask=True)  # the same tokens, all at once
        np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-12, atol=1e-13)
    with_cache = attention.new_cache(batch_size=2)
    out = attention(X[:, :5], cache=with_cache, query_lengths=[5, 3])
    alone = attention(X[1:, :3], mask=True)
    np.testing.assert_allclose(out[1, :3], alone[0], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("heads", "kv_heads", "tile"), [(4, 2, 8192), (6, 2, 16), (3, 3, 7)])
def test_a_lone_walk_gives_its_plans_bits(walks, monkeypatch, dtype, heads, kv_heads, tile):
    """A decoding step on one worker runs the compiled walk without a plan
    (:func:`.walk.run_lone`): the bits of the same step through :class:`.walk.ForwardPlan`
    (what :func:`.forward.attend` runs), for ragged sequences, grouped heads and key tiles
    of one key to many."""
    from mha._kernel import runtime, walk

    rng = np.random.default_rng(heads * 10 + tile)
    prompt = rng.standard_normal((3, 40, 8 * heads)).astype(dtype)
    steps = rng.standard_normal((5, 3, 1, 8 * heads)).astype(dtype)
    attention = mha.MultiHeadAttention(8 * heads, heads, num_kv_heads=kv_heads, seed=1,
                                       rope_theta=500.0, dtype=dtype)  # fmt: skip

    def decode(lone):
        cache = attention.new_cache(batch_size=3)
        attention(prompt, cache=cache, query_lengths=[40, 17, 1])
        calls = []
        real = walk.run_lone

        def run_lone(*args):
            calls.append(1)
            return lone and real(*args)  # False: attend computes the step, by a plan

        monkeypatch.setattr(walk, "run_lone", run_lone)
        out = [attention(x, cache=cache, workers=1) for x in steps]
        monkeypatch.setattr(walk, "run_lone", real)
        assert len(calls) == len(steps) if lone else len(calls) >= len(steps)
        return np.concatenate(out, axis=1)

    with runtime.DEFAULT.tuned(wide_key_tile=tile):
        np.testing.assert_array_equal(decode(lone=True), decode(lone=False))


def test_gemm_entry_points_are_numpys_own_blas(walks):
    """A GEMM through the addresses gives np.matmul's bits; the thread setting is NumPy's."""
    from numba import njit
    from threadpoolctl import threadpool_limits

    from mha._kernel._numba_walk import NO_TRANS, TRANS, _gemm

    @njit
    def product(address, a, b, c):  # a @ b.T, row-major
        op = (NO_TRANS, TRANS, a.shape[0], b.shape[0], a.shape[1], 1.0, 0.0)
        _gemm(address, op, (a, 0, a.shape[1]), (b, 0, b.shape[1]), (c, 0, c.shape[1]))

    addresses = blas.gemm_addresses()
    assert addresses is not None and set(addresses) == {"float32", "float64"}
    rng = np.random.default_rng(14)
    for dtype in (np.float32, np.float64):
        a, b = (rng.standard_normal(shape).astype(dtype) for shape in ((300, 70), (90, 70)))
        c = np.empty((300, 90), dtype)
        with threadpool_limits(1, user_api="blas"):
            product(addresses[np.dtype(dtype).name], a, b, c)
            np.testing.assert_array_equal(c, a @ b.T)
    get, _ = blas.thread_setting()
    with threadpool_limits(2, user_api="blas"):  # what a user's program may have set
        with team.Team(2):
            assert get() == 1  # the team holds NumPy's BLAS to one thread
        assert get() == 2  # and gives the user's setting back


def test_calls_from_many_threads_give_the_same_bits(walks, counted):
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((2, 4, 300, 16)).astype(np.float32) for _ in range(3))
    alone = mha.scaled_dot_product_attention(q, k, v, causal=True, workers=2)
    results = [None] * 6

    def call(i):
        results[i] = mha.scaled_dot_product_attention(q, k, v, causal=True, workers=2)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert counted["forward"] >= 7 and counted["left"] == 0
    for result in results:
        np.testing.assert_array_equal(result, alone)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [4, 6, 8])
def test_a_decoding_steps_register_blocks_sum_as_one_row_at_a_time(walks, dtype, rows):
    """``p @ v`` for few rows: four rows at a time in registers (LLVM vector code), the rest
    one or two at a time; each partial sum gets the same operations in the same order, so
    the bits are the same, in ``acc`` and in the sums not yet added to it. Runs that start
    mid-tile, cross the 256-position flushes, and a tile's values split into two runs (a
    paged cache's blocks apart) as if they were one."""
    from numba import njit

    from mha._kernel import _numba_pool

    @njit
    def accumulate(values, n, s, at, w, acc, i0, rows, partial):
        run = (_numba_pool.address(values, 0), values.shape[1], n, 0, 0)
        _numba_pool.few_accumulate(run, s, at, w, acc, i0, rows, partial)

    rng = np.random.default_rng(rows)
    for n, at, w, d in [(1024, 0, 1024, 128), (300, 100, 700, 64), (37, 5, 42, 16), (9, 0, 9, 8)]:
        values = rng.standard_normal((n, d)).astype(dtype)
        s = rng.standard_normal((rows, w)).astype(dtype)
        acc = rng.standard_normal((rows + 2, d)).astype(dtype)
        blocked, blocked_partial = acc.copy(), np.zeros((rows, d), dtype)
        accumulate(values, n, s, at, w, blocked, 2, rows, blocked_partial)
        alone, alone_partial = acc.copy(), np.zeros((rows, d), dtype)
        for j in range(rows):
            accumulate(values, n, s[j : j + 1], at, w, alone, 2 + j, 1, alone_partial[j : j + 1])
        np.testing.assert_array_equal(blocked, alone)
        np.testing.assert_array_equal(blocked_partial, alone_partial)
        split, split_partial, k = acc.copy(), np.zeros((rows, d), dtype), n // 3
        for lo, hi in ((0, k), (k, n)):
            part = np.ascontiguousarray(values[lo:hi])
            accumulate(part, hi - lo, s, at + lo, w, split, 2, rows, split_partial)
        np.testing.assert_array_equal(split, blocked)
        np.testing.assert_array_equal(split_partial, blocked_partial)
        total = blocked[2:].astype(np.float64) + blocked_partial - acc[2:]
        expected = s[:, at : at + n].astype(np.float64) @ values.astype(np.float64)
        tolerance = 1e-4 if dtype == np.float32 else 1e-11
        np.testing.assert_allclose(total, expected, rtol=tolerance, atol=tolerance)


def test_workers_take_tasks_from_one_counter(walks, monkeypatch):
    """Each worker runs the walk once, taking tasks from the call's counter until none are
    left: with the helpers busy elsewhere, the caller's one run takes every task, the share
    left for a helper finds none (and runs no walk), and the bits are one worker's."""
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((3, 4, 600, 16)) for _ in range(3))
    one = mha.scaled_dot_product_attention(q, k, v, causal=True, workers=1)
    runs = []
    real = compiled.forward_walk

    def spy(dtype, work, *args):
        table, counter, _ = work
        before = int(counter[0])
        real(dtype, work, *args)
        runs.append((before, int(counter[0]), len(table)))

    monkeypatch.setattr(compiled, "forward_walk", spy)
    release = threading.Event()
    for _ in range(max(1, team._helpers().threads)):  # every helper busy elsewhere
        team._helpers().submit(release.wait, 1)
    try:
        busy = mha.scaled_dot_product_attention(q, k, v, causal=True, workers=2)
    finally:
        release.set()
    ((start, taken, tasks),) = runs  # the second share found nothing left: no walk ran
    assert tasks > 2 and start == 0 and taken == tasks + 1  # every task, then the end
    np.testing.assert_array_equal(busy, one)
    runs.clear()
    both = mha.scaled_dot_product_attention(q, k, v, causal=True, workers=2)
    ends = [end for _, end, _ in runs]  # one walk, or two if the helper came in time
    assert len(runs) in (1, 2) and max(ends) == tasks + len(runs)  # one overshoot each
    np.testing.assert_array_equal(both, one)


def test_take_hands_each_index_to_exactly_one_thread(walks):
    """The walks' counter (an atomic add) from four threads at once, each taking indices
    as fast as it can without the GIL: every index once, none twice."""
    from numba import njit

    from mha._kernel._numba_walk import _take

    @njit(nogil=True)
    def take_all(counter, n, log):
        taken = 0
        while True:
            t = _take(counter)
            if t >= n:
                return taken
            log[t] += 1
            taken += 1

    n = 2_000_000
    counter, log = np.zeros(1, np.int64), np.zeros(n, np.int8)
    take_all(np.zeros(1, np.int64), 10, np.zeros(10, np.int8))  # compiled before the race
    counts = [0] * 4

    def run(i):
        counts[i] = take_all(counter, n, log)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(counts) == n and counter[0] == n + 4
    assert (log == 1).all()


def test_the_walk_is_chosen_by_the_fields_a_call_sets():
    """A call's features are the fields its objects set, by name: the compiled walk supports
    a band, plain scores with sinks and float32/float64; an option it does not declare, even
    one added after it was written, sends the call to the NumPy walk."""
    q, k = np.zeros((2, 4, 5, 8), np.float32), np.zeros((2, 2, 7, 8), np.float32)
    out = np.zeros_like(q)
    arrays, walks = (q, k, k, out), (walk.COMPILED_FORWARD, walk.NUMPY)
    rules, lengths = MaskRules(causal=True, window=3), MaskArrays(key_lengths=[7, 4])
    visibility = Visibility.build(rules, lengths, ScoreShape((2,), 4, 5, 7))
    call = KernelCall(q, k, k, visibility, 0.5, scores=Scores(sinks=np.zeros(4)))
    needs = walk.features(call, Outputs(out), arrays)
    band = {"visibility.causal", "visibility.window", "visibility.causal_offset"}
    assert needs == band | {"visibility.key_lengths", "scores", "scores.sinks", "dtype float32"}
    assert needs <= walk.COMPILED_FORWARD.supports
    chosen = walk.choose(walks, call, Outputs(out), arrays)
    assert chosen is (walk.COMPILED_FORWARD if compiled.walk_available() else walk.NUMPY)
    grads = Gradients(q, k, k, dq_factor=2.0)
    assert walk.features(call, grads, (q, k, k)) <= walk.COMPILED_BACKWARD.supports

    @dataclasses.dataclass(frozen=True)
    class Later(Visibility):  # an option the compiled walk was never told of
        novel: int | None = None

    fields = {name: getattr(visibility, name) for name in Visibility.__dataclass_fields__}
    taken = {
        "score softcap": dataclasses.replace(call, scores=Scores((SoftCap(2.0),))),
        "visibility.chunk": dataclasses.replace(
            call, visibility=dataclasses.replace(visibility, chunk=2)
        ),
    }
    for feature, changed in taken.items():
        needs = walk.features(changed, Outputs(out), arrays)
        assert feature in needs and needs <= walk.COMPILED_FORWARD.supports
    refused = {
        "score ScoreMod": dataclasses.replace(call, scores=Scores((ScoreMod(np.negative),))),
        "dropout": dataclasses.replace(call, dropout=Dropout(0.1, 0, 4, 5)),
        "visibility.sink_tokens": dataclasses.replace(
            call, visibility=dataclasses.replace(visibility, sink_tokens=2)
        ),
        "visibility.novel": dataclasses.replace(call, visibility=Later(**fields, novel=3)),
    }
    for feature, changed in refused.items():
        needs = walk.features(changed, Outputs(out), arrays)
        assert feature in needs and not needs <= walk.COMPILED_FORWARD.supports
        assert walk.choose(walks, changed, Outputs(out), arrays) is walk.NUMPY
    assert "weights" in walk.features(call, Outputs(out, weights=out), arrays)
    assert "dtypes mixed" in walk.features(call, Outputs(out), (q, k, k, out.astype(float)))


RULES = [
    {"causal": True},
    {"causal": True, "window": 37},
    {"window": (20, 9)},
    {"causal": True, "chunk": 50},
    {"causal": True, "chunk": 64, "window": 40, "causal_alignment": "top_left"},
    {"chunk": 33, "key_lengths": [300, 17], "query_lengths": [5, 260]},
    {"causal": True, "key_lengths": [300, 120], "query_lengths": [260, 99],
     "causal_alignment": "bottom_right_per_sequence"},
]  # fmt: skip


@pytest.mark.parametrize("keywords", RULES, ids=lambda kw: "-".join(sorted(kw)))
def test_the_share_of_pairs_seen_is_counted_exactly(keywords):
    """What a call's workers are chosen from: the pairs its rules leave (counted row by
    row), equal to the count of its visibility written out pair by pair."""
    keywords = dict(keywords)
    arrays = MaskArrays(
        key_lengths=keywords.pop("key_lengths", None),
        query_lengths=keywords.pop("query_lengths", None),
    )
    rules = MaskRules.check(
        None,
        keywords.pop("causal", None),
        keywords.pop("causal_alignment", None),
        keywords.pop("window", None),
        None,
        keywords.pop("chunk", None),
        None,
    )
    visibility = Visibility.build(rules, arrays, ScoreShape((2,), 1, 260, 300))
    assert visibility.seen_fraction() == pytest.approx(visibility.allowed().mean(), abs=1e-15)


def test_a_call_whose_rules_leave_little_work_runs_on_one_worker(monkeypatch):
    """The workers follow the pairs computed, not L x S: 2,048 queries in chunks of 32
    compute 1/128 of the pairs."""
    sizes = []
    real = team.Team.__init__

    def spy(self, workers, *args, **kwargs):
        sizes.append(workers)
        real(self, workers, *args, **kwargs)

    monkeypatch.setattr(team.Team, "__init__", spy)
    monkeypatch.setattr(team, "default_workers", lambda: 2)
    q = np.zeros((1, 1, 2048, 16), np.float32)
    limit = team.runtime.DEFAULT.thresholds.serial_below
    assert 2048 * 2048 * 32 >= limit > 2048 * 2048 * 32 / 128  # (the test's premise)
    mha.scaled_dot_product_attention(q, q, q, causal=True)
    mha.scaled_dot_product_attention(q, q, q, causal=True, chunk=32)
    assert sizes == [2, 1]
