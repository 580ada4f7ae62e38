"""Which layers slide and how far, as each family's config class decides (transformers
5.24): no layer (:data:`NO_WINDOWS`: a ``sliding_window`` in the config is refused, since
transformers' mask would ignore it while its cache keeps only that many positions), every
layer (:data:`EVERY_LAYER`), or by ``layer_types`` (:class:`ByLayerTypes`), whose default
when the config has none is the config class's: :func:`by_layer_types` (every ``pattern``-th
layer full, the others sliding: Gemma 2 and 3, gpt-oss), :data:`QWEN_WINDOWS` (the layers
from ``max_window_layers`` on, when ``use_sliding_window``; without it Qwen's
``sliding_window`` is dropped whatever ``layer_types`` says), :data:`SLIDING_IF_WINDOWED`
(every layer when there is a ``sliding_window``: Ministral), :data:`GPT_NEO_WINDOWS`
(``attention_types``' ``local`` layers).

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> checkpoint = SimpleNamespace(path="ckpt", config={"num_hidden_layers": 4})
>>> read = Settings(checkpoint, "gemma2", {"sliding_window": 4096})
>>> windows = by_layer_types(pattern=2)
>>> [windows.layer_type(read, i)[:4] for i in range(4)], windows.size(read)
(['slid', 'full', 'slid', 'full'], 4096)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import AttentionValueError
from .config import FULL, SLIDING, Settings

__all__ = [
    "CWM_WINDOWS",
    "EVERY_LAYER",
    "GPT_NEO_WINDOWS",
    "MODERNBERT_WINDOWS",
    "NO_WINDOWS",
    "QWEN_WINDOWS",
    "SLIDING_IF_WINDOWED",
    "ByLayerTypes",
    "Windows",
    "by_layer_types",
]

_LEGACY_LAYER_TYPES = {"attention": FULL}  # transformers' remap_legacy_layer_types


class Windows(Protocol):
    """A family's sliding windows: each layer's type, and a sliding layer's window."""

    def layer_type(self, read: Settings, index: int) -> str: ...

    def size(self, read: Settings) -> Any: ...


def sliding_window(read: Settings) -> Any:
    """The config's ``sliding_window`` (``None``: the layer sees every position)."""
    return read.get("sliding_window")


@dataclass(frozen=True)
class NoWindows:
    """Every layer full; a ``sliding_window`` in the config is refused."""

    def layer_type(self, read: Settings, index: int) -> str:
        window = read.get("sliding_window")
        if window is not None:
            raise read.refuse(
                f"sliding_window={window}, which transformers' {read.family} mask ignores "
                "while its DynamicCache keeps only that many positions"
            )
        return FULL

    def size(self, read: Settings) -> Any:
        return None


@dataclass(frozen=True)
class EveryLayer:
    """Every layer slides by the config's ``sliding_window`` (none when it is null)."""

    def layer_type(self, read: Settings, index: int) -> str:
        return SLIDING

    def size(self, read: Settings) -> Any:
        return sliding_window(read)


LayerTypes = Callable[[Settings, int], list[str]]
"""A config class's default ``layer_types`` for a config of so many layers."""


@dataclass(frozen=True)
class ByLayerTypes:
    """The layers the config's ``layer_types`` (else ``default``'s) says slide, by ``size``'s
    window; ``names`` maps a family's own names of the types to transformers' (GPT-Neo's
    ``local``: sliding)."""

    default: LayerTypes
    size: Callable[[Settings], Any] = sliding_window
    names: Mapping[str, str] = field(default_factory=dict)

    def layer_type(self, read: Settings, index: int) -> str:
        types = read.get("layer_types")
        count = read.positive("num_hidden_layers")
        if types is None:
            types = self.default(read, count)
        if not isinstance(types, list) or len(types) != count:
            raise AttentionValueError(
                f"{read.path}: config.json's layer_types must list one type for each of its "
                f"{count} layers; got {types!r}"
            )
        names = {**_LEGACY_LAYER_TYPES, **self.names}
        kind = names.get(types[index], types[index])
        if kind not in (SLIDING, FULL):
            raise read.refuse(f"layer {index} of type {kind!r} (mha reads {SLIDING} and {FULL})")
        return str(kind)


