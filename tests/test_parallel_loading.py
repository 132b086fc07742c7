"""Expert-parallel loading: each rank builds and loads only the experts its placement gives it."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_core.distributed import ExpertPlacement, expert_filter, moe_layers
from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.weights.loader import load_model_weights

CPU = torch.device("cpu")


def test_each_rank_loads_exactly_its_experts(tiny_checkpoint: Path) -> None:
    config = load_model_config(tiny_checkpoint)
    num_layers, experts, ep = len(config.all_layers), config.n_routed_experts, 4
    load = torch.rand(num_layers, experts, generator=torch.Generator().manual_seed(9)) ** 2
    placement = ExpertPlacement.balanced(load, ep, num_redundant_experts=4)
    full = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, CPU)
    load_model_weights(full, tiny_checkpoint)
    full_state = full.state_dict()
    copies = torch.zeros(num_layers, experts, dtype=torch.int64)
    for rank in range(ep):
        owned = expert_filter(placement, rank)
        model = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, CPU, expert_filter=owned)
        load_model_weights(model, tiny_checkpoint, expert_filter=owned)
        for layer, block in enumerate(moe_layers(model)):
            held = sorted(int(e) for e in block.ffn.experts)
            assert held == sorted(placement.rank_experts(layer, rank))
            copies[layer, held] += 1
        state = model.state_dict()
        missing = set(full_state) - set(state)
        assert missing and all(".experts." in name for name in missing), sorted(missing)[:5]
        for name, tensor in state.items():
            assert torch.equal(tensor, full_state[name]), name
    # Every expert is loaded somewhere; the 4 redundant slots per layer add copies, never duplicates on a rank.
    assert bool((copies >= 1).all())
    assert copies.sum(dim=1).tolist() == [experts + 4] * num_layers
