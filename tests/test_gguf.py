"""llama.cpp's GGUF files read by ``mha.from_pretrained``: tiny random models written with
gguf's own writer and quantizer, in each quantization, each layer's attention compared with
transformers' own GGUF loader in float64: its dequantized weights equal, bit for bit, and
its attention on the same inputs within 1e-12. CI's full tier installs the ``models`` extra
and sets MHA_REQUIRE_MODELS=1, making gguf's absence a failure."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.configs import relative_error
from support.gguf_models import permute, write_gguf
from support.pretrained_models import attention_path
from support.rope_oracle import float64_rotary, float64_torch, rotary_modules
from support.transformers_oracle import AttentionRecorder

import mha

QUANTIZATIONS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ADDED = {
    "phi3": "Q8_0", "gemma2": "Q5_1", "gemma3_text": "Q4_1",
    "nemotron": "Q5_0", "stablelm": "Q8_0", "starcoder2": "Q4_0", "gpt2": "Q4_1",
    "bloom": "Q8_0", "qwen2_moe": "Q8_0", "qwen3_moe": "Q4_0",
    "falcon": "Q5_1", "lfm2": "Q8_0",
    "minimax_m2": "Q4_1",
}  # fmt: skip
"""The architectures read beyond Llama's and Qwen's, each with the quantization it is
checked in beside F32."""
CASES = [("llama", q) for q in QUANTIZATIONS + K_QUANTS] + [
    ("qwen2", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "F16"), ("qwen3", "Q4_0")
] + [(kind, q) for kind, quantization in ADDED.items() for q in ("F32", quantization)]  # fmt: skip
CLASSES = {"gemma3_text": "Gemma3TextConfig", "stablelm": "StableLmConfig", "gpt2": "GPT2Config",
           "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
           "minimax_m2": "MiniMaxM2Config"}  # fmt: skip


@pytest.fixture(scope="module")
def gguf() -> Any:
    try:
        import gguf
    except ImportError:
        if os.environ.get("MHA_REQUIRE_MODELS") == "1":
            pytest.fail("MHA_REQUIRE_MODELS=1 but gguf cannot be imported: pip install mha[models]")
        pytest.skip("gguf is not installed (pip install mha[models]): GGUF files not read")
    return gguf


def tiny(transformers: Any, torch: Any, kind: str, seed: int, width: int = 64) -> Any:
    """A random ``{kind}ForCausalLM`` whose config is what its GGUF file says (every other
    setting the class's default, as transformers' GGUF loader reads it back), its rows
    multiples of llama.cpp's 32-wide blocks (``width=256``: of the K-quants' 256-wide ones)."""
    settings: dict[str, Any] = {
        "hidden_size": width, "intermediate_size": max(96, width), "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 128, "rope_theta": 5000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": kind not in ("llama", "mistral", "phi3", "nemotron"),
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    if kind == "qwen3":  # transformers reads no head width from a qwen3 GGUF: its default
        settings.update(head_dim=128, num_attention_heads=2, num_key_value_heads=1)
    if kind in ("mistral", "gemma2", "gemma3_text", "qwen3_moe", "minimax_m2"):
        settings.update(head_dim=width // 4)
    if kind in ("qwen2_moe", "qwen3_moe"):  # the experts' widths: the defaults, unread
        settings.update(num_experts=4, num_experts_per_tok=2)
    if kind == "minimax_m2":
        settings.update(num_local_experts=4, num_experts_per_tok=2, rotary_dim=width // 8)
    if kind == "nemotron":
        settings["norm_eps"] = settings.pop("rms_norm_eps")
    if kind in ("stablelm", "starcoder2"):  # transformers reads no rope base: the default
        del settings["rope_theta"], settings["rms_norm_eps"]
        settings["use_qkv_bias"] = kind == "stablelm"
    if kind == "lfm2":  # a convolution layer, then an attention layer
        settings.update(full_attn_idxs=[1], block_auto_adjust_ff_dim=False)
        settings["norm_eps"] = settings.pop("rms_norm_eps")
    if kind == "falcon":  # Falcon-7B's layers: one key and value head, parallel
        settings = {"hidden_size": width, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "vocab_size": 96}  # fmt: skip
    if kind in ("gpt2", "bloom"):
        settings = {"hidden_size": width, "n_layer": 2, "n_head": 4, "vocab_size": 96,
                    "layer_norm_epsilon": 1e-5}  # fmt: skip
    name = CLASSES.get(kind, f"{kind.capitalize()}Config")
    config = getattr(transformers, name)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model


def per_expert(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' fused experts (``mlp.experts.gate_up_proj``, ``down_proj``) as each
    expert's projections, as ``save_pretrained`` writes them and mha reads them."""
    split = {}
    for name, array in weights.items():
        stem, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*np.split(array, 2, axis=1), strict=True)):
                split[f"{stem}.{e}.gate_proj.weight"], split[f"{stem}.{e}.up_proj.weight"] = (
                    gate,
                    up,
                )
        elif kind == "down_proj" and stem.endswith("mlp.experts"):
            split.update({f"{stem}.{e}.down_proj.weight": down for e, down in enumerate(array)})
        else:
            split[name] = array
    return split


