"""`ExpertStacks`: a layer's stack is found again only for the same live expert tensors at the same versions."""

from __future__ import annotations

import gc

import torch

from deepinfer_core.platform.expert_stacks import ExpertStacks
from deepinfer_core.platform.kernel_ops import MlpWeights


def _views(base: torch.Tensor) -> list[MlpWeights | None]:
    """Experts 0 and 2 held (1 not), each projection a new view object of `base`'s rows."""
    return [MlpWeights(base[0], base[1], base[2]), None, MlpWeights(base[3], base[4], base[5])]


class _Counting:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, held: list[int]) -> object:
        self.calls.append(held)
        return object()


def test_the_same_experts_find_their_stack():
    base, build, stacks = torch.randn(6, 4, 3), _Counting(), ExpertStacks()
    experts = _views(base)
    first = stacks.get(experts, build)
    assert stacks.get(experts, build) is first
    assert build.calls == [[0, 2]]


def test_other_tensors_at_the_same_addresses_get_a_new_stack():
    """New views of the same storage share the addresses and the version counter: a key of addresses and
    versions would hand them the first experts' stack, as freed weights' addresses reused by new ones would."""
    base, build, stacks = torch.randn(6, 4, 3), _Counting(), ExpertStacks()
    first, second = _views(base), _views(base)
    assert first[0].w1.data_ptr() == second[0].w1.data_ptr() and first[0].w1._version == second[0].w1._version
    assert stacks.get(first, build) is not stacks.get(second, build)
    assert len(build.calls) == 2


def test_an_in_place_write_or_other_held_experts_rebuild_it():
    base, build, stacks = torch.randn(6, 4, 3), _Counting(), ExpertStacks()
    experts = _views(base)
    first = stacks.get(experts, build)
    experts[2].w2.add_(1.0)  # a reload of the last held expert
    reloaded = stacks.get(experts, build)
    assert reloaded is not first
    experts[1] = MlpWeights(base[0], base[1], base[2])  # expert 1 held too (another rank layout)
    assert stacks.get(experts, build) is not reloaded
    assert build.calls == [[0, 2], [0, 2], [0, 1, 2]]


def test_a_stack_goes_when_its_experts_are_freed():
    stacks = ExpertStacks()
    experts = _views(torch.randn(6, 4, 3))
    stacks.get(experts, _Counting())
    assert len(stacks) == 1
    del experts
    gc.collect()
    assert len(stacks) == 0
