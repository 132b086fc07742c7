"""DeepSeek-V4.1's DSpark drafter (MODEL_SPEC_V41 §10) and speculative decoding with it.

On a tiny random V4.1 checkpoint with DSpark weights (`make_tiny_dspark_checkpoint`: six layers with
every band kind, an engram layer, fp8 window KV since head_dim is a multiple of 32):
- the drafter against `ReferenceDSpark`, a straightforward plain-torch reading of §10 written here
  from the checkpoint's tensors (full recompute of the context window, no cache): draft tokens equal,
  confidences within 1e-5 (float32, other summation orders);
- the target features (mean over the hc streams of each target layer's input streams) against the
  model's own per-layer trace;
- greedy output through the engine with method="dspark" equal to no speculation, for a mixed batch
  with chunked prefill, async scheduling on and off; the random drafter is rarely right, so a
  drafter whose tokens are right for a varying number of positions checks partial acceptance too;
- seeded sampling with DSpark gives the same tokens on every run;
- the survival budget admits the expected drafts for injected confidences;
- after a rejection, the target's cache (windows, open groups, entries, engram look-back) and the
  drafter's cache equal caches built without the rejected tokens, and the next step agrees.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer_core import LLM, SamplingParams, SpeculativeConfig
from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.engine.speculation import (
    SpeculativeMethodMismatch,
    build_drafter,
    load_draft_layers,
)
from deepinfer_core.models.deepseek_v41 import (
    DeepseekV41Cache,
    DeepseekV41ForCausalLM,
    parse_deepseek_v41_config,
)
from deepinfer_core.models.deepseek_v41.dspark import DSparkUnavailable
from deepinfer_core.models.deepseek_v41.rollback import StepRollback
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.speculative import (
    Draft,
    DraftContext,
    DSparkDrafter,
    survival_budget,
)
from deepinfer_core.tools.tiny_checkpoint import make_tiny_dspark_checkpoint
from deepinfer_core.weights.loader import load_model_weights
from v41_fixtures import garbage

CPU = torch.device("cpu")
N_DRAFT = 4          # the tiny config's dspark_block_size; the window is 8
CONF_TOL = 1e-5      # float32 confidences of the same math in other summation orders
STATE_TOL = 1e-5     # float32 cache rows computed in steps of other lengths
BLOCK_SIZE = 8
PROMPT_LENS = [3, 9, 14, 21]
NEW_TOKENS = 24
BUDGET = 16          # tokens per step: the longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dspark_checkpoint(tmp_path_factory.mktemp("dspark") / "tiny-v41-dspark")


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


@cache
def target(checkpoint: Path, kv_cache_dtype: str) -> DeepseekV41ForCausalLM:
    config = parse_deepseek_v41_config(json.loads((checkpoint / "config.json").read_text()))
    model = DeepseekV41ForCausalLM(config, KernelOps(), torch.float32, CPU, kv_cache_dtype=kv_cache_dtype)
    load_model_weights(model, checkpoint)
    model.bind_tokenizer_dir(checkpoint)
    return model.eval()


def drafter(checkpoint: Path, kv_cache_dtype: str, num_slots: int = 4, **options) -> DSparkDrafter:
    model = target(checkpoint, kv_cache_dtype)
    cache = DeepseekV41Cache(model.config, num_blocks=num_slots * 8, block_size=BLOCK_SIZE, num_slots=num_slots,
                             dtype=torch.float32, allocate=garbage, kv_cache_dtype=kv_cache_dtype)
    spec = SpeculativeConfig(method="dspark", num_draft_tokens=N_DRAFT, **options)
    return build_drafter(model, cache, spec, garbage, load_draft_layers(model, spec, checkpoint))


def rows_batch(slots: list[int], starts: list[int], counts: list[int], ids: torch.Tensor | None = None) -> ForwardBatch:
    """counts[i] rows of slot slots[i] at positions starts[i]..; sequence i owns blocks [8i, 8i+8)."""
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
    tables = [list(range(8 * slot, 8 * slot + 8)) for slot in slots]
    return ForwardBatch(
        input_ids=ids if ids is not None else torch.zeros(len(positions), dtype=torch.long),
        positions=positions,
        query_start_loc=torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32),
        context_lens=torch.tensor(starts, dtype=torch.int32),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.arange(len(positions)),
        query_lens_cpu=list(counts), context_lens_cpu=list(starts), slot_ids_cpu=list(slots),
        block_tables_cpu=tables,
    )


def greedy_sampling(num_seqs: int) -> SamplingTensors:
    params = [SamplingParams(temperature=0.0)] * num_seqs
    return SamplingTensors.build(params, list(range(num_seqs)), [0] * num_seqs, CPU)


# --- the independent reading of MODEL_SPEC_V41 §10 -------------------------------------------------------


class ReferenceDSpark:
    """Plain torch from the checkpoint's tensors: one sequence, every context row recomputed."""

    def __init__(self, checkpoint: Path, fp8_window: bool) -> None:
        raw = json.loads((checkpoint / "config.json").read_text())["text_config"]
        self.c = raw
        self.w = load_file(str(checkpoint / "model.safetensors"))
        self.fp8 = fp8_window
        self.eps = raw.get("rms_norm_eps", 1e-20)
        rd = raw["qk_rope_head_dim"]
        self.inv_freq = 1.0 / raw.get("rope_theta", 10000.0) ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, positions, sign=1.0):
        rd = 2 * self.inv_freq.shape[0]
        angle = positions.float()[:, None] * self.inv_freq[None] * sign
        cos, sin = angle.cos(), angle.sin()
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        a, b = x[..., -rd:][..., 0::2], x[..., -rd:][..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([x[..., :-rd], rotated], dim=-1)

    def fp8q(self, x):
        """Blocks of 32: scale 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3 round trip."""
        if not self.fp8:
            return x
        blocks = x.view(*x.shape[:-1], -1, 32)
        amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(amax * torch.tensor(1 / 448, dtype=torch.float32))))
        q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return q.view_as(x)

    def hc_mix(self, streams, p):
        n = streams.shape[1]
        flat = streams.flatten(1)
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        mix = flat @ self.w[f"{p}_fn"].T
        base, scale, hc_eps = self.w[f"{p}_base"], self.w[f"{p}_scale"], self.c.get("hc_eps", 1e-6)
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = torch.softmax(mix[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n), dim=-1) + hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
        for _ in range(self.c.get("hc_sinkhorn_iters", 20) - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
        return pre, post, comb

    def attention(self, p, x, positions, ctx_kv, ctx_positions):
        w, c = self.w, self.c
        heads, d = c["num_attention_heads"], c["head_dim"]
        q = self.rms(x @ w[f"{p}.wq_a.weight"].T, w[f"{p}.q_norm.weight"]) @ w[f"{p}.wq_b.weight"].T
        q = self.rope(q.view(-1, heads, d), positions)
        kv = self.fp8q(self.rope(self.rms(x @ w[f"{p}.wkv.weight"].T, w[f"{p}.kv_norm.weight"]), positions))
        keys = torch.cat([ctx_kv, kv])
        logits = torch.einsum("qhd,kd->hqk", q, keys) * d**-0.5
        sink = w[f"{p}.attn_sink"].view(-1, 1, 1).expand(-1, x.shape[0], 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        out = self.rope(torch.einsum("hqk,kd->qhd", probs, keys), positions, sign=-1.0)
        groups = c["o_groups"]
        wo_a = w[f"{p}.wo_a.weight"].view(groups, -1, heads * d // groups)
        grouped = torch.einsum("tgk,grk->tgr", out.reshape(x.shape[0], groups, -1), wo_a)
        return grouped.flatten(1) @ w[f"{p}.wo_b.weight"].T

    def moe(self, p, x):
        w, c = self.w, self.c
        k, limit = c["dspark_num_experts_per_tok"], c.get("swiglu_limit", 10.0)
        scores = torch.nn.functional.softplus(x @ w[f"{p}.gate.weight"].T / c.get("gate_temp", 1.0)).sqrt()
        ids = torch.topk(scores + w[f"{p}.gate.bias"], k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c.get("routed_scaling_factor", 1.5)

        def swiglu(prefix, rows, weight):
            gate = (rows @ w[f"{prefix}.w1.weight"].T).clamp(max=limit)
            up = (rows @ w[f"{prefix}.w3.weight"].T).clamp(-limit, limit)
            return (torch.nn.functional.silu(gate) * up * weight) @ w[f"{prefix}.w2.weight"].T

        out = swiglu(f"{p}.shared_experts", x, 1.0)
        for t in range(x.shape[0]):
            for slot in range(k):
                e = int(ids[t, slot])
                out[t] += swiglu(f"{p}.experts.{e}", x[t:t + 1], weights[t, slot])[0]
        return out

    def draft(self, features: torch.Tensor, anchor: int, n: int):
        """features [L, F] of context positions 0..L-1; returns (greedy tokens, confidences) of the block."""
        w, c = self.w, self.c
        length, window, stages = features.shape[0], c["sliding_window"], c["num_nextn_predict_layers"]
        main_x = self.rms(features @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"])
        ctx_positions = torch.arange(max(0, length + n - window), length)
        positions = torch.arange(length, length + n)
        ids = torch.tensor([anchor] + [c["dspark_noise_token_id"]] * (n - 1))
        streams = w["embed.weight"][ids][:, None, :].repeat(1, c["hc_mult"], 1)
        pre = torch.zeros(n, c["hc_mult"])
        pre[:, 0] = 1.0
        for k in range(stages):
            p = f"mtp.{k}"
            ctx = main_x[ctx_positions]
            ctx_kv = self.fp8q(self.rope(self.rms(ctx @ w[f"{p}.attn.wkv.weight"].T, w[f"{p}.attn.kv_norm.weight"]),
                                         ctx_positions))
            pre_attn, post, comb = self.hc_mix(streams, f"{p}.hc_attn")
            a = self.attention(f"{p}.attn", self.rms((pre[..., None] * streams).sum(1), w[f"{p}.attn_norm.weight"]),
                               positions, ctx_kv, ctx_positions)
            streams = post[..., None] * a[:, None] + torch.einsum("tjk,tjd->tkd", comb, streams)
            pre, post, comb = self.hc_mix(streams, f"{p}.hc_ffn")
            f = self.moe(f"{p}.ffn", self.rms((pre_attn[..., None] * streams).sum(1), w[f"{p}.ffn_norm.weight"]))
            streams = post[..., None] * f[:, None] + torch.einsum("tjk,tjd->tkd", comb, streams)
        last = f"mtp.{stages - 1}"
        hidden = (pre[..., None] * streams).sum(1)
        base = self.rms(hidden, w[f"{last}.norm.weight"]) @ w["head.weight"].T
        tokens, confidences, prev = [], [], anchor
        for k in range(n):
            e = w[f"{last}.markov_head.embed.weight"][prev]
            logits = base[k] + w[f"{last}.markov_head.head.weight"] @ e
            confidences.append(torch.sigmoid(torch.cat([hidden[k], e]) @ w[f"{last}.confidence_head.proj.weight"][0]))
            prev = int(logits.argmax())
            tokens.append(prev)
        return tokens, torch.stack(confidences)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_fp4", "bf16"])
def test_drafter_matches_reference_implementation(checkpoint, kv_cache_dtype):
    d = drafter(checkpoint, kv_cache_dtype)
    reference = ReferenceDSpark(checkpoint, fp8_window=kv_cache_dtype == "fp8_fp4")
    features_dim = d.dspark.first.main_proj.weight.shape[1]
    gen = torch.Generator().manual_seed(3)
    vocab = d.dspark.config.vocab_size
    # Two sequences in slots 0 and 2; the context arrives in two calls, the first longer than the window.
    calls = [([0, 0], [11, 5]), ([11, 5], [3, 1])]
    features = {0: [], 2: []}
    for starts, counts in calls:
        feats = torch.randn(sum(counts), features_dim, generator=gen)
        next_ids = torch.randint(3, vocab - 3, (sum(counts),), generator=gen)
        batch = rows_batch([0, 2], starts, counts)
        draft = d.propose(DraftContext(batch, feats, next_ids), greedy_sampling(2), [N_DRAFT, N_DRAFT])
        for i, (slot, rows) in enumerate(zip([0, 2], feats.split(counts))):
            features[slot].append(rows)
            anchor = int(next_ids[batch.query_start_loc[i + 1] - 1])
            tokens, confidences = reference.draft(torch.cat(features[slot]), anchor, N_DRAFT)
            assert draft.tokens[i].tolist() == tokens
            torch.testing.assert_close(draft.confidences[i], confidences, atol=CONF_TOL, rtol=0)
            assert int(draft.lengths[i]) == N_DRAFT  # min_survival_probability 0 admits every draft
    assert draft.probs is None


def test_target_features_are_the_mean_input_streams_of_the_target_layers(checkpoint):
    d = drafter(checkpoint, "bf16")
    model = d.dspark.target
    cache = DeepseekV41Cache(model.config, num_blocks=8, block_size=BLOCK_SIZE, num_slots=1, dtype=torch.float32,
                             allocate=garbage, kv_cache_dtype="bf16")
    ids = torch.randint(3, 120, (10,), generator=torch.Generator().manual_seed(4))
    model.trace.start()
    out = model(rows_batch([0], [0], [10], ids), cache)
    trace = model.trace.stop()
    layers = d.dspark.draft_config.target_layer_ids
    assert layers == (1, 3, 5)
    want = torch.cat([trace[f"hidden_streams.layer{i - 1}"].mean(1) for i in layers], dim=-1)
    torch.testing.assert_close(d.target_features(out), want, atol=1e-6, rtol=0)


# --- the verification budget ------------------------------------------------------------------------------


def test_survival_budget_admits_drafts_while_the_product_of_confidences_is_high_enough():
    c = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.99, 0.99, 0.99], [0.95, 0.2, 0.99, 0.99], [0.3, 0.9, 0.9, 0.9]])
    limit = torch.tensor([4, 4, 4, 2])
    # survivals: row 0 .9 .81 .729 .656; row 1 .5 .495 .49 .485; row 2 .95 .19 .188 .186; row 3 .3 .27
    assert survival_budget(c, limit, 0.0).tolist() == [4, 4, 4, 2]
    assert survival_budget(c, limit, 0.7).tolist() == [3, 0, 1, 0]
    assert survival_budget(c, limit, 0.49).tolist() == [4, 3, 1, 0]
    assert survival_budget(c, limit, 0.3).tolist() == [4, 4, 1, 1]
    # A step budget keeps the most likely drafts over all rows: .95 .9 .81 .729 .656 .5 | .495 ...
    assert survival_budget(c, limit, 0.0, max_total=6).tolist() == [4, 1, 1, 0]
    assert survival_budget(c, limit, 0.3, max_total=0).tolist() == [0, 0, 0, 0]
    assert survival_budget(c, limit, 0.3, max_total=100).tolist() == [4, 4, 1, 1]


def test_drafter_verifies_the_budget_of_its_own_confidences(checkpoint):
    d = drafter(checkpoint, "bf16", min_survival_probability=0.3)
    features_dim = d.dspark.first.main_proj.weight.shape[1]
    gen = torch.Generator().manual_seed(6)
    feats = torch.randn(12, features_dim, generator=gen)
    next_ids = torch.randint(3, 120, (12,), generator=gen)
    draft = d.propose(DraftContext(rows_batch([0, 1], [0, 0], [7, 5]), feats, next_ids), greedy_sampling(2),
                      [N_DRAFT, 2])
    survival = draft.confidences.cumprod(1)
    for i, limit in enumerate([N_DRAFT, 2]):
        admitted = int(((survival[i] >= 0.3) & (torch.arange(N_DRAFT) < limit)).long().cumprod(0).sum())
        assert int(draft.lengths[i]) == admitted
        assert (draft.tokens[i, admitted:] == -1).all() and (draft.tokens[i, :admitted] >= 0).all()
    assert ((draft.confidences > 0) & (draft.confidences < 1)).all()


def test_sampled_rows_report_the_distribution_their_drafts_were_drawn_from(checkpoint):
    d = drafter(checkpoint, "bf16")
    gen = torch.Generator().manual_seed(8)
    feats = torch.randn(9, d.dspark.first.main_proj.weight.shape[1], generator=gen)
    next_ids = torch.randint(3, 120, (9,), generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, seed=3)]
    sampling = SamplingTensors.build(params, [1, 3], [5, 5], CPU)
    draft = d.propose(DraftContext(rows_batch([0, 1], [0, 0], [4, 5]), feats, next_ids), sampling, [N_DRAFT] * 2)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(2, N_DRAFT))
    chosen = draft.probs.gather(2, draft.tokens[..., None])[..., 0]
    assert torch.equal(chosen[0], torch.ones(N_DRAFT))  # greedy: a point mass on its argmax draft
    assert (chosen[1] > 0).all() and ((draft.probs[1] > 0).sum(-1) == 20).all()  # top_k=20 of the temperature
    again = d.propose(DraftContext(rows_batch([2, 3], [0, 0], [4, 5]), feats, next_ids), sampling, [N_DRAFT] * 2)
    assert torch.equal(again.tokens, draft.tokens)  # keyed on (seed, output index), not on the slot


