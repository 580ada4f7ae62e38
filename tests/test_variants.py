"""Attention variants (issue 18): sinks, sink tokens, soft-capping, ALiBi, chunked attention,
mask_mod and score_mod. Checked against a dense float64 reference written here from the
formula, central differences, torch's FlexAttention machinery (create_mask, create_block_mask,
flex_attention) and autograd, the gpt-oss and BLOOM code in transformers, and mha itself run
with other tilings, other workers and a cache."""

from __future__ import annotations

import math
import types
import warnings

import numpy as np
import pytest
from support.configs import relative_error
from support.reference import paper_slopes

import mha

sdpa = mha.scaled_dot_product_attention
TINY, ONE_TILE = 4096, 2**30  # max_memory: many small tiles, or one tile


# ---------------------------------------------------------------- the dense NumPy reference


def indices(B, H, L, S):
    """FlexAttention's b, h, q_idx, kv_idx as broadcastable int64 arrays."""
    return tuple(
        np.arange(n).reshape([n if a == i else 1 for i in range(4)])
        for a, n in enumerate((B, H, L, S))
    )


def offset(kw, L, S):
    return 0 if kw.get("causal_alignment") == "top_left" else S - L


def alibi_term(kw, H, L, S):
    """The additive ALiBi term -slope_h * (position of query - position of key), or 0."""
    alibi = kw.get("alibi")
    if alibi is None or alibi is False:
        return 0.0
    slopes = paper_slopes(H) if alibi is True else np.asarray(alibi, dtype=np.float64)
    _, _, i, j = indices(1, H, L, S)
    return -slopes.reshape(1, H, 1, 1) * (i + offset(kw, L, S) - j)


def visibility(kw, B, H, L, S, *, with_mask_mod=True):
    """(B, H, L, S): True where query i may attend to key j, every keyword ANDed."""
    b, h, i, j = indices(B, H, L, S)
    pos = i + offset(kw, L, S)
    seen = np.ones((B, H, L, S), dtype=bool)
    if kw.get("causal"):
        seen &= j <= pos
    if kw.get("window") is not None:
        near = pos - j < kw["window"]
        if kw.get("sink_tokens"):
            near |= j < kw["sink_tokens"]
        seen &= near
    if kw.get("chunk") is not None:
        seen &= pos // kw["chunk"] == j // kw["chunk"]
    if kw.get("key_lengths") is not None:
        seen &= j < np.asarray(kw["key_lengths"]).reshape(B, 1, 1, 1)
    if kw.get("mask") is not None:
        seen &= kw["mask"]
    if kw.get("bias") is not None:
        seen &= np.asarray(kw["bias"]) != -np.inf
    if with_mask_mod and kw.get("mask_mod") is not None:
        seen &= kw["mask_mod"](b, h, i, j)
    return seen


