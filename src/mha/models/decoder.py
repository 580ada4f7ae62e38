# mypy: disable-error-code="no-any-return,assignment"
"""A whole decoder-only language model in NumPy, with mha's attention and KV cache: each
family's decoder layer a row of :data:`FAMILIES`, read from a transformers checkpoint folder
or a llama.cpp GGUF file (:func:`mha.integrations.checkpoint.open_checkpoint`), one layer's
tensors at a time.

Each layer's attention is ``mha.MultiHeadAttention.from_pretrained(path, layer=i)``
(``mha.LatentAttention`` for DeepSeek-V3): heads, grouped keys, biases, the scale, rotary
positions with their scaling, sliding or full attention, QK-norm, sinks and soft-capping, as
the config says. Everything else is in :mod:`.layers`, written from each family's
``modeling_<family>.py`` in transformers 5.24:

* Llama, Mistral, Qwen2, Qwen3: RMSNorm before attention and before the SwiGLU MLP.
* Phi-3: the same, with the MLP's gate and up projections fused in one ``gate_up_proj``.
* OLMo 2: RMSNorm after attention and after the MLP only, ``(w * x)`` then cast.
* Gemma 2 and Gemma 3: ``(1 + w)`` RMSNorms before and after both attention and the GELU
  (tanh) MLP, embeddings times ``sqrt(hidden_size)``, Gemma 2's final soft-capping.
* gpt-oss: OLMo 2's RMSNorm placed as Llama's; a mixture of experts, a softmax over the top
  router logits, each expert a clamped SwiGLU.
* DeepSeek-V3: Llama's norms; dense MLPs in the first layers, then a mixture of experts
  routed by group-limited sigmoid scores, with a shared expert.
* SmolLM3, Helium, Seed-OSS, CWM, InternLM 3: Llama's layer (their attention differs);
  Gemma: Gemma's ``(1 + w)`` norms before attention and the MLP, embeddings scaled; OLMo 3
  and EXAONE 4: OLMo 2's norms after attention and the MLP.
* Mixtral, Qwen3-MoE, OLMoE: Llama's norms, a mixture of SwiGLU experts routed by a softmax
  over the router's logits (the best ``num_experts_per_tok``, renormalised in Mixtral and
  where ``norm_topk_prob``).

A config it cannot compute exactly is refused, naming the setting, never approximated.

>>> sorted(FAMILIES)[:3]
['cwm', 'deepseek_v3', 'exaone4']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..api.latent import LatentAttention
from ..api.module import MultiHeadAttention
from ..api.paged_cache import PagedKVCache
from ..integrations.checkpoint import open_checkpoint
from .layers import (
    ACTIVATIONS,
    GATE_UP_DOWN,
    Function,
    Tensors,
    UnsupportedModelError,
    deepseek_mlp,
    fused_mlp,
    gated_mlp,
    gemma_norm,
    gpt_oss_mlp,
    llama_norm,
    olmo2_norm,
    softmax_experts,
)

__all__ = ["CACHES", "FAMILIES", "Decoder", "Family", "attention_layer"]

CACHES = ("contiguous", "paged", "int8", "int4", "kivi8", "kivi4")
BLOCK = 16  # positions per block of a paged cache
KIVI_BLOCK = 32  # a KIVI cache's: its keys' groups of 32 tokens lie within blocks
FEW = 4  # tokens in a step whose matrix products run on one BLAS thread

# ---------------------------------------------------------------- the families

PRE = ("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
POST = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    """What a family's decoder layer does around its attention."""

    norms: tuple[str | None, ...]
    """The layer's RMSNorms before attention, after it, before the MLP and after it."""
    norm: Callable[[np.ndarray, np.ndarray, float], np.ndarray] = llama_norm
    mlp: str = "gated"  # or "fused" (Phi-3), "gpt_oss", "deepseek", "experts"
    activation_key: str = "hidden_act"
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    attention: str = "MultiHeadAttention"  # mha's class: LatentAttention for DeepSeek
    experts: tuple[str, tuple[str, ...]] = ("mlp.", GATE_UP_DOWN)
    """Where a mixture's router (``gate``) and experts lie, and each expert's projections."""
    normalise: bool = False  # the top experts' weights renormalised whatever the config says


GEMMA = Family(SANDWICH, gemma_norm, activation_key="hidden_activation", embed_scale=True)
MIXTRAL = Family(
    PRE, mlp="experts", experts=("block_sparse_moe.", ("w1", "w3", "w2")), normalise=True
)
FAMILIES = {
    "llama": Family(PRE),
    "mistral": Family(PRE),
    "qwen2": Family(PRE),
    "qwen3": Family(PRE),
    "phi3": Family(PRE, mlp="fused"),
    "olmo2": Family(POST, olmo2_norm),
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "gpt_oss": Family(PRE, olmo2_norm, mlp="gpt_oss"),
    "deepseek_v3": Family(PRE, mlp="deepseek", attention="LatentAttention"),
    # families whose attention is one of the above's under other names (docs/pretrained.md)
    "smollm3": Family(PRE),
    "helium": Family(PRE),
    "seed_oss": Family(PRE),
    "cwm": Family(PRE),
    "internlm3": Family(PRE),
    "gemma": Family(PRE, gemma_norm, embed_scale=True),
    "olmo3": Family(POST, olmo2_norm),
    "exaone4": Family(POST),
    "mixtral": MIXTRAL,
    "qwen3_moe": Family(PRE, mlp="experts"),
    "olmoe": Family(PRE, mlp="experts"),
}
"""The families whose decoder layers mha writes out, by ``model_type``; others are
refused by name."""


