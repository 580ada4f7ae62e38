"""A layer's rotary embedding, read from its config as transformers 5.24 standardises it
(``convert_rope_params_to_dict`` and ``standardize_rope_params``): ``rope_parameters``, or the
older ``rope_theta`` and ``rope_scaling``, completed by what the family's config class fills
in (:class:`Rope`, one per row of the table); and which layers rotate at all (a layer that
does not, NoPE, has ``rope_theta=None``): every one, or as ``no_rope_layers`` (SmolLM3) or
the layer's type (Cohere 2, EXAONE 4) says.

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> checkpoint = SimpleNamespace(path="ckpt", config={"rope_theta": 500.0})
>>> rope_parameters(Settings(checkpoint, "llama", {}), Rope(), None)
{'rope_theta': 500.0, 'rope_type': 'default'}
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...api.rope_scaling import check_rope_scaling
from ...errors import AttentionValueError
from .config import FULL, SLIDING, Settings

__all__ = [
    "Rope",
    "by_layer_type_entries",
    "by_no_rope_layers",
    "check_refused",
    "check_rope",
    "every_layer",
    "layer_theta",
    "partial_rotary",
    "rope_parameters",
    "rotary_dim",
    "sliding_layers",
    "sliding_layers_if_windowed",
    "sliding_or_dense_layers",
    "yarn_mscale",
]

_OMPE = "original_max_position_embeddings"
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")

LayerRotates = Callable[[Settings, int, str], bool]
"""Whether layer ``index``, of type ``layer_type``, rotates its queries and keys (a layer
that does not has no positions: NoPE)."""


def every_layer(read: Settings, index: int, layer_type: str) -> bool:
    """Every layer rotates."""
    return True


def by_no_rope_layers(read: Settings, index: int, layer_type: str) -> bool:
    """SmolLM3's: the layers whose ``no_rope_layers`` entry is 1 rotate; by default every
    ``no_rope_layer_interval``-th layer does not."""
    flags = read.get("no_rope_layers")
    count = read.positive("num_hidden_layers")
    if flags is None:
        return bool((index + 1) % read.positive("no_rope_layer_interval"))
    if not isinstance(flags, list) or len(flags) != count or any(f not in (0, 1) for f in flags):
        raise AttentionValueError(
            f"{read.path}: config.json's no_rope_layers must list 1 (rope) or 0 (no rope) for "
            f"each of its {count} layers; got {flags!r}"
        )
    return bool(flags[index])


def sliding_layers(read: Settings, index: int, layer_type: str) -> bool:
    """Cohere 2's: the sliding layers rotate, the full ones have no positions."""
    return layer_type == SLIDING


def sliding_or_dense_layers(read: Settings, index: int, layer_type: str) -> bool:
    """Cohere 2 MoE's: the sliding layers rotate, and the dense ones (``mlp_layer_types``,
    by default the first ``first_k_dense_replace``) when
    ``prefix_dense_sliding_window_pattern`` is 1."""
    if layer_type == SLIDING:
        return True
    if read.get("prefix_dense_sliding_window_pattern") != 1:
        return False
    count, dense = read.positive("num_hidden_layers"), read.get("first_k_dense_replace", 0)
    types = read.get("mlp_layer_types")
    if types is None:
        types = ["dense" if i < dense else "sparse" for i in range(count)]
    if not isinstance(types, list) or len(types) != count:
        raise AttentionValueError(
            f"{read.path}: config.json's mlp_layer_types must list one type for each of its "
            f"{count} layers; got {types!r}"
        )
    return bool(types[index] == "dense")


def by_layer_type_entries(read: Settings, index: int, layer_type: str) -> bool:
    """Cohere Compass's: the layers whose type's entry in ``rope_parameters`` is not null
    rotate; a config without an entry for the layer's type is refused (transformers' rotary
    embedding of the family takes one per type)."""
    parameters = read.given("rope_parameters")
    if not isinstance(parameters, dict) or layer_type not in parameters:
        raise read.refuse(
            f"no rope_parameters entry for its {layer_type} layers (one per layer type, "
            "null for none, which transformers' rotary embedding of the family reads)"
        )
    return parameters[layer_type] is not None


def sliding_layers_if_windowed(read: Settings, index: int, layer_type: str) -> bool:
    """EXAONE 4's: the sliding layers rotate, the full ones only when the config has no
    ``sliding_window``."""
    return layer_type == SLIDING or read.get("sliding_window") is None


