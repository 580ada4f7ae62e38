"""Which layers of a hybrid model are attention, as each hybrid family's config class says
(transformers 5.24): a :class:`Hybrid` row names the family, the function of its config
that gives each layer's type in transformers' names (``full_attention``,
``sliding_attention``, ``linear_attention``, ``conv``, ``moe``, ``mlp``), and what each type
that is not attention is in that family (a Mamba layer, a short convolution), so that such a
layer is refused by its index and its kind, with the attention layers the checkpoint has.
(Falcon-H1, whose every layer runs a Mamba mixer beside its attention, has no such row: each
layer's attention is read.)

Each family says it under its own config key; one small function per key:

* :func:`from_layer_types`: ``layer_types`` (or ``layers_block_type``), transformers' names
  or the older ``attention`` and ``mamba``, else the class's default (Granite-MoE-hybrid,
  LFM2, Nemotron-H, LFM2-MoE, MiniMax);
* :func:`by_period`: every ``attn_layer_period``-th layer from ``attn_layer_offset`` (Jamba);
* :func:`by_indices`: the layers listed in a key (Bamba's ``attn_layer_indices``, LFM2's
  ``full_attn_idxs``);
* :func:`by_pattern`: one character a layer (Nemotron-H's ``hybrid_override_pattern``);
* :func:`cycled`: block types repeated over the layers (RecurrentGemma's ``block_types``);
* :func:`every_layer_of`, :func:`alternating`, :func:`every_fourth`, :func:`listed`: the
  defaults of Granite-MoE-hybrid (every layer Mamba), MiniMax (attention and lightning
  attention in turn), OLMo-hybrid (every fourth layer attention) and Nemotron-H (four
  layers: Mamba, experts, attention, MLP).

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> period = ("attn_layer_period", "attn_layer_offset")
>>> jamba = Hybrid("Jamba", by_period(*period), {LINEAR: "a Mamba layer"}, keys=period)
>>> read = Settings(SimpleNamespace(path="ckpt", config={"num_hidden_layers": 6,
...     "attn_layer_period": 4, "attn_layer_offset": 1}), "jamba", {})
>>> jamba.attention_layers(read, 6)
[1, 5]
>>> jamba.check(read, 2, 6)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mha.AttentionValueError: ckpt: layer 2 of this Jamba checkpoint is a Mamba layer, which mha
does not compute; its attention layers are 1, 5 (attn_layer_period=4, attn_layer_offset=1)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...errors import AttentionValueError
from .config import FULL, SLIDING, Settings

__all__ = [
    "CONV",
    "LINEAR",
    "MLP",
    "MOE",
    "Hybrid",
    "alternating",
    "by_indices",
    "by_pattern",
    "by_period",
    "cycled",
    "every_fourth",
    "every_layer_of",
    "from_layer_types",
    "listed",
]

LINEAR, CONV, MOE, MLP = "linear_attention", "conv", "moe", "mlp"
"""transformers' names of the layer types that are not attention."""
_LEGACY = {"mamba": LINEAR, "attention": FULL}  # transformers' remap_legacy_layer_types

LayerKinds = Callable[[Settings, int], list[str]]
"""A hybrid family's layer types, from its config, for a model of so many layers."""


def from_layer_types(default: LayerKinds | None = None) -> LayerKinds:
    """The config's ``layer_types`` (older names remapped as transformers remaps them),
    else ``default``'s."""

    def kinds(read: Settings, count: int) -> list[str]:
        types = read.get("layer_types")
        if types is None and default is not None:
            return default(read, count)
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise AttentionValueError(
                f"{read.path}: config.json's {read.name('layer_types')} must list the type of "
                f"each layer; got {types!r}"
            )
        return [str(_LEGACY.get(kind, kind)) for kind in types]

    return kinds


def every_layer_of(kind: str) -> LayerKinds:
    """Every layer ``kind`` (Granite-MoE-hybrid's default: every layer Mamba)."""

    def kinds(read: Settings, count: int) -> list[str]:
        return [kind] * count

    return kinds


def alternating(even: str, odd: str) -> LayerKinds:
    """``even`` and ``odd`` in turn from layer 0 (MiniMax's default)."""

    def kinds(read: Settings, count: int) -> list[str]:
        return [odd if i % 2 else even for i in range(count)]

    return kinds


def listed(*types: str) -> LayerKinds:
    """These layer types, whatever the count (Nemotron-H's default, which counts its layers
    by its types)."""

    def kinds(read: Settings, count: int) -> list[str]:
        return list(types)

    return kinds


def every_fourth(read: Settings, count: int) -> list[str]:
    """Full attention at every fourth layer (3, 7, ...), else at the last (OLMo-hybrid's
    default)."""
    kinds = [FULL if i % 4 == 3 else LINEAR for i in range(count)]
    if FULL not in kinds:
        kinds[-1] = FULL
    return kinds


