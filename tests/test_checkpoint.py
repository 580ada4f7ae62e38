"""Reading transformers checkpoints: the safetensors reader (against the safetensors package
and, for bfloat16, torch), sharded folders, reading only the tensors asked for, every
refusal; and what each layer's attention is (``layer_attention``), against transformers' own
config objects and attention modules for every family, on tiny random bfloat16 checkpoints
written by ``save_pretrained`` in many shards (support.pretrained_models)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import shutil
import struct
import sys

import numpy as np
import pytest
from support import pretrained_models as models
from support.transformers_oracle import ATTENTION_TYPES

import mha
from mha.api.sparse import IndexerSpec
from mha.errors import AttentionTypeError, AttentionValueError, WeightsFileError
from mha.integrations import checkpoint as checkpoint_module
from mha.integrations.checkpoint import Checkpoint
from mha.integrations.readers import FAMILIES, layer_attention

TORCH_FAMILIES = models.FAMILIES


def write(folder, tensors, config=None, header_extra=None):
    """A one-file checkpoint of NumPy arrays (``{name: array}``, or ``{name: (dtype,
    shape, bytes)}`` for dtypes NumPy lacks), written byte by byte."""
    folder.mkdir(parents=True, exist_ok=True)
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        if isinstance(value, tuple):
            kind, shape, data = value
        else:
            kinds = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64",
                     "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                     "bool": "BOOL"}  # fmt: skip
            kind, shape, data = kinds[value.dtype.name], list(value.shape), value.tobytes()
        header[name] = {"dtype": kind, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header.update(header_extra or {})
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    return folder


def arrays():
    rng = np.random.default_rng(0)
    return {
        "f64": rng.standard_normal((3, 4)), "f32": rng.standard_normal((5,)).astype(np.float32),
        "f16": rng.standard_normal((2, 3, 2)).astype(np.float16),
        "i64": rng.integers(-9, 9, (4,)), "i32": rng.integers(-9, 9, (2, 2)).astype(np.int32),
        "i16": np.array([-3, 7], np.int16), "i8": np.array([-1, 2, 3], np.int8),
        "u8": np.array([0, 255], np.uint8), "bool": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 3), np.float32),
    }  # fmt: skip


# ---------------------------------------------------------------- the reader


def test_reads_what_the_safetensors_package_reads(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_file(arrays(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    checkpoint = Checkpoint(tmp_path)
    expected = load_file(str(tmp_path / "model.safetensors"))
    assert checkpoint.config == {"model_type": "llama", "hidden_size": 8}
    assert checkpoint.keys() == sorted(expected) == list(checkpoint) and len(checkpoint) == 11
    got = checkpoint.read(checkpoint.keys())
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert np.array_equal(got[name], array), name
    cast = checkpoint.read(["f16", "i32", "scalar"], dtype=np.float64)
    for name in cast:
        assert cast[name].dtype == np.float64
        assert np.array_equal(cast[name], expected[name].astype(np.float64))
    assert "f16" in checkpoint and "nothing" not in checkpoint
    assert repr(checkpoint).endswith("llama, 11 tensors in 1 file)")


BF16 = {0x3F80: 1.0, 0xC020: -2.5, 0x4049: 3.140625, 0x7F80: np.inf, 0x0001: 2.0**-133,
        0x8000: -0.0, 0x7F7F: 3.3895313892515355e38}  # fmt: skip


@pytest.mark.parametrize("with_ml_dtypes", [True, False])
def test_bfloat16_is_read_exactly(tmp_path, monkeypatch, with_ml_dtypes):
    """bfloat16 as ml_dtypes.bfloat16, or without ml_dtypes as float32; dtype= casts exactly."""
    bits = np.array(list(BF16), "<u2")
    write(tmp_path, {"w": ("BF16", [7], bits.tobytes())})
    if with_ml_dtypes:
        pytest.importorskip("ml_dtypes")
    else:
        monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes fails
    w = Checkpoint(tmp_path).read(["w"])["w"]
    assert w.dtype.name == ("bfloat16" if with_ml_dtypes else "float32")
    exact = np.array(list(BF16.values()))
    assert np.array_equal(w.astype(np.float64), exact)
    assert np.signbit(w.astype(np.float64)[5])
    for dtype in (np.float32, np.float64):
        cast = Checkpoint(tmp_path).read(["w"], dtype=dtype)["w"]
        assert cast.dtype == dtype and np.array_equal(cast, exact.astype(dtype))


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_bfloat16_checkpoints_match_torch(family, transformers):
    import torch
    from safetensors.torch import load_file

    folder = models.saved(family)
    checkpoint = Checkpoint(folder)
    expected = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        expected |= load_file(str(shard))
    assert checkpoint.keys() == sorted(expected)
    got, cast = checkpoint.read(expected), checkpoint.read(expected, dtype=np.float64)
    stored = "float32" if importlib.util.find_spec("ml_dtypes") is None else "bfloat16"
    for name, tensor in expected.items():
        assert tensor.dtype == torch.bfloat16
        assert got[name].dtype.name == stored and got[name].shape == tuple(tensor.shape)
        assert np.array_equal(got[name].astype(np.float32), tensor.float().numpy()), name
        assert np.array_equal(cast[name], tensor.double().numpy()), name


@pytest.mark.parametrize("family", TORCH_FAMILIES)
def test_each_family_is_saved_in_several_shards(family, transformers):
    from safetensors import safe_open

    folder = models.saved(family)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == [
        shard.name for shard in shards
    ]
    held = {}
    for shard in shards:
        with safe_open(str(shard), "np") as handle:
            held |= dict.fromkeys(handle.keys(), shard.name)
    checkpoint = Checkpoint(folder)
    assert checkpoint.keys() == sorted(held) and index["weight_map"] == held
    assert checkpoint.config == json.loads((folder / "config.json").read_text())


class Opened:
    """The files the reader opens and the bytes it reads, observed on its own module."""

    def __init__(self, monkeypatch):
        self.files, self.bytes = [], 0
        monkeypatch.setattr(checkpoint_module, "open", self.open, raising=False)
        original = np.fromfile

        def fromfile(file, dtype, count, **kwargs):
            self.bytes += count * np.dtype(dtype).itemsize
            return original(file, dtype=dtype, count=count, **kwargs)

        monkeypatch.setattr(checkpoint_module.np, "fromfile", fromfile)

    def open(self, path, *args, **kwargs):
        self.files.append(path.name)
        return open(path, *args, **kwargs)


def test_only_the_tensors_asked_for_are_read(monkeypatch, transformers):
    folder = models.saved("qwen2")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    opened = Opened(monkeypatch)
    checkpoint = Checkpoint(folder)
    assert opened.files == []  # the index and config.json only (read as text, not opened here)
    for layer in (0, 3):
        opened.files, opened.bytes = [], 0
        _, _, weights = layer_attention(checkpoint, layer)
        names = [name for name in weight_map if name.startswith(f"model.layers.{layer}.self_attn.")]
        assert set(opened.files) == {weight_map[name] for name in names}
        assert len(opened.files) < len(set(weight_map.values()))
        assert opened.bytes == 2 * sum(W.size for W in weights.values())  # bfloat16: 2 bytes
    opened.files = []
    checkpoint.read(["lm_head.weight"])
    assert opened.files == [weight_map["lm_head.weight"]] * 2  # the header once, then the data


# ---------------------------------------------------------------- the reader's refusals


def refused(error, *parts, kind=WeightsFileError):
    assert isinstance(error.value, kind), type(error.value)
    message = str(error.value)
    assert "\n" not in message
    for part in parts:
        assert str(part) in message, (part, message)


def test_folders_that_are_not_checkpoints_are_refused(tmp_path):
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(tmp_path / "missing")
    refused(error, tmp_path / "missing", "does not exist", "config.json")
    (tmp_path / "file").write_text("")
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(tmp_path / "file")
    refused(error, "is a file, not a folder")
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(tmp_path)
    refused(error, tmp_path, "has no config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(tmp_path)
    refused(error, tmp_path / "config.json", "is not valid JSON")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(tmp_path)
    refused(error, "holds no JSON object")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(tmp_path)
    refused(error, tmp_path, "neither model.safetensors nor model.safetensors.index.json")
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(tmp_path)
    refused(error, "model.safetensors.index.json has no weight_map")


def test_a_missing_shard_is_named_with_a_tensor_it_holds(tmp_path, transformers):
    folder = shutil.copytree(models.saved("llama"), tmp_path / "llama")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[2]
    (folder / shard).unlink()
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(folder)
    first = next(name for name, file in weight_map.items() if file == shard)
    refused(error, f"lists the shard {shard}, which is not in {folder}", first)


def test_a_tensor_the_checkpoint_lacks_is_refused_with_what_it_holds(transformers):
    checkpoint = Checkpoint(models.saved("qwen2"))
    with pytest.raises(WeightsFileError) as error:
        checkpoint.read(["model.layers.7.self_attn.q_proj.weight", "nothing"])
    held = "51 tensors under model.layers.{0..3}., lm_head., model.embed_tokens., model.norm."
    refused(error, "no tensor 'model.layers.7.self_attn.q_proj.weight' (nor 1 more)", held)
    with pytest.raises(AttentionTypeError) as error:
        checkpoint.read(["lm_head.weight"], dtype="no such dtype")
    refused(error, "dtype must be a NumPy dtype", kind=AttentionTypeError)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda raw: raw[:5], "is not a safetensors file: it has 5 bytes"),
        (lambda raw: struct.pack("<Q", 10**6) + raw[8:], "its header length 1000000 exceeds"),
        (lambda raw: raw[:8] + b"x" + raw[9:], "has a damaged header (Expecting value"),
        (lambda raw: raw[:8] + b"\xff" + raw[9:], "has a damaged header ('utf-8'"),
        (lambda raw: raw[:-4], "tensor 'b' has data_offsets [16, 32] outside the 28 bytes"),
    ],
)
def test_damaged_files_are_refused(tmp_path, damage, said):
    rng = np.random.default_rng(1)
    folder = write(tmp_path, {"a": rng.standard_normal(2), "b": rng.standard_normal(2)})
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(damage(raw))
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(folder)
    refused(error, folder / "model.safetensors", said)


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"dtype": "F32", "shape": [1]}, "lacks its dtype, shape or data_offsets"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "has shape [-1]"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "outside the 8 bytes"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "has 8 bytes for shape [3]"),
        ({"dtype": 7, "shape": [1], "data_offsets": [0, 4]}, "has dtype 7"),
        ("F32", "lacks its dtype"),
    ],
)
def test_damaged_header_entries_are_refused(tmp_path, entry, said):
    folder = write(tmp_path, {"ok": np.zeros(1)}, header_extra={"bad": entry})
    with pytest.raises(WeightsFileError) as error:
        Checkpoint(folder)
    refused(error, folder / "model.safetensors", "has a damaged header: tensor 'bad'", said)


def test_an_unsupported_dtype_is_refused_when_its_tensor_is_read(tmp_path):
    folder = write(tmp_path, {"f8": ("F8_E4M3", [2], b"\x01\x02"), "ok": np.ones(2)})
    checkpoint = Checkpoint(folder)
    assert np.array_equal(checkpoint.read(["ok"])["ok"], np.ones(2))  # the others still read
    with pytest.raises(WeightsFileError) as error:
        checkpoint.read(["f8"])
    refused(error, folder / "model.safetensors", "tensor 'f8' has dtype F8_E4M3", "BF16")


def test_a_tensor_missing_from_the_shard_its_index_names_is_refused(tmp_path):
    folder = write(tmp_path, {"a": np.zeros(2)})
    (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-1.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    checkpoint = Checkpoint(folder)
    with pytest.raises(WeightsFileError) as error:
        checkpoint.read(["b"])
    refused(error, folder / "model-1.safetensors", "does not hold 'b', which the index says")


# ---------------------------------------------------------------- each layer's attention


LATENT_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu", "sarvam_mla", "axk1",
                "minicpm3", "longcat_flash", "deepseek_v32", "glm_moe_dsa", "axk2",
                "dots3_note_text")  # fmt: skip
EVERY_LAYER_SLIDES = ("mistral", "phi3", "mixtral", "phimoe", "starcoder2", "ministral3",
                      "qwen3_moe")  # fmt: skip
SOFTCAPPED = ("gemma2", "vaultgemma")
QK_NORMS = {"qwen3": ("head", 0.0), "gemma3_text": ("head", 1.0), "olmo2": ("all", 0.0),
            "qwen3_moe": ("head", 0.0), "dots1": ("head", 0.0), "apertus": ("head", 0.0),
            "olmoe": ("all", 0.0), "flex_olmo": ("all", 0.0), "olmo3": ("all", 0.0),
            "apertus1p5_text": ("head", 0.0), "hy_v3": ("head", 0.0),
            "mellum": ("head", 0.0), "exaone4": ("head", 0.0),
            "minimax_m2": ("all", 0.0), "exaone_moe": ("head", 0.0), "kolibri1": ("head", 0.0),
            "flint": ("head", 0.0), "nanochat": ("head", 0.0), "hunyuan_v1_dense": ("head", 0.0),
            "afmoe": ("head", 0.0), "laguna": ("head", 0.0),
            "hunyuan_v1_moe": ("head", 0.0), "beam": ("head", 0.0)}  # fmt: skip
LAYER_NORMS = {"stablelm": ("qk_layernorm", "each_head"), "phi": ("qk_layernorm", "head"),
               "cohere": ("use_qk_norm", "each_head")}  # fmt: skip
"""The families whose QK-norm is a LayerNorm: the config key that turns it on, its kind."""
INTERLEAVED = ("helium", "ernie4_5", "ernie4_5_moe", "cohere", "cohere2", "cohere2_moe", "glm",
               "glm4")  # fmt: skip
"""What each family's transformers attention computes beyond Llama's, for the oracle below
(the pairs rotated: from the attention module, :func:`interleaved`, where there is one)."""
ROTATES = {
    "smollm3": lambda attention: attention.use_rope,
    "cohere2": lambda attention: attention.sliding_window is not None,
    "cohere2_moe": lambda attention: attention.sliding_window is not None or attention.force_rope,
    "exaone4": lambda attention: attention.sliding_window is None or attention.is_sliding,
    "exaone_moe": lambda attention: attention.sliding_window is None or attention.is_sliding,
    "kolibri1": lambda attention: attention.sliding_window is None or attention.is_sliding,
    "flint": lambda attention: attention.sliding_window is not None,
    "afmoe": lambda attention: attention.is_local_attention,
    "llama4_text": lambda attention: attention.use_rope,
}
"""Whether a layer rotates, from the attributes of transformers' attention module that its
``forward`` tests, for the families with layers without positions."""


def interleaved(attention):
    """Whether transformers' ``rotate_half`` of the module's family pairs ``(2i, 2i + 1)``."""
    rotate_half = getattr(sys.modules[type(attention).__module__], "rotate_half", None)
    source = "" if rotate_half is None else inspect.getsource(rotate_half)  # gpt-oss: none
    return "x[..., 0::2]" in source or "x[..., ::2]" in source


def expected_settings(config, index, attention=None):
    """mha's settings for layer ``index``, from transformers' own config object (its
    ``layer_types``, ``sliding_window`` and standardised ``rope_parameters``) and, for the
    rotary embedding, its attention module (which layers rotate, which pairs)."""
    model_type = config.model_type
    layer_types = getattr(config, "layer_types", None)
    layer_type = layer_types[index] if layer_types else None
    rope = config.rope_parameters
    if layer_type in rope:  # Gemma 3: one set per layer type
        rope = rope[layer_type]
    if rope is None:  # Cohere Compass's layers of a type without rope
        rope = {"rope_type": "default", "rope_theta": None}
    scaling = None if rope["rope_type"] == "default" else {
        **rope, "max_position_embeddings": config.max_position_embeddings}  # fmt: skip
    if model_type == "dots3_note_text":  # each layer's own sizes, from its module
        latent = {name: getattr(attention, name) for name in (
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")}  # fmt: skip
        latent |= {"d_model": config.hidden_size, "num_heads": attention.num_heads,
                   "rope_theta": rope["rope_theta"], "rope_scaling": scaling,
                   "rotary_interleaved": True, "output_gate": "sigmoid",
                   "rope_key_norm": True}  # fmt: skip
        if attention.sliding_window is not None:
            latent["window"] = attention.sliding_window
        if attention.indexer is not None:  # GLM-MoE-DSA's
            latent["indexer"] = IndexerSpec(
                config.index_topk,
                config.index_n_heads,
                config.index_head_dim,
                rotary_interleaved=True,
            )
        return latent
    if model_type in LATENT_TYPES:
        latent = {"d_model": config.hidden_size, "num_heads": config.num_attention_heads,
                "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
                "qk_nope_head_dim": config.qk_nope_head_dim,
                "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim,
                "rope_theta": rope["rope_theta"], "rope_scaling": scaling,
                "rotary_interleaved": getattr(config, "rope_interleave",
                                              model_type != "minicpm3")}  # fmt: skip
        if model_type in ("deepseek_v32", "glm_moe_dsa", "axk2"):  # sparse top-k: its indexer
            latent["indexer"] = IndexerSpec(
                config.index_topk, config.index_n_heads, config.index_head_dim,
                rotary_interleaved=model_type == "glm_moe_dsa")  # fmt: skip
        if model_type == "axk2":  # its query and gate per feature fused in q_gate_proj
            latent |= {"query_gate": True, "output_gate": "sigmoid"}
        return latent
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if attention is not None:  # StableLM's: hidden_size // heads, whatever the config says
        head_dim = attention.head_dim
    if model_type in EVERY_LAYER_SLIDES:
        window = config.sliding_window
    elif model_type in ("llama", "olmo2"):
        window = None
    else:
        window = config.sliding_window if layer_type == "sliding_attention" else None
    factor = rope.get("partial_rotary_factor", 1.0)
    kind, offset = QK_NORMS.get(model_type, (None, None))
    if model_type in ("glm4_moe", "sarvam_moe") and getattr(config, "use_qk_norm", False):
        kind, offset = "head", 0.0
    layer_norm = model_type in LAYER_NORMS and getattr(config, LAYER_NORMS[model_type][0])
    if layer_norm:
        kind, offset = LAYER_NORMS[model_type][1], 0.0
    if scaling is not None:
        scaling.pop("llama_4_scaling_beta", None)  # Ministral 3's, 0 here
    scale = getattr(config, "attention_multiplier", None)
    if hasattr(config, "query_pre_attn_scalar"):
        scale = config.query_pre_attn_scalar**-0.5
    pairs = interleaved(attention) if attention is not None else model_type in INTERLEAVED
    rotary = {"rope_theta": rope["rope_theta"], "rope_scaling": scaling,
              "rotary_dim": None if factor == 1.0 else int(head_dim * factor),
              "rotary_interleaved": pairs}  # fmt: skip
    thetas = getattr(config, "layer_rope_theta", None)  # GraniteSWA's: a base per layer
    if thetas is not None:
        rotary["rope_theta"] = float(thetas[index])
    rotates = attention is None or ROTATES.get(model_type, lambda _: True)(attention)
    if not rotates or (thetas is not None and not thetas[index]) or rope["rope_theta"] is None:
        rotary = {"rope_theta": None, "rope_scaling": None, "rotary_dim": None,
                  "rotary_interleaved": False}  # fmt: skip
    expected = {
        "num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads,
        "head_dim": head_dim, **rotary, "window": window, "chunk": None,
        "softcap": config.attn_logit_softcapping if model_type in SOFTCAPPED else None,
        "scale": scale,
        "qk_norm": kind, "qk_norm_offset": offset,
        "qk_norm_eps": (config.layer_norm_eps if layer_norm else config.rms_norm_eps) if kind
        else None,
        "clip_qkv": getattr(config, "clip_qkv", None), "qk_layernorm": bool(layer_norm),
        "qk_norm_after_rope": model_type.startswith("hunyuan"),
        **_gate(model_type, attention),
    }  # fmt: skip
    if model_type == "laguna":  # each layer its own heads
        expected["num_heads"] = attention.num_heads
    if model_type == "mimo_v2_flash":  # twice the key/value heads when sliding; values' width
        expected["num_kv_heads"] = attention.k_proj.out_features // head_dim
        expected["v_head_dim"] = attention.v_head_dim
    return expected | _temperature(config, index, attention, expected)


def _temperature(config, index, attention, expected):
    """Llama 4's settings from its attention module (its rope layers chunked, with its L2
    QK-norm after the (2i, 2i + 1) rotation; its other layers' query temperature) and
    Ministral 3's query temperature from its rope parameters, Beam's on its layers without
    rope."""
    if config.model_type == "ministral3":
        rope = config.rope_parameters
        beta, length = rope["llama_4_scaling_beta"], rope.get("original_max_position_embeddings")
        return {"query_temperature": (beta, float(length), 0.0) if beta else None}
    if config.model_type == "beam":  # compute_attention_scaling on the layers without rope
        return {
            "query_temperature": None if expected["rope_theta"] else (0.1, 2048.0, 1.0, "power")
        }
    if config.model_type != "llama4_text":
        return {}
    chunked = config.layer_types[index] == "chunked_attention"
    temperature = (attention.attn_scale, float(attention.floor_scale), 1.0)
    norm = getattr(attention, "qk_norm", None)
    return {
        "rotary_interleaved": attention.use_rope,
        "chunk": config.attention_chunk_size if chunked else None,
        "qk_norm": "head" if norm else None, "qk_norm_offset": 0.0 if norm else None,
        "qk_norm_eps": norm.eps if norm else None, "qk_norm_after_rope": bool(norm),
        "query_temperature": None if attention.use_rope or not attention.attn_temperature_tuning
        else temperature,
    }  # fmt: skip


def _gate(model_type, attention):
    """The output gate's settings: AFMoE's sigmoid, Laguna's softplus (per head or not)."""
    if model_type in ("afmoe", "beam"):
        return {"output_gate": "sigmoid", "output_gate_per_head": False}
    if model_type == "laguna":
        return {"output_gate": "softplus", "output_gate_per_head": attention.gate_per_head}
    return {}