def reference(q, k, v, **kw):
    """``(out, lse)`` straight from the formula, in float64, for q (B, H, L, d)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, L, d = q.shape
    S, group = k.shape[-2], H // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) * kw.get("scale", 1 / math.sqrt(d))
    if kw.get("softcap") is not None:
        s = kw["softcap"] * np.tanh(s / kw["softcap"])
    b, h, i, j = indices(B, H, L, S)
    if kw.get("score_mod") is not None:
        s = np.concatenate([kw["score_mod"](s[n : n + 1], b[n : n + 1], h, i, j) for n in range(B)])
    s = s + alibi_term(kw, H, L, S)
    if kw.get("bias") is not None:
        s = s + kw["bias"]
    allowed = visibility(kw, B, H, L, S)
    s = np.where(allowed, s, -np.inf)
    sinks = kw.get("sinks")
    sink = np.full((B, H, L, 1), -np.inf)
    if sinks is not None:
        sink[...] = np.asarray(sinks, dtype=np.float64).reshape(1, H, 1, 1)
    full = np.concatenate([s, sink], axis=-1)
    top = full.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(full - top).sum(axis=-1, keepdims=True)) + top
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    return p @ v, lse[..., 0]


def lse_error(ours, expected):
    """Relative error of log-sum-exps; rows without keys and sinks must be -inf on both sides."""
    ours, expected = np.asarray(ours, dtype=np.float64), np.asarray(expected)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(expected))
    finite = np.isfinite(expected)
    return relative_error(ours[finite], expected[finite]) if finite.any() else 0.0


# Masks and score modifications, written once over a table that is a NumPy array for mha
# (called with broadcastable int64 arrays) or a torch tensor for FlexAttention (called with
# scalars under vmap) and the dense torch reference (broadcastable tensors).


def document_mod(doc, off):
    """Packed sequences: a query sees the earlier keys of its own document (doc (B, S) ids)."""
    S = doc.shape[-1]  # % S: rows before the first key (L > S) see nothing anyway
    return lambda b, h, q, kv: (doc[b, (q + off) % S] == doc[b, kv]) & (q + off >= kv)


def prefix_lm_mod(prefix, off):
    """Prefix LM: the first prefix[b] keys of sequence b are seen by all, the rest causally."""
    return lambda b, h, q, kv: (kv < prefix[b]) | (q + off >= kv)


def window_mod(w, off):
    return lambda b, h, q, kv: (q + off >= kv) & (q + off - kv < w)


def causal_mod(off):
    return lambda b, h, q, kv: q + off >= kv


def tanh_mod(c, tanh):
    return lambda s, b, h, q, kv: c * tanh(s / c)


def tanh_grad(c):
    return lambda s, b, h, q, kv: 1 - np.tanh(s / c) ** 2


def alibi_mod(slopes, off):
    return lambda s, b, h, q, kv: s - slopes[h] * (q + off - kv)


def relative_mod(table, shift, S):
    """A learned relative-position bias table[h, q - kv + S - 1], plus a per-sequence shift."""
    return lambda s, b, h, q, kv: s + table[h, q - kv + S - 1] + shift[b]


def unit_grad(s, b, h, q, kv):
    return np.ones_like(s)


def heads(seed, B=2, H=4, H_kv=2, L=37, S=53, d=8, dtype=np.float64):
    g = np.random.default_rng(seed)
    q = g.standard_normal((B, H, L, d))
    k, v = g.standard_normal((2, B, H_kv, S, d))
    return g, q.astype(dtype), k.astype(dtype), v.astype(dtype)


def random_shape(g):
    """(B, H, H_kv, L, S, d): grouped heads, lengths that do not divide anything."""
    H_kv, group = int(g.integers(1, 3)), int(g.integers(1, 4))
    B, L, S, d = (int(g.integers(1, top)) for top in (3, 24, 30, 9))
    return B, H_kv * group, H_kv, L, S, d


VARIANTS = {  # name: mha's keywords, from a draw n (g, B, H, L, S, off, sinks, doc; xp tables)
    "sinks": lambda n: dict(sinks=n.sinks),
    "sinks+causal+key_lengths": lambda n: dict(
        sinks=n.sinks, causal=True, key_lengths=n.g.integers(0, n.S + 1, n.B)
    ),
    "softcap": lambda n: dict(softcap=n.g.uniform(0.3, 2.0), scale=2.0),
    "alibi": lambda n: dict(alibi=True, causal=True),
    "alibi slopes": lambda n: dict(alibi=n.g.uniform(0.01, 1.0, n.H)),
    "alibi top_left": lambda n: dict(
        alibi=n.g.uniform(0.01, 1.0, n.H), causal=True, causal_alignment="top_left"
    ),
    "chunk": lambda n: dict(chunk=int(n.g.integers(1, n.S + 2))),
    "chunk+causal": lambda n: dict(chunk=int(n.g.integers(1, 6)), causal=True),
    "window+sink_tokens": lambda n: dict(
        window=int(n.g.integers(1, 6)), sink_tokens=int(n.g.integers(0, 4)), causal=True
    ),
    "window+sink_tokens, not causal": lambda n: dict(window=3, sink_tokens=2),
    "score_mod": lambda n: dict(
        score_mod=relative_mod(n.table(n.H, n.L + n.S), n.xp.asarray(n.g.normal(0, 3, n.B)), n.S),
        score_mod_grad=unit_grad,
    ),
    "mask_mod document": lambda n: dict(mask_mod=document_mod(n.doc, n.off)),
    "mask_mod prefix_lm": lambda n: dict(
        mask_mod=prefix_lm_mod(n.xp.asarray(n.g.integers(0, n.S + 1, n.B)), n.off)
    ),
    "everything": lambda n: everything(n),
}
CASES = tuple(VARIANTS)


def everything(n):
    return dict(
        sinks=n.sinks, softcap=1.5, alibi=True, chunk=7, window=5, sink_tokens=2, causal=True,
        score_mod=tanh_mod(1.2, n.xp.tanh), score_mod_grad=tanh_grad(1.2),
        bias=n.g.standard_normal((n.B, 1, n.L, n.S)), mask=n.g.random((n.L, n.S)) < 0.9,
        key_lengths=n.g.integers(1, n.S + 1, n.B), mask_mod=document_mod(n.doc, n.off),
    )  # fmt: skip


def variant(name, g, B, H, L, S, xp=np):
    """mha's keywords for one named case; the mods' tables are xp arrays (NumPy or torch)."""
    doc = xp.asarray(np.sort(g.integers(0, 3, (B, S)), axis=-1))
    n = types.SimpleNamespace(
        g=g, B=B, H=H, L=L, S=S, off=S - L, sinks=g.normal(0.0, 2.0, H), doc=doc, xp=xp,
        table=lambda *shape: xp.asarray(g.standard_normal(shape)),
    )  # fmt: skip
    return VARIANTS[name](n)


def mha_keywords(kw, dtype=np.float64):
    """The keywords mha is given: sinks in the inputs' dtype, the rest as they are."""
    return {n: (x.astype(dtype) if n == "sinks" else x) for n, x in kw.items()}


# ---------------------------------------------------------------- against the NumPy reference


def draw(case, seed, xp=np):
    """Random non-degenerate q (B, H, L, d), k, v and the case's keywords (xp: the mods' tables)."""
    g = np.random.default_rng([18, seed, CASES.index(case)])
    B, H, H_kv, L, S, d = random_shape(g)
    q = g.standard_normal((B, H, L, d))
    k, v = g.standard_normal((2, B, H_kv, S, d))
    return q, k, v, variant(case, g, B, H, L, S, xp)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", CASES)
