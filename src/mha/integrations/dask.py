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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import functional
from .._arrays import as_array, as_float_array, flag, positive_int, resolve_scale
from .._kernel.contract import Visibility, fit_to_scores, split_mask
from .._kernel.forward import attend, merge_partials
from .._kernel.team import Team, workers_for
from ..errors import AttentionValueError
from ..rotary import apply_rotary, check_rotary

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
    scale: float | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_backward: bool = False,
    dropout_p: float = 0.0,
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
    the in-memory function's. ``workers`` counts threads inside each task (default 1: Dask
    runs tasks in parallel); ``split_every`` is the merge tree's fan-in.
    ``return_weights``, ``return_backward``, dropout and ``cache`` are in-memory only.

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
    da = _dask()
    lazy = {name: _lazy_or_array(name, x, da) for name, x in (("q", q), ("k", k), ("v", v))}
    standins = [_standin(x) for x in lazy.values()]
    sq, sk, sv, result_dtype, compute_dtype = functional._checked_heads(*standins)
    scale = resolve_scale(scale, sq.shape[-1], compute_dtype)
    budget, threads = functional._kernel_options(return_weights, max_memory, workers)
    functional._dropout_p(dropout_p, generator)
    batch_shape, H, L, S = sq.shape[:-3], sq.shape[-3], sq.shape[-2], sk.shape[-2]
    masks = _Masks.check(mask, bias, da).fit_scores(batch_shape, H, L, S)
    causal = flag("causal", causal)
    visibility = Visibility.build(
        batch_shape=batch_shape, H=H, L=L, S=S, causal=causal or masks.causal,
        causal_alignment=causal_alignment, key_lengths=_small("key_lengths", key_lengths),
        query_lengths=_small("query_lengths", query_lengths), window=window,
        dtype=compute_dtype, context=f"q {sq.shape}, k {sk.shape}",
    )  # fmt: skip
    want_lse = flag("return_lse", return_lse)
    _refuse_in_memory_only(return_weights, return_backward, dropout_p, generator, cache)
    fan_in = _fan_in(split_every)

    batched = len(batch_shape) > 0
    arrays = {name: x if batched else x[None] for name, x in lazy.items()}
    visibility = visibility if batched else _with_batch_axis(visibility)
    grid = _Grid.of(arrays["q"], arrays["k"], arrays["v"], H, heads_axis=True)
    qd, kd, vd = (
        grid.fit(arrays["q"], "rows", da),
        grid.fit(arrays["k"], "cols", da),
        grid.fit(arrays["v"], "cols", da),
    )
    mask_d, bias_d = masks.fit(grid, batched)
    graph = _Graph("mha-sdpa", (qd, kd, vd, mask_d, bias_d, visibility, scale, budget, threads,
                                fan_in, want_lse, causal, causal_alignment, window,
                                compute_dtype, result_dtype))  # fmt: skip
    d_v = sv.shape[-1]
    for bb, batch in grid.batch_blocks():
        for i, rows in enumerate(grid.rows):
            index = (*bb, 0, i, 0)
            if grid.one_pair:  # the in-memory call on this block
                call = _SdpaBlock(
                    masks=masks.block_keywords(causal, causal_alignment, window, visibility,
                                               batch),
                    scale=scale, budget=budget, threads=threads,
                )  # fmt: skip
                key = graph.task(
                    "block", (*bb, i), _sdpa_block, (qd.name, *index), (kd.name, *bb, 0, 0, 0),
                    (vd.name, *bb, 0, 0, 0), masks.key(mask_d, bb, i, 0),
                    masks.key(bias_d, bb, i, 0), call,
                )  # fmt: skip
            else:
                parts = []
                for j, cols in enumerate(grid.cols):
                    block = visibility.block(batch, rows, cols)
                    if block.sees_any():
                        plan = _Part(block, scale, budget, threads, compute_dtype)
                        parts.append(graph.task(
                            "part", (*bb, i, j), _part, (qd.name, *index),
                            [(kd.name, *bb, 0, j, 0), (vd.name, *bb, 0, j, 0)],
                            masks.key(mask_d, bb, i, j), masks.key(bias_d, bb, i, j), plan,
                        ))  # fmt: skip
                shape = (*grid.block_shape(batch), H, rows.stop - rows.start, d_v)
                last = graph.reduce(parts, (*bb, i), fan_in)
                key = graph.task("merged", (*bb, i), _merge, last, _Empty(shape, compute_dtype))
            graph.task("out", index, _sdpa_out, key, result_dtype)
            if want_lse:
                graph.task("lse", index[:-1], _lse_out, key)
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
    rope_theta: float | None = None,
    rotary_dim: int | None = None,
    rotary_interleaved: bool = False,
    positions: Any = None,
    cache: Any = None,
    return_backward: bool = False,
    dropout_p: float = 0.0,
    generator: np.random.Generator | None = None,
    split_every: int = SPLIT_EVERY,
) -> Any:
    """:func:`mha.multi_head_attention` over ``dask.array`` inputs, lazily.

    ``Q (B, L, d_q)``, ``K (B, S, d_kin)``, ``V (B, S, d_vin)`` (or unbatched ``(L, d)``):
    Dask or NumPy arrays (NumPy ones are wrapped). The batch follows ``Q``'s chunks and the
    key positions ``K``'s; the feature axis is taken whole (rechunked if cut). The weights
    are NumPy arrays, sent to the cluster once. ``mask`` and ``bias`` may be Dask arrays,
    cut like the scores; ``key_lengths``, ``query_lengths`` and ``positions`` are small and
    read when the graph is built. Every other argument is the in-memory function's.
    ``workers`` counts threads inside each task (default 1: Dask runs tasks in parallel);
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
    da = _dask()
    self_attention = Q is K is V
    lazy = {name: _lazy_or_array(name, x, da) for name, x in (("Q", Q), ("K", K), ("V", V))}
    sQ, sK, sV = (_standin(x) for x in lazy.values())
    if self_attention:
        sK = sV = sQ
    masking = functional._masking(  # the mask and the bias are checked by _Masks, after
        True if isinstance(mask, (bool, np.bool_)) and mask else None, causal, causal_alignment,
        _small("key_lengths", key_lengths), _small("query_lengths", query_lengths), None, window,
    )  # fmt: skip
    call = functional._check_call(
        sQ, sK, sV, W_q, W_k, W_v, W_o, num_heads, masking, b_q=b_q, b_k=b_k, b_v=b_v,
        b_o=b_o, scale=scale, return_weights=return_weights, max_memory=max_memory,
        workers=workers,
        bias_k=bias_k, bias_v=bias_v, add_zero_attn=add_zero_attn, num_kv_heads=num_kv_heads,
        rope_theta=rope_theta, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
        positions=_small("positions", positions), cache=cache, return_backward=return_backward,
        dropout_p=dropout_p, generator=generator,
    )  # fmt: skip
    _refuse_in_memory_only(return_weights, return_backward, dropout_p, generator, cache)
    H, B, L, S = call.H, call.B, call.L, call.S
    masks = _Masks.check(mask, bias, da).fit_scores(B, H, L, S)
    causal = flag("causal", causal)
    fan_in = _fan_in(split_every)
    assert call.visibility is not None  # no cache
    rotation = _Rotation.check(call, positions)

    batched = len(B) > 0
    arrays = {name: x if batched else x[None] for name, x in lazy.items()}
    visibility = call.visibility if batched else _with_batch_axis(call.visibility)
    grid = _Grid.of(arrays["Q"], arrays["K"], arrays["V"], H, heads_axis=False)
    Qd = grid.fit(arrays["Q"], "rows", da)
    Kd = Qd if self_attention else grid.fit(arrays["K"], "cols", da)
    Vd = Qd if self_attention else grid.fit(arrays["V"], "cols", da)
    mask_d, bias_d = masks.fit(grid, batched)
    weights = {name: getattr(call, name) for name in WEIGHT_NAMES}
    graph = _Graph("mha", (  # everything the graph depends on: equal tokens, equal results
        Qd, Kd, Vd, mask_d, bias_d, weights, visibility, call.scale, call.H, call.H_kv,
        call.budget, call.threads, fan_in, rotation, call.add_zero_attn, call.compute_dtype,
        call.result_dtype, causal, causal_alignment, window, num_kv_heads,
    ))  # fmt: skip
    w = graph.data("weights", weights)
    if call.extra:  # bias_k's key and the zero key, one batch item: parts broadcast them
        extra_kv = graph.data("extra", tuple(
            functional._append_keys(
                np.zeros((1, call.H_kv, 0, d), call.compute_dtype),
                None if b is None else b.astype(call.compute_dtype), call.add_zero_attn, call.H_kv,
            ) for b, d in ((call.bias_k, call.d_k), (call.bias_v, call.d_v))
        ))  # fmt: skip
    d_out = call.W_o.shape[1]
    projected: dict[tuple[str, tuple[int, ...]], Any] = {}

    def project(which: str, bb: tuple[int, ...], n: int, at: slice, batch: Any) -> Any:
        """The key of chunk ``n``'s projected queries (``"q"``) or keys and values
        (``"kv"``, one task: every part needs both)."""
        if (which, (*bb, n)) not in projected:
            plan = _Projection(which, call.H, call.H_kv, call.scale, call.compute_dtype,
                               rotation.at(which, batch, at), call.threads)  # fmt: skip
            inputs = [(Qd.name, *bb, n, 0)] if which == "q" else [
                (Kd.name, *bb, n, 0), (Vd.name, *bb, n, 0)]  # fmt: skip
            projected[which, (*bb, n)] = graph.task(which, (*bb, n), _project, inputs, w, plan)
        return projected[which, (*bb, n)]

    for bb, batch in grid.batch_blocks():
        for i, rows in enumerate(grid.rows):
            if grid.one_pair:  # the in-memory call on this block
                plan_block = _MhaBlock(
                    num_heads=call.H, scale=call.scale,
                    keywords={
                        **masks.block_keywords(causal, causal_alignment, window, visibility,
                                               batch),
                        "num_kv_heads": num_kv_heads, "rope_theta": rope_theta,
                        "rotary_dim": rotary_dim, "rotary_interleaved": rotary_interleaved,
                        "positions": rotation.block_positions(batch),
                        "add_zero_attn": call.add_zero_attn, "max_memory": call.budget,
                        "workers": call.threads,
                    },
                )  # fmt: skip
                graph.task("out", (*bb, i, 0), _mha_block, (Qd.name, *bb, 0, 0),
                             (Kd.name, *bb, 0, 0), (Vd.name, *bb, 0, 0),
                             masks.key(mask_d, bb, 0, 0), masks.key(bias_d, bb, 0, 0), w,
                             plan_block)  # fmt: skip
                continue
            q = project("q", bb, i, rows, batch)
            parts = []
            for j, cols in enumerate(grid.cols):
                block = visibility.block(batch, rows, cols)
                if block.sees_any():
                    plan = _Part(block, 1.0, call.budget, call.threads, call.compute_dtype)
                    parts.append(graph.task(
                        "part", (*bb, i, j), _part, q, project("kv", bb, j, cols, batch),
                        masks.key(mask_d, bb, i, j), masks.key(bias_d, bb, i, j), plan,
                    ))  # fmt: skip
            if call.extra:  # bias_k's key and the zero key: seen by every real query
                rows_only = visibility.block(batch, rows, slice(0, 0))
                extra = Visibility(
                    index_shape=rows_only.index_shape, L=rows_only.L, S=call.extra,
                    query_lengths=rows_only.query_lengths,
                )  # fmt: skip
                plan = _Part(extra, 1.0, call.budget, call.threads, call.compute_dtype)
                parts.append(graph.task("part", (*bb, i, len(grid.cols)), _part, q, extra_kv,
                                        None, None, plan))  # fmt: skip
            shape = (*grid.block_shape(batch), H, rows.stop - rows.start, call.d_v)
            output = _Output(shape, call.compute_dtype, call.result_dtype, call.threads)
            last = graph.reduce(parts, (*bb, i), fan_in)  # the output task merges the last few
            graph.task("out", (*bb, i, 0), _mha_out, last, w, output)
    chunks = (*grid.batch_chunks, grid.row_chunks, (d_out,))
    out = graph.array("out", chunks, call.result_dtype, [Qd, Kd, Vd, mask_d, bias_d], da)
    return out if batched else out[0]


# --- checking the call -------------------------------------------------------------------


def _dask() -> Any:
    try:
        import dask.array as da
    except ImportError:
        raise ImportError(
            'mha.dask needs Dask: pip install ".[dask]" in the mha checkout, or '
            'pip install "dask[array]" distributed'
        ) from None
    return da


def _is_dask(x: Any) -> bool:
    return hasattr(x, "dask") and hasattr(x, "chunks") and hasattr(x, "rechunk")


def _lazy_or_array(name: str, x: Any, da: Any) -> Any:
    """A Dask array as it is (integers read as float64, lazily), anything else as the
    in-memory function reads it."""
    if not _is_dask(x):
        return as_float_array(name, x)
    if _known(name, x).dtype.kind in "iu":
        return x.astype(np.float64)
    return x


def _known(name: str, x: Any) -> Any:
    """``x``, refused if its chunk sizes are unknown (as after boolean indexing)."""
    if any(np.isnan(size) for size in x.shape):
        raise AttentionValueError(
            f"{name} has unknown chunk sizes {x.chunks}; call {name}.compute_chunk_sizes() "
            "first (attention needs every chunk's length to plan the graph)"
        )
    return x


def _standin(x: Any) -> np.ndarray:
    """A NumPy array with ``x``'s shape and dtype that takes no memory, for the checks."""
    if isinstance(x, np.ndarray):
        return x
    return np.broadcast_to(np.zeros((), x.dtype), x.shape)


