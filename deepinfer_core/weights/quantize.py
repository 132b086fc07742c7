"""Turn a float checkpoint (either naming scheme) into the official fp8 / fp4 release layout (MODEL_SPEC §8).

- fp8 e4m3 with 128 x 128 ue8m0 block scales: the attention projections (wq_a, wq_b, wkv, wo_a, wo_b),
  the indexer's wq_b, the shared experts and the MTP blocks' e_proj / h_proj;
- routed experts: fp4 (e2m1 packed in int8, scales per 32 columns) or fp8 like the above;
- float32: hyper-connection tensors, attention sinks, compressor position biases (`ape`), routing bias;
- tid2eid stays int64; everything else (embeddings, head, norms, compressor and gate projections) bf16.
Each quantised `X.weight` gets its companion `X.scale`.
"""

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from deepinfer_core.quantization import FP8_BLOCK, QuantizationFormatError, quantize_fp4, quantize_fp8_block
from deepinfer_core.weights.errors import AlreadyQuantized, CheckpointError
from deepinfer_core.weights.reader import iter_official_tensors
from deepinfer_core.weights.safetensors_io import INDEX_FILE, PICKLE_SUFFIXES, read_header

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExpertFormat", "quantize_checkpoint", "storage_format"]

ExpertFormat = Literal["fp4", "fp8"]
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

_BLOCK = r"^(?:layers|mtp)\.\d+\."
_FP8 = re.compile(
    _BLOCK + r"(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$"
)
_ROUTED_EXPERT = re.compile(_BLOCK + r"ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(
    r"^hc_head_(?:fn|base|scale)$|"
    + _BLOCK
    + r"(?:hc_(?:attn|ffn|head)_(?:fn|base|scale)|attn\.attn_sink|.*\.ape|ffn\.gate\.bias)$"
)
_INT64 = re.compile(_BLOCK + r"ffn\.gate\.tid2eid$")
_QUANTISED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)


def storage_format(name: str, experts: ExpertFormat = "fp4") -> str:
    """How the release stores the official tensor `name`: "fp8", "fp4", "float32", "int64" or "bfloat16"."""
    if _FP8.match(name):
        return "fp8"
    if _ROUTED_EXPERT.match(name):
        return experts
    if _FP32.match(name):
        return "float32"
    if _INT64.match(name):
        return "int64"
    return "bfloat16"


def quantize_checkpoint(
    source_dir: str | Path,
    output_dir: str | Path,
    *,
    experts: ExpertFormat = "fp4",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write the quantised checkpoint (sharded safetensors + index, config.json, tokenizer files) to `output_dir`."""
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    if experts not in ("fp4", "fp8"):
        raise ValueError(f"experts must be 'fp4' or 'fp8', got {experts!r}")
    config = _read_config(source_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in output_dir.glob("*.safetensors"))
    if stale:
        raise CheckpointError(
            f"{output_dir} already holds safetensors files ({', '.join(stale[:3])}); write to an empty directory"
        )
    _write_shards(_quantised_tensors(source_dir, experts), output_dir, max_shard_bytes)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(FP8_BLOCK),
    }
    config.pop("expert_dtype", None)
    if experts == "fp4":
        config["expert_dtype"] = "fp4"
    # transformers 5 writes `dtype`, earlier releases and the official config `torch_dtype`.
    config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_side_files(source_dir, output_dir)


def _read_config(source_dir: Path) -> dict:
    path = source_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the quantised checkpoint needs the source's config.json")
    config = json.loads(path.read_text())
    if config.get("quantization_config"):
        raise AlreadyQuantized(f"{path} already has a quantization_config; quantise a float checkpoint")
    return config


def _quantised_tensors(source_dir: Path, experts: ExpertFormat) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in iter_official_tensors(source_dir):
        fmt = storage_format(name, experts)
        if tensor.dtype in _QUANTISED_DTYPES:
            raise AlreadyQuantized(f"tensor `{name}` is stored as {tensor.dtype}; quantise a float checkpoint")
        if fmt not in ("fp8", "fp4"):
            yield name, tensor.to(getattr(torch, fmt)).contiguous()
            continue
        try:
            weight, scale = quantize_fp8_block(tensor) if fmt == "fp8" else quantize_fp4(tensor)
        except QuantizationFormatError as err:
            raise CheckpointError(f"cannot store tensor `{name}` as {fmt}: {err}") from err
        yield name, weight
        yield name.removesuffix(".weight") + ".scale", scale


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], output_dir: Path, max_shard_bytes: int) -> None:
    pending: list[Path] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            pending.append(_save_pending(shard, output_dir, len(pending)))
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += nbytes
    if shard:
        pending.append(_save_pending(shard, output_dir, len(pending)))
    _name_shards(pending, output_dir)


def _save_pending(tensors: dict[str, torch.Tensor], output_dir: Path, number: int) -> Path:
    path = output_dir / f".pending-{number:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _name_shards(pending: list[Path], output_dir: Path) -> None:
    """Give the shards their final `model-0000i-of-0000n` names and write the index."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, path in enumerate(pending, start=1):
        final = output_dir / f"model-{i:05d}-of-{len(pending):05d}.safetensors"
        path.replace(final)
        for entry in read_header(final):
            weight_map[entry.name] = final.name
            total += _nbytes(entry.dtype, entry.shape)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (output_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.itemsize


def _copy_side_files(source_dir: Path, output_dir: Path) -> None:
    """Tokenizer, chat template and generation config: every file that is not weights or config.json."""
    for path in source_dir.iterdir():
        if not path.is_file() or path.name in ("config.json", INDEX_FILE):
            continue
        if path.suffix == ".safetensors" or path.suffix in PICKLE_SUFFIXES:
            continue
        shutil.copy2(path, output_dir / path.name)