def test_variants_match_the_dense_reference(case, seed, record_error):
    q, k, v, kw = draw(case, seed)
    expected, expected_lse = reference(q, k, v, **kw)
    kw.pop("score_mod_grad", None)
    for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 2e-5)):
        args = [x.astype(dtype) for x in (q, k, v)]
        out, lse = sdpa(*args, **mha_keywords(kw, dtype), return_lse=True)
        assert out.dtype == dtype
        family = f"variants vs dense reference, {np.dtype(dtype).name}"
        assert record_error(family, relative_error(out, expected)) <= tolerance
        assert record_error(family + ", lse", lse_error(lse, expected_lse)) <= tolerance


def test_a_row_that_sees_no_key_has_zero_output_and_the_sink_as_lse():
    _, q, k, v = heads(0, L=3, S=4)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    out, lse = sdpa(q, k, v, sinks=sinks, key_lengths=np.array([0, 4]), return_lse=True)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(lse[0], np.broadcast_to(sinks[:, None], (4, 3)))
    assert np.all(lse[1] > sinks[:, None])


def test_mask_mod_gets_the_flat_batch_index_and_unbatched_calls_get_zero():
    g = np.random.default_rng(3)
    q = g.standard_normal((2, 3, 4, 5, 8))  # batch axes (2, 3)
    k, v = g.standard_normal((2, 2, 3, 4, 9, 8))
    lengths = g.integers(1, 10, 6)
    out = sdpa(q, k, v, mask_mod=lambda b, h, i, j: j < lengths[b])
    assert relative_error(out, sdpa(q, k, v, key_lengths=lengths.reshape(2, 3))) <= 1e-13
    seen = []
    sdpa(q[0, 0], k[0, 0], v[0, 0], mask_mod=lambda b, h, i, j: seen.append(b) or j >= 0 * b)
    assert seen and all(np.all(np.asarray(b) == 0) for b in seen)


def test_alibi_slopes_are_the_papers():
    for n in range(1, 33):
        np.testing.assert_allclose(mha.alibi_slopes(n), paper_slopes(n), rtol=4e-15, atol=0)


def finite_difference(loss, arrays, step=1e-3):
    """Fourth-order central differences of loss() by every entry of every array."""
    grads = {}
    for name, x in arrays.items():
        grad = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            value, at = x[index], []
            for h in (2 * step, step, -step, -2 * step):
                x[index] = value + h
                at.append(loss())
            x[index] = value
            grad[index] = (-at[0] + 8 * at[1] - 8 * at[2] + at[3]) / (12 * step)
        grads[name] = grad
    return grads


FD_CASES = ("sinks", "softcap", "alibi slopes", "score_mod", "chunk+causal", "everything")


@pytest.mark.parametrize("case", FD_CASES)
def test_gradients_match_finite_differences_of_the_reference(case, record_error):
    g = np.random.default_rng([18, 7, FD_CASES.index(case)])
    B, H, L, S, d = 1, 2, 3, 5, 2
    arrays = {"q": g.standard_normal((B, H, L, d))}
    arrays["k"], arrays["v"] = g.standard_normal((2, B, 1, S, d))
    kw = variant(case, g, B, H, L, S)
    if case == "score_mod":
        kw |= {"score_mod": tanh_mod(0.7, np.tanh), "score_mod_grad": tanh_grad(0.7)}
    if "sinks" in kw:
        arrays["sinks"] = kw.pop("sinks")
    arrays["bias"] = kw.pop("bias") if "bias" in kw else g.standard_normal((B, 1, L, S))
    grad_out = g.standard_normal((B, H, L, d))

    def loss():
        return float(np.sum(reference(**arrays, **kw)[0] * grad_out))

    expected = finite_difference(loss, arrays)
    q, k, v = (arrays[n] for n in "qkv")
    extra = {n: x for n, x in arrays.items() if n not in "qkv"}
    _, backward = sdpa(q, k, v, **extra, **kw, return_backward=True)
    ours = backward(grad_out)
    assert set(ours) == set(arrays)
    for name in arrays:
        error = relative_error(ours[name], expected[name])
        # fourth-order differences with step 1e-3: truncation about 1e-12, rounding 1e-13
        assert record_error("gradients vs finite differences", error) <= 1e-8, name


# ---------------------------------------------------------------- torch: FlexAttention, autograd


def torch_reference(torch, q, k, v, allowed, kw, score_mod=None):
    """The same formula in torch, for autograd: q, k, v (and kw's sinks, bias) are tensors;
    ``allowed`` is the boolean (B, H, L, S) visibility, ``score_mod`` a torch function."""
    B, H, L, d = q.shape
    S, group = k.shape[-2], H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * kw.get("scale", 1 / math.sqrt(d))
    if kw.get("softcap") is not None:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    if score_mod is not None:
        s = score_mod(s, *(torch.from_numpy(x) for x in indices(B, H, L, S)))
    s = s + torch.as_tensor(alibi_term(kw, H, L, S), dtype=s.dtype)
    if kw.get("bias") is not None:
        s = s + kw["bias"]
    allowed = torch.from_numpy(np.array(allowed, dtype=bool))
    some = allowed.any(-1, keepdim=True)
    s = torch.where(allowed, s, -math.inf)
    if kw.get("sinks") is None:  # rows without keys: finite logits, weights zeroed below
        lse = torch.logsumexp(torch.where(some, s, 0.0), -1)
    else:
        sink = kw["sinks"].reshape(1, H, 1, 1).expand(B, H, L, 1)
        lse = torch.logsumexp(torch.cat([s, sink], -1), -1)
    out = (torch.exp(s - lse[..., None]) * allowed) @ v
    return out, (lse if kw.get("sinks") is not None else torch.where(some[..., 0], lse, -math.inf))


