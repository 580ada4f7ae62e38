"""A model's own tokenizer and chat template: ``tokenizer.json`` through the ``tokenizers``
package, or, for a llama.cpp GGUF file, the same tokenizer built from its metadata (its
vocabulary, merges, token types and special tokens), as transformers' GGUF loader builds it.

A GGUF vocabulary is read for ``tokenizer.ggml.model = "gpt2"``, the byte-level BPE of GPT-2,
SmolLM, Qwen and Llama 3: tokens spelled in GPT-2's byte alphabet, merges in order, the text
split by the pre-tokenizer ``tokenizer.ggml.pre`` names (GPT-2's own split where it names
none of the splits below), tokens marked control (type 3) kept whole as special tokens, and
those marked user-defined (type 4) kept whole as plain ones. Other models (sentencepiece's
``llama``, ``t5``...) are refused by name. Chat templates are Jinja, rendered in Jinja's
sandbox as transformers renders them. Needs ``pip install 'mha[models]'``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .layers import UnsupportedModelError

__all__ = ["Tokenizer"]

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}
"""The text splits of ``tokenizer.ggml.pre`` values, before the byte-level BPE."""

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of each byte as a printable character (``bytes_to_unicode``)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return spelled


class Tokenizer:
    """Text to token ids and back, with the model's special tokens and chat template.

    ``Tokenizer.from_path(path)`` reads a folder's ``tokenizer.json`` (and
    ``tokenizer_config.json``: the chat template, ``add_bos_token``), or a GGUF file's
    metadata (a :class:`~mha.integrations.gguf_file.GGUFFile`'s ``metadata``).
    """

    def __init__(
        self,
        backend: Any,
        bos: str | None = None,
        eos: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend, self.bos, self.eos = backend, bos, eos
        self.add_bos, self.chat_template = add_bos, chat_template

    @classmethod
    def from_path(cls, path: Any, metadata: dict[str, Any] | None = None) -> Tokenizer:
        """The tokenizer of the model at ``path``: a GGUF file's (its ``metadata``), or a
        folder's ``tokenizer.json``."""
        if metadata is not None:
            return cls.from_gguf(metadata, path)
        folder = Path(path)
        tokenizers = _tokenizers()
        if not (folder / "tokenizer.json").is_file():
            raise UnsupportedModelError(f"{folder} has no tokenizer.json: pass token ids")
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            _content(config.get("bos_token")),
            _content(config.get("eos_token")),
            bool(config.get("add_bos_token", False)),
            template if isinstance(template, str) else None,
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], path: Any = "the GGUF file") -> Tokenizer:
        """The byte-level BPE a GGUF file's metadata describes (see the module's docstring)."""
        tokenizers = _tokenizers()
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"{path}: mha builds the byte-level BPE tokenizer (tokenizer.ggml.model = "
                f"'gpt2') from GGUF metadata; this file's is {kind!r}: pass token ids"
            )
        tokens = list(metadata["tokenizer.ggml.tokens"])
        kinds = list(metadata.get("tokenizer.ggml.token_type") or [])
        spelled = byte_alphabet()
        alphabet = set(spelled.values())
        vocab = {
            token if set(token) <= alphabet else "".join(spelled[b] for b in token.encode()): i
            for i, token in enumerate(tokens)
        }
        merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
        models, pre_tokenizers, decoders = (
            tokenizers.models,
            tokenizers.pre_tokenizers,
            tokenizers.decoders,
        )
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        split = SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        added = tokenizers.AddedToken
        typed = list(zip(tokens, kinds, strict=False))
        backend.add_special_tokens(
            [
                added(token, normalized=False, special=True)
                for token, kind in typed
                if kind == CONTROL and set(token) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                added(token, normalized=False, special=False)
                for token, kind in typed
                if kind == USER_DEFINED and token in vocab
            ]
        )

        def special(name: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{name}_token_id")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        return cls(
            backend,
            special("bos"),
            special("eos"),
            bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            metadata.get("tokenizer.chat_template"),
        )

    def token_id(self, token: str | None) -> int | None:
        """The id of the token spelled ``token`` (``None`` for ``None`` or an unknown one)."""
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, special tokens in it kept whole, BOS first where the model
        adds one."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos)
        if self.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text: str = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template rendered over ``messages`` (``{"role": ..., "content": ...}``),
        as transformers' ``apply_chat_template(tokenize=False)`` renders it."""
        if not self.chat_template:
            raise UnsupportedModelError("this model has no chat template: drop --chat")
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ImportError(
                "chat templates need jinja2: pip install 'mha[models]'", name="jinja2"
            ) from None

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        template = environment.from_string(self.chat_template)
        text: str = template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos or "",
            eos_token=self.eos or "",
        )
        return text

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """The text of ``ids`` piece by piece as they come: each piece what the ids so far
        add to the text, held back while it ends inside a character (bytes of UTF-8 that
        later tokens complete)."""
        seen: list[int] = []
        written = 0
        for token in ids:
            seen.append(token)
            text = self.decode(seen)
            if text.endswith("\ufffd"):
                continue
            yield text[written:]
            written = len(text)


def _content(token: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` gives it: a string, or an object whose
    ``content`` is the string."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "reading a model's tokenizer needs tokenizers: pip install 'mha[models]'",
            name="tokenizers",
        ) from None
    return tokenizers
