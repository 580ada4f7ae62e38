"""A checkpoint's ``config.json`` read as its family's config class reads it (transformers
5.24): the value ``config.json`` gives, else the class's default. Every key read is
remembered, so that a refusal can show the config behind it (:meth:`Settings.summary`), and
a key whose value asks for what mha does not compute is refused by the feature it names
(:class:`Unsupported`).

>>> from types import SimpleNamespace
>>> config = SimpleNamespace(path="ckpt", config={"model_type": "llama", "num_attention_heads": 8})
>>> read = Settings(config, "llama", {"num_attention_heads": 32, "num_key_value_heads": None})
>>> read.positive("num_attention_heads"), read.positive("num_key_value_heads", optional=True)
(8, None)
>>> Unsupported("attention_chunk_size", "chunked attention", is_given).check(read)
>>> read.summary()
'num_attention_heads=8'
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...errors import AttentionTypeError, AttentionValueError

__all__ = ["FULL", "SLIDING", "Settings", "Source", "Unsupported", "layer_index"]

SLIDING, FULL = "sliding_attention", "full_attention"
"""The layer types mha reads (transformers' ``layer_types``)."""


class Source(Protocol):
    """Where a layer is read from: a config in transformers' keys and the tensors by
    transformers' names (a :class:`~mha.integrations.checkpoint.Checkpoint`; a GGUF file
    whose metadata and tensor names are mapped to transformers' would be another)."""

    path: Any
    config: dict[str, Any]

    def __iter__(self) -> Iterator[str]: ...

    def read(self, names: Iterable[str], dtype: Any = None) -> dict[str, np.ndarray]: ...


class Settings:
    """A config's values as the family's config class reads them: ``config.json``'s, else
    the class's defaults (``defaults``, the row's). Keys are transformers' common names
    (``num_attention_heads``); ``keys`` gives the family's own where they differ (as a config
    class's ``attribute_map`` does), which ``config.json`` and ``defaults`` use. A key
    ``"outer.inner"`` is ``inner`` of the object ``outer`` in ``config.json`` (MPT's
    ``attn_config``), and is named so in ``defaults``."""

    def __init__(
        self,
        source: Source,
        family: str,
        defaults: Mapping[str, Any],
        keys: Mapping[str, str] | None = None,
    ) -> None:
        self.config, self.path = source.config, source.path
        self.family, self.defaults, self.keys = family, defaults, keys or {}
        self.read: list[str] = []

    def name(self, key: str) -> str:
        """The family's name of ``key``, unless ``config.json`` gives ``key`` by its common
        name alone (as ``save_pretrained`` writes it: an ``attribute_map`` takes both)."""
        alias = self.keys.get(key, key)
        return key if not _find(self.config, alias)[0] and key in self.config else alias

    def get(self, key: str, default: Any = None) -> Any:
        """``key``'s value: ``config.json``'s, else the class's default, else ``default``."""
        found, name, value = self._given(key)
        self.read.append(name)
        if found:
            return value
        return self.defaults.get(name, self.defaults.get(key, default))

    def given(self, key: str, default: Any = None) -> Any:
        """``key``'s value in ``config.json`` (``default`` when it has none)."""
        found, _, value = self._given(key)
        return value if found else default

    def has(self, key: str) -> bool:
        """Whether ``config.json`` or the class's defaults hold ``key``."""
        return self._given(key)[0] or self.name(key) in self.defaults or key in self.defaults

    def _given(self, key: str) -> tuple[bool, str, Any]:
        """Whether ``config.json`` gives ``key``, under which name, and its value: the
        family's name, else the common one (a config class's ``attribute_map`` takes both)."""
        for name in dict.fromkeys((self.name(key), key)):
            found, value = _find(self.config, name)
            if found:
                return True, name, value
        return False, self.name(key), None

    def positive(self, key: str, optional: bool = False) -> Any:
        """A positive integer (or, when ``optional``, ``None``)."""
        value = self.get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            needed = "a positive integer or null" if optional else "a positive integer"
            raise AttentionValueError(
                f"{self.path}: config.json has {self.name(key)}={value!r}; {needed} is needed"
            )
        return value

    def summary(self) -> str:
        """The keys read that ``config.json`` gives, with their values."""
        keys = dict.fromkeys(key for key in self.read if _find(self.config, key)[0])
        return ", ".join(f"{key}={_find(self.config, key)[1]!r}" for key in keys)

    def refuse(self, what: str) -> AttentionValueError:
        return AttentionValueError(
            f"{self.path}: {self.family} with {what}: mha would compute something else, "
            "so it is refused"
        )


def _find(config: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """Whether ``config`` holds ``key``, and its value; ``"outer.inner"`` is a key of a
    nested object (MPT's ``attn_config.alibi``)."""
    if key in config:
        return True, config[key]
    outer, dot, inner = key.partition(".")
    nested = config.get(outer) if dot else None
    if isinstance(nested, Mapping) and inner in nested:
        return True, nested[inner]
    return False, None


def is_given(value: Any) -> bool:
    """Whether a config value is set at all (``None`` is not)."""
    return value is not None


@dataclass(frozen=True)
class Unsupported:
    """A config key whose value asks for an attention feature mha does not compute: refused,
    naming the key, its value and the feature, when ``asks(value)`` (by default, when the
    value is true)."""

    key: str
    feature: str
    asks: Callable[[Any], bool] = bool

    def check(self, read: Settings) -> None:
        value = read.get(self.key)
        if self.asks(value):
            raise read.refuse(f"{read.name(self.key)}={value!r} ({self.feature})")


def layer_index(layer: Any, count: int, path: Any) -> int:
    """``layer`` as an index into the ``count`` layers of the checkpoint at ``path``."""
    if isinstance(layer, (bool, np.bool_)):
        raise AttentionTypeError(f"layer must be an integer; got {layer!r}")
    try:
        index = operator.index(layer)
    except TypeError:
        raise AttentionTypeError(
            f"layer must be an integer; got {layer!r} of type {type(layer).__name__}"
        ) from None
    if not 0 <= index < count:
        raise AttentionValueError(
            f"layer={index} is out of range: {path} has {count} layers, 0 to {count - 1}"
        )
    return index
