"""The DSpark drafter: DeepSeek-V4.1's block drafter with per-position confidences (MODEL_SPEC_V41 §10).

After a target step the drafter extends each stage's context window with the step's accepted rows
(their target features, `target_features`), then drafts one block per sequence: [anchor, noise x
(N-1)] with N = num_draft_tokens, the anchor being the token after the last accepted row. The block
runs once through the three stages; the Markov stage then walks the block in order, draft k drawn
from U_k + markov_head(e(previous token)): greedy rows take the argmax, sampled rows a Gumbel draw on
the drafter's own counter-based stream (speculative/sampling.py), whose distribution goes to the
verifier for rejection sampling. The confidences choose how many drafts are verified
(budget.py's survival rule). Only accepted positions ever reach the drafter's cache, so a rejection
leaves nothing in it to roll back.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.models.deepseek_v41.dspark import (
    DSpark,
    DSparkCache,
    DSparkUnavailable,
)

from .budget import survival_budget
from .config import SpeculativeConfig
from .drafter import Draft, DraftContext, Drafter
from .sampling import draw, select_rows

__all__ = ["DSparkDrafter", "TargetFeatureTap"]


class TargetFeatureTap:
    """Records, in every forward of the target, the mean over the hc streams of the input streams of
    each DSpark target layer; `features()` is their concatenation [T, len(layers) * D].

    NOTE: forward pre-hooks keep the target's forward unchanged for runs without DSpark."""

    def __init__(self, target, layer_ids: tuple[int, ...]) -> None:
        self.layer_ids = layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        for layer in layer_ids:
            target.layers[layer].register_forward_pre_hook(self._recorder(layer))

    def _recorder(self, layer: int):
        def record(module, args) -> None:
            streams = args[0]
            self.captured[layer] = streams.float().mean(dim=1).to(streams.dtype)
        return record

    def features(self) -> torch.Tensor:
        return torch.cat([self.captured[layer] for layer in self.layer_ids], dim=-1)


class DSparkDrafter(Drafter):
    def __init__(self, dspark: DSpark, cache: DSparkCache, config: SpeculativeConfig) -> None:
        window, trained = dspark.config.sliding_window, dspark.draft_config.block_size
        if config.num_draft_tokens > trained:
            raise DSparkUnavailable(
                f"num_draft_tokens {config.num_draft_tokens} asks for draft blocks longer than the "
                f"dspark_block_size={trained} the drafter was trained on: use num_draft_tokens <= {trained}"
            )
        if config.num_draft_tokens + 1 > window:
            raise DSparkUnavailable(
                f"num_draft_tokens {config.num_draft_tokens} needs verification steps of "
                f"{config.num_draft_tokens + 1} tokens and a draft block of {config.num_draft_tokens}, but the "
                f"sliding window holds {window}: use num_draft_tokens <= {window - 1}"
            )
        self.dspark, self.cache, self.config = dspark, cache, config
        self.tap = TargetFeatureTap(dspark.target, dspark.draft_config.target_layer_ids)

    def target_features(self, out) -> torch.Tensor:
        """[T, F] of the target forward that produced `out`: the drafter's context input."""
        return self.tap.features()

    def extend_context(self, context: DraftContext) -> None:
        """Write the context rows' window K=V into every stage's cache."""
        batch = context.batch
        if batch.num_tokens == 0:
            return
        for stage, kv in enumerate(self.dspark.context_kv(context.streams, batch.positions)):
            self.cache.store(self.dspark.ops, stage, kv, batch)

    def propose(self, context: DraftContext, sampling: SamplingTensors, max_drafts: list[int]) -> Draft:
        self.extend_context(context)
        batch, dspark = context.batch, self.dspark
        device = context.streams.device
        num_seqs, n = batch.num_seqs, self.config.num_draft_tokens
        tokens = torch.full((num_seqs, n), -1, dtype=torch.long, device=device)
        confidences = torch.zeros((num_seqs, n), dtype=torch.float32, device=device)
        probs = None if sampling.all_greedy else torch.zeros((num_seqs, n, dspark.config.vocab_size), device=device)
        limit = torch.tensor(max_drafts, dtype=torch.long, device=device).clamp(max=n)
        active_cpu = [i for i, m in enumerate(max_drafts) if m > 0]
        if active_cpu:
            active = torch.tensor(active_cpu, dtype=torch.long, device=device)
            last = batch.query_start_loc[1:].to(device, torch.long)[active] - 1
            anchors = context.next_token_ids[last]
            slots = torch.tensor([batch.slot_ids_cpu[i] for i in active_cpu], dtype=torch.long, device=device)
            rings = [window.read(dspark.ops, (slots,)) for window in self.cache.windows]
            block = torch.full((len(active_cpu), n), dspark.draft_config.noise_token_id, dtype=torch.long, device=device)
            block[:, 0] = anchors
            hidden = dspark.block_hidden(block, batch.positions[last] + 1, rings)
            base = dspark.base_logits(hidden.flatten(0, 1)).view(len(active_cpu), n, -1)
            prev = anchors
            for k in range(n):
                e, markov = dspark.markov(prev)
                confidences[active, k] = dspark.confidence(hidden[:, k], e)
                drawn, _, q = draw(base[:, k] + markov, select_rows(sampling, active, k))
                tokens[active, k] = drawn
                if probs is not None:
                    probs[active, k] = q
                prev = drawn
        lengths = survival_budget(confidences, limit, self.config.min_survival_probability,
                                  self.config.max_verify_drafts)
        positions = torch.arange(n, device=device)
        tokens = tokens.masked_fill(positions[None, :] >= lengths[:, None], -1)
        return Draft(tokens, confidences, lengths, probs)
