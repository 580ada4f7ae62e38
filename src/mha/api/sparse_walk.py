"""Sparse top-k attention at the cost of the keys it reads: the attention of a
:class:`mha.LatentAttention` with an indexer (:mod:`.sparse`) over the keys each query chose,
gathered, rather than over every key with the rest masked.

The indexer keeps ``topk`` keys per query of the ``S`` it sees. For each sequence and each
tile of queries, the keys any query of the tile chose are gathered, in order, and the
library's one kernel (:func:`mha.scaled_dot_product_attention`) attends over them, each
query masked to its own choice (no mask where the tile's queries chose the same keys, as
one query always does: a decoding step reads ``topk`` keys, not ``S``). A tile whose
queries chose together more than half the keys is walked over all of them, masked, as
the dense path does. The scores, the softmax and the output are the dense path's over the
same keys, in the same order; only the tiles' split of the sum differs (float rounding).

>>> import numpy as np
>>> q = np.ones((1, 2, 1, 3)); keys = np.arange(12.0).reshape(1, 1, 4, 3)
>>> chosen = np.array([[[True, False, True, False]]])
>>> out = attend_chosen(q, keys, 2, 1.0, chosen, {"cache": None})
>>> bool(np.allclose(out, attend_chosen(q, keys, 2, 1.0, chosen, {"cache": None})))
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cache import KVCache
from .split_heads import scaled_dot_product_attention

__all__ = ["attend_chosen", "walks_chosen"]

GATHERED_BYTES = 1 << 25
"""At most this many bytes of keys gathered for one tile of queries (32 MiB)."""

SHARED = 1.25
"""A tile of queries is walked together while the keys they chose together are at most this
many times those of the query that chose most; past it, each query alone (over its own
keys, with others' queries). A tile computes every query's scores against all its keys: at
twice as many keys as each query's, 16 queries a sequence of a 32k-token decoding chunk
took 212 ms (tiles of 2 queries masked among ~4,000 keys: a quarter of the time, for an
eighth of the queries); at 1.25, every query alone (``benchmarks/sparse.py``)."""

_KERNEL_KEYWORDS = ("max_memory", "workers", "sinks")
_TAKEN = frozenset({"mask", "causal", "cache", "query_lengths", "key_lengths", *_KERNEL_KEYWORDS})


def walks_chosen(attention: dict[str, Any], dtype: np.dtype) -> bool:
    """Whether :func:`attend_chosen` computes a call of these keywords in ``dtype``: the
    layer's plain keywords and sinks (no variant that reads the keys' positions), and no
    cache or a contiguous cache of ``dtype`` without a window (the others are walked
    masked)."""
    if any(value is not None for name, value in attention.items() if name not in _TAKEN):
        return False  # a variant set (a window, a temperature): the masked walk
    cache = attention.get("cache")
    return cache is None or (
        type(cache).__name__ == "SparseKVCache"
        and isinstance(cache, KVCache)
        and cache.window is None
        and cache.dtype == dtype
    )


def attend_chosen(
    query: np.ndarray,
    key: np.ndarray,
    r: int,
    scale: float,
    chosen: np.ndarray,
    attention: dict[str, Any],
) -> np.ndarray:
    """The latent attention ``(*B, H, L, r)`` of ``query (*B, H, L, D)`` over the keys
    ``chosen (*B, L, S)`` marks, of ``key (*B, 1, L, D)`` (the new tokens'; the values are
    the keys' first ``r`` features) and, with ``attention["cache"]``, the cached ones before
    them: the new keys are appended and committed once the attention is computed."""
    cache = attention.get("cache")
    kernel = {name: attention[name] for name in _KERNEL_KEYWORDS if attention.get(name) is not None}
    batch, (H, L, D) = query.shape[:-3], query.shape[-3:]
    q = query.reshape(-1, H, L, D)
    picked = chosen.reshape(-1, L, chosen.shape[-1])
    if cache is None:
        keys = key.reshape(-1, 1, key.shape[-2], D)
        return _walk(q, keys, picked, r, scale, kernel).reshape(*batch, H, L, r)
    B = q.shape[0]
    cache._check_fit(B, 1, D, r, f"query {query.shape}, key {key.shape}")
    counts = np.full(B, L, np.int64)
    saved = cache._snapshot()
    try:
        filled = cache._append(key, key[..., :r], counts)
        keys = cache._attended(int(filled.max(initial=0)))[0]
        out = _walk(q, keys, picked, r, scale, kernel)
    except BaseException:
        cache._restore(saved)
        raise
    cache._commit(counts)
    return out.reshape(*batch, H, L, r)


def _walk(
    q: np.ndarray,
    keys: np.ndarray,
    chosen: np.ndarray,
    r: int,
    scale: float,
    kernel: dict[str, Any],
) -> np.ndarray:
    """``q (B, H, L, D)`` over ``keys (B, 1, S, D)`` where ``chosen (B, L, S)``."""
    B, H, L, D = q.shape
    out = np.zeros((B, H, L, r), q.dtype)
    alone: list[tuple[int, int, np.ndarray]] = []  # (sequence, query, its keys)
    for b in range(B):
        counts = chosen[b].sum(-1)
        # As many queries a tile as keep their keys within GATHERED_BYTES, at least one.
        tile = max(1, GATHERED_BYTES // max(1, int(counts.max(initial=1)) * D * q.itemsize))
        start = 0
        while start < L:
            stop = min(L, start + tile)
            used = np.flatnonzero(chosen[b, start:stop].any(0))
            if stop - start > 1 and used.size > SHARED * counts[start:stop].max():
                stop = start + 1  # the tile's queries share few keys: one query at a time
                used = np.flatnonzero(chosen[b, start])
            if stop - start == 1 and 0 < 2 * used.size <= keys.shape[-2]:
                alone.append((b, start, used))
            else:
                _attend_tile(q[b, :, start:stop], keys[b], chosen[b, start:stop], used, r,
                             scale, kernel, out[b, :, start:stop])  # fmt: skip
            start = stop
    _attend_alone(q, keys, alone, r, scale, kernel, out)
    return out


def _attend_alone(
    q: np.ndarray,
    keys: np.ndarray,
    alone: list[tuple[int, int, np.ndarray]],
    r: int,
    scale: float,
    kernel: dict[str, Any],
    out: np.ndarray,
) -> None:
    """The queries walked alone, ``(b, l, keys chosen)``, each over its own keys, gathered:
    as many in one call of the kernel (one a row of its batch, its keys' count the row's
    key length) as keep their keys within ``GATHERED_BYTES``. A decoding step's sequences
    are attended together, as a dense step's are."""
    D, start = q.shape[-1], 0
    while start < len(alone):
        stop, width = start + 1, alone[start][2].size
        while stop < len(alone):
            wider = max(width, alone[stop][2].size)
            if (stop + 1 - start) * wider * D * q.itemsize > GATHERED_BYTES:
                break
            stop, width = stop + 1, wider
        rows = alone[start:stop]
        at = np.zeros((len(rows), width), np.intp)  # a row's keys, then its first key again
        lengths = np.array([used.size for _, _, used in rows])
        for i, (_, _, used) in enumerate(rows):
            at[i, : used.size] = used
        seq, query = np.array([row[0] for row in rows]), np.array([row[1] for row in rows])
        k = keys[seq[:, None], 0, at][:, None]  # (n, 1, width, D)
        short = None if (lengths == width).all() else lengths
        got = scaled_dot_product_attention(
            q[seq, :, query][:, :, None], k, k[..., :r], key_lengths=short, scale=scale, **kernel
        )
        out[seq, :, query] = got[:, :, 0]
        start = stop


def _attend_tile(
    q: np.ndarray,
    keys: np.ndarray,
    picked: np.ndarray,
    used: np.ndarray,
    r: int,
    scale: float,
    kernel: dict[str, Any],
    out: np.ndarray,
) -> None:
    """``out (H, T, r)``: the queries ``q (H, T, D)`` over the keys ``used`` of ``keys (1,
    S, D)``, each query over those it ``picked (T, S)``: gathered, or (most of the keys)
    all of them masked."""
    if used.size == 0:
        return  # no key chosen: zeros, as a row the mask hides whole
    mask: np.ndarray | None
    if 2 * used.size > keys.shape[-2]:
        k, mask = keys, picked[None]
    else:
        k, sub = keys[:, used], picked[:, used]
        mask = None if sub.all() else sub[None]
    out[...] = scaled_dot_product_attention(q, k, k[..., :r], mask=mask, scale=scale, **kernel)
