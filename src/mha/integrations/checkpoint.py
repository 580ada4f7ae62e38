"""A transformers checkpoint folder, as ``save_pretrained`` writes it: ``config.json`` and
the weights in ``model.safetensors``, or in shards listed by ``model.safetensors.index.json``.

The safetensors format is read here rather than through the ``safetensors`` package: its
NumPy loader refuses bfloat16, the dtype most checkpoints are published in (``TypeError:
data type 'bfloat16' not understood`` from ``safetensors.numpy.load_file`` and from
``safe_open(..., framework="np")``, with safetensors 0.8 and ml_dtypes installed alike). The
format is small: an 8-byte little-endian header length, a JSON header giving each tensor's
``dtype``, ``shape`` and ``data_offsets``, then the bytes. Only the tensors asked for are read,
each from its offset, so one layer of a large model costs that layer's bytes; a shard that
holds none of them is never opened.

bfloat16 comes back as ``ml_dtypes.bfloat16`` when ml_dtypes is installed, and otherwise as
float32, exactly (a bfloat16 is the top half of a float32). ``dtype=`` casts after reading.

>>> import json, os, struct, tempfile, numpy as np
>>> folder = tempfile.mkdtemp()
>>> header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
>>> with open(os.path.join(folder, "model.safetensors"), "wb") as handle:
...     _ = handle.write(struct.pack("<Q", len(header)) + header)
...     _ = handle.write(np.array([1.5, -2.0], "<f4").tobytes())
>>> with open(os.path.join(folder, "config.json"), "w") as handle:
...     _ = handle.write('{"model_type": "llama"}')
>>> checkpoint = Checkpoint(folder)
>>> checkpoint.config["model_type"], checkpoint.keys()
('llama', ['w'])
>>> checkpoint.read(["w"], dtype=np.float64)["w"]
array([ 1.5, -2. ])
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .._arrays import bfloat16_from_bits
from ..errors import AttentionTypeError, WeightsFileError
from .sources import TensorNames

__all__ = ["DTYPES", "Checkpoint", "open_checkpoint"]

DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "u1",
}
"""The safetensors dtypes read, and the NumPy dtype of their bytes (bfloat16: raw 16 bits)."""

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
LARGEST_HEADER = 100_000_000  # the safetensors package's own limit


def open_checkpoint(path: Any) -> Any:
    """The checkpoint at ``path``: a :class:`Checkpoint` folder, or a llama.cpp GGUF file
    (:class:`~mha.integrations.gguf_file.GGUFFile`, the same keys and tensor names)."""
    from .gguf_file import is_gguf, open_gguf

    return open_gguf(path) if is_gguf(path) else Checkpoint(path)


class Checkpoint(TensorNames):
    """The config and the safetensors weights of a transformers ``save_pretrained`` folder.

    ``config`` is ``config.json`` as a dict; :meth:`keys` names the tensors (from the index
    alone when the weights are sharded); :meth:`read` reads the named tensors and no others.
    A folder without ``config.json`` or without weights, an index naming a shard that is not
    there, and a damaged header are refused with the file's name.
    """

    def __init__(self, path: Any) -> None:
        self.path = Path(os.fspath(path))
        if not self.path.is_dir():
            state = "is a file, not" if self.path.exists() else "does not exist; it should be"
            raise WeightsFileError(
                f"{self.path} {state} a folder written by save_pretrained (config.json and "
                f"{SINGLE} or {INDEX})"
            )
        self.config: dict[str, Any] = _json(self.path / CONFIG, "the model's config")
        if not isinstance(self.config, dict):
            raise WeightsFileError(f"{self.path / CONFIG} holds no JSON object")
        self._headers: dict[Path, tuple[int, dict[str, dict[str, Any]]]] = {}
        self._shards = self._weight_map()

    def _weight_map(self) -> dict[str, Path]:
        """Each tensor's file: the index's ``weight_map``, or every tensor of the single file."""
        index = self.path / INDEX
        if index.is_file():
            contents = _json(index, "the index of the weights' shards")
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) and isinstance(shard, str)
                for name, shard in weight_map.items()
            ):
                raise WeightsFileError(f"{index} has no weight_map of tensor names to shard files")
            shards = {name: self.path / shard for name, shard in weight_map.items()}
            first = {shard: name for name, shard in reversed(shards.items())}
            for shard, name in first.items():
                if not shard.is_file():
                    raise WeightsFileError(
                        f"{index} lists the shard {shard.name}, which is not in {self.path} "
                        f"(it should hold {name}): download it again"
                    )
            return shards
        single = self.path / SINGLE
        if single.is_file():
            return dict.fromkeys(self._header(single)[1], single)
        raise WeightsFileError(
            f"{self.path} has neither {SINGLE} nor {INDEX}: is it a save_pretrained folder "
            "of safetensors weights? (PyTorch .bin weights are not read)"
        )

    def _where(self) -> dict[str, Path]:
        return self._shards  # each tensor's shard

    def __repr__(self) -> str:
        files = len(set(self._shards.values()))
        return (
            f"Checkpoint({str(self.path)!r}: {self.config.get('model_type', 'no model_type')}, "
            f"{len(self._shards)} tensors in {files} file{'s' if files != 1 else ''})"
        )

    def read(self, names: Iterable[str], dtype: Any = None) -> dict[str, np.ndarray]:
        """The tensors ``names`` as NumPy arrays, read from their files' offsets; no other
        tensor is read and no other shard is opened. ``dtype`` (float32, float64, ...) casts
        them; without it each keeps its stored dtype (bfloat16 as ``ml_dtypes.bfloat16``, or
        float32 without ml_dtypes). A name the checkpoint lacks is refused with the prefixes
        it does hold."""
        wanted = list(names)
        missing = [name for name in wanted if name not in self._shards]
        if missing:
            raise WeightsFileError(
                f"{self.path} has no tensor {missing[0]!r}"
                f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                f"it holds {len(self._shards)} tensors under {tensor_prefixes(self._shards)}"
            )
        target = None if dtype is None else _dtype(dtype)
        arrays = {}
        by_shard: dict[Path, list[str]] = {}
        for name in wanted:
            by_shard.setdefault(self._shards[name], []).append(name)
        for shard, shard_names in by_shard.items():
            length, header = self._header(shard)
            start = 8 + length
            with open(shard, "rb") as handle:
                for name in shard_names:
                    if name not in header:
                        raise WeightsFileError(
                            f"{shard} does not hold {name!r}, which the index says it does"
                        )
                    arrays[name] = _tensor(handle, shard, name, header[name], start, target)
        return arrays

    def _header(self, shard: Path) -> tuple[int, dict[str, dict[str, Any]]]:
        """The header's length and the tensors of ``shard`` by name, each entry checked
        (read once, then kept)."""
        if shard not in self._headers:
            self._headers[shard] = _read_header(shard)
        return self._headers[shard]


def _read_header(shard: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """A safetensors file's header length and header: each tensor's dtype, shape and byte
    range, checked against each other and against the file's size."""
    size = shard.stat().st_size
    with open(shard, "rb") as handle:
        start = handle.read(8)
        if len(start) < 8:
            raise WeightsFileError(f"{shard} is not a safetensors file: it has {size} bytes")
        (length,) = struct.unpack("<Q", start)
        if length > min(size - 8, LARGEST_HEADER):
            raise WeightsFileError(
                f"{shard} is not a safetensors file, or is truncated: its header length "
                f"{length} exceeds the {size - 8} bytes after it"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WeightsFileError(f"{shard} has a damaged header ({error})") from None
    if not isinstance(header, dict):
        raise WeightsFileError(f"{shard} has a damaged header (not a JSON object)")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for name, entry in header.items():
        problem = _entry_problem(entry, data)
        if problem:
            raise WeightsFileError(f"{shard} has a damaged header: tensor {name!r} {problem}")
    return length, header


def _entry_problem(entry: Any, data: int) -> str | None:
    """What is wrong with one tensor's header entry, or ``None``."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        return "lacks its dtype, shape or data_offsets"
    shape, offsets, kind = entry["shape"], entry["data_offsets"], entry["dtype"]
    if not isinstance(kind, str):
        return f"has dtype {kind!r}"
    if not (isinstance(shape, list) and all(_count(n) for n in shape)):
        return f"has shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(n) for n in offsets)):
        return f"has data_offsets {offsets!r}"
    begin, end = offsets
    if not begin <= end <= data:
        return f"has data_offsets {offsets} outside the {data} bytes of data"
    if kind in DTYPES and end - begin != np.dtype(DTYPES[kind]).itemsize * _product(shape):
        return f"has {end - begin} bytes for shape {shape} of {kind}"
    return None


def _tensor(
    handle: Any, shard: Path, name: str, entry: dict[str, Any], start: int, target: Any
) -> np.ndarray:
    """One tensor's bytes, from its offset in the open ``shard``, as an array."""
    kind = entry["dtype"]
    if kind not in DTYPES:
        raise WeightsFileError(
            f"{shard}: tensor {name!r} has dtype {kind}, which mha does not read "
            f"(it reads {', '.join(DTYPES)})"
        )
    stored = np.dtype(DTYPES[kind])
    count = _product(entry["shape"])
    handle.seek(start + entry["data_offsets"][0])
    raw = np.fromfile(handle, dtype=stored, count=count) if count else np.empty(0, stored)
    if raw.size != count:
        raise WeightsFileError(f"{shard} is truncated: tensor {name!r} is cut short")
    raw = raw.reshape(entry["shape"])
    array: np.ndarray
    if kind == "BOOL":
        array = raw != 0
    elif kind == "BF16":
        array = bfloat16_from_bits(raw, float32=target is not None)  # float32 on the way to a cast
    else:
        array = raw.astype(stored.newbyteorder("="), copy=False)
    return array if target is None else array.astype(target, copy=False)


def _dtype(dtype: Any) -> np.dtype:
    try:
        target: np.dtype = np.dtype(dtype)
    except TypeError:
        raise AttentionTypeError(
            f"dtype must be a NumPy dtype such as float32; got {dtype!r}"
        ) from None
    return target


def _json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise WeightsFileError(f"{path.parent} has no {path.name} ({what})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WeightsFileError(f"{path} is not valid JSON ({error})") from None


def tensor_prefixes(names: Iterable[str]) -> str:
    """The prefixes that ``names`` fall under, layers as ranges: ``model.layers.{0..31}.``."""
    layers: dict[str, set[int]] = {}
    others: set[str] = set()
    for name in names:
        match = re.match(r"(.*?layers\.)(\d+)\.", name)
        if match:
            layers.setdefault(match.group(1), set()).add(int(match.group(2)))
        else:
            others.add(name.rsplit(".", 1)[0] + "." if "." in name else name)
    said = [
        f"{head}{low}." if low == high else f"{head}{{{low}..{high}}}."
        for head, (low, high) in sorted((head, (min(n), max(n))) for head, n in layers.items())
    ]
    return ", ".join(said + sorted(others)[: max(0, 8 - len(said))])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _product(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
