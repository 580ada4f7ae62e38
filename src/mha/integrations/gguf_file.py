"""A llama.cpp GGUF file as a checkpoint: its metadata as transformers' ``config.json`` keys,
its tensors under transformers' names, dequantized by the ``gguf`` package's own functions.

llama.cpp names one value per architecture (``llama.block_count``,
``llama.attention.head_count_kv``, ``llama.rope.freq_base``) and one tensor per layer and role
(``blk.3.attn_q.weight``). Each architecture read is one row of :data:`ARCHITECTURES`: its
``model_type``, the keys it maps as transformers' GGUF reader maps them (a key mapped to
``None`` is read and dropped: the config class's default stands, as in transformers), its
tensors' names, and what its ``convert_hf_to_gguf.py`` did to the tensors, undone here
exactly as transformers' reader undoes it: llama's query and key rows reordered for
interleaved rotary (each head's ``(2, d/2)`` rows as ``(d/2, 2)``), Gemma's and Nemotron's
norm weights written as ``1 + w``, GPT-2's Conv1D weights transposed, BLOOM's fused rows
regrouped, Qwen-MoE's experts stacked one tensor per projection (read here one expert at a
time). The dequantization is ``gguf.dequantize``, the reference llama.cpp ships, in float32,
then cast to the asked dtype.

What mha would compute differently is refused by name, never approximated: an architecture
not in the table (those transformers reads are named in :data:`NOT_READ` with what they
lack), a quantization type outside :data:`QUANTIZATIONS`, a metadata key of the architecture
that this reader does not map (rope scaling...), and llama 3's ``rope_freqs`` tensor. A
tensor with no transformers name keeps its GGUF name, so that whoever reads the layers
refuses it by that name.

>>> ARCHITECTURES["llama"].model_type, "Q4_1" in QUANTIZATIONS
('llama', True)
>>> hf_name("blk.7.attn_q.weight", ARCHITECTURES["llama"])
'model.layers.7.self_attn.q_proj.weight'
>>> hf_name("blk.7.ffn_gate_exps.weight", ARCHITECTURES["llama"])
'blk.7.ffn_gate_exps.weight'
>>> hf_name("blk.0.attn_qkv.weight", ARCHITECTURES["gpt2"])
'transformer.h.0.attn.c_attn.weight'
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AttentionTypeError, AttentionValueError, WeightsFileError
from .sources import TensorNames

__all__ = [
    "ARCHITECTURES",
    "NOT_READ",
    "QUANTIZATIONS",
    "GGUFFile",
    "hf_name",
    "is_gguf",
    "open_gguf",
]

QUANTIZATIONS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # fmt: skip
"""The tensor types read: ``gguf.dequantize`` turns each into the float32 numbers llama.cpp
computes with."""

COMMON_KEYS: dict[str, str | None] = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
"""``{arch}.KEY`` metadata and the transformers config key it gives, as transformers reads
Llama's (``GGUF_CONFIG_MAPPING``); each row says how its own differ."""

HEAD_WIDTHS = ("rope.dimension_count", "attention.key_length", "attention.value_length")
"""Keys that must agree with the head width where the architecture does not read them."""

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
"""llama.cpp's name of each tensor outside the layers and transformers', as Llama names them."""

LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""llama.cpp's name of each tensor of a layer (``blk.N.NAME``) and transformers' (under
``model.layers.N.``), as Llama, Qwen2 and Qwen3 name them."""

GEMMA_LAYER = {
    **LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
MOE_LAYER = {
    **LAYER,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
"""Qwen-MoE's experts, stacked in one tensor per projection (``blk.N.ffn_up_exps``), and
each expert's projection (``model.layers.N.mlp.experts.E.up_proj``)."""
MOE_KEYS: dict[str, str | None] = {
    **COMMON_KEYS,
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": None,  # transformers reads none: the class's default
    "expert_shared_feed_forward_length": None,
}
GPT2_LAYER = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
BLOOM_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}
GPT2_KEYS: dict[str, str | None] = {
    "block_count": "n_layer",
    "context_length": "n_ctx",
    "embedding_length": "n_embd",
    "feed_forward_length": "feed_forward_length",  # GPT2Config reads none: its MLP is 4 wide
    "attention.head_count": "n_head",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "vocab_size": None,  # transformers counts the tokenizer's tokens
}
BLOOM_KEYS: dict[str, str | None] = {
    "block_count": "n_layer",
    "embedding_length": "hidden_size",
    "attention.head_count": "n_head",
    "vocab_size": "vocab_size",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
}
UNREAD = dict.fromkeys(("rope.dimension_count",))
"""Keys transformers reads and drops (``None`` in its mapping): the config class's default
stands (StableLM's and Nemotron's partial rotary fractions)."""


