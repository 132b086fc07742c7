"""Copy a checkpoint's tensors into a model whose parameter and buffer names are the official names.

Loading runs in two passes. The first reads only the safetensors headers and checks the whole plan:
every name converts to one the model expects, shapes and dtypes agree, nothing the model needs is
missing. The second streams tensors from memory-mapped shards one at a time straight into the
model's storage, so host memory stays near one tensor and no float32 copy of the model is made.

Float tensors are cast to the model entry's dtype; quantised tensors (fp8 e4m3 weights, e8m0 scales,
int8-packed fp4) and integer tensors are copied exactly and must match the model's dtype.

Expert parallelism: `expert_filter(layer_idx, expert_idx)` says whether this rank owns a routed
expert. Rejected experts are neither read nor required. `layer_idx` is the block index: main layer
`layers.{i}` passes `i`; MTP block `mtp.{k}` passes `num_hidden_layers + k`, its index in the
official `compress_ratios` list and in `ModelConfig.all_layers`.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.weights.errors import CheckpointMismatch, CheckpointNotFound, CorruptCheckpoint
from deepinfer_core.weights.names import FusedExperts, expert_of, fused_experts, official_name, split_fused_experts
from deepinfer_core.weights.safetensors_io import StoredTensor, checkpoint_shards, open_shard, read_header

__all__ = ["ExpertFilter", "load_model_weights"]

ExpertFilter = Callable[[int, int], bool]
# (`layers` or `mtp`, block index within that kind, expert index) -> whether this rank loads the expert.
_Ownership = Callable[[str, int, int], bool]

_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True, slots=True)
class _Copy:
    """One model entry filled from a stored tensor: whole, or one expert's part of a fused tensor."""

    target: str
    stored: StoredTensor
    fused: FusedExperts | None = None
    expert: int = 0


def load_model_weights(
    model: torch.nn.Module,
    checkpoint_dir: str | Path,
    *,
    expert_filter: ExpertFilter | None = None,
    prefixes: tuple[str, ...] | None = None,
) -> None:
    """Fill every entry of `model.state_dict()` from the checkpoint in `checkpoint_dir`.

    Checkpoint tensors whose official name starts with one of the model's `skipped_checkpoint_prefixes`
    (a class attribute, e.g. V4.1's `mtp.`, which its drafter loads) are neither read nor checked; with
    `prefixes`, only tensors under those prefixes are (a drafter loading just its own layers).

    Raises CheckpointMismatch naming the tensor when one is missing, unexpected, or of the wrong shape
    or dtype; CorruptCheckpoint naming the file when a shard cannot be parsed; UnsafeCheckpointFormat
    for pickle files; CheckpointNotFound when the directory holds no safetensors.
    """
    checkpoint_dir = Path(checkpoint_dir)
    targets = model.state_dict()
    owns = _expert_ownership(checkpoint_dir, expert_filter)
    skipped_prefixes = tuple(getattr(model, "skipped_checkpoint_prefixes", ()))

    def wanted(name: str) -> bool:
        return (prefixes is None or name.startswith(prefixes)) and not name.startswith(skipped_prefixes)

    plan = _plan(checkpoint_shards(checkpoint_dir), targets, owns, wanted)
    by_file: dict[Path, list[_Copy]] = {}
    for copy in plan:
        by_file.setdefault(copy.stored.file, []).append(copy)
    with torch.no_grad():
        for path, copies in by_file.items():
            with open_shard(path) as shard:
                for copy in copies:
                    _fill(targets[copy.target], shard, copy)


def _fill(target: torch.Tensor, shard: Any, copy: _Copy) -> None:
    if copy.fused is None:
        target.copy_(shard.get_tensor(copy.stored.name))
        return
    one_expert = shard.get_slice(copy.stored.name)[copy.expert]
    target.copy_(split_fused_experts(copy.fused, one_expert, copy.expert)[copy.target])


