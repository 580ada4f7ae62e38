"""Where a layer's attention keeps its tensors, by transformers' names, and how each becomes
mha's weights (the "x @ W" layout: the transposes of ``nn.Linear``'s ``(out, in)``), as
llama.cpp's ``LLM_TENSOR_NAMES`` names them per architecture: separate query, key, value and
output projections (:data:`SEPARATE_QKV`) or one fused ``qkv_proj`` (:data:`FUSED_QKV`),
their biases (:class:`Biases`, :class:`BiasesByKey`), QK-norms and sinks, under the layer's
prefix (EXAONE 3's own: :data:`EXAONE`); DeepSeek's latent projections (:data:`LATENT`).

A layout gives each tensor the config calls for as a :class:`Tensor`: its shape, and mha's
weights in it, a fused tensor's row by row.

>>> import numpy as np
>>> tensors = FUSED_QKV.tensors(d_model=4, heads=(2, 1, 2), biased=(), qk_norm=None, sinks=False)
>>> {name: tensor.shape for name, tensor in tensors.items()}
{'o_proj.weight': (4, 4), 'qkv_proj.weight': (8, 4)}
>>> {name: W.shape for name, W in lay_out(np.ones((8, 4)), tensors["qkv_proj.weight"]).items()}
{'W_q': (4, 4), 'W_k': (4, 2), 'W_v': (4, 2)}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...errors import WeightsFileError
from ..checkpoint import tensor_prefixes
from .config import Settings, Source

__all__ = [
    "ALL_BIASES",
    "ATTENTION_BIAS",
    "EXAONE",
    "FUSED_QKV",
    "LATENT",
    "NO_BIASES",
    "QKV_ATTENTION_BIAS",
    "QKV_BIASES",
    "QKV_BIASES_BY_KEY",
    "SEPARATE_QKV",
    "Biases",
    "BiasesByKey",
    "LatentProjections",
    "Projections",
    "Tensor",
    "attention_prefix",
    "check_names",
    "lay_out",
]

PREFIXES = ("model.layers.{index}.self_attn.", "layers.{index}.self_attn.")
"""Where a layer's attention tensors are in most families' checkpoints: a causal LM's, a bare
model's."""
IGNORED = ("rotary_emb.inv_freq",)
"""Tensors under a layer's attention that are not read: older checkpoints' rotary buffer,
which the config gives."""


@dataclass(frozen=True)
class Tensor:
    """One tensor under a layer's attention: its shape, and mha's weights it holds, each with
    its rows (output features), in order."""

    shape: tuple[int, ...]
    parts: tuple[tuple[str, int], ...]


def whole(name: str, *shape: int) -> Tensor:
    """A tensor that is one weight of mha's."""
    return Tensor(shape, ((name, shape[0]),))


def lay_out(array: np.ndarray, tensor: Tensor) -> dict[str, np.ndarray]:
    """mha's weights from one tensor: matrices transposed to "x @ W", a fused tensor split."""
    W = array.T if array.ndim == 2 else array
    if len(tensor.parts) == 1:
        return {tensor.parts[0][0]: W}
    weights, start = {}, 0
    for name, rows in tensor.parts:
        weights[name] = W[..., start : start + rows]
        start += rows
    return weights


@dataclass(frozen=True)
class Biases:
    """Which projections carry a bias: those in ``roles`` (every one that can, when
    ``None``), always or, with ``key``, when that config key is true."""

    key: str | None = None
    roles: tuple[str, ...] | None = None

    def carried(self, read: Settings, possible: Iterable[str]) -> tuple[str, ...]:
        if self.key is not None and not read.get(self.key):
            return ()
        return tuple(role for role in possible if self.roles is None or role in self.roles)


@dataclass(frozen=True)
class BiasesByKey:
    """Each projection in ``keys`` biased when its own config key is true (Seed-OSS:
    ``attention_bias`` for the query, key and value, ``attention_out_bias`` for the output)."""

    keys: Mapping[str, str]

    def carried(self, read: Settings, possible: Iterable[str]) -> tuple[str, ...]:
        return tuple(role for role in possible if role in self.keys and read.get(self.keys[role]))


