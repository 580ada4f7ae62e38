"""Whole decoder-only language models in NumPy, with mha's attention and KV cache: text in,
text out, greedily.

``mha.models.load(path)`` reads a transformers ``save_pretrained`` folder or a llama.cpp GGUF
file (:mod:`mha.integrations.gguf_file`) with its tokenizer (:mod:`.tokenizer`); the model's
layers are :class:`.decoder.Decoder`'s, each family a row of :data:`.families.FAMILIES`.

    model = mha.models.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    for piece in model.stream("What is the capital of France?", chat=True):
        print(piece, end="", flush=True)

The same on the command line: ``mha generate --model PATH --prompt TEXT --chat``.

>>> from mha.models import load
>>> load("no-such-model")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mha.models.layers.UnsupportedModelError: no-such-model does not exist; ...
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .decoder import CACHES, Decoder, attention_layer
from .families import FAMILIES, NOT_WRITTEN
from .layers import UnsupportedModelError
from .tokenizer import Tokenizer

__all__ = [
    "CACHES",
    "FAMILIES",
    "NOT_WRITTEN",
    "Decoder",
    "Model",
    "Timing",
    "Tokenizer",
    "UnsupportedModelError",
    "attention_layer",
    "load",
]


@dataclass
class Timing:
    """How long the last generation took: the prompt's pass (its ``prompt_tokens``), then
    each of the ``new_tokens`` after the first."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    new_tokens: int = 0
    decode_seconds: float = 0.0
    ids: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second after the first (which the prompt's pass yields)."""
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


class Model:
    """A :class:`.decoder.Decoder` with its :class:`.tokenizer.Tokenizer` (``None`` where
    the model has none: then prompts are token ids)."""

    def __init__(self, decoder: Decoder, tokenizer: Tokenizer | None) -> None:
        self.decoder, self.tokenizer = decoder, tokenizer
        self.timing = Timing()

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """The prompt's token ids: a text tokenized (through the chat template with
        ``chat``), or ids as they are."""
        if not isinstance(prompt, str):
            if chat:
                raise UnsupportedModelError("a chat prompt is text, not token ids")
            return [int(token) for token in prompt]
        if self.tokenizer is None:
            raise UnsupportedModelError("this model has no tokenizer: pass token ids")
        if chat:
            prompt = self.tokenizer.chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stop_ids(self) -> set[int]:
        """The ids that end a generation: the config's ``eos_token_id`` and the tokenizer's."""
        eos = self.decoder.config.get("eos_token_id")
        stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.token_id(self.tokenizer.eos) is not None:
            stops.add(int(self.tokenizer.token_id(self.tokenizer.eos)))  # type: ignore[arg-type]
        return stops

    def ids(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 64,
        chat: bool = False,
        stop: bool = True,
    ) -> Iterator[int]:
        """The new token ids, greedily, each as soon as it is chosen; with ``stop``, up to
        the first end-of-sequence token (not yielded). :attr:`timing` says how long."""
        prompt_ids = self.encode(prompt, chat)
        stops = self.stop_ids() if stop else set()
        self.timing = timing = Timing(prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        for token, _ in self.decoder.stream(prompt_ids, max_new_tokens):
            now = time.perf_counter()
            if timing.new_tokens == 0:
                timing.prompt_seconds = now - start
            else:
                timing.decode_seconds += now - start
            start = now
            if token in stops:
                return
            timing.new_tokens += 1
            timing.ids.append(token)
            yield token
            start = time.perf_counter()  # the caller's time is not the model's

    def stream(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 64,
        chat: bool = False,
        stop: bool = True,
    ) -> Iterator[str]:
        """The new text piece by piece as it is generated (see :meth:`ids`)."""
        if self.tokenizer is None:
            raise UnsupportedModelError("this model has no tokenizer: use ids()")
        yield from self.tokenizer.stream(self.ids(prompt, max_new_tokens, chat, stop))

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 64,
        chat: bool = False,
        stop: bool = True,
    ) -> str:
        """The new text, whole (see :meth:`ids`)."""
        return "".join(self.stream(prompt, max_new_tokens, chat, stop))


def load(path: Any, dtype: Any = np.float32, cache: str = "contiguous") -> Model:
    """The model at ``path`` (a ``save_pretrained`` folder or a GGUF file), computing in
    ``dtype`` (float32 or float64), with its tokenizer where it has one (a folder without
    ``tokenizer.json`` has none). ``cache``: see :class:`.decoder.Decoder`."""
    decoder = Decoder(path, dtype=dtype, cache=cache)
    metadata = getattr(decoder.checkpoint, "metadata", None)
    tokenizer = None
    if metadata is not None or (decoder.checkpoint.path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_path(path, metadata)
    return Model(decoder, tokenizer)
