"""Parallelism applied after the model is built: rank groups, expert parallelism, EPLB, context
parallelism, launch."""

from .context_parallel import ContextParallelRows, apply_context_parallel
from .ep_moe import ExpertParallelMoE, apply_expert_parallel, expert_filter, join_without_tokens, moe_layers
from .errors import LaunchTimeout, ParallelConfigError, PlacementError, RankFailed
from .expert_placement import ExpertLoad, ExpertPlacement, rank_imbalance
from .groups import ParallelGroups, ParallelLayout
from .launch import init_from_env, spawn
from .rebalance import rebalance_experts

__all__ = [
    "ContextParallelRows",
    "ExpertLoad",
    "ExpertParallelMoE",
    "ExpertPlacement",
    "LaunchTimeout",
    "ParallelConfigError",
    "ParallelGroups",
    "ParallelLayout",
    "PlacementError",
    "RankFailed",
    "apply_context_parallel",
    "apply_expert_parallel",
    "expert_filter",
    "init_from_env",
    "join_without_tokens",
    "moe_layers",
    "rank_imbalance",
    "rebalance_experts",
    "spawn",
]
