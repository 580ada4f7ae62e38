"""One kernel, one answer: tile sizes, ragged tiles and workers change results only by
rounding; the log-sum-exp is right; partial results merge exactly; memory stays linear."""

from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest
from support.configs import call_args, random_config, relative_error
from support.reference import loop_log_sum_exp

import mha
from mha._kernel import forward as kernel

# (keys per tile, scratch budget in bytes, workers): from one-key tiles to uneven ones
TILINGS = [
    (1, 2**12, 1),
    (3, 2**13, 2),
    (7, 2**14, 3),
    (16, 2**12, 3),
    (16, 2**15, 2),
    (512, 2**16, 2),
]


@pytest.fixture
def tiny_tiles(monkeypatch, tuned):
    """Make small problems use the thread pool and the requested key tile."""
    tuned(serial_below=0)

    def set_key_tile(cols):
        tuned(key_tile=cols, wide_key_tile=cols)

    return set_key_tile


@pytest.mark.parametrize("seed", range(3000, 3040))
def test_tiles_and_workers_change_results_only_by_rounding(seed, tiny_tiles, record_error):
    config = random_config(seed, long=True)
    positional, keywords = call_args(config)
    layout = config["layout"]
    d_k, d_v = layout["d_k"], layout["d_v"]
    one_tile = kernel.plan_tiles(layout["L"], layout["S"], 1, d_k, d_v, 8, 2**30)
    assert one_tile == kernel.Tiles(rows=layout["L"], cols=layout["S"], heads=1)
    heads = config["num_heads"]
    expected = mha.multi_head_attention(*positional, heads, **keywords, max_memory=2**30, workers=1)
    expected_weights = mha.multi_head_attention(
        *positional, heads, **keywords, max_memory=2**30, workers=1, return_weights=True
    )[1]
    for cols, budget, workers in TILINGS:
        tiny_tiles(cols)
        tiles = kernel.plan_tiles(layout["L"], layout["S"], heads, d_k, d_v, 8, budget)
        assert tiles.cols <= cols
        out = mha.multi_head_attention(
            *positional, heads, **keywords, max_memory=budget, workers=workers
        )
        assert record_error(
            "tiled vs one tile, output, float64", relative_error(out, expected)
        ) <= (1e-12)
        _, weights = mha.multi_head_attention(
            *positional, heads, **keywords, max_memory=budget, workers=workers, return_weights=True
        )
        assert relative_error(weights, expected_weights) <= 1e-12


def test_tilings_really_are_ragged_and_many(tiny_tiles):
    plans = []
    for cols, budget, _ in TILINGS:
        tiny_tiles(cols)
        plans.append(kernel.plan_tiles(37, 45, 1, 4, 4, 8, budget))
    assert any(37 % plan.rows and 45 % plan.cols for plan in plans)
    assert min(plan.rows for plan in plans) < 37 and min(plan.cols for plan in plans) < 45


def logsumexp_oracle(config, torch):
    """log sum_j exp(logit_ij) over visible keys, by torch, from the explicit mask."""
    from support.torch_oracle import allowed_mask

    q, k = (torch.from_numpy(config[name]) for name in ("q", "k"))
    logits = q @ k.transpose(-1, -2) * config["scale"] + torch.from_numpy(config["bias"])
    visible = allowed_mask(config["as_config"], torch)[:, : q.shape[1]]
    return torch.logsumexp(torch.where(visible, logits, -math.inf), dim=-1).numpy()


def split_heads_config(seed):
    rng = np.random.default_rng(seed)
    B, H, L, S, d = 2, 3, int(rng.integers(1, 30)), int(rng.integers(1, 40)), 5
    q, k, v = (rng.standard_normal((B, H, n, d)) for n in (L, S, S))
    bias = rng.standard_normal((B, H, L, S))
    bias[rng.random(bias.shape) < 0.1] = -np.inf
    mask = rng.random((B, L, S)) < 0.8
    mask &= np.tril(np.ones((L, S), dtype=bool), k=S - L)  # causal, as an explicit mask
    key_lengths = rng.integers(0, S + 1, size=B)
    as_config = {
        "layout": {"B": B, "H": H, "L": L, "S": S, "unbatched": False},
        "kwargs": {"mask": mask, "key_lengths": key_lengths, "bias": bias},
    }
    return {"q": q, "k": k, "v": v, "bias": bias, "mask": mask, "key_lengths": key_lengths,
            "scale": 1 / math.sqrt(d), "as_config": as_config, "rng": rng}  # fmt: skip