@dataclass(frozen=True)
class Rope:
    """What a family's config class fills in of its rotary embedding, and how its attention
    applies it."""

    theta: float = 10_000.0
    """The base when the config gives none (the config class's ``default_theta``)."""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """The ``rope_parameters`` when the config gives none (gpt-oss's yarn)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Old ``rope_type`` names and the type they mean (Phi-3's ``su``: ``longrope``)."""
    per_layer_type: Mapping[str, tuple[str | None, float]] = field(default_factory=dict)
    """One set of parameters per layer type, each base from a config key (or none) with its
    default (Gemma 3: ``rope_theta`` for the full layers, ``rope_local_base_freq`` for the
    sliding ones; OLMo 3: ``rope_theta`` for the full layers only); an old config's
    ``rope_scaling`` is the full layers'."""
    partial: bool = False
    """Whether the attention rotates ``partial_rotary_factor`` of each head (else that
    factor, unless 1, is refused)."""
    fraction: float | None = None
    """The ``partial_rotary_factor`` the config class sets when the config gives none."""
    width: str | None = None
    """The config key of the rotated width in features, read as the fraction
    ``width / head_dim`` when the config gives no ``partial_rotary_factor`` (MiniMax-M2's
    ``rotary_dim``)."""
    interleave: bool | str = False
    """Whether the rotary pairs are ``(2i, 2i + 1)`` rather than the two halves: always,
    never, or as the config key named here says."""
    dim_key: str | None = None
    """The config key of the features of each head that rotate, when the family counts them
    so (GPT-J's ``rotary_dim``) rather than by ``partial_rotary_factor``."""
    applied: bool = True
    """Whether the attention rotates its queries and keys at all (GPT-2, OPT and BLOOM
    add their positions elsewhere, or none)."""
    scaled: bool = True
    """Whether the attention scales its rope as ``rope_type`` says (PhiMoE's multiplies its
    own ``short_mscale`` and ``long_mscale``: a ``rope_type`` other than ``default`` is
    refused)."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Keys of the rope parameters whose value, unless 0, asks for a feature mha does not
    compute, by that feature's name (Ministral 3's ``llama_4_scaling_beta``)."""
    apart: tuple[str, ...] = ()
    """Keys of the rope parameters that are no part of the rotation, read apart by the row
    (Ministral 3's ``llama_4_scaling_beta``, its query temperature): dropped from them."""
    rotates: LayerRotates = every_layer
    """Which layers rotate; the others have no positions (NoPE)."""
    text_mrope: bool = False
    """Whether a multimodal rope (``mrope_section``) is read as the plain rope of text, whose
    positions are the same on every axis (the text models of multimodal families); else it
    is refused."""
    negated: bool = False
    """Whether the attention rotates by the negated angles (NanoChat's ``rotate_half``,
    ``(x2, -x1)``): read as the usual rotation of each head's halves swapped in the query and
    key projections, whose scores are the same."""
    per_layer_theta: str | None = None
    """The config key listing each layer's base, which replaces ``rope_theta`` (0: that
    layer has no positions), when the config gives it (GraniteSWA's ``layer_rope_theta``)."""

    def interleaved(self, read: Settings) -> bool:
        if isinstance(self.interleave, str):
            return bool(read.get(self.interleave))
        return self.interleave


def layer_theta(read: Settings, key: str, index: int) -> float | None:
    """Layer ``index``'s base in the config key ``key``, a list of one base per layer (0:
    the layer has no positions), or ``None`` when the config gives no list."""
    thetas = read.get(key)
    if thetas is None:
        return None
    count = read.positive("num_hidden_layers")
    if (
        not isinstance(thetas, list)
        or len(thetas) != count
        or any(
            isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta < 0
            for theta in thetas
        )
    ):
        raise AttentionValueError(
            f"{read.path}: config.json's {read.name(key)} must list a base (0: no rope) for "
            f"each of its {count} layers; got {thetas!r}"
        )
    return float(thetas[index])


def rope_parameters(read: Settings, rope: Rope, layer_type: str | None) -> dict[str, Any]:
    """The rope parameters of a layer of type ``layer_type`` (``None``: one for every layer),
    with ``rope_theta`` and ``rope_type`` always, as transformers standardises them."""
    given = read.given("rope_scaling") or read.given("rope_parameters")
    parameters = copy.deepcopy(given) if given is not None else None
    if rope.per_layer_type:
        parameters = _per_layer_type(read, rope, parameters)
    if parameters is None:
        parameters = copy.deepcopy(dict(rope.parameters))
    if not isinstance(parameters, dict):
        raise AttentionValueError(
            f"{read.path}: config.json's rope_parameters must be a JSON object; got {given!r}"
        )
    nested = layer_type is not None and isinstance(parameters.get(layer_type), dict)
    layer = parameters[layer_type] if nested else parameters
    layer.setdefault("rope_theta", read.given("rope_theta", rope.theta))
    factor = read.get("partial_rotary_factor", rope.fraction)
    width = read.positive(rope.width, optional=True) if rope.width else None
    if factor is None and width is not None:
        factor = width / read.positive("head_dim")
    if factor is not None:
        layer.setdefault("partial_rotary_factor", factor)
    theta = layer["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise AttentionValueError(
            f"{read.path}: config.json's rope_theta must be a positive number; got {theta!r}"
        )
    layer.setdefault("rope_type", layer.get("type", "default"))  # old configs' name
    layer["rope_type"] = rope.aliases.get(layer["rope_type"], layer["rope_type"])
    if layer["rope_type"] in _ORIGINAL_LENGTH_TYPES:
        if not nested and read.has(_OMPE):
            layer[_OMPE] = read.get(_OMPE)  # a top-level one takes precedence (Phi-3)
        else:
            layer.setdefault(_OMPE, read.get("max_position_embeddings"))
    return dict(layer)


