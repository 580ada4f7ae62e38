"""mha.models' whole decoders of every family ``from_pretrained`` reads, enumerated from
transformers' causal-LM mapping (tests/support/census.py), not listed by hand: each dense
family's tiny random checkpoint (the census's config, bfloat16 in shards, every weight outside
attention drawn at random too) generates what transformers' ``generate`` does in float32,
token for token, with the logits of every step; each family whose decoder mha.models does
not write out (a mixture of experts of its own kind, a hybrid's Mamba layers) is refused
naming what it lacks. A family added upstream and read by ``from_pretrained`` shows up here
as unaccounted for."""

from __future__ import annotations

import time
from pathlib import Path

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

    types = census.causal_lm_types()
    return [
        kind for kind in types if census.CLASSES.get(kind) == census.DECODER and kind in FAMILIES
    ]


def build(model_type: str, folder: Path) -> Path:
    """``model_type``'s tiny model, every norm weight and bias outside the attention
    drawn at random (a misplaced norm or bias would not show at their initial values),
    saved in bfloat16 in shards."""
    import torch
    import transformers

    config = census.tiny_config(model_type)
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


def test_every_family_read_is_generated_or_refused_by_name():
    from mha.models import FAMILIES, NOT_WRITTEN

    unaccounted = [
        kind for kind in read_families() if kind not in FAMILIES and kind not in NOT_WRITTEN
    ]
    assert not unaccounted, f"read by from_pretrained, neither generated nor refused: {unaccounted}"
    assert len([kind for kind in read_families() if kind in FAMILIES]) >= 60


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
    expected_tokens, expected_logits = transformers_generate(folder, model_type)
    start = time.perf_counter()
    tokens, logits = Decoder(folder).generate(PROMPT, NEW_TOKENS)
    seconds = time.perf_counter() - start
    errors = [
        relative_error(ours, theirs) for ours, theirs in zip(logits, expected_logits, strict=True)
    ]
    assert record_error(f"mha.models {model_type}, float32 logits", max(errors)) <= 1e-4
    assert tokens == expected_tokens
    assert seconds < 30, f"{model_type}: {seconds:.1f} s for {NEW_TOKENS} tokens"
