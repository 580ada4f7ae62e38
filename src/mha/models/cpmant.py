"""CPM-Ant's whole decoder in NumPy, written from ``modeling_cpmant.py`` in transformers 5.24
(``CpmAntModel`` and ``CpmAntForCausalLM``), each layer's attention a
:class:`mha.SegmentBiasAttention` read by ``mha.from_pretrained(path, layer=i)``:

* ``prompt_length`` prompt tokens, ids ``vocab_size + 2 * prompt_length`` to ``vocab_size +
  3 * prompt_length - 1`` of ``input_embedding``, are prepended to the text on the first
  call, in segment 0; each text token is in segment 2 but for token id 0 (segment 0, and
  the text before the last as many tokens as are not 0 is left padding, hidden from every
  token and seeing none: :meth:`mha.SegmentBiasAttention.token_inputs`);
* each token's embedding plus its segment's row of ``segment_embedding``; on a call after
  the first, every new token takes the last position's segment (transformers' own slice);
* pre-norm blocks: ``x + attention(norm(x))`` (every token sees every token, the cached
  ones too, with the bias by segment) and ``x + w_out(gelu(w_0 h) * w_1 h)`` of ``h =
  norm(x)`` (exact GELU), each norm an RMSNorm of ``eps`` with a weight;
* ``output_layernorm``, the prompt's rows dropped on the first call, ``lm_head``.

A sequence's token ids are kept beside its caches (:class:`Caches`): each call's segments
and mask are those of the whole sequence so far, as transformers' ``generate`` passes the
whole ids every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..api.pretrained import from_pretrained
from ..integrations.checkpoint import open_checkpoint
from .greedy import Greedy
from .layers import UnsupportedModelError, compute_dtype, gelu

__all__ = ["Caches", "CpmAntDecoder"]

TOP = "cpmant"
LAYERS = "cpmant.encoder.layers"
DEFAULTS = {"prompt_length": 32, "vocab_size": 30720, "eps": 1e-6, "num_hidden_layers": 48}
"""CpmAntConfig's defaults of the settings read here."""


