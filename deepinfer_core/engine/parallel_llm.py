"""One `LLM` served by several ranks: expert parallelism (EP), attention data parallelism (DP) with
EPLB while serving, and context parallelism (CP).

Ranks: `ParallelConfig.world_size` processes (dp when dp > 1, else ep; cp alone for CP).
- A process already in a torch.distributed group, or started by torchrun (WORLD_SIZE set), is one
  rank (SPMD): every rank calls `generate` with the same prompts, and each returns every output, in
  request order (`RankRuntime`).
- Otherwise `LLM` spawns one persistent process per rank, each running the SPMD path, and drives them
  (`SpawnedRanks`); a rank that dies or hangs raises `RankFailed` / `LaunchTimeout` in the caller.

A rank builds its engine as a single process would, except that its model holds only the experts its
EP rank's placement gives it (built and loaded through `expert_filter`), its MoE layers run
expert-parallel over its EP group, and with cp > 1 `apply_context_parallel` splits prefills.

DP: `partition_requests` splits the requests over the DP ranks (balanced by prompt tokens); each rank
runs its own scheduler, KV cache and engine. Ranks step in lockstep: every step starts with an
all-reduce of "has work"; a rank whose step runs no forward (no work, or a step that only read the
previous one's tokens) joins its EP group's MoE collectives without tokens; the loop ends when no rank
has work, and the outputs are all-gathered. Requests keep the ids a single engine would give them,
and unseeded requests derive their seeds from those ids, so sampling does not depend on the rank a
request lands on. Speculative decoding combines with dp only (ep = 1): with ep > 1 the idle ranks
would have to mirror the drafter's MoE forwards.

EPLB: every `eplb_interval_steps` steps all ranks all-reduce the interval's per-expert token counts,
compute `ExpertPlacement.balanced` from them (global: one level, the same placement for every EP
group) and move the expert weights with `rebalance_experts` before the next step. A re-placement
changes only where an expert runs, never what it computes.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepinfer_core.config import EngineConfig, ParallelConfig
from deepinfer_core.distributed import (
    ExpertLoad,
    ExpertParallelMoE,
    ExpertPlacement,
    ParallelConfigError,
    ParallelGroups,
    ParallelLayout,
    apply_expert_parallel,
    expert_filter,
    init_from_env,
    join_without_tokens,
    rank_imbalance,
    rebalance_experts,
)
from deepinfer_core.distributed.rank_pool import RankPool
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.platform.interfaces import Backend

if TYPE_CHECKING:
    from deepinfer_core.engine.engine import LLMEngine
    from deepinfer_core.engine.llm import LLM

__all__ = ["EplbRecord", "RankRuntime", "SpawnedRanks", "check_parallel", "is_rank_process", "partition_requests"]


@dataclass(frozen=True, slots=True)
class EplbRecord:
    step: int                 # lockstep steps run (over every generate call) when the re-placement happened
    imbalance_before: float   # max/mean (token, expert) pairs per EP rank in the interval, worst layer
    imbalance_planned: float  # the same load under the new placement


def partition_requests(prompt_lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Request indices per DP rank, balanced by prompt tokens: longest prompt first (ties: lower
    index), each to the rank with the fewest prompt tokens so far (ties: lower rank); ascending within
    a rank. A pure function of the lengths, so every rank computes the same split."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0] * num_ranks
    for index in sorted(range(len(prompt_lengths)), key=lambda i: (-prompt_lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (totals[r], r))
        shares[rank].append(index)
        totals[rank] += prompt_lengths[index]
    return [sorted(share) for share in shares]


def is_rank_process() -> bool:
    """Whether this process is already one rank: inside a process group, or started by torchrun."""
    return dist.is_available() and (dist.is_initialized() or "WORLD_SIZE" in os.environ)


def local_rank() -> int:
    """This rank's device index on its host (torchrun's LOCAL_RANK; spawned ranks set it too)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def check_parallel(parallel: ParallelConfig, model_config: Any, *, speculative: bool, rank: int = 0) -> ParallelLayout:
    """The layout of `rank`, or ParallelConfigError saying which option to change."""
    ep, dp, cp = parallel.ep, parallel.dp, parallel.cp
    if cp > 1 and (ep > 1 or dp > 1):
        raise ParallelConfigError(
            f"cp={cp} with ep={ep}, dp={dp}: context parallelism does not combine with expert or data "
            "parallelism yet; use cp alone, or ep/dp with cp=1"
        )
    if dp > 1 and dp % ep:
        raise ParallelConfigError(
            f"ep={ep} must divide dp={dp}: EP groups are ep consecutive DP ranks (dp={dp} ranks in all)"
        )
    if ep == 1 and (parallel.num_redundant_experts or parallel.eplb_interval_steps is not None):
        raise ParallelConfigError(
            "num_redundant_experts and eplb_interval_steps place experts over EP ranks and need ep > 1, "
            f"found ep=1 (num_redundant_experts={parallel.num_redundant_experts}, "
            f"eplb_interval_steps={parallel.eplb_interval_steps})"
        )
    if speculative and ep > 1:
        raise ParallelConfigError(
            f"speculative decoding with ep={ep} is not supported: the drafter's MoE forwards would need every "
            "idle DP rank to mirror them; turn speculative off or use ep=1"
        )
    _, num_experts = _moe_shape(model_config)
    return ParallelLayout(
        world_size=parallel.world_size, rank=rank, ep=ep, dp=dp, num_experts=num_experts,
        num_redundant_experts=parallel.num_redundant_experts,
    )


