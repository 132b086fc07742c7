"""The offline API: validation, stop conditions, abort, chat, detokenisation, diagnostics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from deepinfer_core import LLM, EngineConfig, InvalidRequestError, SamplingParams
from deepinfer_core.engine.chat import encode_conversation
from deepinfer_core.engine.detokenizer import IncrementalDetokenizer

PROMPT = {"prompt_token_ids": [40, 41, 300, 7, 99]}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=8,
               num_kv_blocks=24, max_model_len=256)


def greedy(**options) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": 20, **options})


@pytest.mark.parametrize(
    ("options", "field"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
     ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"),
     ({"stop": [""]}, "stop"), ({"logprobs": -1}, "logprobs"), ({"bogus": 1}, "bogus")],
)
def test_sampling_params_errors_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**options)


def test_engine_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5)
    with pytest.raises(ValidationError, match="max_num_seqs"):
        LLM("unused", max_num_seqs=0)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [({"prompt_token_ids": []}, greedy(), "empty"),
     ({"prompt_token_ids": [3, 512]}, greedy(), "outside the vocabulary"),
     ({"prompt_token_ids": [3] * 256}, greedy(), "max_model_len"),
     (PROMPT, greedy(max_tokens=2000), "KV blocks"),
     (PROMPT, greedy(logprobs=100_000), "logprobs"),
     (42, greedy(), "prompt_token_ids")],
)
def test_bad_request_fails_alone_and_names_its_index(llm: LLM, prompt, params, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"request 1: .*{message}"):
        llm.generate([PROMPT, prompt, PROMPT], [greedy(), params, greedy()], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    [ok] = llm.generate([PROMPT], greedy(max_tokens=3), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 3


def test_stop_conditions(llm: LLM) -> None:
    [base] = llm.generate([PROMPT], greedy(max_tokens=30), use_tqdm=False)
    tokens, text = base.outputs[0].token_ids, base.outputs[0].text
    assert base.outputs[0].finish_reason == "length" and len(tokens) == 30

    stop_id = tokens[6]
    [by_id] = llm.generate([PROMPT], greedy(max_tokens=30, stop_token_ids=[stop_id]), use_tqdm=False)
    cut = tokens.index(stop_id) + 1
    assert by_id.outputs[0].token_ids == tokens[:cut]
    assert (by_id.outputs[0].finish_reason, by_id.outputs[0].stop_reason) == ("stop", stop_id)

    stop = text.strip()[10:14]
    assert len(stop) == 4
    [by_text] = llm.generate([PROMPT], greedy(max_tokens=30, stop=stop), use_tqdm=False)
    assert by_text.outputs[0].text == text[:text.index(stop)]
    assert (by_text.outputs[0].finish_reason, by_text.outputs[0].stop_reason) == ("stop", stop)

    eos_before = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {tokens[3]}
    try:
        [by_eos] = llm.generate([PROMPT], greedy(max_tokens=30, ignore_eos=False), use_tqdm=False)
        [ignored] = llm.generate([PROMPT], greedy(max_tokens=30), use_tqdm=False)
    finally:
        llm.engine.eos_token_ids = eos_before
    assert by_eos.outputs[0].token_ids == tokens[:tokens.index(tokens[3]) + 1]
    assert ignored.outputs[0].token_ids == tokens


def test_string_prompts_and_per_prompt_params(llm: LLM) -> None:
    outputs = llm.generate(["def main():", "import os"], [greedy(max_tokens=4), greedy(max_tokens=6)],
                           use_tqdm=False)
    assert [o.prompt for o in outputs] == ["def main():", "import os"]
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("def main():")
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 6]


def test_abort_frees_the_cache(llm: LLM) -> None:
    free = llm.kv.num_free_blocks
    request_id = llm.engine.add_request([5] * 30, greedy(max_tokens=50))
    llm.engine.step()
    llm.engine.step()
    assert llm.kv.num_free_blocks < free
    llm.engine.abort(request_id)
    while llm.engine._in_flight is not None or llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.kv.num_free_blocks == free and not llm.engine.has_unfinished()


def test_chat_uses_the_tokenizer_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    [output] = llm.chat(messages, greedy(max_tokens=5), use_tqdm=False)
    expected = llm.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
    assert output.prompt_token_ids == list(expected)
    assert len(output.outputs[0].token_ids) == 5


def test_deepseek_recipe_renders_without_a_template(llm: LLM, tmp_path: Path) -> None:
    """A checkpoint without a chat template goes through deepseek-recipe's V4 encoding."""
    import deepseek_recipe as recipe
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(llm.checkpoint_dir / "tokenizer.json"))
    specials = [getattr(recipe.SpecialToken, name).default_str()
                for name in ("Bos", "Eos", "ThinkingStart", "ThinkingEnd", "System", "User", "Assistant",
                             "LatestReminder", "Dsml")]
    tokenizer.add_special_tokens(specials)  # the real V4 vocabulary has them all
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    class NoTemplate:
        chat_template = None

    ids = encode_conversation(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenizer=NoTemplate(), checkpoint_dir=tmp_path, model_type="deepseek_v4",
        thinking_mode=False, reasoning_effort=None,
    )
    assert tokenizer.decode(ids, skip_special_tokens=False).replace(" ", "") == (
        "<｜begin▁of▁sentence｜>Bebrief.<｜User｜>Hi<｜Assistant｜></think>"
    )


def test_incremental_detokenizer_matches_full_decode(llm: LLM) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 512, (80,), generator=gen).tolist()
    detok = IncrementalDetokenizer(llm.tokenizer, ids[:5], [])
    for token in ids[5:]:
        detok.add_token(token)
    full = llm.tokenizer.decode(ids[5:], skip_special_tokens=True)
    assert full.startswith(detok.text) and len(full) - len(detok.text) <= 1  # a held-back partial char


def test_diagnostics_are_recorded(llm: LLM) -> None:
    steps_before = llm.engine.stats.num_steps
    llm.generate([PROMPT] * 3, greedy(max_tokens=5), use_tqdm=False)
    summary = llm.engine.stats.summary()
    assert llm.engine.stats.num_steps > steps_before
    assert summary["decode_tokens"] > 0 and summary["prefill_tokens"] > 0
    assert summary["device_ms_per_step"] > 0 and summary["host_ms_per_step"] > 0


def test_batch_invariant_mode_needs_a_backend_that_claims_it(tiny_checkpoint: Path, monkeypatch) -> None:
    from dataclasses import replace

    from deepinfer_core.platform.errors import CapabilityUnavailable
    from deepinfer_core.reference.backend import CpuBackend

    claimed = CpuBackend.capabilities  # cpu claims the mode: stand in for a backend (ascend) that does not
    monkeypatch.setattr(CpuBackend, "capabilities", lambda self: replace(claimed(self), batch_invariant=False))
    with pytest.raises(CapabilityUnavailable, match="backend 'cpu' does not claim them"):
        LLM(str(tiny_checkpoint), accelerator="cpu", num_kv_blocks=64, batch_invariant=True)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    with pytest.raises(CapabilityUnavailable, match="DEEPINFER_BATCH_INVARIANT"):
        LLM(str(tiny_checkpoint), accelerator="cpu", num_kv_blocks=64)


def test_seeded_sampling_needs_deterministic_sampling(llm: LLM, monkeypatch) -> None:
    from dataclasses import replace

    monkeypatch.setattr(llm, "capabilities", replace(llm.capabilities, deterministic_sampling=False))
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="request 1: a seed promises reproducible sampling"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}], [greedy(max_tokens=2), seeded])
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], greedy(max_tokens=2))[0].outputs[0].token_ids) == 2
