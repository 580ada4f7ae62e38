"""The graphs of :mod:`mha.dask`: per block of the batch, each query chunk's parts over the
key chunks its rows may see, merged by their log-sum-exp; or, with one chunk of queries and
one of keys, the in-memory function on the block.

Both graphs read the call's checked spec (:mod:`mha.api.spec`): a block's in-memory call
gets that spec with its own arrays, and each part the kernel's objects cut from it, so the
Dask functions compute what the in-memory ones compute, option for option.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..._kernel.contract import MaskArrays, Visibility
from ...api.checks import Call
from ...api.projection import append_keys
from ...api.relative_bias import RelativeBias
from ...api.spec import CallInputs, Checked
from ...api.variants import SymmetricAlibi
from .graph import Graph, Grid
from .inputs import Masks, Rotation, with_batch_axis
from .tasks import (
    WEIGHT_NAMES,
    Empty,
    InBlock,
    MhaBlock,
    Output,
    Part,
    Projection,
    SdpaBlock,
    lse_out,
    merge,
    mha_block,
    mha_out,
    part,
    project_chunk,
    sdpa_block,
    sdpa_out,
)

__all__ = ["Lazy", "MhaGraph", "SdpaGraph"]


@dataclass(frozen=True)
class Lazy:
    """A call's Dask arrays (batched: an unbatched call's gain a batch axis of one), its
    masks, the merge tree's fan-in and ``dask.array``."""

    arrays: dict[str, Any]
    batched: bool
    masks: Masks
    fan_in: int
    da: Any


def block_checked(
    checked: Checked, visibility: Visibility, batch: Any, arrays: MaskArrays, positions: Any
) -> Checked:
    """The checked call of the in-memory function on one batch block: the call's spec, its
    ``mask_mod`` and ``score_mod`` seeing the call's sequence numbers (the block numbers
    its own from 0), the block's own arrays, and the log-sum-exp asked back."""
    spec = checked.spec
    block = visibility.block(batch, slice(0, 0), slice(0, 0))
    sequences = None if block.sequences is None else block.sequences.reshape(-1)
    if sequences is not None and spec.mask.mask_mod is not None:
        rules = replace(spec.mask, mask_mod=InBlock(spec.mask.mask_mod, sequences, False))
        spec = replace(spec, mask=rules)
    score_mod = spec.scores.score_mod
    if sequences is not None and isinstance(score_mod, RelativeBias):  # the block's segments
        spec = replace(spec, scores=replace(spec.scores, score_mod=score_mod.block(sequences)))
    elif sequences is not None and score_mod is not None:
        scores = replace(spec.scores, score_mod=InBlock(score_mod, sequences, True))
        spec = replace(spec, scores=scores)
    sliced = _block_slopes(spec.scores.alibi, batch)
    if sliced is not spec.scores.alibi:  # each sequence's slopes: the block's rows of them
        spec = replace(spec, scores=replace(spec.scores, alibi=sliced))
    request = replace(checked.request, lse=True)
    return Checked(spec, CallInputs(arrays, positions), request)


def _block_slopes(alibi: Any, batch: Any) -> Any:
    """``alibi=`` as given, for one batch block: slopes with batch axes ``(*batch, H)`` cut
    to the block's sequences (``batch``: a slice per batch axis); anything else as it is."""
    symmetric = isinstance(alibi, SymmetricAlibi)
    given = alibi.slopes if isinstance(alibi, SymmetricAlibi) else alibi
    if given is None or isinstance(given, (bool, np.bool_)) or np.ndim(given) <= 1:
        return alibi
    part = np.asarray(given)[tuple(batch)]
    return SymmetricAlibi(part) if symmetric else part


