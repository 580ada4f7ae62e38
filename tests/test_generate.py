"""examples/generate.py: whole models of every family, read from bfloat16 checkpoints in
shards, generate what transformers' ``generate`` does in float32, token for token, with the
logits of every step; the mixtures of experts' attention also layer by layer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.configs import relative_error
from support.pretrained_models import LONG, SHARD_SIZE, build
from support.transformers_oracle import AttentionRecorder

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "olmo2", "phi3",
            "gpt_oss", "deepseek_v3", "deepseek_v3_mha", "smollm3", "helium", "seed_oss", "cwm",
            "internlm3", "gemma", "olmo3", "exaone4", "mixtral", "qwen3_moe", "olmoe")  # fmt: skip
NEW_TOKENS = 64
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 64, 12)]
"""12 tokens: longer than every sliding window of the tiny models (5 to 9), shorter than
``LONG`` (16), past which Phi-3's longrope switches to its long factors and the scaled ropes
(Llama 3's, yarn) stretch; 64 new tokens go past it, and past the windows many times."""
SCRIPT = Path(__file__).parent.parent / "examples" / "generate.py"


def checkpoint(family: str, folder: Path) -> Path:
    """``family``'s tiny model (tests/support/pretrained_models.py), saved in bfloat16 in
    several shards, with what starts at a constant outside attention drawn at random too:
    the norms (ones, or zeros for Gemma's ``1 + w``: a misplaced norm would not show), the
    experts' and router's biases, DeepSeek's ``e_score_correction_bias``; and DeepSeek's
    experts in 2 groups, one of them chosen per token."""
    import torch
    from transformers.utils import logging

    model = build(family)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "self_attn" in name or not tensor.is_floating_point():
                continue
            if "norm" in name:
                tensor.normal_(0.0 if "gemma" in family else 1.0, 0.3)
            elif name.endswith(("bias", "e_score_correction_bias")):
                tensor.normal_(0.0, 0.3)
    logging.disable_progress_bar()
    try:
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=SHARD_SIZE)
    finally:
        logging.enable_progress_bar()
    if family.startswith("deepseek"):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "n_group": 2, "topk_group": 1}))
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    return folder


def implementation(family: str) -> str:
    """SDPA where transformers has it for the family; Gemma 2 (soft-capping) and gpt-oss
    (sinks) have the eager attention only."""
    return "eager" if family in ("gemma2", "gpt_oss") else "sdpa"


def transformers_model(folder: Path, family: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=implementation(family)
    ).eval()


def transformers_generate(folder: Path, family: str, prompt: list[int], new_tokens: int):
    """transformers' greedy ``generate`` on the checkpoint loaded in float32: the new tokens
    and the logits of each step."""
    import torch

    with torch.no_grad():
        generated = transformers_model(folder, family).generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    tokens = generated.sequences[0, len(prompt) :].tolist()
    return tokens, [step[0].numpy() for step in generated.logits]


WINDOWS = {"qwen2": [None, None, 5, 5], "gemma2": [5, None, 5], "mistral": [7, 7, 7]}
"""Sliding layers where the configs put them: from Qwen2's max_window_layers=2 on, by
Gemma's layer_types, everywhere for Mistral."""


