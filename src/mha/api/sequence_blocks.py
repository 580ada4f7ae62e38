"""A plain layer call over many sequences, computed a block of sequences at a time.

A layer's call computes its q, k, v projection for every row, then the heads' attention,
then the output projection: each stage a pass over arrays as large as the input three
times over, which a batch of many short sequences (32 of 128 tokens, 256 features: issue
35's S3) reads and writes from memory between the stages. Here each worker takes a block
of whole sequences (``matmul_rows`` rows, or one sequence when it is longer) and computes
the layer for it from end to end while it is in cache: its rows' q, k, v in one product
into a buffer of the worker's own, the late scale and the biases on that buffer, the heads'
attention by the compiled forward walk reading the buffer's columns as they lie, and the
joined heads' output projection into the result's rows. Nothing but the result is as large
as the input (an input not C-contiguous is copied first), and no stage waits for the
others' workers. Measured on an AMD EPYC (Zen 4, two workers, S3, docs/benchmarks.md): 19.4
-> 17.8 ms in float32, 37.8 -> 35.3 in float64, the peak memory 25.0 -> 7.2 MiB in float32.

The same bits as the layer computed whole (:func:`.projection.compute`'s other path), for
the same ``workers``: the same weights (:func:`.qkv.qkv_weights`); the walk computes each
sequence's heads alone, on tiles that do not depend on the number of sequences; the scale
and the biases are the same operations on the same values; and a product's rows round as
the same rows of the whole path's products do where each product of both paths is one
OpenBLAS computes row by row alike (:func:`_products_alike`: two rows at least, beyond its
small-matrix kernels), which :func:`blocks_for` asks of every call it takes
(tests/test_sequence_blocks.py compares the two paths bit for bit, and a call refused for
it). A call the compiled walk leaves work undone in (a non-finite value at a hidden key)
is computed again the other way, which does it.

Only plain calls (:func:`plain_call`) over at least two blocks, as many for each worker
(or four for each at least): anything a sequence's rows depend on beyond its own (a mask,
padding, positions) is not cut per block here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from .._kernel import compiled, runtime, walk
from .._kernel.call import KernelCall, Outputs
from .._kernel.contract import Visibility
from .._kernel.forward import call_tiles
from .._kernel.team import Team, rows_per_task
from .checks import Call, Weights, plain_heads
from .gradients import split_heads
from .qkv import qkv_weights

__all__ = ["SequenceBlocks", "blocks_for", "forward_plan", "plain_call", "whole_call"]


def plain_call(call: Call) -> bool:
    """Whether a checked layer call is a plain one: self-attention without a cache, extra
    keys, sinks, soft-capping, ALiBi, QK-norm, key selection, dropout, output stage or
    anything but its output asked for, a float32 or float64 walk the compiled forward
    takes, a mask of the contract's rules alone (:mod:`.layer_plan` keeps the plan of a
    layer's plain call)."""
    visibility = call.visibility
    return (
        call.append is None
        and visibility is not None
        and visibility.mask_mod is None
        and call.self_attention
        and call.spec.selection is None
        and plain_heads(call)
        and call.compute_dtype.type in (np.float32, np.float64)  # (the compiled walk's)
        and compiled.walk_available()
    )


def whole_call(call: Call, sequences: int | None = None) -> tuple[KernelCall, Outputs]:
    """The kernel's call of ``call``'s attention and its outputs, on zeros of the projected
    heads' shapes (a plan keeps no array, only what the shapes decide); ``sequences``: of a
    block of that many sequences instead (its visibility cut to them)."""
    H, H_kv, dtype, lead = call.H, call.H_kv, call.compute_dtype, call.B
    visibility = call.visibility
    assert visibility is not None
    if sequences is not None:
        lead, visibility = (sequences,), replace(visibility, index_shape=(sequences, H))
    q = np.zeros((*lead, H, call.L, call.d_k), dtype)
    k = np.zeros((*lead, H_kv, call.S, call.d_k), dtype)
    v = np.zeros((*lead, H_kv, call.S, call.d_v), dtype)
    kernel = KernelCall(q, k, v, visibility, 1.0, budget=call.request.budget)
    return kernel, Outputs(np.zeros((*lead, H, call.L, call.d_v), dtype))