def _small(name: str, x: Any) -> Any:
    """Lengths and positions: one number per sequence or position, read when the graph is
    built (a Dask array is computed)."""
    if x is None:
        return None
    return as_array(name, x.compute() if _is_dask(x) else x)


def _fan_in(split_every: Any) -> int:
    fan_in = positive_int("split_every", split_every)
    if fan_in < 2:
        raise AttentionValueError(f"split_every must be at least 2; got {fan_in}")
    return fan_in


def _refuse_in_memory_only(
    return_weights: Any, return_backward: Any, dropout_p: Any, generator: Any, cache: Any
) -> None:
    """The in-memory functions' options that mha.dask does not offer: checked as they check
    them, then refused by name when asked for."""
    asked = [
        name
        for name, value in (
            ("return_weights", return_weights),
            ("return_backward", return_backward),
        )
        if flag(name, value)
    ]
    if functional._dropout_p(dropout_p, generator):
        asked.append("dropout_p")
    if cache is not None:
        asked.append("cache")
    if asked:
        raise AttentionValueError(
            f"mha.dask computes the attention output (and its log-sum-exp) only; "
            f"{', '.join(asked)} are for the in-memory functions: call mha's on a slice"
        )


def _with_batch_axis(visibility: Visibility) -> Visibility:
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
class _Masks:
    """The boolean mask and the bias as Dask arrays, checked by their dtypes and shapes
    alone (nothing is computed)."""

    causal: bool  # mask=True
    mask: Any = None
    bias: Any = None
    full: tuple[int, ...] = ()  # the scores' shape, once checked

    @classmethod
    def check(cls, mask: Any, bias: Any, da: Any) -> _Masks:
        causal = isinstance(mask, (bool, np.bool_)) and bool(mask)
        if mask is None or isinstance(mask, (bool, np.bool_)):
            mask = None
        elif _is_dask(mask):
            split_mask(_standin(_known("mask", mask)))  # a non-boolean mask's error
        else:
            _, mask = split_mask(mask)
            mask = da.from_array(mask)
        if bias is not None:
            if _is_dask(bias):
                as_float_array("bias", np.zeros((), _known("bias", bias).dtype))
            else:
                bias = da.from_array(as_float_array("bias", bias))
            if bias.dtype.kind in "iu":
                bias = bias.astype(np.float64)
        return cls(causal, mask, bias)

    def fit_scores(self, batch: tuple[int, ...], H: int, L: int, S: int) -> _Masks:
        full = (*batch, H, L, S)
        for name, array in (("mask", self.mask), ("bias", self.bias)):
            if array is not None:
                fit_to_scores(name, _standin(array), full, batch)
        return replace(self, full=full)

    def fit(self, grid: _Grid, batched: bool) -> tuple[Any, Any]:
        """The mask and the bias as full-rank Dask arrays cut like the scores (broadcast
        axes whole), or ``None``."""
        mask, bias = (
            None if x is None else self._fit(x, batched, grid) for x in (self.mask, self.bias)
        )
        return mask, bias

    def _fit(self, x: Any, batched: bool, grid: _Grid) -> Any:
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
        return {"causal": causal or self.causal, "causal_alignment": alignment,
                "window": window, "key_lengths": block.key_lengths,
                "query_lengths": block.query_lengths}  # fmt: skip


