"""A plain layer call over many sequences computed a block of sequences at a time
(:mod:`mha.api.sequence_blocks`): taken where it should be, the bits of the layer computed
whole for every ``workers``, torch's ``nn.MultiheadAttention`` and a float64 loop's values,
and the layer computed whole where a block's walk leaves work undone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.configs import relative_error
from support.extras import needs_numba
from support.kept import taken

import mha
from mha._kernel import compiled, runtime
from mha.api import module, projection, sequence_blocks


@pytest.fixture(autouse=True)
def walked():
    """Blocks run the compiled walk: without numba no call is computed by blocks (the
    last test here says so)."""
    runtime.DEFAULT.forget()
    yield
    runtime.DEFAULT.forget()


def _whole(monkeypatch):
    """Every call computed whole, as before blocks (and no layer's plan kept)."""
    monkeypatch.setattr(projection, "blocks_for", lambda call, workers: None)
    monkeypatch.setattr(module, "kept_plan", lambda layer: None)


def _weights(rng, E, H, H_kv, d_v, bias, dtype):
    d = E // H
    W = [rng.standard_normal((E, w)) / np.sqrt(E) for w in (H * d, H_kv * d, H_kv * d_v)]
    W.append(rng.standard_normal((H * d_v, E)) / np.sqrt(H * d_v))
    b = [rng.uniform(-0.5, 0.5, x.shape[1]) if bias else None for x in W]
    return [x.astype(dtype) for x in W], [None if x is None else x.astype(dtype) for x in b]


def _loop(X, W, b, H, H_kv, causal, window, scale=None):
    """The layer by loops over sequences and heads in float64: projections, scaled scores,
    the mask (causal: ``j <= i``; a window: ``i - j < window``), a softmax, the output."""
    X = np.asarray(X, np.float64).reshape(-1, *X.shape[-2:])
    W = [np.asarray(x, np.float64) for x in W]
    b = [0.0 if x is None else np.asarray(x, np.float64) for x in b]
    L, d_k, d_v = X.shape[1], W[0].shape[1] // H, W[2].shape[1] // H_kv
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    seen = np.ones((L, L), bool)
    if causal:
        seen &= j <= i
    if window is not None:
        seen &= i - j < window
    out = np.zeros((len(X), L, H * d_v))
    for s, x in enumerate(X):
        q, k, v = (x @ W[n] + b[n] for n in range(3))
        for h in range(H):
            g = h // (H // H_kv)
            scores = q[:, h * d_k : (h + 1) * d_k] @ k[:, g * d_k : (g + 1) * d_k].T
            scores = np.where(seen, scores * (scale or d_k**-0.5), -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[s, :, h * d_v : (h + 1) * d_v] = p @ v[:, g * d_v : (g + 1) * d_v]
    return out @ W[3] + b[3]


CASES = {
    # name: (batch, L, d_model, H, H_kv, d_v, options): each taken by blocks on 1, 2 and 3
    # workers (6 or 9 blocks), each product of more than 100^3 multiply-adds
    "S3-like, 2 sequences a block": ((12,), 128, 64, 4, 4, 16, {}),
    "causal, biases, GQA": ((24,), 64, 96, 4, 2, 24, {"causal": True, "bias": True}),
    "one key head, a window": ((24,), 64, 64, 2, 1, 32, {"causal": True, "window": 5}),
    "value heads wider": ((12,), 96, 64, 4, 4, 24, {"bias": True}),
    "long sequences, one a block": ((6,), 300, 64, 4, 2, 16, {"causal": True}),
    "keys in tiles, tiles in a budget": ((6,), 600, 64, 2, 2, 32, {"max_memory": 2**17}),
    "a last block of fewer": ((70,), 32, 128, 4, 4, 32, {}),
    "float16 input": ((24,), 64, 64, 4, 4, 16, {"input": np.float16}),
    "an input of strided rows": ((12,), 128, 64, 4, 4, 16, {"strided": True}),
    "a scale given": ((24,), 64, 64, 4, 4, 16, {"scale": 0.3, "causal": True}),
    "weights side by side: the scale late": ((12,), 96, 96, 4, 2, 24, {"joined": True}),
}


def _call(case, dtype, workers, seed=0):
    batch, L, E, H, H_kv, d_v, options = CASES[case]
    rng = np.random.default_rng(seed)
    W, b = _weights(rng, E, H, H_kv, d_v, options.get("bias", False), dtype)
    if options.get("joined"):  # views of one array: one product, the queries scaled after
        joined = np.concatenate(W[:3], axis=1)
        cuts = np.cumsum([x.shape[1] for x in W[:3]])
        W[:3] = joined[:, : cuts[0]], joined[:, cuts[0] : cuts[1]], joined[:, cuts[1] :]
    X = rng.standard_normal((*batch, L, 2 * E if options.get("strided") else E))
    X = X[..., ::2] if options.get("strided") else X
    X = X.astype(options.get("input", dtype), copy=False)
    keywords = {"causal": options.get("causal", False), "workers": workers}
    if "window" in options:
        keywords["window"] = options["window"]
    for name in ("scale", "max_memory"):
        if name in options:
            keywords[name] = options[name]
    if H_kv != H:
        keywords["num_kv_heads"] = H_kv
    for name, x in zip(("b_q", "b_k", "b_v", "b_o"), b, strict=True):
        if x is not None:
            keywords[name] = x
    return (X, W, b, H, H_kv, options), keywords


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_blocks_give_the_whole_layers_bits_and_its_values(case, dtype, workers, monkeypatch):
    needs_numba(compiled.walk_available(), "every call is computed whole")
    (X, W, b, H, H_kv, options), keywords = _call(case, dtype, workers)
    given = X.copy()
    by_blocks = taken(monkeypatch, sequence_blocks.SequenceBlocks)
    out = mha.multi_head_attention(X, X, X, *W[:3], W[3], H, **keywords)
    assert len(by_blocks) == 1
    np.testing.assert_array_equal(X, given)  # (the input is not written)
    with monkeypatch.context() as m:
        _whole(m)
        whole = mha.multi_head_attention(X, X, X, *W[:3], W[3], H, **keywords)
    assert out.dtype == whole.dtype == dtype
    np.testing.assert_array_equal(out, whole)
    expected = _loop(X, W, b, H, H_kv, keywords["causal"], options.get("window"),
                     options.get("scale")).reshape(out.shape)  # fmt: skip
    tolerance = 2e-5 if dtype == np.float32 else 1e-12
    assert relative_error(out, expected) <= tolerance


def test_the_blocks_are_shared_evenly_or_not_taken():
    """Blocks go to every worker alike (as many each, or four each at least); a call of
    one sequence, or of too few rows to share, is computed whole."""
    needs_numba(compiled.walk_available(), "every call is computed whole")

    def taken_for(batch, L, workers):
        (X, W, *_), _ = _call("S3-like, 2 sequences a block", np.float64, workers)
        X = np.random.default_rng(1).standard_normal((*batch, L, X.shape[-1]))
        seen = []
        real = sequence_blocks.blocks_for

        def spy(call, n):
            seen.append(real(call, n))
            return seen[-1]

        with pytest.MonkeyPatch.context() as m:
            m.setattr(projection, "blocks_for", spy)
            mha.multi_head_attention(X, X, X, *W, 4, workers=workers)
        return seen[0]

    shared = taken_for((8,), 128, 2)
    assert shared is not None and shared.together == 2  # 4 blocks, 2 each
    assert taken_for((1,), 2048, 2) is None  # one sequence
    assert taken_for((5,), 128, 2) is None  # 3 blocks of 2 sequences for 2 workers
    assert taken_for((18,), 128, 2) is not None  # 9 blocks: 4 or 5 each
    assert taken_for((17,), 128, 2) is None  # the last block's output: 128 x 64 x 64
    assert taken_for((2,), 64, 2) is None  # 128 rows: too few to share
    assert taken_for((2,), 128, 1) is None  # one block
    assert taken_for((513,), 1, 1) is None  # blocks of 256 rows and a last of one (gemv)
    assert taken_for((16,), 16, 1) is None  # a last product of 16 rows: small-matrix kernels'
    assert taken_for((16,), 32, 1) is not None  # 512 rows: 256 x 192 x 64 multiply-adds


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_match_torch_multihead_attention(torch, record_error, causal, dtype):
    """torch's ``nn.MultiheadAttention`` (its weights mha's, transposed) on 24 sequences of
    64 tokens: in float64 within 1e-12, in float32 within 1e-5."""
    needs_numba(compiled.walk_available(), "every call is computed whole")
    rng = np.random.default_rng(5)
    E, H, L = 64, 4, 64
    W, b = _weights(rng, E, H, H, E // H, True, dtype)
    X = rng.standard_normal((24, L, E)).astype(dtype)
    layer = torch.nn.MultiheadAttention(
        E, H, batch_first=True, dtype=getattr(torch, np.dtype(dtype).name)
    )
    with torch.no_grad():
        layer.in_proj_weight.copy_(torch.from_numpy(np.concatenate(W[:3], 1).T.copy()))
        layer.in_proj_bias.copy_(torch.from_numpy(np.concatenate(b[:3])))
        layer.out_proj.weight.copy_(torch.from_numpy(W[3].T.copy()))
        layer.out_proj.bias.copy_(torch.from_numpy(b[3]))
        t = torch.from_numpy(X)
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1) if causal else None
        expected = layer(t, t, t, attn_mask=mask, need_weights=False)[0].numpy()
    with pytest.MonkeyPatch.context() as m:
        by_blocks = taken(m, sequence_blocks.SequenceBlocks)
        out = mha.multi_head_attention(
            X, X, X, *W, H, causal=causal, b_q=b[0], b_k=b[1], b_v=b[2], b_o=b[3], workers=2
        )
    assert by_blocks == [1]
    name = np.dtype(dtype).name
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    assert record_error(f"torch nn.MultiheadAttention, by blocks, {name}",
                        relative_error(out, expected)) <= tolerance  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2])
