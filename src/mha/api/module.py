"""``MultiHeadAttention``: a layer that owns its weights and calls the function's path.

The constructor draws torch's initialisation; ``forward`` checks its inputs under their own
names and computes exactly what :func:`mha.multi_head_attention` computes with the module's
weights and settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

import numpy as np

from .._arrays import as_float_array, flag, positive_int
from .._kernel.contract import window_sides
from ..errors import AttentionTypeError, AttentionValueError, ShapeError
from .cache import KVCache
from .checks import (
    LayerArrays,
    LayerWeights,
    check_mask_argument,
    random_generator,
)
from .configuration import LayerSpec, float_dtype
from .decoding import keep_step, kept_step
from .layer_plan import keep_plan, kept_plan
from .layouts import Layouts
from .paged_cache import PagedKVCache
from .plans import checked_layer
from .projection import compute
from .shared_kv import shared_view
from .spec import Checked, MhaKeywords, check_mha

if TYPE_CHECKING:
    from typing import Unpack

    from .signatures import Backward, Flag, ForwardOptions, MaskMod, ScoreMod

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(Layouts):
    """Multi-head attention that owns its weights; ``forward`` calls the function.

    ``d_model`` is the model width and ``num_heads`` the number of query heads, each
    ``head_dim`` wide (default ``d_model // num_heads``; the values' heads ``v_head_dim``
    wide, default ``head_dim``). The weights are attributes in the function's "x @ W" layout:
    ``W_q (d_model, H*head_dim)``, ``W_k (kdim, H_kv*head_dim)``, ``W_v (vdim,
    H_kv*v_head_dim)``, ``W_o (H*v_head_dim, d_model)``, and with ``bias=True``
    also ``b_q``, ``b_k``, ``b_v``, ``b_o`` (``None`` otherwise; weights loaded from a
    model may have some of them, as Qwen2 has ``b_q``, ``b_k``, ``b_v`` only).

    **bias defaults to False** (the specification's weights-only layer), where
    ``torch.nn.MultiheadAttention`` defaults to ``bias=True``: pass ``bias=True`` for
    torch's layout. ``kdim``/``vdim`` are the key and value input widths (default
    ``d_model``), ``qdim`` the queries' (default ``d_model``; ``W_q (qdim, H*head_dim)``:
    Zamba's attention reads the hidden states joined to the embeddings, ``2*d_model`` wide,
    and self-attention then needs ``kdim = vdim = qdim``); ``add_bias_kv`` and
    ``add_zero_attn`` are torch's extra keys; ``dtype`` is the weights' floating dtype
    (default float64). The random initialisation follows torch's: Xavier/Glorot uniform
    over the packed ``(3*d_model, d_model)`` in-projection (or over each of W_q, W_k, W_v
    when their shapes differ), ``U(-1/sqrt(d_model), 1/sqrt(d_model))`` for ``W_o`` and zero
    biases; ``seed`` (an int or a ``np.random.Generator``) makes it reproducible.

    For decoder models: ``num_kv_heads`` (grouped-query attention, default ``num_heads``),
    ``rope_theta`` (rotary position embeddings of q and k after projection, with
    ``rotary_dim`` and ``rotary_interleaved`` as in :func:`mha.apply_rotary`) and
    ``window`` (a sliding window); :meth:`new_cache` makes a :class:`mha.KVCache` for
    ``forward(x, cache=...)``, and :meth:`from_llama` reads transformers' layout. What a
    model fixes of today's variants (docs/variants.md): ``sinks=True`` (gpt-oss: the
    module owns ``sinks``, one learned logit per head, zero to start, in :meth:`parameters`),
    ``sink_tokens`` (StreamingLLM, with ``window``), ``softcap`` (Gemma 2), ``alibi``
    (True for :func:`mha.alibi_slopes`, or the slopes) and ``chunk`` (Llama 4). What today's
    checkpoints add: ``rope_scaling`` (transformers' ``rope_parameters``: ``linear``,
    ``dynamic``, ``llama3``, ``yarn``, ``longrope``), ``scale`` (the softmax scale, as
    Gemma's ``query_pre_attn_scalar ** -0.5``; default ``1/sqrt(head_dim)``) and ``qk_norm``
    (``"head"``: Qwen3 and Gemma 3, ``"all"``: OLMo 2; the module owns ``q_norm`` and
    ``k_norm``, with ``qk_norm_eps`` and ``qk_norm_offset``, 1.0 for Gemma's ``(1 + w)``;
    ``"each_head"``: StableLM and Cohere, weights of each head; ``qk_layernorm=True``: a
    LayerNorm, with its biases ``q_norm_bias`` and ``k_norm_bias`` when ``bias``;
    ``qk_norm_after_rope=True``: HunYuan's, after the rotation) and
    ``output_gate`` (``"sigmoid"`` or ``"softplus"``: the joined heads times ``act(x @ W_g +
    b_g)`` before ``W_o``, per element, or per head with ``output_gate_per_head``; the module
    owns ``W_g``, and ``b_g`` with ``bias``), ``query_temperature`` (Llama 4's and
    Ministral 3's and Beam's queries scaled by their position: ``(beta, floor, offset[, law])``, as
    :func:`mha.scaled_dot_product_attention` takes it), ``clip_qkv`` (DBRX, OLMo: the
    projections clamped to ``[-clip_qkv, clip_qkv]``) and ``v_norm`` (Gemma 3n, Gemma 4: the
    epsilon of an RMSNorm without weights of each value head). ``shares_kv_with``: the index
    of the layer whose keys and values this one attends with (Gemma 3n's and Gemma 4's KV
    sharing): it is called with that layer's cache, after that layer's call on the same
    tokens, and reads it without appending (:mod:`.shared_kv`). ``output_norm`` (``"rms"``:
    BitNet's RMSNorm of the joined heads before ``W_o``, the module owns its weight
    ``o_norm``; ``"l2"``: nGPT's L2 norm, no weights) with ``output_norm_eps`` (default
    1e-6); ``query_scale=True`` (Dory's nGPT ``sqk``: the module owns ``q_scale``, one
    factor a query feature after the rotation, one to start). :meth:`from_pretrained` reads
    a layer of a transformers checkpoint with all of them.

    The class holds configuration and weights and delegates to the function's own path (same
    inputs, same bits): its settings and weights are checked in :mod:`.configuration`, the
    other layouts of its weights are read and written in :mod:`.layouts`.

    >>> import numpy as np
    >>> from mha import MultiHeadAttention
    >>> attention = MultiHeadAttention(d_model=8, num_heads=2, seed=0)
    >>> attention
    MultiHeadAttention(d_model=8, num_heads=2, bias=False, dtype=float64)
    >>> X = np.random.default_rng(1).standard_normal((2, 5, 8))
    >>> attention.forward(X, mask=True).shape            # causal self-attention
    (2, 5, 8)
    >>> memory = np.random.default_rng(2).standard_normal((2, 7, 8))
    >>> attention(X, key=memory, key_lengths=[7, 3]).shape   # cross-attention, padding
    (2, 5, 8)
    """

    def __init__(
        self,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        *,
        num_kv_heads: SupportsIndex | None = None,
        head_dim: SupportsIndex | None = None,
        kdim: SupportsIndex | None = None,
        vdim: SupportsIndex | None = None,
        qdim: SupportsIndex | None = None,
        bias: Flag = False,
        add_bias_kv: Flag = False,
        add_zero_attn: Flag = False,
        rope_theta: float | None = None,
        rotary_dim: SupportsIndex | None = None,
        rotary_interleaved: Flag = False,
        window: SupportsIndex | None = None,
        sinks: Flag = False,
        sink_tokens: SupportsIndex | None = None,
        softcap: float | None = None,
        alibi: Any = False,
        chunk: SupportsIndex | None = None,
        rope_scaling: dict[str, Any] | None = None,
        scale: float | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float | None = None,
        output_gate: str | None = None,
        output_gate_per_head: Flag = False,
        query_temperature: tuple[float | str, ...] | None = None,
        v_head_dim: SupportsIndex | None = None,
        clip_qkv: float | None = None,
        qk_layernorm: Flag = False,
        qk_norm_after_rope: Flag = False,
        v_norm: float | None = None,
        shares_kv_with: SupportsIndex | None = None,
        output_norm: str | None = None,
        output_norm_eps: float | None = None,
        query_scale: Flag = False,
        dtype: Any = np.float64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        E = positive_int("d_model", d_model)
        H = positive_int("num_heads", num_heads)
        if head_dim is None and E % H:
            raise AttentionValueError(
                f"d_model={E} is not divisible by num_heads={H}; each head needs an equal "
                "share of the width (or give head_dim=)"
            )
        spec = LayerSpec(
            H, num_kv_heads, E // H if head_dim is None else head_dim, rope_theta, rotary_dim,
            rotary_interleaved, rope_scaling, window, sink_tokens, softcap, alibi, chunk, scale,
            qk_norm, qk_norm_eps, qk_norm_offset, add_zero_attn, output_gate, output_gate_per_head,
            query_temperature, v_head_dim, clip_qkv, qk_layernorm, qk_norm_after_rope, v_norm,
            shares_kv_with, output_norm, output_norm_eps,
        )  # fmt: skip
        kdim, vdim, qdim = (E if width is None else width for width in (kdim, vdim, qdim))
        self._configure(spec, (E, kdim, vdim, qdim))
        if not isinstance(bias, (bool, np.bool_)):
            raise AttentionTypeError(f"bias must be True or False; got {bias!r}")
        self.dtype = float_dtype(dtype)
        with_bias_kv, with_sinks = flag("add_bias_kv", add_bias_kv), flag("sinks", sinks)
        rng = random_generator(seed)  # drawn from only once everything is checked

        inner, kv_inner = H * self.head_dim, self.num_kv_heads * self.head_dim
        v_inner, joined = self.num_kv_heads * self.v_head_dim, H * self.v_head_dim
        if self.kdim == self.vdim == self.qdim == E and inner == E and kv_inner == E == v_inner:
            in_proj = _uniform(rng, (3 * E, E), _xavier_bound(E, 3 * E), self.dtype)
            self.W_q, self.W_k, self.W_v = (part.T.copy() for part in np.split(in_proj, 3))
        else:
            self.W_q, self.W_k, self.W_v = (
                _uniform(rng, (width, d_in), _xavier_bound(d_in, width), self.dtype).T.copy()
                for d_in, width in ((self.qdim, inner), (self.kdim, kv_inner), (self.vdim, v_inner))
            )
        self._side_by_side()
        bound = 1.0 / float(np.sqrt(joined))
        self.W_o = _uniform(rng, (E, joined), bound, self.dtype).T.copy()
        self.b_q, self.b_k, self.b_v, self.b_o = (
            np.zeros(width, dtype=self.dtype) if bias else None
            for width in (inner, kv_inner, v_inner, E)
        )
        self.bias_k: np.ndarray | None = None
        self.bias_v: np.ndarray | None = None
        if with_bias_kv:  # torch: xavier_normal_ on (1, 1, E)
            self.bias_k, self.bias_v = (
                rng.normal(0.0, 1.0 / float(np.sqrt(E)), width).astype(self.dtype)
                for width in (kv_inner, v_inner)
            )
        self.sinks: np.ndarray | None = None
        if with_sinks:  # gpt-oss's learned logits, one per head; zero to start
            self.sinks = np.zeros(H, dtype=self.dtype)
        self.q_norm: np.ndarray | None = None
        self.k_norm: np.ndarray | None = None
        if self.qk_norm is not None:  # a gain of one to start: w = 1 - offset
            shapes = self._shapes()
            self.q_norm, self.k_norm = (
                np.full(shapes[name], 1.0 - self.qk_norm_offset, dtype=self.dtype)
                for name in ("q_norm", "k_norm")
            )
        self.q_norm_bias: np.ndarray | None = None
        self.k_norm_bias: np.ndarray | None = None
        if self.qk_layernorm and bias:  # a LayerNorm's biases, zero to start
            shapes = self._shapes()
            self.q_norm_bias, self.k_norm_bias = (
                np.zeros(shapes[name], dtype=self.dtype) for name in ("q_norm_bias", "k_norm_bias")
            )
        self.W_g: np.ndarray | None = None
        self.b_g: np.ndarray | None = None
        if self.output_gate is not None:  # as a projection of d_model: xavier, bias zero
            rows, columns = self._shapes()["W_g"]
            bound = _xavier_bound(rows, columns)
            self.W_g = _uniform(rng, (columns, rows), bound, self.dtype).T.copy()
            self.b_g = np.zeros(columns, dtype=self.dtype) if bias else None
        self.o_norm: np.ndarray | None = None
        if self.output_norm == "rms":  # a gain of one to start
            self.o_norm = np.ones(self._shapes()["o_norm"], dtype=self.dtype)
        self.q_scale: np.ndarray | None = None
        if flag("query_scale", query_scale):  # each query feature's factor, one to start
            self.q_scale = np.ones(inner, dtype=self.dtype)

    # One overload per combination of the return_* flags; the last for run-time flags.
    # fmt: off
    @overload
    def forward(
        self, query: Any, mask: Any = ..., *, return_weights: Literal[False] = ...,
        return_backward: Literal[False] = ..., **options: Unpack[ForwardOptions],
    ) -> np.ndarray: ...
    @overload
    def forward(
        self, query: Any, mask: Any = ..., *, return_weights: Literal[True],
        return_backward: Literal[False] = ..., **options: Unpack[ForwardOptions],
    ) -> tuple[np.ndarray, np.ndarray]: ...
    @overload
    def forward(
        self, query: Any, mask: Any = ..., *, return_weights: Literal[False] = ...,
        return_backward: Literal[True], **options: Unpack[ForwardOptions],
    ) -> tuple[np.ndarray, Backward]: ...
    @overload
    def forward(
        self, query: Any, mask: Any = ..., *, return_weights: Literal[True],
        return_backward: Literal[True], **options: Unpack[ForwardOptions],
    ) -> tuple[np.ndarray, np.ndarray, Backward]: ...
    @overload
    def forward(
        self, query: Any, mask: Any = ..., *, return_weights: Flag = ...,
        return_backward: Flag = ..., **options: Unpack[ForwardOptions],
    ) -> np.ndarray | tuple[Any, ...]: ...
    # fmt: on

    def forward(
        self,
        query: Any,
        mask: Any = None,
        *misplaced: Any,
        key: Any = None,
        value: Any = None,
        causal: Flag | None = None,
        causal_alignment: str | None = None,
        key_lengths: Any = None,
        query_lengths: Any = None,
        bias: Any = None,
        window: SupportsIndex | tuple[int, int] | None = None,
        scale: float | None = None,
        return_weights: Flag = False,
        positions: Any = None,
        cache: KVCache | PagedKVCache | None = None,
        padding_side: str | None = None,
        return_backward: Flag = False,
        dropout_p: float | None = None,
        generator: np.random.Generator | None = None,
        max_memory: SupportsIndex | None = None,
        workers: SupportsIndex | None = None,
        mask_mod: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
        score_mod_grad: ScoreMod | None = None,
    ) -> np.ndarray | tuple[Any, ...]:
        """Attention of ``query (B, L, d_model)`` (or ``(L, d_model)``) over itself, or over
        ``key``/``value`` given by name.

        The rule for arguments: **the second positional argument is always the mask**, as
        in the specification's ``forward(X, mask)``. ``mask`` (positional or by name):
        ``None`` attends everywhere, ``True``
        is causal, a boolean array marks where attention is allowed (True = may attend).
        Anything else there (a float array, say) is refused, never guessed at. For
        cross-attention pass ``key=`` (``(B, S, kdim)``) and ``value=`` (``(B, S, vdim)``,
        default: ``key``) by name. The other keywords are those of
        :func:`mha.multi_head_attention`: ``causal``, ``causal_alignment``,
        ``key_lengths``, ``query_lengths``, ``bias``, ``window``, ``scale``,
        ``return_weights``, ``max_memory``, ``workers``, ``mask_mod``, ``score_mod`` and
        ``score_mod_grad``; the module's own ``num_kv_heads``, rotary settings and variants
        (sinks, sink tokens, soft-capping, ALiBi, chunks) apply. A ``window`` given here
        combines with the module's by AND, as every mask argument does (the narrower one
        counts; with a cache too, which keeps what the module's window needs).
        ``positions`` (``(L,)`` or ``(B, L)``) places the tokens for the rotary embedding.
        ``cache`` (from :meth:`new_cache`) makes ``query`` the next tokens of each sequence:
        they are projected, rotated at their true positions, appended, and attend causally
        over everything cached (every key, the new ones too, with ``mask=False`` or
        ``causal=False``); with ``query_lengths`` only the first ``query_lengths[b]``
        rows of sequence ``b`` are real tokens (the last ones with ``padding_side="left"``,
        a left-padded prompt). A :class:`mha.PagedKVCache` serves too (its sequences, in
        the order added, are the batch).
        ``return_backward=True`` adds ``backward``, a function of the output's gradient that
        returns the gradients keyed by attribute name for the weights (``W_q``, ...,
        ``b_o``, ``bias_k``, ``bias_v``: those present) and by argument name for the inputs
        (``query``, ``key``, ``value``, separately even for self-attention; their sum is the
        gradient of a shared input), and ``bias`` when given; see :meth:`parameters`.
        ``dropout_p`` with ``generator`` drops attention weights in training, the same mask
        in ``backward`` (``dropout_p=0.0`` turns it off, the generator given or not).
        Messages name the arguments as given here (``query``, ``key``, ``value``).
        ``attention(...)`` is ``attention.forward(...)``.

        >>> import numpy as np
        >>> from mha import MultiHeadAttention
        >>> attention = MultiHeadAttention(4, 2, seed=0)
        >>> X = np.random.default_rng(0).standard_normal((1, 3, 4))
        >>> causal = attention.forward(X, True)       # the specification's forward(X, mask)
        >>> bool((causal == attention(X, causal=True)).all())
        True
        >>> memory = np.random.default_rng(1).standard_normal((1, 6, 4))
        >>> attention(X, key=memory).shape                # cross-attention: key= by name
        (1, 3, 4)
        """
        plain = (  # every keyword left out but the mask, the cache and the workers
            type(self) is MultiHeadAttention  # (a subclass may compute more)
            and not misplaced
            and key is None
            and value is None
            and causal is None
            and causal_alignment is None
            and key_lengths is None
            and query_lengths is None
            and bias is None
            and window is None
            and scale is None
            and return_weights is False
            and positions is None
            and padding_side is None
            and return_backward is False
            and dropout_p is None
            and generator is None
            and max_memory is None
            and mask_mod is None
            and score_mod is None
            and score_mod_grad is None
        )
        plain_step = plain and cache is not None and mask is None  # a decoding step's call
        plain_call = plain and cache is None and (mask is None or mask is True)
        if plain_step:  # the layer's kept step, when this call is its (decoding.py)
            step = kept_step(self)
            if step is not None:
                out: np.ndarray | None = step(self, query, cache, workers)
                if out is not None:
                    return out
        elif plain_call:  # the layer's kept plan, when this call is its (layer_plan.py)
            plan = kept_plan(self)
            if plan is not None:
                out = plan(self, query, mask, workers)
                if out is not None:
                    return out
        if cache is not None and (key is not None or value is not None):
            raise AttentionValueError(
                "cache= appends the query tokens' own keys and values: key= and value= "
                "cannot be combined with it"
            )
        if misplaced:
            raise AttentionTypeError(
                f"forward takes at most two positional arguments, the query and the mask; "
                f"got {2 + len(misplaced)}. For cross-attention pass key= and value= by name"
            )
        check_mask_argument(
            mask,
            ". For cross-attention pass key= (and value=) by name; for an "
            "additive mask of 0 and -inf pass bias=",
        )
        query = as_float_array("query", query)
        if self.shares_kv_with is not None:  # another layer's cache, read (shared_kv.py)
            cache = shared_view(cache, query.shape[-2], query_lengths, self.shares_kv_with)
        if key is None and value is not None:
            raise AttentionValueError(
                "forward got value= without key=: give key= too (value defaults to key)"
            )
        itself = key is None  # self-attention: the query is its own key and value
        q_label = "d_model" if self.qdim == self.d_model else "qdim"
        if itself and (self.kdim, self.vdim) != (self.qdim, self.qdim):
            raise AttentionValueError(
                f"this MultiHeadAttention takes keys {self.kdim} and values {self.vdim} wide "
                f"(kdim, vdim), not {q_label}={self.qdim}: it cannot attend over the query "
                "itself; pass key= (and value=)"
            )
        key = query if itself else as_float_array("key", key)
        value = key if value is None else as_float_array("value", value)
        for name, array, width, label in (
            ("query", query, self.qdim, q_label),
            ("key", key, self.kdim, "kdim"),
            ("value", value, self.vdim, "vdim"),
        ):
            if array.ndim not in (2, 3):
                raise ShapeError(
                    f"{name} must have shape (B, L, {label}) or (L, {label}); "
                    f"got shape {array.shape}"
                )
            if array.shape[-1] != width:
                raise ShapeError(
                    f"{name} has width {array.shape[-1]} but this MultiHeadAttention has "
                    f"{label}={width} ({name} {array.shape})"
                )
        if window is not None:
            before, ahead = window_sides(window)  # (an int, or FlashAttention's pair)
            if self.window is not None:  # both windows hide keys: the narrower one counts
                before = self.window if before is None else min(before, self.window)
            window = before if ahead is None else (-1 if before is None else before - 1, ahead)
        held = getattr(cache, "window", None)
        if held is not None and window is None and self.window is None:
            raise AttentionValueError(  # the layer attends to every key: its cache must keep them
                f"window=None but the cache keeps only what window={held} needs: {cache!r}; "
                "this layer has no window (make its cache with new_cache)"
            )
        if scale is None:
            scale = self.scale
        if self.qk_norm is None and (self.q_norm is not None or self.k_norm is not None):
            raise AttentionValueError(
                "this MultiHeadAttention holds q_norm/k_norm weights but has qk_norm=None: "
                "make it with qk_norm='head' or 'all' (or set the weights to None)"
            )
        keywords = MhaKeywords(
            mask, causal, causal_alignment, key_lengths, query_lengths, bias, scale,
            return_weights, max_memory, workers, self.add_zero_attn, self.num_kv_heads,
            self.window if window is None else window, self.sink_tokens, self.chunk, mask_mod,
            self.sinks, self.softcap, self.alibi, score_mod, score_mod_grad,
            self.query_temperature, self.rope_theta,
            self.rotary_dim, self.rotary_interleaved, self.rope_scaling, positions, self.qk_norm,
            None if self.qk_norm is None else self.qk_norm_eps,
            None if self.qk_norm is None else self.qk_norm_offset, cache, padding_side,
            return_backward, dropout_p, generator, self.output_gate, self.clip_qkv,
            self.qk_layernorm, self.qk_norm_after_rope, self.v_norm, self.output_norm,
            self.output_norm_eps,
        )  # fmt: skip
        weights = LayerWeights(
            self.W_q,
            self.W_k,
            self.W_v,
            self.W_o,
            self.b_q,
            self.b_k,
            self.b_v,
            self.b_o,
            self.bias_k,
            self.bias_v,
            self.q_norm,
            self.k_norm,
            self.W_g,
            self.b_g,
            self.q_norm_bias,
            self.k_norm_bias,
            self.o_norm,
            self.q_scale,
        )
        inputs = LayerArrays(query, key, value)
        names = _SELF_NAMES if itself else _INPUT_NAMES
        checked = self._checked(check_mha(keywords))
        call = checked_layer(self, inputs, weights, self.num_heads, checked, names)
        result = compute(call)
        if plain_step:
            keep_step(self, call, workers)
        elif plain_call:
            keep_plan(self, call, mask, workers)
        if not call.request.backward:
            return result
        *outputs, backward = result
        return (*outputs, _Renamed(backward))

    def _checked(self, checked: Checked) -> Checked:
        """A call's checked keywords, with what a subclass computes beyond them (its output
        stage: :class:`mha.DifferentialAttention`)."""
        return checked

    def parameters(self) -> dict[str, np.ndarray]:
        """The weights an optimiser updates, by attribute name: the arrays themselves (update
        them in place), only those present.

        >>> import numpy as np
        >>> from mha import MultiHeadAttention
        >>> attention = MultiHeadAttention(8, 2, bias=True, seed=0)
        >>> X = np.random.default_rng(0).standard_normal((2, 3, 8))
        >>> out, backward = attention(X, mask=True, return_backward=True)
        >>> grads = backward(np.ones_like(out))
        >>> for name, W in attention.parameters().items():   # one step of gradient descent
        ...     W -= 0.1 * grads[name]
        >>> sorted(grads)[:4], grads["query"].shape
        (['W_k', 'W_o', 'W_q', 'W_v'], (2, 3, 8))
        """
        return {name: W for name, W in self.weights().items() if W is not None}

    def new_cache(self, batch_size: int, *, capacity: int = 256, dtype: Any = None) -> KVCache:
        """An empty :class:`mha.KVCache` for ``batch_size`` sequences, made for this
        attention's key/value heads, head width, window and sink tokens. ``capacity``
        positions are preallocated; more are added as needed. ``dtype`` is what the cache
        stores: by default the weights' dtype (a bfloat16 or float16 module keeps a cache of
        its own dtype, half the memory of float32, and computes in float32); a float32 module
        may keep a bfloat16 cache too, by ``dtype=ml_dtypes.bfloat16``.

        >>> import numpy as np
        >>> from mha import MultiHeadAttention
        >>> attention = MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0, seed=0)
        >>> cache = attention.new_cache(2, capacity=32)
        >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))
        >>> attention(x, cache=cache).shape, cache.lengths   # a prompt of 5 tokens
        ((2, 5, 16), array([5, 5]))
        >>> attention(x[:, :1], cache=cache).shape, cache.lengths   # then one more
        ((2, 1, 16), array([6, 6]))
        """
        return KVCache(
            batch_size,
            self.num_kv_heads,
            self.head_dim,
            value_dim=self.v_head_dim,
            capacity=capacity,
            dtype=self.dtype if dtype is None else float_dtype(dtype),
            window=self.window,
            sink_tokens=self.sink_tokens,
        )

    __call__ = forward


_WIDTHS = {"d_q": "d_model", "d_kin": "kdim", "d_vin": "vdim"}
_INPUT_NAMES = {"Q": "query", "K": "key", "V": "value", **_WIDTHS}
_SELF_NAMES = {"Q": "query", "K": "query", "V": "query", **_WIDTHS}  # messages name one input
_GRADIENT_NAMES = {"Q": "query", "K": "key", "V": "value"}  # apart, even for self-attention


class _Renamed:
    """A module's ``backward``: the function's gradients under the module's names."""

    def __init__(self, backward: Any) -> None:
        self.backward = backward

    def __call__(self, grad_out: Any) -> dict[str, np.ndarray]:
        return {_GRADIENT_NAMES.get(name, name): g for name, g in self.backward(grad_out).items()}


def _xavier_bound(fan_in: int, fan_out: int) -> float:
    return float(np.sqrt(6.0 / (fan_in + fan_out)))


def _uniform(
    rng: np.random.Generator, shape: tuple[int, int], bound: float, dtype: np.dtype
) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(dtype)