def parameter(module):
    return module.detach().numpy() if hasattr(module, "detach") else module.weight.detach().numpy()


def expected_weights(attention, settings):
    """The layer's weights in mha's layout, from transformers' attention module itself."""
    names = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "dense": "o",
             "gate_proj": "g", "g_proj": "g",
             "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
             "kv_b_proj": "kv_b"}  # fmt: skip
    weights = {}
    for name, short in names.items():
        module = getattr(attention, name, None)
        if module is not None:
            weights[f"W_{short}"] = module.weight.detach().numpy().T
            if module.bias is not None:
                weights[f"b_{short}"] = module.bias.detach().numpy()
    if hasattr(attention, "qkv_proj"):  # Phi-3
        W = attention.qkv_proj.weight.detach().numpy().T
        q = settings["num_heads"] * settings["head_dim"]
        kv = settings["num_kv_heads"] * settings["head_dim"]
        weights |= {"W_q": W[:, :q], "W_k": W[:, q : q + kv], "W_v": W[:, q + kv :]}
    for name, ours in (("q_norm", "q_norm"), ("k_norm", "k_norm"), ("sinks", "sinks"),
                       ("query_layernorm", "q_norm"), ("key_layernorm", "k_norm"),
                       ("q_a_layernorm", "q_a_norm"), ("kv_a_layernorm", "kv_a_norm")):  # fmt: skip
        module = getattr(attention, name, None)
        if module is not None and not hasattr(module, "weight") and not hasattr(module, "detach"):
            weights[ours] = np.ones(settings["head_dim"])  # NanoChat's norm without weights
        elif module is not None:
            weights[ours] = parameter(module)
    if hasattr(attention, "gate_bias"):  # Beam's: one a head, over the head's features
        weights["b_g"] = np.repeat(parameter(attention.gate_bias), settings["head_dim"])
    if getattr(attention, "qk_norm", None) is not None:  # Llama 4's L2 norm, without weights
        weights |= {name: np.ones(settings["head_dim"]) for name in ("q_norm", "k_norm")}
    for role in "qk":  # LayerNorms: Phi's one, StableLM's one a head
        norm = getattr(attention, f"{role}_layernorm", None)
        if norm is not None and hasattr(norm, "norms"):
            weights[f"{role}_norm"] = np.stack([parameter(each) for each in norm.norms])
        elif norm is not None:
            weights[f"{role}_norm"] = parameter(norm)
            weights[f"{role}_norm_bias"] = norm.bias.detach().numpy()
    if getattr(attention, "indexer", None) is not None:  # sparse top-k attention's indexer
        indexer = attention.indexer
        weights |= {"W_index_q": indexer.wq_b.weight.detach().numpy().T,
                    "W_index_k": indexer.wk.weight.detach().numpy().T,
                    "index_k_norm": parameter(indexer.k_norm),
                    "b_index_k_norm": indexer.k_norm.bias.detach().numpy(),
                    "W_index_weights": indexer.weights_proj.weight.detach().numpy().T}  # fmt: skip
    if hasattr(attention, "q_gate_proj"):  # A.X-K2's: each head's query rows, then its gate's
        W = attention.q_gate_proj.weight.detach().numpy().T
        H, v = settings["num_heads"], settings["v_head_dim"]
        heads = W.reshape(W.shape[0], H, -1)
        weights["W_q_b"] = heads[..., :-v].reshape(W.shape[0], -1)
        weights["W_g"] = heads[..., -v:].reshape(W.shape[0], -1)
    if hasattr(attention, "k_rope_only_layernorm"):  # dots3's, its norms scaled as LongCat's
        weights["k_pe_norm"] = parameter(attention.k_rope_only_layernorm)
        weights["q_a_norm"] = weights["q_a_norm"] * attention.q_lora_scale
        weights["kv_a_norm"] = weights["kv_a_norm"] * attention.kv_lora_scale
    if hasattr(attention, "mla_scale_q_lora"):  # LongCat-Flash's, in the norms' weights
        weights["q_a_norm"] = weights["q_a_norm"] * attention.mla_scale_q_lora
        weights["kv_a_norm"] = weights["kv_a_norm"] * attention.mla_scale_kv_lora
    if hasattr(attention, "v_scale"):  # MiMo-V2-Flash's scale of the values, in W_v and b_v
        weights["W_v"] = weights["W_v"] * attention.v_scale
        weights["b_v"] = weights["b_v"] * attention.v_scale
    if type(attention).__name__ == "NanoChatAttention":  # its rotation by negated angles
        half = settings["head_dim"] // 2
        for name in [name for name in ("W_q", "W_k", "b_q", "b_k") if name in weights]:
            x = weights[name]
            weights[name] = x.reshape(*x.shape[:-1], -1, 2, half)[..., ::-1, :].reshape(x.shape)
    return weights


