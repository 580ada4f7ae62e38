"""``paged_attention`` with several queries per sequence (``cu_seqlens_q``, vLLM's and
FlashAttention's packed layout) and with the variants (``softcap``, ``alibi``, ``sinks``,
``window``, ``mask_mod``, ``score_mod``), against a plain loop over each sequence, head and
query of the definitions: sequence ``b``'s ``L_b`` queries are its last positions ``p =
seq_lens[b] - L_b + i``; key ``j`` is visible when ``j < seq_lens[b]``, ``j <= p`` (causal),
``p - j < window`` and ``mask_mod(b, h, p, j)``; its score is ``scale * q.k``, soft-capped,
then ``score_mod(s, b, h, p, j)``, then ``- slope_h * (p - j)``; the softmax adds
``exp(sinks[h])`` to its denominator."""

from __future__ import annotations

import numpy as np
import pytest
from support.flash import relative

import mha
from mha.errors import AttentionError


def loop(q, pool_k, pool_v, table, seq_lens, counts, *, causal=False, window=None, softcap=None,
         slopes=None, sinks=None, mask_mod=None, score_mod=None):  # fmt: skip
    """Packed ``q (total_q, H, d)``; returns ``(out (total_q, H, d_v), lse (H, total_q))``."""
    H, d = q.shape[1:]
    H_kv, block = pool_k.shape[2], pool_k.shape[1]
    out = np.zeros((len(q), H, pool_v.shape[-1]))
    lse = np.full((H, len(q)), -np.inf)
    row = 0
    for b, (n, count) in enumerate(zip(seq_lens, counts, strict=True)):
        keys = [pool_k[table[b, j // block], j % block] for j in range(n)]
        values = [pool_v[table[b, j // block], j % block] for j in range(n)]
        for i in range(count):
            p = n - count + i
            for h in range(H):
                g = h // (H // H_kv)
                scores, seen = [], []
                for j in range(n):
                    if (causal and j > p) or (window is not None and p - j >= window):
                        continue
                    if mask_mod is not None and not mask_mod(b, h, p, j):
                        continue
                    s = float(q[row + i, h] @ keys[j][g]) / np.sqrt(d)
                    if softcap is not None:
                        s = softcap * np.tanh(s / softcap)
                    if score_mod is not None:
                        s = float(score_mod(s, b, h, p, j))
                    if slopes is not None:
                        s = s - slopes[h] * (p - j)
                    scores.append(s)
                    seen.append(j)
                if not seen:
                    continue
                scores = np.array(scores)
                top = scores.max() if sinks is None else max(scores.max(), sinks[h])
                weights = np.exp(scores - top)
                total = weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
                out[row + i, h] = (weights / total) @ np.array([values[j][g] for j in seen])
                lse[h, row + i] = top + np.log(total)
        row += count
    return out, lse


def paged(rng, seq_lens, block=4, H_kv=2, d=8):
    blocks = [-(-n // block) for n in seq_lens]
    order = rng.permutation(sum(blocks) + 3)
    table = np.zeros((len(seq_lens), max(blocks)), np.int64)
    table[:] = -1  # past each sequence's blocks: never read
    used = 0
    for b, count in enumerate(blocks):
        table[b, :count] = order[used : used + count]
        used += count
    pool_k = rng.standard_normal((len(order), block, H_kv, d))
    pool_v = rng.standard_normal((len(order), block, H_kv, d))
    return pool_k, pool_v, table


def document(b, h, q_idx, kv_idx):
    """A mask of documents of 3 positions (vectorised: also works on scalars)."""
    return q_idx // 3 == kv_idx // 3


def tilt(score, b, h, q_idx, kv_idx):
    return score + 0.1 * (h + 1) * np.cos(q_idx - kv_idx)


VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window": 3},
    "softcap": {"causal": True, "softcap": 2.0},
    "alibi": {"causal": True, "alibi": True},
    "sinks": {"causal": True, "sinks": True},
    "mask_mod": {"mask_mod": document},
    "score_mod": {"causal": True, "score_mod": tilt},
    "all": {"causal": True, "window": 5, "softcap": 3.0, "alibi": True, "sinks": True,
            "mask_mod": document, "score_mod": tilt},
}  # fmt: skip


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("packed", [False, True])
def test_paged_attention_with_the_variants(name, packed, record_error):
    rng = np.random.default_rng(11)
    H = 4
    seq_lens = np.array([9, 3, 12, 1])
    counts = np.array([3, 2, 5, 1]) if packed else np.full(4, 1)
    pool_k, pool_v, table = paged(rng, seq_lens)
    q = rng.standard_normal((counts.sum(), H, 8))
    keywords = dict(VARIANTS[name])
    given = dict(keywords)
    if keywords.get("alibi"):
        given["slopes"] = mha.alibi_slopes(H)
        keywords["alibi"] = True
    if keywords.get("sinks"):
        keywords["sinks"] = given["sinks"] = rng.standard_normal(H)
    given.pop("alibi", None)
    want, want_lse = loop(q, pool_k, pool_v, table, seq_lens, counts, **given)
    if packed:
        cu = np.concatenate([[0], np.cumsum(counts)])
        out, lse = mha.paged_attention(q, pool_k, pool_v, table, seq_lens, cu_seqlens_q=cu,
                                       return_lse=True, **keywords)  # fmt: skip
    else:
        out, lse = mha.paged_attention(q[:, None], pool_k, pool_v, table, seq_lens,
                                       return_lse=True, **keywords)  # fmt: skip
        out, lse = out[:, 0], lse[:, :, 0].T
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    record_error(
        "paged_attention (packed, variants) vs a loop, float64",
        relative(out, want),
    )
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-12)


def test_packed_queries_equal_one_call_per_sequence():
    """Each sequence of a packed call gives what a call of its own gives."""
    rng = np.random.default_rng(12)
    seq_lens, counts = np.array([7, 4, 10]), np.array([2, 4, 3])
    pool_k, pool_v, table = paged(rng, seq_lens, block=3)
    q = rng.standard_normal((counts.sum(), 6, 8))
    cu = np.concatenate([[0], np.cumsum(counts)])
    out = mha.paged_attention(q, pool_k, pool_v, table, seq_lens, cu_seqlens_q=cu, causal=True)
    for b in range(3):
        alone = mha.paged_attention(q[None, cu[b] : cu[b + 1]], pool_k, pool_v, table[b : b + 1],
                                    seq_lens[b : b + 1], causal=True)  # fmt: skip
        np.testing.assert_allclose(out[cu[b] : cu[b + 1]], alone[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    ("cu", "q_shape", "named"),
    [
        ([0, 2, 5], (5, 4, 8), "sequences of cu_seqlens_q"),  # the table has three
        ([1, 2, 3, 5], (5, 4, 8), "cu_seqlens_q"),
        ([0, 3, 2, 5], (5, 4, 8), "cu_seqlens_q"),
        ([0, 1, 2, 4], (5, 4, 8), "cu_seqlens_q"),
        ([0.0, 1.0, 2.0, 5.0], (5, 4, 8), "cu_seqlens_q"),
        ([0, 1, 2, 5], (1, 5, 4, 8), "q must have shape"),
    ],
)
def test_packed_refusals_name_the_argument(cu, q_shape, named):
    rng = np.random.default_rng(0)
    pool_k, pool_v, table = paged(rng, [4, 4, 4])
    with pytest.raises(AttentionError, match=named):
        mha.paged_attention(np.ones(q_shape), pool_k, pool_v, table, [4, 4, 4], cu_seqlens_q=cu)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("packed", [False, True])
def test_cascade_attention_with_the_variants(name, packed, record_error):
    """The prefix's part and each sequence's own, merged, against the loop over the whole
    sequences (prefix then own positions)."""
    rng = np.random.default_rng(13)
    H, block, n = 4, 4, 8  # a prefix of two whole blocks
    own_lens = np.array([5, 3, 9, 2])
    counts = np.array([3, 2, 5, 1]) if packed else np.full(4, 2)
    pool_k, pool_v, own_table = paged(rng, own_lens, block=block)
    prefix = np.array([len(pool_k), len(pool_k) + 1])
    pool_k = np.concatenate([pool_k, rng.standard_normal((2, block, 2, 8))])
    pool_v = np.concatenate([pool_v, rng.standard_normal((2, block, 2, 8))])
    whole_table = np.concatenate([np.tile(prefix, (4, 1)), own_table], axis=1)
    q = rng.standard_normal((counts.sum(), H, 8))
    keywords = dict(VARIANTS[name])
    given = dict(keywords)
    if keywords.get("alibi"):
        given["slopes"] = mha.alibi_slopes(H)
    if keywords.get("sinks"):
        keywords["sinks"] = given["sinks"] = rng.standard_normal(H)
    given.pop("alibi", None)
    want, want_lse = loop(q, pool_k, pool_v, whole_table, n + own_lens, counts, **given)
    if packed:
        cu = np.concatenate([[0], np.cumsum(counts)])
        out, lse = mha.cascade_attention(q, pool_k, pool_v, prefix, n, own_table, own_lens,
                                         cu_seqlens_q=cu, return_lse=True, **keywords)  # fmt: skip
    else:
        out, lse = mha.cascade_attention(
            q.reshape(4, 2, H, 8), pool_k, pool_v, prefix, n, own_table, own_lens,
            return_lse=True, **keywords,
        )  # fmt: skip
        out, lse = out.reshape(-1, H, 8), lse.transpose(1, 0, 2).reshape(H, -1)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    record_error(
        "cascade_attention (packed, variants) vs a loop, float64",
        relative(out, want),
    )
    seen = np.isfinite(want_lse)
    assert np.array_equal(seen, np.isfinite(lse))
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-12)


def test_lse_in_base_2_on_request():
    """FlashInfer's log-sum-exp, ``log2 sum 2^(s log2 e)``, from every entry point that
    returns one, and read back by ``merge_attention(base=2)``."""
    rng = np.random.default_rng(14)
    q, k, v = rng.standard_normal((3, 2, 4, 6, 8))
    out = mha.scaled_dot_product_attention(q, k, v, causal=True)
    out2, lse2 = mha.scaled_dot_product_attention(q, k, v, causal=True, return_lse=True,
                                                  lse_base=2)  # fmt: skip
    scores = np.einsum("bhld,bhsd->bhls", q, k) / np.sqrt(8)
    scores = np.where(np.tril(np.ones((6, 6), bool)), scores, -np.inf)
    want = np.log2(np.sum(np.exp2(scores * np.log2(np.e)), axis=-1))  # FlashInfer's definition
    np.testing.assert_allclose(lse2, want, rtol=1e-14, atol=1e-14)
    assert np.array_equal(out2, out)
    _, _, lse_w = mha.scaled_dot_product_attention(
        q, k, v, causal=True, return_weights=True, return_lse=True, lse_base=2
    )
    np.testing.assert_allclose(lse_w, want, rtol=1e-14, atol=1e-14)
    halves = [mha.scaled_dot_product_attention(q, k[..., a:b, :], v[..., a:b, :],
                                               return_lse=True, lse_base=2)
              for a, b in ((0, 2), (2, 6))]  # fmt: skip
    merged, merged_lse = mha.merge_attention(*zip(*halves, strict=True), base=2)
    whole, whole_lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True, lse_base=2)
    np.testing.assert_allclose(merged, whole, rtol=0, atol=1e-14)
    np.testing.assert_allclose(merged_lse, whole_lse, rtol=1e-14, atol=1e-14)
    pool_k, pool_v, table = paged(rng, [5, 7])
    queries = rng.standard_normal((2, 1, 4, 8))
    _, natural = mha.paged_attention(queries, pool_k, pool_v, table, [5, 7], return_lse=True)
    _, base2 = mha.paged_attention(queries, pool_k, pool_v, table, [5, 7], return_lse=True,
                                   lse_base=2)  # fmt: skip
    np.testing.assert_allclose(base2, natural / np.log(2), rtol=1e-15, atol=1e-15)
    prefix = np.array([len(pool_k) - 1])
    keywords = dict(prefix_blocks=prefix, prefix_len=4, block_table=table, seq_lens=[5, 7],
                    return_lse=True)  # fmt: skip
    _, natural = mha.cascade_attention(queries, pool_k, pool_v, **keywords)
    _, base2 = mha.cascade_attention(queries, pool_k, pool_v, lse_base=2, **keywords)
    np.testing.assert_allclose(base2, natural / np.log(2), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize(
    ("keywords", "named"),
    [({"lse_base": 2}, "give return_lse=True"), ({"return_lse": True, "lse_base": 10}, "lse_base"),
     ({"return_lse": True, "lse_base": True}, "lse_base"),
     ({"return_lse": True, "lse_base": np.array([2, 2])}, "lse_base")],
)  # fmt: skip
def test_lse_base_refusals(keywords, named):
    q = np.ones((1, 2, 3, 4))
    with pytest.raises(AttentionError, match=named):
        mha.scaled_dot_product_attention(q, q, q, **keywords)
    pool_k, pool_v, table = paged(np.random.default_rng(0), [3])
    with pytest.raises(AttentionError, match=named):
        mha.paged_attention(np.ones((1, 1, 4, 8)), pool_k, pool_v, table, [3], **keywords)
