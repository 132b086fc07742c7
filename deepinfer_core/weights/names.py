"""Checkpoint tensor names -> the official DeepSeek-V4 names (MODEL_SPEC §8), which the model uses.

Two schemes reach the loader, and one checkpoint may mix them:
- official: `embed.weight`, `layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.7.w1.weight`, `mtp.0.*`;
- transformers: its module names (`model.layers.3.self_attn.q_a_proj.weight`,
  `model.layers.3.mlp.experts.gate_up_proj` with all experts fused), or the mix its `save_pretrained`
  writes (official layer names under a `model.` prefix, plus `model.embed_tokens.weight`,
  `model.hc_head.hc_fn`, and `attn.norm` for the attention's `kv_norm`); its fp8 quantizer calls a
  block scale `X.weight_scale_inv` where the release says `X.scale`.

`official_name` renames an ordinary tensor; `fused_experts` recognises transformers' fused expert
tensors, whose per-expert parts `split_fused_experts` cuts out under official names.
"""

import re
from dataclasses import dataclass

import torch

from deepinfer_core.weights.errors import CheckpointMismatch

__all__ = [
    "FusedExperts",
    "expert_of",
    "fused_experts",
    "official_name",
    "split_fused_experts",
]

_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# transformers module path inside a block -> official path; the longest matching prefix wins.
_IN_BLOCK = {
    "self_attn": "attn",
    "self_attn.q_a_proj": "attn.wq_a",
    "self_attn.q_a_norm": "attn.q_norm",
    "self_attn.q_b_proj": "attn.wq_b",
    "self_attn.kv_proj": "attn.wkv",
    "self_attn.kv_norm": "attn.kv_norm",
    "self_attn.o_a_proj": "attn.wo_a",
    "self_attn.o_b_proj": "attn.wo_b",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj": "attn.compressor.wkv",
    "self_attn.compressor.gate_proj": "attn.compressor.wgate",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm": "attn.compressor.norm",
    "self_attn.compressor.indexer.q_b_proj": "attn.indexer.wq_b",
    "self_attn.compressor.indexer.scorer.weights_proj": "attn.indexer.weights_proj",
    "self_attn.compressor.indexer.kv_proj": "attn.indexer.compressor.wkv",
    "self_attn.compressor.indexer.gate_proj": "attn.indexer.compressor.wgate",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm": "attn.indexer.compressor.norm",
    # save_pretrained reverses transformers' `.norm.` -> `.kv_norm.` rename everywhere, so the
    # attention's own kv_norm comes back as `attn.norm`.
    "attn.norm": "attn.kv_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "mlp": "ffn",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj": "ffn.shared_experts.w1",
    "mlp.shared_experts.up_proj": "ffn.shared_experts.w3",
    "mlp.shared_experts.down_proj": "ffn.shared_experts.w2",
}

_BLOCK = re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^(?P<kind>layers|mtp)\.(?P<block>\d+)\.ffn\.experts\.(?P<expert>\d+)\.")
_FUSED = re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?:mlp|ffn)\.experts\.(?P<kind>gate_up_proj|down_proj)$")


def official_name(name: str) -> str:
    """The official name of a stored tensor that is not a fused expert tensor."""
    bare = name.removeprefix("model.")
    if bare.endswith(".weight_scale_inv"):  # transformers' fp8 quantizer name for the block scale
        bare = bare.removesuffix(".weight_scale_inv") + ".scale"
    if bare in _TOP_LEVEL:
        return _TOP_LEVEL[bare]
    match = _BLOCK.match(bare)
    if match is None:
        return bare
    return f"{match['block']}.{_rename_in_block(match['rest'])}"


def _rename_in_block(rest: str) -> str:
    parts = rest.split(".")
    for cut in range(len(parts), 0, -1):
        renamed = _IN_BLOCK.get(".".join(parts[:cut]))
        if renamed is not None:
            return ".".join([renamed, *parts[cut:]])
    return rest


@dataclass(frozen=True, slots=True)
class FusedExperts:
    """A transformers fused expert tensor: `gate_up_proj` [E, 2I, D] (W1 rows then W3 rows) or `down_proj` [E, D, I]."""

    block: str
    kind: str

    def names(self, expert: int) -> tuple[str, ...]:
        prefix = f"{self.block}.ffn.experts.{expert}"
        if self.kind == "gate_up_proj":
            return (f"{prefix}.w1.weight", f"{prefix}.w3.weight")
        return (f"{prefix}.w2.weight",)


def fused_experts(name: str) -> FusedExperts | None:
    """The fused-expert description of `name`, or None when it is an ordinary tensor."""
    match = _FUSED.match(name.removeprefix("model."))
    return FusedExperts(match["block"], match["kind"]) if match else None


def split_fused_experts(fused: FusedExperts, tensor: torch.Tensor, expert: int) -> dict[str, torch.Tensor]:
    """Official tensors of one expert, cut from that expert's slice [2I, D] or [D, I] of a fused tensor (views)."""
    names = fused.names(expert)
    if fused.kind == "down_proj":
        return {names[0]: tensor}
    rows = tensor.shape[0]
    if rows % 2:
        raise CheckpointMismatch(
            f"{fused.block}.mlp.experts.gate_up_proj has {rows} rows per expert; expected an even count (W1 then W3)"
        )
    w1, w3 = tensor.split(rows // 2, dim=0)
    return {names[0]: w1, names[1]: w3}


def expert_of(name: str) -> tuple[str, int, int] | None:
    """(`layers` or `mtp`, block index, expert index) of an official routed-expert tensor name, else None."""
    match = _EXPERT.match(name)
    return (match["kind"], int(match["block"]), int(match["expert"])) if match else None