LAYERS_DIFFER = ("qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss", "ministral", "qwen2_moe",
                 "vaultgemma", "olmo3", "dots1", "cwm", "mellum")  # fmt: skip
"""The tiny models whose layers slide differently."""


OWN_ORACLES = ("mistral4", "bitnet", "hy_v4", "minimax_m3_vl_text")
"""Families whose settings this test's rebuild from transformers' modules does not cover
(Mistral 4's and HY-V4's modules name no head_dim, BitNet's output norm, MiniMax-M3's block
indexer): their layers are compared with transformers' output by test_pretrained.py and
their own files (test_temperature.py, test_outnorm.py, test_hyv4.py, test_blocksparse.py)."""


@pytest.mark.parametrize(
    "family", [family for family in models.LLAMA_LAYOUT if family not in OWN_ORACLES]
)
def test_each_layer_is_what_transformers_computes(family, transformers):
    """Settings against transformers' config and attention modules (their scaling, window,
    head width, rotary width, norms), weights against the modules' own, layer by layer."""
    model = models.transformers_model(family)
    config = model.config
    checkpoint = Checkpoint(models.saved(family))
    assert config.num_hidden_layers == len(models.attention_modules(model))
    seen = set()
    for index, attention in enumerate(models.attention_modules(model)):
        kind, settings, weights = layer_attention(checkpoint, index, dtype=np.float64)
        expected = expected_settings(config, index, attention)
        assert kind == ("latent" if family in models.LATENT_FAMILIES else "attention")
        if kind == "latent":
            assert settings.pop("output_gate_per_head", True) is True  # the default
            assert settings.pop("scale") == attention.scaling
            assert settings.pop("norm_eps") == attention.kv_a_layernorm.variance_epsilon
            if attention.q_a_layernorm is not None and family != "dots3_note_text":
                assert attention.q_a_layernorm.variance_epsilon == 1e-6 != config.rms_norm_eps
            elif family == "dots3_note_text":  # every norm's rms_norm_eps
                assert attention.q_a_layernorm.variance_epsilon == config.rms_norm_eps
        else:
            scale = settings["scale"] or settings["head_dim"] ** -0.5  # Helium's: 1 / sqrt(d)
            assert scale == pytest.approx(attention.scaling, rel=1e-15, abs=0)
            assert settings["head_dim"] == attention.head_dim
            if hasattr(attention, "sliding_window") and not hasattr(attention, "is_sliding"):
                assert settings["window"] == attention.sliding_window  # EXAONE 4's: is_sliding
            if settings["qk_norm"]:
                names = ("q_norm", "q_layernorm", "query_layernorm", "qk_norm")
                norm = next(getattr(attention, n) for n in names if hasattr(attention, n))
                norm = getattr(norm, "norms", [norm])[0]  # StableLM's: one a head
                assert settings["qk_norm_eps"] == getattr(norm, "eps", None) or getattr(
                    norm, "variance_epsilon", None
                )
            rotary = model.model.rotary_emb
            per_type = isinstance(rotary.rope_type, dict)  # Gemma 3, OLMo 3
            layer_type = (config.layer_types[index] + "_") if per_type else ""
            if settings["rope_theta"] is not None:
                width = 2 * getattr(rotary, f"{layer_type}inv_freq").numel()
                assert width == (settings["rotary_dim"] or settings["head_dim"])
        assert settings == expected, index
        wanted = expected_weights(attention, settings)
        assert sorted(weights) == sorted(wanted)
        for name, W in weights.items():
            assert W.dtype == np.float64 and np.array_equal(W, wanted[name]), (index, name)
        seen.add((settings.get("window"), settings["rope_theta"]))
    if family in LAYERS_DIFFER:
        assert len({window for window, _ in seen}) == 2, seen
    if family in ("gemma3", "olmo3", "mellum"):
        assert {theta for _, theta in seen} == {100.0, 3000.0}