def test_a_non_finite_value_at_a_hidden_key_is_computed_whole(workers, monkeypatch):
    """A sequence whose last token is infinite: hidden from every other row by the causal
    mask, which the compiled walk leaves to the whole computation, which gives its rows
    their values (and the last row its NaN) as it does without blocks."""
    needs_numba(compiled.walk_available(), "every call is computed whole")
    (X, W, _, H, *_), keywords = _call("causal, biases, GQA", np.float64, workers)
    X[3, -1, :] = np.inf
    by_blocks = taken(monkeypatch, sequence_blocks.SequenceBlocks)  # (those that computed)
    tried = []
    real = sequence_blocks.blocks_for
    monkeypatch.setattr(projection, "blocks_for", lambda *a: tried.append(real(*a)) or tried[-1])
    out = mha.multi_head_attention(X, X, X, *W[:3], W[3], H, **keywords)
    assert len(tried) == 1 and tried[0] is not None  # tried by blocks,
    assert by_blocks == []  # which left it
    with monkeypatch.context() as m:
        _whole(m)
        whole = mha.multi_head_attention(X, X, X, *W[:3], W[3], H, **keywords)
    np.testing.assert_array_equal(out, whole)
    assert np.isfinite(out[3, :-1]).all() and np.isfinite(out[:3]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_layers_kept_plan_computes_by_blocks_with_the_same_bits(dtype, monkeypatch):
    """:class:`mha.MultiHeadAttention` called again on 16 sequences of 64 tokens (heads 24
    wide: the scale is no power of two, and late, the weights being one array): its kept
    plan computes by blocks, and every call has the bits of the layer computed whole."""
    needs_numba(compiled.walk_available(), "every call is computed whole")
    rng = np.random.default_rng(9)
    layer = mha.MultiHeadAttention(96, 4, num_kv_heads=2, bias=True, seed=4, dtype=dtype)
    xs = [rng.standard_normal((16, 64, 96)).astype(dtype) for _ in range(3)]
    by_blocks = taken(monkeypatch, sequence_blocks.SequenceBlocks)
    own = [layer(x, True, workers=2) for x in xs]
    assert len(by_blocks) == 3  # the general path's first call, the kept plan's two
    assert runtime.DEFAULT.layer_plans[layer].blocks is not None
    with monkeypatch.context() as m:
        _whole(m)
        whole = [layer(x, True, workers=2) for x in xs]
    for a, b in zip(own, whole, strict=True):
        np.testing.assert_array_equal(a, b)


def test_without_the_compiled_walk_no_call_is_computed_by_blocks(monkeypatch):
    monkeypatch.setattr(compiled, "walk_available", lambda: False)
    (X, W, b, H, H_kv, _), keywords = _call("S3-like, 2 sequences a block", np.float64, 2)
    by_blocks = taken(monkeypatch, sequence_blocks.SequenceBlocks)
    out = mha.multi_head_attention(X, X, X, *W[:3], W[3], H, **keywords)
    assert by_blocks == []
    expected = _loop(X, W, b, H, H_kv, False, None).reshape(out.shape)
    assert relative_error(out, expected) <= 1e-12


def test_a_kept_plan_of_separate_weights_and_few_rows_projects_as_before(monkeypatch):
    """Fewer rows than features and ``W_q``, ``W_k``, ``W_v`` not one array: q, k and v are
    each their own product, which blocks do not compute; the layer's kept plan computes the
    call whole, call after call (the general path's bits)."""
    needs_numba(compiled.walk_available(), "no plan is kept")
    rng = np.random.default_rng(11)
    layer = mha.MultiHeadAttention(600, 4, seed=5)
    layer.W_q = layer.W_q.copy()  # (no longer a view of one array with W_k and W_v)
    xs = [rng.standard_normal((8, 64, 600)) for _ in range(3)]
    kept = taken(monkeypatch, mha.api.layer_plan.LayerPlan)
    own = [layer(x, workers=2) for x in xs]
    assert len(kept) == 2 and runtime.DEFAULT.layer_plans[layer].blocks is None
    with monkeypatch.context() as m:
        _whole(m)
        whole = [layer(x, workers=2) for x in xs]
    for a, b in zip(own, whole, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shape", [(24, 64, 40), (48, 32, 40), (24, 64, 56), (513, 1, 64)])
def test_products_a_row_would_round_differently_in_are_computed_whole(shape, monkeypatch):
    """Blocks whose products OpenBLAS may give to its small-matrix kernels (100^3
    multiply-adds or fewer; d_model 40 or 56 here), or a block of one row (``gemv``): by
    blocks, these calls measured other bits than whole in float32 (the rule lifted), so
    :func:`blocks_for` refuses them and they are computed whole."""
    needs_numba(compiled.walk_available(), "every call is computed whole")
    E = shape[-1]
    rng = np.random.default_rng(12)
    X = rng.standard_normal(shape).astype(np.float32)
    W = [(rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32) for _ in range(4)]
    tried = []
    real = sequence_blocks.blocks_for
    monkeypatch.setattr(projection, "blocks_for", lambda *a: tried.append(real(*a)) or tried[-1])
    out = mha.multi_head_attention(X, X, X, *W, 4, workers=1)
    assert tried == [None]
    with monkeypatch.context() as m:
        _whole(m)
        np.testing.assert_array_equal(out, mha.multi_head_attention(X, X, X, *W, 4, workers=1))


def test_threads_share_the_blocks_plans():
    """Two threads calling one layer at once (each call by blocks on two workers, the
    blocks' walks' plans shared): every output the bits of the same call made alone."""
    needs_numba(compiled.walk_available(), "every call is computed whole")
    rng = np.random.default_rng(13)
    layer = mha.MultiHeadAttention(64, 4, bias=True, seed=6)
    xs = [rng.standard_normal((12, 128, 64)) for _ in range(6)]
    alone = [layer(x, True, workers=2) for x in xs]
    assert runtime.DEFAULT.layer_plans[layer].blocks is not None
    outs: dict[int, np.ndarray] = {}

    def call(indices):
        for i in indices:
            outs[i] = layer(xs[i], True, workers=2)

    threads = [threading.Thread(target=call, args=(range(j, 6, 2),)) for j in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outs) == list(range(6))
    for i, a in enumerate(alone):
        np.testing.assert_array_equal(outs[i], a)