def every_nth_full(pattern: int) -> LayerTypes:
    """Every ``pattern``-th layer full, the others sliding (``sliding_window_pattern`` in
    the config overrides ``pattern``)."""

    def layer_types(read: Settings, count: int) -> list[str]:
        every = read.get("sliding_window_pattern", pattern)
        return [SLIDING if (i + 1) % every else FULL for i in range(count)]

    return layer_types


def by_layer_types(pattern: int) -> ByLayerTypes:
    """Windows by ``layer_types``, every ``pattern``-th layer full by default."""
    return ByLayerTypes(every_nth_full(pattern))


def qwen_window(read: Settings) -> Any:
    """Qwen's ``sliding_window``: dropped unless ``use_sliding_window``."""
    return read.get("sliding_window") if read.get("use_sliding_window") else None


def qwen_layer_types(read: Settings, count: int) -> list[str]:
    """Qwen's default: the layers from ``max_window_layers`` on slide, when they have a window."""
    start = read.get("max_window_layers")
    slides = qwen_window(read) is not None
    return [SLIDING if slides and i >= start else FULL for i in range(count)]


def sliding_if_windowed(read: Settings, count: int) -> list[str]:
    """Every layer sliding when the config has a ``sliding_window``, else every layer full."""
    return [SLIDING if read.get("sliding_window") is not None else FULL] * count


def gpt_neo_layer_types(read: Settings, count: int) -> list[str]:
    """GPT-Neo's ``attention_layers`` when the config has none: its config class expands
    them from ``attention_types`` (``[[["global", "local"], 12]]`` when null), each
    ``[types, n]`` the types ``n`` times."""
    spec = read.get("attention_types") or [[["global", "local"], 12]]
    pairs: list[Any] = spec if isinstance(spec, list) else [None]
    if not all(
        isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], list)
        and isinstance(pair[1], int) for pair in pairs
    ):  # fmt: skip
        raise AttentionValueError(
            f"{read.path}: config.json's attention_types must list [[types, count], ...]; "
            f"got {spec!r}"
        )
    return [kind for kinds, repeat in pairs for _ in range(repeat) for kind in kinds]


def full_first_of_every(pattern: int, key: str | None = None) -> LayerTypes:
    """Layers ``0, pattern, 2 * pattern, ...`` full, the others sliding (the config key
    ``key``, when given, overrides ``pattern``: ModernBERT's ``global_attn_every_n_layers``)."""

    def layer_types(read: Settings, count: int) -> list[str]:
        every = read.get(key, pattern) if key else pattern
        return [FULL if i % every == 0 else SLIDING for i in range(count)]

    return layer_types


def half_local_attention(read: Settings) -> Any:
    """ModernBERT-decoder's window: half its ``local_attention``."""
    local = read.get("local_attention")
    if not local:
        raise read.refuse(f"local_attention={local!r} (a sliding window of -1 positions)")
    return local // 2


NO_WINDOWS = NoWindows()
EVERY_LAYER = EveryLayer()
QWEN_WINDOWS = ByLayerTypes(qwen_layer_types, size=qwen_window)
SLIDING_IF_WINDOWED = ByLayerTypes(sliding_if_windowed)
GPT_NEO_WINDOWS = ByLayerTypes(
    gpt_neo_layer_types,
    size=lambda read: read.get("window_size"),
    names={"global": FULL, "local": SLIDING},
)
"""GPT-Neo's ``local`` layers, which see the last ``window_size`` positions."""
CWM_WINDOWS = ByLayerTypes(full_first_of_every(4))
MODERNBERT_WINDOWS = ByLayerTypes(
    full_first_of_every(3, "global_attn_every_n_layers"), size=half_local_attention
)
