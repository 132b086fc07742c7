"""Structured output without the engine: a random "model" (seeded random logits, masked by the
grammar bitmask, sampled greedily and at temperature 1) over a real byte-level BPE tokenizer must
produce, for every constraint, output that terminates and that an independent checker accepts:
`re.fullmatch`, `jsonschema`, or a lark parser written separately for each EBNF grammar."""

from __future__ import annotations

import json
import pathlib
import re
import sysconfig

import jsonschema
import lark
import pydantic
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from deepinfer_core.engine.grammar_bitmask import GrammarBitmask, apply_token_bitmask, bitmask_width
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.grammar import GrammarCompiler, GrammarMatcher
from deepinfer_core.engine.structured import InvalidGrammarError, StructuredOutput

# Logits wider than the tokenizer (800 tokens) and not a multiple of 32: the padded ids must
# never be allowed and the last bitmask word is partial.
MODEL_VOCAB = 837
# A random model ends an unbounded repetition with probability ~1/(allowed tokens) per step, so
# lengths are geometric; with this budget a non-terminated output means a grammar that cannot end.
MAX_STEPS = 4000

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]+@[a-z]+\.(com|org|net)",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
    r"#[0-9a-fA-F]{6}",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"[a-z_][a-z0-9_]{0,15}",
    r"(ab|cd)*e",
    r"\(\d+, \d+\)",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r'"[^"\n]{0,20}"',
    r"x{2,5}y?z*",
    r"(def|class) [a-zA-Z_]+\(\):",
    r"[+-]?[0-9]+(e[+-]?[0-9]+)?",
    r"(0|1)+",
    r"[ \t]*import [a-z]+( as [a-z]+)?",
    r"\[(\d+(, \d+)*)?\]",
    r"https?://[a-z0-9.]+(/[a-z0-9]*)*",
    r"[^a-z\n]{1,10}",
    r"(ha){2,4}!",
    r"\w+ = \w+",
]

_ITEM = {"type": "object", "properties": {"k": {"type": "string", "enum": ["a", "b"]}}, "required": ["k"]}
JSON_SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
    },
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"type": "string", "maxLength": 5}},
        "required": ["a"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 2},
            },
            "required": ["id"],
        },
        "minItems": 2,
        "maxItems": 3,
    },
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"const": "fixed"},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    {"type": "boolean"},
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"$defs": {"item": _ITEM}, "type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 3},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    {"enum": [1, "two", None, True]},
    {
        "type": "object",
        "properties": {
            "outer": {
                "type": "object",
                "properties": {
                    "middle": {
                        "type": "object",
                        "properties": {"inner": {"type": "integer", "minimum": -5, "maximum": 5}},
                        "required": ["inner"],
                    },
                    "note": {"type": "string", "maxLength": 8},
                },
                "required": ["middle"],
            }
        },
        "required": ["outer"],
    },
    {"type": "string", "pattern": "^[a-z]+-[0-9]+$"},
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {
        "type": "object",
        "properties": {"kind": {"enum": ["circle", "square"]}, "size": {"type": "number", "minimum": 0}},
        "required": ["kind", "size"],
    },
    {"type": ["string", "null"]},
    {"type": "object", "properties": {}},
]

