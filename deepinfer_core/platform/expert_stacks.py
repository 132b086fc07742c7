"""A backend's stacks of a layer's held experts, built once and found again only for the same live weights.

Grouped-GEMM kernels want a layer's experts as one [E_held, N, K] tensor per projection, while `fused_moe`
receives a list of `MlpWeights` every step. A backend builds the stack on the first call and reuses it. The entry
is found again only for the very tensors it was built from (weak references, compared by identity) at the
version counters it saw. Keyed by their addresses alone, as backends once did, new weights allocated where freed
ones lay (another model, or a test's next case) would have found the old weights' stack and computed with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from deepinfer_core.platform.kernel_ops import MlpWeights

__all__ = ["ExpertStacks"]

Stack = TypeVar("Stack")


class ExpertStacks(Generic[Stack]):
    """`get(experts, build)`: the stack `build(held)` made for these experts (`held`: the indices of the experts
    present), rebuilt when the held indices change, or when the first or last held expert's weights are other
    tensors or were written in place (a reload). An entry is dropped when its first expert's w1 is freed, so a
    freed model's stacks go with it; the stack must therefore not hold that tensor (a view of it does, as its
    `_base`: view a `detach()`ed alias instead), or neither is ever freed."""

    def __init__(self) -> None:
        # id(first held expert's w1) -> (held indices, weak references to the six key tensors, their versions, stack)
        self._entries: dict[int, tuple[tuple[int, ...], tuple[weakref.ref, ...], tuple[int, ...], Stack]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, experts: Sequence[MlpWeights | None], build: Callable[[list[int]], Stack]) -> Stack:
        held = [i for i, expert in enumerate(experts) if expert is not None]
        if not held:
            raise ValueError("no held expert to stack")
        first, last = experts[held[0]], experts[held[-1]]
        tensors = (first.w1, first.w3, first.w2, last.w1, last.w3, last.w2)
        versions = tuple(t._version for t in tensors)
        key = id(first.w1)  # unique while w1 lives, and the entry dies with it
        entry = self._entries.get(key)
        if entry is not None:
            same_held, refs, same_versions, stack = entry
            if same_held == tuple(held) and same_versions == versions and all(r() is t for r, t in zip(refs, tensors)):
                return stack
        else:
            weakref.finalize(first.w1, self._entries.pop, key, None)
        stack = build(held)
        self._entries[key] = (tuple(held), tuple(weakref.ref(t) for t in tensors), versions, stack)
        return stack
