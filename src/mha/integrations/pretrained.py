"""The readers of transformers checkpoints under their first name: see
:mod:`mha.integrations.readers`, where each family is a row of one table.

>>> from mha.integrations.pretrained import read_layer
>>> read_layer.__module__
'mha.integrations.readers'
"""

from __future__ import annotations

from .readers import FAMILIES, SUPPORTED, layer_attention, read_layer

__all__ = ["FAMILIES", "SUPPORTED", "layer_attention", "read_layer"]