@pytest.mark.parametrize("seed", range(40))
def test_log_sum_exp_matches_torch(seed, torch, record_error):
    c = split_heads_config(seed)
    _out, lse = mha.scaled_dot_product_attention(
        c["q"], c["k"], c["v"], mask=c["mask"], bias=c["bias"], key_lengths=c["key_lengths"],
        return_lse=True, max_memory=2**13,
    )  # fmt: skip
    loops = loop_log_sum_exp(c["q"], c["k"], c["scale"], c["bias"], c["as_config"])
    for family, expected in (("torch", logsumexp_oracle(c, torch)), ("plain loops", loops)):
        assert np.array_equal(np.isneginf(lse), np.isneginf(expected)), family
        finite = np.isfinite(expected)
        error = relative_error(lse[finite], expected[finite])
        assert record_error(f"log-sum-exp vs {family}", error) <= 1e-12


@pytest.mark.parametrize("seed", range(40))
def test_partials_over_disjoint_key_ranges_merge_exactly(seed, record_error):
    c = split_heads_config(seed)
    S = c["k"].shape[-2]
    cuts = (
        sorted(c["rng"].choice(np.arange(1, S), size=min(S - 1, 3), replace=False)) if S > 1 else []
    )
    edges = [0, *cuts, S]
    full, full_lse = mha.scaled_dot_product_attention(
        c["q"], c["k"], c["v"], mask=c["mask"], bias=c["bias"], key_lengths=c["key_lengths"],
        return_lse=True,
    )  # fmt: skip
    outs, lses = [], []
    for a, b in itertools.pairwise(edges):
        out, lse = mha.scaled_dot_product_attention(
            c["q"], c["k"][..., a:b, :], c["v"][..., a:b, :], mask=c["mask"][..., a:b],
            bias=c["bias"][..., a:b], key_lengths=np.clip(c["key_lengths"] - a, 0, b - a),
            return_lse=True, max_memory=2**12,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = mha.merge_attention(outs, lses)
    assert record_error("merged partials vs whole", relative_error(merged, full)) <= 1e-12
    assert np.array_equal(np.isneginf(merged_lse), np.isneginf(full_lse))
    finite = np.isfinite(full_lse)
    assert relative_error(merged_lse[finite], full_lse[finite]) <= 1e-12
    assert np.all(merged[~finite] == 0)


def test_merging_fully_masked_partials():
    out = np.zeros((1, 2, 3))
    lse = np.full((1, 2), -np.inf)
    merged, merged_lse = mha.merge_attention([out, out], [lse, lse])
    assert np.all(merged == 0) and np.all(np.isneginf(merged_lse))
    seen = np.ones((1, 2, 3))
    merged, merged_lse = mha.merge_attention([out, seen], [lse, np.zeros((1, 2))])
    np.testing.assert_array_equal(merged, seen)
    np.testing.assert_array_equal(merged_lse, 0.0)


def test_merging_lses_in_base_2_as_flashinfer_keeps_them(record_error):
    """FlashInfer's ``merge_state``, from its definition: a part's lse is ``log2 sum_j
    2^(s_j)`` of its scores in base 2 (``s = q.k * scale * log2(e)``); the merged output is
    ``sum_p 2^(lse_p) o_p / sum_p 2^(lse_p)`` and the merged lse ``log2 sum_p 2^(lse_p)``."""
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((3, 2, 3, 5, 8))
    scale = 8**-0.5
    parts = [(0, 2), (2, 5)]
    outs, lses = [], []
    for a, b in parts:
        s2 = np.einsum("...ld,...sd->...ls", q, k[..., a:b, :]) * scale * np.log2(np.e)
        lse2 = np.log2(np.sum(np.exp2(s2), axis=-1))
        outs.append(np.exp2(s2 - lse2[..., None]) @ v[..., a:b, :])
        lses.append(lse2)
    weights = np.exp2(np.stack(lses))
    want = (weights[..., None] * np.stack(outs)).sum(axis=0) / weights.sum(axis=0)[..., None]
    want_lse = np.log2(weights.sum(axis=0))
    merged, merged_lse = mha.merge_attention(outs, lses, base=2)
    error = relative_error(merged, want)
    assert record_error("merge_attention base 2 vs FlashInfer's formula", error) <= 1e-14
    np.testing.assert_allclose(merged_lse, want_lse, rtol=1e-14, atol=0)
    whole = mha.scaled_dot_product_attention(q, k, v)
    assert relative_error(merged, whole) <= 1e-14
    with pytest.raises(mha.AttentionValueError, match=r"base must be None .* or 2; got 10"):
        mha.merge_attention(outs, lses, base=10)


def test_an_lse_of_plus_infinity_is_a_part_that_saw_no_key():
    """vLLM's ``merge_attn_states`` reads FlashAttention-2's ``+inf`` lse of an empty part
    (a sequence of no keys) as ``-inf``: the part adds nothing, where the merge would give
    NaN."""
    rng = np.random.default_rng(8)
    seen = rng.standard_normal((2, 3, 4))
    seen_lse = rng.standard_normal((2, 3))
    garbage = np.full((2, 3, 4), 7.0)  # what an empty part's output buffer held
    merged, merged_lse = mha.merge_attention([garbage, seen], [np.full((2, 3), np.inf), seen_lse])
    np.testing.assert_array_equal(merged, seen)
    np.testing.assert_array_equal(merged_lse, seen_lse)
    merged, merged_lse = mha.merge_attention([garbage], [np.full((2, 3), np.inf)])
    assert np.all(merged == 0) and np.all(np.isneginf(merged_lse))


@pytest.mark.parametrize(
    ("outputs", "lses", "kind", "message"),
    [
        ([np.zeros((2, 3))], [], mha.AttentionValueError, r"one lse per output .* 1 outputs and 0"),
        ([np.zeros((2, 3))], [np.zeros(3)], mha.ShapeError,
         r"lses\[0\] must have the shape of outputs\[0\] without its last axis"),
        ([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2)] * 2, mha.ShapeError,
         r"outputs\[0\] has shape \(2, 3\) but outputs\[1\] has \(2, 4\)"),
        (np.zeros((2, 2, 3)), [np.zeros(2)] * 2, mha.AttentionTypeError, r"list or tuple"),
    ],
)  # fmt: skip
def test_merge_errors(outputs, lses, kind, message):
    with pytest.raises(kind, match=message):
        mha.merge_attention(outputs, lses)


