"""The integrations' readers and writers, registered with the API (:mod:`mha.api.formats`)
when ``mha`` is imported: the API's loaders and exporters call them by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..api import formats
from . import npz, pytorch, readers, transformers

__all__ = ["FUNCTIONS"]

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "torch.weights": pytorch.weights_from_torch,
    "torch.state_dict": pytorch.torch_state_dict,
    "torch.tensors": pytorch.as_tensors,
    "torch.module": pytorch.torch_module,
    "gpt2": transformers.weights_from_gpt2,
    "llama": transformers.weights_from_llama,
    "pretrained": readers.read_layer,
    "pretrained.attention_layers": readers.attention_layers,
    "npz.save": npz.save,
    "npz.load": npz.load,
    "npz.save_latent": npz.save_latent,
    "npz.load_latent": npz.load_latent,
}
"""Each function, by the name the API asks for."""

for name, function in FUNCTIONS.items():
    formats.register(name, function)