# (xgrammar EBNF, the same language written for lark). Nesting is bounded or rarely chosen: under
# a random model, a grammar whose opening brackets outnumber its closing ones nests forever.
EBNF_GRAMMARS = [
    (
        """
        root ::= expr
        expr ::= term (("+" | "-") term)*
        term ::= factor (("*" | "/") factor)*
        factor ::= [0-9]+ | "(" expr ")"
        """,
        """
        start: expr
        expr: term (("+" | "-") term)*
        term: factor (("*" | "/") factor)*
        factor: /[0-9]+/ | "(" expr ")"
        """,
    ),
    (
        """
        root ::= pair ("," pair)*
        pair ::= [a-z]+ "=" value
        value ::= [0-9]+ | "\\"" [a-z ]* "\\""
        """,
        r"""
        start: pair ("," pair)*
        pair: /[a-z]+/ "=" value
        value: /[0-9]+/ | /"[a-z ]*"/
        """,
    ),
    (
        """
        root ::= "[" (item ("," item)*)? "]"
        item ::= [0-9]+ | "[" ([0-9]+ ("," [0-9]+)*)? "]"
        """,
        """
        start: "[" (item ("," item)*)? "]"
        item: NUM | "[" (NUM ("," NUM)*)? "]"
        NUM: /[0-9]+/
        """,
    ),
    (
        """
        root ::= "SELECT " cols " FROM " ident (" WHERE " ident "=" [0-9]+)?
        cols ::= "*" | ident (", " ident)*
        ident ::= [a-z_]+
        """,
        """
        start: "SELECT " cols " FROM " IDENT (" WHERE " IDENT "=" /[0-9]+/)?
        cols: "*" | IDENT (", " IDENT)*
        IDENT: /[a-z_]+/
        """,
    ),
    (
        """
        root ::= bexpr
        bexpr ::= bterm (" or " bterm)*
        bterm ::= bfactor (" and " bfactor)*
        bfactor ::= "not "? (literal | "(" flat ")")
        flat ::= literal ((" and " | " or ") literal)*
        literal ::= "True" | "False"
        """,
        """
        start: bexpr
        bexpr: bterm (" or " bterm)*
        bterm: bfactor (" and " bfactor)*
        bfactor: "not "? (LITERAL | "(" flat ")")
        flat: LITERAL ((" and " | " or ") LITERAL)*
        LITERAL: "True" | "False"
        """,
    ),
    (
        """
        root ::= row "\\n" row ("\\n" row)?
        row ::= field ("," field)*
        field ::= [a-zA-Z0-9]*
        """,
        r"""
        start: row "\n" row ("\n" row)?
        row: FIELD? ("," FIELD?)*
        FIELD: /[a-zA-Z0-9]+/
        """,
    ),
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(stdlib.glob("json/*.py")) + sorted(stdlib.glob("re/*.py")) + [stdlib / "textwrap.py"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([path.read_text() for path in sources], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eos|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerFast) -> GrammarCompiler:
    grammar_compiler = GrammarCompiler(tokenizer, MODEL_VOCAB)
    yield grammar_compiler
    grammar_compiler.shutdown()


def _generate(
    compiler: GrammarCompiler, specs: list[StructuredOutput], *, greedy: bool, seed: int
) -> list[list[int]]:
    return _generate_with(compiler, MODEL_VOCAB, specs, greedy=greedy, seed=seed)


def _generate_with(
    compiler: GrammarCompiler, vocab: int, specs: list[StructuredOutput], *, greedy: bool, seed: int
) -> list[list[int]]:
    """Decode every spec in one batch, interleaved with unconstrained rows, as the engine does:
    fill the masks, apply them to random logits, sample, advance the matchers."""
    pending = [compiler.submit(spec) for spec in specs]
    matchers: list[GrammarMatcher | None] = []
    for index, grammar in enumerate(pending):
        matchers.append(grammar.new_matcher())
        if index % 4 == 0:
            matchers.append(None)
    outputs: list[list[int]] = [[] for _ in matchers]
    bitmask = GrammarBitmask(vocab, max_rows=len(matchers))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(MAX_STEPS):
        if bitmask.fill(matchers) == 0:
            break
        logits = torch.randn(len(matchers), vocab, generator=generator)
        bitmask.apply(logits)
        if greedy:
            tokens = logits.argmax(-1)
        else:
            tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
        for row, (matcher, token) in enumerate(zip(matchers, tokens.tolist())):
            if matcher is not None and not matcher.is_terminated():
                assert matcher.accept(token), f"row {row}: the mask allowed token {token} the grammar refuses"
                outputs[row].append(token)
    constrained = [(m, out) for m, out in zip(matchers, outputs) if m is not None]
    assert all(m.is_terminated() for m, _ in constrained), f"not terminated within {MAX_STEPS} steps"
    assert all(out[-1] == compiler.stop_token_ids[0] for _, out in constrained)
    return [out for _, out in constrained]


def _text(tokenizer: PreTrainedTokenizerFast, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "temperature1"])
def test_regex_outputs_full_match(compiler, tokenizer, greedy: bool) -> None:
    outputs = _generate(compiler, [StructuredOutput(regex=r) for r in REGEXES], greedy=greedy, seed=1)
    for pattern, token_ids in zip(REGEXES, outputs):
        text = _text(tokenizer, token_ids)
        assert re.fullmatch(pattern, text), f"{pattern!r} does not match {text!r}"


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "temperature1"])
def test_json_outputs_validate(compiler, tokenizer, greedy: bool) -> None:
    specs = [StructuredOutput(json_schema=schema) for schema in JSON_SCHEMAS]
    specs.append(StructuredOutput(json_object=True))
    outputs = _generate(compiler, specs, greedy=greedy, seed=2)
    for schema, token_ids in zip([*JSON_SCHEMAS, {"type": "object"}], outputs):
        text = _text(tokenizer, token_ids)
        jsonschema.Draft202012Validator(schema).validate(json.loads(text))


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "temperature1"])
def test_ebnf_outputs_parse(compiler, tokenizer, greedy: bool) -> None:
    specs = [StructuredOutput(ebnf=ebnf) for ebnf, _ in EBNF_GRAMMARS]
    outputs = _generate(compiler, specs, greedy=greedy, seed=3)
    for (_, lark_grammar), token_ids in zip(EBNF_GRAMMARS, outputs):
        lark.Lark(lark_grammar, parser="earley", lexer="dynamic").parse(_text(tokenizer, token_ids))