def test_memory_is_linear_in_sequence_length(warm_kernel):
    """Causal attention over 4096 positions in float32: the dense scores would be 128 MiB."""
    rng = np.random.default_rng(0)
    H, L, d = 2, 4096, 32
    q, k, v = (rng.standard_normal((H, L, d), dtype=np.float32) for _ in range(3))
    budget = 2**20
    tracemalloc.start()
    out = mha.scaled_dot_product_attention(q, k, v, causal=True, max_memory=budget, workers=2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    dense = H * L * L * 4
    assert peak <= out.nbytes + 2 * 2 * budget, (peak, dense)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_row_hidden_in_its_first_tiles_then_seeing_very_negative_logits(dtype, workers):
    """The running sum of a row that saw nothing yet must not be rescaled by exp(+big)."""
    r = np.random.default_rng(0)
    L, S = 2, 600
    q, k = r.standard_normal((1, L, 8)).astype(dtype), r.standard_normal((1, S, 8)).astype(dtype)
    v = r.standard_normal((1, S, 4)).astype(dtype)
    mask = np.ones((L, S), dtype=bool)
    mask[1, :512] = False  # row 1 sees nothing in the first key tile
    bias = np.full((L, S), -1e4)  # a finite "padding" bias: logits far below -709
    out, lse = mha.scaled_dot_product_attention(
        q, k, v, mask=mask, bias=bias, return_lse=True, workers=workers
    )
    one_tile, one_lse = mha.scaled_dot_product_attention(
        q, k, v, mask=mask, bias=bias, return_lse=True, max_memory=2**30
    )
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, one_tile, rtol=1e-5 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(lse, one_lse, rtol=1e-6)


def test_merge_ignores_a_part_that_saw_no_key_even_if_it_holds_nan():
    seen, lse = np.ones((2, 3)), np.zeros(2)
    merged, merged_lse = mha.merge_attention(
        [np.full((2, 3), np.nan), seen], [np.full(2, -np.inf), lse]
    )
    np.testing.assert_array_equal(merged, seen)
    np.testing.assert_array_equal(merged_lse, lse)


def test_multi_head_attention_memory_is_the_projections_plus_scratch(warm_kernel):
    """Causal self-attention, L = 8192, d_model 512, 8 heads, float32: the scores would be
    2 GiB; the peak stays within q, k, v and the output plus 64 MiB."""
    L, E = 8192, 512
    r = np.random.default_rng(0)
    X = r.standard_normal((1, L, E), dtype=np.float32)
    W = [r.standard_normal((E, E), dtype=np.float32) / np.float32(23) for _ in range(4)]
    tracemalloc.start()
    mha.multi_head_attention(X, X, X, *W, 8, causal=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= 4 * L * E * 4 + 64 * 2**20, peak / 2**20


NARROWED = [  # (L, S, max_memory, call): tiles of 172 rows (1 MiB) or 1037 (6 MiB)
    (900, 700, 2**20, {"causal": True}),  # L > S: the first key tile is already narrowed
    (700, 700, 2**20, {"causal": True, "causal_alignment": "top_left"}),
    (1400, 1400, 6 * 2**20, {"window": 40}),  # no causal mask: later rows drop out instead
    (700, 700, 2**20, {"causal": True, "window": 200, "key_lengths": [700, 430]}),
]


@pytest.mark.parametrize("path", ["walk", "compiled step", "numpy"])
@pytest.mark.parametrize(("L", "S", "max_memory", "call"), NARROWED)
def test_rows_narrowed_per_key_tile_match_autograd(L, S, max_memory, call, path, torch,
                                                   monkeypatch):  # fmt: skip
    """Tiles of many rows over key tiles of 512: only the rows that can see a key tile are
    computed for it, forward and backward: in the compiled walks (where numba is), and in
    the Python walk on the compiled and on NumPy's softmax step."""
    from mha._kernel import compiled, contract

    if path == "walk" and not compiled.walk_available():
        pytest.skip("the compiled walks need numba (test_walk.py fails without it in CI)")
    if path != "walk":  # the Python walk, which asks rows_seeing
        monkeypatch.setattr(compiled, "walk_available", lambda: False)
    if path == "numpy":
        monkeypatch.setattr(compiled, "available", lambda: False)
    narrowed = []
    seeing = contract.ItemVisibility.rows_seeing

    def counting(item, r0, r1, c0, c1):
        rows = seeing(item, r0, r1, c0, c1)
        narrowed.append(rows != (r0, r1))
        return rows

    monkeypatch.setattr(contract.ItemVisibility, "rows_seeing", counting)
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 2, n, 16)) for n in (L, S, S))
    grad = rng.standard_normal((2, 2, L, 16))
    out, lse, backward = mha.scaled_dot_product_attention(
        q, k, v, max_memory=max_memory, return_lse=True, return_backward=True, **call
    )
    grads = backward(grad)
    assert any(narrowed) or path == "walk"

    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    offset = 0 if call.get("causal_alignment") == "top_left" else S - L
    visible = np.ones((2, 1, L, S), dtype=bool)
    if call.get("causal"):
        visible &= j <= i + offset
    if "window" in call:
        visible &= (i + offset) - j < call["window"]
    if "key_lengths" in call:
        visible &= j < np.array(call["key_lengths"])[:, None, None, None]
    tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
    scores = tq @ tk.transpose(-1, -2) / 4.0
    scores = scores.masked_fill(~torch.from_numpy(visible), -torch.inf)
    expected_lse = torch.logsumexp(scores, -1)
    weights = torch.nan_to_num(torch.exp(scores - expected_lse[..., None]))  # empty rows: 0
    expected = weights @ tv
    expected.backward(torch.from_numpy(grad))
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    seen = np.isfinite(expected_lse.detach().numpy())
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert relative_error(lse[seen], expected_lse.detach().numpy()[seen]) <= 1e-12
    for name, tensor in (("q", tq), ("k", tk), ("v", tv)):
        assert relative_error(grads[name], tensor.grad.numpy()) <= 1e-12, name