@pytest.mark.parametrize("family", FAMILIES)
def test_a_whole_model_generates_what_transformers_generates(
    family, torch, transformers, tmp_path, record_error
):
    from generate import Decoder

    folder = checkpoint(family, tmp_path)
    expected_tokens, expected_logits = transformers_generate(folder, family, PROMPT, NEW_TOKENS)
    start = time.perf_counter()
    decoder = Decoder(folder)
    tokens, logits = decoder.generate(PROMPT, NEW_TOKENS)
    seconds = time.perf_counter() - start
    assert tokens == expected_tokens
    assert len(logits) == NEW_TOKENS
    for ours, theirs in zip(logits, expected_logits, strict=True):
        assert ours.dtype == np.float32
        # relative to the logits' scale: max |ours - theirs| / max |theirs|, each step
        error = relative_error(ours, theirs)
        assert record_error(f"generate.py {family}, float32 logits", error) <= 1e-4
    if family in WINDOWS:
        assert [layer.attention.window for layer in decoder.layers] == WINDOWS[family]
    assert decoder.recompute_at == (LONG if family == "phi3" else None)
    assert seconds < 30, f"{family}: {seconds:.1f} s for {NEW_TOKENS} tokens"


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_the_attention_of_mixtures_of_experts_matches_transformers(
    family, torch, transformers, tmp_path, record_error
):
    """Each layer's attention alone, from ``attention_layer`` (``from_pretrained``), on the
    inputs transformers' attention layers received in float32: whole sequences, and the
    same sequences cached, 10 tokens then one at a time."""
    from generate import attention_layer

    folder = checkpoint(family, tmp_path)
    model = transformers_model(folder, family)
    recorder = AttentionRecorder(model)
    ids = torch.randint(0, 64, (2, 2 * LONG), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids)
    recorder.close()
    for layer, calls in enumerate(recorder.calls):
        ((x, expected),) = calls
        attention = attention_layer(folder, layer)
        whole = attention(x, mask=True)
        assert whole.dtype == np.float32
        cache = attention.new_cache(2, capacity=x.shape[1])
        steps = [attention(x[:, :10], cache=cache)]
        steps += [attention(x[:, t : t + 1], cache=cache) for t in range(10, x.shape[1])]
        for name, ours in (("whole", whole), ("cached", np.concatenate(steps, axis=1))):
            error = relative_error(ours, expected)
            assert record_error(f"generate.py {family} attention, float32", error) <= 1e-4, name


def test_an_unsharded_float32_checkpoint_generates_the_same(torch, transformers, tmp_path):
    """``save_pretrained``'s default: one ``model.safetensors`` in float32."""
    from generate import Decoder

    build("gemma2").save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    decoder = Decoder(tmp_path)
    assert decoder.head is decoder.embed  # Gemma 2 ties them: no lm_head.weight saved
    expected, expected_logits = transformers_generate(tmp_path, "gemma2", PROMPT, 8)
    tokens, logits = decoder.generate(PROMPT, 8)
    assert tokens == expected
    for ours, theirs in zip(logits, expected_logits, strict=True):
        assert relative_error(ours, theirs) <= 1e-4