def flex(torch, q, k, v, *, score_mod=None, mask_mod=None):
    """torch's flex_attention (eager: on CPU torch.compile takes ~30 s and refuses float64):
    ``(out, lse)`` as NumPy arrays. torch 2.13's eager CPU path runs both dtypes; a torch
    where it does not fails here, as a missing oracle does."""
    from torch.nn.attention import flex_attention as fa

    B, H, L, _ = q.shape
    S = k.shape[-2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": unfused, exact
        block = None if mask_mod is None else fa.create_block_mask(mask_mod, B, H, L, S, "cpu")
        out, aux = fa.flex_attention(
            *(torch.from_numpy(x) for x in (q, k, v)),
            score_mod=score_mod,
            block_mask=block,
            enable_gqa=k.shape[1] != H,
            return_aux=fa.AuxRequest(lse=True),
        )
    return out.numpy(), aux.lse.numpy()


def with_sinks(out, lse, sinks):
    """FlexAttention has no sinks: add one to the denominator through the log-sum-exp."""
    sink = np.asarray(sinks, dtype=np.float64).reshape(-1, 1)
    total = np.logaddexp(lse.astype(np.float64), sink)
    return out * np.exp(lse - total)[..., None], total


MASK_MODS = {
    "document": lambda xp, g, B, L, S: document_mod(
        xp.asarray(np.sort(g.integers(0, 4, (B, S)), -1)), S - L
    ),
    "prefix_lm": lambda xp, g, B, L, S: prefix_lm_mod(xp.asarray(g.integers(0, S + 1, B)), S - L),
    "sliding_window": lambda xp, g, B, L, S: window_mod(7, S - L),
    "causal": lambda xp, g, B, L, S: causal_mod(S - L),
}


def mask_mods(torch, name, seed, B, L, S):
    """The named mask_mod for mha (NumPy tables) and for torch (tensor tables)."""
    return tuple(MASK_MODS[name](xp, np.random.default_rng(seed), B, L, S) for xp in (np, torch))


@pytest.mark.parametrize(("L", "S"), [(37, 53), (53, 53)])
@pytest.mark.parametrize("name", MASK_MODS)
def test_mask_mods_match_create_mask_and_a_dense_torch_softmax(name, L, S, torch, record_error):
    from torch.nn.attention.flex_attention import create_mask

    g, q, k, v = heads(L + S, L=L, S=S)
    ours, theirs = mask_mods(torch, name, 7, 2, L, S)
    allowed = create_mask(theirs, 2, 4, L, S, device="cpu").numpy()
    np.testing.assert_array_equal(
        allowed, np.broadcast_to(ours(*indices(2, 4, L, S)), allowed.shape)
    )
    for sinks in (None, g.normal(0, 2, 4)):
        kw = {} if sinks is None else {"sinks": torch.from_numpy(sinks)}
        t = [torch.from_numpy(x) for x in (q, k, v)]
        expected, expected_lse = (x.numpy() for x in torch_reference(torch, *t, allowed, kw))
        for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 2e-5)):
            extra = {} if sinks is None else {"sinks": sinks.astype(dtype)}
            args = (x.astype(dtype) for x in (q, k, v))
            out, lse = sdpa(*args, mask_mod=ours, return_lse=True, **extra)
            family = f"mask_mod vs create_mask + torch softmax, {np.dtype(dtype).name}"
            assert record_error(family, relative_error(out, expected)) <= tolerance
            assert record_error(family, lse_error(lse, expected_lse)) <= tolerance


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", MASK_MODS)
def test_mask_mods_match_flex_attention(name, dtype, torch, record_error):
    g, q, k, v = heads(11, L=37, S=53, dtype=dtype)
    ours, theirs = mask_mods(torch, name, 8, 2, 37, 53)
    sinks = g.normal(0, 2, 4).astype(dtype)
    expected, expected_lse = with_sinks(*flex(torch, q, k, v, mask_mod=theirs), sinks)
    out, lse = sdpa(q, k, v, mask_mod=ours, sinks=sinks, return_lse=True)
    tolerance = 1e-12 if dtype == np.float64 else 2e-5
    family = f"mask_mod + sinks vs flex_attention, {np.dtype(dtype).name}"
    assert record_error(family, relative_error(out, expected)) <= tolerance
    assert record_error(family, lse_error(lse, expected_lse)) <= tolerance


def score_mods(torch, name, S, off):
    """(mha keyword forms, torch score_mod) for a named score modification."""
    g = np.random.default_rng(S)
    slopes, table, shift = g.uniform(0.05, 1.0, 4), g.standard_normal((4, 2 * S)), g.normal(0, 1, 2)
    forms = {
        "softcap": [{"softcap": 0.7}, {"score_mod": tanh_mod(0.7, np.tanh)}],
        "alibi": [{"alibi": slopes}, {"score_mod": alibi_mod(slopes, off)}],
        "relative table": [{"score_mod": relative_mod(table, shift, S)}],
    }[name]
    slopes, table, shift = (torch.from_numpy(x) for x in (slopes, table, shift))
    return forms, {
        "softcap": tanh_mod(0.7, torch.tanh),
        "alibi": alibi_mod(slopes, off),
        "relative table": relative_mod(table, shift, S),
    }[name]