@dataclass(frozen=True)
class _Rotation:
    """Rotary embeddings: the keywords, the positions of the queries and of the keys, and
    the caller's own ``positions`` (``None`` for the defaults), checked once."""

    options: dict[str, Any] | None
    q_positions: np.ndarray | None
    k_positions: np.ndarray | None
    given: np.ndarray | None

    @classmethod
    def check(cls, call: functional._Call, given: Any) -> _Rotation:
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


@dataclass(frozen=True)
class _Grid:
    """How the scores ``(*batch, H, L, S)`` are cut: the batch blocks, the query chunks
    (``rows``) and the key chunks (``cols``)."""

    batch_chunks: tuple[tuple[int, ...], ...]
    row_chunks: tuple[int, ...]
    col_chunks: tuple[int, ...]
    H: int
    heads_axis: bool

    @classmethod
    def of(cls, q: Any, k: Any, v: Any, H: int, *, heads_axis: bool) -> _Grid:
        n_batch = q.ndim - (3 if heads_axis else 2)
        lead = next((x for x in (q, k, v) if _is_dask(x)), None)
        batch = (
            lead.chunks[:n_batch] if lead is not None else tuple((n,) for n in q.shape[:n_batch])
        )
        rows = q.chunks[-2] if _is_dask(q) else (q.shape[-2],)
        keyed = next((x for x in (k, v) if _is_dask(x)), None)
        cols = keyed.chunks[-2] if keyed is not None else (k.shape[-2],)
        return cls(batch, _nonempty(rows), _nonempty(cols), H,
                   heads_axis)  # fmt: skip

    @property
    def rows(self) -> list[slice]:
        return _slices(self.row_chunks)

    @property
    def cols(self) -> list[slice]:
        return _slices(self.col_chunks)

    @property
    def one_pair(self) -> bool:
        return len(self.row_chunks) == 1 and len(self.col_chunks) == 1

    def batch_blocks(self) -> Any:
        """``(block index, slices)`` for every block of the batch axes."""
        per_axis = [list(enumerate(_slices(chunks))) for chunks in self.batch_chunks]
        for combo in itertools.product(*per_axis):
            yield tuple(n for n, _ in combo), tuple(s for _, s in combo)

    def block_shape(self, batch: tuple[slice, ...]) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in batch)

    def fit(self, x: Any, positions: str, da: Any) -> Any:
        """``x`` as a Dask array cut by this grid: batch blocks, its positions as the rows
        or the columns, everything else whole."""
        along = self.row_chunks if positions == "rows" else self.col_chunks
        if x.shape[-2] == 0:
            along = (0,)
        middle = ((x.shape[-3],),) if self.heads_axis else ()
        chunks = (*self.batch_chunks, *middle, along, (x.shape[-1],))
        if not _is_dask(x):
            return da.from_array(x, chunks=chunks)
        return x if x.chunks == chunks else x.rechunk(chunks)


