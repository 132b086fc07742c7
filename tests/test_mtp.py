"""The MTP block (`mtp.0.*`) against MODEL_SPEC §6 written out here.

transformers does not run MTP, so the reference is assembled in this file: the MTP input
z = e_proj(enorm(embed[next token])) + h_proj(hnorm(H)) spelled out in torch, then a transformers
decoder layer (sliding attention, score-routed MoE) holding the mtp.0 block weights, transformers'
hyper-head with the MTP's own hc_head_*, the MTP norm and the shared head.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_cache, build_forward_batch
from safetensors.torch import load_file

from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.weights.loader import load_model_weights
from deepinfer_core.weights.names import official_name

LENGTH = 30


def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def hf_mtp_block(path, tensors: dict[str, torch.Tensor]):
    """A transformers decoder layer of the MTP's type, holding the mtp.0 block weights."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 1
    config.layer_types = ["sliding_attention"]
    config.mlp_layer_types = ["moe"]
    config._experts_implementation = "eager"
    layer = hf.DeepseekV4DecoderLayer(config, 0).eval()
    state = {}
    for name in layer.state_dict():
        if name.startswith("mlp.experts."):
            continue
        state[name] = tensors["mtp.0." + official_name(f"model.layers.0.{name}").removeprefix("layers.0.")]
    experts = range(config.n_routed_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack([
        torch.cat([tensors[f"mtp.0.ffn.experts.{e}.w1.weight"], tensors[f"mtp.0.ffn.experts.{e}.w3.weight"]])
        for e in experts
    ])
    state["mlp.experts.down_proj"] = torch.stack([tensors[f"mtp.0.ffn.experts.{e}.w2.weight"] for e in experts])
    layer.load_state_dict(state)
    head = hf.DeepseekV4HyperHead(config)
    head.load_state_dict({
        "hc_fn": tensors["mtp.0.hc_head_fn"], "hc_base": tensors["mtp.0.hc_head_base"],
        "hc_scale": tensors["mtp.0.hc_head_scale"],
    })
    return config, layer, head, hf.DeepseekV4RotaryEmbedding(config)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    config = load_model_config(tiny_checkpoint)
    model = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu"))
    load_model_weights(model, tiny_checkpoint)
    ids = torch.randint(0, config.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(5))
    hf_model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    captured = []
    hook = hf_model.model.layers[-1].register_forward_hook(lambda module, args, output: captured.append(output))
    with torch.no_grad():
        hf_model(ids[None], use_cache=False)
    hook.remove()
    streams = captured[0][0]
    return config, model, ids, streams


def reference_mtp_logits(path, ids: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """MODEL_SPEC §6 for rows 0..S-2: row t sees H_t and the embedding of token t+1."""
    tensors = load_file(path / "model.safetensors")
    config, layer, hyper_head, rotary = hf_mtp_block(path, tensors)
    eps = config.rms_norm_eps
    rows = len(ids) - 1
    embeds = tensors["model.embed_tokens.weight"][ids[1:]]
    z = weighted_rms_norm(embeds, tensors["mtp.0.enorm.weight"], eps) @ tensors["mtp.0.e_proj.weight"].T
    h = weighted_rms_norm(streams[:rows], tensors["mtp.0.hnorm.weight"], eps) @ tensors["mtp.0.h_proj.weight"].T
    z = z[:, None, :] + h
    positions = torch.arange(rows)[None]
    window = config.sliding_window
    query, key = positions[0, :, None], positions[0, None, :]
    allowed = (key <= query) & (key > query - window)
    mask = torch.zeros(rows, rows).masked_fill(~allowed, float("-inf"))[None, None]
    cos_sin = rotary(z, position_ids=positions, layer_type="main")
    with torch.no_grad():
        out = layer(
            z[None], input_ids=None, position_embeddings={"main": cos_sin, "compress": cos_sin},
            position_ids=positions, attention_mask=mask, past_key_values=None,
        )
        hidden = weighted_rms_norm(hyper_head(out)[0], tensors["mtp.0.norm.weight"], eps)
    return hidden @ tensors["head.weight"].T


def test_main_model_streams_are_transformers_last_layer_output(setup) -> None:
    config, model, ids, streams = setup
    out = model(build_forward_batch([(ids, 0, 0, list(range(8)))]), build_cache(config, num_slots=1))
    torch.testing.assert_close(out.streams, streams, rtol=1e-4, atol=1e-5)


def test_mtp_logits_match_spec_formula(setup, tiny_checkpoint) -> None:
    config, model, ids, streams = setup
    want = reference_mtp_logits(tiny_checkpoint, ids, streams)
    cache = build_cache(config, num_slots=2)
    rows = len(ids) - 1
    out = model(build_forward_batch([(ids, 0, 1, list(range(8)))]), cache)
    mtp_batch = build_forward_batch([(ids[1:], 0, 1, list(range(8)))])
    got = model.mtp_forward(out.streams[:rows], ids[1:], mtp_batch, cache)
    assert got.logits.dtype == torch.float32 and got.logits.shape == (rows, config.vocab_size)
    assert got.streams.shape == (rows, config.hc_mult, config.hidden_size)
    # float32 on both sides; only summation order differs.
    err = (got.logits - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() <= 1e-4


def test_mtp_in_chunks_matches_whole(setup) -> None:
    """The MTP layer's own window cache carries across steps like a main sliding layer's."""
    config, model, ids, streams = setup
    rows = len(ids) - 1
    whole = model.mtp_forward(
        streams[:rows], ids[1:], build_forward_batch([(ids[1:], 0, 0, [0])]), build_cache(config, num_slots=1)
    ).logits
    cache = build_cache(config, num_slots=3)
    parts, done = [], 0
    for size in (11, 5, 1, 1, 7, 4):
        batch = build_forward_batch([(ids[1 + done:1 + done + size], done, 2, [3])])
        parts.append(model.mtp_forward(streams[done:done + size], ids[1 + done:1 + done + size], batch, cache).logits)
        done += size
    assert done == rows
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