def _minimax_m2(config: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M2's scoring of the experts, given by llama.cpp as a number."""
    scoring = config.get("scoring_func")
    if not isinstance(scoring, int):
        return {}
    return {"scoring_func": {0: "none", 1: "softmax", 2: "sigmoid"}.get(scoring, "softmax")}


def _lfm2(config: dict[str, Any]) -> dict[str, Any]:
    """LFM2's layers as transformers reads them: the key and value heads given per layer
    (none in a convolution layer) make ``full_attn_idxs``, their largest the count."""
    heads = config["num_key_value_heads"]
    heads = list(heads) if isinstance(heads, list | tuple) else [heads]
    return {
        "num_key_value_heads": max(heads),
        "full_attn_idxs": [i for i, n in enumerate(heads) if n > 0],
        "block_auto_adjust_ff_dim": False,
    }


def _stablelm(names: Collection[str]) -> dict[str, Any]:
    """StableLM's settings that transformers reads from the tensors: biases on the query,
    key and value; a parallel residual where the layers have no ``ffn_norm``."""
    return {
        "use_qkv_bias": any(re.search(r"\.attn_[qkv]\.bias$", name) for name in names),
        "use_parallel_residual": not any(".ffn_norm." in name for name in names),
    }


@dataclass(frozen=True)
class Architecture:
    """One ``general.architecture``: what transformers calls it, the ``{arch}.KEY`` values
    it maps (to ``None``: read and dropped, the config class's default standing), its
    tensors' names, and what llama.cpp's converter did to its tensors that is undone here."""

    model_type: str
    keys: Mapping[str, str | None] = field(default_factory=lambda: COMMON_KEYS)
    permuted: bool = False  # llama's converter reorders q and k rows for interleaved rotary
    layer: Mapping[str, str] = field(default_factory=lambda: LAYER)
    top: Mapping[str, str] = field(default_factory=lambda: TOP)
    layers: str = "model.layers"
    plus_one: bool = False  # every norm weight written as 1 + w (Gemma's, Nemotron's)
    transposed: tuple[str, ...] = ()  # GPT-2's Conv1D weights, written as Linear ones
    qkv_by_head: bool = False  # BLOOM's fused rows, written as all q, all k, all v
    tied: bool | None = None  # whatever the file holds (BLOOM's and Falcon's: always)
    derived: Callable[[Collection[str]], dict[str, Any]] | None = None
    """Settings transformers reads from the tensors' names (StableLM's)."""
    adapted: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Settings transformers derives from the others (LFM2's attention layers)."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Settings transformers' reader gives whatever the file says (Qwen3-MoE's)."""
    unsqueezed: tuple[str, ...] = ()  # LFM2's convolutions, written (channels, width)
    bare: Mapping[str, str] = field(default_factory=dict)
    """Tensors whose transformers name has no ``.weight`` or ``.bias`` (MiniMax-M2's
    routing bias), by llama.cpp's ``role.kind``."""
    requires: Mapping[str, Any] = field(default_factory=dict)
    """``{arch}.KEY`` values the file must hold, else refused: what transformers' model
    of it assumes (Falcon-7B's one key and value head)."""


ARCHITECTURES = {
    "llama": Architecture(
        "llama", {**COMMON_KEYS, "rope.dimension_count": "head_dim"}, permuted=True
    ),
    "qwen2": Architecture("qwen2"),
    "qwen3": Architecture("qwen3", {**COMMON_KEYS, "attention.key_length": "head_dim"}),
    "qwen2moe": Architecture("qwen2_moe", MOE_KEYS, layer=MOE_LAYER),
    "qwen3moe": Architecture(
        "qwen3_moe",
        {**MOE_KEYS, "attention.key_length": "head_dim"},
        layer=MOE_LAYER,
        settings={"norm_topk_prob": True},  # llama.cpp always renormalises the top experts
    ),
    "minimax-m2": Architecture(
        "minimax_m2",
        {
            **MOE_KEYS,
            "rope.dimension_count": "rotary_dim",
            "attention.key_length": "head_dim",
            "attention.value_length": None,
            "expert_count": "num_local_experts",
            "expert_gating_func": "scoring_func",
        },
        layer=MOE_LAYER,
        bare={"exp_probs_b.bias": "mlp.e_score_correction_bias"},
        settings={"use_routing_bias": True},
        adapted=_minimax_m2,
    ),
    "lfm2": Architecture(
        "lfm2",
        {**COMMON_KEYS, "rope.dimension_count": None, "shortconv.l_cache": "conv_L_cache"},
        layer={
            **LAYER,
            "attn_output": "self_attn.out_proj",
            "attn_q_norm": "self_attn.q_layernorm",
            "attn_k_norm": "self_attn.k_layernorm",
            "attn_norm": "operator_norm",
            "ffn_norm": "ffn_norm",
            "ffn_gate": "feed_forward.w1",
            "ffn_up": "feed_forward.w3",
            "ffn_down": "feed_forward.w2",
            "shortconv.conv": "conv.conv",
            "shortconv.in_proj": "conv.in_proj",
            "shortconv.out_proj": "conv.out_proj",
        },
        top={**TOP, "token_embd_norm": "model.embedding_norm"},
        unsqueezed=("shortconv.conv",),
        adapted=_lfm2,
    ),
    "phi3": Architecture(
        "phi3",
        {
            **COMMON_KEYS,
            "rope.scaling.original_context_length": None,
            "attention.sliding_window": None,
        },
        layer={**LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
    "gemma2": Architecture(
        "gemma2",
        {
            **COMMON_KEYS,
            "attention.key_length": "head_dim",
            "attention.value_length": None,
            "attention.sliding_window": "sliding_window",
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        },
        layer=GEMMA_LAYER,
        plus_one=True,
    ),
    "gemma3": Architecture(
        "gemma3_text",
        {
            **COMMON_KEYS,
            "attention.key_length": "head_dim",
            "attention.value_length": None,
            "attention.sliding_window": "sliding_window",
        },
        layer=GEMMA_LAYER,
        plus_one=True,
    ),
    "nemotron": Architecture(
        "nemotron",
        {
            **COMMON_KEYS,
            **UNREAD,
            "attention.layer_norm_rms_epsilon": "norm_eps",
            "attention.layer_norm_epsilon": None,
        },
        plus_one=True,
    ),
    "stablelm": Architecture(
        "stablelm",
        {
            **COMMON_KEYS,
            **UNREAD,
            "attention.layer_norm_epsilon": "layer_norm_eps",
            "rope.freq_base": None,
            "use_parallel_residual": None,
        },
        derived=_stablelm,
    ),
    "starcoder2": Architecture(
        "starcoder2",
        {
            "block_count": "num_hidden_layers",
            "context_length": "max_position_embeddings",
            "embedding_length": "hidden_size",
            "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "attention.layer_norm_epsilon": "norm_epsilon",
            "rope.freq_base": None,
            "vocab_size": None,  # transformers counts the tokenizer's tokens
        },
        layer={**LAYER, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    ),
    "falcon": Architecture(
        "falcon",
        {
            **COMMON_KEYS,
            "attention.head_count_kv": None,  # one, multi-query: Falcon-7B's
            "attention.layer_norm_epsilon": None,
            "tensor_data_layout": None,
        },
        layer={
            "attn_norm": "input_layernorm",
            "attn_qkv": "self_attention.query_key_value",
            "attn_output": "self_attention.dense",
            "ffn_up": "mlp.dense_h_to_4h",
            "ffn_down": "mlp.dense_4h_to_h",
        },
        top={
            "token_embd": "transformer.word_embeddings",
            "output_norm": "transformer.ln_f",
            "output": "lm_head",
        },
        layers="transformer.h",
        tied=True,
        requires={"attention.head_count_kv": 1},
    ),
    "gpt2": Architecture(
        "gpt2",
        GPT2_KEYS,
        layer=GPT2_LAYER,
        top={
            "token_embd": "transformer.wte",
            "position_embd": "transformer.wpe",
            "output_norm": "transformer.ln_f",
            "output": "lm_head",
        },
        layers="transformer.h",
        transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
    ),
    "bloom": Architecture(
        "bloom",
        {
            **BLOOM_KEYS,
            "context_length": None,
            "feed_forward_length": None,
            "attention.head_count_kv": None,
        },
        layer=BLOOM_LAYER,
        top={
            "token_embd": "transformer.word_embeddings",
            "token_embd_norm": "transformer.word_embeddings_layernorm",
            "output_norm": "transformer.ln_f",
            "output": "lm_head",
        },
        layers="transformer.h",
        qkv_by_head=True,
        tied=True,
    ),
}
"""The architectures read, by ``general.architecture``; others are refused by name."""

NOT_READ = {
    "t5": "an encoder-decoder, T5, whose checkpoints mha does not read either",
    "t5encoder": "an encoder, T5's, whose checkpoints mha does not read either",
    "mamba": "Mamba's state-space layers, which have no attention",
    "deci": "DeciLM's layers, whose checkpoints mha does not read either",
    "gemma4": "Gemma 4's layers, whose checkpoints mha does not read either",
    "gpt-oss": "gpt-oss's sinks, YaRN scaling and MXFP4 experts, not mapped from GGUF yet",
}
"""Architectures transformers reads from GGUF that mha does not, each with what it lacks."""

IGNORED = ("general.", "tokenizer.", "GGUF.", "split.", "quantize.")
"""Metadata that changes nothing computed: names, licences, the tokenizer (read apart)."""


def is_gguf(path: Any) -> bool:
    """Whether ``path`` names a GGUF file (by its first four bytes, ``GGUF``)."""
    try:
        with open(os.fspath(path), "rb") as handle:
            return handle.read(4) == b"GGUF"
    except (OSError, TypeError):
        return False


def open_gguf(path: Any) -> GGUFFile:
    """The GGUF file at ``path``, parsed once while it is unchanged (each layer's reader
    opens the file by its path)."""
    resolved = Path(os.fspath(path)).resolve()
    stat = resolved.stat()
    return _opened(resolved, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _opened(path: Path, mtime: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def hf_name(name: str, architecture: Architecture) -> str:
    """transformers' name of the GGUF tensor ``name``, or ``name`` itself where it has none."""
    match = re.fullmatch(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)", name)
    if match and f"{match.group(2)}.{match.group(3)}" in architecture.bare:
        index, role, kind = match.groups()
        return f"{architecture.layers}.{index}.{architecture.bare[f'{role}.{kind}']}"
    if match and match.group(2) in architecture.layer:
        index, role, kind = match.groups()
        return f"{architecture.layers}.{index}.{architecture.layer[role]}.{kind}"
    match = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if match and match.group(1) in architecture.top:
        return f"{architecture.top[match.group(1)]}.{match.group(2)}"
    return name


class GGUFFile(TensorNames):
    """The config and tensors of a GGUF file, under transformers' keys and names: the same
    ``config``, :meth:`keys` and :meth:`read` as :class:`~mha.integrations.checkpoint.Checkpoint`.
    :attr:`metadata` holds every value of the file by its GGUF key (the tokenizer's among
    them). Needs the ``gguf`` package (``pip install mha[models]``)."""

    def __init__(self, path: Any) -> None:
        self.path = Path(os.fspath(path))
        reader = _reader(self.path)
        self.metadata: dict[str, Any] = {
            key: value.contents() for key, value in reader.fields.items()
        }
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            lacks = f" ({NOT_READ[arch]})" if arch in NOT_READ else ""
            raise WeightsFileError(
                f"{self.path}: mha reads the GGUF architectures {', '.join(ARCHITECTURES)}; "
                f"this file's general.architecture is {arch!r}, which it does not{lacks}"
            )
        self.architecture = row = ARCHITECTURES[arch]
        self._tensors = {hf_name(t.name, row): t for t in reader.tensors}
        self._slices: dict[str, int] = {}  # an expert's name: its index in the stack
        for tensor in reader.tensors:
            match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor.name)
            if match and match.group(2) in EXPERTS:
                del self._tensors[tensor.name]
                for e in range(int(tensor.shape[-1])):
                    name = f"{row.layers}.{match.group(1)}.mlp.experts.{e}"
                    name = f"{name}.{EXPERTS[match.group(2)]}.weight"
                    self._tensors[name], self._slices[name] = tensor, e
        if row.tied and "lm_head.weight" in self._tensors:
            del self._tensors["lm_head.weight"]  # the embeddings' copy: transformers ties them
        if "rope_freqs.weight" in self._tensors:
            raise WeightsFileError(
                f"{self.path} has rope_freqs.weight, llama 3's rope scaling factors, which mha "
                "does not read from GGUF files"
            )
        self.config = self._config(arch)
        self.config.update(row.settings)
        if row.adapted is not None:
            self.config.update(row.adapted(self.config))
        for key, value in row.requires.items():
            given = self.metadata.get(f"{arch}.{key}", value)
            if given != value:
                raise WeightsFileError(
                    f"{self.path}: {key} = {given!r}; mha reads {arch} GGUF files with "
                    f"{key} = {value!r}, as transformers' model of them assumes"
                )
        if row.derived is not None:
            self.config.update(row.derived([t.name for t in reader.tensors]))

    def _config(self, arch: str) -> dict[str, Any]:
        """``config.json``'s keys from the ``{arch}.`` metadata, as transformers maps them;
        a key that asks for what these keys cannot say (rope scaling, experts) is refused by
        name."""
        config: dict[str, Any] = {"model_type": self.architecture.model_type}
        keys = self.architecture.keys
        widths = {}
        for key, value in self.metadata.items():
            if key.startswith(IGNORED):
                continue
            short = key[len(arch) + 1 :] if key.startswith(arch + ".") else ""
            if short in keys:
                name = keys[short]
                if name is not None:
                    config[name] = value
            elif short in HEAD_WIDTHS:
                widths[key] = value
            else:
                raise WeightsFileError(
                    f"{self.path}: mha does not read the GGUF metadata {key} = {value!r} "
                    f"(of a {arch} model), so it would not compute what llama.cpp does"
                )
        if "vocab_size" not in config and "tokenizer.ggml.tokens" in self.metadata:
            config["vocab_size"] = len(self.metadata["tokenizer.ggml.tokens"])
        config["tie_word_embeddings"] = self.architecture.tied or (
            "lm_head.weight" not in self._tensors
        )
        for name, value in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
            if f"tokenizer.ggml.{value}_token_id" in self.metadata:
                config[name] = self.metadata[f"tokenizer.ggml.{value}_token_id"]
        if widths:
            heads = config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
        for key, value in widths.items():
            if value != head_dim:
                raise WeightsFileError(
                    f"{self.path}: {key} = {value}, but the heads are {head_dim} wide: mha "
                    "does not compute partial rotary or unequal key and value widths from GGUF"
                )
        return config

    def _where(self) -> dict[str, Any]:
        return self._tensors  # each tensor's record, by transformers' name where it has one

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}: {self.config['model_type']}, {len(self)} tensors)"

    def tensor_type(self, name: str) -> str:
        """The GGUF type the tensor ``name`` is stored in (``"Q4_1"``, ``"F32"``...)."""
        return str(self._tensors[name].tensor_type.name)

    def read(self, names: Iterable[str], dtype: Any = None) -> dict[str, np.ndarray]:
        """The tensors ``names``, dequantized by ``gguf.dequantize`` (float32), as
        transformers holds them (:meth:`_undo`), in ``dtype`` (float32 by default)."""
        import gguf

        target = np.dtype(np.float32 if dtype is None else _dtype(dtype))
        arrays = {}
        stacks: dict[str, np.ndarray] = {}  # each tensor dequantized once (experts: per call)
        for name in names:
            if name not in self._tensors:
                raise WeightsFileError(f"{self.path} has no tensor {name!r}")
            tensor = self._tensors[name]
            kind = tensor.tensor_type.name
            if kind not in QUANTIZATIONS:
                raise WeightsFileError(
                    f"{self.path}: {tensor.name} is stored as {kind}, which mha does not read "
                    f"(it reads {', '.join(QUANTIZATIONS)})"
                )
            if tensor.name not in stacks:
                array = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), np.float32)
                stacks[tensor.name] = array.reshape([int(n) for n in reversed(tensor.shape)])
            array = stacks[tensor.name]
            if name in self._slices:
                array = array[self._slices[name]]
            else:
                del stacks[tensor.name]
            arrays[name] = self._undo(tensor.name, name, array).astype(target, copy=True)
        return arrays

    def _undo(self, gguf_name: str, name: str, array: np.ndarray) -> np.ndarray:
        """The tensor as transformers holds it: what llama.cpp's converter did, undone
        (each an exact permutation, transpose or subtraction, as transformers' reader does)."""
        row = self.architecture
        role = gguf_name.split(".", 2)[-1].rsplit(".", 1)[0] if gguf_name.startswith("blk.") else ""
        if row.permuted:
            array = self._unpermute(name, array)
        if row.plus_one and gguf_name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        if role in row.transposed and gguf_name.endswith(".weight"):
            array = array.T
        if row.qkv_by_head and role == "attn_qkv":
            array = self._by_head(array)
        if role in row.unsqueezed:
            array = array[:, None]
        if role == "ffn_gate_inp_shexp":
            array = array[None]  # Qwen2-MoE's shared expert's gate, (1, hidden)
        return array

    def _by_head(self, array: np.ndarray) -> np.ndarray:
        """BLOOM's fused rows back in its order, each head's query, key and value together:
        llama.cpp's converter wrote all the queries, then the keys, then the values."""
        heads = self.config["n_head"]
        q, k, v = (part.reshape(heads, -1, *array.shape[1:]) for part in np.split(array, 3))
        return np.stack([q, k, v], axis=1).reshape(array.shape)

    def _unpermute(self, name: str, array: np.ndarray) -> np.ndarray:
        """The query's and key's rows in transformers' order: llama.cpp's converter wrote
        each head's ``d`` rows as ``(d/2, 2)`` pairs of the ``(2, d/2)`` halves."""
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = self.config["num_attention_heads"]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = self.config.get("num_key_value_heads") or self.config["num_attention_heads"]
        else:
            return array
        rows = array.shape[0]
        if rows % (2 * heads):
            raise WeightsFileError(f"{self.path}: {name} has {rows} rows, not 2 per head pair")
        w = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
        return w.swapaxes(1, 2).reshape(array.shape)


def _reader(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise WeightsFileError(
            f"{path} is a GGUF file: reading it needs the gguf package (pip install 'mha[models]')"
        ) from None
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError) as error:
        raise WeightsFileError(f"{path} is not a GGUF file mha can read ({error})") from None


def _dtype(dtype: Any) -> np.dtype:
    try:
        target: np.dtype = np.dtype(dtype)
    except TypeError:
        raise AttentionTypeError(
            f"dtype must be a NumPy dtype such as float32; got {dtype!r}"
        ) from None
    if target.kind != "f":
        raise AttentionValueError(f"dtype must be a float dtype; got {target}")
    return target
