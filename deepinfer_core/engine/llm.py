"""The offline API: `LLM(model, ...).generate(prompts, sampling_params)` and `LLM.chat(...)`.

Bad requests are reported before anything runs: `generate` validates every prompt first and raises
`InvalidRequestError` naming the request's index and what is wrong; nothing is queued then, so the
other requests are unharmed and the engine stays usable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from deepinfer_core.config import EngineConfig, SchedulerConfig
from deepinfer_core.engine.chat import encode_conversation
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.kv_cache import KVCacheManager, plan_kv_pool
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.structured import InvalidGrammarError
from deepinfer_core.platform.errors import CapabilityUnavailable
from deepinfer_core.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    from deepinfer_core.engine.grammar import GrammarCompiler, PendingGrammar

__all__ = ["LLM", "InvalidRequestError"]

Prompt = str | dict[str, Any]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InvalidRequestError(ValueError):
    """A request cannot run (empty, too long, unknown token ids, ...); nothing was queued."""


class LLM:
    def __init__(
        self,
        model: str | None = None,
        accelerator: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        async_scheduling: bool = True,
        seed: int = 0,
        kv_cache_memory_fraction: float = 0.9,
        num_kv_blocks: int | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        kv_cache_dtype: str = "auto",
        speculative: SpeculativeConfig | None = None,
        batch_invariant: bool | None = None,
    ) -> None:
        self.config = EngineConfig(
            model=model,
            accelerator=accelerator,
            dtype=dtype,
            seed=seed,
            kv_cache_memory_fraction=kv_cache_memory_fraction,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            kv_cache_dtype=kv_cache_dtype,
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                async_scheduling=async_scheduling,
            ),
            speculative=speculative,
            **({} if batch_invariant is None else {"batch_invariant": batch_invariant}),
        )
        self._grammar_compiler: GrammarCompiler | None = None
        self.engine = self._build_engine(self.config)

    def _build_engine(self, config: EngineConfig) -> LLMEngine:
        from deepinfer_core.model_config import load_model_config
        from deepinfer_core.models.registry import cache_class_for, kv_cache_options, model_class_for
        from deepinfer_core.platform.registry import select_backend
        from deepinfer_core.weights.loader import load_model_weights
        from deepinfer_core.weights.resolve import resolve_model_path

        self.checkpoint_dir = resolve_model_path(config.model)
        self.model_config = load_model_config(self.checkpoint_dir)
        self.backend = select_backend(config.accelerator)
        self.capabilities = self.backend.capabilities()
        if config.batch_invariant and not self.capabilities.batch_invariant:
            raise CapabilityUnavailable(
                f"batch_invariant=True (or DEEPINFER_BATCH_INVARIANT=1) needs batch-invariant kernels, and "
                f"backend '{self.backend.name}' does not claim them (`deepinfer backends` lists each backend's "
                "capabilities); turn the mode off"
            )
        self.dtype = self._resolve_dtype(config.dtype)
        kv_options = kv_cache_options(self.model_config, config.kv_cache_dtype)
        model = model_class_for(self.model_config)(self.model_config, self.backend.ops(), self.dtype,
                                                  self.backend.device, **kv_options)
        load_model_weights(model, self.checkpoint_dir)
        if hasattr(model, "bind_tokenizer_dir"):  # V4.1's engram layers hash the tokenizer's vocabulary
            model.bind_tokenizer_dir(self.checkpoint_dir)
        self.model = model.eval()
        self.tokenizer = _load_tokenizer(self.checkpoint_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings

        cache_cls = cache_class_for(self.model_config)
        multiple = cache_cls.block_size_multiple(self.model_config)
        block_size = config.block_size or multiple
        if block_size % multiple:
            raise ValueError(f"block_size {block_size} must be a multiple of {multiple} (the lcm of the "
                             f"model's compress ratios)")
        memory = self.backend.memory()
        num_slots = config.scheduler.max_num_seqs
        plan = plan_kv_pool(
            bytes_per_block=cache_cls.bytes_per_block(self.model_config, block_size, self.dtype, **kv_options),
            bytes_per_slot=cache_cls.bytes_per_slot(self.model_config, self.dtype, **kv_options),
            num_slots=num_slots,
            block_size=block_size,
            available_bytes=int(memory.memory_info().free_bytes * config.kv_cache_memory_fraction),
            num_blocks=config.num_kv_blocks,
            max_useful_blocks=num_slots * -(-self.max_model_len // block_size),
        )
        cache = cache_cls(self.model_config, num_blocks=plan.num_blocks, block_size=plan.block_size,
                          num_slots=plan.num_slots, dtype=self.dtype, allocate=memory.allocate, **kv_options)
        self.kv = KVCacheManager(plan)
        eos = self.model_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        return LLMEngine(
            scheduler=Scheduler(config.scheduler, self.kv),
            runner=ModelRunner(self.model, cache, self.backend, config.scheduler.max_num_seqs,
                               config.speculative),
            tokenizer=self.tokenizer,
            eos_token_ids=eos_ids,
            max_model_len=self.max_model_len,
            seed=config.seed,
            async_scheduling=config.scheduler.async_scheduling,
            # n > 1 prefills the prompt once where the cache can copy a sequence's state; with
            # speculation each completion prefills its own, so the drafter's cache sees every row
            fork_prompts=callable(getattr(cache, "copy_sequence", None)) and config.speculative is None,
        )

    def _resolve_dtype(self, name: str) -> torch.dtype:
        if name != "auto":
            return _DTYPES[name]
        raw = json.loads((self.checkpoint_dir / "config.json").read_text())
        stored = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        return _DTYPES.get(stored, torch.bfloat16)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of `prompts`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        requests = [self._validated(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        order = {}
        for index, (text, token_ids, sp, grammar) in enumerate(requests):
            order[self.engine.add_request(token_ids, sp, text, grammar)] = index
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        thinking_mode: bool = True,
        reasoning_effort: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them.

        Rendered with the tokenizer's chat template when it has one, else with deepseek-recipe's
        encoding for the checkpoint's model_type; `thinking_mode` and `reasoning_effort` are
        deepseek-recipe's options.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": encode_conversation(
                conversation, tokenizer=self.tokenizer, checkpoint_dir=self.checkpoint_dir,
                model_type=self.model_config.model_type, thinking_mode=thinking_mode,
                reasoning_effort=reasoning_effort,
            )}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, order: dict[int, int], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        outputs: list[RequestOutput | None] = [None] * len(order)
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.request_id in order:
                        outputs[order[output.request_id]] = output
                        bar.update(1)
        return outputs

    def _validated(
        self, index: int, prompt: Prompt, params: SamplingParams
    ) -> tuple[str | None, list[int], SamplingParams, PendingGrammar | None]:
        def fail(problem: str) -> InvalidRequestError:
            return InvalidRequestError(f"request {index}: {problem}; no request was run")

        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise fail(f"{self.checkpoint_dir} has no tokenizer: pass {{'prompt_token_ids': [...]}}")
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            raise fail(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise fail("the prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise fail(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise fail(f"the prompt has {len(token_ids)} tokens; max_model_len {self.max_model_len} leaves "
                       "no room for an output")
        need = self.kv.blocks_for(min(len(token_ids) + params.max_tokens, self.max_model_len))
        if need > self.kv.num_blocks:
            raise fail(f"prompt + max_tokens needs {need} KV blocks, the pool has {self.kv.num_blocks}; "
                       "lower max_tokens or raise num_kv_blocks")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise fail(f"SamplingParams.{name}={getattr(params, name)} exceeds the vocabulary ({vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise fail(f"stop_token_ids {params.stop_token_ids} reach outside the vocabulary [0, {vocab})")
        if params.seed is not None and params.temperature > 0 and not self.capabilities.deterministic_sampling:
            raise fail(f"a seed promises reproducible sampling, which backend '{self.backend.name}' does not "
                       "claim (deterministic_sampling=False); drop the seed or use a backend that claims it")
        grammar = None
        if params.structured_output is not None:
            if self.tokenizer is None:
                raise fail(f"structured_output needs a tokenizer and {self.checkpoint_dir} has none")
            try:
                grammar = self._grammars().submit(params.structured_output)
            except InvalidGrammarError as error:
                raise fail(str(error)) from error
        return text, token_ids, params, grammar

    def _grammars(self) -> GrammarCompiler:
        """Built on the first structured request: xgrammar's vocabulary scan takes ~2 s on a
        129k-token tokenizer."""
        if self._grammar_compiler is None:
            from deepinfer_core.engine.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, stop_token_ids=sorted(self.engine.eos_token_ids)
            )
        return self._grammar_compiler


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one "
                                  "per prompt")
    return params


def _load_tokenizer(checkpoint_dir: Path) -> Any:
    if not any((checkpoint_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir)