SCORE_MODS = ("softcap", "alibi", "relative table")


@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mods_match_a_dense_torch_softmax(name, torch, record_error):
    _, q, k, v = heads(12, L=37, S=53)
    forms, theirs = score_mods(torch, name, 53, 16)
    allowed = np.broadcast_to(causal_mod(16)(*indices(2, 4, 37, 53)), (2, 4, 37, 53))
    t = [torch.from_numpy(x) for x in (q, k, v)]
    expected, expected_lse = (x.numpy() for x in torch_reference(torch, *t, allowed, {}, theirs))
    for kw in forms:
        out, lse = sdpa(q, k, v, causal=True, return_lse=True, **kw)
        assert record_error("score_mod vs torch", relative_error(out, expected)) <= 1e-12
        if "alibi" not in kw:  # ALiBi's lse is checked against the formula above
            assert record_error("score_mod vs torch", lse_error(lse, expected_lse)) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mods_match_flex_attention(name, dtype, torch, record_error):
    _, q, k, v = heads(13, L=37, S=53, dtype=dtype)
    forms, theirs = score_mods(torch, name, 53, 16)
    expected, expected_lse = flex(torch, q, k, v, score_mod=theirs, mask_mod=causal_mod(16))
    tolerance = 1e-12 if dtype == np.float64 else 2e-5
    family = f"score_mod vs flex_attention, {np.dtype(dtype).name}"
    for kw in forms:
        out, lse = sdpa(q, k, v, causal=True, return_lse=True, **kw)
        assert record_error(family, relative_error(out, expected)) <= tolerance
        if "alibi" not in kw:
            assert record_error(family, lse_error(lse, expected_lse)) <= tolerance


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("case", CASES)
def test_gradients_match_autograd(case, seed, torch, record_error):
    from torch.nn.attention.flex_attention import create_mask

    q, k, v, kw = draw(case, seed)
    *_, kw_torch = draw(case, seed, torch)
    (B, H, L, _), S = q.shape, k.shape[-2]
    kw.setdefault("bias", np.random.default_rng(seed).standard_normal((B, 1, L, S)))
    out, lse, backward = sdpa(q, k, v, **kw, return_lse=True, return_backward=True)
    leaves = {"q": q, "k": k, "v": v} | {n: kw[n] for n in ("sinks", "bias") if n in kw}
    leaves = {n: torch.tensor(x, requires_grad=True) for n, x in leaves.items()}
    allowed = visibility(kw, B, H, L, S, with_mask_mod=False)
    if "mask_mod" in kw:
        allowed = allowed & create_mask(kw_torch["mask_mod"], B, H, L, S, device="cpu").numpy()
    expected, expected_lse = torch_reference(
        torch, leaves["q"], leaves["k"], leaves["v"], allowed,
        kw | {n: leaves[n] for n in ("sinks", "bias") if n in leaves},
        kw_torch.get("score_mod"),
    )  # fmt: skip
    error = relative_error(out, expected.detach().numpy())
    assert record_error("variants vs torch", error) <= 1e-12
    assert lse_error(lse, expected_lse.detach().numpy()) <= 1e-12
    grad = np.random.default_rng(seed + 1).standard_normal(out.shape)
    (expected * torch.from_numpy(grad)).sum().backward()
    ours = backward(grad)
    assert set(ours) == set(leaves)
    for name, leaf in leaves.items():
        assert ours[name].shape == leaf.shape
        error = relative_error(ours[name], leaf.grad.numpy())
        assert record_error("variant gradients vs autograd", error) <= 1e-10, name


def test_sinks_match_gpt_oss_and_alibi_matches_bloom(torch, transformers, record_error):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g, q, k, v = heads(14, L=21, S=21)
    sinks = g.normal(0, 2, 4)
    module = types.SimpleNamespace(
        sinks=torch.from_numpy(sinks), num_key_value_groups=2, training=False
    )
    causal = torch.from_numpy(np.where(np.tril(np.ones((21, 21), bool)), 0.0, -np.inf))
    t = [torch.from_numpy(x) for x in (q, k, v)]
    expected, _ = eager_attention_forward(module, *t, causal, 1 / math.sqrt(8))
    out = sdpa(q, k, v, sinks=sinks, causal=True)
    error = relative_error(out.transpose(0, 2, 1, 3), expected.numpy())
    assert record_error("sinks vs transformers gpt-oss", error) <= 1e-12
    # BLOOM adds slope * j (j from 0): the same weights, lse larger by slope * i.
    bloom = build_alibi_tensor(torch.ones(2, 21), 4, torch.float64).numpy().reshape(2, 4, 1, 21)
    slopes = mha.alibi_slopes(4)
    exact = slopes[:, None, None] * np.arange(21)  # BLOOM's bias, in float64 (it has float32)
    np.testing.assert_allclose(bloom, np.broadcast_to(exact, bloom.shape), rtol=1e-7)
    bloom = np.broadcast_to(exact, bloom.shape)
    out, lse = sdpa(q, k, v, alibi=slopes, causal=True, return_lse=True)
    expected, expected_lse = sdpa(q, k, v, bias=bloom, causal=True, return_lse=True)
    assert record_error("alibi vs transformers bloom", relative_error(out, expected)) <= 1e-12
    shifted = expected_lse - slopes[:, None] * np.arange(21)
    assert record_error("alibi vs transformers bloom", relative_error(lse, shifted)) <= 1e-12