def _moe_shape(model_config: Any) -> tuple[int, int]:
    """(MoE blocks, numbered as the loader numbers them: main then MTP; routed experts per block)."""
    text = getattr(model_config, "text_config", model_config)
    blocks = len(model_config.all_layers) if hasattr(model_config, "all_layers") else text.num_hidden_layers
    return blocks, text.n_routed_experts


class RankRuntime:
    """This process's rank of a parallel `LLM`: its groups and expert placement, and the lockstep loop."""

    def __init__(self, parallel: ParallelConfig, model_config: Any, backend: Backend, *, speculative: bool) -> None:
        if not dist.is_initialized():
            init_from_env(backend, timeout_s=parallel.timeout_s)
        self.parallel = parallel
        self.layout = check_parallel(parallel, model_config, speculative=speculative, rank=dist.get_rank())
        self.groups = ParallelGroups.create(self.layout, backend)
        self.device = backend.device
        num_layers, num_experts = _moe_shape(model_config)
        ep = self.layout.ep
        self.placement = (
            ExpertPlacement.initial(num_layers, num_experts, ep, parallel.num_redundant_experts) if ep > 1 else None
        )
        self.load = (
            ExpertLoad.zeros(num_layers, num_experts, ep, self.device)
            if parallel.eplb_interval_steps is not None else None
        )
        self.moe_layers: list[ExpertParallelMoE] = []       # main then MTP blocks: what EPLB re-places
        self.main_moe_layers: list[ExpertParallelMoE] = []  # what one plain step's forward runs
        self.next_request_id = 0
        self.steps = 0
        self.eplb_records: list[EplbRecord] = []

    def model_options(self) -> dict[str, Any]:
        """Keyword arguments of the model constructor: this EP rank's experts only."""
        if self.placement is None:
            return {}
        return {"expert_filter": expert_filter(self.placement, self.layout.ep_rank)}

    def before_load(self, model: torch.nn.Module) -> None:
        if self.placement is None:
            return
        self.moe_layers = apply_expert_parallel(
            model, self.placement, self.groups.ep, tokens_replicated=self.layout.tokens_replicated, load=self.load
        )
        self.main_moe_layers = [block.ffn for block in model.layers]

    def after_load(self, model: torch.nn.Module) -> None:
        if self.parallel.cp > 1:
            from deepinfer_core.distributed.context_parallel import apply_context_parallel

            apply_context_parallel(model, self.groups.world)

    def generate(self, engine: LLMEngine, requests: list[tuple], use_tqdm: bool) -> list[RequestOutput]:
        """Run validated `(text, token_ids, params, grammar)` requests over the ranks (collective);
        every rank returns every output, in request order."""
        first, self.next_request_id = self.next_request_id, self.next_request_id + len(requests)
        mine = partition_requests([len(r[1]) for r in requests], self.layout.dp)[self.layout.dp_rank]
        order = {}
        for index in mine:
            text, token_ids, params, grammar = requests[index]
            order[engine.add_request(token_ids, params, text, grammar, request_id=first + index)] = index
        done = self._run(engine, order, use_tqdm and self.layout.rank == 0)
        if self.layout.dp > 1:
            done = self._all_gathered(done)
        return [done[index] for index in range(len(requests))]

    def _run(self, engine: LLMEngine, order: dict[int, int], use_tqdm: bool) -> dict[int, RequestOutput]:
        from tqdm.auto import tqdm

        done: dict[int, RequestOutput] = {}
        with tqdm(total=len(order), desc="Processed prompts (rank 0)", disable=not use_tqdm) as bar:
            while self._anyone_busy(engine.has_unfinished()):
                launched = engine.stats.num_steps  # counts the steps that launched a forward
                if engine.has_unfinished():
                    for output in engine.step():
                        done[order[output.request_id]] = output
                        bar.update(1)
                if engine.stats.num_steps == launched and self.main_moe_layers:
                    join_without_tokens(self.main_moe_layers)
                self.steps += 1
                if self.load is not None and self.steps % self.parallel.eplb_interval_steps == 0:
                    self._rebalance()
        return done

    def _anyone_busy(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)], dtype=torch.int64, device=self.device)
        self.groups.world.all_reduce(flag, "max")
        return bool(flag.item())

    def _rebalance(self) -> None:
        observed = self.load.summed(self.groups.world)
        self.load.reset()
        if not bool(observed.expert_tokens.any()):
            return
        placement = ExpertPlacement.balanced(observed.expert_tokens, self.layout.ep, self.parallel.num_redundant_experts)
        self.eplb_records.append(EplbRecord(
            step=self.steps,
            imbalance_before=rank_imbalance(observed.rank_tokens),
            imbalance_planned=rank_imbalance(placement.rank_loads(observed.expert_tokens)),
        ))
        rebalance_experts(self.moe_layers, placement)
        self.placement = placement

    def _all_gathered(self, done: dict[int, RequestOutput]) -> dict[int, RequestOutput]:
        world = self.groups.world
        payload = torch.frombuffer(bytearray(pickle.dumps(done)), dtype=torch.uint8).to(self.device)
        sizes = world.all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload
        rows = world.all_gather(padded).view(len(sizes), -1).cpu()
        merged: dict[int, RequestOutput] = {}
        for row, size in zip(rows, sizes):
            merged.update(pickle.loads(row[:size].numpy().tobytes()))
        return merged