def load_gguf(transformers: Any, torch: Any, path: Path, dtype: Any = None) -> Any:
    """transformers' own GGUF loader, in float64 (SDPA where the family has it; its eager
    attention computes in float64 under ``float64_torch``), its rotary in float64 too;
    ``dtype=torch.float32``: as it stands, for generating."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype or torch.float64,
        attn_implementation="sdpa" if model_class._supports_sdpa else "eager",
        experts_implementation="eager",  # grouped_mm takes no float64
    ).eval()  # fmt: skip
    if dtype is None and rotary_modules(model):
        float64_rotary(model)
    return model


@pytest.mark.parametrize(("kind", "quantization"), CASES)
def test_each_layer_matches_transformers_gguf_loader(
    kind, quantization, gguf, torch, transformers, tmp_path, record_error
):
    path = tmp_path / "model.gguf"
    width = 256 if quantization in K_QUANTS else 64
    write_gguf(tiny(transformers, torch, kind, seed=len(kind), width=width), path, quantization)
    model = load_gguf(transformers, torch, path)
    # the dequantized weights, as transformers holds them, bit for bit
    from mha.integrations.gguf_file import open_gguf

    source = open_gguf(path)
    theirs = per_expert({k: v.numpy() for k, v in model.state_dict().items()})
    expected_names = set(theirs) - ({"lm_head.weight"} if source.config["tie_word_embeddings"]
                                    else set())  # fmt: skip
    assert set(source.keys()) == expected_names
    ours = source.read(sorted(expected_names), dtype=np.float64)
    for name in expected_names:
        assert ours[name].dtype == np.float64
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # each layer's attention on the inputs transformers' layers received
    recorder = AttentionRecorder(model, attention_path(model))
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), float64_torch():
        model(ids)
    recorder.close()
    for layer, calls in zip(recorder.layers, recorder.calls, strict=True):  # LFM2: attention alone
        ((x, expected),) = calls
        attention = mha.from_pretrained(path, layer=layer, dtype=np.float64)
        error = relative_error(attention(x, mask=True), expected)
        assert record_error(f"GGUF {kind} {quantization}, float64", error) <= 1e-12


GENERATED = [("llama", "Q4_0")] + [
    (kind, q) for kind, quantization in ADDED.items() for q in ("F32", quantization)
]


@pytest.mark.parametrize(("kind", "quantization"), GENERATED)
def test_the_decoder_generates_what_transformers_generates(
    kind, quantization, gguf, torch, transformers, tmp_path, record_error
):
    """``mha.models.Decoder`` on the GGUF file: transformers' greedy tokens from the same
    file, in float32, token for token."""
    from mha.models import NOT_WRITTEN, Decoder, UnsupportedModelError

    path = tmp_path / "model.gguf"
    write_gguf(tiny(transformers, torch, kind, seed=len(kind) + 1), path, quantization)
    if kind in NOT_WRITTEN:  # Qwen2-MoE's shared expert: its attention alone is read
        with pytest.raises(UnsupportedModelError, match=re.escape(NOT_WRITTEN[kind])):
            Decoder(path)
        return
    model = load_gguf(transformers, torch, path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = [5, 17, 42, 8, 90, 33, 61]
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    tokens, logits = Decoder(path).generate(prompt, 8)
    errors = [
        relative_error(ours, step[0].numpy())
        for ours, step in zip(logits, generated.logits, strict=True)
    ]
    assert record_error(f"GGUF {kind} {quantization}, float32 logits", max(errors)) <= 1e-4
    assert tokens == generated.sequences[0, len(prompt) :].tolist()


def test_llama_rows_come_back_in_transformers_order(gguf, torch, transformers, tmp_path):
    """Unquantized, the weights read are the model's own: llama.cpp's permutation undone."""
    model = tiny(transformers, torch, "llama", seed=1)
    path = tmp_path / "model.gguf"
    write_gguf(model, path, "F32")
    from mha.integrations.gguf_file import open_gguf

    source = open_gguf(path)
    for name, tensor in model.state_dict().items():
        (array,) = source.read([name]).values()
        np.testing.assert_array_equal(array, tensor.numpy(), err_msg=name)
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(permute(q, 4), q)


def test_what_mha_cannot_compute_is_refused_by_name(gguf, torch, transformers, tmp_path):
    model = tiny(transformers, torch, "llama", seed=2)
    path = tmp_path / "model.gguf"
    write_gguf(model, path, "F32")
    source = path.read_bytes()
    # a metadata key this reader does not map: rope scaling
    writer = gguf.GGUFWriter(str(tmp_path / "scaled.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(mha.WeightsFileError, match=r"llama\.rope\.scaling\.type"):
        mha.from_pretrained(tmp_path / "scaled.gguf", layer=0)
    # an architecture not read
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        mha.WeightsFileError, match=r"general\.architecture is 'mamba'.*state-space"
    ):
        mha.from_pretrained(other, layer=0)
    # a Falcon file with more than one key and value head (Falcon-40B's layout)
    falcon = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(falcon), "falcon")
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(mha.WeightsFileError, match=r"attention\.head_count_kv = 2"):
        mha.from_pretrained(falcon, layer=0)
    # a quantization type not read (IQ4_NL), named
    from mha.integrations.gguf_file import GGUFFile

    assert source[:4] == b"GGUF"
    file = GGUFFile(path)
    tensor = file._tensors["model.layers.0.self_attn.q_proj.weight"]
    file._tensors["model.layers.0.self_attn.q_proj.weight"] = tensor._replace(
        tensor_type=gguf.GGMLQuantizationType.IQ4_NL
    )
    with pytest.raises(mha.WeightsFileError, match="stored as IQ4_NL"):
        file.read(["model.layers.0.self_attn.q_proj.weight"])


GGUF_NAMES = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss",
              "minimax_m2": "minimax-m2", "umt5": "t5", "mistral": "llama"}  # fmt: skip
"""transformers' names of the GGUF architectures it reads, as llama.cpp writes them
(Mistral as Llama, whose ``general.name`` transformers' reader takes apart, but then finds
no ``mistral`` in gguf's names and fails)."""


def test_every_architecture_transformers_reads_is_read_or_refused_by_name(gguf, transformers):
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from mha.integrations.gguf_file import ARCHITECTURES, NOT_READ

    theirs = {GGUF_NAMES.get(k, k) for k in GGUF_CONFIG_MAPPING} - {"general", "tokenizer"}
    assert theirs <= set(ARCHITECTURES) | set(NOT_READ), theirs - set(ARCHITECTURES)
    assert not set(ARCHITECTURES) & set(NOT_READ)
