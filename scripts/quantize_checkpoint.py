"""Quantise a float DeepSeek-V4 checkpoint into the official fp8 / fp4 layout (see deepinfer_core.weights.quantize)."""

import argparse
import re

from deepinfer_core.weights.quantize import DEFAULT_MAX_SHARD_BYTES, quantize_checkpoint

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_size(text: str) -> int:
    """Bytes from `123`, `500KB`, `5GB` or `2GiB` (KB/MB/GB are powers of 1000, as transformers reads them)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if match is None or match[2].upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with KB/MB/GB/KiB/MiB/GiB")
    return int(match[1]) * _UNITS[match[2].upper()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source", help="float checkpoint directory (official or transformers tensor names)")
    parser.add_argument("output", help="directory to write the quantised checkpoint to (must hold no safetensors)")
    parser.add_argument("--experts", choices=("fp4", "fp8"), default="fp4", help="routed expert format (default fp4)")
    parser.add_argument(
        "--max-shard-size",
        type=shard_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="largest shard before a new one starts, e.g. 5GB or 200000 (bytes); default 5GiB",
    )
    args = parser.parse_args(argv)
    quantize_checkpoint(args.source, args.output, experts=args.experts, max_shard_bytes=args.max_shard_size)


if __name__ == "__main__":
    main()