def test_the_decoder_refuses_what_it_cannot_compute_or_read(torch, transformers, tmp_path, capsys):
    """Configs and tensors it cannot compute exactly, by name; on the command line, one line
    and exit code 2, also for a prompt or a count it cannot take."""
    from generate import Decoder, UnsupportedModelError, main

    checkpoint("qwen2", tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    refusals = {
        "model_type='bert'": {"model_type": "bert"},
        "hidden_act='mish'": {"hidden_act": "mish"},
        "config.json has no rms_norm_eps, which": {"rms_norm_eps": None},
        "does not compute model.layers.3.": {"num_hidden_layers": 3},
    }
    for words, change in refusals.items():
        (tmp_path / "config.json").write_text(json.dumps({**saved, **change}))
        with pytest.raises(UnsupportedModelError) as refused:
            Decoder(tmp_path)
        assert words in str(refused.value), (words, str(refused.value))
    (tmp_path / "config.json").write_text(json.dumps({**saved, "layer_types": ["chunked"] * 4}))
    with pytest.raises(ValueError, match="chunked"):  # from_pretrained's refusal
        Decoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "model_type": "phi3"}))
    with pytest.raises(UnsupportedModelError, match=r"no model\.layers\.0\.mlp\.gate_up_proj"):
        Decoder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    run = subprocess.run([sys.executable, SCRIPT, tmp_path, "1"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "config.json is not valid JSON" in run.stderr, run.stderr
    (tmp_path / "config.json").write_text(json.dumps(saved))
    for argv, words in (
        (["--new-tokens", "-3", "1"], "--new-tokens must be 0 or more; got -3"),
        (["64", "1"], "token ids [64] are outside the vocabulary of 64 (ids 0 to 63)"),
        (["-1"], "token ids [-1] are outside the vocabulary"),
        (["1", "x"], "argument prompt: invalid int value: 'x'"),
        (["1", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    ):
        try:
            code = main([str(tmp_path), *argv])
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
        stderr = capsys.readouterr().err
        assert code == 2 and words in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1, stderr
    shard = next(tmp_path.glob("model-00002-*.safetensors"))
    shard.unlink()
    assert main([str(tmp_path), "1"]) == 2
    assert f"{shard.name}, which is not in" in capsys.readouterr().err


def test_the_command_line_generates_in_float32_and_float64(torch, transformers, tmp_path):
    from generate import Decoder

    checkpoint("olmo2", tmp_path)
    expected = " ".join(map(str, Decoder(tmp_path).generate(PROMPT, 5)[0]))
    for dtype in ("float32", "float64"):
        argv = [tmp_path, *map(str, PROMPT), "--new-tokens", "5", "--dtype", dtype]
        run = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == expected, dtype
    decoder = Decoder(tmp_path, dtype=np.float64)
    assert decoder.forward(np.array([PROMPT]), decoder.new_caches(1)).dtype == np.float64


def readme_model(transformers, torch, folder: Path) -> Path:
    """The README's random Llama-style model (benchmarks/decode.py's), saved in float32."""
    import importlib.util

    path = Path(__file__).parent.parent / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_benchmark", path)
    assert spec is not None and spec.loader is not None
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    decode.readme_model(torch, transformers).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def readme_run(transformers, torch, tmp_path_factory):
    """The README model, a 64-token prompt and its 256 greedy tokens with the contiguous
    cache, and each step's logits: computed once for the tests of each cache kind."""
    from generate import Decoder

    folder = readme_model(transformers, torch, tmp_path_factory.mktemp("readme"))
    prompt = np.random.default_rng(0).integers(0, 8000, 64).tolist()
    tokens, steps = Decoder(folder).generate(prompt, 256)
    return folder, prompt, tokens, steps


def test_a_paged_cache_generates_the_same_bits(readme_run):
    """256 greedy tokens from a 64-token prompt: a paged cache gives the same bits as the
    contiguous one, the same tokens."""
    from generate import Decoder

    folder, prompt, tokens, steps = readme_run
    paged, paged_steps = Decoder(folder, cache="paged").generate(prompt, 256)
    assert paged == tokens
    for a, b in zip(paged_steps, steps, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="cache must be one of"):
        Decoder(folder, cache="int2")


@pytest.mark.parametrize("kind", ["int8", "int4", "kivi8", "kivi4"])
def test_each_quantized_cache_generates_on_the_readme_model(kind, readme_run, record_error):
    """The quantized caches' first logits are recorded against float32's (this random
    model, drawn at a large scale, is sensitive: its best two logits lie 2% apart, so even
    int8's error changes the first token; its keys have no large channels, so KIVI's do no
    better on them than int8's and int4's), and the best next token, teacher-forced, counted
    against float32's (docs/serving.md gives the counts)."""
    from generate import Decoder

    folder, prompt, tokens, steps = readme_run
    # Teacher-forced: the quantized cache reads float32's tokens one by one, and each
    # step's best next token is compared with float32's (so that one early difference
    # does not decide the rest). Measured: 212, 49, 208 and 52 of 256.
    decoder = Decoder(folder, cache=kind)
    caches = decoder.new_caches(1, len(prompt) + 256)
    logits = decoder.forward(np.array([prompt]), caches)[0, -1]
    error = record_error(f"README model, {kind} cache's first logits vs float32",
                         relative_error(logits, steps[0]))  # fmt: skip
    assert error <= {"int8": 0.2, "int4": 1.0, "kivi8": 0.2, "kivi4": 1.5}[kind]
    agree = 0
    for step, token in zip(steps, tokens, strict=True):
        agree += int(np.argmax(logits) == np.argmax(step))
        logits = decoder.forward(np.array([[token]]), caches)[0, -1]
    assert agree >= {"int8": 180, "int4": 25, "kivi8": 180, "kivi4": 25}[kind], agree


@pytest.mark.parametrize("family", ["gemma2", "mistral", "qwen2"])
def test_sliding_models_decode_with_a_paged_cache(family, torch, transformers, tmp_path):
    """A paged cache keeps every position; a sliding layer attends within its window: the
    same tokens and logits as the contiguous window cache (this was refused, "full
    attention only"), while a latent model is refused for the reason that holds."""
    from generate import Decoder, UnsupportedModelError

    folder = checkpoint(family, tmp_path / family)
    tokens, steps = Decoder(folder).generate(list(range(1, 12)), 12)
    paged, paged_steps = Decoder(folder, cache="paged").generate(list(range(1, 12)), 12)
    assert paged == tokens
    for a, b in zip(paged_steps, steps, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(UnsupportedModelError, match="caches one latent per token"):
        Decoder(checkpoint("deepseek_v3", tmp_path / "ds"), cache="paged").new_caches(1)
