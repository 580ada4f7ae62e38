"""A Llama-style decoder in NumPy, with mha's attention and KV cache, generating greedily.

It reads a directory written by transformers' ``save_pretrained``: ``config.json`` and
``model.safetensors`` (read with the ``safetensors`` package's NumPy loader). Llama, Mistral
(sliding window) and Qwen2 (q/k/v biases, sliding windows on some layers) checkpoints share
this layout. Everything but attention is a few lines: token embedding, RMSNorm, the SwiGLU
MLP and the output head. A configuration it cannot compute exactly is refused, naming the
setting, never approximated.

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

MODEL_TYPES = ("llama", "mistral", "qwen2")
"""The families whose decoder layer this example writes out; others are refused by name."""


class UnsupportedModelError(ValueError):
    """A checkpoint this example cannot compute exactly (or cannot read)."""


class Decoder:
    """A causal language model: embeddings, decoder layers of attention and MLP, head."""

    def __init__(self, directory: str | Path, dtype: Any = np.float32) -> None:
        directory = Path(directory)
        config = _read_config(directory)
        weights = {name: array.astype(dtype) for name, array in _read_weights(directory).items()}
        self.dtype = np.dtype(dtype)
        self.eps = float(config["rms_norm_eps"])
        self.vocab_size = int(config["vocab_size"])
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.embed = weights["model.embed_tokens.weight"]  # (vocab, hidden)
        self.head = weights.get("lm_head.weight", self.embed)  # tied when absent
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i, window in enumerate(layer_windows(config)):
            prefix = f"model.layers.{i}."
            attention = mha.MultiHeadAttention.from_llama(
                {k: v for k, v in weights.items() if k.startswith(prefix + "self_attn.")},
                prefix=prefix + "self_attn.", num_heads=heads, num_kv_heads=kv_heads,
                head_dim=config.get("head_dim"), rope_theta=config["rope_theta"], window=window,
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


def layer_windows(config: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (``None``: full attention), as transformers reads the
    config: none for Llama; Mistral's ``sliding_window`` on every layer; for Qwen2, the
    ``layer_types`` (from ``max_window_layers`` on when the config has none) with
    ``sliding_window`` on its ``sliding_attention`` layers, and only when
    ``use_sliding_window`` is set. Layer types other than these two are refused."""
    kind, count = config.get("model_type"), int(config["num_hidden_layers"])
    if kind == "llama":
        return [None] * count
    window = config.get("sliding_window")
    if kind == "qwen2" and not config.get("use_sliding_window", False):
        window = None
    if window is not None and not (isinstance(window, int) and window > 0):
        raise UnsupportedModelError(f"sliding_window must be a positive integer; got {window!r}")
    if kind == "mistral":
        return [window] * count
    types = config.get("layer_types")
    if types is None:
        first = int(config.get("max_window_layers", count))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(count)]
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown or len(types) != count:
        raise UnsupportedModelError(
            f"this example computes full_attention and sliding_attention layers; the config's "
            f"layer_types has {unknown or f'{len(types)} entries for {count} layers'}"
        )
    return [window if t == "sliding_attention" else None for t in types]


def _read_config(directory: Path) -> dict[str, Any]:
    """``config.json``, refused (naming the setting) unless this example computes it exactly."""
    path = directory / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except OSError as error:
        raise UnsupportedModelError(f"cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise UnsupportedModelError(f"{path} is not valid JSON: {error}") from None
    if config.get("model_type") not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"this example computes the {', '.join(MODEL_TYPES)} decoders; the config says "
            f"model_type={config.get('model_type')!r}"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    config["rope_theta"] = rope.get("rope_theta", config.get("rope_theta"))
    needed = ("rms_norm_eps", "vocab_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "rope_theta")  # fmt: skip
    missing = [name for name in needed if config.get(name) is None]
    if missing:
        raise UnsupportedModelError(f"{path} has no {', '.join(missing)}, which this example needs")
    unsupported = [  # refused rather than computed wrongly
        f"{key}={value!r}"
        for key, value, supported in (
            ("rope_type", rope.get("rope_type", rope.get("type", "default")), "default"),
            ("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0), 1.0),
            ("hidden_act", config.get("hidden_act", "silu"), "silu"),
            ("mlp_bias", config.get("mlp_bias", False), False),
        )
        if value != supported
    ]
    if unsupported:
        raise UnsupportedModelError(f"this example does not implement {', '.join(unsupported)}")
    layer_windows(config)  # refuses layer types it does not compute
    return config


def _read_weights(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    path = directory / "model.safetensors"
    if not path.exists():
        sharded = (directory / "model.safetensors.index.json").exists()
        raise UnsupportedModelError(
            f"{directory} holds a sharded checkpoint (model.safetensors.index.json), which "
            "this example does not read yet"
            if sharded
            else f"{path} does not exist"
        )
    weights: dict[str, np.ndarray] = load_file(path)
    return weights


class _Parser(argparse.ArgumentParser):
    """argparse, with every mistake in one line on standard error (exit code 2)."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a directory with config.json and model.safetensors")
    parser.add_argument("prompt", type=int, nargs="+", help="prompt token ids")
    parser.add_argument("--new-tokens", type=int, default=20, help="how many (default 20)")
    args = parser.parse_args(argv)
    if args.new_tokens < 0:
        parser.error(f"--new-tokens must be 0 or more; got {args.new_tokens}")
    try:
        decoder = Decoder(args.model)
        tokens, _ = decoder.generate(args.prompt, args.new_tokens)
    except ValueError as error:  # a model it cannot compute, or a prompt it cannot read
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    print(" ".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
