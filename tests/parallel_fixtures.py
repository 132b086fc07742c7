"""Helpers of the tests/test_parallel_*.py files: a random MoE layer built identically on every rank."""

from __future__ import annotations

import torch

from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4.factory import ModuleFactory
from deepinfer_core.models.deepseek_v4.moe import MoE
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.tools.tiny_checkpoint import TINY_CONFIG

# Tiny config layers: 0 is hash-routed, 2 score-routed (MODEL_SPEC §10).
HASH_LAYER, SCORE_LAYER = 0, 2


def tiny_config(**overrides):
    return load_model_config({**TINY_CONFIG, **overrides})


def random_moe(
    config, layer: int, seed: int, skew: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> MoE:
    """A MoE layer with seeded random weights; `skew` [E] is added to the score layer's selection bias."""
    moe = MoE(ModuleFactory(config, KernelOps(), dtype, torch.device("cpu")), config.layers[layer], layer)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in moe.state_dict().items():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(config.n_routed_experts, generator=gen)[: tensor.shape[1]]
                        for _ in range(tensor.shape[0])]
                tensor.copy_(torch.stack(rows))
            else:
                tensor.copy_((torch.randn(tensor.shape, generator=gen) * 0.2).to(tensor.dtype))
        if skew is not None:
            moe.gate.bias += skew
    return moe


def random_tokens(config, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, config.hidden_size, generator=gen), torch.randint(0, config.vocab_size, (count,), generator=gen)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0 if got.numel() == 0 else float("inf")
    return float((got.float() - want.float()).norm() / want.float().norm())


def held_in_one_stack(layer: torch.nn.Module) -> bool:
    """Whether the layer's experts are consecutive slices of one tensor per projection that holds them alone
    (as a grouped-GEMM backend reads them without a copy, and no expert the rank gave up stays allocated)."""
    for proj in ("w1", "w3", "w2"):
        tensors = [getattr(expert, proj).weight for expert in layer.experts.values()]
        size = tensors[0].numel() * tensors[0].element_size()
        if tensors[0].untyped_storage().nbytes() != len(tensors) * size:
            return False
        if [t.data_ptr() - tensors[0].data_ptr() for t in tensors] != [i * size for i in range(len(tensors))]:
            return False
    return True
