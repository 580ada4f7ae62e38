"""The census of transformers' causal language models: every ``model_type`` of transformers'
own ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, classified, and for each what ``mha.from_pretrained``
does with a tiny random checkpoint of it.

The families are enumerated from transformers, not listed by hand, so that a family added
upstream shows up here (unclassified, which test_families.py fails) rather than vanishing.
Each is one of :data:`CLASSES`: a decoder-only text family, an encoder used as a decoder
(BERT's ``is_decoder``), the decoder of an encoder-decoder model, a multimodal wrapper whose
text model has its own ``model_type``, or a model without attention (Mamba, RWKV).

A family's tiny checkpoint is built generically (:func:`tiny_config`): its config class with
transformers' common sizes shrunk (hidden 48, 4 layers, 4 heads and 2 key/value heads, a
vocabulary of 64, 4 experts of which 2 per token), under the family's own names of the keys
(its ``attribute_map``), with :data:`OVERRIDES` only where the generic shrink fails. First
its ``config.json`` alone is offered to ``mha.from_pretrained``: a family mha refuses is
refused there, by its ``model_type`` or by its config. A family mha accepts gets random
weights (nonzero attention biases, norm weights away from their initial values, as
support.pretrained_models builds them), saved in bfloat16 in shards of 20 KB, and each of its
layers is read and compared with transformers' own attention module of that layer (where the
family's row says its tensors are: GPT-2's ``transformer.h.{i}.attn``), loaded in float64 from
the same checkpoint: whole sequences and prefill then token-by-token decoding,
within :data:`TOLERANCE`. Each family's :class:`Entry` says:

* ``read``: every attention layer loads and matches (a hybrid's other layers may be refused
  by their index, with the feature);
* ``refused``: mha raised its own error, given in ``detail``;
* ``wrong``: a layer loaded but computes something else (a bug);
* ``cannot build``: this harness failed (the reason in ``detail``).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DECODER = "decoder"
ENCODER = "encoder as decoder"
SEQ2SEQ = "decoder of an encoder-decoder"
MULTIMODAL = "multimodal wrapper"
RECURRENT = "not attention"

_ENCODERS = (
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
    "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
    "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod",
)  # fmt: skip
_SEQ2SEQ = (
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "blt", "marian", "mbart",
    "musicgen", "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "trocr", "whisper",
)  # fmt: skip
_MULTIMODAL = (
    "dots3_note", "emu3", "fuyu", "gemma3", "gemma3n", "gemma4", "gemma4_assistant",
    "gemma4_unified", "gemma4_unified_assistant", "git", "got_ocr2", "llama4", "mllama",
    "moshi", "moss_transcribe_diarize", "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
)  # fmt: skip
_RECURRENT = ("falcon_mamba", "mamba", "mamba2", "rwkv", "xlstm")
_DECODERS = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2",
    "bailing_hybrid", "bamba", "beam", "biogpt", "bitnet", "bloom", "codegen", "cohere",
    "cohere2", "cohere2_moe", "cohere_compass_text", "cpmant", "ctrl", "cwm", "dbrx",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "diffllama", "doge", "dory",
    "dots1", "dots3_note_text", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe",
    "falcon", "falcon_h1", "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text",
    "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox",
    "gpt_neox_japanese", "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe",
    "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium", "hrm_text",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax",
    "inkling2_loop_text", "inkling2_text", "inkling_text", "internlm3", "iquestcoder", "jais2",
    "jamba", "jetmoe", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2", "lfm2_moe",
    "lfm3", "llama", "llama4_text", "longcat_flash", "mellum", "mimo_v2_flash", "minicpm3",
    "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
    "mixtral", "modernbert-decoder", "mpt", "nanochat", "nemotron", "nemotron_h", "olmo",
    "olmo2", "olmo3", "olmo_hybrid", "olmoe", "openai-gpt", "opt", "persimmon", "phi", "phi3",
    "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe",
    "qwen3_next", "qwen4_exp_text", "recurrent_gemma", "reformer", "sarvam_mla", "sarvam_moe",
    "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma", "xglm",
    "youtu", "zamba", "zamba2", "zaya",
)  # fmt: skip

CLASSES: dict[str, str] = {
    **dict.fromkeys(_DECODERS, DECODER),
    **dict.fromkeys(_ENCODERS, ENCODER),
    **dict.fromkeys(_SEQ2SEQ, SEQ2SEQ),
    **dict.fromkeys(_MULTIMODAL, MULTIMODAL),
    **dict.fromkeys(_RECURRENT, RECURRENT),
}
"""Every ``model_type`` of transformers 5.24's causal-LM mapping, by what it is."""