ATTENTION_BIAS = Biases("attention_bias")
"""All four projections biased or none, as ``attention_bias`` says (Llama's)."""
QKV_BIASES = Biases(roles=("q", "k", "v"))
"""The query, key and value projections always biased, the output never (Qwen2's)."""
QKV_BIASES_BY_KEY = Biases("attention_bias", roles=("q", "k", "v"))
"""The query, key and value projections biased as ``attention_bias`` says, the output never
(Helium's, Solar Open's)."""
NO_BIASES = Biases(roles=())
QKV_ATTENTION_BIAS = Biases("attention_bias", roles=("q", "k", "v"))
"""The query, key and value projections biased as ``attention_bias`` says, the output never
(GLM's, Helium's)."""
ALL_BIASES = Biases()
"""All four projections always biased (Phi's)."""


@dataclass(frozen=True)
class Projections:
    """transformers' names of a multi-head attention's modules: the query, key, value and
    output projections (or ``qkv``, one fused projection of the queries, then the keys, then
    the values), the QK-norms and the sinks."""

    kind: ClassVar[str] = "attention"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    sinks: str = "sinks"
    prefixes: tuple[str, ...] = PREFIXES
    """Where a layer's attention tensors are (``{index}``: the layer's)."""

    def tensors(
        self,
        d_model: int,
        heads: tuple[int, int, int],
        biased: Iterable[str],
        qk_norm: str | None,
        sinks: bool,
    ) -> dict[str, Tensor]:
        """The tensors of a layer of ``heads`` (query heads, key/value heads, head width):
        projections with the ``biased`` ones' biases, the QK-norm's weights (per ``"head"``
        or across ``"all"`` heads) and the sinks."""
        H, H_kv, d = heads
        q, kv, E = H * d, H_kv * d, d_model
        tensors = {f"{self.o}.weight": whole("W_o", E, q)}
        if self.qkv is not None:
            parts = (("W_q", q), ("W_k", kv), ("W_v", kv))
            tensors[f"{self.qkv}.weight"] = Tensor((q + 2 * kv, E), parts)
        else:
            names = {"q": self.q, "k": self.k, "v": self.v}
            widths = {"q": q, "k": kv, "v": kv}
            tensors |= {f"{names[p]}.weight": whole(f"W_{p}", widths[p], E) for p in "qkv"}
        tensors |= self._biases(tuple(biased), q, kv, E)
        if qk_norm is not None:
            per_head = qk_norm == "head"
            tensors[f"{self.q_norm}.weight"] = whole("q_norm", d if per_head else q)
            tensors[f"{self.k_norm}.weight"] = whole("k_norm", d if per_head else kv)
        if sinks:
            tensors[self.sinks] = whole("sinks", H)
        return tensors

    def _biases(self, biased: tuple[str, ...], q: int, kv: int, E: int) -> dict[str, Tensor]:
        widths = {"q": q, "k": kv, "v": kv, "o": E}
        if self.qkv is None:
            names = {"q": self.q, "k": self.k, "v": self.v, "o": self.o}
            return {f"{names[p]}.bias": whole(f"b_{p}", widths[p]) for p in biased}
        tensors = {}
        if any(p in biased for p in "qkv"):  # one bias for the fused projection
            parts = (("b_q", q), ("b_k", kv), ("b_v", kv))
            tensors[f"{self.qkv}.bias"] = Tensor((q + 2 * kv,), parts)
        if "o" in biased:
            tensors[f"{self.o}.bias"] = whole("b_o", E)
        return tensors


SEPARATE_QKV = Projections()
"""``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (Llama's and most families')."""
FUSED_QKV = Projections(qkv="qkv_proj")
"""One ``qkv_proj`` and ``o_proj`` (Phi-3's)."""
EXAONE = Projections(o="out_proj", prefixes=("transformer.h.{index}.attn.attention.",))
"""EXAONE 3's names, under ``transformer.h.{index}.attn.attention.``, with ``out_proj``."""