def test_dtype_is_the_stored_one_unless_asked(transformers):
    checkpoint = Checkpoint(models.saved("gpt_oss"))
    stored = "float32" if importlib.util.find_spec("ml_dtypes") is None else "bfloat16"
    for dtype, name in ((None, stored), (np.float32, "float32"), (np.float64, "float64")):
        _, _, weights = layer_attention(checkpoint, 1, dtype=dtype)
        assert {W.dtype.name for W in weights.values()} == {name}
    assert weights["sinks"].shape == (4,) and weights["W_q"].shape == (48, 48)


@pytest.mark.parametrize("family", sorted({f for f in FAMILIES if f != "gemma3_text"} | {"gemma3"}))
def test_the_defaults_are_the_config_classes(family, transformers):
    """What a config.json may leave out: each family's defaults are its config class's."""
    name = "gemma3_text" if family == "gemma3" else family
    config_class = transformers.CONFIG_MAPPING[name]
    for key, value in FAMILIES[name].defaults.items():
        outer, _, inner = key.rpartition(".")  # MPT's attn_config.alibi: its sub-config's
        owner = config_class.sub_configs[outer] if outer else config_class
        if inner not in owner.__dataclass_fields__:  # a key the class lacks: absent, None
            assert value is None, (family, key)
            continue
        assert owner.__dataclass_fields__[inner].default == value, (family, key)
    rope = FAMILIES[name].rope
    if rope.per_layer_type:  # Gemma 3, OLMo 3, Mellum, ModernBERT: a base per layer type
        with models._quiet():
            parameters = config_class().rope_parameters
        for kind, (_, base) in rope.per_layer_type.items():
            assert parameters[kind]["rope_theta"] == base, (family, kind)
    else:
        assert config_class.default_theta == rope.theta


