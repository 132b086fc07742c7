"""Memory-mapped safetensors reading: find a checkpoint's files, check their headers, read tensor by tensor.

A checkpoint directory holds either `model.safetensors.index.json` (tensor -> shard file) or one or more
`*.safetensors` files. Pickle formats are refused: unpickling can run arbitrary code.
"""

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepinfer_core.weights.errors import CheckpointNotFound, CorruptCheckpoint, UnsafeCheckpointFormat

__all__ = [
    "INDEX_FILE",
    "PICKLE_SUFFIXES",
    "StoredTensor",
    "checkpoint_shards",
    "open_shard",
    "read_header",
]

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A header beyond this size is garbage, not a real index of tensors (the release's largest is ~100 KB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor's entry in a safetensors header."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def checkpoint_shards(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointNotFound(f"checkpoint directory {directory} does not exist")
    index = directory / INDEX_FILE
    if index.is_file():
        return _shards_from_index(index)
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UnsafeCheckpointFormat(
            f"{directory} holds only pickle weight files ({', '.join(pickles)}); DeepInfer loads safetensors only, "
            "because unpickling can run arbitrary code. Convert the checkpoint to safetensors first."
        )
    raise CheckpointNotFound(f"no {INDEX_FILE} and no *.safetensors file in {directory}")


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CorruptCheckpoint(f"{index} is not a safetensors index with a `weight_map`: {err}") from err
    files = sorted(set(weight_map.values()))
    pickles = [f for f in files if Path(f).suffix in PICKLE_SUFFIXES]
    if pickles:
        raise UnsafeCheckpointFormat(
            f"{index} points at pickle files ({', '.join(pickles)}); DeepInfer loads safetensors only"
        )
    shards = [index.parent / f for f in files]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointNotFound(f"{index} lists shard(s) that are not in {index.parent}: {', '.join(missing)}")
    return shards


def read_header(path: Path) -> list[StoredTensor]:
    """Names, dtypes and shapes in a safetensors file, checked against the file's size (data not read)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CorruptCheckpoint(f"{path} is {size} bytes long, too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CorruptCheckpoint(f"{path}: header length {header_len} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CorruptCheckpoint(f"{path}: safetensors header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{path}: safetensors header is not a JSON object")
    data_bytes = size - 8 - header_len
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            end = int(entry["data_offsets"][1])
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise CorruptCheckpoint(f"{path}: header entry of tensor `{name}` is malformed: {entry!r}") from err
        if end > data_bytes:
            raise CorruptCheckpoint(
                f"{path} is truncated: tensor `{name}` ends at data byte {end}, the file holds {data_bytes}"
            )
        tensors.append(StoredTensor(name, path, dtype, shape))
    return tensors


@contextmanager
def open_shard(path: Path) -> Iterator:
    """A memory-mapped safetensors handle (`get_tensor`, `get_slice`); parse errors name the file."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as err:
        raise CorruptCheckpoint(f"{path} cannot be read as safetensors: {err}") from err