# ---------------------------------------------------------------- combinations, tiles, workers


def _doc(B, S, off):
    doc = np.sort(np.random.default_rng(S).integers(0, 5, (B, S)), -1)
    return lambda b, h, q, kv: doc[b, (q + off) % S] == doc[b, kv]  # not causal by itself


COMBOS = {
    "sinks+window+GQA": lambda g, B, L, S: dict(sinks=g.normal(0, 2, 4), window=9, causal=True),
    "softcap+window": lambda g, B, L, S: dict(softcap=0.9, window=11, scale=1.5),
    "alibi+key_lengths": lambda g, B, L, S: dict(alibi=True, key_lengths=g.integers(1, S + 1, B)),
    "chunk+causal+sinks": lambda g, B, L, S: dict(chunk=16, causal=True, sinks=g.normal(0, 2, 4)),
    "mask_mod+causal": lambda g, B, L, S: dict(mask_mod=_doc(B, S, S - L), causal=True),
    "sink_tokens+window": lambda g, B, L, S: dict(window=8, sink_tokens=3, causal=True),
}


@pytest.mark.parametrize(("L", "S"), [(37, 53), (130, 300), (53, 37)])
@pytest.mark.parametrize("combo", COMBOS)
def test_combinations_tiled_equal_one_tile_and_the_reference(combo, L, S, record_error):
    g, q, k, v = heads(L * S, L=L, S=S)
    kw = COMBOS[combo](g, 2, L, S)
    expected, expected_lse = reference(q, k, v, **kw)
    results = {}
    for budget in (TINY, ONE_TILE):
        out, lse, backward = sdpa(
            q, k, v, **kw, max_memory=budget, return_lse=True, return_backward=True
        )
        assert record_error("combinations vs reference", relative_error(out, expected)) <= 1e-12
        assert record_error("combinations vs reference", lse_error(lse, expected_lse)) <= 1e-12
        results[budget] = out, lse, backward(np.ones_like(out) + q[..., :1])
    (out, lse, grads), (out1, lse1, grads1) = results[TINY], results[ONE_TILE]
    assert record_error("tiled vs one tile", relative_error(out, out1)) <= 1e-13
    assert record_error("tiled vs one tile", lse_error(lse, lse1)) <= 1e-13
    for name in grads1:
        assert (
            record_error("tiled vs one tile, gradients", relative_error(grads[name], grads1[name]))
            <= 1e-12
        )


DECODING = {
    "chunk": {"chunk": 5},
    "chunk+sinks": {"chunk": 4, "sinks": np.array([1.0, -0.5, 2.0, 0.0])},
    "window+sink_tokens": {"window": 6, "sink_tokens": 3},
    "alibi+sinks": {"alibi": True, "sinks": np.array([0.5, 1.5, -1.0, 3.0])},
}


@pytest.mark.parametrize("case", DECODING)
def test_decoding_token_by_token_equals_the_full_call(case, record_error):
    kw = DECODING[case]
    _, q, k, v = heads(31, L=40, S=40)
    full = sdpa(q, k, v, causal=True, **kw)
    assert relative_error(full, reference(q, k, v, causal=True, **kw)[0]) <= 1e-12
    own = {n: kw[n] for n in ("window", "sink_tokens") if n in kw}
    cache = mha.KVCache(2, 2, 8, capacity=8, **own)
    steps = [sdpa(q[:, :, :6], k[:, :, :6], v[:, :, :6], cache=cache, **kw)]
    for t in range(6, 40):
        steps.append(sdpa(*(x[:, :, t : t + 1] for x in (q, k, v)), cache=cache, **kw))
    error = relative_error(np.concatenate(steps, axis=2), full)
    assert record_error("cached decoding vs full call", error) <= 1e-13
    if own:
        assert cache.capacity < 40  # it kept the sink tokens and the window, not everything


SPLIT = {
    "sinks": {},
    "sinks+alibi+softcap": {"alibi": True, "softcap": 2.0},
    "sinks+window+sink_tokens": {"window": 12000, "sink_tokens": 4, "causal": True},
}


