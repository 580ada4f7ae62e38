"""Checking and reading what :mod:`mha.dask`'s functions are given: Dask or NumPy arrays,
the masks cut like the scores, rotary positions, and the options that are in-memory only."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..._arrays import as_float_array, positive_int
from ..._kernel.contract import Visibility, fit_to_scores, split_mask
from ...api import checks
from ...api.rotary import check_rotary
from ...errors import AttentionValueError
from .arrays import is_dask, known, standin
from .graph import Grid


def check_fan_in(split_every: Any) -> int:
    fan_in = positive_int("split_every", split_every)
    if fan_in < 2:
        raise AttentionValueError(f"split_every must be at least 2; got {fan_in}")
    return fan_in


def refuse_in_memory_only(weights: bool, backward: bool, dropout_p: float, cache: Any) -> None:
    """The in-memory functions' options that mha.dask does not offer (checked as they check
    them), refused by name when asked for."""
    asked = [
        name
        for name, value in (
            ("return_weights", weights),
            ("return_backward", backward),
            ("dropout_p", dropout_p),
            ("cache", cache is not None),
        )
        if value
    ]
    if asked:
        listed = " and ".join([", ".join(asked[:-1]), asked[-1]] if len(asked) > 1 else asked)
        raise AttentionValueError(
            f"mha.dask computes the attention output (and its log-sum-exp) only; {listed} "
            f"{'is' if len(asked) == 1 else 'are'} available in the in-memory functions "
            "alone (mha.multi_head_attention and mha.scaled_dot_product_attention): call "
            "them on a slice that fits in memory"
        )


def with_batch_axis(visibility: Visibility) -> Visibility:
    """An unbatched call's visibility as a batch of one."""

    def one(lengths: np.ndarray | None) -> np.ndarray | None:
        return None if lengths is None else np.reshape(lengths, (1,))

    return replace(
        visibility,
        index_shape=(1, *visibility.index_shape),
        key_lengths=one(visibility.key_lengths),
        query_lengths=one(visibility.query_lengths),
        mask=None,
        bias=None,
    )


@dataclass(frozen=True)
class Masks:
    """The boolean mask and the bias as Dask arrays, checked by their dtypes and shapes
    alone (nothing is computed)."""

    causal: bool  # mask=True
    mask: Any = None
    bias: Any = None
    full: tuple[int, ...] = ()  # the scores' shape, once checked

    @classmethod
    def check(cls, mask: Any, bias: Any, da: Any) -> Masks:
        causal = isinstance(mask, (bool, np.bool_)) and bool(mask)
        if mask is None or isinstance(mask, (bool, np.bool_)):
            mask = None
        elif is_dask(mask):
            split_mask(standin(known("mask", mask)))  # a non-boolean mask's error
        else:
            _, mask = split_mask(mask)
            mask = da.from_array(mask)
        if bias is not None:
            if is_dask(bias):
                as_float_array("bias", np.zeros((), known("bias", bias).dtype))
            else:
                bias = da.from_array(as_float_array("bias", bias))
            if bias.dtype.kind in "iu":
                bias = bias.astype(np.float64)
        return cls(causal, mask, bias)

    def fit_scores(self, batch: tuple[int, ...], H: int, L: int, S: int) -> Masks:
        full = (*batch, H, L, S)
        for name, array in (("mask", self.mask), ("bias", self.bias)):
            if array is not None:
                fit_to_scores(name, standin(array), full, batch)
        return replace(self, full=full)

    def fit(self, grid: Grid, batched: bool) -> tuple[Any, Any]:
        """The mask and the bias as full-rank Dask arrays cut like the scores (broadcast
        axes whole), or ``None``."""
        mask, bias = (
            None if x is None else self._fit(x, batched, grid) for x in (self.mask, self.bias)
        )
        return mask, bias

    def _fit(self, x: Any, batched: bool, grid: Grid) -> Any:
        if batched and x.ndim == len(self.full) - 1:
            x = x[..., None, :, :]  # (B, L, S): the same for every head
        x = x[(None,) * (len(self.full) - x.ndim + (not batched))]
        scores = (*grid.batch_chunks, (grid.H,), grid.row_chunks, grid.col_chunks)
        chunks = tuple((1,) if n == 1 else c for n, c in zip(x.shape, scores, strict=True))
        return x if x.chunks == chunks else x.rechunk(chunks)

    @staticmethod
    def key(x: Any, bb: tuple[int, ...], i: int, j: int) -> Any:
        """The key of the block of ``x`` that covers query chunk ``i`` and key chunk ``j``."""
        if x is None:
            return None
        index = (*bb, 0, i, j)
        return (x.name, *(0 if n == 1 else at for n, at in zip(x.shape, index, strict=True)))

    def block_keywords(
        self, causal: bool, alignment: Any, window: Any, visibility: Visibility, batch: Any
    ) -> dict[str, Any]:
        """The in-memory call's masking keywords for one batch block (the mask and the bias
        come as the block's own arrays)."""
        block = visibility.block(batch, slice(0, visibility.L), slice(0, visibility.S))
        return {
            "causal": causal or self.causal,
            "causal_alignment": alignment,
            "window": window,
            "key_lengths": block.key_lengths,
            "query_lengths": block.query_lengths,
        }


@dataclass(frozen=True)
class Rotation:
    """Rotary embeddings: the keywords, the positions of the queries and of the keys, and
    the caller's own ``positions`` (``None`` for the defaults), checked once."""

    options: dict[str, Any] | None
    q_positions: np.ndarray | None
    k_positions: np.ndarray | None
    given: np.ndarray | None

    @classmethod
    def check(cls, call: checks.Call, given: Any) -> Rotation:
        if call.rotary is None:
            return cls(None, None, None, None)
        qp, kp = np.asarray(call.q_positions), np.asarray(call.k_positions)
        heads = {"q": call.H, "k": call.H_kv}
        for which, at, n in (("q", qp, call.L), ("k", kp, call.S)):
            check_rotary((*call.B, heads[which], n, call.d_k), at, **call.rotary)
        if not call.B and qp.ndim != 1:  # accepted in memory, lined up with the heads
            raise AttentionValueError(
                f"mha.dask takes positions of shape (L,) for unbatched input; got shape {qp.shape}"
            )
        return cls(call.rotary, qp, kp, None if given is None else np.asarray(given))

    def at(self, which: str, batch: tuple[slice, ...], at: slice) -> dict[str, Any] | None:
        """apply_rotary's keywords for the queries (``"q"``) or keys (``"kv"``) at ``at``."""
        if self.options is None:
            return None
        positions = self.q_positions if which == "q" else self.k_positions
        assert positions is not None
        cut = positions[(*batch[: positions.ndim - 1], at)]
        return {"positions": cut, **self.options}

    def block_positions(self, batch: tuple[slice, ...]) -> Any:
        """The in-memory call's ``positions`` for one batch block."""
        if self.given is None:
            return None
        return self.given[batch[:1]] if self.given.ndim == 2 else self.given
