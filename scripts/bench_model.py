"""The benchmark model of issue 5: a V4-Flash-width slice (MODEL_SPEC §1.2) of 4 layers (sliding with
hash routing, CSA, HCA, CSA), random weights made on the device, as DeepInfer and as transformers.

Also: step batches and caches for DeepInfer, and the FLOP / byte counts the benchmarks divide by.
DeepInfer's routed experts are held stacked ([E, N, K] per projection) with each expert's parameters
viewing its slice, the layout proposed for the model (see the nvidia ops' `_stack`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.model_config import CSA, DeepseekV4Config, load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4Cache, DeepseekV4ForCausalLM
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps

__all__ = [
    "BenchModel", "attention_flops", "build_deepinfer", "build_transformers", "counting_experts",
    "expected_experts_touched", "flash_slice_raw", "kv_bytes_per_sequence", "random_cache", "setup", "step_batch",
    "randomise_parameter", "use_ops", "weight_bytes", "weight_flops_per_token",
]

FLASH_WIDTHS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_attention_heads": 64,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "sliding_window": 128, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "compress_rate_hca": 128,
}
TINY_WIDTHS: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 4, "head_dim": 32,
    "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": 8, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3,
    "compress_rate_hca": 8,
}


def flash_slice_raw(tiny: bool, weights: str) -> dict[str, Any]:
    """config.json-style dict; weights: "bf16", or "fp8" (fp8 projections, fp8 experts), or "fp4"
    (fp8 projections, fp4 experts); a "-a8" suffix (fp8 activations, `fresh_ops`) does not change it."""
    from deepinfer_core.tools.tiny_checkpoint import TINY_CONFIG

    weights = weights.removesuffix("-a8")
    raw = {**TINY_CONFIG, **(TINY_WIDTHS if tiny else FLASH_WIDTHS)}
    raw.update(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4], num_hash_layers=1, num_nextn_predict_layers=0)
    if weights in ("fp8", "fp4"):
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if weights == "fp4":
        raw["expert_dtype"] = "fp4"
    return raw


@dataclass
class BenchModel:
    config: DeepseekV4Config
    model: DeepseekV4ForCausalLM


def setup(tiny: bool) -> tuple[torch.device, KernelOps]:
    """The device and the nvidia backend's ops (on the CPU, --tiny runs them through Triton's interpreter)."""
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not tiny:
            raise SystemExit("no GPU: run with --tiny (toy widths through the Triton interpreter)")
        sys.path.insert(0, str(repo / "tests"))
        import triton_interpreter  # noqa: F401  (TRITON_INTERPRET=1 before the kernels import)
    from deepinfer_nvidia.ops import TritonOps

    return device, TritonOps()


def fresh_ops(ops_type: type[KernelOps], weights: str) -> KernelOps:
    """New ops for one model or case, with fp8 activations (W8A8) for weights named "...-a8" (fp8-a8, fp4-a8)."""
    ops = ops_type()
    ops.fp8_activations = weights.endswith("-a8")
    return ops


def use_ops(model: torch.nn.Module, ops: KernelOps) -> None:
    """Point every module of `model` at `ops` (to run the same weights through the reference ops)."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def build_deepinfer(
    raw: dict[str, Any], ops: KernelOps, device: torch.device, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> BenchModel:
    config = load_model_config(raw)
    model = DeepseekV4ForCausalLM(config, ops, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, tensor in model.state_dict().items():
        randomise_parameter(name, tensor, config, gen)
    return BenchModel(config, model)


def randomise_parameter(name: str, t: torch.Tensor, config: DeepseekV4Config, gen: torch.Generator) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        t.copy_(torch.rand(t.shape[0], config.n_routed_experts, device=t.device, generator=gen)
                .topk(t.shape[1], dim=-1).indices)
    elif t.dtype == torch.float8_e4m3fn:
        t.copy_(torch.randn(t.shape, device=t.device, generator=gen).to(torch.float8_e4m3fn))
    elif t.dtype == torch.float8_e8m0fnu:
        # e4m3 values ~N(0, 1) or e2m1 codes ~U(-6, 6): a scale near 1/sqrt(fan-in) keeps activations O(1)
        t.view(torch.uint8).fill_(127 - 7)
    elif t.dtype == torch.int8:
        t.copy_(torch.randint(-128, 128, t.shape, device=t.device, generator=gen, dtype=torch.int16).to(torch.int8))
    elif "norm" in name and leaf == "weight":
        t.copy_(1.0 + 0.1 * torch.randn(t.shape, device=t.device, generator=gen))
    elif t.dim() >= 2:
        t.copy_(torch.randn(t.shape, device=t.device, generator=gen) / math.sqrt(t.shape[-1]))
    elif leaf == "scale" or leaf.endswith("_scale"):
        t.copy_(torch.rand(t.shape, device=t.device, generator=gen) + 0.5)
    else:
        t.copy_(0.5 * torch.randn(t.shape, device=t.device, generator=gen))


def build_transformers(raw: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """transformers' DeepseekV4ForCausalLM on the same config, bf16, initialised on the device."""
    from transformers import DeepseekV4Config
    from transformers import DeepseekV4ForCausalLM as HFModel

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "quantization_config", "expert_dtype")}
    hf_config = DeepseekV4Config(**fields)
    with torch.device(device):
        model = HFModel._from_config(hf_config, dtype=torch.bfloat16)
    return model.eval()


