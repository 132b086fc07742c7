"""Stream a checkpoint's tensors under their official names, one tensor in memory at a time."""

from collections.abc import Iterator
from pathlib import Path

import torch

from deepinfer_core.weights.names import fused_experts, official_name, split_fused_experts
from deepinfer_core.weights.safetensors_io import checkpoint_shards, open_shard, read_header

__all__ = ["iter_official_tensors"]


def iter_official_tensors(checkpoint_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) for every stored tensor; transformers' fused experts come out per expert."""
    for path in checkpoint_shards(Path(checkpoint_dir)):
        stored = read_header(path)
        with open_shard(path) as shard:
            for entry in stored:
                fused = fused_experts(entry.name)
                if fused is None:
                    yield official_name(entry.name), shard.get_tensor(entry.name)
                    continue
                whole = shard.get_slice(entry.name)
                for expert in range(entry.shape[0]):
                    yield from split_fused_experts(fused, whole[expert], expert).items()