class SdpaGraph:
    """The graph of :func:`mha.dask.scaled_dot_product_attention` for a call of ``checked``
    keywords on split heads of the shapes of ``standins`` (``q``, ``k``, ``v``), its
    ``visibility`` (batched) and its ``scale`` and changes to the scores resolved."""

    def __init__(
        self, lazy: Lazy, checked: Checked, visibility: Visibility, scale: float, scores: Any
    ) -> None:
        self.lazy, self.checked, self.scale, self.scores = lazy, checked, scale, scores
        arrays, da = lazy.arrays, lazy.da
        self.visibility = visibility if lazy.batched else with_batch_axis(visibility)
        self.H = visibility.index_shape[-1]
        self.grid = Grid.of(arrays["q"], arrays["k"], arrays["v"], self.H, heads_axis=True)
        self.qd, self.kd, self.vd = (
            self.grid.fit(arrays[name], where, da)
            for name, where in (("q", "rows"), ("k", "cols"), ("v", "cols"))
        )
        self.mask_d, self.bias_d = lazy.masks.fit(self.grid, lazy.batched)
        request = checked.request
        self.graph = Graph("mha-sdpa", (
            self.qd, self.kd, self.vd, self.mask_d, self.bias_d, self.visibility, scale,
            request.budget, request.threads, lazy.fan_in, request.lse, checked.spec.mask,
            checked.spec.scores, scores,
        ))  # fmt: skip

    def build(self, d_v: int, dtypes: tuple[np.dtype, np.dtype]) -> Any:
        """The lazy output (and log-sum-exp), values ``d_v`` wide, in the result dtype of
        ``dtypes`` (result, compute)."""
        grid, graph, lazy = self.grid, self.graph, self.lazy
        for bb, batch in grid.batch_blocks():
            for i, rows in enumerate(grid.rows):
                index = (*bb, 0, i, 0)
                if grid.one_pair:
                    key = self._block(bb, batch, i, index)
                else:
                    shape = (*grid.block_shape(batch), self.H, rows.stop - rows.start, d_v)
                    key = self._parts(bb, batch, (i, rows), index, Empty(shape, dtypes[1]))
                graph.task("out", index, sdpa_out, key, dtypes[0])
                if self.checked.request.lse:
                    graph.task("lse", index[:-1], lse_out, key)
        out_chunks = (*grid.batch_chunks, (self.H,), grid.row_chunks, (d_v,))
        deps = [self.qd, self.kd, self.vd, self.mask_d, self.bias_d]
        out = graph.array("out", out_chunks, dtypes[0], deps, lazy.da)
        if not lazy.batched:
            out = out[0]
        if not self.checked.request.lse:
            return out
        lse = graph.array("lse", out_chunks[:-1], dtypes[1], deps, lazy.da)
        return out, (lse if lazy.batched else lse[0])

    def _block(self, bb: tuple[int, ...], batch: Any, i: int, index: tuple[int, ...]) -> Any:
        """The in-memory function on one batch block (one chunk of queries and of keys)."""
        masks, block = (
            self.lazy.masks,
            self.visibility.block(batch, slice(0, self.visibility.L), slice(0, self.visibility.S)),
        )
        lengths = MaskArrays(None, None, block.key_lengths, block.query_lengths)
        checked = block_checked(self.checked, self.visibility, batch, lengths, None)
        return self.graph.task(
            "block",
            (*bb, i),
            sdpa_block,
            (self.qd.name, *index),
            (self.kd.name, *bb, 0, 0, 0),
            (self.vd.name, *bb, 0, 0, 0),
            masks.key(self.mask_d, bb, i, 0),
            masks.key(self.bias_d, bb, i, 0),
            SdpaBlock(checked),
        )

    def _parts(
        self,
        bb: tuple[int, ...],
        batch: Any,
        row: tuple[int, slice],
        index: tuple[int, ...],
        empty: Empty,
    ) -> Any:
        """Query chunk ``row = (i, rows)``'s parts over the key chunks its rows may see,
        merged (the sinks added once, at the last merge)."""
        i, rows = row
        request, masks = self.checked.request, self.lazy.masks
        parts_scores = None if self.scores is None else self.scores.without_sinks()
        parts = []
        for j, cols in enumerate(self.grid.cols):
            block = self.visibility.block(batch, rows, cols)
            if block.sees_any():
                plan = Part(
                    block, self.scale, request.budget, request.threads, empty.dtype, parts_scores
                )
                parts.append(
                    self.graph.task(
                        "part",
                        (*bb, i, j),
                        part,
                        (self.qd.name, *index),
                        [(self.kd.name, *bb, 0, j, 0), (self.vd.name, *bb, 0, j, 0)],
                        masks.key(self.mask_d, bb, i, j),
                        masks.key(self.bias_d, bb, i, j),
                        plan,
                    )
                )
        last = self.graph.reduce(parts, (*bb, i), self.lazy.fan_in)
        sinks = None if self.scores is None else self.scores.sinks
        return self.graph.task("merged", (*bb, i), merge, last, replace(empty, sinks=sinks))


