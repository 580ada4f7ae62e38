"""``MultiHeadAttention.from_pretrained`` and ``LatentAttention.from_pretrained`` against the
layers of transformers' own models, loaded in float64 from the same checkpoints: tiny random
bfloat16 checkpoints of every family, in many shards (support.pretrained_models).

Each layer's attention is compared on whole sequences of 24 positions (past the rope's
``original_max_position_embeddings`` of 16 and past every sliding window), and in prefill
then token-by-token decoding with transformers' DynamicCache, every step against
``attention(x, cache=ours)``. transformers computes some things in float32 even in a float64
model, which would hide every error below 1e-7: its rotary embeddings
(support.rope_oracle.float64_rotary runs its own code in float64), and its RMSNorms (QK-norm,
DeepSeek's latent norms) and Gemma 2's eager softmax, which ask for float32: the whole
forward runs under support.rope_oracle.float64_torch, where a request for float32 gets
float64. Everything else is transformers' code as it is. GPT-J's and CodeGen's sine table is
recomputed in float64 by their own function; BLOOM's attention returns its output plus the
residual, which the recorder subtracts; GPT-1 has no cache, so its decoding steps are
compared against the last token of each prefix. The older configs (the families' own keys,
or none where the class fills them in) are compared the same way, from variants of the
saved checkpoints.

DeepSeek V2, whose rotary embedding is complex (``torch.polar``), has its own float64 oracle
in test_pretrained_deepseek_v2.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.api.block_sparse import BlockIndexerSpec
from mha.api.qsa import QSAIndexerSpec
from mha.api.sparse import IndexerSpec
from mha.errors import AttentionValueError
from mha.integrations import readers
from mha.integrations.readers import defaults
from mha.integrations.readers.family import Family
from mha.integrations.readers.layouts import NO_BIASES
from mha.integrations.readers.windows import EVERY_LAYER

# DeepSeek V2's and CPM-Ant's (its calls' segments and mask of the token ids) in their files
FAMILIES = [family for family in models.FAMILIES if family not in ("deepseek_v2", "cpmant")]
B, L, PREFILL = 2, 24, 10
TOLERANCE = 1e-12


@functools.cache
def oracle(family):
    """Each layer's attention calls in transformers, ``(input, output)`` as NumPy: first the
    whole sequence, then the prefill and each decoding step."""
    from support.rope_oracle import float64_rotary, rotary_modules

    model = models.transformers_model(family)
    if rotary_modules(model):
        float64_rotary(model)
    return models.decoding_calls(model, B, L, PREFILL)


def load(family, layer):
    if family in models.BLOCK_SPARSE:  # a BlockSparseAttention or not, by the layer's type
        return mha.from_pretrained(models.saved(family), layer=layer, dtype=np.float64)
    kind = mha.LatentAttention if family in models.LATENT_FAMILIES else mha.MultiHeadAttention
    kind = mha.DifferentialAttention if family == "diffllama" else kind
    kind = mha.DynamicMaskAttention if family == "doge" else kind
    return kind.from_pretrained(models.saved(family), layer=layer, dtype=np.float64)


def whole(family, layer):
    """Layer ``layer``'s output on its whole sequence. A layer that attends with another's
    keys and values (Gemma 3n's and Gemma 4's KV sharing) reads that layer's cache, filled by
    that layer's call on its own input (a cache without a window: the whole prompt). A layer
    that reuses another's choice of keys (HY-V4's "shared" layers) attends with the choice
    of that layer's call on its own input."""
    attention, (x, _) = load(family, layer), oracle(family)[layer][0]
    source = getattr(attention, "shares_kv_with", None)
    chooser = getattr(attention, "shares_choice_with", None)
    if chooser is not None:
        cache = load(family, chooser).new_cache(B)
        load(family, chooser)(oracle(family)[chooser][0][0], cache=cache)
        return attention(x, mask=cache.chosen)
    if source is None:
        return attention(x, mask=True)
    owner = load(family, source)
    cache = mha.KVCache(B, owner.num_kv_heads, owner.head_dim)
    owner(oracle(family)[source][0][0], cache=cache)
    return attention(x, cache=cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_sequences_match_transformers(family, transformers, record_error):
    for layer, calls in oracle(family).items():
        x, expected = calls[0]
        width = 96 if family in models.JOINED else 48  # Zamba's: joined to the embeddings
        assert x.shape == (B, L, width) and np.abs(expected).max() > 0.1
        error = relative_error(whole(family, layer), expected)
        assert record_error(f"pretrained {family}, float64", error) <= TOLERANCE, layer


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decoding_matches_transformers_cache(family, transformers, record_error):
    for layer, calls in oracle(family).items():
        attention = load(family, layer)
        source = getattr(attention, "shares_kv_with", None)  # KV sharing: that layer's cache
        owner = None if source is None else load(family, source)
        ours = (owner or attention).new_cache(B)
        chooser = getattr(attention, "shares_choice_with", None)  # another layer's choice
        chosen_by = None if chooser is None else load(family, chooser)
        choices = None if chosen_by is None else chosen_by.new_cache(B)
        assert len(calls) == 2 + L - PREFILL
        for step, (x, expected) in enumerate(calls[1:], 1):
            if owner is not None:  # the owner's step first, as transformers runs the layers
                owner(oracle(family)[source][step][0], cache=ours)
            chosen = {}
            if chosen_by is not None:  # the chooser's step first, its choice the mask
                chosen_by(oracle(family)[chooser][step][0], cache=choices)
                chosen = {"mask": choices.chosen}
            error = relative_error(attention(x, cache=ours, **chosen), expected)
            assert record_error(f"pretrained {family} cached decoding, float64", error) <= (
                TOLERANCE
            ), layer
        assert ours.lengths.tolist() == [L] * B


RMS_NORM = {"qk_layernorm": False, "q_norm_bias": None, "k_norm_bias": None}
"""A LayerNorm QK-norm read as an RMSNorm (its biases dropped)."""

DENSE = {"indexer": None, **dict.fromkeys(mha.api.sparse.INDEXER_WEIGHTS)}
"""A sparse top-k attention read as dense (its indexer and the indexer's weights dropped)."""

CHANGES = {
    "llama": [{"rope_scaling": None}],
    "qwen2": [{"window": None}, {"b_q": None}],
    "qwen3": [{"window": None}, {"qk_norm_offset": 1.0}],
    "mistral": [{"window": None}],
    "gemma2": [{"window": None}, {"softcap": None}, {"scale": None}],
    "gemma3": [{"rope_theta": 10000.0}, {"window": None}, {"qk_norm_offset": 0.0},
               {"scale": None}],
    "olmo2": [{"qk_norm_offset": 1.0}],
    # the partial rotary without longrope (whose factors are for 8 features, not 12)
    "phi3": [{"rope_scaling": None}, {"rope_scaling": None, "rotary_dim": None},
             {"window": None}],
    "gpt_oss": [{"rope_scaling": None}, {"window": None}, {"sinks": None}],
    "deepseek_v3": [{"scale": None}, {"rope_scaling": None}, {"rotary_interleaved": False}],
    "deepseek_v3_mha": [{"scale": None}, {"rotary_interleaved": True}, {"b_kv_a": None}],
    "ministral": [{"window": None}, {"window": 5}],  # its full layer, given a window, differs
    "mixtral": [{"window": None}, {"rope_theta": 10000.0}],  # its base: the class's 1e6
    "arcee": [{"rope_scaling": None}, {"b_o": None}],
    "qwen3_moe": [{"window": None}, {"qk_norm_offset": 1.0}],  # every layer slides
    "qwen2_moe": [{"window": None}, {"b_q": None}],  # qkv_bias
    "olmoe": [{"qk_norm_offset": 1.0}, {"b_o": None}, {"clip_qkv": None}],
    "flex_olmo": [{"qk_norm_offset": 1.0}],
    "phimoe": [{"window": None}, {"b_o": None}],
    "vaultgemma": [{"window": None}, {"softcap": None}, {"scale": None}],
    "gemma": [{"b_q": None}],
    "olmo": [{"b_o": None}, {"clip_qkv": None}],
    "olmo3": [{"rope_theta": 10000.0}, {"window": None}, {"qk_norm_offset": 1.0}],
    "internlm3": [{"b_o": None}],
    "seed_oss": [{"b_o": None}],  # attention_out_bias, without attention_bias
    "dots1": [{"window": None}, {"qk_norm_offset": 1.0}],
    "apertus": [{"rope_scaling": None}, {"qk_norm_offset": 1.0}],
    "glm4_moe_lite": [{"scale": None}, {"rope_scaling": None}, {"rotary_interleaved": False}],
    "youtu": [{"scale": None}, {"rotary_interleaved": True}, {"b_kv_a": None}],
    "granite": [{"scale": None}],  # attention_multiplier
    "granitemoe": [{"scale": None}],
    "granitemoeshared": [{"scale": None}],
    "helium": [{"b_q": None}, {"rotary_interleaved": False}],  # no output bias
    "starcoder2": [{"window": None}, {"b_o": None}],  # use_bias
    "solar_open": [{"b_q": None}],  # no output bias
    "hyperclovax": [{"scale": None}],  # attention_multiplier
    "iquestcoder": [{"b_o": None}],
    "jais2": [{"b_o": None}],
    "ministral3": [{"window": None}, {"rope_scaling": None}],
    "aria_text": [{"b_o": None}],
    # EXAONE 3: the config's base, not the class's 500000
    "exaone": [{"b_o": None}, {"rope_theta": 10000.0}],
    "apertus1p5_text": [{"rope_scaling": None}, {"qk_norm_offset": 1.0}],
    "hy_v3": [{"qk_norm_offset": 1.0}, {"b_q": None}],
    "ernie4_5": [{"rotary_interleaved": False}, {"b_o": None}],  # use_bias
    "ernie4_5_moe": [{"rotary_interleaved": False}, {"b_o": None}],
    "cwm": [{"window": None}, {"rope_scaling": None}],
    "mellum": [{"rope_theta": 10000.0}, {"window": None}, {"qk_norm_offset": 1.0}],
    "exaone_moe": [{"rope_theta": 500.0}, {"qk_norm_offset": 1.0}, {"window": None}],
    "kolibri1": [{"rope_theta": 500.0}, {"qk_norm_offset": 1.0}, {"window": None}],
    "flint": [{"sinks": None}, {"rope_theta": 500.0}, {"window": None}, {"qk_norm_offset": 1.0}],
    # layer_rope_theta: layer 1 without rope, layer 2 of base 900
    "granite_swa": [{"sinks": None}, {"window": None}, {"scale": None}, {"rope_theta": 500.0}],
    "granitemoe_swa": [{"sinks": None}, {"window": None}, {"scale": None}],
    "sarvam_moe": [{"rotary_dim": 6}, {"qk_norm_offset": 1.0}, {"b_q": None}],
    "sarvam_mla": [{"scale": None}, {"rope_scaling": None}, {"rotary_interleaved": False}],
    "axk1": [{"scale": None}, {"rotary_interleaved": False}, {"b_kv_a": None}],
    "minicpm3": [{"scale": None}, {"rope_scaling": None}, {"rotary_interleaved": True}],
    # the sliding layers given a rope, the full one another base
    "cohere_compass_text": [{"rope_theta": 500.0}, {"rope_theta": 10000.0}, {"window": None}],
    # the scales read into the norms' weights (scale: its yarn mscale)
    "longcat_flash": [{"scale": None}, {"rotary_interleaved": False}, {"b_kv_a": None}],
    "nanochat": [{"qk_norm": None, "qk_norm_eps": None, "qk_norm_offset": None, "q_norm": None,
                  "k_norm": None}, {"b_k": None}],
    # a layer without positions given the others' rope (the layers with rope keep theirs)
    "smollm3": [{"rope_theta": 500.0}, {"window": None}],
    "cohere2": [{"rope_theta": 500.0}, {"rotary_interleaved": False}, {"window": None}],
    "cohere2_moe": [{"rope_theta": 500.0}, {"rotary_interleaved": False}, {"window": None}],
    "exaone4": [{"rope_theta": 500.0}, {"qk_norm_offset": 1.0}, {"window": None}],
    # the whole head rotated, the halves paired instead of (2i, 2i + 1) or the reverse
    "glm": [{"rotary_dim": None}, {"rotary_interleaved": False}, {"b_q": None}],
    "glm4": [{"rotary_dim": None}, {"rotary_interleaved": False}],
    "glm4_moe": [{"rotary_dim": None}, {"rotary_interleaved": True}, {"qk_norm_offset": 1.0}],
    "minimax_m2": [{"rotary_dim": None}, {"qk_norm_offset": 1.0}],
    "stablelm": [{"rotary_dim": None}, {"b_v": None}, {"qk_layernorm": False},
                 {"qk_norm_eps": 1e-6}],
    "phi": [{"rotary_dim": None}, {"b_o": None}, {**RMS_NORM}, {"q_norm_bias": None,
            "k_norm_bias": None}],
    "afmoe": [{"window": None}, {"W_g": None, "output_gate": None}, {"qk_norm_offset": 1.0},
              {"rope_theta": None, "rotary_dim": None}],
    "laguna": [{"window": None}, {"output_gate": "sigmoid"}, {"rotary_dim": None},
               {"rope_theta": 10000.0}],
    "laguna_per_element": [{"output_gate": "sigmoid"}, {"qk_norm_offset": 1.0}],
    "hunyuan_v1_dense": [{"qk_norm_after_rope": False}, {"b_o": None}],
    "hunyuan_v1_moe": [{"qk_norm_after_rope": False}, {"qk_norm_eps": 1e-2}],
    "persimmon": [{"rotary_dim": None}, {**RMS_NORM}, {"qk_norm_eps": 1e-6}],
    "nemotron": [{"rotary_dim": None}, {"b_o": None}],
    "cohere": [{"rotary_interleaved": False}, {"b_o": None}, {"qk_layernorm": False}],
    "gpt2": [{"scale": None}],  # scale_attn_by_inverse_layer_idx: 1/sqrt(d) / (i + 1)
    "gpt_bigcode": [{"b_q": None}],
    "gpt_bigcode_mha": [{"b_v": None}],
    "gpt_neox": [{"rotary_dim": None}, {"rope_theta": 10000.0}, {"b_q": None}],
    "gpt_neox_japanese": [{"b_o": None}, {"rotary_dim": None}],  # the last layer's b_o
    "gptj": [{"rotary_interleaved": False}, {"rotary_dim": None}],
    "codegen": [{"rotary_interleaved": False}, {"rotary_dim": None}],
    "gpt_neo": [{"scale": None}, {"window": None}],
    "bloom": [{"alibi": None}, {"b_o": None}],
    "mpt": [{"alibi": None}, {"scale": None}, {"clip_qkv": None}],
    "dbrx": [{"clip_qkv": None}, {"rope_theta": 10000.0}],
    "falcon": [{"rope_theta": 10000.0}, {"b_q": None}],
    # Falcon's slopes are divided by sqrt(head_dim), as its scores are
    "falcon_alibi": [{"alibi": None}, {"alibi": mha.alibi_slopes(6)}],
    # OPT, BioGPT and XGLM scale their queries, biases included, in q_proj
    "opt": [{"scale": 1.0}, {"b_q": None}],
    "biogpt": [{"scale": 1.0}, {"b_q": None}],
    "xglm": [{"scale": 1.0}, {"b_q": None}],
    "ctrl": [{"scale": 1.0}, {"b_q": None}],
    "openai-gpt": [{"scale": 1.0}, {"b_o": None}],
    "modernbert-decoder": [{"window": None}, {"rope_theta": 10000.0}, {"b_o": None}],
    # hybrids: the attention layers' own settings (a rope given to Jamba's and Nemotron-H's
    # layers without positions)
    "granitemoehybrid": [{"scale": None}, {"rope_theta": None}, {"b_q": None}],
    "falcon_h1": [{"scale": None}, {"b_k": None}],  # key_multiplier
    "jamba": [{"rope_theta": 500.0}],
    "nemotron_h": [{"rope_theta": 500.0}],
    "bamba": [{"rotary_dim": None}, {"b_o": None}],
    "lfm2": [{"qk_norm_offset": 1.0}, {"rope_theta": 10000.0}],
    "lfm2_moe": [{"qk_norm_offset": 1.0}, {"rope_theta": 10000.0}],
    "minimax": [{"window": None}, {"rope_theta": 10000.0}],
    "olmo_hybrid": [{"rope_theta": 500.0}, {"qk_norm_offset": 1.0}],
    "lara_mini": [{"rope_theta": 500.0}, {"window": None}, {"qk_norm_offset": 1.0}],
    "recurrent_gemma": [{"window": None}, {"rotary_dim": None}, {"b_o": None}],
    # position-dependent query temperatures (layer 1 of Llama 4; every layer of Ministral 3)
    "llama4_text": [{"query_temperature": None}, {"chunk": None}, {"qk_norm": None,
                    "qk_norm_eps": None, "qk_norm_offset": None, "qk_norm_after_rope": False,
                    "q_norm": None, "k_norm": None}, {"rotary_interleaved": False}],
    "ministral3_scaled": [{"query_temperature": None}, {"window": None}],
    "mistral4": [{"query_temperature": None}, {"scale": None}, {"rotary_interleaved": False}],
    "beam": [{"query_temperature": None}, {"window": None}, {"qk_norm_offset": 1.0},
             {"b_g": None}],  # Beam's power law, from 1.0 at position 0 to 1.0012 at 23
    # sparse top-k attention: dense instead, another top-k, the indexer's other rope pairs
    "deepseek_v32": [DENSE, {"indexer": IndexerSpec(5, 3, 12)},
                     {"indexer": IndexerSpec(4, 3, 12, rotary_interleaved=True)},
                     {"b_index_k_norm": None}],
    "glm_moe_dsa": [DENSE, {"indexer": IndexerSpec(4, 2, 10, rotary_interleaved=True)},
                    {"indexer": IndexerSpec(5, 2, 10, rotary_interleaved=False)},
                    {"b_index_k_norm": None}],
    "qwen3_next": [{"W_g": None, "b_g": None, "output_gate": None}, {"b_g": None},
                   {"qk_norm_offset": 0.0}, {"rotary_dim": None}],
    "qwen3_5_text": [{"W_g": None, "output_gate": None}, {"qk_norm_offset": 0.0},
                     {"rotary_dim": None}],
    "qwen3_5_moe_text": [{"W_g": None, "output_gate": None}, {"qk_norm_offset": 0.0},
                         {"rotary_dim": None}],
    "lfm3": [{"W_g": None, "output_gate": None, "output_gate_per_head": False}, {"window": None},
             {"rope_scaling": None}, {"rope_theta": 10000.0}],
    "bailing_hybrid": [{"W_g": None, "output_gate": None}, {"scale": None},
                       {"rope_scaling": None}, {"b_o": None}],
    "mimo_v2_flash": [{"sinks": None}, {"window": None}, {"rotary_dim": None},
                      {"rope_theta": 10000.0}, {"b_v": None}],
    "diffllama": [{"lambda_init": 0.1}, {"differential_eps": 1e-6}, {"rope_theta": 10000.0},
                  {"b_o": None}],
    # the values' norm; layer 2 attending with its own keys and values (layer 0's weights)
    "gemma3n": [{"v_norm": None}, {"shares_kv_with": None}, {"scale": None}, {"window": None},
                {"qk_norm_offset": 1.0}],
    "gemma4": [{"v_norm": None}, {"shares_kv_with": None}, {"rope_scaling": None},
               {"scale": None}, {"window": None}],
    "gemma4_unified": [{"v_norm": None}, {"rope_scaling": None}, {"window": None}],
    "bitnet": [{"output_norm": None, "output_norm_eps": None, "o_norm": None},
               {"output_norm_eps": 1e-6}, {"output_norm": "l2", "o_norm": None},
               {"rope_theta": 10000.0}],
    # the gate per feature, the sinks, the indexer's last features rotated (its first
    # instead), its LayerNorm's rms_norm_eps (LayerNorm's 1e-6 instead), layer 1 without
    # layer 0's choice (dense)
    "hy_v4": [{"W_g": None, "output_gate": None}, {"sinks": None},
              {"indexer": IndexerSpec(4, 3, 12, norm_eps=2.0)},
              {"indexer": IndexerSpec(4, 3, 12, rotate_last=True)},
              {"shares_choice_with": None}],
    "kimi_linear": [{"rotate": True}],
    "zamba": [{"scale": None}],
    "zamba2": [{"rope_theta": None}, {"scale": None}],
    # A.X-K2: its gate a softplus, not a sigmoid; dense; the softmax scale without yarn's
    "axk2": [{"output_gate": "softplus"}, DENSE, {"scale": None}],
    # dots3: no gate; no window (layer 2); dense (layers 0, 1); the rotary key unnormalised;
    # each layer type's base replaced
    "dots3_note_text": [{"W_g": None, "output_gate": None}, {"window": None}, DENSE,
                        {"rope_key_norm": False, "k_pe_norm": None}, {"rope_theta": 10000.0}],
    # every block kept (dense), one local block, 2 blocks of 6 keys, QK-norm of weight alone
    "minimax_m3_vl_text": [{"block_indexer": BlockIndexerSpec(4, 6, 2, 2, 10)},
                           {"block_indexer": BlockIndexerSpec(4, 3, 1, 2, 10)},
                           {"block_indexer": BlockIndexerSpec(6, 2, 1, 2, 10)},
                           {"qk_norm_offset": 0.0}],
    # every block kept (dense), 3 blocks of 2 keys, a budget of one block; the gate
    "qwen4_exp_text": [{"block_indexer": QSAIndexerSpec(24, 3, 2, 12)},
                       {"block_indexer": QSAIndexerSpec(6, 2, 2, 12)},
                       {"block_indexer": QSAIndexerSpec(3, 3, 2, 12)},
                       {"output_gate": None, "W_g": None}, {"qk_norm_offset": 0.0}],
    # the gate of every feature in each cache slot of HRM's recurrent stacks
    "hrm_text": [{"W_g": None, "output_gate": None}, {"rope_theta": 10000.0}],
    # every key kept, or more of them (the bias itself: test_dynamic_mask.py)
    "doge": [{"keep_window_size": None}, {"keep_window_size": 12}, {"qk_norm_offset": 1.0}],
    # Dory: no gate; no L2 norm of the joined heads; no query factors; no unit queries and
    # keys; no window; the sliding layers' base on the full layer
    "dory": [{"W_g": None, "output_gate": None}, {"output_norm": None, "output_norm_eps": None},
             {"q_scale": None},
             {"qk_norm": None, "qk_norm_eps": None, "qk_norm_offset": None, "q_norm": None,
              "k_norm": None},
             {"window": None}, {"rope_theta": 500.0}],
}  # fmt: skip
"""Settings changed (or weights, given as None, removed) that each family's tiny model
exercises: with the change, a layer differs from transformers'. The second change of Phi-3
differs from the first only by its full rotary."""


@pytest.mark.parametrize("family", FAMILIES)
def test_every_setting_read_matters_in_these_models(family, monkeypatch, transformers):
    """Each setting read above, changed, or each weight, dropped, is caught by the
    comparison: the tiny models are not degenerate for what they are meant to check."""
    read = readers.layer_attention
    baseline = None
    for change in CHANGES[family]:
        monkeypatch.setattr(readers, "layer_attention", models.changed(read, change))
        expected = [calls[0][1] for calls in oracle(family).values()]
        outputs = [whole(family, layer) for layer in oracle(family)]
        errors = [relative_error(out, e) for out, e in zip(outputs, expected, strict=True)]
        assert max(errors) > 1e-4, (change, errors)
        if family == "phi3" and "rotary_dim" in change:  # against the change before it
            assert max(relative_error(a, b) for a, b in zip(outputs, baseline, strict=True)) > 1e-4
        baseline = outputs


@pytest.mark.parametrize(
    ("family", "field", "change"),
    [
        ("nanochat", "rope", {"negated": False}),
        ("longcat_flash", "tensors", {"lora_scaled": False}),
        ("mimo_v2_flash", "value_width", {"scale": None}),
        ("dots3_note_text", "tensors", {"lora_scaled": False}),
    ],
)
def test_what_is_read_into_the_weights_matters(family, field, change, monkeypatch, transformers):
    """What a row reads into the weights rather than the settings, left out, is caught by the
    comparison: NanoChat's rotation by the negated angles (each head's halves swapped),
    LongCat-Flash's scales of its query and latent (in the norms' weights)."""
    row = readers.FAMILIES[family]
    changed = dataclasses.replace(
        row, **{field: dataclasses.replace(getattr(row, field), **change)}
    )
    monkeypatch.setitem(readers.FAMILIES, family, changed)
    for layer, calls in oracle(family).items():
        x, expected = calls[0]
        assert relative_error(load(family, layer)(x, mask=True), expected) > 1e-4, layer


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layers_without_attention_are_refused_by_their_index(family, transformers):
    """The layers read above are transformers' attention layers (``mha.attention_layers``):
    every layer, but a hybrid's other layers (Mamba, short convolutions), each refused by
    its index, naming what it is and the attention layers."""
    folder = models.saved(family)
    layers = sorted(oracle(family))
    count = models.transformers_model(family).config.num_hidden_layers
    assert mha.attention_layers(folder) == layers
    assert (len(layers) < count) == (family in models.HYBRIDS and family != "falcon_h1")
    for layer in sorted(set(range(count)) - set(layers)):
        said = f"layer {layer} of this .* checkpoint is .*; its attention layers are 0, 2"
        with pytest.raises(AttentionValueError, match=said) as error:
            mha.from_pretrained(folder, layer=layer)
        assert str(folder) in str(error.value)


def test_every_row_of_the_table_has_a_tiny_model_compared_here(transformers):
    """A family cannot join the table without its layers compared with transformers' above."""
    compared = {
        getattr(transformers, f"{name}Config").model_type for name, _ in models.MODELS.values()
    }
    assert set(readers.FAMILIES) <= compared, set(readers.FAMILIES) - compared
    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    assert set(readers.FAMILIES) - set(causal) <= {"mistral4"}  # outside it in 5.24


def test_a_renamed_family_is_one_row(tmp_path, monkeypatch, transformers, record_error):
    """A family whose attention is Mistral's under another ``model_type`` and other names of
    its config keys is read once its row is in the table, and then computes what
    transformers' Mistral layers compute."""
    names = {"num_attention_heads": "n_head", "sliding_window": "window"}
    folder = shutil.copytree(models.saved("mistral"), tmp_path / "renamed")
    config = json.loads((folder / "config.json").read_text())
    config = {names.get(key, key): value for key, value in config.items()}
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral_renamed"}))
    with pytest.raises(AttentionValueError, match="model_type 'mistral_renamed': it is not"):
        mha.MultiHeadAttention.from_pretrained(folder, layer=0)
    row = Family(
        "mistral_renamed",
        {names.get(key, key): value for key, value in defaults.MISTRAL.items()},
        keys=names,
        biases=NO_BIASES,
        windows=EVERY_LAYER,
    )
    monkeypatch.setitem(readers.FAMILIES, row.name, row)
    for layer, calls in oracle("mistral").items():
        x, expected = calls[0]
        attention = mha.MultiHeadAttention.from_pretrained(folder, layer=layer, dtype=np.float64)
        assert (attention.num_heads, attention.window) == (4, 7)
        error = relative_error(attention(x, mask=True), expected)
        assert record_error("pretrained mistral_renamed, float64", error) <= TOLERANCE, layer
    (folder / "config.json").write_text(json.dumps({**config, "model_type": row.name, "n_head": 0}))
    with pytest.raises(AttentionValueError, match=r"config\.json has n_head=0"):
        mha.MultiHeadAttention.from_pretrained(folder, layer=0)


OLDER_CONFIGS = [
    ("gpt_neox", {"rotary_pct": 1 / 3, "rotary_emb_base": 800.0}, ("rope_parameters",)),
    ("gpt2", {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": False}, ()),
    # GPT-Neo's attention_layers, else its config class's expansion of attention_types
    ("gpt_neo", {"attention_types": [[["local", "global", "local"], 1]]},
     ("attention_layers",)),
    ("gpt_neo", {"attention_types": [[["local", "global", "local"], 1]],
                 "attention_layers": ["global", "local", "global"]}, ()),
    ("mpt", {}, ("attn_config",)),  # its defaults: ALiBi, 1/sqrt(head_dim)
    ("mpt", {"attn_config": {"softmax_scale": 0.2, "clip_qkv": 0.0}}, ()),  # 0: no clamp
    ("exaone", {"num_layers": 3, "rope_theta": 900.0}, ("num_hidden_layers", "rope_parameters")),
    ("cwm", {}, ("layer_types", "rope_parameters")),  # llama3 rope of base 1e6, factor 16
    ("falcon", {"rope_theta": 900.0, "multi_query": True}, ("rope_parameters",)),
    ("modernbert-decoder", {"global_attn_every_n_layers": 2, "global_rope_theta": 900.0,
                            "local_rope_theta": 50.0}, ("layer_types", "rope_parameters")),
]  # fmt: skip


@pytest.mark.parametrize(("family", "change", "drop"), OLDER_CONFIGS)
def test_older_configs_are_read_as_transformers_reads_them(
    tmp_path, family, change, drop, transformers
):
    """Older config.json files (the families' old keys, or none where the class fills them
    in), each loaded by transformers and compared layer by layer: the variant computes
    something else than the tiny model's own config, and what transformers computes."""
    from support.rope_oracle import float64_rotary, rotary_modules

    folder = shutil.copytree(models.saved(family), tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    config = {key: value for key, value in config.items() if key not in drop} | change
    (folder / "config.json").write_text(json.dumps(config))
    model = models.transformers_model(family, folder)
    if rotary_modules(model):
        float64_rotary(model)
    calls = models.decoding_calls(model, B, L, L - 1)
    differs = 0.0
    for layer, layer_calls in calls.items():
        x, expected = layer_calls[0]
        attention = mha.MultiHeadAttention.from_pretrained(folder, layer=layer, dtype=np.float64)
        out = attention(x, mask=True)
        assert relative_error(out, expected) <= TOLERANCE, layer
        differs = max(differs, relative_error(out, load(family, layer)(x, mask=True)))
    assert differs > 1e-4


@pytest.mark.parametrize(
    ("family", "change", "refusal"),
    [
        ("glm", {"sliding_window": 4}, "glm with sliding_window=4"),
        (
            "nanochat",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}},
            "rope_type 'yarn', whose attention factor scales",
        ),
        (
            "cohere_compass_text",
            {"rope_parameters": {}},
            "no rope_parameters entry for its sliding_attention layers",
        ),
        ("olmo", {"clip_qkv": -1.0}, r"clip_qkv=-1.0 \(the projections clamped to a bound"),
        (
            "dbrx",
            {"attn_config": {"kv_n_heads": 2, "clip_qkv": 1.5, "rope_theta": 9e5}},
            r"attn_config\.rope_theta=900000\.0 \(a rotary base transformers' DBRX ignores: it "
            r"rotates by rope_parameters' rope_theta=500\.0\)",
        ),
        ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers must list 1 .rope. or 0"),
        (
            "exaone4",
            {"layer_types": None, "sliding_window_pattern": "LLLG"},
            "no layer_types and sliding_window_pattern='LLLG'",
        ),
    ],
)
def test_what_a_family_computes_beyond_mha_is_refused_by_name(
    tmp_path, family, change, refusal, transformers
):
    """A family's option that mha does not compute (a LayerNorm of the queries and keys, a
    window its mask ignores) or a malformed one is refused, naming the checkpoint and the
    key."""
    folder = shutil.copytree(models.saved(family), tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AttentionValueError, match=refusal) as error:
        mha.MultiHeadAttention.from_pretrained(folder, layer=0)
    assert str(folder) in str(error.value)


def test_the_rotated_width_may_come_from_rotary_dim_alone(tmp_path, transformers):
    """MiniMax-M2's released configs give the rotated width as ``rotary_dim``, without a
    ``partial_rotary_factor``: read as the same fraction of the head."""
    folder = shutil.copytree(models.saved("minimax_m2"), tmp_path / "minimax_m2")
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["rotary_dim"] == 8 and config["rope_parameters"]["partial_rotary_factor"] == 8 / 12
    )
    del config["rope_parameters"]["partial_rotary_factor"]
    (folder / "config.json").write_text(json.dumps(config))
    for rotary_dim in (8, None):
        if rotary_dim is None:
            del config["rotary_dim"]
            (folder / "config.json").write_text(json.dumps(config))
        attention = mha.MultiHeadAttention.from_pretrained(folder, layer=0)
        assert attention.rotary_dim == rotary_dim