def variant(tmp_path, family, change=None, drop=()):
    """A copy of ``family``'s checkpoint whose config.json drops and changes some keys."""
    folder = shutil.copytree(models.saved(family), tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(change or {})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


LLAMA3 = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
LONGROPE = {"rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0, 1.5, 2.0, 1.2],
            "long_factor": [3.0, 5.0, 8.0, 13.0],
            "original_max_position_embeddings": 32}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "change", "drop"),
    [
        ("qwen2", {}, ("layer_types",)),  # from max_window_layers
        ("qwen2", {"use_sliding_window": False}, ()),  # its layer_types say sliding: no window
        ("qwen3", {"max_window_layers": 2}, ("layer_types",)),
        ("llama", {"rope_theta": 800.0, "rope_scaling": {"type": "llama3", **LLAMA3}},
         ("rope_parameters",)),  # the old keys
        ("gemma3", {"rope_theta": 3000.0, "rope_local_base_freq": 100.0,
                    "sliding_window_pattern": 2}, ("rope_parameters", "layer_types")),
        ("gemma3", {"rope_theta": 3000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
         ("rope_parameters",)),
        ("gemma2", {}, ("layer_types", "query_pre_attn_scalar", "attn_logit_softcapping")),
        ("mistral", {}, ("sliding_window",)),
        ("phi3", {"rope_parameters": LONGROPE, "partial_rotary_factor": 2 / 3}, ()),
        ("gpt_oss", {}, ("rope_parameters", "layer_types")),
        ("deepseek_v3", {"rope_theta": 800.0}, ("rope_parameters",)),
        ("deepseek_v3_mha", {}, ("rope_interleave",)),
        ("ministral", {}, ("layer_types",)),  # every layer sliding
        ("ministral", {"sliding_window": None}, ("layer_types",)),  # none
        ("mixtral", {}, ("sliding_window", "rope_parameters")),  # no window, theta 1e6
        ("arcee", {}, ("rope_parameters",)),
        ("qwen3_moe", {"use_sliding_window": False}, ()),  # no window
        ("qwen3_moe", {}, ("rope_parameters", "rms_norm_eps")),
        ("qwen2_moe", {}, ("layer_types",)),  # every other layer below max_window_layers
        ("qwen2_moe", {"max_window_layers": 3}, ("layer_types", "sliding_window")),
        ("dots1", {}, ("layer_types",)),  # from max_window_layers
        ("dots1", {"sliding_window": None}, ("layer_types",)),  # none
        ("vaultgemma", {}, ("layer_types", "query_pre_attn_scalar", "attn_logit_softcapping")),
        ("olmo3", {}, ("layer_types", "rope_parameters")),  # every fourth layer full, base 5e5
        ("olmo3", {"rope_theta": 800.0}, ("rope_parameters",)),  # the full layers' base only
        ("olmo3", {"rope_parameters": {"rope_type": "default", "rope_theta": 800.0}}, ()),
        ("flex_olmo", {}, ("rope_parameters",)),
        ("phimoe", {}, ("rope_parameters", "sliding_window")),
        ("helium", {}, ("rope_parameters",)),
        ("solar_open", {}, ("rope_parameters",)),
        ("apertus", {}, ("rope_parameters",)),  # llama3 scaling by default
        ("starcoder2", {}, ("sliding_window",)),
        ("granite", {}, ("attention_multiplier",)),
        ("ministral3", {}, ("sliding_window",)),
        ("glm4_moe_lite", {}, ("rope_interleave",)),
        ("youtu", {"rope_theta": 800.0}, ("rope_parameters",)),
        ("exaone", {"num_layers": 3}, ("num_hidden_layers",)),  # EXAONE 3's own key
        # a family's own name of a key (its attribute_map) wins over the common one
        ("internlm3", {"qkv_bias": True, "attention_bias": False, "bias": True}, ()),
        ("glm4_moe_lite", {"head_dim": 8, "qk_rope_head_dim": 4}, ()),
        ("cwm", {}, ("layer_types", "rope_parameters")),  # layers 0, 4... full; llama3
        ("apertus1p5_text", {}, ("rope_parameters",)),
        ("hy_v3", {}, ("rope_parameters",)),
        ("ernie4_5_moe", {}, ("rope_parameters",)),
        ("mellum", {}, ("rope_parameters", "layer_types")),  # full layers, 5e5 and 1e4
        # layers without rope by default: every 4th (SmolLM3, none of 3; of every 3rd, the
        # last, which slides), the full ones (Cohere 2, EXAONE 4: every 4th, or 3rd;
        # Cohere 2 MoE: the dense layers rotate)
        ("smollm3", {}, ("no_rope_layers", "layer_types")),
        ("smollm3", {"no_rope_layer_interval": 3}, ("no_rope_layers", "layer_types")),
        ("cohere2", {}, ("layer_types",)),
        ("cohere2", {"sliding_window_pattern": 3}, ("layer_types",)),
        ("cohere2_moe", {"first_k_dense_replace": 2}, ("layer_types", "mlp_layer_types")),
        ("cohere2_moe", {"prefix_dense_sliding_window_pattern": 2}, ("layer_types",)),
        ("exaone4", {"sliding_window_pattern": 3}, ("layer_types",)),
        ("exaone4", {"sliding_window": None}, ()),
        # the fraction: the class's default, rotary_dim (MiniMax-M2), a top-level one
        ("glm", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, ()),
        ("glm4_moe", {}, ("rope_parameters",)),
        ("minimax_m2", {"rope_parameters": {"rope_type": "default"}, "rotary_dim": 6}, ()),
        ("minimax_m2", {"use_qk_norm": True, "qk_norm_type": "per_layer"}, ()),  # ignored
        ("nemotron", {"rope_parameters": None, "partial_rotary_factor": 1.0}, ()),
        ("stablelm", {}, ("rope_parameters",)),
        ("stablelm", {"head_dim": 8}, ()),  # hidden_size // heads all the same
        ("phi", {"rope_parameters": {"rope_theta": 500.0, "partial_rotary_factor": 1 / 3}}, ()),
    ],
)  # fmt: skip
def test_configs_are_read_as_transformers_reads_them(tmp_path, family, change, drop, transformers):
    """Old and incomplete config.json files: transformers' AutoConfig is the oracle."""
    folder = variant(tmp_path, family, change, drop)
    with models._quiet():
        config = transformers.AutoConfig.from_pretrained(folder)
    checkpoint = Checkpoint(folder)
    layers = None  # the attention modules, for which layers rotate and which pairs
    if not family.startswith("deepseek"):
        with models._quiet():
            layers = transformers.AutoModelForCausalLM.from_config(config).model.layers
    for index in range(config.num_hidden_layers):
        _, settings, _ = layer_attention(checkpoint, index)
        expected = expected_settings(config, index, layers and layers[index].self_attn)
        if family in models.LATENT_FAMILIES:
            settings.pop("scale"), settings.pop("norm_eps")
        assert settings == expected, (index, settings, expected)


