"""mha.models' whole decoders of every family ``from_pretrained`` reads, enumerated from
transformers' causal-LM mapping (tests/support/census.py), not listed by hand: each dense
family's tiny random checkpoint (the census's config, bfloat16 in shards, every weight outside
attention drawn at random too) generates what transformers' ``generate`` does in float32,
token for token, with the logits of every step; each family whose decoder mha.models does
not write out (a mixture of experts of its own kind, a hybrid's Mamba layers) is refused
naming what it lacks. A family added upstream and read by ``from_pretrained`` shows up here
as unaccounted for. A family of each mechanism of the older families (computed positions, a
stage before the head, xIELU...) also computes in float64 what transformers does, within
1e-10."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import census
from support.configs import relative_error

NEW_TOKENS = 40  # 12 + 40 positions: within the tiny models' 64 learned positions
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 64, 12)]


def read_families() -> list[str]:
    """The decoder families of transformers' causal-LM mapping whose attention
    ``from_pretrained`` reads."""
    from mha.integrations.readers import FAMILIES

    # census.CLASSES holds every model type of the mapping (test_families.py checks it
    # against transformers'), so the families are known where transformers is not installed
    return [
        kind
        for kind, kind_class in census.CLASSES.items()
        if kind_class == census.DECODER and kind in FAMILIES
    ]


def build(model_type: str, folder: Path, **changes: Any) -> Path:
    """``model_type``'s tiny model (its config with ``changes``), every norm weight and bias
    outside the attention drawn at random (a misplaced norm or bias would not show at their
    initial values), saved in bfloat16 in shards."""
    import torch
    import transformers

    config = census.tiny_config(model_type)
    if changes:
        with census._quiet():
            config = type(config)(**(config.to_dict() | changes))
    model_class = getattr(transformers, census.causal_lm_types()[model_type])
    torch.manual_seed(0)
    with census._quiet():
        model = model_class(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                tensor.normal_(0.0, 0.3) if name.endswith("bias") else tensor.add_(
                    torch.randn_like(tensor) * 0.3
                )
            elif name.endswith(("correct_output_scale", "router.scale", "per_expert_scale")):
                tensor.normal_(1.0, 0.3)  # Gemma 3n's AltUp's (zeros), Gemma 4's router's (ones)
        for name, tensor in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's: ones at first
                tensor.uniform_(0.5, 1.5)
    with census._quiet():
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=census.SHARD_SIZE)
    return folder


def transformers_generate(folder: Path, model_type: str):
    import torch
    import transformers

    model_class = getattr(transformers, census.causal_lm_types()[model_type])
    with census._quiet():
        model = model_class.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=census._implementation(model_class)
        ).eval()
        # no end-of-sequence token: min_new_tokens would hide it from the choice, not the logits
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
    tokens = generated.sequences[0, len(PROMPT) :].tolist()
    return tokens, [step[0].numpy() for step in generated.logits]


def test_every_family_read_is_generated_or_refused_by_name(transformers):
    from mha.models import FAMILIES, NOT_WRITTEN

    unaccounted = [
        kind for kind in read_families() if kind not in FAMILIES and kind not in NOT_WRITTEN
    ]
    assert not unaccounted, f"read by from_pretrained, neither generated nor refused: {unaccounted}"
    assert len([kind for kind in read_families() if kind in FAMILIES]) >= 70


@pytest.mark.parametrize("model_type", [kind for kind in read_families()])
def test_a_family_generates_what_transformers_generates(
    model_type, torch, transformers, tmp_path, record_error
):
    from mha.models import FAMILIES, NOT_WRITTEN, Decoder, UnsupportedModelError
    from mha.models.families import MIXTURE

    folder = build(model_type, tmp_path)
    if model_type not in FAMILIES:
        with pytest.raises(UnsupportedModelError) as refused:
            Decoder(folder)
        assert NOT_WRITTEN[model_type] in str(refused.value)
        if NOT_WRITTEN[model_type] == MIXTURE:  # a dense family is never refused as one
            from mha.integrations.checkpoint import open_checkpoint

            keys = list(open_checkpoint(folder))
            assert any(word in key for key in keys for word in ("expert", "router")), keys
        return
    _generates_what_transformers_generates(folder, model_type, model_type, record_error)


def _generates_what_transformers_generates(
    folder: Path, model_type: str, label: str, record_error
) -> np.ndarray:
    """The check of :func:`test_a_family_generates_what_transformers_generates`; the
    prompt's last logits of transformers' model."""
    from mha.models import Decoder

    expected_tokens, expected_logits = transformers_generate(folder, model_type)
    start = time.perf_counter()
    tokens, logits = Decoder(folder).generate(PROMPT, NEW_TOKENS)
    seconds = time.perf_counter() - start
    errors = [
        relative_error(ours, theirs) for ours, theirs in zip(logits, expected_logits, strict=True)
    ]
    assert record_error(f"mha.models {label}, float32 logits", max(errors)) <= 1e-4
    assert tokens == expected_tokens
    assert seconds < 30, f"{label}: {seconds:.1f} s for {NEW_TOKENS} tokens"
    return expected_logits[0]


_SHARING = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "per_layer_config": {"1": {"head_dim": 16}, "3": {"head_dim": 16}},
}
GEMMA_VARIANTS = {
    "gemma4_text": ("gemma4_text", {
        "num_kv_shared_layers": 2, "attention_k_eq_v": True, "use_double_wide_mlp": True,
        "final_logit_softcapping": 30.0, **_SHARING,
    }),
    "gemma4_text, experts": ("gemma4_text", {
        "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 16,
    }),
    "gemma4_unified_text": ("gemma4_unified_text", {
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True, **_SHARING,
    }),
    "gemma3n_text": ("gemma3n_text", {"activation_sparsity_pattern": [0.95, 0.5, 0.0, 0.3]}),
}  # fmt: skip
"""What the census's tiny Gemma configs lack: Gemma 4's last two layers attending with the
keys and values of layers 0 and 1 (its sliding and full layers alternating, the full ones'
heads 16 wide), with the values of the full layers their keys' projection, the sharing
layers' MLPs twice as wide and the logits capped; Gemma 4's mixture of experts beside its
MLP (its router's scales drawn at random, each of them and the mixture's norm shown to
matter: read as ones, the prompt's logits are not within 1e-2); Gemma 3n's activation
sparsity (its MLPs' gates cut below their mean plus a normal quantile of standard
deviations)."""


EXPERT_TENSORS = ("router.scale", "router.per_expert_scale", "post_feedforward_layernorm_2.weight")


@pytest.mark.parametrize("variant", sorted(GEMMA_VARIANTS))
def test_gemma_variants_generate_what_transformers_generates(
    variant, torch, transformers, tmp_path, record_error, monkeypatch
):
    from mha.models import Decoder, UnsupportedModelError, layers

    model_type, changes = GEMMA_VARIANTS[variant]
    folder = build(model_type, tmp_path, **changes)
    first = _generates_what_transformers_generates(
        folder, model_type, f"{variant} (variant)", record_error
    )
    take = layers.Tensors.take
    for name in EXPERT_TENSORS if changes.get("enable_moe_block") else ():

        def ones(self, key, name=name):
            array = take(self, key)
            return np.ones_like(array) if key == name else array

        monkeypatch.setattr(layers.Tensors, "take", ones)
        _, logits = Decoder(folder).generate(PROMPT, 1)
        assert relative_error(logits[0], first) > 1e-2, name
    monkeypatch.undo()
    if changes.get("num_kv_shared_layers"):  # a sharing layer reads its owner's mha.KVCache
        with pytest.raises(UnsupportedModelError, match="use the contiguous cache"):
            Decoder(folder, cache="paged").generate(PROMPT, 1)


def _without_scalars(decoder) -> None:
    for layer in decoder.layers:
        layer.stages.scalar = None


def _without_per_layer_inputs(decoder) -> None:
    inputs = decoder.per_layer_inputs
    decoder.per_layer_inputs = lambda ids, x: inputs(ids, x) * 0.0


def _without_laurel(decoder) -> None:
    for layer in decoder.layers:
        layer.stages.laurel = lambda h: h


def _without_correction_scale(decoder) -> None:
    for layer in decoder.layers:
        layer.stages.altup.output_scale = None


def _one_stream(decoder) -> None:
    spread = decoder.streams[0]
    decoder.streams = ([W * 0.0 for W in spread], decoder.streams[1])


GEMMA_STAGES = {
    "gemma4_text": (_without_scalars, _without_per_layer_inputs),
    "gemma3n_text": (
        _without_per_layer_inputs, _without_laurel, _without_correction_scale, _one_stream
    ),
}  # fmt: skip
"""Each stage of Gemma 4's and Gemma 3n's decoders (:mod:`mha.models.gemma`) left out."""


@pytest.mark.parametrize("model_type", sorted(GEMMA_STAGES))
def test_each_gemma_stage_matters(model_type, torch, transformers, tmp_path):
    """The prompt's logits within 1e-4 of transformers', and not within 1e-2 without any
    one of the stages (each drawn at random in the tiny model, as its norms)."""
    from mha.models import Decoder

    folder = build(model_type, tmp_path)
    model_class = getattr(transformers, census.causal_lm_types()[model_type])
    with census._quiet():
        model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0].numpy()

    def logits(decoder) -> np.ndarray:
        return decoder.forward(np.array([PROMPT]), decoder.new_caches(1, len(PROMPT)))[0]

    assert relative_error(logits(Decoder(folder)), expected) <= 1e-4
    for leave_out in GEMMA_STAGES[model_type]:
        decoder = Decoder(folder)
        leave_out(decoder)
        assert relative_error(logits(decoder), expected) > 1e-2, leave_out.__name__


FLOAT64_FAMILIES = {
    "ctrl": "CTRL's sinusoidal positions, embeddings times sqrt(d), a tied head's own bias",
    "xglm": "XGLM's sinusoidal positions from row 2, scale_embedding",
    "biogpt": "BioGPT's learned positions from row 2, scale_embedding",
    "modernbert-decoder": "the embeddings' norm, a first layer without one, GLU, a head stage",
    "mpt": "LayerNorms without biases, exact GELU",
}
"""A family of each mechanism the decoders gained for the older families and ModernBERT
(Apertus's xIELU: test_xielu_in_float64)."""


def _float64_model(model_type: str, folder: Path):
    import torch
    import transformers

    model_class = getattr(transformers, census.causal_lm_types()[model_type])
    with census._quiet():
        model = model_class.from_pretrained(
            folder, dtype=torch.float64, attn_implementation=census._implementation(model_class)
        ).eval()
    census._float64_rotaries(model)  # its frequencies in float64, as mha's
    return model


def _replace_computed_positions(model_type: str, model) -> None:
    """CTRL's and XGLM's tables of sinusoidal positions, which transformers computes in
    float32 with torch's float32 ``exp``, ``pow``, ``sin`` and ``cos`` (within an ulp of the
    exact value, not always the nearest float32), replaced by mha's (each value the nearest
    float32), after checking them within 4 ulps of 1 of each other."""
    import torch

    from mha.models.layers import ctrl_positions, sinusoidal_positions

    if model_type == "ctrl":
        module, name = model.transformer, "pos_encoding"
    elif model_type == "xglm":
        module, name = model.model.embed_positions, "weights"
    else:
        return
    theirs = getattr(module, name).numpy()
    rows, width = np.arange(len(theirs)), theirs.shape[1]
    if model_type == "ctrl":
        ours = ctrl_positions(rows, width)
    else:
        ours = sinusoidal_positions(rows, width, model.config.pad_token_id)
    assert ours.dtype == np.float32
    assert np.abs(ours - theirs).max() <= 4 * np.finfo(np.float32).eps
    setattr(module, name, torch.from_numpy(ours.astype(np.float64)))


@pytest.mark.parametrize("model_type", sorted(FLOAT64_FAMILIES))
def test_a_family_computes_what_transformers_computes_in_float64(
    model_type, torch, transformers, tmp_path, record_error
):
    """A prefill and a step in float64, each logit within 1e-10 of transformers' float64
    model run in float64 throughout (its float32 softmax and rotary too: float64_torch), its
    computed positions mha's (:func:`_replace_computed_positions`)."""
    from support.rope_oracle import float64_torch

    from mha.models import Decoder

    folder = build(model_type, tmp_path)
    model = _float64_model(model_type, folder)
    _replace_computed_positions(model_type, model)
    decoder = Decoder(folder, dtype=np.float64)
    caches = decoder.new_caches(1, capacity=len(PROMPT) + 1)
    with torch.no_grad(), float64_torch():
        first = model(torch.tensor([PROMPT]), use_cache=True)
        step = first.logits[0, -1].argmax().reshape(1, 1)
        second = model(step, cache=first.cache, use_cache=True)
    ours_first = decoder.forward(np.array([PROMPT]), caches)
    ours_second = decoder.forward(step.numpy(), caches)
    assert ours_first.dtype == ours_second.dtype == np.float64
    error = max(
        relative_error(ours_first, first.logits.numpy()),
        relative_error(ours_second, second.logits.numpy()),
    )
    assert record_error(f"mha.models {model_type}, float64 logits", error) <= 1e-10


def test_xielu_in_float64(torch, transformers, tmp_path, record_error):
    """Apertus's MLP with its xIELU (learned alphas, the checkpoint's beta and eps) in
    float64, within 1e-10 of transformers' on inputs of both signs, in each layer. (Its whole
    model differs by float32's rounding: its RMSNorms compute in float32 in both, transformers'
    with ``rsqrt``.)"""
    from mha.models import Decoder

    folder = build("apertus", tmp_path)
    model = _float64_model("apertus", folder)
    decoder = Decoder(folder, dtype=np.float64)
    h = np.random.default_rng(0).normal(0.0, 2.0, (3, 7, model.config.hidden_size))
    for ours, theirs in zip(decoder.layers, model.model.layers, strict=True):
        with torch.no_grad():
            expected = theirs.mlp(torch.from_numpy(h)).numpy()
        error = relative_error(ours.mlp(h), expected)
        assert record_error("mha.models apertus, float64 xIELU MLP", error) <= 1e-10


CPMANT_PROMPTS = ([7], [3, 0, 9, 12, 5], [0, 0, 4, 8], PROMPT)
"""CPM-Ant's prompts of several lengths (its prompt tokens prepended to each), with token
id 0 among them (segment 0) and left padding (leading zeros)."""


@pytest.mark.parametrize("prompt", CPMANT_PROMPTS, ids=lambda prompt: f"{len(prompt)} tokens")
def test_cpmant_generates_what_transformers_generates_in_float64(
    prompt, torch, transformers, tmp_path, record_error, monkeypatch
):
    """CPM-Ant's decoder (:mod:`mha.models.cpmant`) in float64: 12 new tokens, each the one
    transformers' float64 ``generate`` chooses, every step's logits within 1e-10 (its
    RMSNorms' mean taken in float64, as mha's: transformers' in float32)."""
    from support.rope_oracle import float64_torch
    from transformers.models.cpmant import modeling_cpmant

    from mha.models import Decoder
    from mha.models.cpmant import CpmAntDecoder

    def float64_norm(self, x):
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight

    monkeypatch.setattr(modeling_cpmant.CpmAntLayerNorm, "forward", float64_norm)
    folder = build("cpmant", tmp_path)
    model = _float64_model("cpmant", folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad(), float64_torch():
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    decoder = Decoder(folder, dtype=np.float64)
    assert isinstance(decoder, CpmAntDecoder)
    tokens, logits = decoder.generate(prompt, 12)
    assert tokens == generated.sequences[0, len(prompt) :].tolist()
    error = max(
        relative_error(ours, theirs[0].numpy())
        for ours, theirs in zip(logits, generated.logits, strict=True)
    )
    assert logits[0].dtype == np.float64
    assert record_error("mha.models cpmant, float64 logits", error) <= 1e-10


def _cpmant_without_prompt(decoder) -> None:
    decoder.prompt_ids = decoder.prompt_ids - decoder.prompt_length  # the next prompt type's


def _cpmant_without_segments(decoder) -> None:
    decoder.segment_embed = decoder.segment_embed * 0.0


def _cpmant_causal(decoder) -> None:
    class Causal:
        def __init__(self, layer) -> None:
            self.layer, self.new_cache, self.token_inputs = (
                layer,
                layer.new_cache,
                layer.token_inputs,
            )

        def __call__(self, h, **keywords):
            return self.layer(h, **keywords, causal=True)

    decoder.layers = [(Causal(layer), *rest) for layer, *rest in decoder.layers]


@pytest.mark.parametrize(
    "leave_out", [_cpmant_without_prompt, _cpmant_without_segments, _cpmant_causal]
)
def test_each_cpmant_piece_matters(leave_out, torch, transformers, tmp_path):
    """CPM-Ant's prompt tokens (another prompt type's), its segment embeddings and its
    attention that is not causal: without any one the prompt's logits are not within 1e-2
    of the decoder's; a cache of another kind and ragged tokens are refused by name."""
    from mha.models import Decoder, UnsupportedModelError

    folder = build("cpmant", tmp_path)
    _, expected = Decoder(folder, dtype=np.float64).generate(PROMPT, 2)
    decoder = Decoder(folder, dtype=np.float64)
    leave_out(decoder)
    _, logits = decoder.generate(PROMPT, 2)
    assert relative_error(logits[1], expected[1]) > 1e-2
    with pytest.raises(UnsupportedModelError, match="cache='paged'"):
        Decoder(folder, cache="paged")
    with pytest.raises(ValueError, match="query_lengths=None"):
        decoder.forward(np.array([PROMPT]), decoder.new_caches(1), query_lengths=[3])