def step_batch(query_lens: list[int], context_lens: list[int], block_size: int, device: torch.device) -> ForwardBatch:
    """Sequences i on slot i with consecutive blocks, enough for context + query tokens. The token ids come
    from a generator of their own: a step's routing, hence the experts it reads and the decode floor, depend
    only on the step's shape, not on what the process ran before (the global generator's draws)."""
    per_seq = [(c + q) // block_size + 1 for q, c in zip(query_lens, context_lens)]
    width = max(per_seq)
    tables, first = [], 0
    for n in per_seq:
        tables.append(list(range(first, first + n)) + [-1] * (width - n))
        first += n
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(starts[-1])
    return ForwardBatch(
        input_ids=torch.randint(0, 97, (total,), generator=torch.Generator().manual_seed(total)).to(device),
        positions=torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)]).to(device),
        query_start_loc=starts.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        slot_ids=torch.arange(len(query_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        logits_indices=(starts[1:] - 1).long().to(device),
        query_lens_cpu=list(query_lens), context_lens_cpu=list(context_lens),
        slot_ids_cpu=list(range(len(query_lens))), block_tables_cpu=tables,
    )


def random_cache(
    config: DeepseekV4Config, batch: ForwardBatch, block_size: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
    spare: int = 0,
) -> DeepseekV4Cache:
    """A cache holding random state for every position < context_len (as after a prefill); `spare` more
    slots and blocks than the batch uses (decode graphs pad on slot num_seqs and the block after the last)."""
    blocks = sum(sum(1 for b in table if b >= 0) for table in batch.block_tables_cpu)
    gen = torch.Generator(device=device).manual_seed(99)
    return DeepseekV4Cache(
        config, num_blocks=blocks + spare, block_size=block_size, num_slots=batch.num_seqs + spare, dtype=dtype,
        allocate=lambda shape, dt: torch.randn(shape, device=device, generator=gen).to(dt),
    )


def replayed_decode(model, cache: DeepseekV4Cache, batch: ForwardBatch, block_size: int, device: torch.device):
    """`batch`'s decode step replayed from a CUDA graph, as the engine runs it: a callable returning the
    logits. `cache` needs a spare slot and block (`random_cache(..., spare=1)`)."""
    from deepinfer_core.engine.decode_graphs import DecodeGraphs
    from deepinfer_nvidia.cuda_memory import CudaMemoryManager

    graphs = DecodeGraphs(
        model, cache, CudaMemoryManager(device), device, spare_slot=batch.num_seqs, spare_block=cache.num_blocks - 1,
        block_size=block_size, max_num_seqs=batch.num_seqs, max_model_len=max(batch.context_lens_cpu) + block_size,
    )
    return lambda: graphs.logits(batch)


def weight_flops_per_token(model: torch.nn.Module) -> float:
    """2 x the logical weight elements one token multiplies (routed experts at k of E), without the LM
    head (the benchmarks add it for the tokens whose logits are computed) and the embedding lookups
    (V4's or V4.1's model)."""
    c = getattr(model.config, "text_config", model.config)  # V4.1 nests its text model's config
    flops = 0.0
    for name, p in model.named_parameters():
        if (p.dim() != 2 or name.startswith(("embed.", "head.", "mtp.")) or name.endswith(("scale", "ape"))
                or ".engram.embed." in name):  # V4.1's engram tables: a token looks rows up, multiplies none
            continue
        elements = p.numel() * (2 if p.dtype == torch.int8 else 1)
        if ".experts." in name:
            elements *= c.num_experts_per_tok / c.n_routed_experts
        flops += 2 * elements
    return flops


def attention_flops(config: DeepseekV4Config, positions: torch.Tensor) -> float:
    """Summed over tokens at `positions`: 4 * heads * head_dim per key attended (window, CSA top-k of the
    visible entries, all visible HCA entries) plus the CSA indexer's scores over every visible entry."""
    c = config
    pos = positions.double()
    total = torch.zeros_like(pos)
    for spec in c.layers:
        keys = torch.clamp(pos + 1, max=c.sliding_window)
        if spec.is_compressed:
            visible = torch.floor((pos + 1) / spec.compress_ratio)
            if spec.attention == CSA:
                keys = keys + torch.clamp(visible, max=c.index_topk)
                total += 2 * c.index_n_heads * c.index_head_dim * visible
            else:
                keys = keys + visible
        total += 4 * c.num_attention_heads * c.head_dim * keys
    return float(total.sum())


def kv_bytes_per_sequence(config: DeepseekV4Config, context: int) -> float:
    """Cache bytes one decode token reads (bf16): its window, the entries attention reads (CSA: the
    top-k; HCA: all), and every CSA index key the indexer scores."""
    c = config
    total = 0.0
    for spec in c.layers:
        total += min(context, c.sliding_window) * c.head_dim * 2
        if spec.is_compressed:
            visible = (context + 1) // spec.compress_ratio
            if spec.attention == CSA:
                total += min(visible, c.index_topk) * c.head_dim * 2 + visible * c.index_head_dim * 2
            else:
                total += visible * c.head_dim * 2
    return total


def weight_bytes(model: torch.nn.Module, experts_touched: float, n_routed_experts: int | None = None) -> float:
    """Bytes of weights a step reads: everything but the embedding tables (the token embedding; V4.1's
    engram tables in host memory, of which a token reads a few rows), routed experts counted at
    `experts_touched` per layer (of n_routed_experts, default the V4 config's)."""
    routed = n_routed_experts or model.config.n_routed_experts
    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith(("embed.", "mtp.")) or ".engram.embed." in name:
            continue
        size = p.numel() * p.element_size()
        total += size * (experts_touched / routed if ".experts." in name else 1.0)
    return total


@contextmanager
def counting_experts(ops: KernelOps, op_name: str = "fused_moe") -> Iterator[list[int]]:
    """The distinct routed experts of each `ops.<op_name>` call inside the block (V4.1's MoE calls
    `fused_moe_prescaled`), read from its routing ids: the experts a step really reads. (This random model's router is far from uniform: at 16 and 64
    tokens it touches fewer experts than `expected_experts_touched`, which made steps look faster than the
    floor.)"""
    counts: list[int] = []
    run = getattr(ops, op_name)

    def counted(x, weights, ids, *args, **kwargs):
        counts.append(int(torch.unique(ids).numel()))
        return run(x, weights, ids, *args, **kwargs)

    setattr(ops, op_name, counted)
    try:
        yield counts
    finally:
        delattr(ops, op_name)


def expected_experts_touched(config: DeepseekV4Config, tokens: int) -> float:
    """E * (1 - (1 - k/E)^T): distinct experts hit by T tokens routed uniformly."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens)
