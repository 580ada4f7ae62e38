"""Attention blocks shared across layers (Zamba's and Zamba2's, transformers 5.24): one block
(or ``num_mem_blocks`` blocks in turn) of attention runs at every attention layer, its
weights tied, so a checkpoint keeps each block's tensors once, under the first layer that
runs it; each block reads the hidden states joined to the embeddings (``2 * hidden_size``
wide) and writes ``hidden_size`` (:class:`mha.MultiHeadAttention`'s ``qdim``). Zamba2's
block may add, per layer, a low-rank adapter to each of its query, key and value
projections, ``x @ A @ B`` (``linear_{q,k,v}_adapter_list.{n}``, ``n`` the layer's place
among the attention layers, kept under its block's layer beside the other layers' of that
block): each layer's weights are the block's with its adapters folded in, ``W + A @ B``,
computed in float64.

>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> blocks = SharedBlocks(blocks="num_mem_blocks", adapters="use_shared_attention_adapter")
>>> read = Settings(SimpleNamespace(path="ckpt", config={"num_mem_blocks": 2,
...     "use_shared_attention_adapter": True}), "zamba2", {})
>>> [blocks.source(read, i, [0, 2, 3, 5]) for i in (0, 2, 3, 5)]
[0, 2, 0, 2]
>>> blocks.others(read, 3, [0, 2, 3, 5])[:2]
['linear_q_adapter_list.0.0.weight', 'linear_q_adapter_list.0.1.weight']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import AttentionValueError
from .config import Settings
from .layouts import Tensor, whole

__all__ = ["SharedBlocks"]

_ADAPTER = "linear_{p}_adapter_list.{n}.{j}.weight"
"""transformers' name of adapter ``n``'s down (``j=0``) and up (``j=1``) projection of
``p`` (``q``, ``k``, ``v``), under the block's attention."""


@dataclass(frozen=True)
class SharedBlocks:
    """Attention blocks shared by the attention layers: as many as the config key
    ``blocks`` says (``None``: one, Zamba's), run in turn, with adapters per layer where the
    config key ``adapters`` is true (Zamba2's ``use_shared_attention_adapter``), of the rank
    the config key ``rank`` gives; the projections read ``inputs`` times ``hidden_size``."""

    blocks: str | None = None
    adapters: str | None = None
    rank: str = "adapter_rank"
    inputs: int = 2

    def count(self, read: Settings) -> int:
        return 1 if self.blocks is None else int(read.positive(self.blocks))

    def source(self, read: Settings, index: int, layers: list[int]) -> int:
        """The layer under which layer ``index``'s block is kept (``layers``: the attention
        layers, in order)."""
        return layers[layers.index(index) % self.count(read)]

    def tensors(
        self, read: Settings, index: int, layers: list[int], tensors: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """``tensors`` (a multi-head layer's, as its layout names them for projections of
        ``hidden_size`` inputs) with the query, key and value projections ``inputs`` times
        wider, and layer ``index``'s adapters."""
        E = read.positive("hidden_size")
        widened = {
            name: Tensor((tensor.shape[0], self.inputs * E), tensor.parts)
            if name.split(".")[0] in ("q_proj", "k_proj", "v_proj") and name.endswith("weight")
            else tensor
            for name, tensor in tensors.items()
        }
        if not self._adapted(read):
            return widened
        n, width, rank = layers.index(index), self.inputs * E, read.positive(self.rank)
        for p in "qkv":
            widened[_ADAPTER.format(p=p, n=n, j=0)] = whole(f"A_{p}", rank, width)
            widened[_ADAPTER.format(p=p, n=n, j=1)] = whole(f"B_{p}", width, rank)
        return widened

    def others(self, read: Settings, index: int, layers: list[int]) -> list[str]:
        """The adapters of the other layers that share layer ``index``'s block, kept under
        the same module."""
        if not self._adapted(read):
            return []
        blocks, n = self.count(read), layers.index(index)
        return [
            _ADAPTER.format(p=p, n=m, j=j)
            for m in range(n % blocks, len(layers), blocks)
            if m != n
            for p in "qkv"
            for j in (0, 1)
        ]

    def folded(self, read: Settings, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``weights`` with each adapter folded into its projection, ``W + A @ B`` in float64
        (then in the weights' dtype), the adapters dropped."""
        if not self._adapted(read):
            return weights
        folded = {name: W for name, W in weights.items() if name[:2] not in ("A_", "B_")}
        for p in "qkv":
            W, A, B = weights[f"W_{p}"], weights[f"A_{p}"], weights[f"B_{p}"]
            if B.shape[1] != W.shape[1]:
                raise AttentionValueError(
                    f"{read.path}: the {p} adapter of {read.family} writes {B.shape[1]} "
                    f"features but its {p}_proj {W.shape[1]}; transformers adds them"
                )
            sum64 = W.astype(np.float64) + A.astype(np.float64) @ B.astype(np.float64)
            folded[f"W_{p}"] = sum64.astype(W.dtype)
        return folded

    def _adapted(self, read: Settings) -> bool:
        return self.adapters is not None and bool(read.get(self.adapters))
