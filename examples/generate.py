"""Whole decoder-only language models in NumPy, with mha's attention and KV cache, greedily.

It reads a directory written by transformers' ``save_pretrained`` (``config.json`` and
``model.safetensors``, or the shards of ``model.safetensors.index.json``; bfloat16 or
float32) through ``mha.integrations.checkpoint.Checkpoint``, one layer's tensors at a time.
Each layer's attention is ``mha.MultiHeadAttention.from_pretrained(directory, layer=i)``
(``mha.LatentAttention`` for DeepSeek-V3): heads, grouped keys, biases, the scale, rotary
positions with their scaling, sliding or full attention, QK-norm, sinks and soft-capping, as
the config says. Everything else is a few lines below, written from each family's
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

RMSNorm computes in float32 whatever the compute dtype, as transformers does. A config it
cannot compute exactly is refused, naming the setting, never approximated.

    python examples/generate.py MODEL_DIR 1 2 3 --new-tokens 20 [--dtype float64]
                                [--cache paged|int8|int4|kivi8|kivi4]

needs NumPy and mha, nothing else: bfloat16 tensors are read as the float32 they are
exactly, then converted to the compute dtype (``--dtype``, float32 by default).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import mha
from mha.integrations.checkpoint import Checkpoint

Function = Callable[[np.ndarray], np.ndarray]


CACHES = ("contiguous", "paged", "int8", "int4", "kivi8", "kivi4")
BLOCK = 16  # positions per block of a paged cache
KIVI_BLOCK = 32  # a KIVI cache's: its keys' groups of 32 tokens lie within blocks


class UnsupportedModelError(ValueError):
    """A checkpoint this example cannot compute exactly (or cannot read)."""


# ---------------------------------------------------------------- activations and norms


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))``, as ``(1 + tanh(x / 2)) / 2`` (no overflow)."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (transformers' ``gelu_pytorch_tanh``)."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


ACTIVATIONS = {"silu": silu, "swish": silu, "gelu_pytorch_tanh": gelu_tanh}


def _normalise(x: np.ndarray, eps: float) -> np.ndarray:
    """``x / rms(x)`` in float32, as every transformers RMSNorm computes it."""
    x = x.astype(np.float32)
    return x * (1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps))


def llama_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Llama's RMSNorm: cast back to ``x``'s dtype, then times the weight."""
    return weight * _normalise(x, eps).astype(x.dtype)


def olmo2_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """OLMo 2's (and gpt-oss's): times the weight, then cast back."""
    return (weight * _normalise(x, eps)).astype(x.dtype)


def gemma_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gemma's: times ``1 + weight`` in float32 (its weights start at zero), then cast back."""
    return (_normalise(x, eps) * (1.0 + weight.astype(np.float32))).astype(x.dtype)


# ---------------------------------------------------------------- MLPs