class Caches(list):  # type: ignore[type-arg]
    """One :class:`mha.KVCache` per layer, with the text's token ids ``(B, L)`` seen so far
    (the prompt tokens not among them)."""

    ids: np.ndarray


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """CPM-Ant's ``CpmAntLayerNorm``: ``x / sqrt(mean(x**2) + eps) * weight``, in ``x``'s
    dtype (transformers takes the mean in float32)."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return np.asarray(x / np.sqrt(variance + x.dtype.type(eps)) * weight)


class CpmAntDecoder(Greedy):
    """CPM-Ant's causal language model (the module's docstring), with
    :class:`~mha.models.Decoder`'s public methods: ``CpmAntDecoder(directory,
    dtype=np.float32)`` in float32 or float64, each layer's cache a contiguous
    :class:`mha.KVCache` (the only kind: ``cache="contiguous"``)."""

    def __init__(
        self, directory: str | Path, dtype: Any = np.float32, cache: str = "contiguous"
    ) -> None:
        self.dtype = compute_dtype(dtype)
        if cache != "contiguous":
            raise UnsupportedModelError(
                f"{directory}: CPM-Ant's decoder keeps a contiguous mha.KVCache per layer "
                f"(its attention sees every cached key); got cache={cache!r}"
            )
        self.cache = cache
        try:
            checkpoint = self.checkpoint = open_checkpoint(directory)
        except (OSError, ValueError) as error:
            raise UnsupportedModelError(str(error)) from None
        config = self.config = checkpoint.config
        get = {key: config.get(key, default) for key, default in DEFAULTS.items()}.__getitem__
        self.prompt_length, self.vocab_size = int(get("prompt_length")), int(get("vocab_size"))
        self.eps, count = float(get("eps")), int(get("num_hidden_layers"))
        top = [
            f"{TOP}.input_embedding.weight",
            f"{TOP}.segment_embedding.weight",
            f"{TOP}.encoder.output_layernorm.weight",
            "lm_head.weight",
        ]
        keys = set(checkpoint.keys())
        missing = [name for name in top if name not in keys]
        if missing:
            raise UnsupportedModelError(f"{directory}: CPM-Ant's {', '.join(missing)} is missing")
        weights = checkpoint.read(top, dtype=self.dtype)
        self.embed, self.segment_embed, self.norm, self.head = (weights[name] for name in top)
        start = self.vocab_size + 2 * self.prompt_length
        self.prompt_ids = start + np.arange(self.prompt_length)
        if self.prompt_length and self.prompt_ids[-1] >= len(self.embed):
            raise UnsupportedModelError(
                f"{directory}: input_embedding has {len(self.embed)} rows, not the "
                f"vocab_size + 3 * prompt_length = {self.prompt_ids[-1] + 1} CPM-Ant reads"
            )
        block = [
            "self_att.layernorm_before_attention.weight",
            "ffn.layernorm_before_ffn.weight",
            "ffn.ffn.w_in.w_0.weight",
            "ffn.ffn.w_in.w_1.weight",
            "ffn.ffn.w_out.weight",
        ]
        attention = [
            f"self_att.self_attention.{name}.weight"
            for name in ("project_q", "project_k", "project_v", "attention_out")
        ]
        known = set(top) | {f"{TOP}.position_bias.relative_attention_bias"}
        self.layers: list[tuple[Any, ...]] = []
        for i in range(count):
            names = [f"{LAYERS}.{i}.{name}" for name in block]
            known |= set(names) | {f"{LAYERS}.{i}.{name}" for name in attention}
            tensors = checkpoint.read(names, dtype=self.dtype)
            norm_1, norm_2, w_0, w_1, w_out = (tensors[name] for name in names)
            layer: Any = from_pretrained(directory, layer=i, dtype=self.dtype)
            self.layers.append((layer, norm_1, norm_2, w_0.T, w_1.T, w_out.T))
        others = keys - known
        if others:
            raise UnsupportedModelError(f"mha does not compute {', '.join(sorted(others))}")

    def new_caches(self, batch_size: int, capacity: int = 256) -> Caches:
        """One contiguous cache per layer, room for ``capacity`` text tokens per sequence
        (and the prompt tokens), and no token ids yet."""
        caches = Caches(
            layer.new_cache(batch_size, capacity=capacity + self.prompt_length)
            for layer, *_ in self.layers
        )
        caches.ids = np.zeros((batch_size, 0), np.int64)
        return caches

    def forward(
        self, ids: Any, caches: Caches, query_lengths: Any = None, last: bool = False
    ) -> np.ndarray:
        """Logits ``(B, L, vocab)`` for the next tokens ``ids (B, L)`` of each sequence,
        appended to ``caches`` (from :meth:`new_caches`: their token ids too); ``last``:
        the last position's alone, ``(B, 1, vocab)``. Every sequence takes all its ``L``
        tokens (``query_lengths`` is refused: CPM-Ant's padding is on the left)."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be integer token ids (B, L); got {ids.dtype} {ids.shape}")
        if not isinstance(caches, Caches) or len(caches) != len(self.layers):
            raise ValueError(f"caches must be new_caches()'s: one per layer, {len(self.layers)}")
        if query_lengths is not None:
            raise ValueError("CPM-Ant's decoder takes every token given: query_lengths=None")
        first = caches.ids.shape[1] == 0
        whole = caches.ids = np.concatenate([caches.ids, ids.astype(np.int64)], axis=1)
        inputs = self.layers[0][0].token_inputs(whole)
        segments, mask = inputs["segments"], inputs["mask"]
        if first:
            prompt = np.broadcast_to(self.prompt_ids, (len(ids), self.prompt_length))
            x = self.embed[np.concatenate([prompt, ids], axis=1)] + self.segment_embed[segments]
        else:  # transformers adds the last position's segment to every new token
            x = self.embed[ids] + self.segment_embed[segments[:, -1:]]
        rows = mask[:, -x.shape[1] :]
        for (layer, norm_1, norm_2, w_0, w_1, w_out), cache in zip(
            self.layers, caches, strict=True
        ):
            h = rms_norm(x, norm_1, self.eps)
            x = x + np.asarray(layer(h, cache=cache, segments=segments, mask=rows))
            h = rms_norm(x, norm_2, self.eps)
            x = x + (gelu(h @ w_0) * (h @ w_1)) @ w_out
        x = rms_norm(x, self.norm, self.eps)
        if first:  # the prompt's rows dropped
            x = x[:, self.prompt_length :]
        if last:
            x = x[:, -1:]
        return np.asarray(x @ self.head.T)
