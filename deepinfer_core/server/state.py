"""Everything the HTTP handlers share: the engine front end, the model's name and formats, the
limits and the metrics."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as recipe

from deepinfer_core.engine.grammar import GrammarCompiler, PendingGrammar
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.structured import InvalidGrammarError
from deepinfer_core.server.async_engine import AsyncEngine
from deepinfer_core.server.conversation_prompt import (
    ConversationEncoder,
    model_version_for,
)
from deepinfer_core.server.limits import ServerLimits
from deepinfer_core.server.metrics import ServerMetrics
from deepinfer_core.server.protocol import APIError

__all__ = ["ServerState"]


@dataclass(slots=True)
class ServerState:
    llm: Any                      # deepinfer_core.LLM: the model, tokenizer, KV pool and engine
    engine: AsyncEngine
    metrics: ServerMetrics
    limits: ServerLimits
    model_name: str
    encoder: ConversationEncoder
    conversion: recipe.ConversionOptions
    _grammars: GrammarCompiler | None = None
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(cls, llm: Any, model_name: str, limits: ServerLimits) -> ServerState:
        version = model_version_for(llm.model_config.model_type)
        encoder = ConversationEncoder(llm.tokenizer, llm.checkpoint_dir, llm.model_config.model_type)
        # A chat template renders no thinking; requests then default to answers without reasoning.
        conversion = recipe.ConversionOptions(
            default_thinking_mode=not encoder.uses_chat_template,
        ).with_model_versions_by_name({model_name: version})
        metrics = ServerMetrics()
        return cls(
            llm=llm,
            engine=AsyncEngine(llm.engine, metrics),
            metrics=metrics,
            limits=limits,
            model_name=model_name,
            encoder=encoder,
            conversion=conversion,
        )

    def check_prompt(self, token_ids: list[int], max_tokens: int) -> None:
        """Refuse a prompt the engine could never finish, before it is queued."""
        vocab = self.llm.model_config.vocab_size
        if not token_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
        if len(token_ids) + max_tokens > self.context_limit:
            raise APIError(400, f"the prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"{self.context_limit} tokens one request may hold here (the model's context or the "
                           "KV cache, whichever is less); shorten the prompt or lower max_tokens",
                           param="max_tokens")

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + output) one request can have: the model's context, or what the
        KV pool holds if that is less."""
        kv = self.llm.kv
        return min(self.llm.max_model_len, kv.num_blocks * kv.block_size)

    async def grammar_for(self, params: SamplingParams) -> PendingGrammar | None:
        """Check and start compiling the request's output constraint, off the event loop; an
        invalid regex, schema or grammar is a 400."""
        if params.structured_output is None:
            return None
        if self.llm.tokenizer is None:
            raise APIError(400, "output constraints need a tokenizer and this model has none")
        try:
            return await asyncio.to_thread(self._submit_grammar, params)
        except InvalidGrammarError as error:
            raise APIError(400, str(error), param="response_format") from None

    def _submit_grammar(self, params: SamplingParams) -> PendingGrammar:
        with self._grammars_lock:
            if self._grammars is None:  # xgrammar scans the vocabulary once, on first use
                self._grammars = GrammarCompiler(self.llm.tokenizer, self.llm.model_config.vocab_size,
                                                 stop_token_ids=sorted(self.llm.engine.eos_token_ids))
        return self._grammars.submit(params.structured_output)
