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

from ..._arrays import resolve_scale
from ..._kernel.contract import ScoreShape, Visibility
from ...api import checks
from ...api.checks import LayerArrays, LayerWeights, check_layer
from ...api.spec import Checked, MhaKeywords, SdpaKeywords, check_mha, check_sdpa
from ...errors import AttentionValueError
from .arrays import import_dask, lazy_or_array, small, standin
from .build import Lazy, MhaGraph, SdpaGraph
from .inputs import Masks, Rotation, check_fan_in, refuse_in_memory_only

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
    window: int | tuple[int, int] | None = None,
    sink_tokens: int | None = None,
    chunk: int | None = None,
    mask_mod: Any = None,
    sinks: Any = None,
    softcap: float | None = None,
    alibi: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    query_temperature: Any = None,
    scale: float | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_backward: bool = False,
    dropout_p: float | None = None,
    generator: np.random.Generator | None = None,
    cache: Any = None,
    padding_side: str | None = None,
    max_memory: int | None = None,
    workers: int | None = 1,
    lse_base: float | None = None,
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
    ``return_lse=True`` the lazy log-sum-exp ``(..., H, L)`` too (in base 2 with
    ``lse_base=2``).

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
    checks.checked_heads(*map(standin, lazy.values()))  # the arrays' errors first
    keywords = SdpaKeywords(  # the mask and the bias are checked by Masks, after
        _causal(mask), causal, causal_alignment, small("key_lengths", key_lengths),
        small("query_lengths", query_lengths), None, window, sink_tokens, chunk, mask_mod, sinks,
        softcap, alibi, score_mod, score_mod_grad, query_temperature, scale, return_weights,
        return_lse, return_backward, dropout_p, generator, cache, padding_side, max_memory,
        workers, lse_base,
    )  # fmt: skip
    checked = check_sdpa(keywords)
    result = _sdpa(lazy, checked, (mask, bias), split_every, da)
    if checked.request.lse_base2:
        out, lse = result
        return out, checked.request.returned_lse(lse)
    return result