def _nonempty(chunks: tuple[int, ...]) -> tuple[int, ...]:
    kept = tuple(c for c in chunks if c)
    return kept or (0,)


def _slices(chunks: tuple[int, ...]) -> list[slice]:
    ends = np.cumsum((0, *chunks))
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(ends)]


# --- the graph ---------------------------------------------------------------------------


class _Graph:
    """Tasks keyed ``(name-token, *index)``, in one layer."""

    def __init__(self, prefix: str, inputs: Any) -> None:
        from dask.base import tokenize

        self.token = tokenize(*inputs)
        self.prefix = prefix
        self.layer: dict[Any, Any] = {}

    def name(self, kind: str) -> str:
        return f"{self.prefix}-{kind}-{self.token}"

    def data(self, kind: str, value: Any) -> str:
        key = self.name(kind)
        self.layer[key] = value
        return key

    def task(self, kind: str, index: tuple[int, ...], function: Any, *args: Any) -> Any:
        key = (self.name(kind), *index)
        self.layer[key] = (function, *args)
        return key

    def reduce(self, parts: list[Any], index: tuple[int, ...], fan_in: int) -> list[Any]:
        """At most ``fan_in`` keys whose merge is the merge of ``parts``: a tree of merges,
        ``fan_in`` parts at a time, of depth ``log(parts)``."""
        level, depth = parts, 0
        while len(level) > fan_in:
            level = [
                self.task("merge", (depth, *index, n), _merge, level[a : a + fan_in])
                for n, a in enumerate(range(0, len(level), fan_in))
            ]
            depth += 1
        return level

    def array(
        self, kind: str, chunks: tuple[tuple[int, ...], ...], dtype: np.dtype, deps: Any, da: Any
    ) -> Any:
        """The Dask array of the ``kind`` tasks (the outputs), over every other task."""
        from dask.highlevelgraph import HighLevelGraph

        outputs = {self.name(output) for output in ("out", "lse")}
        inner = {key: task for key, task in self.layer.items() if _name(key) not in outputs}
        mine = {key: task for key, task in self.layer.items() if _name(key) == self.name(kind)}
        graph = HighLevelGraph.from_collections(
            self.name("tasks"), inner, dependencies=[x for x in deps if x is not None]
        )
        name = self.name(kind)
        graph = HighLevelGraph(
            {**graph.layers, name: mine}, {**graph.dependencies, name: {self.name("tasks")}}
        )
        return da.Array(graph, name, chunks, meta=np.empty((0,) * len(chunks), dtype))


