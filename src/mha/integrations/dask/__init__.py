"""Attention over Dask arrays: parallel over the batch, and over the sequence through the
log-sum-exp merge. The public path is :mod:`mha.dask`.

The functions take the in-memory functions' arguments, check them the same way when the
graph is built (raising the same errors), and return a lazy ``dask.array`` chunked like the
queries. The graph, per block of the batch, with the queries cut into chunks ``i`` and the
keys into chunks ``j``:

* ``weights``: one node holding the projection weights, sent to the cluster once;
* ``q[i]``, ``k[j]``, ``v[j]``: each chunk's projected heads (:func:`multi_head_attention`);
* ``part[i, j]``: the ``(out, lse)`` of query chunk ``i`` over key chunk ``j``, computed by
  the in-memory kernel, only for the pairs in which some query may see some key: the causal
  mask and the window skip the others (about half the pairs for a causal mask);
* ``merge``: the parts of one query chunk combined by their log-sum-exp
  (:func:`mha.merge_attention`), ``split_every`` at a time, a tree of depth
  ``log(key chunks)``;
* ``out[i]``: the heads joined and projected by ``W_o``.

No task holds more than one chunk of keys and values, or more than one chunk pair's scores.
With one chunk along the queries and one along the keys, each batch block is one task: the
in-memory function on that block, with no communication.

The package: the two functions here build the graph; ``inputs`` checks and reads what they
are given, ``graph`` cuts the scores into chunks and holds the tasks, ``tasks`` holds the
functions the workers run (plain module-level functions and data, as they travel).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._arrays import flag, resolve_scale
from ..._kernel.contract import Visibility
from ...api import checks
from ...api.projection import append_keys
from ...api.variants import check_scores
from .graph import Graph, Grid
from .inputs import (
    Masks,
    Rotation,
    check_fan_in,
    import_dask,
    lazy_or_array,
    refuse_in_memory_only,
    small,
    standin,
    with_batch_axis,
)
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

__all__ = ["multi_head_attention", "scaled_dot_product_attention"]

SPLIT_EVERY = 4
"""Parts merged by one task of the tree reduction."""


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: bool = False,
    causal_alignment: str | None = None,
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    window: int | None = None,
    sink_tokens: int | None = None,
    chunk: int | None = None,
    mask_mod: Any = None,
    sinks: Any = None,
    softcap: float | None = None,
    alibi: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    scale: float | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_backward: bool = False,
    dropout_p: float | None = None,
    generator: np.random.Generator | None = None,
    cache: Any = None,
    max_memory: int | None = None,
    workers: int | None = 1,
    split_every: int = SPLIT_EVERY,
) -> Any:
    """:func:`mha.scaled_dot_product_attention` over ``dask.array`` inputs, lazily.

    ``q (..., H, L, d_k)``, ``k (..., H_kv, S, d_k)``, ``v (..., H_kv, S, d_v)``: Dask or
    NumPy arrays (NumPy ones are wrapped). The batch axes follow ``q``'s chunks, the key
    positions ``k``'s; the head and width axes are taken whole (rechunked if cut). ``mask``
    and ``bias`` may be Dask arrays, cut like the scores; ``key_lengths`` and
    ``query_lengths`` are small and read when the graph is built. Every other argument is
    the in-memory function's, the variants included (sinks are added once, after the
    merge; ``mask_mod`` and ``score_mod`` see the call's indices in every chunk).
    ``workers`` counts threads inside each task (default 1: Dask runs tasks in parallel);
    ``split_every`` is the merge tree's fan-in. ``return_weights``, ``return_backward``,
    dropout and ``cache`` are in-memory only.

    Returns the lazy output ``(..., H, L, d_v)`` chunked like ``q``, and with
    ``return_lse=True`` the lazy log-sum-exp ``(..., H, L)`` too.

    >>> import numpy as np, dask.array as da, mha, mha.dask
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 1, 2, 64, 8))
    >>> lazy = mha.dask.scaled_dot_product_attention(
    ...     da.from_array(q, chunks=(1, 2, 16, 8)), da.from_array(k, chunks=(1, 2, 32, 8)),
    ...     v, causal=True)
    >>> lazy.chunks[-2]
    (16, 16, 16, 16)
    >>> exact = mha.scaled_dot_product_attention(q, k, v, causal=True)
    >>> bool(np.allclose(lazy.compute(scheduler="sync"), exact, rtol=1e-13, atol=1e-15))
    True
    """
    da = import_dask()
    lazy = {name: lazy_or_array(name, x, da) for name, x in (("q", q), ("k", k), ("v", v))}
    standins = [standin(x) for x in lazy.values()]
    sq, sk, sv, result_dtype, compute_dtype = checks.checked_heads(*standins)
    scale = resolve_scale(scale, sq.shape[-1], compute_dtype)
    budget, threads = checks.kernel_options(max_memory, workers)
    # what only memory offers, refused by name before the in-memory checks of what it needs
    refuse_in_memory_only(return_weights, return_backward, dropout_p, generator, cache)
    batch_shape, H, L, S = sq.shape[:-3], sq.shape[-3], sq.shape[-2], sk.shape[-2]
    masks = Masks.check(mask, bias, da).fit_scores(batch_shape, H, L, S)
    causal = flag("causal", causal)
    visibility = Visibility.build(
        batch_shape=batch_shape, H=H, L=L, S=S, causal=causal or masks.causal,
        causal_alignment=causal_alignment, key_lengths=small("key_lengths", key_lengths),
        query_lengths=small("query_lengths", query_lengths), window=window,
        sink_tokens=sink_tokens, chunk=chunk, mask_mod=mask_mod, dtype=compute_dtype,
        context=f"q {sq.shape}, k {sk.shape}",
    )  # fmt: skip
    scores = check_scores(
        sinks=sinks, softcap=softcap, alibi=alibi, score_mod=score_mod,
        score_mod_grad=score_mod_grad, H=H, want_backward=False,
    )  # fmt: skip
    variants = variant_keywords(sink_tokens, chunk, mask_mod, sinks, softcap, alibi, score_mod)
    want_lse = flag("return_lse", return_lse)
    fan_in = check_fan_in(split_every)

    batched = len(batch_shape) > 0
    arrays = {name: x if batched else x[None] for name, x in lazy.items()}
    visibility = visibility if batched else with_batch_axis(visibility)
    grid = Grid.of(arrays["q"], arrays["k"], arrays["v"], H, heads_axis=True)
    parts_scores = None if scores is None else scores.without_sinks()
    qd, kd, vd = (
        grid.fit(arrays["q"], "rows", da),
        grid.fit(arrays["k"], "cols", da),
        grid.fit(arrays["v"], "cols", da),
    )
    mask_d, bias_d = masks.fit(grid, batched)
    graph = Graph("mha-sdpa", (qd, kd, vd, mask_d, bias_d, visibility, scale, budget, threads,
                                fan_in, want_lse, causal, causal_alignment, window,
                                compute_dtype, result_dtype, scores, variants))  # fmt: skip
    d_v = sv.shape[-1]
    for bb, batch in grid.batch_blocks():
        for i, rows in enumerate(grid.rows):
            index = (*bb, 0, i, 0)
            if grid.one_pair:  # the in-memory call on this block
                call = SdpaBlock(
                    masks=masks.block_keywords(causal, causal_alignment, window, visibility,
                                               batch),
                    scale=scale, budget=budget, threads=threads,
                    variants=in_block(variants, visibility, batch),
                )  # fmt: skip
                key = graph.task(
                    "block", (*bb, i), sdpa_block, (qd.name, *index), (kd.name, *bb, 0, 0, 0),
                    (vd.name, *bb, 0, 0, 0), masks.key(mask_d, bb, i, 0),
                    masks.key(bias_d, bb, i, 0), call,
                )  # fmt: skip
            else:
                parts = []
                for j, cols in enumerate(grid.cols):
                    block = visibility.block(batch, rows, cols)
                    if block.sees_any():
                        plan = Part(block, scale, budget, threads, compute_dtype, parts_scores)
                        parts.append(graph.task(
                            "part", (*bb, i, j), part, (qd.name, *index),
                            [(kd.name, *bb, 0, j, 0), (vd.name, *bb, 0, j, 0)],
                            masks.key(mask_d, bb, i, j), masks.key(bias_d, bb, i, j), plan,
                        ))  # fmt: skip
                shape = (*grid.block_shape(batch), H, rows.stop - rows.start, d_v)
                last = graph.reduce(parts, (*bb, i), fan_in)
                empty = Empty(shape, compute_dtype, None if scores is None else scores.sinks)
                key = graph.task("merged", (*bb, i), merge, last, empty)
            graph.task("out", index, sdpa_out, key, result_dtype)
            if want_lse:
                graph.task("lse", index[:-1], lse_out, key)
    out_chunks = (*grid.batch_chunks, (H,), grid.row_chunks, (d_v,))
    out = graph.array("out", out_chunks, result_dtype, [qd, kd, vd, mask_d, bias_d], da)
    if not batched:
        out = out[0]
    if not want_lse:
        return out
    lse = graph.array("lse", out_chunks[:-1], compute_dtype, [qd, kd, vd, mask_d, bias_d], da)
    return out, (lse if batched else lse[0])


def multi_head_attention(
    Q: Any,
    K: Any,
    V: Any,
    W_q: Any,
    W_k: Any,
    W_v: Any,
    W_o: Any,
    num_heads: int,
    *,
    mask: Any = None,
    causal: bool = False,
    causal_alignment: str | None = None,
    key_lengths: Any = None,
    query_lengths: Any = None,
    bias: Any = None,
    b_q: Any = None,
    b_k: Any = None,
    b_v: Any = None,
    b_o: Any = None,
    scale: float | None = None,
    return_weights: bool = False,
    max_memory: int | None = None,
    workers: int | None = 1,
    bias_k: Any = None,
    bias_v: Any = None,
    add_zero_attn: bool = False,
    num_kv_heads: int | None = None,
    window: int | None = None,
    sink_tokens: int | None = None,
    chunk: int | None = None,
    mask_mod: Any = None,
    sinks: Any = None,
    softcap: float | None = None,
    alibi: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    rope_theta: float | None = None,
    rotary_dim: int | None = None,
    rotary_interleaved: bool = False,
    positions: Any = None,
    cache: Any = None,
    return_backward: bool = False,
    dropout_p: float | None = None,
    generator: np.random.Generator | None = None,
    split_every: int = SPLIT_EVERY,
) -> Any:
    """:func:`mha.multi_head_attention` over ``dask.array`` inputs, lazily.

    ``Q (B, L, d_q)``, ``K (B, S, d_kin)``, ``V (B, S, d_vin)`` (or unbatched ``(L, d)``):
    Dask or NumPy arrays (NumPy ones are wrapped). The batch follows ``Q``'s chunks and the
    key positions ``K``'s; the feature axis is taken whole (rechunked if cut). The weights
    are NumPy arrays, sent to the cluster once. ``mask`` and ``bias`` may be Dask arrays,
    cut like the scores; ``key_lengths``, ``query_lengths`` and ``positions`` are small and
    read when the graph is built. Every other argument is the in-memory function's, but for
    ``rope_scaling`` and QK-norm (``q_norm``, ...), in-memory only. ``workers`` counts
    threads inside each task (default 1: Dask runs tasks in parallel);
    ``split_every`` is the merge tree's fan-in. ``return_weights``, ``return_backward``,
    dropout and ``cache`` are in-memory only.

    Returns the lazy ``(B, L, d_out)`` (``(L, d_out)`` unbatched), chunked like ``Q``.

    >>> import numpy as np, dask.array as da, mha, mha.dask
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((2, 64, 16))
    >>> W_q, W_k, W_v, W_o = rng.standard_normal((4, 16, 16))
    >>> lazy = mha.dask.multi_head_attention(
    ...     da.from_array(X, chunks=(1, 16, 16)), X, X, W_q, W_k, W_v, W_o, 4, causal=True)
    >>> lazy.chunks
    ((1, 1), (16, 16, 16, 16), (16,))
    >>> exact = mha.multi_head_attention(X, X, X, W_q, W_k, W_v, W_o, 4, causal=True)
    >>> bool(np.allclose(lazy.compute(scheduler="sync"), exact, rtol=1e-13, atol=1e-13))
    True
    """
    da = import_dask()
    self_attention = Q is K is V
    lazy = {name: lazy_or_array(name, x, da) for name, x in (("Q", Q), ("K", K), ("V", V))}
    sQ, sK, sV = (standin(x) for x in lazy.values())
    if self_attention:
        sK = sV = sQ
    # what only memory offers, refused by name before the in-memory checks of what it needs
    refuse_in_memory_only(return_weights, return_backward, dropout_p, generator, cache)
    masking = checks.masking(  # the mask and the bias are checked by Masks, after
        True if isinstance(mask, (bool, np.bool_)) and mask else None, causal, causal_alignment,
        small("key_lengths", key_lengths), small("query_lengths", query_lengths), None, window,
        sink_tokens, chunk, mask_mod,
    )  # fmt: skip
    call = checks.check_call(
        sQ, sK, sV, W_q, W_k, W_v, W_o, num_heads, masking, b_q=b_q, b_k=b_k, b_v=b_v,
        b_o=b_o, scale=scale, return_weights=return_weights, max_memory=max_memory,
        workers=workers,
        bias_k=bias_k, bias_v=bias_v, add_zero_attn=add_zero_attn, num_kv_heads=num_kv_heads,
        rope_theta=rope_theta, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
        positions=small("positions", positions), cache=cache, return_backward=return_backward,
        dropout_p=dropout_p, generator=generator, sinks=sinks, softcap=softcap, alibi=alibi,
        score_mod=score_mod, score_mod_grad=score_mod_grad,
    )  # fmt: skip
    H, B, L, S = call.H, call.B, call.L, call.S
    variants = variant_keywords(sink_tokens, chunk, mask_mod, sinks, softcap, alibi, score_mod)
    parts_scores = None if call.scores is None else call.scores.without_sinks()
    masks = Masks.check(mask, bias, da).fit_scores(B, H, L, S)
    causal = flag("causal", causal)
    fan_in = check_fan_in(split_every)
    assert call.visibility is not None  # no cache
    rotation = Rotation.check(call, positions)

    batched = len(B) > 0
    arrays = {name: x if batched else x[None] for name, x in lazy.items()}
    visibility = call.visibility if batched else with_batch_axis(call.visibility)
    grid = Grid.of(arrays["Q"], arrays["K"], arrays["V"], H, heads_axis=False)
    Qd = grid.fit(arrays["Q"], "rows", da)
    Kd = Qd if self_attention else grid.fit(arrays["K"], "cols", da)
    Vd = Qd if self_attention else grid.fit(arrays["V"], "cols", da)
    mask_d, bias_d = masks.fit(grid, batched)
    weights = {name: getattr(call.weights, name) for name in WEIGHT_NAMES}
    graph = Graph("mha", (  # everything the graph depends on: equal tokens, equal results
        Qd, Kd, Vd, mask_d, bias_d, weights, visibility, call.scale, call.H, call.H_kv,
        call.budget, call.threads, fan_in, rotation, call.add_zero_attn, call.compute_dtype,
        call.result_dtype, causal, causal_alignment, window, num_kv_heads, call.scores, variants,
    ))  # fmt: skip
    w = graph.data("weights", weights)
    if call.extra:  # bias_k's key and the zero key, one batch item: parts broadcast them
        extra_kv = graph.data("extra", tuple(
            append_keys(
                np.zeros((1, call.H_kv, 0, d), call.compute_dtype),
                None if b is None else b.astype(call.compute_dtype), call.add_zero_attn, call.H_kv,
            ) for b, d in ((call.weights.bias_k, call.d_k), (call.weights.bias_v, call.d_v))
        ))  # fmt: skip
    d_out = call.weights.W_o.shape[1]
    projected: dict[tuple[str, tuple[int, ...]], Any] = {}

    def project(which: str, bb: tuple[int, ...], n: int, at: slice, batch: Any) -> Any:
        """The key of chunk ``n``'s projected queries (``"q"``) or keys and values
        (``"kv"``, one task: every part needs both)."""
        if (which, (*bb, n)) not in projected:
            plan = Projection(which, call.H, call.H_kv, call.scale, call.compute_dtype,
                               rotation.at(which, batch, at), call.threads)  # fmt: skip
            inputs = [(Qd.name, *bb, n, 0)] if which == "q" else [
                (Kd.name, *bb, n, 0), (Vd.name, *bb, n, 0)]  # fmt: skip
            projected[which, (*bb, n)] = graph.task(which, (*bb, n), project_chunk, inputs, w, plan)
        return projected[which, (*bb, n)]

    for bb, batch in grid.batch_blocks():
        for i, rows in enumerate(grid.rows):
            if grid.one_pair:  # the in-memory call on this block
                plan_block = MhaBlock(
                    num_heads=call.H, scale=call.scale,
                    keywords={
                        **masks.block_keywords(causal, causal_alignment, window, visibility,
                                               batch),
                        "num_kv_heads": num_kv_heads, "rope_theta": rope_theta,
                        "rotary_dim": rotary_dim, "rotary_interleaved": rotary_interleaved,
                        "positions": rotation.block_positions(batch),
                        "add_zero_attn": call.add_zero_attn, "max_memory": call.budget,
                        "workers": call.threads, **in_block(variants, visibility, batch),
                    },
                )  # fmt: skip
                graph.task("out", (*bb, i, 0), mha_block, (Qd.name, *bb, 0, 0),
                             (Kd.name, *bb, 0, 0), (Vd.name, *bb, 0, 0),
                             masks.key(mask_d, bb, 0, 0), masks.key(bias_d, bb, 0, 0), w,
                             plan_block)  # fmt: skip
                continue
            q = project("q", bb, i, rows, batch)
            parts = []
            for j, cols in enumerate(grid.cols):
                block = visibility.block(batch, rows, cols)
                if block.sees_any():
                    plan = Part(block, 1.0, call.budget, call.threads, call.compute_dtype,
                                parts_scores)  # fmt: skip
                    parts.append(graph.task(
                        "part", (*bb, i, j), part, q, project("kv", bb, j, cols, batch),
                        masks.key(mask_d, bb, i, j), masks.key(bias_d, bb, i, j), plan,
                    ))  # fmt: skip
            if call.extra:  # bias_k's key and the zero key: seen by every real query
                rows_only = visibility.block(batch, rows, slice(0, 0))
                extra = Visibility(
                    index_shape=rows_only.index_shape, L=rows_only.L, S=call.extra,
                    query_lengths=rows_only.query_lengths,
                )  # fmt: skip
                plan = Part(extra, 1.0, call.budget, call.threads, call.compute_dtype,
                            parts_scores)  # fmt: skip
                parts.append(graph.task("part", (*bb, i, len(grid.cols)), part, q, extra_kv,
                                        None, None, plan))  # fmt: skip
            shape = (*grid.block_shape(batch), H, rows.stop - rows.start, call.d_v)
            output = Output(shape, call.compute_dtype, call.result_dtype, call.threads,
                            None if call.scores is None else call.scores.sinks)  # fmt: skip
            last = graph.reduce(parts, (*bb, i), fan_in)  # the output task merges the last few
            graph.task("out", (*bb, i, 0), mha_out, last, w, output)
    chunks = (*grid.batch_chunks, grid.row_chunks, (d_out,))
    out = graph.array("out", chunks, call.result_dtype, [Qd, Kd, Vd, mask_d, bias_d], da)
    return out if batched else out[0]


def variant_keywords(
    sink_tokens: Any, chunk: Any, mask_mod: Any, sinks: Any, softcap: Any, alibi: Any,
    score_mod: Any,
) -> dict[str, Any]:  # fmt: skip
    """The variants' keywords as a one-chunk call passes them to the in-memory function."""
    return {"sink_tokens": sink_tokens, "chunk": chunk, "mask_mod": mask_mod, "sinks": sinks,
            "softcap": softcap, "alibi": alibi, "score_mod": score_mod}  # fmt: skip


def in_block(variants: dict[str, Any], visibility: Visibility, batch: Any) -> dict[str, Any]:
    """The variants' keywords for the in-memory call on one batch block: its ``mask_mod``
    and ``score_mod`` see the call's sequence numbers, not the block's."""
    given = {name: value for name, value in variants.items() if value is not None}
    block = visibility.block(batch, slice(0, 0), slice(0, 0))
    sequences = None if block.sequences is None else block.sequences.reshape(-1)
    for name, score in (("mask_mod", False), ("score_mod", True)):
        if name in given and sequences is not None:
            given[name] = InBlock(given[name], sequences, score)
    return given