class SpawnedRanks:
    """The driver of one spawned process per rank; each builds the `LLM` for its rank and serves calls."""

    def __init__(self, config: EngineConfig, backend: Backend, recoverable: tuple[type[BaseException], ...]) -> None:
        self.limit_s = config.parallel.timeout_s
        self.pool = RankPool(
            _build_rank, config.parallel.world_size, backend.distributed_backend, args=(config,),
            timeout_s=self.limit_s, startup_timeout_s=self.limit_s, recoverable=recoverable,
            preload=("deepinfer_core.engine.llm", "transformers"),
        )

    def generate(self, prompts: list, params: list) -> list[RequestOutput]:
        # No overall limit: every step has a collective, so a rank that hangs fails its peers in timeout_s.
        return self.pool.call("generate", prompts, params)[0]

    def rank_summaries(self) -> list[dict[str, float]]:
        return self.pool.call("summary", limit_s=self.limit_s)

    def eplb_records(self) -> list[EplbRecord]:
        return self.pool.call("eplb_records", limit_s=self.limit_s)[0]

    def close(self) -> None:
        self.pool.close()


class _RankServer:
    def __init__(self, llm: LLM, rank: int) -> None:
        self.llm, self.rank = llm, rank

    def generate(self, prompts: list, params: list) -> list[RequestOutput] | None:
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return outputs if self.rank == 0 else None  # every rank has them all: send one copy

    def summary(self) -> dict[str, float]:
        return self.llm.engine.stats.summary()

    def eplb_records(self) -> list[EplbRecord]:
        return self.llm.eplb_records()


def _build_rank(rank: int, world_size: int, config: EngineConfig) -> _RankServer:
    from deepinfer_core.engine.llm import LLM

    return _RankServer(LLM.from_config(config), rank)