def _name(key: Any) -> str:
    return str(key[0] if isinstance(key, tuple) else key)


# --- the tasks (module-level functions and plain data: they travel to the workers) --------


WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v")
Weights = dict[str, Any]  # the arrays of WEIGHT_NAMES, as checked (None where not given)


@dataclass(frozen=True)
class _Projection:
    which: str  # "q", or "kv" for the keys and the values
    H: int
    H_kv: int
    scale: float
    dtype: np.dtype
    rotary: dict[str, Any] | None  # apply_rotary's positions and keywords for this chunk
    threads: int | None


def _project(inputs: list[np.ndarray], weights: Weights, plan: _Projection) -> Any:
    """One chunk's heads ``(b, heads, n, d)`` in the compute dtype: the queries times the
    scale, or the keys and the values as a pair."""
    if plan.which == "q":
        return _heads(inputs[0], weights["W_q"], weights["b_q"], plan.H, plan, plan.scale)
    return (
        _heads(inputs[0], weights["W_k"], weights["b_k"], plan.H_kv, plan),
        _heads(inputs[1], weights["W_v"], weights["b_v"], plan.H_kv, plan, rotate=False),
    )


def _heads(
    X: np.ndarray,
    W: np.ndarray,
    b: np.ndarray | None,
    heads: int,
    plan: _Projection,
    scale: float = 1.0,
    rotate: bool = True,
) -> np.ndarray:
    W = W.astype(plan.dtype, copy=False)
    b = None if b is None else b.astype(plan.dtype, copy=False)
    if scale != 1.0:
        W, b = W * scale, None if b is None else b * scale
    with Team(workers_for(float(X.size) * W.shape[1], plan.threads)) as team:
        projected = team.matmul(X.astype(plan.dtype, copy=False), W, b)
    x = functional._split_heads(projected, heads)
    if rotate and plan.rotary is not None:
        x = apply_rotary(x, **plan.rotary)
    return x