@pytest.mark.parametrize(
    ("family", "change", "drop"),
    [
        ("granitemoehybrid", {"layers_block_type": ["mamba", "attention", "attention"]},
         ("layer_types",)),  # the older names
        ("granitemoehybrid", {}, ("layer_types",)),  # every layer Mamba by default
        ("jamba", {"attn_layer_period": 3, "attn_layer_offset": 2}, ()),
        ("jamba", {}, ("attn_layer_period", "attn_layer_offset")),
        ("nemotron_h", {"hybrid_override_pattern": "M*-"}, ("layers_block_type",)),
        ("nemotron_h", {"layers_block_type": ["moe", "full_attention", "mlp", "full_attention"],
                        "num_hidden_layers": 3}, ()),  # the types count the layers
        ("nemotron_h", {}, ("layers_block_type",)),  # four layers by default
        ("bamba", {"attn_layer_indices": [1]}, ()),
        ("bamba", {}, ("attn_layer_indices",)),  # every layer Mamba
        ("lfm2", {"full_attn_idxs": [1]}, ("layer_types",)),
        ("lfm2", {}, ("layer_types", "full_attn_idxs")),  # every layer attention
        ("minimax", {}, ("layer_types",)),  # every other layer from 0
        ("olmo_hybrid", {}, ("layer_types",)),  # every fourth, else the last
        ("falcon_h1", {}, ()),  # every layer's attention beside its Mamba mixer
        ("qwen3_next", {"full_attention_interval": 2}, ("layer_types",)),
        ("qwen3_5_text", {"full_attention_interval": 1}, ("layer_types",)),
        ("qwen3_5_moe_text", {}, ("layer_types",)),  # every fourth: none of 3
        ("lfm3", {"num_hidden_layers": 5}, ("layer_types",)),  # convolutions, full at 2
        ("bailing_hybrid", {"layer_group_size": 3}, ("layer_types",)),
        ("bailing_hybrid", {"layer_group_size": 1}, ("layer_types",)),
    ],
)  # fmt: skip
def test_a_hybrids_attention_layers_are_transformers_own(
    tmp_path, family, change, drop, transformers
):
    """Which layers of a hybrid are attention, from each family's own config keys (their
    older forms and the classes' defaults): transformers' config's ``layer_types`` is the
    oracle. Every other layer is refused by its index."""
    folder = variant(tmp_path, family, change, drop)
    with models._quiet():
        config = transformers.AutoConfig.from_pretrained(folder)
    expected = [i for i, kind in enumerate(config.layer_types) if kind in ATTENTION_TYPES]
    assert mha.attention_layers(folder) == expected
    for index in sorted(set(range(config.num_hidden_layers)) - set(expected)):
        with pytest.raises(AttentionValueError, match=f"layer {index} of this .* checkpoint is"):
            layer_attention(Checkpoint(folder), index)