READ, REFUSED, WRONG, CANNOT_BUILD = "read", "refused", "wrong", "cannot build"
GENERIC = "it is not supported"
"""The refusal of a ``model_type`` that mha names no reason for."""

TOLERANCE = 1e-12
B, L, PREFILL = 2, 24, 10
SHARD_SIZE = "20KB"

SIZES = {
    "hidden_size": 48, "intermediate_size": 32, "num_hidden_layers": 4, "vocab_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "initializer_range": 0.2, "head_dim": 12,
}  # fmt: skip
"""transformers' common config keys, shrunk (where a family's config has them)."""

SET_SIZES = {
    "sliding_window": 5, "q_lora_rank": 20, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 10, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1,
}  # fmt: skip
"""Keys shrunk only where the config class sets them (``None`` stays ``None``)."""

DROP = object()
"""A key of :data:`OVERRIDES` left to the config class."""
MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 24, "mamba_n_groups": 1}
"""Mamba heads that divide the expanded width (2 * 48)."""

ASSISTANT = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
             "enable_moe_block": False, "use_double_wide_mlp": False}  # fmt: skip
"""Gemma 4's assistant drafters: a text model without per-layer inputs or experts."""

_ATTENTION_13 = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
"""A hybrid's layers 1 and 3 attention, between Mamba or linear-attention layers."""

OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {**MAMBA, "attn_layer_indices": [1, 3]},
    "granitemoehybrid": {**MAMBA, "layer_types": _ATTENTION_13},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "full_attention", "moe", "full_attention"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 24,
        "n_groups": 1,
    },
    "mamba2": {"num_heads": 4, "head_dim": 24, "n_groups": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    "gptj": {"rotary_dim": 8},  # of the heads' 12 features (64 by default)
    "codegen": {"rotary_dim": 8},
    "gpt_neox": {  # half of each head rotated (a quarter, 3 features, cannot pair)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        }
    },
    "stablelm": {  # half of each head rotated (a quarter, 3 features, cannot pair)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        }
    },
    "ministral3": {  # yarn and Llama 4's query scale past 16 positions
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16,
            "llama_4_scaling_beta": 0.5,
        }
    },
    # Llama 4's chunks and query temperature within the census's 24 positions
    "llama4_text": {"attention_chunk_size": 8, "floor_scale": 4, "intermediate_size_mlp": 32},
    "zaya": {"num_experts_per_tok": 1},
    **{  # half of each head rotated (a quarter, 3 features, cannot pair)
        family: {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            }
        }
        for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
    },
    "longcat_flash": {"num_layers": 2, "head_dim": 8},  # its rotary is head_dim wide
    "cohere_compass_text": {  # its rotary embedding takes a rope per layer type (none: {})
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": None,
        },
    },
    # DbrxAttention reads attn_config.rope_theta (to no effect) and clamps always (None fails)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 1.0}},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "prophetnet": {"num_hidden_layers": DROP},
    "xlnet": {"max_position_embeddings": DROP},
    "gemma4_assistant": {"text_config": ASSISTANT},
    "gemma4_unified_assistant": {"text_config": ASSISTANT},
    # per-layer inputs of a vocabulary of 64; Gemma 3n's last 2 layers share the keys and
    # values of layers 0 and 1 (its 15 of 35 by default: more than 4 layers have)
    "gemma3n_text": {
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 64,
        "laurel_rank": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "gemma4_text": {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 64},
    # HY-V4: each query attends to 6 of its keys (2048 by default, every key of 24)
    "hy_v4": {"index_topk": 6, "index_n_heads": 2, "index_head_dim": 16},
    # Kimi-Linear's latent keys expanded one a query head; its full attention at layers 1, 3
    "kimi_linear": {"num_key_value_heads": 4, "layer_types": _ATTENTION_13},
    # Zamba's and Zamba2's shared attention blocks at layers 1 and 3, between Mamba layers
    "zamba": {"layers_block_type": ["linear_attention", "hybrid"] * 2},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"] * 2, "n_mamba_heads": 4},
    # MiniMax-M3's sparse layers (all dense by default): 2 blocks of 4 keys of 6 kept
    "minimax_m3_vl_text": {
        "layer_types": ["minimax_m3_sparse", "full_attention"] * 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_block_size": 4,
        "index_topk_blocks": 2,
    },
    # Qwen4-Exp's QSA (its config class sets none, which its attention cannot build without):
    # 2 blocks of 3 averaged keys, in its indexed layers 1 and 3; small Gated DeltaNet layers
    "qwen4_exp_text": {
        "layer_types": ["linear_attention", "indexed_attention"] * 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 12,
        "indexer_budget": 6,
        "indexer_compress_ratio": 3,
        "hc_lowrank": 8,
    },
    # 2 layers a stack, 2 L cycles: 12 cache slots (its 4 and 3: 32)
    "hrm_text": {"num_hidden_layers": 2, "L_cycles": 2},
    # its top-k within the census's 24 positions (2048), over 24 tokens that do not repeat
    # (equal tokens' equal biases: which of them torch.topk keeps is unspecified)
    "doge": {"keep_window_size": 8, "vocab_size": 1000},
    # one input, 2 recurrent (run twice: 6 cache slots) and one output layer (its 8 of 36),
    # a full layer in the loop
    "dory": {
        "n_input_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # CPM-Ant's bias of 16 buckets (logarithmic past 4) and 3 segments, 4 prompt tokens
    "cpmant": {
        "dim_head": 12,
        "dim_ff": 32,
        "prompt_types": 3,
        "prompt_length": 4,
        "position_bias_num_buckets": 16,
        "position_bias_max_distance": 40,
        "segment_types": 3,
    },
}
"""Per-family changes where the generic shrink does not build, or builds what the family's
real configs are not (a rotary of 3 features, GPT-J's 64 of 12; by ``model_type``)."""


@dataclass(frozen=True)
class Entry:
    """What the census found for one ``model_type``."""

    family: str
    kind: str
    """One of :data:`CLASSES`' values."""
    result: str
    """``read``, ``refused``, ``wrong`` or ``cannot build``."""
    detail: str = ""
    """The refusal, the harness's failure, or the layers refused in a family read."""
    error: float = 0.0
    """The largest relative error of the layers read (``read`` and ``wrong``)."""
    layers: tuple[int, ...] = ()
    """The layers read (``read`` and ``wrong``): a hybrid's attention layers."""
    count: int = 0
    """The checkpoint's layers."""

    @property
    def generic(self) -> bool:
        """A refusal that names no feature."""
        return self.result == REFUSED and GENERIC in self.detail


def causal_lm_types() -> dict[str, str]:
    """transformers' causal-LM mapping: ``model_type`` to its model class's name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> Any:
    """The config class of ``model_type`` with its sizes shrunk (see the module's docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    with _quiet():
        default = config_class()
    names = dict(getattr(config_class, "attribute_map", {}) or {})
    present = default.to_dict()

    def name_of(key: str) -> str | None:
        name = names.get(key, key)
        return name if name in present else None

    settings: dict[str, Any] = {}
    for key, value in SIZES.items():
        name = name_of(key)
        if name is not None:
            settings[name] = value
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # in the vocabulary
        name = name_of(key)
        if name is not None and isinstance(present[name], int):
            settings[name] = min(present[name], SIZES["vocab_size"] - 1)
    for key, value in SET_SIZES.items():
        name = name_of(key)
        if name is not None and present[name] is not None:
            settings[name] = value
    if "kv_lora_rank" in settings:  # latent attention: as many key/value heads as heads
        settings.pop(name_of("head_dim") or "head_dim", None)
        settings[name_of("num_key_value_heads") or "num_key_value_heads"] = 4
    experts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if any(settings.get(name_of(key) or "") for key in experts):
        settings[name_of("num_experts_per_tok") or "num_experts_per_tok"] = 2
    layers = SIZES["num_hidden_layers"]
    types_key = name_of("layer_types")
    types = present.get(types_key or "")
    if types_key and isinstance(types, list) and len(types) >= layers:
        kept = types[:layers]  # and one layer of each type the family has, at the end
        missing = [kind for kind in dict.fromkeys(types) if kind not in kept]
        settings[types_key] = kept[: layers - len(missing)] + missing if missing else kept
    for key, value in OVERRIDES.get(model_type, {}).items():
        if value is DROP:
            settings.pop(key, None)
        else:
            settings[key] = value
    with _quiet():
        return config_class(**settings)


def _default_config(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    changes = OVERRIDES.get(model_type, {})
    changes = {key: value for key, value in changes.items() if value is not DROP}
    with _quiet():
        return CONFIG_MAPPING[model_type](**changes)


def census(model_types: Any = None) -> list[Entry]:
    """The census of ``model_types`` (default: the whole causal-LM mapping), in its order."""
    return [entry(model_type) for model_type in (model_types or causal_lm_types())]


def entry(model_type: str) -> Entry:
    """What mha does with ``model_type``'s tiny checkpoint (see the module's docstring)."""
    import mha

    kind = CLASSES.get(model_type)
    if kind is None:
        return Entry(model_type, "unclassified", CANNOT_BUILD, "not in census.CLASSES")
    try:
        try:
            config = tiny_config(model_type)
        except Exception:
            if kind == DECODER:
                raise
            config = _default_config(model_type)  # mha reads its model_type alone
        folder = _config_only(model_type, config)
    except Exception as error:  # the harness's failure, recorded
        return Entry(model_type, kind, CANNOT_BUILD, _reason(error))
    refusals = []
    for index in range(_model_layers(config)):
        try:
            mha.from_pretrained(folder, layer=index)
        except mha.WeightsFileError:
            break  # a layer's config is accepted: the layers are read from weights below
        except mha.AttentionError as error:
            refusals.append(str(error).replace(str(folder), "<checkpoint>"))
            if f"layer {index}" not in refusals[-1]:  # the family or its config: every layer
                return Entry(model_type, kind, REFUSED, refusals[-1])
    else:
        return Entry(model_type, kind, REFUSED, "; ".join(refusals))
    try:
        return _compared(model_type, kind, config)
    except Exception as error:
        return Entry(model_type, kind, CANNOT_BUILD, _reason(error))


def _compared(model_type: str, kind: str, config: Any) -> Entry:
    """Every layer of ``model_type``'s tiny checkpoint read by mha and compared with
    transformers' attention module of that layer."""
    import numpy as np

    import mha
    from mha.integrations import readers
    from mha.integrations.checkpoint import Checkpoint
    from mha.integrations.readers.layouts import attention_prefix, module_path
    from support.configs import relative_error

    folder = checkpoint(model_type, config)
    layers = _model_layers(config)
    refused, read = [], {}
    for index in range(layers):
        try:
            read[index] = mha.from_pretrained(folder, layer=index, dtype=np.float64)
        except mha.WeightsFileError:
            raise  # a layer whose config is read but whose weights are not: a reader's bug
        except mha.AttentionError as error:
            refused.append(f"layer {index}: {error}".replace(str(folder), "<checkpoint>"))
    if not read:
        return Entry(model_type, kind, REFUSED, "; ".join(refused))
    source = Checkpoint(folder)
    # the row's module path (GPT-2's transformer.h.{i}.attn), by the config's model_type
    # (GPT-SW3's is gpt2)
    row = readers.FAMILIES[source.config["model_type"]]
    path = row.tensors.path
    names = {  # a block shared across layers (Zamba's) is kept once: its modules by path
        index: module_path(path, index)
        if row.shared is not None
        else attention_prefix(source, index, path).rstrip(".")
        for index in read
    }
    calls = _oracle(model_type, folder, names)
    worst = 0.0
    for index, attention in read.items():
        (x, expected), *steps = calls[index]
        source = getattr(attention, "shares_kv_with", None)
        chooser = getattr(attention, "shares_choice_with", None)
        if chooser is not None:  # another layer's choice of keys: its calls' (HY-V4's)
            worst = max(worst, _choice_reused(attention, read[chooser], calls, index, chooser))
            continue
        keywords = CALLS.get(model_type, _causal)
        if source is None:
            worst = max(worst, relative_error(attention(x, **keywords(attention, 0)), expected))
            cache = attention.new_cache(B)
        else:  # KV sharing: the cache of layer `source`, filled by its own call first
            owner = read[source]
            cache = mha.KVCache(B, owner.num_kv_heads, owner.head_dim)  # the whole prompt
            owner(calls[source][0][0], cache=cache)
            worst = max(worst, relative_error(attention(x, cache=cache), expected))
            cache = owner.new_cache(B)
        for step, (x, expected) in enumerate(steps, 1):
            if source is not None:
                read[source](calls[source][step][0], cache=cache)
            out = attention(x, cache=cache, **keywords(attention, step))
            worst = max(worst, relative_error(out, expected))
    result = READ if worst <= TOLERANCE else WRONG
    return Entry(model_type, kind, result, "; ".join(refused), worst, tuple(read), layers)


def _causal(attention: Any, step: int) -> dict[str, Any]:
    """A call's keywords beside the cache: the whole sequence (step 0) causal."""
    return {"mask": True} if step == 0 else {}


def _cpmant(attention: Any, step: int) -> dict[str, Any]:
    """CPM-Ant's segments and mask (SegmentBiasAttention.token_inputs) of the token ids
    support.pretrained_models.drive runs, its prompt prepended: the whole sequence's, the
    prefill's, and each step's row over the positions so far."""
    from support.pretrained_models import token_ids

    ids = token_ids(SIZES["vocab_size"], B, L)
    inputs: dict[str, Any] = attention.token_inputs(
        ids[:, : L if step == 0 else PREFILL + step - 1]
    )
    if step > 1:
        inputs["mask"] = inputs["mask"][:, -1:]
    return inputs


CALLS = {"cpmant": _cpmant}
"""The keywords of each call of a family's layers (default :func:`_causal`), by step: the
whole sequence, the prefill, then each decoding step."""


def _choice_reused(attention: Any, chooser: Any, calls: Any, index: int, at: int) -> float:
    """The worst error of layer ``index``, which attends to the keys layer ``at``'s indexer
    chose: each of its calls given as its mask the choice of layer ``at``'s call on that
    layer's own input (the whole sequence, then the prefill and each step)."""
    from support.configs import relative_error

    worst = 0.0
    for step, (x, expected) in enumerate(calls[index]):
        if step < 2:  # the whole sequence, then the prefill: new caches
            choices, cache = chooser.new_cache(B), attention.new_cache(B)
        chooser(calls[at][step][0], cache=choices)
        keywords = {"cache": cache} if step else {}
        out = attention(x, mask=choices.chosen, **keywords)
        worst = max(worst, relative_error(out, expected))
    return worst


def _model_layers(config: Any) -> int:
    """The config's layers by cache slot (Dory's later loops after them), one where it has
    no single count (an encoder-decoder's)."""
    from support.transformers_oracle import cache_slots

    try:
        return cache_slots(config)
    except Exception:
        return 1


def checkpoint(model_type: str, config: Any = None) -> Path:
    """The folder of ``model_type``'s tiny checkpoint (random weights, bfloat16, in shards of
    20 KB, with their index); built on the first call of a session."""
    key = f"{model_type}/model"
    if key not in _SAVED:
        import torch
        import transformers

        config = config if config is not None else tiny_config(model_type)
        model_class = getattr(transformers, causal_lm_types()[model_type])
        config._attn_implementation = _implementation(model_class)
        torch.manual_seed(0)
        with _quiet():
            model = model_class(config).eval()
            _randomized(model)
            folder = _root() / model_type.replace("-", "_") / "model"
            model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=SHARD_SIZE)
        _SAVED[key] = folder
    return _SAVED[key]


def _randomized(model: Any) -> None:
    """Every attention bias nonzero, every attention norm weight and sink (and Doge's ``A``,
    Dory's ``sqk`` and ``s_gate``) away from its initial value: no part of a layer's
    attention is left to its neutral value."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "attn" not in name and "attention" not in name:
                continue
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
            elif "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
            elif name.endswith("sinks"):
                parameter.normal_(0.0, 1.5)
            elif name.endswith(".A"):  # Doge's dynamic mask: zeros (a bias of one) at first
                parameter.normal_(0.0, 1.0)
            elif name.endswith((".sqk", ".s_gate")):  # Dory's nGPT scales: constants at first
                parameter.mul_(1.0 + 0.3 * torch.randn_like(parameter))


def _implementation(model_class: Any) -> str:
    """SDPA where the family has it (transformers' eager attention takes its softmax in
    float32; it runs under float64_torch here)."""
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def _oracle(model_type: str, folder: Path, names: dict[int, str]) -> dict[int, list[Any]]:
    """The calls of each attention module named in ``names`` (by layer), ``(input, output)``
    as NumPy, in transformers' float64 model of ``folder``: the whole sequence, then the
    prefill and each decoding step with its DynamicCache."""
    import torch
    import transformers

    from support.pretrained_models import drive, float64_parameters
    from support.transformers_oracle import recorder

    model_class = getattr(transformers, causal_lm_types()[model_type])
    with _quiet():
        model = model_class.from_pretrained(
            folder,
            dtype=torch.float64,
            attn_implementation=_implementation(model_class),
            experts_implementation="eager",
        ).eval()
    float64_parameters(model)
    _float64_rotaries(model)
    calls: dict[int, list[Any]] = {index: [] for index in names}
    modules = {index: _module(model, name, index) for index, name in names.items()}
    handles = [
        module.register_forward_hook(recorder(module, calls[index], index), with_kwargs=True)
        for index, module in modules.items()
    ]
    try:
        drive(model, B, L, PREFILL, list(calls.values()))
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _module(model: Any, name: str, index: int) -> Any:
    """The attention module of layer ``index``: at its tensors' prefix ``name``, else where
    transformers loads a family's own names renamed: under ``model`` (Nemotron-H's
    ``backbone``), else Llama's (EXAONE 3's)."""
    from mha.integrations.readers.layouts import SEPARATE_QKV

    for path in (name, "model." + name.split(".", 1)[1]):
        try:
            return model.get_submodule(path)
        except AttributeError:
            pass
    if name.endswith(".attn"):  # HRM's saved attn, which transformers loads as self_attn
        with contextlib.suppress(AttributeError):
            return model.get_submodule(name.removesuffix("attn") + "self_attn")
    return model.get_submodule(SEPARATE_QKV.path.format(i=index))


def _float64_rotaries(model: Any) -> None:
    """The model's rotary modules in float64 (support.rope_oracle), the complex ones
    (DeepSeek V2's ``polar``) by the same frequencies; none for a family without rope."""
    import torch

    from support.rope_oracle import float64_rotary, float64_torch, init_function

    for rotary in [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]:
        if "torch.polar" not in inspect.getsource(type(rotary).forward):
            float64_rotary(rotary)
            continue
        with float64_torch():
            inv_freq, scaling = init_function(rotary, rotary.rope_type)(rotary.config)

        def forward(x: Any, position_ids: Any, inv_freq: Any = inv_freq, s: Any = scaling) -> Any:
            freqs = position_ids[..., None].double() * inv_freq
            return torch.polar(torch.ones_like(freqs), freqs) * s

        rotary.forward = forward


def _config_only(model_type: str, config: Any) -> Path:
    """A folder of ``config``'s ``config.json`` and an empty ``model.safetensors``: what mha
    refuses by the family or its config is refused there, before any weight is read."""
    folder = _root() / model_type.replace("-", "_") / "config"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        with _quiet():
            config.save_pretrained(folder)
        header = json.dumps({}).encode()
        (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return folder


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


_SAVED: dict[str, Path] = {}
_ROOT: list[Path] = []


def _root() -> Path:
    if not _ROOT:
        root = Path(tempfile.mkdtemp(prefix="mha-census-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _ROOT.append(root)
    return _ROOT[0]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers without its progress bars and its advice on the tiny configs."""
    import warnings

    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()


def table(entries: list[Entry]) -> str:
    """The census as a markdown table: family, class, result, what blocks it."""
    counts: dict[str, int] = {}
    for item in entries:
        label = {READ: "read", REFUSED: "refused by feature", WRONG: "wrong"}.get(
            item.result, item.result
        )
        label = "refused as not supported" if item.generic else label
        counts[label] = counts.get(label, 0) + 1
    lines = [
        "| `model_type` | class | result | what blocks it |",
        "|---|---|---|---|",
    ]
    for item in entries:
        result = item.result
        if item.result in (READ, WRONG):
            result = f"{item.result} ({item.error:.1e})"
            if len(item.layers) < item.count:  # a hybrid: its attention layers alone
                shown = ", ".join(map(str, item.layers))
                result = (
                    f"{item.result} ({item.error:.1e}; attention layers {shown} of {item.count})"
                )
        detail = _blocker(item).replace("|", "\\|")
        lines.append(f"| `{item.family}` | {item.kind} | {result} | {detail} |")
    summary = ", ".join(f"{count} {label}" for label, count in sorted(counts.items()))
    decoders = [item for item in entries if item.kind == DECODER]
    read = sum(item.result == READ for item in decoders)
    return (
        f"{len(entries)} model types: {summary}. Of the {len(decoders)} decoder-only families, "
        f"{read} read.\n\n" + "\n".join(lines) + "\n"
    )


def _blocker(item: Entry) -> str:
    """The reason of a refusal, without the checkpoint and the list of families read; a
    hybrid's other layers, each with what it is."""
    if item.result in (READ, WRONG) and item.detail:
        other = [part.split(" checkpoint is ")[1].split(", which")[0] for part in
                 item.detail.split("; layer ") if " checkpoint is " in part]  # fmt: skip
        refused = [i for i in range(item.count) if i not in item.layers]
        what = ", ".join(dict.fromkeys(other))
        return f"layers {', '.join(map(str, refused))} refused by index: {what}"
    detail = item.detail.split("; the model types mha reads are")[0]
    prefix = f"<checkpoint>: model_type {item.family!r}: "
    return detail.removeprefix(prefix)
