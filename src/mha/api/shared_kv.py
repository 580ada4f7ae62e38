"""KV sharing: a layer that computes no keys and values of its own and attends with another
layer's (Gemma 3n's and Gemma 4's last ``num_kv_shared_layers`` layers, each with the last
earlier layer of its type).

The layer's call reads that layer's cache (:class:`mha.KVCache`) and writes nothing to it:
the cache's owner has already appended the same tokens (transformers runs the layers in
order), so the call's ``L`` queries are the last ``L`` positions the cache holds, and attend
over everything it holds up to them. :class:`SharedKV` is the cache as such a call sees it:
its lengths are the positions of the call's first query, its appends write nothing (the new
keys and values, which a layer sharing them does not have, are dropped) and commit nothing.

A cache with a window keeps the last ``window - 1`` positions once a call ends: after a
prompt longer than that, its owner's cache no longer holds what the prompt's first queries
see, and the call is refused (give the owner a cache without a window for the prompt).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import AttentionTypeError, AttentionValueError
from .cache import KVCache

__all__ = ["SharedKV", "shared_view"]


def shared_view(cache: Any, L: int, query_lengths: Any, layer: int) -> Any:
    """The view of ``cache`` (layer ``layer``'s) for a call of ``L`` new queries a
    sequence, checked: that layer's cache, holding those tokens already (a
    :class:`SharedKV`, which the calls take as a cache)."""
    where = (
        f"this layer attends with layer {layer}'s keys and values (KV sharing): call it with "
        f"cache= layer {layer}'s cache, after layer {layer}'s call on the same tokens"
    )
    if cache is None:
        raise AttentionValueError(f"{where}; it has no keys and values of its own")
    if not isinstance(cache, KVCache):
        raise AttentionTypeError(f"{where}, an mha.KVCache; got {type(cache).__name__}")
    if query_lengths is not None:
        raise AttentionValueError(
            f"query_lengths= cannot be combined with a cache read by KV sharing ({where}): "
            "every sequence's L tokens are the last ones its cache holds"
        )
    view = SharedKV(cache, L)
    if (view.lengths < 0).any():
        raise AttentionValueError(
            f"the cache holds {cache.lengths.tolist()} positions, fewer than the {L} new "
            f"tokens: {where}"
        )
    window = cache.window
    if window is not None:
        seen = np.maximum(view.lengths - window + 1, 0)  # the first query's first key
        if (cache.first > np.maximum(seen, cache.sink_tokens)).any():
            raise AttentionValueError(
                f"{cache!r} no longer holds the positions the first of these {L} queries "
                f"see: a cache with window={window} keeps the last {window - 1} once a call "
                f"ends. Give layer {layer} a cache without a window for a prompt longer than "
                "that (mha.KVCache without window=)"
            )
    return view


class SharedKV:
    """Another layer's :class:`mha.KVCache` as a call that shares its keys and values sees
    it (see the module's docstring): everything is the cache's but its lengths, which are
    the first new query's positions, and its writes, which there are none of."""

    def __init__(self, cache: KVCache, L: int) -> None:
        self._cache = cache
        self._L = L

    def __getattr__(self, name: str) -> Any:  # window, first, dtypes, _check_fit, _attended
        return getattr(self._cache, name)

    def __repr__(self) -> str:
        return f"SharedKV({self._cache!r})"

    @property
    def lengths(self) -> np.ndarray:
        lengths: np.ndarray = self._cache.lengths - self._L
        return lengths

    def _append(self, k: np.ndarray, v: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Nothing written: each sequence's filled slots, the new tokens already among them."""
        return self._cache._held()

    def _snapshot(self) -> None:
        return None

    def _restore(self, state: None) -> None:
        pass

    def _commit(self, counts: np.ndarray) -> None:
        pass
