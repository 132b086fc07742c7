"""Structured output: a regex, a JSON schema, an EBNF grammar and "any JSON object", in one batch
with an unconstrained prompt.

    python examples/structured_output.py [--model_name ID_OR_PATH] [--temperature T] [--max_tokens N]

The model is `--model_name`, else `DEEPINFER_HF_MODEL_DIR`, else the tiny random checkpoint
(written on first run). The tiny model's unconstrained output is noise; its constrained outputs
still match their constraints, which is the point of the demonstration.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deepinfer_core import LLM, SamplingParams, StructuredOutput
from deepinfer_core.envs import hf_model_dir

TINY_CHECKPOINT = Path.home() / ".cache" / "deepinfer" / "tiny-deepseek-v4"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["python", "c++", "rust"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}

ARITHMETIC_EBNF = """
root ::= expr
expr ::= term ((" + " | " - ") term)*
term ::= [0-9]{1,3} | "(" expr ")"
"""

REQUESTS = [
    ("An IPv4 address:", StructuredOutput(regex=r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])")),
    ("A person, as JSON:", StructuredOutput(json_schema=PERSON_SCHEMA)),
    ("A sum:", StructuredOutput(ebnf=ARITHMETIC_EBNF)),
    ("Any JSON object:", StructuredOutput(json_object=True)),
    ("Unconstrained:", None),
]


def resolve_model(name: str | None) -> str | None:
    if name is not None or hf_model_dir() is not None:
        return name  # LLM resolves DEEPINFER_HF_MODEL_DIR itself
    if not (TINY_CHECKPOINT / "config.json").is_file():
        from deepinfer_core.tools.tiny_checkpoint import make_tiny_checkpoint

        make_tiny_checkpoint(TINY_CHECKPOINT)
    return str(TINY_CHECKPOINT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name", default=None, help="hub id or checkpoint directory")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max_tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(model=resolve_model(args.model_name), seed=args.seed)
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, structured_output=constraint)
        for _, constraint in REQUESTS
    ]
    outputs = llm.generate([prompt for prompt, _ in REQUESTS], params)
    for (prompt, constraint), output in zip(REQUESTS, outputs):
        completion = output.outputs[0]
        kind = constraint.kind if constraint is not None else "none"
        print(f"--- {kind}: {prompt!r} (finish_reason={completion.finish_reason})")
        print(completion.text)
        if constraint is not None and constraint.kind in ("json_schema", "json_object") and completion.finish_reason == "stop":
            print("parsed:", json.loads(completion.text))


if __name__ == "__main__":
    main()