@dataclass(frozen=True)
class _Part:
    visibility: Visibility  # the chunk pair's, without its mask and bias
    scale: float
    budget: int
    threads: int | None
    dtype: np.dtype


def _part(
    q: np.ndarray,
    kv: Any,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    plan: _Part,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``(out, lse)`` of a query chunk over a key chunk ``kv = (k, v)`` (whose batch
    axes may be 1, broadcast), by the in-memory kernel."""
    k, v = (np.broadcast_to(x, (*q.shape[:-3], *x.shape[-3:])) for x in kv)
    visibility = plan.visibility
    if mask is not None or bias is not None:
        bias = None if bias is None else bias.astype(plan.dtype, copy=False)
        visibility = visibility.with_arrays(mask, bias)
    out = np.zeros((*q.shape[:-1], v.shape[-1]), dtype=plan.dtype)
    lse = np.full(q.shape[:-1], -np.inf, dtype=plan.dtype)
    cost = float(np.prod(q.shape[:-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    with (
        np.errstate(invalid="ignore", over="ignore"),
        Team(workers_for(cost, plan.threads)) as team,
    ):
        attend(q, k, v, visibility, plan.scale, out, lse=lse, max_memory=plan.budget, team=team)
    return out, lse


@dataclass(frozen=True)
class _Empty:
    shape: tuple[int, ...]  # (*b, H, n, d_v)
    dtype: np.dtype


def _merge(
    parts: list[tuple[np.ndarray, np.ndarray]], empty: _Empty | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Parts over disjoint key ranges merged by their log-sum-exp; with none (a query chunk
    that sees no key), a zero output and a ``-inf`` log-sum-exp of ``empty``'s shape."""
    if not parts:
        assert empty is not None
        return np.zeros(empty.shape, empty.dtype), np.full(empty.shape[:-1], -np.inf, empty.dtype)
    if len(parts) == 1:
        return parts[0]
    with np.errstate(invalid="ignore", over="ignore"):
        return merge_partials([out for out, _ in parts], [lse for _, lse in parts])


@dataclass(frozen=True)
class _Output:
    shape: tuple[int, ...]  # the heads' (b, H, n, d_v)
    dtype: np.dtype
    result_dtype: np.dtype
    threads: int | None


def _mha_out(parts: list[Any], weights: Weights, plan: _Output) -> Any:
    """The last parts merged, the heads joined and projected by ``W_o``: ``(b, n, d_out)``
    in the result dtype."""
    heads, _ = _merge(parts, _Empty(plan.shape, plan.dtype))
    joined = functional._join_heads(heads)
    b_o = None if weights["b_o"] is None else weights["b_o"].astype(plan.dtype, copy=False)
    W_o = weights["W_o"].astype(plan.dtype, copy=False)
    with Team(workers_for(float(joined.size) * W_o.shape[1], plan.threads)) as team:
        out = team.matmul(joined, W_o, b_o)
    return functional._cast(out, plan.result_dtype)


def _sdpa_out(merged: tuple[np.ndarray, np.ndarray], result_dtype: np.dtype) -> np.ndarray:
    return functional._cast(merged[0], result_dtype)


def _lse_out(merged: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    return merged[1]


@dataclass(frozen=True)
class _SdpaBlock:
    masks: dict[str, Any]
    scale: float
    budget: int
    threads: int | None


def _sdpa_block(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any, bias: Any, plan: _SdpaBlock
) -> tuple[np.ndarray, np.ndarray]:
    """One batch block by the in-memory function (one chunk of queries and of keys)."""
    out, lse = functional.scaled_dot_product_attention(
        q, k, v, mask=mask, bias=bias, scale=plan.scale, max_memory=plan.budget,
        workers=plan.threads, return_lse=True, **plan.masks,
    )  # fmt: skip
    return out, lse


@dataclass(frozen=True)
class _MhaBlock:
    num_heads: int
    scale: float
    keywords: dict[str, Any]


def _mha_block(
    Q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    mask: Any,
    bias: Any,
    weights: Weights,
    plan: _MhaBlock,
) -> np.ndarray:
    """One batch block by the in-memory function (one chunk of queries and of keys)."""
    out: np.ndarray = functional.multi_head_attention(
        Q, K, V, mask=mask, bias=bias, num_heads=plan.num_heads, scale=plan.scale,
        **weights, **plan.keywords,
    )  # fmt: skip
    return out