def forward_plan(kernel: KernelCall, outputs: Outputs, workers: int) -> walk.ForwardPlan:
    """The compiled forward walk's plan of ``kernel`` (:func:`whole_call`'s) on a team of
    ``workers``, on the tiles :func:`.forward.attend` gives it."""
    tuned = runtime.DEFAULT.thresholds
    tiles = call_tiles(kernel, outputs)
    return walk.ForwardPlan(kernel, tiles, workers, tuned.wide_below_rows, tuned.product_chunk)


_ALIKE = {
    "index_shape", "L", "S", "causal_offset", "bias_hides_keys", "causal", "window",
    "sink_tokens", "chunk", "held_sink_tokens", "ahead", "memo",
}  # fmt: skip
"""The fields of a :class:`Visibility` that are the same for every sequence (the others,
arrays and functions, may differ per sequence or position)."""


def _same_for_every_sequence(visibility: Visibility) -> bool:
    """Whether every sequence sees the same keys: the causal rule, a window, chunks, sink
    tokens, and no field besides (a mask, lengths, offsets, a ``mask_mod``: cut per block,
    it would not be the same call; a field added later counts as one until it is listed in
    :data:`_ALIKE`)."""
    return all(
        field.name in _ALIKE or getattr(visibility, field.name) is None
        for field in dataclasses.fields(visibility)
    )


SMALL_PRODUCT = 100**3
"""The multiply-adds up to which OpenBLAS may take a small-matrix kernel (its SkylakeX
build's ``gemm_small_kernel_permit``: ``M * N * K <= 100^3``), whose sums go in another order
than its blocked kernel's: below it, a product's rows round differently as part of fewer
rows, as they do for one row (``gemv``). Above it and from two rows, each row of a product
is the bits of that row of any product of more rows (measured on both kinds of kernel
tails). Without this rule, layers of 24 sequences of 64 tokens and 40 or 56 features, or
of 513 one-token sequences, gave other float32 bits by blocks than whole on the Zen 4
(tests/test_sequence_blocks.py checks that they are refused)."""


def _products_alike(call: Call, workers: int, together: int, count: int) -> bool:
    """Whether every product of ``call`` by blocks of ``together`` sequences (``count`` of
    them) and of the whole path's tasks (:meth:`.Team.matmul_heads` and :meth:`.Team.matmul`
    on ``workers``) has two rows at least and more than :data:`SMALL_PRODUCT` multiply-adds:
    then each row rounds alike in both, and the blocks give the whole path's bits."""
    sequences, L = math.prod(call.B), call.L
    n, step = sequences * L, rows_per_task(sequences * L, workers)
    blocks = {together * L, (sequences - (count - 1) * together) * L}
    if step >= L:  # the projection's tasks: whole sequences, or rows of one
        per = step // L
        projected = {per * L, sequences % per * L}
    else:
        projected = {step, L % step}
    output = {n} if n <= step else {step, n % step}
    width = call.H * call.d_k + call.H_kv * (call.d_k + call.d_v)
    return all(
        rows == 0 or (rows >= 2 and rows * N * K > SMALL_PRODUCT)
        for group, N, K in (
            (blocks | projected, width, call.Q.shape[-1]),
            (blocks | output, call.weights.W_o.shape[1], call.H * call.d_v),
        )
        for rows in group
    )


