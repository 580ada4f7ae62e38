"""llama.cpp's GGUF files read by ``mha.from_pretrained``: tiny random models written with
gguf's own writer and quantizer, in each quantization, each layer's attention compared with
transformers' own GGUF loader in float64: its dequantized weights equal, bit for bit, and
its attention on the same inputs within 1e-12. CI's full tier installs the ``models`` extra
and sets MHA_REQUIRE_MODELS=1, making gguf's absence a failure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.configs import relative_error
from support.gguf_models import permute, write_gguf
from support.rope_oracle import float64_rotary, float64_torch
from support.transformers_oracle import AttentionRecorder

import mha

QUANTIZATIONS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
CASES = [("llama", q) for q in QUANTIZATIONS + K_QUANTS] + [
    ("qwen2", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "F16"), ("qwen3", "Q4_0")
]  # fmt: skip


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
    """A random ``{kind}ForCausalLM``, its rows multiples of llama.cpp's 32-wide blocks
    (``width=256``: of the K-quants' 256-wide ones)."""
    settings: dict[str, Any] = {
        "hidden_size": width, "intermediate_size": max(96, width), "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 128, "rope_theta": 5000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": kind != "llama",
    }  # fmt: skip
    if kind == "qwen3":  # transformers reads no head width from a qwen3 GGUF: its default
        settings.update(head_dim=128, num_attention_heads=2, num_key_value_heads=1)
    config = getattr(transformers, f"{kind.capitalize()}Config")(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model


def load_gguf(transformers: Any, torch: Any, path: Path) -> Any:
    """transformers' own GGUF loader, in float64, its rotary in float64 too (its RMSNorms
    compute in float64 under ``float64_torch``)."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
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
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    expected_names = set(theirs) - ({"lm_head.weight"} if source.config["tie_word_embeddings"]
                                    else set())  # fmt: skip
    assert set(source.keys()) == expected_names
    ours = source.read(sorted(expected_names), dtype=np.float64)
    for name in expected_names:
        assert ours[name].dtype == np.float64
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # each layer's attention on the inputs transformers' layers received
    recorder = AttentionRecorder(model)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), float64_torch():
        model(ids)
    recorder.close()
    for layer, calls in enumerate(recorder.calls):
        ((x, expected),) = calls
        attention = mha.from_pretrained(path, layer=layer, dtype=np.float64)
        error = relative_error(attention(x, mask=True), expected)
        assert record_error(f"GGUF {kind} {quantization}, float64", error) <= 1e-12


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
    writer = gguf.GGUFWriter(str(other), "bloom")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(mha.WeightsFileError, match=r"general\.architecture is 'bloom'"):
        mha.from_pretrained(other, layer=0)
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
