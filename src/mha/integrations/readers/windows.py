"""Which layers slide and how far, as each family's config class decides (transformers
5.24): no layer (:data:`NO_WINDOWS`: a ``sliding_window`` in the config is refused, since
transformers' mask would ignore it while its cache keeps only that many positions), every
layer (:data:`EVERY_LAYER`; :data:`QWEN_EVERY_LAYER` when ``use_sliding_window``: Qwen3-MoE),
or by ``layer_types`` (:class:`ByLayerTypes`), whose default when the config has none is the
config class's: :func:`by_layer_types` (every ``pattern``-th layer full, the others sliding:
Gemma 2 and 3, gpt-oss, VaultGemma, OLMo 3), :data:`QWEN_WINDOWS` (the layers from
``max_window_layers`` on, when ``use_sliding_window``; without it Qwen's ``sliding_window``
is dropped whatever ``layer_types`` says), :data:`QWEN2_MOE_WINDOWS` (every other layer below
``max_window_layers``), :data:`WINDOWED_FROM` (the layers from ``max_window_layers`` on,
when there is a ``sliding_window``: dots.llm1), :data:`CWM_WINDOWS` (the first of every four
layers full: CWM, GraniteSWA), :data:`MODERNBERT_WINDOWS` (the first of every
``global_attn_every_n_layers``), :data:`FULL_BY_DEFAULT` (Mellum), :data:`SLIDING_IF_WINDOWED`
(every layer when there is a ``sliding_window``: Ministral), :data:`SMOLLM3_WINDOWS` (the
layers without rope, when ``use_sliding_window``), :data:`COHERE2_MOE_WINDOWS` (a pattern of
the dense layers, another of the others), :data:`GPT_NEO_WINDOWS` (``attention_types``'
``local`` layers), :data:`FLINT_WINDOWS` (the first two, every fourth from layer 1 and the
last layers full).

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
from .rope import by_no_rope_layers

__all__ = [
    "COHERE2_MOE_WINDOWS",
    "CWM_WINDOWS",
    "EVERY_LAYER",
    "FLINT_WINDOWS",
    "FULL_BY_DEFAULT",
    "GPT_NEO_WINDOWS",
    "MODERNBERT_WINDOWS",
    "NO_WINDOWS",
    "QWEN2_MOE_WINDOWS",
    "QWEN_EVERY_LAYER",
    "QWEN_WINDOWS",
    "SLIDING_IF_WINDOWED",
    "SMOLLM3_WINDOWS",
    "WINDOWED_FROM",
    "ByLayerTypes",
    "Windows",
    "by_layer_types",
]

_LEGACY_LAYER_TYPES = {"attention": FULL}  # transformers' remap_legacy_layer_types

LAYER_FEATURES = {
    "linear_attention": "linear attention or a state-space mixer (Gated DeltaNet, Mamba)",
    "indexed_attention": "top-k sparse attention: an indexer picks each query's keys",
    "compressed_sparse_attention": "sparse attention over compressed keys",
    "heavily_compressed_attention": "attention over compressed keys",
    "chunked_attention": "chunked attention",
    "conv": "a short convolution",
    "hybrid": "a Mamba mixer beside the attention",
    "mlp": "no attention",
    "moe": "no attention",
}
"""What the layer types of transformers' hybrid families compute instead of mha's attention,
named in the refusal of such a layer."""


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
    """Every layer slides by ``window``'s (the config's ``sliding_window``; none when it is
    null)."""

    window: Callable[[Settings], Any] = sliding_window

    def layer_type(self, read: Settings, index: int) -> str:
        return SLIDING

    def size(self, read: Settings) -> Any:
        return self.window(read)


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
            feature = f": {LAYER_FEATURES[kind]}" if kind in LAYER_FEATURES else ""
            raise read.refuse(
                f"layer {index} of type {kind!r}{feature} (mha reads {SLIDING} and {FULL})"
            )
        return str(kind)


def every_nth_full(pattern: int, key: str | None = "sliding_window_pattern") -> LayerTypes:
    """Every ``pattern``-th layer full, the others sliding (the config's ``key``, when the
    config class reads one, overrides ``pattern``)."""

    def layer_types(read: Settings, count: int) -> list[str]:
        every = pattern if key is None else read.get(key, pattern)
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise AttentionValueError(
                f"{read.path}: config.json has no layer_types and {key}="
                f"{every!r}; a positive integer is needed"
            )
        return [SLIDING if (i + 1) % every else FULL for i in range(count)]

    return layer_types


def by_layer_types(pattern: int, key: str | None = "sliding_window_pattern") -> ByLayerTypes:
    """Windows by ``layer_types``, every ``pattern``-th layer full by default."""
    return ByLayerTypes(every_nth_full(pattern, key))


def qwen_window(read: Settings) -> Any:
    """Qwen's ``sliding_window``: dropped unless ``use_sliding_window``."""
    return read.get("sliding_window") if read.get("use_sliding_window") else None


