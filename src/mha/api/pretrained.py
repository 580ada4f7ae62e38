"""One entry point for any layer of a transformers checkpoint: :func:`from_pretrained` returns
the attention that layer computes, a :class:`~mha.MultiHeadAttention` or a
:class:`~mha.LatentAttention` (DeepSeek's multi-head latent attention), so that a caller can
walk every layer without knowing the family; :func:`attention_layers` lists the layers that
have an attention to read (all of them, but in a hybrid model: Jamba's, Bamba's, Nemotron-H's
layers between their Mamba layers). The readers are reached by name
(:mod:`.formats`), as the classmethods reach them.
"""

from __future__ import annotations

from typing import Any

from . import formats
from .block_sparse import BlockSparseAttention, BlockSparseSpec
from .differential import DifferentialAttention, DifferentialSpec
from .dynamic_mask import DynamicMaskAttention, DynamicMaskSpec
from .latent import LatentAttention, LatentSpec
from .module import MultiHeadAttention
from .segment_bias import SegmentBiasAttention, SegmentBiasSpec

__all__ = ["attention_layers", "from_pretrained"]


def from_pretrained(
    path: Any, layer: int = 0, dtype: Any = None
) -> MultiHeadAttention | LatentAttention:
    """Layer ``layer``'s attention of the transformers checkpoint at ``path`` (a
    ``save_pretrained`` directory, or a llama.cpp GGUF file), in ``dtype`` (default: the
    checkpoint's), whichever kind it is: the layer :meth:`mha.MultiHeadAttention.from_pretrained` or
    :meth:`mha.LatentAttention.from_pretrained` reads. Only that layer's attention tensors are
    read; what mha cannot compute exactly is refused by the feature's name (docs/pretrained.md).

    >>> import mha
    >>> mha.from_pretrained("no-such-checkpoint", layer=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mha.WeightsFileError: no-such-checkpoint does not exist; it should be a folder ...
    """
    spec, weights = formats.get("pretrained")(path, layer, dtype)
    if isinstance(spec, LatentSpec):
        return LatentAttention.from_spec(spec, weights)
    if isinstance(spec, BlockSparseSpec):
        return BlockSparseAttention.from_spec(spec, weights, f"{path}, layer {layer}")
    if isinstance(spec, DynamicMaskSpec):
        return DynamicMaskAttention.from_spec(spec, weights, f"{path}, layer {layer}")
    if isinstance(spec, SegmentBiasSpec):
        return SegmentBiasAttention.from_spec(spec, weights, f"{path}, layer {layer}")
    if isinstance(spec, DifferentialSpec):
        return DifferentialAttention.from_spec(spec, weights, f"{path}, layer {layer}")
    return MultiHeadAttention.from_spec(spec, weights, f"{path}, layer {layer}")


def attention_layers(path: Any) -> list[int]:
    """The indices of the layers of the transformers checkpoint at ``path`` whose attention
    :func:`from_pretrained` reads: every layer, but in a hybrid model (Jamba, Bamba,
    Granite 4, Nemotron-H, LFM2...) its attention layers alone; its other layers (Mamba,
    linear attention, short convolutions) are refused by their index. Only ``config.json``
    is read.

    >>> import mha
    >>> mha.attention_layers("no-such-checkpoint")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mha.WeightsFileError: no-such-checkpoint does not exist; it should be a folder ...
    """
    layers: list[int] = formats.get("pretrained.attention_layers")(path)
    return layers