@pytest.mark.parametrize(
    ("family", "change", "said"),
    [
        ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 2},
         "attn_layer_offset=2; an integer from 0 to attn_layer_period - 1 = 1 is needed"),
        ("nemotron_h", {"layers_block_type": "M*-"}, "layers_block_type must list the type"),
        ("nemotron_h", {"layers_block_type": None, "hybrid_override_pattern": "M*X"},
         "hybrid_override_pattern must be a string of M"),
        ("bamba", {"attn_layer_indices": "0,2"}, "attn_layer_indices must list layer indices"),
        ("granitemoehybrid", {"layer_types": ["attention", "mamba"]},
         r"gives 2 layer types \(\['full_attention', 'linear_attention'\]\) for its 3 layers"),
    ],
)  # fmt: skip
def test_a_hybrids_malformed_layer_types_are_refused(tmp_path, family, change, said, transformers):
    """A config whose keys do not say which layers are attention is refused, naming them."""
    folder = variant(tmp_path, family, change, ())
    with pytest.raises(AttentionValueError, match=said) as error:
        mha.attention_layers(folder)
    assert str(folder) in str(error.value)


def test_deepseeks_scale_takes_the_yarn_mscale(tmp_path, transformers):
    _, settings, _ = layer_attention(Checkpoint(models.saved("deepseek_v3")), 0)
    mscale = 0.1 * 0.8 * np.log(4.0) + 1.0
    assert settings["scale"] == pytest.approx(16**-0.5 * mscale**2, rel=1e-15)
    folder = variant(tmp_path, "deepseek_v3", drop=("rope_parameters",))
    assert layer_attention(Checkpoint(folder), 0)[1]["scale"] == 16**-0.5


def test_granites_scale_is_its_attention_multiplier(tmp_path, transformers):
    """Granite's and HyperCLOVA X's ``attention_multiplier`` is the scale; HyperCLOVA X's
    null one is the head width's, as its config class makes it."""
    assert layer_attention(Checkpoint(models.saved("granitemoe")), 0)[1]["scale"] == 0.3
    folder = variant(tmp_path, "hyperclovax", {"attention_multiplier": None})
    with models._quiet():
        config = transformers.AutoConfig.from_pretrained(folder)
    assert config.attention_multiplier == 12**-0.5
    assert layer_attention(Checkpoint(folder), 0)[1]["scale"] is None


def test_gemma3_keeps_no_softcap_as_its_attention_does(tmp_path, transformers):
    """Gemma 3's config has attn_logit_softcapping, but its attention never passes it on."""
    folder = variant(tmp_path, "gemma3", {"attn_logit_softcapping": 3.0})
    assert layer_attention(Checkpoint(folder), 0)[1]["softcap"] is None
    folder = variant(tmp_path / "2", "gemma2", {"attn_logit_softcapping": None})
    assert layer_attention(Checkpoint(folder), 0)[1]["softcap"] is None


# ---------------------------------------------------------------- layer_attention's refusals


@pytest.mark.parametrize(
    ("family", "change", "said"),
    [
        ("llama", {"model_type": "made_up"}, "model_type 'made_up': it is not supported; the "
         "model types mha reads are llama, mistral, qwen2, qwen3, gemma2, gemma3_text, olmo2"),
        ("llama", {"model_type": "bert"}, "model_type 'bert': an encoder run as a decoder"),
        ("llama", {"model_type": "qwen3_next"},
         "layer 0 of this Qwen3-Next checkpoint is a Gated DeltaNet linear-attention layer"),
        ("llama", {"model_type": None}, "config.json names no model_type"),
        ("llama4_text", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
         "llama4_text with layer_types=['full_attention', 'sliding_attention', 'full_attention'] "
         "(transformers' Llama 4 masks one full_attention or chunked_attention layer type"),
        ("ministral3", {"rope_parameters": {"rope_type": "default", "llama_4_scaling_beta": None}},
         "ministral3 with rope_parameters without llama_4_scaling_beta"),
        ("qwen2", {"model_type": "qwen2_vl"}, "multimodal rope (mrope)"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("gemma3", {"use_bidirectional_attention": True}, "gemma3_text with use_bidirectional"),
        ("qwen2", {"layer_types": ["full_attention"] * 3 + ["chunked_attention"]},
         "layer 3 of type 'chunked_attention'"),
        ("qwen2", {"layer_types": ["full_attention"]}, "one type for each of its 4 layers"),
        ("qwen2", {"layer_types": ["full_attention"] * 3 + ["linear_attention"]},
         "layer 3 of type 'linear_attention': linear attention or a state-space mixer"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5, which "
         "transformers' llama attention ignores or cannot apply"),
        ("llama", {"sliding_window": 8}, "sliding_window=8, which transformers' llama mask"),
        ("mistral", {"attention_chunk_size": 8}, "attention_chunk_size=8"),
        ("qwen3", {"use_qk_norm": True}, "use_qk_norm=True"),
        ("qwen2", {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 2]}},
         "a multimodal rope (mrope_section=[2, 2, 2])"),
        ("deepseek_v3", {"q_lora_rank": 0}, "q_lora_rank=0; a positive integer or null is needed"),
        ("llama", {"hidden_size": "48"}, "hidden_size='48'; a positive integer is needed"),
        ("llama", {"rope_parameters": [1]}, "rope_parameters must be a JSON object"),
        # the rope's own checks name the checkpoint and the config key, not "rope_scaling"
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": -1.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
         "rope_parameters['factor'] must be a number >= 1.0"),
        ("llama", {"rope_parameters": {"rope_type": "weird"}},
         "'weird' is not supported: use one of"),
        ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                             "beta_fast": 1.0, "beta_slow": 8.0}},
         "rope_parameters['beta_fast'] must be at least rope_parameters['beta_slow']"),
        ("gpt_oss", {"rope_parameters": None, "rope_scaling": {"rope_type": "linear"}},
         "rope_scaling needs the key 'factor' for rope_type 'linear' ("),
        ("mpt", {"attn_config": {"clip_qkv": -2.0}}, "mpt with attn_config.clip_qkv=-2.0 (the "
         "projections clamped to a bound that is not a positive number)"),
        ("mpt", {"attn_config": {"alibi_bias_max": 16}}, "attn_config.alibi_bias_max=16 (ALiBi "
         "slopes of another alibi_bias_max, which transformers' MPT ignores (it takes 8))"),
        ("mpt", {"attn_config": {"alibi": False}},
         "attn_config.alibi=False (no ALiBi, which transformers' MPT applies all the same)"),
        ("gptj", {"rotary_dim": None}, "gptj with rotary_dim=None, whose rotary embedding is "
         "as wide as hidden_size=48, not a head's 12 features"),
        ("codegen", {"rotary_dim": 0}, "config.json has rotary_dim=0; a positive integer"),
        ("codegen", {"n_embd": 30, "n_head": 3},
         "codegen with 3 heads of 10 features, which its qkv_proj cannot split"),
        ("gpt2", {"n_head": 5}, "gpt2 with n_embd=48 not a multiple of n_head=5"),
        ("falcon_alibi", {"num_attention_heads": 12, "max_position_embeddings": 64},
         "num_attention_heads=12 and max_position_embeddings=64 (Falcon's ALiBi, which "
         "transformers computes in bfloat16, rounded unless every slope is a power of two"),
        ("falcon_alibi", {"max_position_embeddings": 2048}, "max_position_embeddings=2048"),
        ("modernbert-decoder", {"local_attention": None, "sliding_window": -1,
                                "layer_types": ["sliding_attention"] * 3},
         "local_attention=None and sliding_window=-1 (a sliding window of -1 positions)"),
        ("gpt_neo", {"attention_types": [["local", 3]], "attention_layers": None},
         "attention_types must list"),
        ("olmo", {"clip_qkv": "8"}, "olmo with clip_qkv='8' (the projections clamped to a"),
        ("olmoe", {"clip_qkv": 0}, "olmoe with clip_qkv=0 (the projections clamped to a bound"),
        ("gemma", {"use_bidirectional_attention": True}, "gemma with use_bidirectional_attention"),
        ("ministral3", {"rope_parameters": {"rope_type": "default", "llama_4_scaling_beta": 0.5}},
         "rope_parameters['llama_4_scaling_beta']=0.5 and original_max_position_embeddings=None"),
        ("phimoe", {"rope_parameters": LONGROPE}, "phimoe with rope_type 'longrope', which "
         "transformers' phimoe rotary embedding scales by its own factors"),
        ("mellum", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
         "mellum with rope_scaling={'rope_type': 'linear', 'factor': 2.0} (an old rope_scaling"),
        ("mellum", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 3000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0,
                                  "partial_rotary_factor": 0.5}}},
         "partial_rotary_factor=0.5, which transformers' mellum attention ignores or cannot"),
        ("qwen2_moe", {"use_sliding_window": False}, "qwen2_moe with a sliding layer in "
         "layer_types but use_sliding_window=False (a window of 0)"),
    ],
)  # fmt: skip
def test_configs_mha_would_compute_differently_are_refused(tmp_path, family, change, said,
                                                           transformers):  # fmt: skip
    checkpoint = Checkpoint(variant(tmp_path, family, change))
    with pytest.raises(AttentionValueError) as error:
        layer_attention(checkpoint, 0 if "layer 3" not in said else 3)
    refused(error, checkpoint.path, said, kind=AttentionValueError)


