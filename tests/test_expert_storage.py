"""Both models hold each layer's routed experts as consecutive slices of one tensor per projection (weights and
scales), filled in place by the loader, so a grouped-GEMM backend reads them without a copy: the nvidia
backend's stack is the model's own memory, not a second copy of every expert."""

from __future__ import annotations

import torch
from deepinfer_nvidia.ops import TritonOps
from v41_fixtures import model as v41_model

from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.weights.loader import load_model_weights


def _assert_one_storage_per_projection(model: torch.nn.Module) -> int:
    layers = 0
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, torch.nn.ModuleDict) or not experts:
            continue
        mlps = [expert.weights() for expert in experts.values()]
        for field in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"):
            tensors = [getattr(m, field) for m in mlps]
            if tensors[0] is None:
                continue
            first = tensors[0]
            step = first.numel() * first.element_size()
            assert all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors), field
            assert [t.data_ptr() - first.data_ptr() for t in tensors] == [i * step for i in range(len(tensors))], field
        stack = TritonOps()._stack(mlps, torch.device("cpu"))
        assert stack.w1.data_ptr() == mlps[0].w1.data_ptr() and stack.w2.data_ptr() == mlps[0].w2.data_ptr()
        layers += 1
    return layers


def test_v4_experts_share_one_storage_after_loading(tiny_checkpoint) -> None:
    config = load_model_config(tiny_checkpoint)
    model = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu"))
    load_model_weights(model, tiny_checkpoint)
    assert _assert_one_storage_per_projection(model) == config.num_hidden_layers + config.num_nextn_predict_layers


def test_v41_experts_share_one_storage_after_loading() -> None:
    """The fp4 release-like fixture (packed weights and their scales), loaded; the parity tests check the same
    model's outputs against the goldens, so the in-place loading into the stacks is covered there too."""
    model = v41_model("a_release_like", "bf16")
    assert _assert_one_storage_per_projection(model) == model.config.text_config.num_hidden_layers