def _per_layer_type(read: Settings, rope: Rope, parameters: Any) -> dict[str, Any]:
    """One set of parameters per layer type: the config's, each completed by its base (the
    type's key, else its default), an old config's ``rope_scaling`` on the full layers."""
    scaling = read.given("rope_scaling")
    if scaling is not None:  # old configs: rope_scaling is the full layers' scaling
        parameters = copy.deepcopy(read.given("rope_parameters"))
    if not isinstance(parameters, dict):
        parameters = {}
    nested = {kind: parameters.get(kind) for kind in rope.per_layer_type}
    for kind, (key, theta) in rope.per_layer_type.items():
        entry = nested[kind] if isinstance(nested[kind], dict) else {"rope_type": "default"}
        if kind == FULL and scaling is not None:
            entry.update(scaling)
        entry.setdefault("rope_theta", theta if key is None else read.given(key, theta))
        nested[kind] = entry
    return nested


def check_refused(read: Settings, rope: Rope, parameters: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters without the keys of :attr:`Rope.refused`, refusing by name what
    asks for what the family's attention computes and mha does not: any ``rope_type`` but
    ``default`` where the attention scales it its own way, a key of :attr:`Rope.refused`
    whose value is not 0."""
    kind = parameters.get("rope_type", "default")
    if not rope.scaled and kind != "default":
        raise read.refuse(
            f"rope_type {kind!r}, which transformers' {read.family} rotary embedding scales "
            "by its own factors"
        )
    for key, feature in rope.refused.items():
        value = parameters.get(key)
        if value != 0:
            raise read.refuse(f"rope_parameters['{key}']={value!r} ({feature})")
    dropped = (*rope.refused, *rope.apart)
    return {key: value for key, value in parameters.items() if key not in dropped}


def partial_rotary(read: Settings, rope: Rope, parameters: Mapping[str, Any], d: int) -> Any:
    """How many of a head's ``d`` features rotate (``None``: all of them): the layer's
    ``partial_rotary_factor``, refused where the family's attention does not apply it (a
    ``proportional`` rope rotates every feature, its later pairs by the angle 0: its
    frequencies read the factor)."""
    factor = parameters.get("partial_rotary_factor")
    if factor is None or factor == 1.0 or parameters.get("rope_type") == "proportional":
        return None  # (proportional: the whole head turns, some pairs by a frequency of 0)
    if not rope.partial:
        raise read.refuse(
            f"partial_rotary_factor={factor}, which transformers' {read.family} attention "
            "ignores or cannot apply"
        )
    rotary_dim = int(d * factor)
    return None if rotary_dim == d else rotary_dim


def rotary_dim(read: Settings, key: str, d: int) -> Any:
    """How many of a head's ``d`` features rotate, as the config key ``key`` says (``None``:
    all); a null one is refused where transformers would rotate a head by the frequencies of
    the whole hidden size (GPT-J and CodeGen, with more than one head)."""
    dim = read.get(key)
    if dim is None and read.positive("hidden_size") != d:
        raise read.refuse(
            f"{read.name(key)}=None, whose rotary embedding is as wide as "
            f"hidden_size={read.get('hidden_size')}, not a head's {d} features"
        )
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0):
        raise AttentionValueError(
            f"{read.path}: config.json has {read.name(key)}={dim!r}; a positive "
            "integer or null is needed"
        )
    return None if dim is None or dim == d else dim


def rope_scaling(read: Settings, parameters: Mapping[str, Any]) -> dict[str, Any] | None:
    """mha's ``rope_scaling``: the parameters with the model's ``max_position_embeddings``,
    or ``None`` for the default rope."""
    if parameters.get("rope_type", "default") == "default":
        return None
    return {**parameters, "max_position_embeddings": read.get("max_position_embeddings")}


def check_rope(read: Settings, settings: Mapping[str, Any], index: int) -> None:
    """The layer's rope scaling checked as the layer will check it, with messages that name
    the checkpoint and the config key it came from."""
    scaling = settings.get("rope_scaling")
    if scaling is None:
        return
    rotated = settings.get("qk_rope_head_dim") or settings.get("rotary_dim") or settings["head_dim"]
    given = [read.name(key) for key in ("rope_scaling", "rope_parameters") if read.given(key)]
    key = given[0] if given else "rope_parameters"
    where = f"{read.path}: config.json" + ("" if given else f", the {read.family} defaults")
    check_rope_scaling(scaling, rotated, f"{where}, layer {index}", key)


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's ``yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