class MhaGraph:
    """The graph of :func:`mha.dask.multi_head_attention` for a checked layer's ``call``
    (on stand-ins of the arrays' shapes) with its ``rotation``."""

    def __init__(self, lazy: Lazy, call: Call, checked: Checked, rotation: Rotation) -> None:
        self.lazy, self.call, self.checked, self.rotation = lazy, call, checked, rotation
        arrays, da = lazy.arrays, lazy.da
        assert call.visibility is not None  # no cache
        self.visibility = call.visibility if lazy.batched else with_batch_axis(call.visibility)
        self.grid = grid = Grid.of(arrays["Q"], arrays["K"], arrays["V"], call.H, heads_axis=False)
        self.Qd = grid.fit(arrays["Q"], "rows", da)
        one = call.self_attention
        self.Kd = self.Qd if one else grid.fit(arrays["K"], "cols", da)
        self.Vd = self.Qd if one else grid.fit(arrays["V"], "cols", da)
        self.mask_d, self.bias_d = lazy.masks.fit(grid, lazy.batched)
        weights = {name: getattr(call.weights, name) for name in WEIGHT_NAMES}
        norm = call.qk_norm
        weights["q_norm"] = None if norm is None else norm.q_norm
        weights["k_norm"] = None if norm is None else norm.k_norm
        weights["q_norm_bias"] = None if norm is None else norm.q_bias
        weights["k_norm_bias"] = None if norm is None else norm.k_bias
        gate = call.spec.output  # an output gate's weights (no other stage reaches mha.dask)
        weights["W_g"] = getattr(gate, "W_g", None)
        weights["b_g"] = getattr(gate, "b_g", None)
        self.graph = Graph("mha", (  # everything the graph depends on: equal tokens, equal results
            self.Qd, self.Kd, self.Vd, self.mask_d, self.bias_d, weights, self.visibility,
            call.scale, call.H, call.H_kv, call.request.budget, call.request.threads,
            lazy.fan_in, rotation, call.compute_dtype, call.result_dtype, call.scores,
            checked.spec.mask, checked.spec.scores, call.spec.add_zero_attn, call.qk_norm,
            call.spec.clip_qkv, call.spec.v_norm,
        ))  # fmt: skip
        self.weights = weights
        self.w = self.graph.data("weights", weights)
        self.projected: dict[tuple[str, tuple[int, ...]], Any] = {}

    def build(self) -> Any:
        """The lazy output, chunked like the queries."""
        call, grid, graph = self.call, self.grid, self.graph
        extra = self._extra_keys() if call.extra else None
        parts_scores = None if call.scores is None else call.scores.without_sinks()
        for bb, batch in grid.batch_blocks():
            for i, rows in enumerate(grid.rows):
                if grid.one_pair:
                    self._block(bb, batch, i)
                    continue
                parts = self._parts(bb, batch, (i, rows), parts_scores)
                if extra is not None:  # bias_k's key and the zero key: seen by every real query
                    parts.append(self._extra_part(bb, batch, (i, rows), extra, parts_scores))
                shape = (*grid.block_shape(batch), call.H, rows.stop - rows.start, call.d_v)
                sinks = None if call.scores is None else call.scores.sinks
                gate = getattr(call.spec.output, "activation", None)
                output = Output(
                    shape, call.compute_dtype, call.result_dtype, call.request.threads, sinks, gate
                )
                last = graph.reduce(parts, (*bb, i), self.lazy.fan_in)
                rows_in = (self.Qd.name, *bb, i, 0) if gate is not None else None  # the gate's
                graph.task("out", (*bb, i, 0), mha_out, last, self.w, output, rows_in)
        chunks = (*grid.batch_chunks, grid.row_chunks, (call.weights.W_o.shape[1],))
        deps = [self.Qd, self.Kd, self.Vd, self.mask_d, self.bias_d]
        out = graph.array("out", chunks, call.result_dtype, deps, self.lazy.da)
        return out if self.lazy.batched else out[0]

    def _project(self, which: str, bb: tuple[int, ...], n: int, at: slice, batch: Any) -> Any:
        """The key of chunk ``n``'s projected queries (``"q"``) or keys and values (``"kv"``,
        one task: every part needs both)."""
        call = self.call
        if (which, (*bb, n)) not in self.projected:
            norm = call.qk_norm
            plan = Projection(
                which,
                call.H,
                call.H_kv,
                call.scale,
                call.compute_dtype,
                self.rotation.at(which, batch, at),
                call.request.threads,
                norm,
                call.spec.clip_qkv,
                call.spec.v_norm,
            )
            inputs = (
                [(self.Qd.name, *bb, n, 0)]
                if which == "q"
                else [(self.Kd.name, *bb, n, 0), (self.Vd.name, *bb, n, 0)]
            )
            self.projected[which, (*bb, n)] = self.graph.task(
                which, (*bb, n), project_chunk, inputs, self.w, plan
            )
        return self.projected[which, (*bb, n)]

    def _block(self, bb: tuple[int, ...], batch: Any, i: int) -> None:
        """The in-memory function on one batch block (one chunk of queries and of keys)."""
        masks, visibility = self.lazy.masks, self.visibility
        block = visibility.block(batch, slice(0, visibility.L), slice(0, visibility.S))
        lengths = MaskArrays(None, None, block.key_lengths, block.query_lengths)
        positions = self.rotation.block_positions(batch)
        checked = block_checked(self.checked, visibility, batch, lengths, positions)
        plan = MhaBlock(self.call.H, checked)
        self.graph.task(
            "out",
            (*bb, i, 0),
            mha_block,
            (self.Qd.name, *bb, 0, 0),
            (self.Kd.name, *bb, 0, 0),
            (self.Vd.name, *bb, 0, 0),
            masks.key(self.mask_d, bb, 0, 0),
            masks.key(self.bias_d, bb, 0, 0),
            self.w,
            plan,
        )

    def _parts(
        self, bb: tuple[int, ...], batch: Any, row: tuple[int, slice], scores: Any
    ) -> list[Any]:
        """Query chunk ``row = (i, rows)``'s parts over the key chunks its rows may see."""
        i, rows = row
        call, masks = self.call, self.lazy.masks
        q = self._project("q", bb, i, rows, batch)
        parts = []
        for j, cols in enumerate(self.grid.cols):
            block = self.visibility.block(batch, rows, cols)
            if block.sees_any():
                plan = Part(
                    block,
                    1.0,
                    call.request.budget,
                    call.request.threads,
                    call.compute_dtype,
                    scores,
                )
                parts.append(
                    self.graph.task(
                        "part",
                        (*bb, i, j),
                        part,
                        q,
                        self._project("kv", bb, j, cols, batch),
                        masks.key(self.mask_d, bb, i, j),
                        masks.key(self.bias_d, bb, i, j),
                        plan,
                    )
                )
        return parts

    def _extra_keys(self) -> Any:
        """bias_k's key and the zero key, one batch item: parts broadcast them."""
        call = self.call
        return self.graph.data(
            "extra",
            tuple(
                append_keys(
                    np.zeros((1, call.H_kv, 0, d), call.compute_dtype),
                    None if b is None else b.astype(call.compute_dtype),
                    call.spec.add_zero_attn,
                    call.H_kv,
                )
                for b, d in ((call.weights.bias_k, call.d_k), (call.weights.bias_v, call.d_v))
            ),
        )

    def _extra_part(
        self, bb: tuple[int, ...], batch: Any, row: tuple[int, slice], extra: Any, scores: Any
    ) -> Any:
        """The part of query chunk ``row`` over the extra keys: seen by every real query."""
        i, rows = row
        call = self.call
        rows_only = self.visibility.block(batch, rows, slice(0, 0))
        seen = Visibility(
            index_shape=rows_only.index_shape,
            L=rows_only.L,
            S=call.extra,
            query_lengths=rows_only.query_lengths,
        )
        plan = Part(
            seen, 1.0, call.request.budget, call.request.threads, call.compute_dtype, scores
        )
        q = self._project("q", bb, i, rows, batch)
        return self.graph.task(
            "part", (*bb, i, len(self.grid.cols)), part, q, extra, None, None, plan
        )