class Tensors:
    """One layer's tensors by their names under the layer's prefix; each MLP takes its own,
    and what no one takes is refused (a tensor this example would not compute)."""

    def __init__(self, prefix: str, arrays: dict[str, np.ndarray]) -> None:
        self.prefix, self.arrays = prefix, dict(arrays)

    def take(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise UnsupportedModelError(f"the checkpoint has no {self.prefix}{name}")
        return self.arrays.pop(name)

    def get(self, name: str) -> np.ndarray | None:
        return self.arrays.pop(name, None)

    def check_all_taken(self) -> None:
        if self.arrays:
            names = ", ".join(self.prefix + name for name in sorted(self.arrays))
            raise UnsupportedModelError(f"this example does not compute {names}")


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def linear(tensors: Tensors, name: str) -> Function:
    """``nn.Linear`` ``name``: ``x @ weight.T + bias``, the bias where the checkpoint has one."""
    weight, bias = tensors.take(f"{name}.weight"), tensors.get(f"{name}.bias")
    return lambda x: x @ weight.T if bias is None else x @ weight.T + bias


def gated_mlp(
    tensors: Tensors, act: Function, prefix: str = "mlp.", names: tuple[str, ...] = GATE_UP_DOWN
) -> Function:
    """Llama's SwiGLU (Gemma's GELU): ``down(act(gate(h)) * up(h))``, its projections named
    ``names`` under ``prefix``."""
    gate, up, down = (linear(tensors, f"{prefix}{name}") for name in names)
    return lambda h: down(act(gate(h)) * up(h))


def fused_mlp(tensors: Tensors, act: Function) -> Function:
    """Phi-3's: one ``gate_up_proj``, the gate its first half."""
    gate_up, down = linear(tensors, "mlp.gate_up_proj"), linear(tensors, "mlp.down_proj")

    def mlp(h: np.ndarray) -> np.ndarray:
        gate, up = np.split(gate_up(h), 2, axis=-1)
        return down(act(gate) * up)

    return mlp


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` largest scores of each row, largest first (``torch.topk``)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def mixture(experts: list[Function], h: np.ndarray, chosen: np.ndarray, weights: Any) -> Any:
    """``sum_k weights[t, k] * experts[chosen[t, k]](h[t])`` for each token ``t`` of
    ``h (N, D)``, expert by expert, as transformers' eager experts add them up."""
    out = np.zeros_like(h)
    for e, expert in enumerate(experts):
        rows, slots = np.nonzero(chosen == e)  # each token picks an expert once at most
        if rows.size:
            out[rows] += expert(h[rows]) * weights[rows, slots, None]
    return out


def gpt_oss_mlp(tensors: Tensors, config: dict[str, Any]) -> Function:
    """gpt-oss's mixture: a softmax over the ``num_experts_per_tok`` largest router logits;
    experts ``(E, D, 2I)`` in the ``x @ W`` layout, gate and up interleaved, clamped to
    ``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    router = linear(tensors, "mlp.router")
    W_gate_up, b_gate_up = (tensors.take(f"mlp.experts.gate_up_proj{s}") for s in ("", "_bias"))
    W_down, b_down = (tensors.take(f"mlp.experts.down_proj{s}") for s in ("", "_bias"))
    k, alpha = int(config["num_experts_per_tok"]), float(config["swiglu_alpha"])
    limit = float(config["swiglu_limit"])

    def expert(e: int) -> Function:
        def run(x: np.ndarray) -> np.ndarray:
            gate_up = x @ W_gate_up[e] + b_gate_up[e]
            gate = np.minimum(gate_up[..., ::2], limit)
            up = np.clip(gate_up[..., 1::2], -limit, limit)
            return ((up + 1.0) * (gate * sigmoid(gate * alpha))) @ W_down[e] + b_down[e]

        return run

    experts = [expert(e) for e in range(len(W_gate_up))]

    def mlp(h: np.ndarray) -> np.ndarray:
        x = h.reshape(-1, h.shape[-1])
        logits = router(x)
        chosen = top_k(logits, k)
        top = np.take_along_axis(logits, chosen, axis=-1)
        weights = np.exp(top - top[:, :1])
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return np.asarray(mixture(experts, x, chosen, weights).reshape(h.shape))

    return mlp


def softmax_experts(
    tensors: Tensors, config: dict[str, Any], act: Function, layer: int, family: Any
) -> Function:
    """Mixtral's, Qwen3-MoE's and OLMoE's mixtures: in float32, a softmax over the router's
    logits, the ``num_experts_per_tok`` best experts weighted by their probabilities
    (renormalised where ``norm_topk_prob``, always in Mixtral), each a SwiGLU. Qwen3-MoE's
    layers in ``mlp_only_layers``, or off its ``decoder_sparse_step``, are dense."""
    prefix, names = family.experts
    sparse = layer not in (config.get("mlp_only_layers") or []) and (
        (layer + 1) % int(config.get("decoder_sparse_step") or 1) == 0
    )
    if not sparse:
        return gated_mlp(tensors, act)
    router = tensors.take(f"{prefix}gate.weight")
    k, normalise = int(config["num_experts_per_tok"]), family.normalise or config["norm_topk_prob"]
    experts = [gated_mlp(tensors, act, f"{prefix}experts.{e}.", names) for e in range(len(router))]

    def mlp(h: np.ndarray) -> np.ndarray:
        x = h.reshape(-1, h.shape[-1])
        logits = (x @ router.T).astype(np.float32)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        chosen = top_k(probs, k)
        weights = np.take_along_axis(probs, chosen, axis=-1)
        if normalise:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return np.asarray(mixture(experts, x, chosen, weights.astype(x.dtype)).reshape(h.shape))

    return mlp


def deepseek_mlp(tensors: Tensors, config: dict[str, Any], act: Function, layer: int) -> Function:
    """DeepSeek-V3's: a dense MLP in the first ``first_k_dense_replace`` layers; then, in
    float32, sigmoid scores plus ``e_score_correction_bias`` choose the ``topk_group``
    groups of experts with the largest two-best sums and the ``num_experts_per_tok`` best
    experts in them, weighted by their scores (normalised with ``norm_topk_prob``) times
    ``routed_scaling_factor``; a shared expert is added to the mixture."""
    if layer < int(config.get("first_k_dense_replace") or 0):
        return gated_mlp(tensors, act)
    router = tensors.take("mlp.gate.weight").astype(np.float32)
    bias = tensors.take("mlp.gate.e_score_correction_bias").astype(np.float32)
    E, groups = len(router), int(config["n_group"])
    k, k_groups = int(config["num_experts_per_tok"]), int(config["topk_group"])
    scaling, normalise = float(config["routed_scaling_factor"]), config["norm_topk_prob"]
    experts = [gated_mlp(tensors, act, f"mlp.experts.{e}.") for e in range(E)]
    shared = gated_mlp(tensors, act, "mlp.shared_experts.")

    def mlp(h: np.ndarray) -> np.ndarray:
        x = h.reshape(-1, h.shape[-1])
        scores = sigmoid(x.astype(np.float32) @ router.T)  # (N, E)
        choice = (scores + bias).reshape(len(x), groups, E // groups)
        best_two = np.sort(choice, axis=-1)[..., -2:].sum(axis=-1)  # (N, groups)
        kept = np.zeros(best_two.shape, dtype=bool)
        np.put_along_axis(kept, top_k(best_two, k_groups), True, axis=-1)
        choice = np.where(kept[..., None], choice, -np.inf).reshape(len(x), E)
        chosen = top_k(choice, k)
        weights = np.take_along_axis(scores, chosen, axis=-1)
        if normalise:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        mixed = mixture(experts, x, chosen, weights * scaling)
        return np.asarray(mixed.reshape(h.shape) + shared(h))

    return mlp


# ---------------------------------------------------------------- the families

PRE = ("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH = ("input_layernorm", "post_attention_layernorm",
            "pre_feedforward_layernorm", "post_feedforward_layernorm")  # fmt: skip
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
MIXTRAL = Family(PRE, mlp="experts", experts=("block_sparse_moe.", ("w1", "w3", "w2")),
                 normalise=True)  # fmt: skip
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
"""The families whose decoder layers this example writes out, by ``model_type``; others are
refused by name."""


def attention_layer(directory: str | Path, layer: int, dtype: Any = np.float32) -> Any:
    """Layer ``layer``'s attention alone, as the decoder builds it: ``attention(x,
    mask=True)`` on hidden states ``x (B, L, hidden_size)``, or with
    ``cache=attention.new_cache(B)``."""
    kind = _open(directory).config.get("model_type")
    if kind not in FAMILIES:
        raise _unsupported(kind)
    module = getattr(mha, FAMILIES[kind].attention)
    return module.from_pretrained(directory, layer=layer, dtype=dtype)


def _unsupported(kind: Any) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"this example computes the {', '.join(FAMILIES)} decoders; the config says "
        f"model_type={kind!r}"
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
        checkpoint = _open(directory)
        config = self.config = checkpoint.config
        kind = config.get("model_type")
        if kind not in FAMILIES:
            raise _unsupported(kind)
        family = self.family = FAMILIES[kind]
        activation = config.get(family.activation_key, "silu")
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"this example does not implement {family.activation_key}={activation!r}"
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
        layer_keys = [{key for key in keys if key.startswith(f"model.layers.{i}.")}
                      for i in range(count)]  # fmt: skip
        others = keys.difference(top, ["lm_head.weight"], *layer_keys)
        if others:
            raise UnsupportedModelError(
                f"this example does not compute {', '.join(sorted(others))}"
            )
        self.layers = [
            self._layer(checkpoint, directory, i, held) for i, held in enumerate(layer_keys)
        ]

    def _layer(self, checkpoint: Any, directory: Any, i: int, held: set[str]) -> Layer:
        """Layer ``i``: its attention from mha, its norms and MLP read here."""
        prefix = f"model.layers.{i}."
        names = sorted(key for key in held if not key.startswith(f"{prefix}self_attn."))
        arrays = self._read(checkpoint, names)
        tensors = Tensors(prefix, {name[len(prefix) :]: arrays[name] for name in names})
        norms = tuple(tensors.take(f"{name}.weight") if name else None
                      for name in self.family.norms)  # fmt: skip
        kind, act = self.family.mlp, self.activation
        mlp = (
            gated_mlp(tensors, act) if kind == "gated"
            else fused_mlp(tensors, act) if kind == "fused"
            else gpt_oss_mlp(tensors, self.config) if kind == "gpt_oss"
            else softmax_experts(tensors, self.config, act, i, self.family) if kind == "experts"
            else deepseek_mlp(tensors, self.config, act, i)
        )  # fmt: skip
        tensors.check_all_taken()
        module = getattr(mha, self.family.attention)
        return Layer(module.from_pretrained(directory, layer=i, dtype=self.dtype), norms, mlp)

    def _read(self, checkpoint: Any, names: list[str]) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = checkpoint.read(names, dtype=self.dtype)
        return arrays

    def new_caches(self, batch_size: int, capacity: int = 256) -> list[Any]:
        """One cache per layer, of the decoder's kind (a paged one with room for
        ``capacity`` tokens per sequence)."""
        if self.cache == "contiguous":
            return [layer.attention.new_cache(batch_size, capacity=capacity)
                    for layer in self.layers]  # fmt: skip
        caches = []
        for layer in self.layers:
            attention = layer.attention
            if not isinstance(attention, mha.MultiHeadAttention):
                raise UnsupportedModelError(
                    f"a {self.cache} cache holds keys and values in pools of their own, but "
                    f"{type(attention).__name__} caches one latent per token (its values "
                    "inside its keys): use the contiguous cache for this model"
                )
            # A sliding layer's paged cache keeps every position; the call attends within
            # the layer's window (the same bits as the contiguous window cache).
            size = KIVI_BLOCK if self.cache.startswith("kivi") else BLOCK
            cache = mha.PagedKVCache(
                batch_size * -(-capacity // size), size, attention.num_kv_heads,
                attention.head_dim, dtype=self.dtype,
                quantize=None if self.cache == "paged" else self.cache,
            )  # fmt: skip
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
        if not prompt or new_tokens < 0:
            raise ValueError(f"a non-empty prompt and new_tokens >= 0; got {prompt}, {new_tokens}")
        outside = [token for token in prompt if not 0 <= token < self.vocab_size]
        if outside:
            raise ValueError(
                f"token ids {outside} are outside the vocabulary of {self.vocab_size} "
                f"(ids 0 to {self.vocab_size - 1})"
            )
        sequence = list(prompt)
        caches = self.new_caches(1, capacity=len(prompt) + new_tokens)
        logits = self.forward(np.array([sequence]), caches)[0, -1]
        tokens, steps = [], []
        for _ in range(new_tokens):
            steps.append(logits)
            tokens.append(int(np.argmax(logits)))
            sequence.append(tokens[-1])
            if len(sequence) == (self.recompute_at or 0) + 1:  # Phi-3 past its short rope
                caches = self.new_caches(1, capacity=len(prompt) + new_tokens)
                logits = self.forward(np.array([sequence]), caches)[0, -1]
            else:
                logits = self.forward(np.array([sequence[-1:]]), caches)[0, -1]
        return tokens, steps


def _open(directory: str | Path) -> Any:
    """The checkpoint, its failures to read as :class:`UnsupportedModelError`."""
    try:
        return Checkpoint(directory)
    except (OSError, ValueError) as error:
        raise UnsupportedModelError(str(error)) from None


def _setting(config: dict[str, Any], name: str) -> Any:
    if config.get(name) is None:
        raise UnsupportedModelError(f"config.json has no {name}, which this example needs")
    return config[name]


class _Parser(argparse.ArgumentParser):
    """argparse, with every mistake in one line on standard error (exit code 2)."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a directory that transformers' save_pretrained wrote")
    parser.add_argument("prompt", type=int, nargs="+", help="prompt token ids")
    parser.add_argument("--new-tokens", type=int, default=20, help="how many (default 20)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="the compute dtype (default float32)",
    )
    parser.add_argument("--cache", choices=CACHES, default="contiguous",
                        help="the KV cache: contiguous (default), paged, int8, int4, kivi8 "
                             "or kivi4")  # fmt: skip
    args = parser.parse_args(argv)
    if args.new_tokens < 0:
        parser.error(f"--new-tokens must be 0 or more; got {args.new_tokens}")
    try:
        decoder = Decoder(args.model, dtype=args.dtype, cache=args.cache)
        tokens, _ = decoder.generate(args.prompt, args.new_tokens)
    except (ValueError, OSError) as error:  # a model it cannot compute, or cannot read
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    print(" ".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