@pytest.mark.parametrize("case", SPLIT)
def test_keys_split_over_two_workers_with_sinks(case, monkeypatch, record_error):
    from mha._kernel import tasks

    g = np.random.default_rng(41)
    q = g.standard_normal((1, 2, 1, 16))  # one decoding row, one key/value head: one work item
    k, v = g.standard_normal((2, 1, 1, 20000, 16))  # past one wide key tile (8192)
    kw = SPLIT[case] | {"sinks": g.normal(10, 1, 2)}  # about the log-sum-exp of the keys
    expected, expected_lse = reference(q, k, v, **kw)
    one = sdpa(q, k, v, **kw, workers=1, return_lse=True)
    splits = []  # the split-key path must really be taken
    split = tasks.split_keys
    monkeypatch.setattr(tasks, "split_keys", lambda *a: splits.append(split(*a)) or splits[-1])
    two = sdpa(q, k, v, **kw, workers=2, return_lse=True)
    assert splits and all(parts is not None for parts in splits)
    for out, lse in (one, two):
        assert record_error("split keys vs reference", relative_error(out, expected)) <= 1e-12
        assert record_error("split keys vs reference", lse_error(lse, expected_lse)) <= 1e-12
    assert record_error("split keys vs one worker", relative_error(two[0], one[0])) <= 1e-13
    assert record_error("split keys vs one worker", lse_error(two[1], one[1])) <= 1e-13


# ---------------------------------------------------------------- NaN where nothing looks


NAN = {  # keywords, and the keys every query of the call is hidden from (S = 40, L = 5)
    "key_lengths": ({"key_lengths": np.array([23, 40])}, lambda b, j: j >= (23, 40)[b]),
    "chunk": ({"chunk": 16, "causal": True}, lambda b, j: j < 32),
    "window outside sink tokens": (
        {"window": 6, "sink_tokens": 3, "causal": True},
        lambda b, j: (j >= 3) & (j < 30),
    ),
    "mask_mod": ({"mask_mod": lambda b, h, i, j: j % 3 != 1}, lambda b, j: j % 3 == 1),
}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", NAN)
def test_nan_in_hidden_keys_reaches_no_output_or_gradient(case, workers):
    kw, hidden = NAN[case]
    g, q, k, v = heads(17, L=5, S=40)
    kw = kw | {"sinks": g.normal(0, 2, 4), "max_memory": TINY, "workers": workers}
    dirty = np.stack([hidden(b, np.arange(40)) for b in range(2)])  # (B, S)
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[dirty[:, None, :, None].repeat(2, 1).repeat(8, 3)] = np.nan
    v_nan[dirty[:, None, :, None].repeat(2, 1).repeat(8, 3)] = np.nan
    grad = g.standard_normal(q.shape)
    out, backward = sdpa(q, k, v, **kw, return_backward=True)
    out_nan, backward_nan = sdpa(q, k_nan, v_nan, **kw, return_backward=True)
    # The same up to rounding: the compiled walk leaves a task whose hidden values are not
    # finite to the NumPy walk, which sums in another order (both walks, or one alone).
    assert np.isfinite(out_nan).all()
    np.testing.assert_allclose(out_nan, out, rtol=1e-13, atol=1e-15)
    grads, grads_nan = backward(grad), backward_nan(grad)
    for name in grads:
        assert np.isfinite(grads_nan[name]).all(), name
        np.testing.assert_allclose(grads_nan[name], grads[name], rtol=1e-13, atol=1e-15)
    assert np.all(grads["k"][dirty[:, None].repeat(2, 1)] == 0)


# ---------------------------------------------------------------- merge_attention with sinks