def test_layers_out_of_range_are_refused(transformers):
    checkpoint = Checkpoint(models.saved("qwen2"))
    for layer in (4, -1):
        with pytest.raises(AttentionValueError) as error:
            layer_attention(checkpoint, layer)
        refused(error, f"layer={layer} is out of range", "has 4 layers, 0 to 3",
                kind=AttentionValueError)  # fmt: skip
    for layer in (1.0, True, "1"):
        with pytest.raises(AttentionTypeError) as error:
            layer_attention(checkpoint, layer)
        refused(error, "layer must be an integer", kind=AttentionTypeError)
    assert layer_attention(checkpoint, np.int64(3))[1]["window"] == 5


def rewritten(tmp_path, family, drop=(), add=None, config=None):
    """``family``'s checkpoint in one file, some tensors dropped or added (torch tensors)."""
    import torch
    from safetensors.torch import load_file, save_file

    source = models.saved(family)
    tensors = {}
    for shard in sorted(source.glob("model-*.safetensors")):
        tensors |= load_file(str(shard))
    for name in drop:
        del tensors[name]
    tensors |= {name: torch.as_tensor(value) for name, value in (add or {}).items()}
    folder = tmp_path / family
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    settings = json.loads((source / "config.json").read_text()) | (config or {})
    (folder / "config.json").write_text(json.dumps(settings))
    return Checkpoint(folder)


ATTN = "model.layers.0.self_attn."


@pytest.mark.parametrize(
    ("family", "drop", "add", "config", "said"),
    [
        ("qwen3", (), {f"{ATTN}lora_A.weight": np.zeros((2, 48), np.float32)}, None,
         "has weights that qwen3's attention with this config"),
        ("qwen3", (f"{ATTN}q_norm.weight",), None, None, "lacks q_norm.weight, which qwen3's"),
        ("llama", (), None, {"attention_bias": False},
         "does not have: k_proj.bias, o_proj.bias, q_proj.bias, v_proj.bias"),
        ("qwen2", (f"{ATTN}k_proj.weight",), {f"{ATTN}k_proj.weight": np.zeros((12, 48))}, None,
         "model.layers.0.self_attn.k_proj.weight has shape (12, 48), but the config"),
        ("deepseek_v3", (), None, {"q_lora_rank": None},
         "does not have: q_a_layernorm.weight, q_a_proj.weight, q_b_proj.weight"),
        ("deepseek_v3", (f"{ATTN}kv_a_layernorm.weight",), None, None,
         "lacks kv_a_layernorm.weight, which deepseek_v3's attention"),
        ("llama", tuple(f"{ATTN}{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")), None,
         None, "no attention weights of layer 0 under model.layers.0.self_attn. or layers.0."),
    ],
)  # fmt: skip
def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, family, drop, add, config,
                                                        said, transformers):  # fmt: skip
    checkpoint = rewritten(tmp_path, family, drop, add, config)
    with pytest.raises(WeightsFileError) as error:
        layer_attention(checkpoint, 0)
    refused(error, checkpoint.path, said)


def test_older_checkpoints_rotary_buffer_is_not_read(tmp_path, transformers):
    inv_freq = {f"{ATTN}rotary_emb.inv_freq": np.ones(6, np.float32)}
    checkpoint = rewritten(tmp_path, "llama", add=inv_freq)
    _, _, weights = layer_attention(checkpoint, 0)
    assert sorted(weights) == ["W_k", "W_o", "W_q", "W_v", "b_k", "b_o", "b_q", "b_v"]


@pytest.mark.parametrize(("family", "prefix"), [("mistral", "model."), ("gpt2", "transformer."),
                                              ("opt", "model.")])  # fmt: skip
def test_a_bare_models_checkpoint_is_read_too(tmp_path, family, prefix, transformers):
    """A bare model's weights (``LlamaModel``'s, ``GPT2Model``'s, ``OPTModel``'s), without
    the first name of a causal LM's (``model.``, ``transformer.``)."""
    import torch
    from safetensors.torch import save_file

    source = Checkpoint(models.saved(family))
    tensors = {name.removeprefix(prefix): torch.as_tensor(array.astype(np.float32))
               for name, array in source.read(source.keys()).items()}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(source.config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _, settings, weights = layer_attention(Checkpoint(tmp_path), 2)
    _, expected, expected_weights_ = layer_attention(source, 2, dtype=np.float32)
    assert settings == expected and all(
        np.array_equal(W, expected_weights_[name]) for name, W in weights.items()
    )