@dataclass(frozen=True)
class LatentProjections:
    """transformers' names of DeepSeek's multi-head latent attention modules."""

    kind: ClassVar[str] = "latent"
    q: str = "q_proj"
    q_a: str = "q_a_proj"
    q_a_norm: str = "q_a_layernorm"
    q_b: str = "q_b_proj"
    kv_a: str = "kv_a_proj_with_mqa"
    kv_a_norm: str = "kv_a_layernorm"
    kv_b: str = "kv_b_proj"
    o: str = "o_proj"
    prefixes: tuple[str, ...] = PREFIXES

    def tensors(self, settings: Mapping[str, Any], biased: Iterable[str]) -> dict[str, Tensor]:
        """The tensors of a latent layer of these ``settings`` (:class:`mha.LatentSpec`'s
        keywords), with the ``biased`` projections' biases (``q_a``, ``kv_a``, ``o``)."""
        E, H, q_rank = settings["d_model"], settings["num_heads"], settings["q_lora_rank"]
        rank, v = settings["kv_lora_rank"], settings["v_head_dim"]
        nope, rope = settings["qk_nope_head_dim"], settings["qk_rope_head_dim"]
        head = H * (nope + rope)
        tensors = {
            f"{self.kv_a}.weight": whole("W_kv_a", rank + rope, E),
            f"{self.kv_a_norm}.weight": whole("kv_a_norm", rank),
            f"{self.kv_b}.weight": whole("W_kv_b", H * (nope + v), rank),
            f"{self.o}.weight": whole("W_o", E, H * v),
        }
        if q_rank is None:
            tensors[f"{self.q}.weight"] = whole("W_q", head, E)
        else:
            tensors[f"{self.q_a}.weight"] = whole("W_q_a", q_rank, E)
            tensors[f"{self.q_a_norm}.weight"] = whole("q_a_norm", q_rank)
            tensors[f"{self.q_b}.weight"] = whole("W_q_b", head, q_rank)
        widths = {"kv_a": rank + rope, "o": E, "q_a": q_rank}
        names = {"kv_a": self.kv_a, "o": self.o, "q_a": self.q_a}
        tensors |= {f"{names[p]}.bias": whole(f"b_{p}", widths[p]) for p in biased}
        return tensors

    def biasable(self, settings: Mapping[str, Any]) -> tuple[str, ...]:
        """The projections that may carry a bias: ``q_a`` (when there is one), ``kv_a``, ``o``."""
        return ("kv_a", "o") + (() if settings["q_lora_rank"] is None else ("q_a",))


LATENT = LatentProjections()
"""DeepSeek V2's and V3's modules."""


def attention_prefix(source: Source, index: int, prefixes: tuple[str, ...] = PREFIXES) -> str:
    """Where layer ``index``'s attention tensors are: the first of ``prefixes`` (``{index}``
    the layer's) the checkpoint holds tensors under; by default under ``model.`` for a
    causal LM's checkpoint, at the top for a bare model's."""
    candidates = tuple(prefix.format(index=index) for prefix in prefixes)
    keys = list(source)
    for prefix in candidates:
        if any(key.startswith(prefix) for key in keys):
            return prefix
    raise WeightsFileError(
        f"{source.path} has no attention weights of layer {index} under "
        f"{' or '.join(candidates)}; it holds {len(keys)} tensors under {tensor_prefixes(keys)}"
    )


def check_names(source: Source, prefix: str, names: Iterable[str], read: Settings) -> None:
    """Every tensor under ``prefix`` is one of ``names`` (those the config calls for, named
    under ``prefix``), and all of those are there."""
    present = {key[len(prefix) :] for key in source if key.startswith(prefix)}
    unknown = sorted(present - set(names) - set(IGNORED))
    if unknown:
        raise WeightsFileError(
            f"{source.path}: the attention at {prefix!r} has weights that "
            f"{read.family}'s attention with this config ({read.summary()}) does not "
            f"have: {', '.join(unknown)}; loading it without them would compute another model"
        )
    missing = sorted(set(names) - present)
    if missing:
        raise WeightsFileError(
            f"{source.path}: the attention at {prefix!r} lacks {', '.join(missing)}, "
            f"which {read.family}'s attention with this config ({read.summary()}) has"
        )
