"""What one layer of a transformers checkpoint computes in its attention: the pair
``(spec, weights)`` that :meth:`mha.MultiHeadAttention.from_spec` (a :class:`mha.LayerSpec`)
or :meth:`mha.LatentAttention.from_spec` (a :class:`mha.LatentSpec`, DeepSeek's multi-head
latent attention) builds the layer from, read from ``config.json`` as transformers 5.24 reads
it and from that layer's tensors alone. The weights are in mha's "x @ W" layout.

Each ``model_type`` is one row of a table (:mod:`.registry`, rows of :class:`.family.Family`):
which tensors hold Q, K, V and O, fused or not, with which biases (:mod:`.layouts`); which
config keys give the heads, the head width, the rope's base, fraction, interleaving and
scaling, and which layers have no rope (:mod:`.rope`), the QK-norm, the sliding windows and
per-layer types (:mod:`.windows`), the scale and soft-cap; the config class's defaults; and
the attention features it uses. The files:

* :mod:`.config`: a config read as its class reads it (``config.json``, else the row's
  defaults), the checks of its values, the keys refused by the feature they ask for;
* :mod:`.rope`: the rope parameters of each layer, standardised as transformers does, and
  which layers rotate;
* :mod:`.windows`: which layers slide and how far; :mod:`.alibi`: ALiBi's slopes;
* :mod:`.layouts`: the tensor names of each layout, their shapes and how each becomes mha's
  weights;
* :mod:`.family` and :mod:`.registry`: the row type and the table, :mod:`.defaults`: each
  config class's defaults of the keys read;
* :mod:`.hybrid`: which layers of a hybrid model (Mamba, linear attention or short
  convolutions between its attention layers) are attention;
* :mod:`.attention`: a layer's settings and tensors from its row and config;
* here: reading them, checked against the config, from a :class:`~.config.Source` (a
  :class:`~mha.integrations.checkpoint.Checkpoint`).

Whatever mha would compute differently is refused by name: an unknown ``model_type``, an
option these readers do not map, a layer's weight that is missing, misshapen or unknown.
(``pretraining_tp``, which only BLOOM's attention reads, to sum its output projection in
slices, the same sum, is ignored; an older checkpoint's ``rotary_emb.inv_freq`` buffer is
not read: the config gives it.)

>>> SUPPORTED[:4]
('llama', 'mistral', 'qwen2', 'qwen3')
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...api.block_sparse import BlockSparseSpec
from ...api.configuration import LayerSpec
from ...api.differential import DifferentialSpec
from ...api.dynamic_mask import DynamicMaskSpec
from ...api.latent import LatentSpec
from ...api.segment_bias import SegmentBiasSpec
from ...errors import AttentionValueError, WeightsFileError
from ..checkpoint import open_checkpoint
from .attention import completed, describe
from .config import Settings, Source, layer_index
from .family import Family
from .layouts import (
    Projections,
    attention_prefix,
    attentions_per_layer,
    check_names,
    lay_out,
    outside_layers,
    stack_heads,
)
from .registry import FAMILIES, REFUSED, SUPPORTED, register
from .rope import check_rope

__all__ = [
    "FAMILIES",
    "REFUSED",
    "SUPPORTED",
    "Family",
    "attention_layers",
    "layer_attention",
    "read_layer",
    "register",
]


def read_layer(
    path: Any, layer: Any, dtype: Any = None
) -> tuple[LayerSpec | LatentSpec, dict[str, np.ndarray]]:
    """Layer ``layer``'s attention of the transformers checkpoint at ``path`` (or of the
    llama.cpp GGUF file, :mod:`mha.integrations.gguf_file`) as the pair
    ``(spec, weights)`` that :meth:`mha.MultiHeadAttention.from_spec` (a
    :class:`~mha.LayerSpec`) or :meth:`mha.LatentAttention.from_spec` (a
    :class:`~mha.LatentSpec`) builds the layer from."""
    kind, settings, weights = layer_attention(open_checkpoint(path), layer, dtype)
    kinds = {"latent": LatentSpec, "differential": DifferentialSpec,
             "dynamic_mask": DynamicMaskSpec}  # fmt: skip
    kinds |= {"block_sparse": BlockSparseSpec, "segment_bias": SegmentBiasSpec}
    return kinds.get(kind, LayerSpec)(**settings), weights


def layer_attention(
    source: Source, layer: Any, dtype: Any = None
) -> tuple[str, dict[str, Any], dict[str, np.ndarray]]:
    """What layer ``layer`` of ``source`` computes in its attention, as ``(kind, settings,
    weights)``, reading that layer's attention tensors and no others (cast to ``dtype`` when
    given). ``kind`` is ``"attention"`` (the settings are :class:`mha.LayerSpec`'s keywords)
    or ``"latent"`` (:class:`mha.LatentSpec`'s)."""
    family = family_of(source.config, source.path)
    read = Settings(source, family.name, family.defaults, family.keys)
    count = _layers(family, read)
    index = layer_index(layer, count, source.path)
    if family.hybrid is not None:
        family.hybrid.check(read, index, count)
    held, others = index, []  # the layer that keeps the tensors, and others' kept there
    if family.shared is not None and family.hybrid is not None:  # Zamba's shared blocks
        layers = family.hybrid.attention_layers(read, count)
        held, others = (
            family.shared.source(read, index, layers),
            family.shared.others(read, index, layers),
        )
    paired = family.tensors.paired if isinstance(family.tensors, Projections) else None
    prefix = attention_prefix(source, held, family.tensors.path, paired)
    kind, settings, tensors = describe(family, read, index)
    if family.shared is not None and family.hybrid is not None:
        tensors = family.shared.tensors(read, index, layers, tensors)
    check_rope(read, settings, index)
    # each tensor's prefix: the layer's, but a layer that attends with another's keys and
    # values (Gemma 3n, Gemma 4) reads their projections and norm from that layer
    at = dict.fromkeys(tensors, prefix)
    shared = getattr(family.tensors, "shared", None)  # tensors outside the layers (CPM-Ant's)
    for name, tensor in (shared(read, settings) if shared else {}).items():
        name = outside_layers(prefix, family.tensors.path, name)
        tensors[name], at[name] = tensor, ""
    if family.values is not None and settings.get("shares_kv_with") is not None:
        other = attention_prefix(source, settings["shares_kv_with"], family.tensors.path)
        at |= {name: other for name in tensors if name.startswith(family.values.borrowed)}
    check_names(source, prefix, [name for name in tensors if at[name] == prefix] + others, read)
    arrays = source.read([at[name] + name for name in tensors], dtype=dtype)
    weights: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        array = arrays[at[name] + name]
        if array.shape != tensor.shape:
            raise WeightsFileError(
                f"{source.path}: {at[name] + name} has shape {array.shape}, but the config "
                f"({read.summary()}) calls for {tensor.shape}"
            )
        weights.update(lay_out(array, tensor))
    weights = completed(family, settings, stack_heads(weights), read)
    if family.shared is not None:
        weights = family.shared.folded(read, weights)
    return kind, settings, weights


def attention_layers(path: Any) -> list[int]:
    """The indices of the layers of the transformers checkpoint at ``path`` whose attention
    mha reads: every layer, but in a hybrid family (Jamba, Bamba, Nemotron-H...) the
    attention layers alone, not its Mamba, linear-attention or convolution layers."""
    source = open_checkpoint(path)
    family = family_of(source.config, source.path)
    read = Settings(source, family.name, family.defaults, family.keys)
    count = _layers(family, read)
    if family.hybrid is None:
        return list(range(count))
    return family.hybrid.attention_layers(read, count)


def _layers(family: Family, read: Settings) -> int:
    """The checkpoint's attention layers as mha numbers them: ``num_hidden_layers`` (times
    two for LongCat-Flash's two attentions a decoder layer), or (Nemotron-H's config, which
    counts its layer types) as many as its layers' types."""
    if family.slots is not None:  # Dory's looped layers, a cache slot a loop
        return family.slots(read)
    if family.hybrid is not None and family.hybrid.counts:
        return len(family.hybrid.types(read, None))
    return int(read.positive("num_hidden_layers")) * attentions_per_layer(family.tensors.path)


def family_of(config: dict[str, Any], path: Any) -> Family:
    """The row of ``config``'s ``model_type``, or a refusal that names it and the reason."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None:
        return family
    reason = "config.json names no model_type"
    if isinstance(model_type, str):
        reason = REFUSED.get(model_type, "it is not supported")
    raise AttentionValueError(
        f"{path}: model_type {model_type!r}: {reason}; the model types mha reads are "
        f"{', '.join(FAMILIES)}"
    )
