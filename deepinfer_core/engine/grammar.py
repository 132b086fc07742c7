"""Grammars through xgrammar: each distinct `StructuredOutput` compiled once, on a worker thread,
against the model's tokenizer; one matcher per sample tracks which tokens may come next.

The engine's part, in order: `GrammarCompiler.submit` when a request arrives (a bad constraint
raises `InvalidGrammarError` for that request alone); `PendingGrammar.new_matcher` once per sample
when the request is first scheduled; `GrammarBitmask.fill` and `.apply` (grammar_bitmask.py) each
step; `GrammarMatcher.accept` for each sampled token, `.rollback` for rejected drafts; the sample
finishes with "stop" once `GrammarMatcher.is_terminated()`.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from deepinfer_core.engine.structured import GrammarKind, InvalidGrammarError, StructuredOutput

__all__ = ["GrammarCompiler", "GrammarMatcher", "PendingGrammar"]

# NOTE: JSON allows any whitespace between tokens, but a run is capped: some models otherwise emit
# newlines forever inside a constrained object. 32 still fits pretty-printing several levels deep.
_JSON_MAX_WHITESPACE_RUN = 32

# xgrammar prefixes its messages with a timestamp and a C++ source location.
_XGRAMMAR_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


# NOTE: xgrammar 0.2.9 turns a string's minLength/maxLength into `[^"\\\r\n]{m,n}`, which admits
# raw control characters (a tab, say), making the output invalid JSON. The same bounds written as a
# pattern over JSON-safe characters exclude them; `_bound_strings_by_pattern` rewrites them so.
_JSON_SAFE_CHAR = r'[^"\\\x00-\x1f]'
_SUBSCHEMA_KEYS = frozenset({
    "items", "additionalItems", "unevaluatedItems", "contains", "additionalProperties",
    "unevaluatedProperties", "propertyNames", "not", "if", "then", "else",
})
_SUBSCHEMA_LIST_KEYS = frozenset({"prefixItems", "anyOf", "oneOf", "allOf", "items"})
_SUBSCHEMA_MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _bound_strings_by_pattern(schema: object) -> object:
    if not isinstance(schema, dict):
        return schema
    rewritten = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAP_KEYS and isinstance(value, dict):
            value = {name: _bound_strings_by_pattern(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LIST_KEYS and isinstance(value, list):
            value = [_bound_strings_by_pattern(sub) for sub in value]
        elif key in _SUBSCHEMA_KEYS:
            value = _bound_strings_by_pattern(value)
        rewritten[key] = value
    bounded = "minLength" in rewritten or "maxLength" in rewritten
    if rewritten.get("type") == "string" and bounded and not {"pattern", "format"} & rewritten.keys():
        low, high = rewritten.pop("minLength", 0), rewritten.pop("maxLength", "")
        rewritten["pattern"] = f"^{_JSON_SAFE_CHAR}{{{low},{high}}}$"
    return rewritten


def _invalid(kind: GrammarKind, error: Exception) -> InvalidGrammarError:
    return InvalidGrammarError(kind, _XGRAMMAR_LOCATION.sub("", str(error)).strip())


def _parse(kind: GrammarKind, spec: str) -> xgr.Grammar:
    try:
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec)
        if kind == "json_schema":
            schema = json.dumps(_bound_strings_by_pattern(json.loads(spec)))
            return xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=_JSON_MAX_WHITESPACE_RUN)
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}', strict_mode=False, max_whitespace_cnt=_JSON_MAX_WHITESPACE_RUN
        )
    except RuntimeError as error:
        raise _invalid(kind, error) from None


class GrammarMatcher:
    """The grammar state of one sample: which tokens may come next, given those accepted so far."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it or the
        matcher has already terminated."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts the target model rejected)."""
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token has been accepted."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a host int32 tensor of width
        ceil(vocab_size / 32); bit t set means token t allowed). The matcher must not be terminated."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_draft_bitmasks(self, draft_token_ids: list[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Write len(draft_token_ids) + 1 rows from `first_row`: the mask before each draft token
        and after the last. Rows past a draft the grammar forbids (or past a stop token) allow
        every token: the masked target gives that draft probability zero, so verification never
        samples from them, but they must stay finite. The matcher's state is unchanged afterwards."""
        self.fill_bitmask(bitmask, first_row)
        accepted = 0
        for token_id in draft_token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            accepted += 1
            row = first_row + accepted
            if self._matcher.is_terminated():
                bitmask[row].fill_(-1)
            else:
                self.fill_bitmask(bitmask, row)
        bitmask[first_row + accepted + 1 : first_row + len(draft_token_ids) + 1].fill_(-1)
        if accepted:
            self._matcher.rollback(accepted)

    @property
    def xgrammar_matcher(self) -> xgr.GrammarMatcher:
        """The underlying xgrammar matcher (for batched filling across matchers)."""
        return self._matcher


class PendingGrammar:
    """A constraint being compiled; the engine waits on it only when it first schedules the request."""

    __slots__ = ("kind", "_future")

    def __init__(self, kind: GrammarKind, future: Future[xgr.CompiledGrammar]) -> None:
        self.kind = kind
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def compiled(self, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Block until compiled; a compilation failure raises `InvalidGrammarError`."""
        try:
            return self._future.result(timeout)
        except RuntimeError as error:
            raise _invalid(self.kind, error) from None

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar: one per sample (n > 1 gets n)."""
        return GrammarMatcher(xgr.GrammarMatcher(self.compiled()))


class GrammarCompiler:
    """Compiles `StructuredOutput` constraints against one tokenizer and model vocabulary.

    `vocab_size` is the width of the model's logits, which may exceed the tokenizer's vocabulary
    (padded embedding) or fall short of it (tokens the model never emits); ids without a token are
    never allowed. A grammar completes by allowing only `stop_token_ids` (default: the tokenizer's
    EOS); accepting one terminates its matcher. Thread-safe.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        stop_token_ids: list[int] | None = None,
        max_workers: int = 1,
        max_cached_grammars: int = 128,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be the model's logits width (>= 1), got {vocab_size}")
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError(
                    "the tokenizer has no eos_token_id, so grammars would have no token to end on; "
                    "pass stop_token_ids"
                )
            stop_token_ids = [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        # Our cache below is keyed on the normalised spec; xgrammar's own would hold a second copy.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[GrammarKind, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._max_cached = max_cached_grammars
        self._lock = threading.Lock()

    def submit(self, structured_output: StructuredOutput) -> PendingGrammar:
        """Check the constraint now (raises `InvalidGrammarError`) and compile it in the background,
        or reuse the compilation of an equal constraint."""
        key = structured_output.cache_key()
        kind = key[0]
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return PendingGrammar(kind, future)
        grammar = _parse(*key)
        future = self._pool.submit(self._compiler.compile_grammar, grammar)
        future.add_done_callback(lambda done: self._forget_failed(key, done))
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return PendingGrammar(kind, future)

    def _forget_failed(self, key: tuple[GrammarKind, str], future: Future[xgr.CompiledGrammar]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def cached_grammars(self) -> int:
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        """Stop the compile workers (pending compilations are cancelled)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