def _sdpa(
    lazy: dict[str, Any], checked: Checked, masking: tuple[Any, Any], split_every: Any, da: Any
) -> Any:
    """:func:`scaled_dot_product_attention`'s graph, its keywords checked."""
    sq, sk, sv, result_dtype, compute_dtype = checks.checked_heads(*map(standin, lazy.values()))
    spec = checked.spec
    scale = resolve_scale(spec.scale, sq.shape[-1], compute_dtype)
    _refuse_in_memory_only(checked)
    shape = ScoreShape(sq.shape[:-3], sq.shape[-3], sq.shape[-2], sk.shape[-2])
    masks = Masks.check(*masking, da).fit_scores(*shape)
    visibility = Visibility.build(
        spec.mask, checked.given.arrays, shape, compute_dtype, f"q {sq.shape}, k {sk.shape}"
    )
    scores = spec.scores.fit(shape.H, want_backward=False, batch_shape=shape.batch_shape)
    batched = len(shape.batch_shape) > 0
    arrays = {name: x if batched else x[None] for name, x in lazy.items()}
    graph = SdpaGraph(
        Lazy(arrays, batched, masks, check_fan_in(split_every), da),
        checked,
        visibility,
        scale,
        scores,
    )
    return graph.build(sv.shape[-1], (result_dtype, compute_dtype))


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
    window: int | tuple[int, int] | None = None,
    sink_tokens: int | None = None,
    chunk: int | None = None,
    mask_mod: Any = None,
    sinks: Any = None,
    softcap: float | None = None,
    alibi: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    query_temperature: Any = None,
    rope_theta: float | None = None,
    rotary_dim: int | None = None,
    rotary_interleaved: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    positions: Any = None,
    q_norm: Any = None,
    k_norm: Any = None,
    qk_norm: str | None = None,
    qk_norm_eps: float | None = None,
    qk_norm_offset: float | None = None,
    qk_layernorm: bool = False,
    qk_norm_after_rope: bool = False,
    q_norm_bias: Any = None,
    k_norm_bias: Any = None,
    W_g: Any = None,
    b_g: Any = None,
    output_gate: str | None = None,
    clip_qkv: float | None = None,
    v_norm: float | None = None,
    q_scale: Any = None,
    o_norm: Any = None,
    output_norm: str | None = None,
    output_norm_eps: float | None = None,
    cache: Any = None,
    padding_side: str | None = None,
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
    read when the graph is built. Every other argument is the in-memory function's (the
    same checked spec: rope scaling, QK-norm, ``clip_qkv``, ``v_norm`` and the output gate
    too).
    ``workers`` counts threads inside each task (default 1: Dask runs tasks in parallel);
    ``split_every`` is the merge tree's fan-in. ``return_weights``, ``return_backward``,
    dropout, ``cache``, ``q_scale`` and ``output_norm`` (with ``o_norm``) are in-memory
    only.

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
    lazy = {name: lazy_or_array(name, x, da) for name, x in (("Q", Q), ("K", K), ("V", V))}
    sQ, sK, sV = (standin(x) for x in lazy.values())
    if Q is K is V:  # one array: one GEMM projects all three
        sK = sV = sQ
    keywords = MhaKeywords(  # the mask and the bias are checked by Masks, after
        _causal(mask), causal, causal_alignment, small("key_lengths", key_lengths),
        small("query_lengths", query_lengths), None, scale, return_weights, max_memory, workers,
        add_zero_attn, num_kv_heads, window, sink_tokens, chunk, mask_mod, sinks, softcap, alibi,
        score_mod, score_mod_grad, query_temperature, rope_theta, rotary_dim, rotary_interleaved,
        rope_scaling,
        small("positions", positions), qk_norm, qk_norm_eps, qk_norm_offset, cache, padding_side,
        return_backward, dropout_p, generator, output_gate, clip_qkv, qk_layernorm,
        qk_norm_after_rope, v_norm, output_norm, output_norm_eps,
    )  # fmt: skip
    weights = LayerWeights(
        W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, bias_k, bias_v, q_norm, k_norm, W_g, b_g,
        q_norm_bias, k_norm_bias, o_norm, q_scale,
    )  # fmt: skip
    return _mha(
        lazy,
        (sQ, sK, sV),
        weights,
        (num_heads, check_mha(keywords)),
        (mask, bias, positions),
        split_every,
        da,
    )


def _mha(
    lazy: dict[str, Any],
    standins: tuple[np.ndarray, ...],
    weights: LayerWeights,
    heads: tuple[Any, Checked],
    given: tuple[Any, Any, Any],
    split_every: Any,
    da: Any,
) -> Any:
    """:func:`multi_head_attention`'s graph, its keywords checked: ``heads`` is the head
    count and the checked keywords, ``given`` the mask, the bias and the positions."""
    num_heads, checked = heads
    mask, bias, positions = given
    _refuse_in_memory_only(checked)
    if checked.spec.output_norm is not None or weights.o_norm is not None:
        raise AttentionValueError(
            "output_norm: mha.dask does not compute the norm of the joined heads before W_o; "
            "call mha.multi_head_attention on a slice that fits in memory"
        )
    if weights.q_scale is not None:
        raise AttentionValueError(
            "q_scale: mha.dask does not compute the queries' factors after the rotation; "
            "call mha.multi_head_attention on a slice that fits in memory"
        )
    call = check_layer(LayerArrays(*standins), weights, num_heads, checked)
    masks = Masks.check(mask, bias, da).fit_scores(call.B, call.H, call.L, call.S)
    fan_in = check_fan_in(split_every)
    rotation = Rotation.check(call, positions)
    batched = len(call.B) > 0
    arrays = {name: x if batched else x[None] for name, x in lazy.items()}
    return MhaGraph(Lazy(arrays, batched, masks, fan_in, da), call, checked, rotation).build()


def _causal(mask: Any) -> Any:
    """The mask's part the spec takes: ``True`` (causal), else nothing (an array is cut
    like the scores, :class:`Masks`)."""
    return True if isinstance(mask, (bool, np.bool_)) and mask else None


def _refuse_in_memory_only(checked: Checked) -> None:
    """The in-memory functions' options that mha.dask does not offer, refused by name."""
    request, given = checked.request, checked.given
    refuse_in_memory_only(request.weights, request.backward, checked.spec.dropout_p, given.cache)