def test_json_schema_as_string_is_the_same_constraint(compiler) -> None:
    schema = JSON_SCHEMAS[0]
    as_dict = compiler.submit(StructuredOutput(json_schema=schema))
    as_string = compiler.submit(StructuredOutput(json_schema=json.dumps(schema, indent=4)))
    assert as_string.compiled() is as_dict.compiled()
    reordered = dict(reversed(schema.items()))
    assert compiler.submit(StructuredOutput(json_schema=reordered)).compiled() is not as_dict.compiled()


def test_length_bounded_json_string_refuses_control_characters(compiler, tokenizer) -> None:
    # xgrammar 0.2.9 alone accepts a raw tab here (invalid JSON); see grammar._bound_strings_by_pattern
    spec = StructuredOutput(json_schema={"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}})
    for control in ["\t", "\x06"]:
        matcher = compiler.submit(spec).new_matcher()
        prefix = tokenizer.encode('{"s": "')
        assert all(matcher.accept(token_id) for token_id in prefix)
        assert not matcher.accept(tokenizer.encode(control)[0])
    matcher = compiler.submit(spec).new_matcher()
    assert all(matcher.accept(token_id) for token_id in tokenizer.encode('{"s": "abéd"}'))


def test_compile_cache_is_bounded(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, max_cached_grammars=2)
    try:
        first = compiler.submit(StructuredOutput(regex="a+"))
        compiler.submit(StructuredOutput(regex="b+"))
        assert compiler.submit(StructuredOutput(regex="a+")).compiled() is first.compiled()
        compiler.submit(StructuredOutput(regex="c+"))
        assert compiler.cached_grammars() == 2
        assert compiler.submit(StructuredOutput(regex="b+")).compiled() is not None
    finally:
        compiler.shutdown()


@pytest.mark.parametrize(
    ("spec", "kind", "fragment"),
    [
        (StructuredOutput(regex="a(b"), "regex", "parenthesis"),
        (StructuredOutput(regex="[z-a]"), "regex", "lower bound is larger"),
        (StructuredOutput(json_schema={"type": "foo"}), "json_schema", "foo"),
        (StructuredOutput(json_schema='{"type": "object",'), "json_schema", "not JSON"),
        (StructuredOutput(json_schema={"type": "array", "minItems": 3, "maxItems": 1}), "json_schema", "minItems"),
        (StructuredOutput(ebnf='root ::= undefined_rule'), "ebnf", "undefined_rule"),
        (StructuredOutput(ebnf='root ::= "a" |'), "ebnf", "line 1"),
    ],
)
def test_invalid_constraint_is_rejected_at_submission(compiler, spec, kind, fragment) -> None:
    with pytest.raises(InvalidGrammarError, match=re.escape(fragment)) as caught:
        compiler.submit(spec)
    assert caught.value.kind == kind
    assert kind in str(caught.value)


def test_invalid_constraint_leaves_the_others_working(compiler, tokenizer) -> None:
    specs = [StructuredOutput(regex="(yes|no)"), StructuredOutput(regex="(unclosed"), StructuredOutput(regex="[0-9]")]
    accepted = []
    for spec in specs:
        try:
            accepted.append(compiler.submit(spec))
        except InvalidGrammarError:
            continue
    assert len(accepted) == 2
    for grammar, expected in zip(accepted, ["no", "7"]):
        matcher = grammar.new_matcher()
        for token_id in tokenizer.encode(expected):
            assert matcher.accept(token_id)
        assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"json_object": False},
        {"regex": "a", "ebnf": 'root ::= "a"'},
        {"json_schema": {"type": "integer"}, "json_object": True},
    ],
)
def test_structured_output_takes_exactly_one_kind(fields) -> None:
    with pytest.raises(pydantic.ValidationError, match="exactly one of regex, json_schema, ebnf, json_object"):
        StructuredOutput(**fields)


