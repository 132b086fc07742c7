"""DeepseekV4ForCausalLM against transformers' full-sequence forward (the numerical reference).

Five random configs cover every layer type, sequences several times longer than sliding_window that
close several compression windows of both rates, hc_mult 2 and 4, one to three hash layers, top-k > 1,
yarn and plain rope, and 8-16 indexer heads (fewer heads make exact-zero indexer ties, MODEL_SPEC §4.4).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_cache, build_forward_batch

from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.tools import make_tiny_checkpoint
from deepinfer_core.weights.loader import load_model_weights

CONFIGS = {
    # MODEL_SPEC §10 (official form): 2 hash layers, CSA 4 / HCA 8, window 8, yarn, hc 4.
    "tiny_default": ({}, 40),
    # transformers form, hc 2, one hash layer, 3 experts per token, HCA 16.
    "hc2_transformers_form": ({
        "compress_ratios": None, "compress_rate_hca": None, "num_hash_layers": None, "num_hidden_layers": 4,
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                        "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "hc_mult": 2, "sliding_window": 6, "num_experts_per_tok": 3, "index_topk": 5,
    }, 72),
    # three hash layers, plain rope for compressed layers, 12 experts / 4 per token.
    "three_hash_plain_rope": ({
        "compress_ratios": [4, 0, 128, 4, 128, 0], "compress_rate_hca": 16, "num_hash_layers": 3,
        "rope_scaling": None, "n_routed_experts": 12, "num_experts_per_tok": 4, "sliding_window": 16,
    }, 70),
    # both rates 4, 16 indexer heads picking 2, a window of 5.
    "equal_rates_16_index_heads": ({
        "compress_rate_hca": 4, "index_n_heads": 16, "index_topk": 2, "sliding_window": 5,
    }, 48),
    # CSA rate 8 (overlap of 16 tokens), 8 heads in 4 output groups.
    "csa_rate_8": ({
        "compress_rate_csa": 8, "compress_rate_hca": 16, "sliding_window": 7, "num_attention_heads": 8,
        "o_groups": 4, "q_lora_rank": 48, "index_topk": 4,
    }, 80),
}


def relative_row_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)


class Case:
    def __init__(self, tmp_path_factory: pytest.TempPathFactory, name: str, configs: dict = CONFIGS) -> None:
        from transformers import AutoModelForCausalLM

        overrides, self.length = configs[name]
        self.path = make_tiny_checkpoint(tmp_path_factory.mktemp(name), overrides=overrides, seed=len(name))
        self.config = load_model_config(self.path)
        self.hf = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch.float32, experts_implementation="eager"
        ).eval()
        self.models: dict[torch.dtype, DeepseekV4ForCausalLM] = {}
        gen = torch.Generator().manual_seed(7)
        self.prompts = [
            torch.randint(0, self.config.vocab_size, (n,), generator=gen)
            for n in (self.length, self.length - 11, self.length // 2 + 3)
        ]
        with torch.no_grad():
            self.refs = [self.hf(p[None], use_cache=False).logits[0].float() for p in self.prompts]

    def model(self, dtype: torch.dtype) -> DeepseekV4ForCausalLM:
        if dtype not in self.models:
            model = DeepseekV4ForCausalLM(self.config, KernelOps(), dtype, torch.device("cpu"))
            load_model_weights(model, self.path)
            self.models[dtype] = model
        return self.models[dtype]

    def whole_prompt_logits(self, dtype: torch.dtype, prompt: torch.Tensor) -> torch.Tensor:
        model = self.model(dtype)
        cache = build_cache(self.config, num_slots=2, dtype=dtype)
        blocks = list(range(cache.num_blocks))[::-1]
        out = model(build_forward_batch([(prompt, 0, 1, blocks)]), cache)
        return model.compute_logits(out.hidden)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(tmp_path_factory, request.param)


def test_prefill_float32_matches_transformers(case: Case) -> None:
    for prompt, ref in zip(case.prompts, case.refs):
        logits = case.whole_prompt_logits(torch.float32, prompt)
        # float32 end to end; only summation order differs from transformers.
        assert relative_row_error(logits, ref).max() <= 1e-4


def chunk_schedule(length: int, first_chunks: list[int]) -> list[int]:
    """Odd-sized prefill chunks, then single-token decodes for the last tokens."""
    sizes, done = [], 0
    for size in first_chunks:
        size = min(size, length - done - 4)
        if size <= 0:
            break
        sizes.append(size)
        done += size
    return sizes + [1] * (length - done)


def test_chunked_prefill_and_decode_batched_match_transformers(case: Case) -> None:
    model, config = case.model(torch.float32), case.config
    cache = build_cache(config, num_slots=5, num_blocks=64, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randperm(cache.num_blocks, generator=gen).tolist()
    per_seq = -(-case.length // cache.block_size)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(3)]
    slots = [3, 0, 4]
    schedules = [chunk_schedule(len(p), sizes) for p, sizes in zip(case.prompts, ([13, 11, 7], [5, 9], [17, 3, 3]))]
    done, logits = [0, 0, 0], [[], [], []]
    for step in range(max(len(s) for s in schedules)):
        active = [i for i in range(3) if step < len(schedules[i])]
        seqs = [(case.prompts[i][done[i]:done[i] + schedules[i][step]], done[i], slots[i], tables[i]) for i in active]
        out = model(build_forward_batch(seqs), cache)
        rows = model.compute_logits(out.hidden).split([len(s[0]) for s in seqs])
        for i, part in zip(active, rows):
            logits[i].append(part)
            done[i] += len(part)
    for got, ref in zip(logits, case.refs):
        # float32; chunking only regroups the same sums.
        assert relative_row_error(torch.cat(got), ref).max() <= 1e-4


# For the bf16 comparison every discrete choice is made robust (all experts routed, all entries
# indexed): on a tiny random model, bf16 rounding flips near-tied expert and entry picks, and one flip
# moves a row's logits by up to 50% (transformers' own bf16 run is as far from its float32 run).
BF16_CONFIGS = {
    "bf16_all_experts_all_entries": ({"n_routed_experts": 4, "num_experts_per_tok": 4, "index_topk": 64}, 48),
    "bf16_hc2": ({**CONFIGS["hc2_transformers_form"][0], "n_routed_experts": 3, "index_topk": 64}, 60),
}


@pytest.mark.parametrize("name", list(BF16_CONFIGS))
def test_bfloat16_model_tracks_float32_reference(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    case = Case(tmp_path_factory, name, BF16_CONFIGS)
    agree, decisive = 0, 0
    for prompt, ref in zip(case.prompts, case.refs):
        logits = case.whole_prompt_logits(torch.bfloat16, prompt)
        # bf16 weights and activations against a float32 reference, over the whole logits tensor:
        # ~3 significant digits per op, compounded over 5 blocks (single rows reach ~6e-2).
        assert (logits - ref).norm() / ref.norm() <= 3e-2
        # Top-1 on rows whose reference winner leads by more than the bf16 noise (0.1 std of the row):
        # random logits have near-ties that transformers' own bf16 run flips on ~3% of rows.
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * ref.std(dim=-1)
        agree += int((logits.argmax(-1) == ref.argmax(-1))[clear].sum())
        decisive += int(clear.sum())
    assert decisive >= 60
    assert agree / decisive >= 0.99


def test_stale_slot_contents_are_never_read(tiny_checkpoint) -> None:
    """A fresh sequence in a slot and blocks another sequence used gives the same logits."""
    config = load_model_config(tiny_checkpoint)
    model = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu"))
    load_model_weights(model, tiny_checkpoint)
    gen = torch.Generator().manual_seed(11)
    first, second = (torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (33, 27))
    cache = build_cache(config, num_slots=1, num_blocks=8)
    model(build_forward_batch([(first, 0, 0, [0, 1, 2])]), cache)
    reused = model.compute_logits(model(build_forward_batch([(second, 0, 0, [2, 0])]), cache).hidden)
    fresh_cache = build_cache(config, num_slots=1, num_blocks=8)
    fresh = model.compute_logits(model(build_forward_batch([(second, 0, 0, [5, 6])]), fresh_cache).hidden)
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)


def test_parameter_names_are_the_official_checkpoint_names(tiny_checkpoint) -> None:
    config = load_model_config(tiny_checkpoint)
    names = set(DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu")).state_dict())
    expected = {
        "embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
        "layers.0.attn_norm.weight", "layers.0.hc_attn_fn", "layers.0.attn.wq_a.weight", "layers.0.ffn.gate.tid2eid",
        "layers.1.attn.compressor.ape", "layers.1.attn.indexer.wq_b.weight",
        "layers.1.attn.indexer.compressor.norm.weight", "layers.2.ffn.gate.bias",
        "layers.2.ffn.experts.7.w1.weight", "layers.2.ffn.shared_experts.w2.weight",
        "mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
        "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.attn_sink", "mtp.0.ffn.gate.bias",
    }
    assert expected <= names
    assert "layers.0.ffn.gate.bias" not in names and "layers.2.ffn.gate.tid2eid" not in names


def test_expert_parallel_ranks_hold_their_experts_and_sum_to_the_full_moe(tiny_checkpoint) -> None:
    """A fake two-rank layout (even / odd experts): each rank loads only its experts, and the ranks'
    MoE outputs sum to the full MoE plus one extra shared expert (which one rank must drop)."""
    config = load_model_config(tiny_checkpoint)
    full = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu"))
    load_model_weights(full, tiny_checkpoint)
    ranks = []
    for parity in (0, 1):
        def owns(layer: int, expert: int, parity=parity) -> bool:
            return expert % 2 == parity
        rank = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu"), expert_filter=owns)
        load_model_weights(rank, tiny_checkpoint, expert_filter=owns)
        names = rank.state_dict()
        assert f"layers.2.ffn.experts.{parity}.w1.weight" in names
        assert f"layers.2.ffn.experts.{1 - parity}.w1.weight" not in names
        assert f"mtp.0.ffn.experts.{1 - parity}.w2.weight" not in names
        ranks.append(rank)
    gen = torch.Generator().manual_seed(2)
    x, ids = torch.randn(9, config.hidden_size, generator=gen), torch.randint(0, config.vocab_size, (9,), generator=gen)
    for layer in (0, 2):  # a hash layer and a score layer
        whole = full.layers[layer].ffn(x, ids)
        parts = sum(rank.layers[layer].ffn(x, ids) for rank in ranks)
        ffn = full.layers[layer].ffn
        no_routed = [None] * config.n_routed_experts
        shared = KernelOps().fused_moe(x, torch.ones(9, 1), torch.zeros(9, 1, dtype=torch.long), no_routed,
                                       ffn.shared_experts.weights(), config.swiglu_limit)
        torch.testing.assert_close(parts, whole + shared, rtol=1e-5, atol=1e-5)
