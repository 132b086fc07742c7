"""The `deepinfer` command.

Each subcommand is one `_add_*` function that adds its parser and sets `run` to a handler taking
the parsed arguments and returning the exit code; list it in `SUBCOMMANDS`. Handlers import what
they need lazily, so `deepinfer --help` stays fast and never touches a vendor stack.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from deepinfer_core import __version__, envs
from deepinfer_core.platform.errors import BackendError

__all__ = ["SUBCOMMANDS", "main"]


def _add_backends(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "backends",
        help="list installed backends, whether each can run here and why, and their capabilities",
    )
    parser.set_defaults(run=_run_backends)


def _run_backends(args: argparse.Namespace) -> int:
    from deepinfer_core.platform.registry import BackendRegistry

    registry = BackendRegistry.from_entry_points()
    for status in registry.probe():
        record = status.record
        state = "available" if status.available else "unavailable"
        print(f"{record.name}  (priority {record.priority}, {state})")
        if not status.available:
            print(f"    reason: {status.reason}")
            continue
        for key, value in status.backend.describe().items():
            print(f"    {key}: {value}")
        caps = status.backend.capabilities()
        flags = ", ".join(f"{field}={getattr(caps, field)}" for field in caps.__slots__)
        print(f"    capabilities: {flags}")
    requested = envs.accelerator()
    selected = registry.select(requested)
    print(f"{envs.ACCELERATOR.name}={requested} selects: {selected.name}")
    return 0


def _add_check_backend(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-backend",
        help="run the conformance suite: every op of a backend against the reference ops",
    )
    parser.add_argument("name", nargs="?", help=f"backend name (default: ${envs.ACCELERATOR.name})")
    parser.add_argument("--seed", type=int, help="seed of the random inputs (default: fresh)")
    parser.set_defaults(run=_run_check_backend)


def _run_check_backend(args: argparse.Namespace) -> int:
    from deepinfer_core.platform.conformance import run_conformance
    from deepinfer_core.platform.registry import select_backend

    report = run_conformance(select_backend(args.name), seed=args.seed)
    print(report.summary())
    return 0 if report.passed else 1


def _add_make_tiny_checkpoint(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny-checkpoint",
        help="write a tiny random DeepSeek-V4 checkpoint with a tokenizer (tests, demos); "
        "`deepinfer make-tiny-checkpoint --help` lists its options",
        add_help=False,
    )
    parser.set_defaults(run=_run_make_tiny_checkpoint, passthrough=True)


def _run_make_tiny_checkpoint(args: argparse.Namespace) -> int:
    from deepinfer_core.tools import tiny_checkpoint

    return tiny_checkpoint.main(args.passthrough_args)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve MODEL over HTTP: OpenAI chat/completions/responses and Anthropic messages "
        "(needs the `serve` extra)",
    )
    parser.add_argument("model", nargs="?", help=f"checkpoint directory or hub id (default: ${envs.HF_MODEL_DIR.name})")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the `model` clients send (default: the checkpoint's folder name)")
    parser.add_argument("--api-key", help="require this key (Authorization: Bearer, or x-api-key) on /v1 routes")
    parser.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body")
    parser.add_argument("--accelerator", help=f"backend (default: ${envs.ACCELERATOR.name})")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--num-kv-blocks", type=int, help="exact KV pool size (default: from free memory)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV storage: auto (the model's own: fp8/fp4 for DeepSeek-V4.1), bf16 (V4.1 debugging)")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="reuse cached prompt prefixes (exact)")
    parser.add_argument("--enforce-eager", action="store_true", help="launch decode steps op by op (no device graphs)")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="quantise the inputs of fp8-weight projections to fp8 and run fp8 matmuls (W8A8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from deepinfer_core.server.serve import ServeExtraMissing, run_serve_command

    try:
        return run_serve_command(args)
    except ServeExtraMissing as exc:
        print(f"deepinfer serve: error: {exc}", file=sys.stderr)
        return 1


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_backends,
    _add_check_backend,
    _add_make_tiny_checkpoint,
    _add_serve,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # A subcommand that sets `passthrough` hands its unparsed arguments to the tool it wraps.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passthrough_args = rest
    try:
        return args.run(args)
    except (BackendError, envs.InvalidEnvVar) as exc:
        print(f"deepinfer {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
