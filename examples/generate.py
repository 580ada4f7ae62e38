"""A Llama-style decoder in NumPy, with mha's attention and KV cache, generating greedily.

It reads a directory written by transformers' ``save_pretrained``: ``config.json`` and
``model.safetensors`` (read with the ``safetensors`` package's NumPy loader). Llama, Mistral
(sliding window) and Qwen2 (q/k/v biases) checkpoints share this layout. Everything but
attention is a few lines: token embedding, RMSNorm, the SwiGLU MLP and the output head.

    python examples/generate.py MODEL_DIR 1 2 3 --new-tokens 20

needs ``pip install numpy safetensors`` and mha; nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import mha


class Decoder:
    """A causal language model: embeddings, decoder layers of attention and MLP, head."""

    def __init__(self, directory: str | Path, dtype: Any = np.float32) -> None:
        from safetensors.numpy import load_file

        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        weights = {
            name: array.astype(dtype)
            for name, array in load_file(directory / "model.safetensors").items()
        }
        self.dtype = np.dtype(dtype)
        self.eps = float(config["rms_norm_eps"])
        rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 1e4)}
        unsupported = [  # refused rather than computed wrongly
            f"{key}={value!r}"
            for key, value, supported in (
                ("rope_type", rope.get("rope_type", "default"), "default"),
                ("hidden_act", config.get("hidden_act", "silu"), "silu"),
                ("mlp_bias", config.get("mlp_bias", False), False),
            )
            if value != supported
        ]
        if unsupported:
            raise ValueError(f"this example does not implement {', '.join(unsupported)}")
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        self.embed = weights["model.embed_tokens.weight"]  # (vocab, hidden)
        self.head = weights.get("lm_head.weight", self.embed)  # tied when absent
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(config["num_hidden_layers"]):
            prefix = f"model.layers.{i}."
            attention = mha.MultiHeadAttention.from_llama(
                {k: v for k, v in weights.items() if k.startswith(prefix + "self_attn.")},
                prefix=prefix + "self_attn.", num_heads=heads, num_kv_heads=kv_heads,
                head_dim=config.get("head_dim"), rope_theta=rope["rope_theta"], window=window,
            )  # fmt: skip
            mlp = {name: weights[f"{prefix}mlp.{name}_proj.weight"].T for name in
                   ("gate", "up", "down")}  # fmt: skip
            norms = (weights[prefix + "input_layernorm.weight"],
                     weights[prefix + "post_attention_layernorm.weight"])  # fmt: skip
            self.layers.append((attention, mlp, norms))

    def new_caches(self, batch_size: int, capacity: int = 256) -> list[mha.KVCache]:
        """One cache per layer."""
        return [layer[0].new_cache(batch_size, capacity=capacity) for layer in self.layers]

    def forward(
        self, ids: np.ndarray, caches: list[mha.KVCache], query_lengths: Any = None
    ) -> np.ndarray:
        """Logits ``(B, L, vocab)`` for the next tokens ``ids (B, L)`` of each sequence,
        appended to ``caches`` (with ``query_lengths``, only the first ``query_lengths[b]``
        of sequence ``b`` are real)."""
        x = self.embed[ids]
        for (attention, mlp, (norm_1, norm_2)), cache in zip(self.layers, caches, strict=True):
            x = x + attention(self._rms(x, norm_1), cache=cache, query_lengths=query_lengths)
            h = self._rms(x, norm_2)
            gate = h @ mlp["gate"]
            x = x + (gate / (1.0 + np.exp(-gate)) * (h @ mlp["up"])) @ mlp["down"]
        return np.asarray(self._rms(x, self.norm) @ self.head.T)

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decoding: the prompt's continuation and the logits of each chosen token."""
        caches = self.new_caches(1, capacity=len(prompt) + new_tokens)
        logits = self.forward(np.array([prompt]), caches)[0, -1]
        tokens, steps = [], []
        for _ in range(new_tokens):
            steps.append(logits)
            tokens.append(int(np.argmax(logits)))
            logits = self.forward(np.array([[tokens[-1]]]), caches)[0, -1]
        return tokens, steps

    def _rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        variance = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        return np.asarray(weight * (x / np.sqrt(variance + self.eps)).astype(self.dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a directory with config.json and model.safetensors")
    parser.add_argument("prompt", type=int, nargs="+", help="prompt token ids")
    parser.add_argument("--new-tokens", type=int, default=20)
    args = parser.parse_args(argv)
    tokens, _ = Decoder(args.model).generate(args.prompt, args.new_tokens)
    print(" ".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