def test_merge_attention_adds_the_sinks_once(record_error):
    g, q, k, v = heads(51, L=37, S=53)
    sinks = g.normal(1, 2, 4)
    mask = np.tril(np.ones((37, 53), bool), 16)
    mask[5] = False  # a row that sees no key anywhere
    whole, whole_lse = sdpa(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    parts = [
        sdpa(q, k[..., a:b, :], v[..., a:b, :], mask=mask[:, a:b], return_lse=True)
        for a, b in ((0, 10), (10, 31), (31, 53))
    ]
    out, lse = mha.merge_attention([p[0] for p in parts], [p[1] for p in parts], sinks=sinks)
    assert record_error("merge_attention with sinks", relative_error(out, whole)) <= 1e-12
    assert record_error("merge_attention with sinks", lse_error(lse, whole_lse)) <= 1e-12
    np.testing.assert_array_equal(out[:, :, 5], 0.0)
    np.testing.assert_array_equal(lse[:, :, 5], np.broadcast_to(sinks, (2, 4)))
    expected = reference(q, k, v, mask=mask, sinks=sinks)
    assert relative_error(out, expected[0]) <= 1e-12 and lse_error(lse, expected[1]) <= 1e-12


# ---------------------------------------------------------------- refusals, no mutation


REFUSALS = [  # keywords, the name the message must give
    *(({"sinks": x}, "sinks") for x in (np.zeros(5), np.zeros((1, 4)))),
    *(({"softcap": x}, "softcap") for x in (0.0, -1.0)),
    ({"chunk": 0}, "chunk"),
    ({"sink_tokens": 2}, "sink_tokens"),
    ({"mask_mod": lambda b, h, i, j: (j <= i).astype(np.int64)}, "mask_mod"),
    ({"mask_mod": lambda b, h, i, j: (j - i) * 1.0}, "mask_mod"),
    ({"mask_mod": lambda b, h, i, j: np.ones((2, 3, 1, 1), bool)}, "mask_mod"),
    ({"score_mod": lambda s, b, h, i, j: s[..., :1]}, "score_mod"),
    ({"score_mod": lambda s, b, h, i, j: s.sum()}, "score_mod"),
    ({"score_mod": lambda s, b, h, i, j: 2 * s, "return_backward": True}, "score_mod_grad"),
    *(({"alibi": x}, "alibi") for x in (np.ones(3), np.ones((4, 1)))),
    # a function of the wrong arity, refused before the kernel calls it (a bare TypeError)
    ({"mask_mod": lambda b, h, i: i >= 0}, r"mask_mod must take 4 positional arguments"),
    ({"mask_mod": lambda b, h, i, j, extra: i >= j}, r"mask_mod must take 4 positional"),
    ({"score_mod": lambda s, b: s}, r"score_mod must take 5 positional arguments"),
    (
        {"score_mod": lambda s, b, h, i, j: s, "score_mod_grad": lambda s: s},
        r"score_mod_grad must take 5 positional",
    ),
]


@pytest.mark.parametrize(("kw", "name"), REFUSALS)
def test_refusals_name_the_argument(kw, name):
    _, q, k, v = heads(19, L=7, S=9)
    with pytest.raises(mha.AttentionError, match=name) as refused:
        sdpa(q, k, v, **kw)
    assert isinstance(refused.value, (ValueError, TypeError))


def test_functions_with_defaults_or_star_arguments_are_taken():
    _, q, k, v = heads(29, L=7, S=9)
    expected = sdpa(q, k, v, mask_mod=lambda b, h, i, j: i >= j)
    for mask_mod in (lambda *a: a[2] >= a[3], lambda b, h, i, j, extra=0: i >= j + extra):
        np.testing.assert_array_equal(sdpa(q, k, v, mask_mod=mask_mod), expected)


@pytest.mark.parametrize("reads_b", [True, False])
def test_a_mask_mod_over_zero_sequences_gives_an_empty_result(reads_b):
    """A mask_mod that reads b over zero sequences divided by zero sizing its block map."""
    q = np.zeros((0, 2, 3, 4))
    out = sdpa(q, q, q, mask_mod=(lambda b, h, i, j: (b >= 0) & (j <= i)) if reads_b else
               (lambda b, h, i, j: j <= i))  # fmt: skip
    assert out.shape == (0, 2, 3, 4)


def test_inputs_are_left_unchanged():
    g, q, k, v = heads(23, L=37, S=53)
    sinks, slopes, bias = g.normal(0, 1, 4), g.uniform(0, 1, 4), g.standard_normal((37, 53))
    given = [q, k, v, sinks, slopes, bias]
    copies = [x.copy() for x in given]
    out, backward = sdpa(
        q, k, v, sinks=sinks, alibi=slopes, bias=bias, softcap=1.0, chunk=8, causal=True,
        score_mod=tanh_mod(2.0, np.tanh), score_mod_grad=tanh_grad(2.0),
        max_memory=TINY, return_backward=True,
    )  # fmt: skip
    backward(np.ones_like(out))
    mha.merge_attention([out], [np.zeros(out.shape[:-1])], sinks=sinks)
    for x, copy in zip(given, copies, strict=True):
        np.testing.assert_array_equal(x, copy)


# ---------------------------------------------------------------- the module


def test_module_equals_the_function_and_learns_its_sinks():
    g = np.random.default_rng(29)
    settings = {"sinks": True, "softcap": 3.0, "alibi": True, "chunk": 4}
    attention = mha.MultiHeadAttention(24, 4, num_kv_heads=2, bias=True, seed=0, **settings)
    assert attention.parameters()["sinks"].shape == (4,)
    attention.sinks[...] = g.normal(0, 1, 4)
    X = g.standard_normal((2, 11, 24))
    weights = [attention.W_q, attention.W_k, attention.W_v, attention.W_o]
    biases = {n: getattr(attention, n) for n in ("b_q", "b_k", "b_v", "b_o")}
    keywords = settings | {"sinks": attention.sinks, "num_kv_heads": 2, "causal": True} | biases
    for extra in ({}, {"mask_mod": _doc(2, 11, 0), "score_mod": tanh_mod(2.0, np.tanh)}):
        grads = {"score_mod_grad": tanh_grad(2.0)} if extra else {}
        out, backward = attention(X, causal=True, return_backward=True, **extra, **grads)
        expected, expected_backward = mha.multi_head_attention(
            X, X, X, *weights, 4, **keywords, **extra, **grads, return_backward=True
        )
        np.testing.assert_array_equal(out, expected)
        grad = g.standard_normal(out.shape)
        ours, theirs = backward(grad), expected_backward(grad)
        assert ours["sinks"].shape == (4,) and np.abs(ours["sinks"]).max() > 0
        for name in ("sinks", "W_q", "W_k", "W_v", "W_o", "b_q", "b_v", "b_o"):
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_module_cache_keeps_the_sink_tokens_and_the_window(record_error):
    attention = mha.MultiHeadAttention(16, 4, window=5, sink_tokens=2, sinks=True, seed=1)
    attention.sinks[...] = np.array([0.5, -1.0, 1.0, 2.0])
    X = np.random.default_rng(31).standard_normal((2, 30, 16))
    full = attention(X, causal=True)
    cache = attention.new_cache(2, capacity=4)
    assert cache.window == 5
    steps = [attention(X[:, :3], cache=cache)]
    steps += [attention(X[:, t : t + 1], cache=cache) for t in range(3, 30)]
    assert (
        record_error("cached decoding vs full call", relative_error(np.concatenate(steps, 1), full))
        <= 1e-13
    )
    assert cache.capacity < 30
