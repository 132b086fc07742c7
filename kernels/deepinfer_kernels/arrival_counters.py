"""Arrival counters: int32 words in device memory, zero between launches, by which the programs of one launch
find the last of them to finish a shared piece of work and let it finish the whole (`linear`'s split-K partial
sums, `fused_moe`'s slots of a token): no second launch. Each program stores its part, `tl.debug_barrier()`,
then `tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")`; the one that reads the last count re-reads the
parts from L2 (`cache_modifier=".cg"`: its multiprocessor's L1 never held another's stores) and resets the
counter to 0, so that the next launch, a graph replay included, finds it zero.
"""

from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

_pools: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(user: str, device: torch.device, count: int) -> torch.Tensor:
    """`user`'s pool of `count` counters on `device` (int32, all zero between its launches), allocated at its first
    call. `user` names the kernels that share the pool (launches of one stream, one after the other)."""
    key = (user, device)
    if key in _pools and _pools[key].numel() < count:
        raise ValueError(f"the {user} arrival counters were allocated {_pools[key].numel()}, not {count}")
    if key not in _pools:
        # Zeroed inside a graph capture, they would only be zeroed when that one graph replays.
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the {user} arrival counters are allocated by a device's first such launch, which "
                               "must not be inside a graph capture: run the step once before capturing it")
        _pools[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return _pools[key]
