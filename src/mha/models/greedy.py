"""Greedy decoding over a decoder's ``forward`` and caches: one loop for every decoder of
:mod:`mha.models` (:class:`~.decoder.Decoder`, CPM-Ant's :class:`~.cpmant.CpmAntDecoder`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

__all__ = ["Greedy"]


class _Runs(Protocol):
    """What :class:`Greedy` needs of the decoder it is mixed into."""

    vocab_size: int
    recompute_at: int | None

    def forward(self, ids: Any, caches: Any, query_lengths: Any = ..., last: bool = ...) -> Any: ...

    def new_caches(self, batch_size: int, capacity: int = 256) -> Any: ...

    def stream(self, prompt: list[int], new_tokens: int) -> Iterator[tuple[int, np.ndarray]]: ...


class Greedy:
    """``generate`` and ``stream`` for a decoder with ``forward(ids, caches)`` (logits ``(B,
    L, vocab)``), ``new_caches(batch_size, capacity)`` and ``vocab_size``; a decoder whose
    ``recompute_at`` is a length recomputes its caches from the whole sequence once the
    sequence passes it (Phi-3 past its short rope)."""

    recompute_at: int | None = None

    def generate(
        self: _Runs, prompt: list[int], new_tokens: int
    ) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decoding: the prompt's continuation and the logits of each chosen token.
        ``prompt`` is a non-empty list of token ids below the vocabulary size."""
        steps = list(self.stream(prompt, new_tokens))
        return [token for token, _ in steps], [logits for _, logits in steps]

    def stream(self: _Runs, prompt: list[int], new_tokens: int) -> Iterator[tuple[int, np.ndarray]]:
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
        logits = self.forward(np.array([sequence]), caches, last=True)[0, -1]
        for step in range(new_tokens):
            token = int(np.argmax(logits))
            yield token, logits
            if step == new_tokens - 1:
                return
            sequence.append(token)
            if len(sequence) == (self.recompute_at or 0) + 1:
                caches = self.new_caches(1, capacity=len(prompt) + new_tokens)
                logits = self.forward(np.array([sequence]), caches, last=True)[0, -1]
            else:
                logits = self.forward(np.array([sequence[-1:]]), caches, last=True)[0, -1]