# --- configuration errors --------------------------------------------------------------------------------


def test_method_must_match_the_model_family(checkpoint, tiny_checkpoint):
    with pytest.raises(SpeculativeMethodMismatch, match="method='dspark'"):
        LLM(str(checkpoint), accelerator="cpu", dtype="float32", num_kv_blocks=16,
            speculative=SpeculativeConfig(method="mtp", num_draft_tokens=2))
    with pytest.raises(SpeculativeMethodMismatch, match="method='mtp'"):
        LLM(str(tiny_checkpoint), accelerator="cpu", dtype="float32", num_kv_blocks=16,
            speculative=SpeculativeConfig(method="dspark", num_draft_tokens=2))
    with pytest.raises(ValueError, match="min_survival_probability"):
        SpeculativeConfig(method="mtp", min_survival_probability=0.5)
    with pytest.raises(ValueError, match="confidence_threshold"):
        SpeculativeConfig(method="dspark", confidence_threshold=0.5)
    with pytest.raises(DSparkUnavailable, match="num_draft_tokens <= 4"):  # the tiny dspark_block_size
        LLM(str(checkpoint), accelerator="cpu", dtype="float32", num_kv_blocks=16,
            speculative=SpeculativeConfig(method="dspark", num_draft_tokens=5))


def test_checkpoint_without_dspark_weights_is_refused(checkpoint, tmp_path):
    from deepinfer_core.tools.tiny_v41_checkpoint import make_tiny_v41_checkpoint

    plain = make_tiny_v41_checkpoint(tmp_path / "plain", vision=False, text_overrides={"num_nextn_predict_layers": 3})
    with pytest.raises(DSparkUnavailable, match="mtp"):
        LLM(str(plain), accelerator="cpu", dtype="float32", num_kv_blocks=16,
            speculative=SpeculativeConfig(method="dspark", num_draft_tokens=2))


