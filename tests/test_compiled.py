"""The compiled softmax step (numba, the ``fast`` extra) against NumPy's passes and exact
exponentials. CI installs numba and sets MHA_REQUIRE_NUMBA=1, making its absence a failure;
it also runs the kernel's test files again with MHA_COMPILED=0 (the NumPy path)."""

from __future__ import annotations

import numpy as np
import pytest
from support.extras import needs_numba

import mha
from mha._kernel import compiled, forward


@pytest.fixture(scope="module")
def kernels():
    needs_numba(compiled.available(), "the NumPy path runs alone")
    from mha._kernel import _numba_step

    return _numba_step


@pytest.fixture(autouse=True)
def every_call_compiled(tuned):
    """Calls of every size take the compiled step here (by default only large ones do)."""
    tuned(compiled_above=0)


def exponentials(kernels, x):
    from numba import njit

    @njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = kernels.exp(x[i])

    out = np.empty_like(x)
    apply(x, out)
    return out


@pytest.mark.parametrize(("dtype", "low"), [(np.float64, -708.0), (np.float32, -87.0)])
def test_exp_is_within_one_ulp_down_to_the_smallest_normal_result(kernels, dtype, low):
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.uniform(low, 0, 400_000), rng.uniform(-1, 0, 100_000), -np.logspace(-30, 0, 1000)]
    ).astype(dtype)
    exact = np.exp(x.astype(np.longdouble))
    ulps = np.abs(exponentials(kernels, x) - exact) / np.spacing(exact.astype(dtype))
    assert ulps.max() <= 1.0


@pytest.mark.parametrize(("dtype", "low"), [(np.float64, -708.0), (np.float32, -87.0)])
def test_exp_special_values(kernels, dtype, low):
    x = np.array([-np.inf, np.nan, low - 1, -1e30, 0.0, -0.0], dtype)
    out = exponentials(kernels, x)
    assert out[0] == 0.0 and np.isnan(out[1]) and out[2] == 0.0 and out[3] == 0.0
    assert out[4] == 1.0 and out[5] == 1.0


def tile(rng, dtype, G=2, R=37, w=53, hidden_share=0.2):
    s = (rng.standard_normal((G, R, w)) * 6).astype(dtype)
    s[rng.random(s.shape) < hidden_share] = -np.inf
    s[:, 3] = -np.inf  # a row that sees nothing in this tile
    return s


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_step_matches_numpy_passes_over_several_tiles(kernels, dtype):
    rng = np.random.default_rng(1)
    G, R, w = 2, 37, 53
    state = {path: [np.zeros((G, R), dtype) for _ in range(5)] for path in ("compiled", "numpy")}
    for first, s in zip((True, False, False), (tile(rng, dtype) for _ in range(3)), strict=True):
        s[:, 5] = -np.inf if first else s[:, 5]  # a row whose first key comes later
        ours, theirs = s.copy(), s.copy()
        m, ref, _, total, alpha = state["compiled"]
        compiled.softmax_step(ours, compiled.full_band(R, w), m, ref, total, alpha, first)
        m2, ref2, ref_new2, total2, alpha2 = state["numpy"]
        forward._softmax_step(theirs, None, m2, ref2, ref_new2, total2, alpha2, first)
        tolerance = 1e-15 if dtype == np.float64 else 1e-6
        np.testing.assert_array_equal(m, m2)
        np.testing.assert_array_equal(ref, ref2)
        np.testing.assert_allclose(ours, theirs, rtol=tolerance, atol=0)
        np.testing.assert_allclose(total, total2, rtol=2 * tolerance, atol=0)
        if not first:
            np.testing.assert_allclose(alpha, alpha2, rtol=tolerance, atol=0)


