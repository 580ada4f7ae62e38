# mypy: disable-error-code="no-any-return,assignment"
"""A whole decoder-only language model in NumPy, with mha's attention and KV cache: each
family's decoder layer a row of :data:`FAMILIES`, read from a transformers checkpoint folder
or a llama.cpp GGUF file (:func:`mha.integrations.checkpoint.open_checkpoint`), one layer's
tensors at a time.

Each layer's attention is ``mha.from_pretrained(path, layer=i)`` (a ``mha.MultiHeadAttention``,
or a ``mha.LatentAttention`` for the latent-attention families): heads, grouped keys, biases,
the scale, rotary positions with their scaling, ALiBi, sliding or full attention, QK-norm,
sinks and soft-capping, as the config says. Everything else is a row of :data:`.families.FAMILIES`
(where the tensors lie, the norms, the residual stream, the MLP, the config's scales),
computed by the functions of :mod:`.layers`.

A config it cannot compute exactly is refused, naming the setting, never approximated.

>>> sorted(FAMILIES)[:3]
['apertus', 'apertus1p5_text', 'arcee']
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..api.cache import KVCache
from ..api.module import MultiHeadAttention
from ..api.paged_cache import PagedKVCache
from ..api.pretrained import from_pretrained
from ..integrations.checkpoint import open_checkpoint
from ..integrations.readers import FAMILIES as READERS
from ..integrations.readers.config import Settings
from ..integrations.readers.layouts import attention_prefix
from .families import FAMILIES, NOT_WRITTEN
from .gemma import (
    GemmaLayer,
    PerLayerInputs,
    altup_layer,
    gemma4_moe,
    merge,
    sparse_mlp,
    spread,
)
from .greedy import Greedy
from .layers import (
    ACTIVATIONS,
    LEARNED_ACTIVATIONS,
    NORMS,
    Function,
    Tensors,
    UnsupportedModelError,
    attention_workers,
    by_rows,
    compute_dtype,
    ctrl_positions,
    deepseek_mlp,
    fused_mlp,
    gated_mlp,
    gpt_oss_mlp,
    inputs_first,
    one_team,
    plain_mlp,
    product,
    sinusoidal_positions,
    softmax_experts,
)

__all__ = ["CACHES", "FAMILIES", "Decoder", "attention_layer"]

CACHES = ("contiguous", "paged", "int8", "int4", "kivi8", "kivi4")
BLOCK = 16  # positions per block of a paged cache
KIVI_BLOCK = 32  # a KIVI cache's: its keys' groups of 32 tokens lie within blocks


def attention_layer(directory: str | Path, layer: int, dtype: Any = np.float32) -> Any:
    """Layer ``layer``'s attention alone, as the decoder builds it: ``attention(x,
    mask=True)`` on hidden states ``x (B, L, hidden_size)``, or with
    ``cache=attention.new_cache(B)``."""
    kind = _open(directory).config.get("model_type")
    if kind not in FAMILIES:
        raise _unsupported(kind)
    return from_pretrained(directory, layer=layer, dtype=dtype)


def _unsupported(kind: Any) -> UnsupportedModelError:
    if kind in NOT_WRITTEN:
        return UnsupportedModelError(
            f"mha reads the attention of model_type={kind!r} (mha.from_pretrained) but does "
            f"not compute its whole decoder: {NOT_WRITTEN[kind]}"
        )
    return UnsupportedModelError(
        f"mha.models computes the decoders of {len(FAMILIES)} families "
        f"(mha.models.FAMILIES: {', '.join(sorted(FAMILIES)[:4])}, ...); the config says "
        f"model_type={kind!r}"
    )


# ---------------------------------------------------------------- the decoder


Weights = tuple[np.ndarray | None, np.ndarray | None]  # a norm's weight and bias


class Layer(NamedTuple):
    """One decoder layer: its attention, its norms' weights and biases before attention,
    after it, before the MLP and after it (``None`` where the family has none), its MLP,
    and Gemma 3n's or Gemma 4's stages of its own."""

    attention: Any
    norms: tuple[Weights | None, ...]
    mlp: Function
    stages: GemmaLayer | None = None  # Gemma 3n's and Gemma 4's (.gemma)


class Decoder(Greedy):
    """A causal language model: embeddings, decoder layers of attention and MLP, head.

    ``Decoder(directory, dtype=np.float32)`` computes in ``dtype`` (float32 or float64),
    the checkpoint's weights converted once. The tensors are read layer by layer, each
    layer's own alone; a tensor the family's layer does not compute is refused by name.
    ``cache`` is the kind of KV cache each layer keeps: ``"contiguous"`` (``mha.KVCache``),
    ``"paged"`` (``mha.PagedKVCache``, blocks of 16), ``"int8"`` and ``"int4"`` (a
    paged cache quantized per token, groups of 32; float32 only), or ``"kivi8"`` and
    ``"kivi4"`` (KIVI: keys per channel over groups of 32 tokens, values per token, blocks
    of 32; float32 only). A model whose layers share another's keys and values (Gemma 3n's,
    Gemma 4's) takes the contiguous cache alone.
    """

    def __new__(
        cls, directory: str | Path, dtype: Any = np.float32, cache: str = "contiguous"
    ) -> Any:
        """A :class:`Decoder`, or CPM-Ant's decoder of its own (:mod:`.cpmant`)."""
        if cls is Decoder and _open(directory).config.get("model_type") == "cpmant":
            from .cpmant import CpmAntDecoder

            return CpmAntDecoder(directory, dtype, cache)
        return super().__new__(cls)

    def __init__(
        self, directory: str | Path, dtype: Any = np.float32, cache: str = "contiguous"
    ) -> None:
        self.dtype = compute_dtype(dtype)
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {', '.join(CACHES)}; got {cache!r}")
        if cache not in ("contiguous", "paged") and self.dtype != np.float32:
            raise ValueError(f"a {cache} cache is read back in float32: use dtype=float32")
        self.cache = cache
        checkpoint = self.checkpoint = _open(directory)
        config = self.config = checkpoint.config
        kind = config.get("model_type")
        if kind not in FAMILIES:
            raise _unsupported(kind)
        reader = READERS[kind]
        self.settings = Settings(checkpoint, kind, reader.defaults, reader.keys)
        get = self.settings.get
        family = self.family = FAMILIES[kind].for_config(get)
        self.activation = self._activation(family.activation, family.activation_key)
        self.norm_kind = NORMS[family.norm]
        self.eps = float(family.eps if family.eps is not None else self._setting(family.eps_key))
        self.vocab_size = int(self._setting("vocab_size"))
        count = int(self._setting("num_hidden_layers"))
        self.softcap = get("final_logit_softcapping")
        scales = family.scales
        self.embed_scale, self.residual_scale, self.logit_scale = (
            None if scale is None else self.dtype.type(scale)
            for scale in (scales.embed(get), scales.residual(get), scales.logits(get))
        )
        # transformers' Phi-3 recomputes the cache when the sequence first passes this length
        # (its longrope switches from the short factors to the long ones there)
        self.recompute_at = None
        if kind == "phi3":
            self.recompute_at = config.get("original_max_position_embeddings")
        top = family.top
        keys = set(checkpoint.keys())
        tied = config.get("tie_word_embeddings", False) or f"{top.head}.weight" not in keys
        names = [f"{top.embed}.weight"]
        if top.positions is not None and top.positions.kind == "learned":
            names.append(f"{top.positions.name}.weight")
        stage = top.before_head
        if stage is not None:
            dense = (f"{stage.name}.dense.weight", f"{stage.name}.dense.bias")
            names += [name for name in dense if name in keys]
        for norm in (top.embed_norm, top.norm, None if stage is None else f"{stage.name}.norm"):
            names += self._norm_names(norm, keys)
        if top.head is not None:  # a tied head's bias is its own (ModernBERT's)
            head = [f"{top.head}.bias"] if tied else [f"{top.head}.weight", f"{top.head}.bias"]
            names += [name for name in head if name in keys]
        names += self._stage_names()
        weights = self._read(checkpoint, names)
        # The head's weight laid out (hidden, vocab), as x @ W reads it (a token's logits
        # read it in order: 113 MB of SmolLM2's in 1.9 ms against 4.0, two threads); a tied
        # head's embeddings are its columns, the same memory.
        embed = weights.pop(f"{top.embed}.weight")  # (vocab, hidden)
        head_weight = embed if tied else weights.pop(f"{top.head}.weight")
        self.head_by_inputs = inputs_first(head_weight)
        del head_weight
        self.embed = self.head_by_inputs.T if tied else embed  # (vocab, hidden)
        del embed
        self.per_layer_inputs, self.streams = self._stages(weights, count)
        self.positions, self.position_count = self._position_embeddings(top.positions, weights)
        self.embed_norm = self._norm_weights(top.embed_norm, weights)
        self.norm = self._norm_weights(top.norm, weights)
        self.before_head = None if stage is None else self._head_stage(stage, weights)
        self.head_bias = weights.get(f"{top.head}.bias")
        layer_keys = [
            {key for key in keys if key.startswith(f"{top.layers}.{i}.")} for i in range(count)
        ]
        others = keys.difference(names, *layer_keys)
        if others:
            raise UnsupportedModelError(f"mha does not compute {', '.join(sorted(others))}")
        self.layers = [
            self._layer(checkpoint, directory, i, held) for i, held in enumerate(layer_keys)
        ]

    def _stage_names(self) -> list[str]:
        """The tensors of Gemma 3n's and Gemma 4's stages outside the layers: the per-layer
        inputs' and the projections in and out of AltUp's streams."""
        stages, get = self.family.stages, self.settings.get
        names: list[str] = []
        if stages is not None and stages.per_layer and get("hidden_size_per_layer_input", 256):
            names += PerLayerInputs.NAMES
        if self.family.residual == "altup":
            n = int(get("altup_num_inputs", 4))
            for kind in ("altup_projections", "altup_unembed_projections"):
                names += [f"model.{kind}.{i}.weight" for i in range(n - 1)]
        return names

    def _stages(self, weights: dict[str, np.ndarray], count: int) -> tuple[Any, Any]:
        """The per-layer inputs (``None``: none) and AltUp's projections in and out of its
        streams (``None``: one stream)."""
        per_layer = streams = None
        if PerLayerInputs.NAMES[0] in weights:
            assert self.family.stages is not None
            per_layer = PerLayerInputs(weights, count, self.eps, self.family.stages.clamp)
        if self.family.residual == "altup":
            n = int(self.settings.get("altup_num_inputs", 4))
            streams = tuple(
                [weights[f"model.{kind}.{i}.weight"] for i in range(n - 1)]
                for kind in ("altup_projections", "altup_unembed_projections")
            )
        return per_layer, streams

    def _setting(self, key: str) -> Any:
        value = self.settings.get(key)
        if value is None:
            raise UnsupportedModelError(
                f"config.json has no {self.settings.name(key)}, which mha needs"
            )
        return value

    def _activation(self, name: str | None, key: str) -> Any:
        """The family's activation, else the config's ``key``: a function, or a builder
        of each layer's from its tensors (:data:`.layers.LEARNED_ACTIVATIONS`)."""
        name = name or self.settings.get(key, "silu")
        if name in LEARNED_ACTIVATIONS:
            return LEARNED_ACTIVATIONS[name]
        if name not in ACTIVATIONS:
            raise UnsupportedModelError(f"mha does not implement {key}={name!r}")
        return ACTIVATIONS[name]

    def _position_embeddings(self, positions: Any, weights: dict[str, np.ndarray]) -> Any:
        """The position embeddings as a function of their rows (``None``: the family has
        none) and how many rows there are (``None``: as many as asked). A table computed
        in transformers (XGLM's, CTRL's) is computed in float32 as it is, then cast."""
        if positions is None:
            return None, None
        if positions.kind == "learned":
            table = weights[f"{positions.name}.weight"]
            return (lambda rows: table[rows]), len(table)
        width, dtype = self.embed.shape[1], self.dtype
        if positions.kind == "ctrl":
            count = int(self._setting("n_positions"))
            return (lambda rows: ctrl_positions(rows, width).astype(dtype)), count
        padding = positions.padding_key and self.settings.get(positions.padding_key)
        return (lambda rows: sinusoidal_positions(rows, width, padding).astype(dtype)), None

    def _head_stage(self, stage: Any, weights: dict[str, np.ndarray]) -> Function:
        """ModernBERT's ``norm(act(dense(x)))`` before the head."""
        act = self._activation(None, stage.activation_key)
        dense, norm = f"{stage.name}.dense", f"{stage.name}.norm"
        weight, bias = weights[f"{dense}.weight"].T, weights.get(f"{dense}.bias")
        norm_weights = (weights.get(f"{norm}.weight"), weights.get(f"{norm}.bias"))

        def before_head(x: np.ndarray) -> np.ndarray:
            x = x @ weight if bias is None else x @ weight + bias
            return self._norm(act(x), norm_weights)

        return before_head

    def _norm_names(self, name: str | None, keys: set[str]) -> list[str]:
        """The tensors of norm ``name`` the family's kind of norm reads (its bias where the
        checkpoint has one and the kind takes one)."""
        if name is None:
            return []
        names = [f"{name}.weight"] if self.norm_kind.weight else []
        if self.norm_kind.bias and f"{name}.bias" in keys:
            names.append(f"{name}.bias")
        return names

    def _norm_weights(self, name: str | None, arrays: dict[str, np.ndarray]) -> Weights | None:
        if name is None:
            return None
        return arrays.get(f"{name}.weight"), arrays.get(f"{name}.bias")

    def _layer(self, checkpoint: Any, directory: Any, i: int, held: set[str]) -> Layer:
        """Layer ``i``: its attention from mha, its norms and MLP read here."""
        family, top = self.family, self.family.top
        prefix = f"{top.layers}.{i}."
        inside = attention_prefix(checkpoint, i, READERS[self.config["model_type"]].tensors.path)
        names = sorted(key for key in held if not key.startswith(inside))
        arrays = self._read(checkpoint, names)
        tensors = Tensors(prefix, {name[len(prefix) :]: arrays[name] for name in names})
        norms = tuple(
            None
            if name is None
            else (
                tensors.take(f"{name}.weight") if self.norm_kind.weight else None,
                tensors.get(f"{name}.bias") if self.norm_kind.bias else None,
            )
            for name in (family.first_norms if i == 0 and family.first_norms else family.norms)
        )
        kind, act = family.mlp, self.activation
        if act in LEARNED_ACTIVATIONS.values():
            act = act(tensors, family.act_fn)
        sparsity = self._sparsity(i)
        mlp = (
            sparse_mlp(tensors, act, sparsity)
            if sparsity
            else gated_mlp(tensors, act, "", family.mlp_names)
            if kind == "gated"
            else plain_mlp(tensors, act, family.mlp_names, family.conv1d)
            if kind == "plain"
            else fused_mlp(tensors, act)
            if kind == "fused"
            else fused_mlp(tensors, act, family.mlp_names)
            if kind == "glu"
            else gpt_oss_mlp(tensors, self.config)
            if kind == "gpt_oss"
            else softmax_experts(tensors, self.config, act, i, family)
            if kind == "experts"
            else deepseek_mlp(tensors, self.config, act, i)
        )
        if family.stages is not None and self.settings.get("enable_moe_block"):
            k = int(self._setting("top_k_experts"))  # Gemma 4's experts beside its MLP
            before = norms[2]
            assert before is not None  # its pre_feedforward_layernorm
            mlp = gemma4_moe(tensors, act, mlp, before[0], self._rms, self.eps, k)
            norms = (*norms[:2], None, norms[3])  # the MLP's first norm inside it
        stages = None
        if family.stages is not None:
            altup = None
            if family.residual == "altup":
                altup = {
                    "n": int(self.settings.get("altup_num_inputs", 4)),
                    "active": int(self.settings.get("altup_active_idx", 0)),
                    "correct_scale": bool(self.settings.get("altup_correct_scale", True)),
                    "D": self.embed.shape[1],
                }
            per_layer = self.per_layer_inputs is not None
            stages = GemmaLayer(tensors, act, self._rms, per_layer, family.stages.scalar, altup)
        tensors.check_all_taken()
        attention = from_pretrained(directory, layer=i, dtype=self.dtype)
        return Layer(attention, norms, mlp, stages)

    def _sparsity(self, i: int) -> float:
        """Gemma 3n's activation sparsity of layer ``i``'s MLP (0: none); as its config
        class fills it in, 0.95 in the first ten layers of a model of more than ten."""
        if self.family.residual != "altup":
            return 0.0
        count = int(self._setting("num_hidden_layers"))
        pattern = self.settings.get("activation_sparsity_pattern")
        if pattern is None:
            pattern = [0.95 if count > 10 and j < 10 else 0.0 for j in range(count)]
        if isinstance(pattern, (int, float)):
            pattern = [pattern] * count
        return float(pattern[i])

    def _rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """The family's norm with a weight and no bias (Gemma 3n's and Gemma 4's stages)."""
        return self.norm_kind.function(x, weight, None, self.eps)

    def _read(self, checkpoint: Any, names: list[str]) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = checkpoint.read(names, dtype=self.dtype)
        return arrays

    def new_caches(self, batch_size: int, capacity: int = 256) -> list[Any]:
        """One cache per layer, of the decoder's kind (a paged one with room for
        ``capacity`` tokens per sequence)."""
        sources = [getattr(layer.attention, "shares_kv_with", None) for layer in self.layers]
        if self.cache == "contiguous":
            return self._contiguous_caches(batch_size, capacity, sources)
        if any(source is not None for source in sources):
            raise UnsupportedModelError(
                f"a {self.cache} cache is not an mha.KVCache, which the layers of this model "
                f"that attend with another layer's keys and values read (layers "
                f"{[i for i, source in enumerate(sources) if source is not None]}): use the "
                "contiguous cache for this model"
            )
        caches = []
        for layer in self.layers:
            attention = layer.attention
            if not isinstance(attention, MultiHeadAttention):
                raise UnsupportedModelError(
                    f"a {self.cache} cache holds keys and values in pools of their own, but "
                    f"{type(attention).__name__} caches one latent per token (its values "
                    "inside its keys): use the contiguous cache for this model"
                )
            # A sliding layer's paged cache keeps every position; the call attends within
            # the layer's window (the same bits as the contiguous window cache).
            size = KIVI_BLOCK if self.cache.startswith("kivi") else BLOCK
            cache = PagedKVCache(
                batch_size * -(-capacity // size),
                size,
                attention.num_kv_heads,
                attention.head_dim,
                dtype=self.dtype,
                quantize=None if self.cache == "paged" else self.cache,
            )
            for b in range(batch_size):
                cache.add(b)
            caches.append(cache)
        return caches

    def _contiguous_caches(self, batch_size: int, capacity: int, sources: list[Any]) -> list[Any]:
        """One ``mha.KVCache`` per layer; a layer that attends with another's keys and values
        (KV sharing) is given that layer's cache, which keeps every position whatever its
        layer's window (the sharing layer's queries of a prompt see more than the window's
        last positions; the owner's calls attend within its window all the same)."""
        owners = {source for source in sources if source is not None}
        caches: list[Any] = []
        for i, (layer, source) in enumerate(zip(self.layers, sources, strict=True)):
            attention = layer.attention
            if source is not None:
                caches.append(caches[source])
            elif i in owners:
                caches.append(
                    KVCache(
                        batch_size,
                        attention.num_kv_heads,
                        attention.head_dim,
                        value_dim=attention.v_head_dim,
                        capacity=capacity,
                        dtype=attention.dtype,
                        sink_tokens=attention.sink_tokens,
                    )
                )
            else:
                caches.append(attention.new_cache(batch_size, capacity=capacity))
        return caches

    @property
    def head(self) -> np.ndarray:
        """The head's weight ``(vocab, hidden)``: logits are ``x @ head.T``."""
        return self.head_by_inputs.T

    def forward(
        self, ids: Any, caches: list[Any], query_lengths: Any = None, last: bool = False
    ) -> np.ndarray:
        """Logits ``(B, L, vocab)`` for the next tokens ``ids (B, L)`` of each sequence,
        appended to ``caches`` (with ``query_lengths``, only the first ``query_lengths[b]``
        of sequence ``b`` are real); ``last``: the last position's alone, ``(B, 1,
        vocab)``, what choosing the next token needs (every position still cached)."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be integer token ids (B, L); got {ids.dtype} {ids.shape}")
        if len(caches) != len(self.layers):
            raise ValueError(f"one cache per layer: {len(self.layers)}; got {len(caches)}")
        x = self._embed(ids, caches[0])
        inputs = None if self.per_layer_inputs is None else self.per_layer_inputs(ids, x)
        if self.streams is not None:
            x = spread(x, self.streams[0])
        with one_team(ids.size):
            for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
                p = None if inputs is None else inputs[:, :, i]
                x = self._decoder_layer(layer, x, cache, query_lengths, p)
            if last:  # each sequence's last real row
                rows = x.shape[1] - 1 if query_lengths is None else np.asarray(query_lengths) - 1
                x = x[np.arange(len(x)), rows][:, None]
            if self.streams is not None:
                x = merge(x, self.streams[1])
            if self.norm is not None:
                x = self._norm(x, self.norm)
            if self.before_head is not None:
                x = self.before_head(x)
            logits = product(x, self.head_by_inputs)
        if self.head_bias is not None:
            logits = logits + self.head_bias
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = np.tanh(logits / float(self.softcap)) * float(self.softcap)
        return np.asarray(logits)

    def attention_input(self, ids: Any, layer: int) -> tuple[np.ndarray, Any]:
        """What layer ``layer``'s attention reads for the token ids ``ids (B, L)``, whole
        sequences from the start: its input ``(B, L, hidden)`` (after the layer's norm
        before attention) and the attention (``attention(h, mask=True)`` computes its part
        of the layer)."""
        ids = np.asarray(ids)
        caches = self.new_caches(len(ids), capacity=ids.shape[1])
        x = self._embed(ids, caches[0])
        inputs = None if self.per_layer_inputs is None else self.per_layer_inputs(ids, x)
        if self.streams is not None:
            x = spread(x, self.streams[0])
        for index in range(layer):
            p = None if inputs is None else inputs[:, :, index]
            x = self._decoder_layer(self.layers[index], x, caches[index], None, p)
        stages = self.layers[layer].stages
        if stages is not None and stages.altup is not None:  # the active stream's prediction
            x = stages.altup.predict(x)[stages.altup.active]
        before = self.layers[layer].norms[0]
        if self.family.residual != "post" and before is not None:
            x = self._norm(x, before)
        return x, self.layers[layer].attention

    def _embed(self, ids: np.ndarray, cache: Any) -> np.ndarray:
        """The embeddings of ``ids``: scaled, with the positions after those ``cache`` has
        seen, normed, as the family does."""
        x = self.embed[ids]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.positions is not None:
            x = x + self._positions(ids.shape[1], cache)
        if self.embed_norm is not None:
            x = self._norm(x, self.embed_norm)
        return x

    def _positions(self, length: int, cache: Any) -> np.ndarray:
        """The position embeddings of the next ``length`` tokens of each sequence
        (``(B, length, hidden)``), from the positions ``cache`` has seen."""
        assert self.positions is not None and self.family.top.positions is not None
        start = np.asarray(cache.lengths)[:, None] + self.family.top.positions.offset
        rows = start + np.arange(length)
        if self.position_count is not None and rows.max() >= self.position_count:
            raise UnsupportedModelError(
                f"position {int(rows.max())} is past the {self.position_count} positions "
                f"this model has embeddings for"
            )
        return self.positions(rows)

    def _norm(self, x: np.ndarray, weights: Weights | None) -> np.ndarray:
        assert weights is not None
        function, eps = self.norm_kind.function, self.eps
        return by_rows(lambda rows: function(rows, *weights, eps), x)

    def _decoder_layer(
        self, layer: Layer, x: np.ndarray, cache: Any, lengths: Any, p: Any = None
    ) -> np.ndarray:
        """The attention and the MLP added to the residual stream ``x`` as the family adds
        them (:mod:`.families`), each with its norms; ``p``: the layer's per-layer input
        (Gemma 3n's and Gemma 4's, :mod:`.gemma`)."""
        before_attention, after_attention, before_mlp, after_mlp = layer.norms
        scale = self.residual_scale

        def branch(sublayer: Any, before: Any, after: Any, h: np.ndarray) -> np.ndarray:
            h = sublayer(h if before is None else self._norm(h, before))
            h = h if after is None else self._norm(h, after)
            return h if scale is None else h * scale

        def attention(h: np.ndarray) -> np.ndarray:
            options = {"query_lengths": lengths}
            workers = attention_workers()
            if workers is not None and _takes_workers(layer.attention):
                options["workers"] = workers
            return np.asarray(layer.attention(h, cache=cache, **options))

        residual = self.family.residual
        if residual == "altup":
            return altup_layer(layer, x, attention, self._rms, p)
        if residual == "parallel":
            a = self._norm(x, before_attention) if before_attention is not None else x
            m = a if before_mlp is None else self._norm(x, before_mlp)
            return x + attention(a) + layer.mlp(m)
        if residual == "post":
            x = self._norm(x + attention(x), after_attention)
            return self._norm(x + layer.mlp(x), after_mlp)
        x = x + branch(attention, before_attention, after_attention, x)
        x = x + branch(layer.mlp, before_mlp, after_mlp, x)
        return x if layer.stages is None else layer.stages.finish(x, p)


_TAKES_WORKERS: dict[type, bool] = {}


def _takes_workers(attention: Any) -> bool:
    """Whether an attention layer's call takes ``workers=`` (the variants' own calls may
    not), found once for each class."""
    kind = type(attention)
    if kind not in _TAKES_WORKERS:
        _TAKES_WORKERS[kind] = "workers" in inspect.signature(kind.forward).parameters
    return _TAKES_WORKERS[kind]


def _open(directory: str | Path) -> Any:
    """The checkpoint, its failures to read as :class:`UnsupportedModelError`."""
    try:
        return open_checkpoint(directory)
    except (OSError, ValueError) as error:
        raise UnsupportedModelError(str(error)) from None