# --- through the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, 120, (n,), generator=gen).tolist()} for n in PROMPT_LENS]


def make_llm(checkpoint: Path, speculative: SpeculativeConfig | None = None, async_scheduling: bool = True) -> LLM:
    return LLM(str(checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=BUDGET,
               num_kv_blocks=48, async_scheduling=async_scheduling, speculative=speculative)


def greedy(max_tokens: int = NEW_TOKENS) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
            for i in range(len(PROMPT_LENS))]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts) -> list[list[int]]:
    outputs = make_llm(checkpoint).generate(prompts, greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


class HalfRightDSpark(DSparkDrafter):
    """The DSpark drafter (its cache and context path unchanged) whose tokens are replaced by the known
    greedy continuation, right for (index^2 + seed) % (k + 1) drafts (index = the output index of the
    first draft): every acceptance length occurs."""

    def __init__(self, inner: DSparkDrafter, reference: list[list[int]]) -> None:
        self.dspark, self.cache, self.config, self.tap = inner.dspark, inner.cache, inner.config, inner.tap
        self.reference = reference

    def propose(self, context, sampling, max_drafts) -> Draft:
        draft = super().propose(context, sampling, max_drafts)
        vocab = self.dspark.config.vocab_size
        for i, (seed, first) in enumerate(zip(sampling.seeds.tolist(), sampling.positions.tolist())):
            n = int(draft.lengths[i])
            right = (first * first + seed) % (N_DRAFT + 1)
            want = self.reference[seed][first:first + n]
            draft.tokens[i, :n] = torch.tensor([t if j < right else (t + 1) % vocab for j, t in enumerate(want)],
                                               dtype=torch.long)
        return draft


@pytest.mark.parametrize("async_scheduling,min_survival,max_verify", [(True, 0.0, None), (False, 0.0, None),
                                                                     (False, 0.3, 3)],
                         ids=["async", "sync", "sync-budget"])
def test_greedy_output_with_dspark_equals_plain_decoding(checkpoint, prompts, reference, async_scheduling,
                                                          min_survival, max_verify):
    spec = SpeculativeConfig(method="dspark", num_draft_tokens=N_DRAFT, min_survival_probability=min_survival,
                             max_verify_drafts=max_verify)
    llm = make_llm(checkpoint, spec, async_scheduling)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(o.spec_draft_tokens > 0 for o in outputs)
    assert max(s.prefill_tokens for s in llm.engine.stats.recent) <= BUDGET
    drafted = llm.engine.stats.speculative.drafted
    if max_verify is None:  # every decode step verifies the whole block (max_tokens permitting)
        assert len(drafted) == N_DRAFT and drafted[-1] > 0
    else:  # the survival rule cut some blocks short
        assert len(drafted) <= N_DRAFT and drafted[-1] < drafted[0]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_partially_right_drafts_are_accepted_and_output_is_unchanged(checkpoint, prompts, reference,
                                                                       async_scheduling):
    llm = make_llm(checkpoint, SpeculativeConfig(method="dspark", num_draft_tokens=N_DRAFT), async_scheduling)
    llm.engine.runner.drafter = HalfRightDSpark(llm.engine.runner.drafter, reference)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    per_position = llm.engine.stats.speculative.accepted
    assert all(o.spec_accepted_tokens > 0 for o in outputs)
    assert len(per_position) == N_DRAFT and all(a > 0 for a in per_position)


def test_seeded_sampling_with_dspark_is_deterministic(checkpoint, prompts):
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=100 + i)
              for i in range(len(PROMPT_LENS))]
    spec = SpeculativeConfig(method="dspark", num_draft_tokens=N_DRAFT)
    first = [o.outputs[0].token_ids for o in make_llm(checkpoint, spec).generate(prompts, params, use_tqdm=False)]
    again = make_llm(checkpoint, spec).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == first
    assert sum(o.spec_draft_tokens for o in again) > 0


