"""DeepSeek-V4.1 config parsing: defaults, derived layer roles, release spellings, errors naming the field."""

from __future__ import annotations

import json

import pytest

from deepinfer_core.model_config import ModelConfigError
from deepinfer_core.models.deepseek_v41 import parse_deepseek_v41_config
from v41_fixtures import FIXTURES

RELEASE = {
    "model_type": "deepseek_v41",
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "text_config": {
        "num_hidden_layers": 40, "engram_pad_token_id": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
    },
}


def _text(raw: dict) -> dict:
    return {**RELEASE, "text_config": {**RELEASE["text_config"], **raw}}


def test_release_defaults_and_roles() -> None:
    c = parse_deepseek_v41_config(RELEASE)
    t = c.text_config
    assert t.compress_ratios == tuple([0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    assert t.kv_source_layer_ids == (2, 8, 14, 20)
    assert t.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert t.candidate_source_layer_id == 20 and t.engram_layer_ids == (1, 14) and t.engram_pad_id == 2
    assert [t.kv_source_of(i) for i in (1, 7, 8, 19, 39)] == [None, 2, 8, 14, 20]
    assert t.uses_candidates(24) and not t.uses_candidates(20) and not t.uses_candidates(25)
    assert t.rope_compress.rope_type == "yarn" and t.rope_compress.rope_theta == 160000.0
    assert t.rope_main.rope_type == "default" and t.rms_norm_eps == 1e-20
    assert c.quantization_config.weight_block_size == (32, 32)
    assert (c.model_type, c.vocab_size, c.eos_token_id, c.max_position_embeddings) == ("deepseek_v41", 129280, 1, 1048576)


def test_fixture_configs_parse_with_their_layouts() -> None:
    a = parse_deepseek_v41_config(json.loads((FIXTURES / "a_release_like/checkpoint/config.json").read_text()))
    b = parse_deepseek_v41_config(json.loads((FIXTURES / "b_mixed_ratios/checkpoint/config.json").read_text()))
    assert a.text_config.band_ratios == {2: 2, 4: 2, 5: 1}
    assert b.text_config.band_ratios == {1: 4, 3: 2, 5: 1}
    assert b.text_config.uses_candidates(6) and not b.text_config.uses_candidates(2)


def test_small_default_schedule_and_derived_sources() -> None:
    t = parse_deepseek_v41_config({"num_hidden_layers": 7, "num_nextn_predict_layers": 0}).text_config
    assert t.compress_ratios == (0, 0, 2, 2, 2, 1, 1)
    assert t.kv_source_layer_ids == (2, 5) and t.index_source_layer_ids == (2, 5)
    assert t.candidate_source_layer_id == 5


@pytest.mark.parametrize(
    "change,field",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}}, "rope_scaling"),
        ({"engram_pad_id": 3}, "engram_pad"),
        ({"compress_ratios": [0, 2, 1]}, "compress_ratios"),
        ({"kv_source_layer_ids": [3, 8, 14, 20]}, "compress_ratios"),
        ({"kv_source_layer_ids": [1, 8, 14, 20]}, "kv_source_layer_ids"),
        ({"candidate_source_layer_id": 21}, "candidate_source_layer_id"),
        ({"index_source_layer_ids": [2, 8, 20, 24]}, "index_source_layer_ids"),
        ({"candidate_source_layer_id": 8}, "candidate_source_layer_id"),
    ],
)
def test_inconsistent_configs_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        parse_deepseek_v41_config(_text(change))


def test_non_fp8_quantization_is_rejected() -> None:
    with pytest.raises(ModelConfigError, match="quant_method"):
        parse_deepseek_v41_config({**RELEASE, "quantization_config": {"quant_method": "gptq"}})
