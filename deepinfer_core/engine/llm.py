"""The offline API: `LLM(model, ...).generate(prompts, sampling_params)` and `LLM.chat(...)`.

Bad requests are reported before anything runs: `generate` validates every prompt first and raises
`InvalidRequestError` naming the request's index and what is wrong; nothing is queued then, so the
other requests are unharmed and the engine stays usable.

With `ep`, `dp` or `cp` above 1 one `LLM` is served by several ranks (`engine/parallel_llm.py`): it
spawns one process per rank, or, started by torchrun, is one rank itself.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from deepinfer_core.config import EngineConfig, ParallelConfig, PrefixCachingConfig, SchedulerConfig
from deepinfer_core.engine.chat import encode_conversation, split_images
from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.images import (
    ImageInputError,
    PendingImages,
    PromptImages,
    checkpoint_has_vision,
    prompt_images,
)
from deepinfer_core.engine.kv_cache import KVCacheManager, plan_kv_pool
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.engine.parallel_llm import (
    EplbRecord,
    RankRuntime,
    SpawnedRanks,
    check_parallel,
    is_rank_process,
    local_rank,
)
from deepinfer_core.engine.prefix_cache import prefix_reuse_for
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.speculation import load_draft_layers
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
    """Offline generation on one backend, or over several ranks.

    Parallelism (see `engine/parallel_llm.py` and `config.ParallelConfig`):
    - `ep`: expert parallelism, each MoE layer's experts spread over `ep` ranks (each loads only its own);
    - `dp`: attention data parallelism, requests split over `dp` ranks, each with its own KV cache
      (ep must divide dp; the run has dp ranks, else ep);
    - `cp`: context parallelism over `cp` ranks (alone for now);
    - `num_redundant_experts`: extra expert slots per layer of an EP group for copies of busy experts;
    - `eplb_interval_steps`: re-place experts by the observed load every this many steps (None = never);
    - `parallel_timeout_s`: the longest a rank may wait in a collective (a hung peer fails the run in
      this time; a dead one at once) and spawned ranks may take to load the model.
    Outside torchrun, ranks are spawned processes: a dead or hung rank raises `RankFailed` /
    `LaunchTimeout`; call `shutdown()` to stop them early (they stop with the `LLM` otherwise).
    """

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
        fp8_activations: bool = False,
        enforce_eager: bool = False,
        ep: int = 1,
        dp: int = 1,
        cp: int = 1,
        num_redundant_experts: int = 0,
        eplb_interval_steps: int | None = None,
        parallel_timeout_s: float = 600.0,
        enable_prefix_caching: bool = False,
        prefix_reuse: str = "exact",
        decoder_replay_span: int = 140,
        num_prefix_snapshots: int | None = None,
    ) -> None:
        config = EngineConfig(
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
            parallel=ParallelConfig(ep=ep, dp=dp, cp=cp, num_redundant_experts=num_redundant_experts,
                                    eplb_interval_steps=eplb_interval_steps, timeout_s=parallel_timeout_s),
            **({} if batch_invariant is None else {"batch_invariant": batch_invariant}),
            fp8_activations=fp8_activations,
            enforce_eager=enforce_eager,
            prefix_caching=PrefixCachingConfig(enabled=enable_prefix_caching, reuse=prefix_reuse,
                                               decoder_replay_span=decoder_replay_span,
                                               num_snapshots=num_prefix_snapshots),
        )
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An `LLM` from a validated config (how spawned ranks build theirs)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self._grammar_compiler: GrammarCompiler | None = None
        self._rank: RankRuntime | None = None
        self._workers: SpawnedRanks | None = None
        if config.parallel.world_size > 1 and not is_rank_process():
            self._describe(config, device_index=0)
            # Bad rank counts fail here, before any process starts.
            check_parallel(config.parallel, self.model_config, speculative=config.speculative is not None)
            self.engine = None
            self._workers = SpawnedRanks(config, self.backend, recoverable=(InvalidRequestError,))
        else:
            self.engine = self._build_engine(config)

    def _describe(self, config: EngineConfig, device_index: int) -> None:
        """The checkpoint, backend, dtype and tokenizer: what a driver needs without the model."""
        from deepinfer_core.model_config import load_model_config
        from deepinfer_core.platform.registry import select_backend
        from deepinfer_core.weights.resolve import resolve_model_path

        self.checkpoint_dir = resolve_model_path(config.model)
        self.model_config = load_model_config(self.checkpoint_dir)
        self.backend = select_backend(config.accelerator, device_index)
        self.capabilities = self.backend.capabilities()
        if config.batch_invariant and not self.capabilities.batch_invariant:
            raise CapabilityUnavailable(
                f"batch_invariant=True (or DEEPINFER_BATCH_INVARIANT=1) needs batch-invariant kernels, and "
                f"backend '{self.backend.name}' does not claim them (`deepinfer backends` lists each backend's "
                "capabilities); turn the mode off"
            )
        self.dtype = self._resolve_dtype(config.dtype)
        self.tokenizer = _load_tokenizer(self.checkpoint_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings

    def _build_engine(self, config: EngineConfig) -> LLMEngine:
        from deepinfer_core.models.registry import cache_class_for, kv_cache_options, model_class_for
        from deepinfer_core.weights.loader import load_model_weights

        parallel = config.parallel.world_size > 1
        self._describe(config, device_index=local_rank() if parallel else 0)
        if parallel:
            self._rank = RankRuntime(config.parallel, self.model_config, self.backend,
                                     speculative=config.speculative is not None)
        experts = self._rank.model_options() if parallel else {}  # this rank's experts only
        kv_options = kv_cache_options(self.model_config, config.kv_cache_dtype)
        ops = self.backend.ops()
        ops.batch_invariant = config.batch_invariant  # the runner samples with these same ops (model.ops)
        ops.fp8_activations = config.fp8_activations
        vision = {"vision": True} if checkpoint_has_vision(self.checkpoint_dir) else {}  # V4.1's tower
        model = model_class_for(self.model_config)(self.model_config, ops, self.dtype, self.backend.device,
                                                  **kv_options, **experts, **vision)
        if config.fp8_activations and not any(
            t.dtype == torch.float8_e4m3fn for t in itertools.chain(model.parameters(), model.buffers())
        ):
            raise ValueError(
                "fp8_activations=True quantises the inputs of fp8-weight projections, and this checkpoint has no "
                f"fp8 weights ({self.checkpoint_dir}); quantise it (scripts/quantize_checkpoint.py) or turn it off"
            )
        if parallel:
            self._rank.before_load(model)
        load_model_weights(model, self.checkpoint_dir, **experts)
        if parallel:
            self._rank.after_load(model)
        if hasattr(model, "bind_tokenizer_dir"):  # V4.1's engram layers hash the tokenizer's vocabulary
            model.bind_tokenizer_dir(self.checkpoint_dir)
        self.model = model.eval()
        # V4.1's DSpark layers load before the KV pool is sized from the free memory
        draft_layers = None if config.speculative is None else load_draft_layers(model, config.speculative,
                                                                                 self.checkpoint_dir)

        cache_cls = cache_class_for(self.model_config)
        multiple = cache_cls.block_size_multiple(self.model_config)
        block_size = config.block_size or multiple
        if block_size % multiple:
            raise ValueError(f"block_size {block_size} must be a multiple of {multiple} (the lcm of the "
                             f"model's compress ratios)")
        memory = self.backend.memory()
        num_slots = config.scheduler.max_num_seqs
        reuse = prefix_reuse_for(config, self.model_config)
        plan = plan_kv_pool(
            bytes_per_block=cache_cls.bytes_per_block(self.model_config, block_size, self.dtype, **kv_options),
            bytes_per_slot=cache_cls.bytes_per_slot(self.model_config, self.dtype, **kv_options),
            num_slots=num_slots,
            block_size=block_size,
            available_bytes=int(memory.memory_info().free_bytes * config.kv_cache_memory_fraction),
            num_blocks=config.num_kv_blocks,
            max_useful_blocks=num_slots * -(-self.max_model_len // block_size),
            num_snapshots=0 if reuse is None else reuse.num_snapshots,
        )
        graphs = (not config.enforce_eager and self.capabilities.graphs and memory.supports_graphs and not parallel
                  and config.speculative is None and ops.capturable_decode and getattr(model, "decode_graphs", False))
        spare = int(graphs)  # a slot and a block that only graph padding rows touch
        slots = plan.num_slots + plan.num_snapshots
        cache = cache_cls(self.model_config, num_blocks=plan.num_blocks + spare, block_size=plan.block_size,
                          num_slots=slots + spare, dtype=self.dtype, allocate=memory.allocate, **kv_options)
        decode_graphs = None
        if graphs:
            decode_graphs = DecodeGraphs(
                model, cache, memory, self.backend.device, spare_slot=slots, spare_block=plan.num_blocks,
                block_size=plan.block_size, max_num_seqs=num_slots, max_model_len=self.max_model_len,
            )
        self.kv = KVCacheManager(plan, reuse)
        eos = self.model_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        return LLMEngine(
            scheduler=Scheduler(config.scheduler, self.kv),
            runner=ModelRunner(self.model, cache, self.backend, config.scheduler.max_num_seqs,
                               config.speculative, draft_layers=draft_layers, decode_graphs=decode_graphs),
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
        """Complete every prompt; outputs come back in the order of `prompts`. Over several ranks
        under torchrun, every rank calls it with the same prompts and gets every output.

        A prompt is a str, {"prompt": str} or {"prompt_token_ids": [...]}; a dict may add "images" (a list,
        or "multi_modal_data": {"image": ...}) with one image token per image in the prompt (engine/images.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        if self._workers is not None:
            return self._workers.generate(list(prompts), params)
        requests = [self._validated(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        images = self._embedded_images([request[4] for request in requests])
        requests = [request[:4] for request in requests]
        if self._rank is not None:
            return self._rank.generate(self.engine, requests, use_tqdm)
        order = {}
        for index, ((text, token_ids, sp, grammar), request_images) in enumerate(zip(requests, images)):
            with_images = {} if request_images is None else {"images": request_images}
            order[self.engine.add_request(token_ids, sp, text, grammar, **with_images)] = index
        return self._run(order, use_tqdm)

    def _embedded_images(self, pending: list[PendingImages | None]) -> list[PromptImages | None]:
        """Run the vision tower over every validated request's images (one call for all of them)."""
        flat = [image for request in pending if request is not None for image in request.images]
        if not flat:
            return [None] * len(pending)
        spans = iter(self.model.embed_images([i.patches for i in flat], [i.grid for i in flat]))
        return [None if request is None else
                PromptImages(request.spans, torch.cat([next(spans) for _ in request.images]))
                for request in pending]

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
        deepseek-recipe's options. A user message's content may be a list of OpenAI-style parts with
        images ({"type": "image_url", "image_url": {"url": "data:..."}} or {"type": "image", "image": <PIL
        image, local path, bytes>}) for a model with a vision tower.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        image_token = self._image_token()
        prompts = []
        for conversation in conversations:
            conversation, images = split_images(conversation, image_token)
            token_ids = encode_conversation(
                conversation, tokenizer=self.tokenizer, checkpoint_dir=self.checkpoint_dir,
                model_type=self.model_config.model_type, thinking_mode=thinking_mode,
                reasoning_effort=reasoning_effort, image_token=image_token,
            )
            prompts.append({"prompt_token_ids": token_ids, **({"images": images} if images else {})})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _image_token(self) -> str | None:
        """The tokenizer's spelling of the config's image token id (None: the model takes no images)."""
        image_token_id = getattr(self.model_config, "image_token_id", None)
        if image_token_id is None or self.tokenizer is None or image_token_id >= len(self.tokenizer):
            return None
        return self.tokenizer.convert_ids_to_tokens(image_token_id)

    def rank_summaries(self) -> list[dict[str, float]]:
        """Engine statistics (`EngineStats.summary()`) of each rank this process runs or drives."""
        if self._workers is not None:
            return self._workers.rank_summaries()
        return [self.engine.stats.summary()]

    def eplb_records(self) -> list[EplbRecord]:
        """The expert re-placements EPLB made so far, oldest first (none without eplb_interval_steps)."""
        if self._workers is not None:
            return self._workers.eplb_records()
        return [] if self._rank is None else list(self._rank.eplb_records)

    def shutdown(self) -> None:
        """Stop the spawned rank processes now (a no-op in one process); the LLM is unusable after."""
        if self._workers is not None:
            self._workers.close()

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
    ) -> tuple[str | None, list[int], SamplingParams, PendingGrammar | None, PendingImages | None]:
        def fail(problem: str) -> InvalidRequestError:
            return InvalidRequestError(f"request {index}: {problem}; no request was run")

        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise fail(f"{self.checkpoint_dir} has no tokenizer: pass {{'prompt_token_ids': [...]}}")
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and self.tokenizer is not None:
            text, token_ids = prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
        else:
            raise fail(f"a prompt is a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}} (either dict may add "
                       f"'images'), got {type(prompt).__name__}")
        try:
            token_ids, images = prompt_images(prompt, token_ids, self.model, self.model_config)
        except ImageInputError as error:
            raise fail(str(error)) from error
        if images is not None and self._rank is not None:
            raise fail("images are not supported over several ranks (ep/dp/cp > 1)")
        budget = self.engine.scheduler.config.max_num_batched_tokens
        if images is not None and images.end > budget:
            raise fail(f"the prompt's image spans end at token {images.end}, beyond max_num_batched_tokens {budget}: "
                       "an image is prefilled in one step; raise max_num_batched_tokens or use smaller images")
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
        return text, token_ids, params, grammar, images

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