def cycled(key: str, names: Mapping[str, str]) -> LayerKinds:
    """The block types listed by ``key``, repeated over the layers, each a type as ``names``
    says (RecurrentGemma's ``block_types``: ``recurrent``, ``attention``)."""

    def kinds(read: Settings, count: int) -> list[str]:
        blocks = read.get(key)
        if not isinstance(blocks, (list, tuple)) or not blocks or not set(blocks) <= set(names):
            raise AttentionValueError(
                f"{read.path}: config.json's {key} must list block types of "
                f"{', '.join(names)}; got {blocks!r}"
            )
        return [names[blocks[i % len(blocks)]] for i in range(count)]

    return kinds


def by_period(period: str, offset: str) -> LayerKinds:
    """Full attention where ``i % period == offset``, linear (Mamba) elsewhere (Jamba)."""

    def kinds(read: Settings, count: int) -> list[str]:
        p, o = read.positive(period), read.get(offset)
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < p:
            raise AttentionValueError(
                f"{read.path}: config.json has {offset}={o!r}; an integer from 0 to "
                f"{period} - 1 = {p - 1} is needed"
            )
        return [FULL if i % p == o else LINEAR for i in range(count)]

    return kinds


def by_indices(key: str, otherwise: str = LINEAR, unset: str | None = None) -> LayerKinds:
    """Full attention at the layers ``key`` lists, ``otherwise`` elsewhere; when the key is
    null, every layer ``unset`` (LFM2's: attention), else ``otherwise`` (Bamba's: Mamba)."""

    def kinds(read: Settings, count: int) -> list[str]:
        indices = read.get(key)
        if indices is None:
            return [unset or otherwise] * count
        if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
            raise AttentionValueError(
                f"{read.path}: config.json's {key} must list layer indices; got {indices!r}"
            )
        return [FULL if i in indices else otherwise for i in range(count)]

    return kinds


def by_pattern(key: str, letters: Mapping[str, str]) -> LayerKinds:
    """One character of ``key`` a layer, each a type as ``letters`` says (Nemotron-H's
    ``hybrid_override_pattern``: ``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` experts)."""

    def kinds(read: Settings, count: int) -> list[str]:
        pattern = read.get(key)
        if not isinstance(pattern, str) or not set(pattern) <= set(letters):
            raise AttentionValueError(
                f"{read.path}: config.json's {key} must be a string of {''.join(letters)}; "
                f"got {pattern!r}"
            )
        return [letters[letter] for letter in pattern]

    return kinds


@dataclass(frozen=True)
class Hybrid:
    """A hybrid family's layers: its name in refusals, its layer types (:data:`LayerKinds`:
    ``kinds``, or where ``config.json`` has no ``layer_types``, the first of ``sources`` it
    gives), what each type that mha does not read is, and which types it reads
    (``attention``)."""

    name: str
    kinds: LayerKinds
    others: Mapping[str, str]
    """What each layer type mha does not read computes, by type."""
    attention: tuple[str, ...] = (FULL, SLIDING)
    sources: tuple[tuple[str, LayerKinds], ...] = ()
    """Older config keys that give the layer types, each with its reading (Nemotron-H's
    ``hybrid_override_pattern``)."""
    keys: tuple[str, ...] = ()
    """The config keys that say which layers are attention, shown in a refusal."""
    counts: bool = False
    """Whether the layer types count the layers, whatever ``num_hidden_layers`` says
    (Nemotron-H's)."""

    def types(self, read: Settings, count: int | None) -> list[str]:
        """Each layer's type (``count`` layers; ``None``: as many as the types listed)."""
        for key, kinds in self.sources:
            if read.given(key) is not None and read.given("layer_types") is None:
                return kinds(read, count or 0)
        types = self.kinds(read, count or 0)
        if count is not None and len(types) != count:
            raise AttentionValueError(
                f"{read.path}: config.json gives {len(types)} layer types ({types!r}) for its "
                f"{count} layers"
            )
        return types

    def attention_layers(self, read: Settings, count: int | None) -> list[int]:
        """The indices of the layers whose attention mha reads."""
        return [i for i, kind in enumerate(self.types(read, count)) if kind in self.attention]

    def check(self, read: Settings, index: int, count: int | None) -> None:
        """Refuses layer ``index`` unless its attention is one mha reads, naming what the
        layer is and the attention layers."""
        types = self.types(read, count)
        kind = types[index]
        if kind in self.attention:
            return
        what = self.others.get(kind, f"a layer of type {kind!r}")
        layers = [i for i, t in enumerate(types) if t in self.attention]
        where = ", ".join(map(str, layers)) if layers else "none"
        said = ", ".join(f"{read.name(key)}={read.get(key)!r}" for key in self.keys)
        raise AttentionValueError(
            f"{read.path}: layer {index} of this {self.name} checkpoint is {what}, which mha "
            f"does not compute; its attention layers are {where}" + (f" ({said})" if said else "")
        )
