"""config.json -> DeepseekV4Config: both config forms, per-layer schedules, rope, quantisation, errors."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer_core.model_config import (
    CSA,
    HCA,
    SLIDING,
    ModelConfigError,
    UnsupportedModelError,
    load_model_config,
)
from deepinfer_core.models.deepseek_v4.rope import rope_inv_freq
from deepinfer_core.tools import TINY_CONFIG

# deepseek-ai/DeepSeek-V4-Flash config.json (MODEL_SPEC §1.2), official form.
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu", "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_flash_release_schedule() -> None:
    config = load_model_config(FLASH)
    assert [s.attention for s in config.layers[:4]] == [SLIDING, SLIDING, CSA, HCA]
    assert all(config.layers[i].attention == CSA for i in range(2, 43, 2))
    assert all(config.layers[i].attention == HCA and config.layers[i].compress_ratio == 128 for i in range(3, 42, 2))
    assert [s.mlp for s in config.layers[:4]] == ["hash_moe", "hash_moe", "hash_moe", "moe"]
    assert len(config.mtp_layers) == 1
    assert config.mtp_layers[0].attention == SLIDING and config.mtp_layers[0].mlp == "moe"
    assert config.qk_rope_head_dim == 64
    assert config.rope_main.rope_type == "default" and config.rope_main.rope_theta == 10000
    assert config.rope_compress.rope_type == "yarn" and config.rope_compress.rope_theta == 160000
    assert config.quantization_config.weight_block_size == (128, 128)
    assert config.expert_dtype == "fp4"
    assert config.topk_method == "noaux_tc"  # unknown keys are kept


def test_transformers_form_matches_official_form(tiny_checkpoint) -> None:
    """The tiny checkpoint's config.json is transformers' rewrite of TINY_CONFIG (official form)."""
    saved = json.loads((tiny_checkpoint / "config.json").read_text())
    assert "layer_types" in saved and "compress_ratios" not in saved
    from_saved, from_official = load_model_config(tiny_checkpoint), load_model_config(TINY_CONFIG)
    assert from_saved.layers == from_official.layers
    assert from_saved.mtp_layers == from_official.mtp_layers
    assert from_saved.rope_compress == from_official.rope_compress
    assert [(s.attention, s.compress_ratio) for s in from_saved.layers] == [
        (SLIDING, 0), (CSA, 4), (HCA, 8), (CSA, 4), (SLIDING, 0)
    ]


def test_compress_rates_dict_and_legacy_overrides() -> None:
    raw = {**TINY_CONFIG, "compress_ratios": None, "layer_types": [CSA, HCA, SLIDING, HCA, CSA],
           "compress_rates": {CSA: 8, HCA: 32}, "compress_rate_hca": None}
    config = load_model_config(raw)
    assert [s.compress_ratio for s in config.layers] == [8, 32, 0, 32, 8]
    legacy = load_model_config({**TINY_CONFIG, "compress_rate_csa": 16})
    assert legacy.layers[1].compress_ratio == 16


def test_rope_inv_freq_matches_transformers() -> None:
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    hf_config = HFConfig(**{k: v for k, v in FLASH.items() if k not in ("architectures", "model_type")})
    rotary = DeepseekV4RotaryEmbedding(hf_config)
    config = load_model_config(FLASH)
    torch.testing.assert_close(rope_inv_freq(config.rope_main, 64), rotary.main_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(rope_inv_freq(config.rope_compress, 64), rotary.compress_inv_freq, rtol=1e-6, atol=0)
    assert rotary.compress_attention_scaling == 1.0
    # MODEL_SPEC §2: pairs 0-15 unscaled, 25-31 divided by the factor 16.
    base = 1.0 / 160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    yarn = rope_inv_freq(config.rope_compress, 64)
    torch.testing.assert_close(yarn[:16], base[:16])
    torch.testing.assert_close(yarn[25:], base[25:] / 16)


def test_deepseek_v41_dispatches_to_its_own_config() -> None:
    from deepinfer_core.models.deepseek_v41 import DeepseekV41Config

    config = load_model_config({"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
                                "text_config": {"num_hidden_layers": 40}})
    assert isinstance(config, DeepseekV41Config)
    assert config.text_config.kv_source_layer_ids == (2, 8, 14, 20)


def test_unknown_model_type_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="model_type"):
        load_model_config({**FLASH, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "head_dim", "index_topk"])
def test_missing_field_is_named(field: str) -> None:
    raw = {k: v for k, v in FLASH.items() if k != field}
    with pytest.raises(ModelConfigError, match=field):
        load_model_config(raw)


@pytest.mark.parametrize("change, field", [
    ({"compress_ratios": [0, 3] + [4] * 42}, "compress_ratios"),
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"o_groups": 7}, "o_groups"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"rope_scaling": {"type": "yarn", "factor": 16}}, "original_max_position_embeddings"),
    ({"mlp_layer_types": ["hash_moe"] * 3}, "mlp_layer_types"),
])
def test_inconsistent_values_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        load_model_config({**FLASH, **change})


def test_reads_a_directory_and_reports_a_missing_file(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FLASH))
    assert load_model_config(tmp_path).num_hidden_layers == 43
    with pytest.raises(ModelConfigError, match="config.json"):
        load_model_config(tmp_path / "absent")


def test_registry_picks_the_model_class_from_the_config_type() -> None:
    from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer_core.models.registry import model_class_for

    assert model_class_for(load_model_config(FLASH)) is DeepseekV4ForCausalLM
    with pytest.raises(UnsupportedModelError):
        model_class_for(object())