class SequenceBlocks:
    """A plain call's blocks of sequences and their walks' plans (:func:`blocks_for`);
    called with the call, its weights in its compute dtype and the team, it gives the
    output ``(*B, L, width)`` in the compute dtype, or ``None`` when a walk left work
    undone, or when q, k and v are not one product's (the caller then computes the call
    the other way)."""

    def __init__(self, call: Call, together: int, plans: dict[int, walk.ForwardPlan]) -> None:
        self.together, self.plans = together, plans
        self.sequences = math.prod(call.B)

    def __call__(self, call: Call, w: Weights, team: Team) -> np.ndarray | None:
        dtype, H, L, scale = call.compute_dtype, call.H, call.L, call.scale
        sequences, together, plans = self.sequences, self.together, self.plans
        X = call.Q.reshape(sequences * L, call.Q.shape[-1])
        weights = qkv_weights(call, w, sequences * L)
        if weights.joined is None:  # (weights of their own for each of q, k, v)
            return None
        (W_qkv, b_qkv), (W_o, b_o) = weights.joined, (w.W_o, w.b_o)
        cuts = list(itertools.accumulate((h * d for h, d in weights.heads), initial=0))
        out = np.empty((sequences * L, W_o.shape[1]), np.result_type(dtype, W_o))
        undone = [False]
        one = Team(1)  # (not entered: the walk runs in the worker's own thread)

        def make_worker() -> Callable[[int], None]:
            product = np.empty((together * L, W_qkv.shape[1]), dtype)
            joined = np.empty((together, L, H * call.d_v), dtype)

            def block(s0: int) -> None:
                if undone[0]:  # (the call is computed the other way)
                    return
                n = min(together, sequences - s0)
                rows = slice(s0 * L, (s0 + n) * L)
                qkv = product[: n * L]
                np.matmul(X[rows].astype(dtype, copy=False), W_qkv, out=qkv)
                if b_qkv is not None:
                    qkv += b_qkv
                if weights.late_scale:
                    np.multiply(qkv[:, : cuts[1]], scale, out=qkv[:, : cuts[1]])
                q, k, v = (
                    qkv[:, a:b].reshape(n, L, h, d).swapaxes(1, 2)
                    for a, b, (h, d) in zip(cuts[:-1], cuts[1:], weights.heads, strict=True)
                )
                heads = joined[:n]
                heads.fill(0)  # (a row that sees no key is zeros, as the other way leaves it)
                if plans[n].run([q, k, v, split_heads(heads, H)], k, one)[0].any():
                    undone[0] = True  # every block still done: the call is computed again
                    return
                np.matmul(heads.reshape(n * L, -1), W_o, out=out[rows])
                if b_o is not None:
                    out[rows] += b_o

            return block

        team.run(range(0, sequences, together), make_worker)
        if undone[0]:
            return None
        return out.reshape(*call.B, L, W_o.shape[1])


def blocks_for(call: Call, workers: int) -> SequenceBlocks | None:
    """The blocks of a checked layer ``call`` computed on ``workers``, or ``None`` when it
    is not computed by blocks (:mod:`.sequence_blocks`)."""
    sequences, L = math.prod(call.B), call.L
    tuned = runtime.DEFAULT.thresholds
    if sequences < 2 or sequences * L < workers * tuned.matmul_rows or call.rotary is not None:
        return None
    visibility = call.visibility
    if not plain_call(call) or visibility is None or not _same_for_every_sequence(visibility):
        return None
    together = min(max(1, tuned.matmul_rows // L), -(-sequences // workers))
    count = -(-sequences // together)
    if count < 2 or (count % workers and count < 4 * workers):
        return None  # (too few blocks to share evenly)
    few_rows = sequences * L < call.Q.shape[-1]  # (then one product only of joined weights)
    if few_rows and call.weights.in_dtype(call.compute_dtype).joined() is None:
        return None  # (q, k and v each their own product: :func:`.qkv.qkv_weights`)
    if not _products_alike(call, workers, together, count):
        return None
    shapes = (call.H_kv, L, call.S, call.d_k, call.d_v, call.compute_dtype)
    key = ("sequence blocks", visibility, shapes, call.request.budget, workers, together)
    kept: Any = runtime.DEFAULT.plans.get(key)  # (the plans: a millisecond a call)
    if kept is None:
        kept = _plans(call, together, count) or False
        runtime.DEFAULT.plans.keep(key, kept)
    if not kept:
        return None
    return SequenceBlocks(call, together, kept)


def _plans(call: Call, together: int, count: int) -> dict[int, walk.ForwardPlan] | None:
    """The walks' plans of ``call``'s blocks of ``together`` sequences (and of the last,
    when it has fewer; the tiles do not depend on the number of sequences: the whole
    call's); ``None`` when the compiled walk would not take the whole call."""
    if walk.forward_walkable(*whole_call(call)) is None:
        return None
    last = math.prod(call.B) - (count - 1) * together
    return {n: forward_plan(*whole_call(call, n), 1) for n in {together, last}}