def qwen_layer_types(read: Settings, count: int) -> list[str]:
    """Qwen's default: the layers from ``max_window_layers`` on slide, when they have a window."""
    start = read.get("max_window_layers")
    slides = qwen_window(read) is not None
    return [SLIDING if slides and i >= start else FULL for i in range(count)]


def qwen2_moe_window(read: Settings) -> Any:
    """Qwen2-MoE's ``sliding_window``: 0 unless ``use_sliding_window``, which a sliding layer
    cannot take (its mask would hide every position), refused."""
    if not read.get("use_sliding_window"):
        raise read.refuse(
            "a sliding layer in layer_types but use_sliding_window=False (a window of 0)"
        )
    return read.get("sliding_window")


def qwen2_moe_layer_types(read: Settings, count: int) -> list[str]:
    """Qwen2-MoE's default: every other layer (the first, the third...) below
    ``max_window_layers`` slides, when ``use_sliding_window``."""
    start, slides = read.get("max_window_layers"), read.get("use_sliding_window")
    return [SLIDING if slides and i % 2 == 0 and i < start else FULL for i in range(count)]


def windowed_from(read: Settings, count: int) -> list[str]:
    """dots.llm1's default: the layers from ``max_window_layers`` on slide, when the config
    has a ``sliding_window`` (``use_sliding_window`` is not read)."""
    start, slides = read.get("max_window_layers"), read.get("sliding_window") is not None
    return [SLIDING if slides and i >= start else FULL for i in range(count)]


def all_full(read: Settings, count: int) -> list[str]:
    """Every layer full (Mellum's default)."""
    return [FULL] * count


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


def flint_layer_types(read: Settings, count: int) -> list[str]:
    """Flint's default: the first two layers, every fourth from layer 1 and the last full,
    the others sliding."""
    return [FULL if i < 2 or i % 4 == 1 or i == count - 1 else SLIDING for i in range(count)]


def half_local_attention(read: Settings) -> Any:
    """ModernBERT-decoder's window: ``config.json``'s ``sliding_window`` (its config class
    sets the keywords it is given after its own), else half its ``local_attention`` (-1 when
    that is null)."""
    local = read.get("local_attention")
    window = read.given("sliding_window", local // 2 if local else -1)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise read.refuse(
            f"local_attention={local!r} and sliding_window={window!r} (a sliding window of "
            f"{window!r} positions)"
        )
    return window


def smollm3_layer_types(read: Settings, count: int) -> list[str]:
    """SmolLM3's default: the layers without rope slide, when ``use_sliding_window`` and
    the config has a ``sliding_window``."""
    slides = read.get("use_sliding_window") and read.get("sliding_window") is not None
    return [
        SLIDING if slides and not by_no_rope_layers(read, i, FULL) else FULL for i in range(count)
    ]


def cohere2_moe_layer_types(read: Settings, count: int) -> list[str]:
    """Cohere 2 MoE's default: every ``prefix_dense_sliding_window_pattern``-th of the first
    ``first_k_dense_replace`` layers full, then every ``sliding_window_pattern``-th."""
    dense = read.get("first_k_dense_replace", 0)
    prefix, every = (
        read.get("prefix_dense_sliding_window_pattern"),
        read.get("sliding_window_pattern"),
    )
    return [SLIDING if (i + 1) % prefix else FULL for i in range(dense)] + [
        SLIDING if (i + 1) % every else FULL for i in range(count - dense)
    ]


NO_WINDOWS = NoWindows()
EVERY_LAYER = EveryLayer()
QWEN_WINDOWS = ByLayerTypes(qwen_layer_types, size=qwen_window)
SLIDING_IF_WINDOWED = ByLayerTypes(sliding_if_windowed)
QWEN_EVERY_LAYER = EveryLayer(qwen_window)
"""Qwen3-MoE's: every layer slides when ``use_sliding_window`` (``layer_types`` not read)."""
QWEN2_MOE_WINDOWS = ByLayerTypes(qwen2_moe_layer_types, size=qwen2_moe_window)
WINDOWED_FROM = ByLayerTypes(windowed_from)
FULL_BY_DEFAULT = ByLayerTypes(all_full)
SMOLLM3_WINDOWS = ByLayerTypes(smollm3_layer_types)
COHERE2_MOE_WINDOWS = ByLayerTypes(cohere2_moe_layer_types)
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
FLINT_WINDOWS = ByLayerTypes(flint_layer_types)
