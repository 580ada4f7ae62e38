"""FlashAttention's attention, written from its own tests' definitions (``attention_ref``,
``construct_local_mask``, ``attn_bias_from_alibi_slopes``) in plain NumPy, one sequence,
head and query at a time: the oracle of ``tests/test_flash_compat.py`` and
``tests/test_flash_kvcache.py``."""

from __future__ import annotations

import numpy as np


def reference(
    q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
    seqlen_k=None,
):  # fmt: skip
    """One sequence: ``q (sq, H, d)``, ``k``, ``v`` ``(sk, H_kv, d)``; ``slopes (H,)``;
    ``seqlen_k``: the call's key length (the padded one, a cache's room), from which a
    window side is unbounded (FlashAttention's ``mha_fwd``: ``window_size_left >= seqlen_k``
    becomes -1, the right side likewise). Returns ``out (sq, H, d_v)``, ``lse (H, sq)``,
    ``probabilities (H, sq, sk)``. The lse of a causal call (no left side, a right side of
    0) with ALiBi is that of the scores with ``slope * j`` added, as FlashAttention's
    ``alibi.h`` adds it there (``Is_causal``), larger by ``slope * (i + sk - sq)``."""
    sq, H, d = q.shape
    sk, H_kv = k.shape[0], k.shape[1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    seqlen_k = sk if seqlen_k is None else seqlen_k
    left, right = (-1 if side >= seqlen_k else side for side in window)
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    out = np.zeros((sq, H, v.shape[-1]))
    lse = np.full((H, sq), np.inf)
    probabilities = np.zeros((H, sq, sk))
    for h in range(H):
        g = h // (H // H_kv)
        for i in range(sq):
            scores, seen = [], []
            for j in range(sk):
                if right >= 0 and j > i + sk - sq + right:
                    continue
                if left >= 0 and j < i + sk - sq - left:
                    continue
                s = scale * float(np.dot(q[i, h], k[j, g]))
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                if slopes is not None:
                    s = s + -slopes[h] * abs(i + sk - sq - j)
                scores.append(s)
                seen.append(j)
            if not seen:
                continue
            scores = np.array(scores)
            top = scores.max()
            weights = np.exp(scores - top)
            total = weights.sum()
            lse[h, i] = top + np.log(total)
            if slopes is not None and is_causal:
                lse[h, i] += slopes[h] * (i + sk - sq)
            probabilities[h, i, seen] = weights / total
            out[i, h] = (weights / total) @ v[seen, g]
    return out, lse, probabilities


def relative(got, want):
    """``max |got - want| / max |want|``: what the suite's summary records."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))