def test_step_band_equals_the_same_pairs_hidden_by_minus_inf(kernels):
    rng = np.random.default_rng(2)
    G, R, w = 2, 40, 70
    s = tile(rng, np.float64, G, R, w, hidden_share=0.0)
    lo = rng.integers(0, w, R)
    hi = np.minimum(w, lo + rng.integers(0, w, R))
    hi[7] = lo[7]  # an empty band
    masked = s.copy()
    outside = (np.arange(w) < lo[:, None]) | (np.arange(w) >= hi[:, None])
    masked[:, outside] = -np.inf
    results = []
    for x, band in ((s, (lo, hi)), (masked, compiled.full_band(R, w))):
        state = [np.zeros((G, R)) for _ in range(4)]
        compiled.softmax_step(x, band, *state, True)
        results.append((x, state[2]))
    np.testing.assert_array_equal(results[0][0], results[1][0])  # the same bits
    np.testing.assert_array_equal(results[0][1], results[1][1])
    assert np.all(results[0][0][:, 7] == 0.0) and np.all(results[0][1][:, 7] == 0.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_row_max_is_numpys_with_nan_passed_over(kernels, dtype):
    """The vector loop's blocks, the scalar tail, offsets into a row and strided rows."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 31, 32, 33, 64, 95, 512, 1000):
        x = rng.standard_normal(n + 5).astype(dtype)
        for view in (x[:n], x[3 : 3 + n], x[: 2 * (n // 2) : 2]):
            expected = view.max() if view.size else -np.inf
            assert kernels.row_max(view) == expected
        if n >= 3:
            y = x[:n].copy()
            top = int(np.argmax(y))
            y[[0, n // 2, n - 1]] = np.nan
            y[top] = 50.0  # the largest, wherever the NaNs fall
            assert kernels.row_max(y) == 50.0
            y[:] = np.nan
            assert kernels.row_max(y) == -np.inf  # only NaN: nothing seen
    x = np.full(64, -np.inf, dtype)
    x[40] = np.inf
    assert kernels.row_max(x) == np.inf


CALLS = [
    {"causal": True},
    {"causal": True, "causal_alignment": "top_left"},
    {"window": 37},
    {"causal": True, "window": 100, "key_lengths": [300, 170]},
    {"mask": "random"},
    {"bias": "random"},
    {},
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("call", CALLS)
def test_attention_agrees_on_both_paths(kernels, monkeypatch, dtype, call):
    rng = np.random.default_rng(3)
    B, H, H_kv, L, S, d = 2, 4, 2, 260, 300, 16
    q = rng.standard_normal((B, H, L, d)).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, S, d)).astype(dtype) for _ in range(2))
    kwargs = dict(call)
    if kwargs.get("mask") == "random":
        kwargs["mask"] = rng.random((B, 1, L, S)) < 0.7
    if kwargs.get("bias") == "random":
        kwargs["bias"] = rng.standard_normal((B, H, L, S)).astype(dtype)
    results = []
    for path in ("compiled", "numpy"):
        with monkeypatch.context() as patch:
            if path == "numpy":
                patch.setattr(compiled, "available", lambda: False)
            out, lse = mha.scaled_dot_product_attention(
                q, k, v, return_lse=True, max_memory=2**16, **kwargs
            )
        results.append((out, lse))
    tolerance = 1e-13 if dtype == np.float64 else 2e-6
    for ours, theirs in zip(*results, strict=True):
        finite = np.isfinite(theirs)
        np.testing.assert_array_equal(np.isfinite(ours), finite)
        np.testing.assert_allclose(ours[finite], theirs[finite], rtol=tolerance, atol=tolerance)


def test_nan_in_a_visible_score_spreads_alike_on_both_paths(kernels, monkeypatch):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 6, 4)) for _ in range(3))
    k[0, 2, 0] = np.nan  # seen by queries 2 to 5 only (causal)
    ours = mha.scaled_dot_product_attention(q, k, v, causal=True)
    monkeypatch.setattr(compiled, "available", lambda: False)
    theirs = mha.scaled_dot_product_attention(q, k, v, causal=True)
    for out in (ours, theirs):
        assert np.isnan(out[0, 2:]).all() and np.isfinite(out[0, :2]).all()
    scale = np.abs(theirs[0, :2]).max()  # the compiled walk (ours) and NumPy's round apart
    np.testing.assert_allclose(ours[0, :2], theirs[0, :2], rtol=1e-15, atol=1e-14 * scale)


def test_small_calls_the_walk_cannot_do_keep_numpys_passes(kernels, monkeypatch, tuned):
    """A call with a boolean mask takes the NumPy walk (the compiled walks take only what a
    band says), with the compiled step from ``compiled_above`` scores."""
    tuned(compiled_above=2**18)

    def refuse(*args):
        raise AssertionError("the compiled step ran for a small call")

    monkeypatch.setattr(compiled, "softmax_step", refuse)
    q = np.random.default_rng(7).standard_normal((2, 4, 64, 16))
    mask = np.tril(np.ones((64, 64), bool))
    mha.scaled_dot_product_attention(q, q, q, mask=mask)  # 32,768 scores: NumPy's passes
    big = np.random.default_rng(7).standard_normal((2, 4, 200, 16))
    with pytest.raises(AssertionError, match="small call"):  # 320,000: the compiled step
        mha.scaled_dot_product_attention(big, big, big, mask=np.ones((200, 200), bool))


def test_compile_time_is_recorded(kernels):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 64, 8)).astype(np.float32)
    # a bias is the NumPy walk's (with the compiled step); a plain call the compiled walk's
    mha.scaled_dot_product_attention(q, q, q, bias=np.zeros((64, 64), np.float32))
    assert compiled.compile_seconds()["step float32"] > 0.0
    mha.scaled_dot_product_attention(q, q, q)
    if compiled.walk_available():
        assert compiled.compile_seconds()["walk forward float32"] > 0.0


@pytest.mark.parametrize("call", CALLS[:4])
def test_float32_stays_within_2e5_of_torch_in_float64(kernels, torch, record_error, call):
    rng = np.random.default_rng(6)
    B, H, L, S, d = 2, 4, 300, 300, 32
    q, k, v = (rng.standard_normal((B, H, n, d)) for n in (L, S, S))
    kwargs = {key: value for key, value in call.items() if key != "key_lengths"}
    ours64 = mha.scaled_dot_product_attention(q, k, v, **kwargs)
    ours32 = mha.scaled_dot_product_attention(*(x.astype(np.float32) for x in (q, k, v)), **kwargs)
    mask = _dense_mask(L, S, **kwargs)  # the contract, written out independently
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(mask)
    ).numpy()
    scale = np.abs(expected).max()
    assert (
        record_error("compiled step vs torch float64, f64", np.abs(ours64 - expected).max() / scale)
        <= 1e-12
    )
    assert (
        record_error("compiled step vs torch float64, f32", np.abs(ours32 - expected).max() / scale)
        <= 2e-5
    )


def _dense_mask(L, S, causal=False, causal_alignment=None, window=None):
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    offset = 0 if causal_alignment == "top_left" else S - L
    visible = np.ones((L, S), dtype=bool)
    if causal:
        visible &= j <= i + offset
    if window is not None:
        visible &= (i + offset) - j < window
    return visible