def _expert_ownership(checkpoint_dir: Path, expert_filter: ExpertFilter | None) -> _Ownership:
    if expert_filter is None:
        return lambda kind, block, expert: True
    num_layers = _num_hidden_layers(checkpoint_dir)

    def owns(kind: str, block: int, expert: int) -> bool:
        return expert_filter(block if kind == "layers" else num_layers + block, expert)

    return owns


def _num_hidden_layers(checkpoint_dir: Path) -> int:
    config = checkpoint_dir / "config.json"
    if not config.is_file():
        raise CheckpointNotFound(
            f"{config} is missing; expert filtering needs its `num_hidden_layers` to number the MTP blocks"
        )
    try:
        raw = json.loads(config.read_text())
        return int(raw.get("text_config", raw)["num_hidden_layers"])  # V4.1 nests its text model's
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CorruptCheckpoint(f"{config} has no integer `num_hidden_layers`: {err}") from err


def _plan(
    shards: list[Path], targets: dict[str, torch.Tensor], owns: _Ownership, wanted: Callable[[str], bool]
) -> list[_Copy]:
    plan: list[_Copy] = []
    filled: dict[str, StoredTensor] = {}
    skipped: set[str] = set()
    for path in shards:
        for stored in read_header(path):
            for copy in _copies_of(stored, owns, skipped, wanted):
                if copy.target in filled:
                    other = filled[copy.target]
                    raise CheckpointMismatch(
                        f"tensor `{copy.target}` is provided twice: by `{other.name}` in {other.file.name} and by "
                        f"`{stored.name}` in {path.name}"
                    )
                _check(copy, targets)
                filled[copy.target] = stored
                plan.append(copy)
    missing = sorted(name for name in targets if name not in filled and name not in skipped)
    if missing:
        shown = ", ".join(f"`{n}`" for n in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise CheckpointMismatch(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}{more}")
    return plan


def _copies_of(
    stored: StoredTensor, owns: _Ownership, skipped: set[str], wanted: Callable[[str], bool]
) -> list[_Copy]:
    fused = fused_experts(stored.name)
    if not wanted(f"{fused.block}.ffn.experts" if fused is not None else official_name(stored.name)):
        return []
    if fused is not None:
        copies = []
        for expert in range(stored.shape[0] if stored.shape else 0):
            names = fused.names(expert)
            kind, block, _ = expert_of(names[0])
            if owns(kind, block, expert):
                copies.extend(_Copy(name, stored, fused, expert) for name in names)
            else:
                skipped.update(names)
        return copies
    target = official_name(stored.name)
    expert = expert_of(target)
    if expert is not None and not owns(*expert):
        skipped.add(target)
        return []
    return [_Copy(target, stored)]


def _check(copy: _Copy, targets: dict[str, torch.Tensor]) -> None:
    stored = copy.stored
    where = f"`{stored.name}` in {stored.file.name}"
    target = targets.get(copy.target)
    if target is None:
        raise CheckpointMismatch(
            f"unexpected tensor {where}: it maps to `{copy.target}`, which the model does not have"
        )
    shape = stored.shape
    if copy.fused is not None:
        rows = shape[1]
        if copy.fused.kind == "gate_up_proj":
            if rows % 2:
                raise CheckpointMismatch(f"fused experts {where} have {rows} rows each; expected W1 and W3 rows")
            rows //= 2
        shape = (rows, *shape[2:])
    if tuple(target.shape) != shape:
        raise CheckpointMismatch(
            f"tensor `{copy.target}` (from {where}) has shape {list(shape)}, the model expects {list(target.shape)}"
        )
    same_kind = stored.dtype == target.dtype or (stored.dtype in _FLOATS and target.dtype in _FLOATS)
    if not same_kind:
        raise CheckpointMismatch(
            f"tensor `{copy.target}` (from {where}) is stored as {stored.dtype}, the model expects {target.dtype}; "
            "float tensors convert to any float dtype, quantised and integer tensors must match exactly "
            "(a quantised checkpoint needs a model built with its quantization_config)"
        )