def test_structured_output_rejects_unknown_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="grammar"):
        StructuredOutput(grammar='root ::= "a"')


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool from a packed int32 bitmask, by integer arithmetic on each token id."""
    token_ids = torch.arange(vocab)
    words = bitmask.long()[:, (token_ids // 32).clamp(max=bitmask.shape[1] - 1)]
    bits = (words >> (token_ids % 32)) & 1
    return (bits == 1) & (token_ids < 32 * bitmask.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "width"), [(837, 27), (837, 26), (64, 2)])
def test_apply_token_bitmask_masks_named_rows_only(dtype, vocab: int, width: int) -> None:
    generator = torch.Generator().manual_seed(vocab + width)
    logits = torch.randn(7, vocab, generator=generator).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (3, width), generator=generator, dtype=torch.int64).to(torch.int32)
    rows = [5, 0, 3]
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, rows)
    allowed = _reference_allowed(bitmask, vocab)
    expected = logits.clone()
    expected[rows] = torch.where(allowed, logits[rows], torch.tensor(float("-inf"), dtype=dtype))
    assert torch.equal(masked, expected)  # a select: exact
    if 32 * width >= vocab:
        # xgrammar's own CPU kernel as a second reference (it needs the bitmask row-aligned)
        aligned = torch.full((7, width), -1, dtype=torch.int32)
        aligned[rows] = bitmask
        by_xgrammar = logits.float().clone()
        xgr.apply_token_bitmask_inplace(by_xgrammar, aligned, vocab_size=vocab, indices=rows)
        assert torch.equal(masked.float(), by_xgrammar)


def test_apply_token_bitmask_without_rows_masks_every_row() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31, (4, 4), generator=generator, dtype=torch.int64).to(torch.int32)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask)
    assert torch.equal(masked.isfinite(), _reference_allowed(bitmask, 100))


def test_grammar_bitmask_skips_unconstrained_and_terminated_rows(compiler, tokenizer) -> None:
    digits = compiler.submit(StructuredOutput(regex="[0-9]+"))
    live, finished, other = digits.new_matcher(), digits.new_matcher(), compiler.submit(
        StructuredOutput(json_object=True)
    ).new_matcher()
    for token_id in [*tokenizer.encode("42"), tokenizer.eos_token_id]:
        assert finished.accept(token_id)
    assert finished.is_terminated()
    bitmask = GrammarBitmask(MODEL_VOCAB, max_rows=2)
    assert bitmask.fill([live, None, finished, other]) == 2
    logits = torch.randn(4, MODEL_VOCAB, generator=torch.Generator().manual_seed(1))
    masked = logits.clone()
    bitmask.apply(masked)
    assert torch.equal(masked[1:3], logits[1:3])
    for row, matcher in [(0, live), (3, other)]:
        own = torch.zeros(1, bitmask_width(MODEL_VOCAB), dtype=torch.int32)
        matcher.fill_bitmask(own, 0)
        assert torch.equal(masked[row].isfinite(), _reference_allowed(own, MODEL_VOCAB)[0])
        # ids past the tokenizer's 800 tokens exist only in the padded logits: never allowed
        assert not masked[row, len(tokenizer):].isfinite().any()
    decodable = [tokenizer.decode([t]) for t in masked[0].isfinite().nonzero().flatten().tolist()]
    assert decodable and all(text.isdigit() for text in decodable if text)
    with pytest.raises(ValueError, match="max_rows"):
        GrammarBitmask(MODEL_VOCAB, max_rows=1).fill([live, other])


def test_fill_without_constrained_rows_makes_apply_a_no_op() -> None:
    bitmask = GrammarBitmask(MODEL_VOCAB, max_rows=2)
    assert bitmask.fill([None, None]) == 0
    logits = torch.randn(2, MODEL_VOCAB)
    before = logits.clone()
    bitmask.apply(logits)
    assert torch.equal(logits, before)


def _own_mask(matcher: GrammarMatcher) -> torch.Tensor:
    mask = torch.zeros(1, bitmask_width(MODEL_VOCAB), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    return mask[0]


def test_rollback_restores_the_mask(compiler, tokenizer) -> None:
    matcher = compiler.submit(StructuredOutput(json_schema=JSON_SCHEMAS[0])).new_matcher()
    prefix = tokenizer.encode('{"name": "Ada", ')
    for token_id in prefix[:2]:
        assert matcher.accept(token_id)
    before = _own_mask(matcher)
    for token_id in prefix[2:]:
        assert matcher.accept(token_id)
    assert not torch.equal(_own_mask(matcher), before)
    matcher.rollback(len(prefix) - 2)
    assert torch.equal(_own_mask(matcher), before)


def test_draft_bitmasks_match_sequential_masks(compiler, tokenizer) -> None:
    pending = compiler.submit(StructuredOutput(json_schema=JSON_SCHEMAS[0]))
    drafts = tokenizer.encode('{"name": "x"')
    matcher, reference = pending.new_matcher(), pending.new_matcher()
    masks = torch.zeros(len(drafts) + 1, bitmask_width(MODEL_VOCAB), dtype=torch.int32)
    matcher.fill_draft_bitmasks(drafts, masks, 0)
    for row, token_id in enumerate(drafts):
        assert torch.equal(masks[row], _own_mask(reference))
        assert reference.accept(token_id)
    assert torch.equal(masks[-1], _own_mask(reference))
    assert torch.equal(_own_mask(matcher), masks[0])  # the matcher's own state is unchanged

    drafts = tokenizer.encode('{"name') + tokenizer.encode("x") + tokenizer.encode('"a"')
    reference = pending.new_matcher()
    masks = torch.zeros(len(drafts) + 1, bitmask_width(MODEL_VOCAB), dtype=torch.int32)
    matcher.fill_draft_bitmasks(drafts, masks, 0)
    first_forbidden = 0
    while reference.accept(drafts[first_forbidden]):
        assert torch.equal(masks[first_forbidden + 1], _own_mask(reference))
        first_forbidden += 1
    assert first_forbidden < len(drafts) - 1
    assert (masks[first_forbidden + 1 :] == -1).all()  # past the forbidden draft: finite, unused


def test_grammar_bitmask_lays_out_draft_rows(compiler, tokenizer) -> None:
    pending = compiler.submit(StructuredOutput(json_schema=JSON_SCHEMAS[0]))
    first, second = pending.new_matcher(), pending.new_matcher()
    drafts = [tokenizer.encode('{"na'), [], tokenizer.encode('{"name":')]
    bitmask = GrammarBitmask(MODEL_VOCAB, max_rows=16)
    assert bitmask.fill([first, None, second], draft_token_ids=drafts) == len(drafts[0]) + len(drafts[2]) + 2
    logits = torch.randn(sum(len(d) + 1 for d in drafts), MODEL_VOCAB, generator=torch.Generator().manual_seed(2))
    masked = logits.clone()
    bitmask.apply(masked)
    expected = torch.zeros(len(drafts[2]) + 1, bitmask_width(MODEL_VOCAB), dtype=torch.int32)
    for matcher, draft, first_row in [(first, drafts[0], 0), (second, drafts[2], len(drafts[0]) + 2)]:
        matcher.fill_draft_bitmasks(draft, expected, 0)
        allowed = _reference_allowed(expected[: len(draft) + 1], MODEL_VOCAB)
        assert torch.equal(masked[first_row : first_row + len(draft) + 1].isfinite(), allowed)
    unconstrained_row = len(drafts[0]) + 1
    assert torch.equal(masked[unconstrained_row], logits[unconstrained_row])


def test_samples_of_one_request_have_independent_matchers(compiler, tokenizer) -> None:
    pending = compiler.submit(StructuredOutput(regex="(cat|dog)s?"))
    first, second = pending.new_matcher(), pending.new_matcher()
    start = _own_mask(second)
    for token_id in tokenizer.encode("cat"):
        assert first.accept(token_id)
    assert torch.equal(_own_mask(second), start)
    assert all(second.accept(t) for t in tokenizer.encode("dog"))


def test_compilation_runs_on_the_worker_thread(tokenizer, monkeypatch) -> None:
    import threading

    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB)
    compile_threads = []
    real_compile = compiler._compiler.compile_grammar

    class RecordingCompiler:
        def compile_grammar(self, grammar):
            compile_threads.append(threading.current_thread().name)
            return real_compile(grammar)

    monkeypatch.setattr(compiler, "_compiler", RecordingCompiler())
    try:
        pending = compiler.submit(StructuredOutput(regex="[a-c]{2}"))
        assert pending.new_matcher().accept(tokenizer.encode("a")[0])
        assert pending.done()
        assert compile_threads and all(name.startswith("grammar-compile") for name in compile_threads)
        assert threading.current_thread().name not in compile_threads
    finally:
        compiler.shutdown()


def test_tiny_checkpoint_tokenizer(tiny_checkpoint) -> None:
    from transformers import AutoTokenizer

    from deepinfer_core.tools.tiny_checkpoint import TINY_CONFIG

    tiny_tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tiny_compiler = GrammarCompiler(tiny_tokenizer, TINY_CONFIG["vocab_size"])
    try:
        assert tiny_compiler.stop_token_ids == [TINY_CONFIG["eos_token_id"]]
        regexes, schemas = REGEXES[:6], JSON_SCHEMAS[:6]
        specs = [StructuredOutput(regex=r) for r in regexes] + [StructuredOutput(json_schema=s) for s in schemas]
        outputs = _generate_with(tiny_compiler, TINY_CONFIG["vocab_size"], specs, greedy=False, seed=4)
        for pattern, token_ids in zip(regexes, outputs):
            assert re.fullmatch(pattern, _text(tiny_tokenizer, token_ids))
        for schema, token_ids in zip(schemas, outputs[len(regexes):]):
            jsonschema.validate(json.loads(_text(tiny_tokenizer, token_ids)), schema)
    finally:
        tiny_compiler.shutdown()


ENGINE_MAX_TOKENS = 48


@pytest.mark.skipif(
    "structured_output" not in SamplingParams.model_fields,
    reason="SamplingParams.structured_output is not wired into the engine yet",
)
def test_engine_mixed_batch_on_tiny_checkpoint(tiny_checkpoint) -> None:
    """Every constraint at temperature 0 or 1 (alternating), in one batch with unconstrained and
    n = 2 requests, async scheduling on and off: completed outputs satisfy their constraint, and
    both schedules give the same tokens (seeded sampling is keyed on position, not on step)."""
    from deepinfer_core import LLM

    constraints = (
        [("regex", r, StructuredOutput(regex=r)) for r in REGEXES]
        + [("json", s, StructuredOutput(json_schema=s)) for s in JSON_SCHEMAS]
        + [("ebnf", g, StructuredOutput(ebnf=e)) for e, g in EBNF_GRAMMARS]
    )
    params = [
        SamplingParams(temperature=float(i % 2), max_tokens=ENGINE_MAX_TOKENS, seed=i, structured_output=c)
        for i, (_, _, c) in enumerate(constraints)
    ]
    params.append(SamplingParams(temperature=1.0, max_tokens=ENGINE_MAX_TOKENS, seed=99, n=2,
                                 structured_output=StructuredOutput(regex=REGEXES[1])))
    params += [SamplingParams(temperature=1.0, max_tokens=8, seed=100 + i) for i in range(3)]
    prompts = [f"Request {i}:" for i in range(len(params))]
    runs = []
    for async_scheduling in (True, False):
        llm = LLM(str(tiny_checkpoint), accelerator="cpu", dtype="float32", async_scheduling=async_scheduling,
                  max_num_seqs=64, max_model_len=256)
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    assert [[c.token_ids for c in out.outputs] for out in runs[0]] == [[c.token_ids for c in out.outputs] for out in runs[1]]

    outputs = runs[0]
    completed = 0
    for (kind, spec, _), output in zip(constraints, outputs):
        completion = output.outputs[0]
        if completion.finish_reason != "stop":
            assert completion.finish_reason == "length" and len(completion.token_ids) == ENGINE_MAX_TOKENS
            continue
        completed += 1
        if kind == "regex":
            assert re.fullmatch(spec, completion.text), (spec, completion.text)
        elif kind == "json":
            jsonschema.Draft202012Validator(spec).validate(json.loads(completion.text))
        else:
            lark.Lark(spec, parser="earley", lexer="dynamic").parse(completion.text)
    assert completed >= len(constraints) // 3, f"only {completed} of {len(constraints)} outputs completed"
    for completion in outputs[len(constraints)].outputs:
        assert completion.finish_reason == "length" or re.fullmatch(REGEXES[1], completion.text)
    assert all(len(out.outputs[0].token_ids) == 8 for out in outputs[len(constraints) + 1:])


@pytest.mark.skipif(
    "structured_output" not in SamplingParams.model_fields,
    reason="SamplingParams.structured_output is not wired into the engine yet",
)
def test_engine_rejects_a_bad_grammar_at_generate(tiny_checkpoint) -> None:
    from deepinfer_core import LLM
    from deepinfer_core.engine.llm import InvalidRequestError

    llm = LLM(str(tiny_checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=4, max_model_len=64)
    params = [SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="[0-9]+")),
              SamplingParams(max_tokens=4, structured_output=StructuredOutput(json_schema={"type": "foo"}))]
    with pytest.raises(InvalidRequestError, match=r"request 1: invalid json_schema .*foo"):
        llm.generate(["a", "b"], params, use_tqdm=False)
    output = llm.generate(["a"], params[:1], use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length" or re.fullmatch("[0-9]+", output.text)