# --- rollback --------------------------------------------------------------------------------------------


def run_step(model, cache, slot: int, start: int, ids: list[int]):
    batch = rows_batch([slot], [start], [len(ids)], torch.tensor(ids))
    return batch, model(batch, cache)


@pytest.mark.parametrize("kept", [1, 2, 3, 4])
def test_rejected_positions_leave_the_caches_as_if_never_run(checkpoint, kept):
    """A verification step of 5 rows (the last token, 4 drafts) keeps `kept` of them; every cache must
    equal the one of a run that only ever saw the kept rows. The prompt (13 tokens) has wrapped the
    window (8) and ends inside an open ratio-2 group."""
    model = target(checkpoint, "bf16")
    prompt = torch.randint(3, 120, (13,), generator=torch.Generator().manual_seed(9)).tolist()
    step = [57, 12, 99, 31, 64]
    caches, drafters = [], []
    for _ in range(2):
        cache = DeepseekV41Cache(model.config, num_blocks=16, block_size=BLOCK_SIZE, num_slots=2,
                                 dtype=torch.float32, allocate=zeros, kv_cache_dtype="bf16")
        spec = SpeculativeConfig(method="dspark", num_draft_tokens=N_DRAFT)
        d = build_drafter(model, cache, spec, zeros, load_draft_layers(model, spec, checkpoint))
        batch, out = run_step(model, cache, 1, 0, prompt)
        d.extend_context(DraftContext(batch, d.target_features(out), torch.zeros(13, dtype=torch.long)))
        caches.append(cache)
        drafters.append(d)
    (rolled, fresh), (rolled_drafter, fresh_drafter) = caches, drafters
    rollback = StepRollback(model, rolled)
    batch = rows_batch([1], [13], [len(step)], torch.tensor(step))
    snapshot = rollback.take(batch, [len(step)])
    out = model(batch, rolled)
    features = rolled_drafter.target_features(out)
    snapshot.restore(torch.tensor([kept]), [(prompt + step)[13 + kept - rollback.lookback:13 + kept]])
    rolled_drafter.extend_context(DraftContext(rows_batch([1], [13], [kept]), features[:kept],
                                               torch.zeros(kept, dtype=torch.long)))
    kept_batch, kept_out = run_step(model, fresh, 1, 13, step[:kept])
    fresh_drafter.extend_context(DraftContext(kept_batch, fresh_drafter.target_features(kept_out),
                                              torch.zeros(kept, dtype=torch.long)))

    end = 13 + kept
    window = model.config.text_config.sliding_window
    live_rows = torch.arange(end - window + 1, end) % window  # the window positions the next step reads
    for a, b in zip(rolled.windows + rolled_drafter.cache.windows, fresh.windows + fresh_drafter.cache.windows):
        torch.testing.assert_close(a.parts[0][1, live_rows], b.parts[0][1, live_rows], atol=STATE_TOL, rtol=0)
    for source, band in rolled.bands.items():
        other = fresh.bands[source]
        n_entries = end // band.ratio
        ids = torch.arange(n_entries)
        blocks = 8 + ids * band.ratio // BLOCK_SIZE  # slot 1 owns blocks 8..15
        offsets = ids % (BLOCK_SIZE // band.ratio)
        for stored, want in ((band.entries, other.entries), (band.index_keys, other.index_keys)):
            torch.testing.assert_close(stored.parts[0][blocks, offsets], want.parts[0][blocks, offsets],
                                       atol=STATE_TOL, rtol=0)
        if band.open_kv is not None:
            n_open = end % band.ratio
            for got, want in ((band.open_kv, other.open_kv), (band.open_gate, other.open_gate)):
                torch.testing.assert_close(got[1, :n_open], want[1, :n_open], atol=STATE_TOL, rtol=0)
    assert torch.equal(rolled.engram_history[1], fresh.engram_history[1])
    # The next step reads only what was compared: its logits agree.
    _, next_rolled = run_step(model, rolled, 1, end, [77, 5])
    _, next_fresh = run_step(model, fresh, 1, end, [77, 5])
    torch.testing.assert_close(model.compute_logits(next_rolled.hidden), model.compute_logits(next_fresh.hidden),
                               atol=1e-4, rtol=0)