def attention_layer(directory: str | Path, layer: int, dtype: Any = np.float32) -> Any:
    """Layer ``layer``'s attention alone, as the decoder builds it: ``attention(x,
    mask=True)`` on hidden states ``x (B, L, hidden_size)``, or with
    ``cache=attention.new_cache(B)``."""
    kind = _open(directory).config.get("model_type")
    if kind not in FAMILIES:
        raise _unsupported(kind)
    module = ATTENTION[FAMILIES[kind].attention]
    return module.from_pretrained(directory, layer=layer, dtype=dtype)


def _unsupported(kind: Any) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"mha computes the {', '.join(FAMILIES)} decoders; the config says model_type={kind!r}"
    )


# ---------------------------------------------------------------- the decoder


class Layer(NamedTuple):
    """One decoder layer: its attention, its RMSNorm weights before attention, after it,
    before the MLP and after it (``None`` where the family has none), and its MLP."""

    attention: Any
    norms: tuple[np.ndarray | None, ...]
    mlp: Function


class Decoder:
    """A causal language model: embeddings, decoder layers of attention and MLP, head.

    ``Decoder(directory, dtype=np.float32)`` computes in ``dtype`` (float32 or float64),
    the checkpoint's weights converted once. The tensors are read layer by layer, each
    layer's own alone; a tensor the family's layer does not compute is refused by name.
    ``cache`` is the kind of KV cache each layer keeps: ``"contiguous"`` (``mha.KVCache``),
    ``"paged"`` (``mha.PagedKVCache``, blocks of 16), ``"int8"`` and ``"int4"`` (a
    paged cache quantized per token, groups of 32; float32 only), or ``"kivi8"`` and
    ``"kivi4"`` (KIVI: keys per channel over groups of 32 tokens, values per token, blocks
    of 32; float32 only).
    """

    def __init__(
        self, directory: str | Path, dtype: Any = np.float32, cache: str = "contiguous"
    ) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64; got {self.dtype}")
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
        family = self.family = FAMILIES[kind]
        activation = config.get(family.activation_key, "silu")
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"mha does not implement {family.activation_key}={activation!r}"
            )
        self.activation = ACTIVATIONS[activation]
        self.eps = float(_setting(config, "rms_norm_eps"))
        self.vocab_size = int(_setting(config, "vocab_size"))
        count = int(_setting(config, "num_hidden_layers"))
        self.softcap = config.get("final_logit_softcapping")
        # transformers' Phi-3 recomputes the cache when the sequence first passes this length
        # (its longrope switches from the short factors to the long ones there)
        self.recompute_at = None
        if kind == "phi3":
            self.recompute_at = config.get("original_max_position_embeddings")
        keys = set(checkpoint.keys())
        top = ["model.embed_tokens.weight", "model.norm.weight"]
        tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in keys
        weights = self._read(checkpoint, top if tied else [*top, "lm_head.weight"])
        self.embed = weights["model.embed_tokens.weight"]  # (vocab, hidden)
        self.embed_scale = None
        if family.embed_scale:  # a float32 scalar cast to the weights' dtype, as transformers
            hidden = int(_setting(config, "hidden_size"))
            self.embed_scale = self.dtype.type(np.float32(hidden**0.5))
        self.head = self.embed if tied else weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        layer_keys = [
            {key for key in keys if key.startswith(f"model.layers.{i}.")} for i in range(count)
        ]
        others = keys.difference(top, ["lm_head.weight"], *layer_keys)
        if others:
            raise UnsupportedModelError(f"mha does not compute {', '.join(sorted(others))}")
        self.layers = [
            self._layer(checkpoint, directory, i, held) for i, held in enumerate(layer_keys)
        ]

    def _layer(self, checkpoint: Any, directory: Any, i: int, held: set[str]) -> Layer:
        """Layer ``i``: its attention from mha, its norms and MLP read here."""
        prefix = f"model.layers.{i}."
        names = sorted(key for key in held if not key.startswith(f"{prefix}self_attn."))
        arrays = self._read(checkpoint, names)
        tensors = Tensors(prefix, {name[len(prefix) :]: arrays[name] for name in names})
        norms = tuple(
            tensors.take(f"{name}.weight") if name else None for name in self.family.norms
        )
        kind, act = self.family.mlp, self.activation
        mlp = (
            gated_mlp(tensors, act)
            if kind == "gated"
            else fused_mlp(tensors, act)
            if kind == "fused"
            else gpt_oss_mlp(tensors, self.config)
            if kind == "gpt_oss"
            else softmax_experts(tensors, self.config, act, i, self.family)
            if kind == "experts"
            else deepseek_mlp(tensors, self.config, act, i)
        )
        tensors.check_all_taken()
        module = ATTENTION[self.family.attention]
        return Layer(module.from_pretrained(directory, layer=i, dtype=self.dtype), norms, mlp)

    def _read(self, checkpoint: Any, names: list[str]) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = checkpoint.read(names, dtype=self.dtype)
        return arrays

    def new_caches(self, batch_size: int, capacity: int = 256) -> list[Any]:
        """One cache per layer, of the decoder's kind (a paged one with room for
        ``capacity`` tokens per sequence)."""
        if self.cache == "contiguous":
            return [
                layer.attention.new_cache(batch_size, capacity=capacity) for layer in self.layers
            ]
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

    def forward(self, ids: Any, caches: list[Any], query_lengths: Any = None) -> np.ndarray:
        """Logits ``(B, L, vocab)`` for the next tokens ``ids (B, L)`` of each sequence,
        appended to ``caches`` (with ``query_lengths``, only the first ``query_lengths[b]``
        of sequence ``b`` are real)."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be integer token ids (B, L); got {ids.dtype} {ids.shape}")
        if len(caches) != len(self.layers):
            raise ValueError(f"one cache per layer: {len(self.layers)}; got {len(caches)}")
        x = self.embed[ids]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        with _one_blas_thread(ids.size <= FEW):
            for layer, cache in zip(self.layers, caches, strict=True):
                x = self._decoder_layer(layer, x, cache, query_lengths)
            logits = self.family.norm(x, self.norm, self.eps) @ self.head.T
        if self.softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = np.tanh(logits / float(self.softcap)) * float(self.softcap)
        return np.asarray(logits)

    def _decoder_layer(self, layer: Layer, x: np.ndarray, cache: Any, lengths: Any) -> np.ndarray:
        """``x + attention(x)`` then ``x + mlp(x)``, each with the family's norms."""
        norm, eps = self.family.norm, self.eps
        before_attention, after_attention, before_mlp, after_mlp = layer.norms
        h = x if before_attention is None else norm(x, before_attention, eps)
        h = layer.attention(h, cache=cache, query_lengths=lengths)
        x = x + (h if after_attention is None else norm(h, after_attention, eps))
        h = layer.mlp(x if before_mlp is None else norm(x, before_mlp, eps))
        return x + (h if after_mlp is None else norm(h, after_mlp, eps))

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decoding: the prompt's continuation and the logits of each chosen token.
        ``prompt`` is a non-empty list of token ids below the vocabulary size."""
        steps = list(self.stream(prompt, new_tokens))
        return [token for token, _ in steps], [logits for _, logits in steps]

    def stream(self, prompt: list[int], new_tokens: int) -> Iterator[tuple[int, np.ndarray]]:
        """Greedy decoding, one token at a time: each new token with the logits it was
        chosen from (``(vocab,)``), as soon as it is chosen."""
        if not prompt or new_tokens < 0:
            raise ValueError(f"a non-empty prompt and new_tokens >= 0; got {prompt}, {new_tokens}")
        outside = [token for token in prompt if not 0 <= token < self.vocab_size]
        if outside:
            raise ValueError(
                f"token ids {outside} are outside the vocabulary of {self.vocab_size} "
                f"(ids 0 to {self.vocab_size - 1})"
            )
        sequence = list(prompt)
        if not new_tokens:
            return
        caches = self.new_caches(1, capacity=len(prompt) + new_tokens)
        logits = self.forward(np.array([sequence]), caches)[0, -1]
        for step in range(new_tokens):
            token = int(np.argmax(logits))
            yield token, logits
            if step == new_tokens - 1:
                return
            sequence.append(token)
            if len(sequence) == (self.recompute_at or 0) + 1:  # Phi-3 past its short rope
                caches = self.new_caches(1, capacity=len(prompt) + new_tokens)
                logits = self.forward(np.array([sequence]), caches)[0, -1]
            else:
                logits = self.forward(np.array([sequence[-1:]]), caches)[0, -1]


def _one_blas_thread(few: bool) -> Any:
    """BLAS on one thread for a step of a few tokens, where the matrix-vector products
    gain nothing from more threads and lose much when the cores are shared (threadpoolctl,
    the ``fast`` extra, where installed)."""
    if not few:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def _open(directory: str | Path) -> Any:
    """The checkpoint, its failures to read as :class:`UnsupportedModelError`."""
    try:
        return open_checkpoint(directory)
    except (OSError, ValueError) as error:
        raise UnsupportedModelError(str(error)) from None


def _setting(config: dict[str, Any], name: str) -> Any:
    if config.get(name) is None:
        raise UnsupportedModelError(f"config.json has no {name}, which mha needs")
    return config[name]


ATTENTION: dict[str, Any] = {
    "MultiHeadAttention": MultiHeadAttention,
    "LatentAttention": LatentAttention,
}
"""mha's attention classes, by the name a :class:`Family` gives."""
