"""The cost of DeepSeek-V4.1's engram lookup, and whether a step ever waits for the host because of it.

The release's two engram tables (~100 GB each, fp8 rows of 256 + 8 e8m0 scale bytes) stay in host
memory. `DeepseekV41ForCausalLM.gather_engram_rows` hashes the step's device token ids on the device
and `KernelOps.gather_rows` reads the rows zero-copy over the bus, so nothing waits for the host. This
script builds the release's engram layout (8 heads, n-grams up to 4, head_dim 256, fp8 tables) with a
smaller `engram_vocab_size` so the two tables fit the machine's memory (--table-rows-m million rows
each; the release has 384), no experts, and for each step shape reports (table and PNG plot):

- the device time of the whole lookup (hash + gather + dequantise) and the gathered bytes' rate
  against the measured pinned host-to-device copy bandwidth;
- the host time to queue it behind a stream kept busy for `--busy-ms`: far below busy-ms = no wait;
  the reference `gather_rows` (ids read back to the host) is timed the same way for contrast;
- the previous design (hash + gather on the host, rows copied over): its wall time.
Every gathered row is checked bytewise against the reference gather.

    python3 scripts/bench_engram_gather.py --out DIR [--table-rows-m 24] [--busy-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from deepinfer_core.models.deepseek_v41 import DeepseekV41ForCausalLM, parse_deepseek_v41_config
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.platform.registry import select_backend
from kernel_bench_common import finish_plot, new_plot, time_ms, write_table

# (sequences, tokens each): decode batches, then prefill chunks
SHAPES = [(1, 1), (16, 1), (64, 1), (256, 1), (1, 1024), (1, 8192)]


def engram_model(rows_m: float, ops: KernelOps, device: torch.device) -> DeepseekV41ForCausalLM:
    """Two engram layers of the release layout, tables of about `rows_m` million rows, no experts."""
    heads_x_orders = 8 * 3
    text = {"num_hidden_layers": 2, "engram_layer_ids": [0, 1], "engram_vocab_size": int(rows_m * 1e6 / heads_x_orders)}
    config = parse_deepseek_v41_config({"text_config": text, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [32, 32]}})
    model = DeepseekV41ForCausalLM(config, ops, torch.bfloat16, device, expert_filter=lambda layer, expert: False)
    for layer in config.text_config.engram_layer_ids:
        embed = model.layers[layer].engram.embed
        for table in (embed.weight, embed.scale):  # distinct bytes in every row, filled by all cores
            words = table.data.view(torch.uint8).view(-1)
            whole = words[: words.numel() // 4 * 4].view(torch.int32)
            torch.arange(whole.numel(), dtype=torch.int32, out=whole).mul_(-1640531535)
    model.bind_token_map([t % config.text_config.engram_compressed_vocab_size for t in range(config.text_config.vocab_size)])
    return model


def step_batch(num_seqs: int, tokens: int, vocab: int, device: torch.device, gen: torch.Generator) -> ForwardBatch:
    ids = torch.randint(0, vocab, (num_seqs * tokens,), generator=gen)
    context = [4096] * num_seqs if tokens == 1 else [0] * num_seqs
    return ForwardBatch(
        input_ids=ids.to(device), positions=torch.zeros(num_seqs * tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(0, num_seqs * tokens + 1, tokens, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context, dtype=torch.int32, device=device),
        slot_ids=torch.arange(num_seqs, dtype=torch.int32, device=device),
        block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32, device=device),
        logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
        query_lens_cpu=[tokens] * num_seqs, context_lens_cpu=context, slot_ids_cpu=list(range(num_seqs)),
        block_tables_cpu=[[0]] * num_seqs,
    )


def queue_ms(lookup, busy_ms: float, cycles_per_ms: float) -> float:
    """Host milliseconds to queue `lookup` behind a stream busy for busy_ms (median of 5)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(busy_ms * cycles_per_ms))
        started = time.perf_counter()
        lookup()
        samples.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def device_ms(lookup, cycles_per_ms: float, reps: int = 10) -> float:
    """Device milliseconds per lookup: queued behind a stream kept busy while the host queues them all,
    so host launch gaps are not counted (the engine's async steps hide them the same way)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(300 * cycles_per_ms))
    start.record()
    for _ in range(reps):
        lookup()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    torch.cuda.synchronize()
    return 100_000_000 / start.elapsed_time(end)


def h2d_gbps(device: torch.device) -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    return host.numel() / time_ms(lambda: dev.copy_(host, non_blocking=True), device) / 1e6


def host_path_ms(model: DeepseekV41ForCausalLM, batch: ForwardBatch, device: torch.device) -> float:
    """The previous design: hash on the host, gather there, copy the rows over; wall ms (median of 5)."""
    ids = batch.input_ids.cpu()
    history = torch.full((batch.num_seqs, 3), -1, dtype=torch.int64)
    reference = KernelOps()
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        hashed = model.hasher.step(batch, history, ids)
        for k, layer in enumerate(model.config.text_config.engram_layer_ids):
            embed, flat = model.layers[layer].engram.embed, hashed[:, k].reshape(-1)
            for table in (embed.weight, embed.scale):
                reference.gather_rows(table, flat).to(device, non_blocking=True)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table-rows-m", type=float, default=24.0, help="million rows per table (release: 384)")
    parser.add_argument("--busy-ms", type=float, default=20.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    backend = select_backend("nvidia", 0)
    device, ops = backend.device, backend.ops()
    started = time.perf_counter()
    model = engram_model(args.table_rows_m, ops, device)
    layers = model.config.text_config.engram_layer_ids
    table_gb = sum(model.layers[i].engram.embed.weight.numel() for i in layers) / 1e9
    print(f"built 2 host tables, {table_gb:.1f} GB of fp8 rows, in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    for layer in layers:  # register the tables now, not inside the first timed step
        embed = model.layers[layer].engram.embed
        ops.gather_rows(embed.weight, torch.zeros(1, dtype=torch.int64, device=device))
        ops.gather_rows(embed.scale, torch.zeros(1, dtype=torch.int64, device=device))
    torch.cuda.synchronize()
    print(f"registered them for zero-copy reads in {time.perf_counter() - started:.1f} s")
    bandwidth, cycles = h2d_gbps(device), sleep_cycles_per_ms()
    gen = torch.Generator().manual_seed(0)
    reference = KernelOps()
    results: list[dict] = []
    lines = [
        f"# Engram lookup: {torch.cuda.get_device_name(device)}, tables {table_gb:.1f} GB in host memory, "
        f"pinned host-to-device copy {bandwidth:.1f} GB/s, stream kept busy {args.busy_ms:.0f} ms", "",
        "| sequences x tokens | rows gathered | MB | device ms | GB/s | % of H2D copy | host ms to queue "
        "(zero-copy) | host ms to queue (reference gather) | previous host path ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for num_seqs, tokens in SHAPES:
        batch = step_batch(num_seqs, tokens, model.config.text_config.vocab_size, device, gen)
        cache = SimpleNamespace(engram_history=torch.full((num_seqs, 3), -1, dtype=torch.int64, device=device))
        hashed = model.hasher.step(batch, cache.engram_history.clone())
        for k, layer in enumerate(layers):
            embed, flat = model.layers[layer].engram.embed, hashed[:, k].reshape(-1)
            for table in (embed.weight, embed.scale):
                got, want = ops.gather_rows(table, flat), reference.gather_rows(table, flat)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "zero-copy gather differs"
        rows = hashed.shape[0] * hashed.shape[1] * hashed.shape[2]
        nbytes = rows * (256 + 8)
        lookup = lambda: model.gather_engram_rows(batch, cache)  # noqa: E731
        lookup()
        device_time = device_ms(lookup, cycles)
        queued = queue_ms(lookup, args.busy_ms, cycles)
        for layer in layers:
            model.layers[layer].engram.ops = reference
        queued_reference = queue_ms(lookup, args.busy_ms, cycles)
        for layer in layers:
            model.layers[layer].engram.ops = ops
        gbps = nbytes / device_time / 1e6
        results.append({"step": f"{num_seqs} x {tokens}", "rows": rows, "device_ms": device_time,
                        "queue_ms": queued, "queue_reference_ms": queued_reference,
                        "host_path_ms": host_path_ms(model, batch, device)})
        lines.append(
            f"| {num_seqs} x {tokens} | {rows:,} | {nbytes / 1e6:.2f} | {device_time:.3f} | {gbps:.1f} | "
            f"{100 * gbps / bandwidth:.0f}% | {queued:.2f} | {queued_reference:.2f} | {results[-1]['host_path_ms']:.2f} |"
        )
        print(lines[-1], flush=True)
    write_table(args.out, "engram_gather.md", lines)
    plot(results, args.busy_ms, args.out / "engram_gather.png")


def plot(results: list[dict], busy_ms: float, path: Path) -> None:
    """Milliseconds against rows gathered: the lookup's device time, the host's time to queue it (zero-copy
    and reference gather) behind a busy stream, and the previous host path."""
    made = new_plot()
    if made is None:
        return
    fig, ax = made
    rows = [r["rows"] for r in results]
    for key, label in (("device_ms", "device time of the lookup (zero-copy)"),
                       ("queue_ms", "host time to queue it (zero-copy)"),
                       ("queue_reference_ms", "host time to queue it (reference gather: waits)"),
                       ("host_path_ms", "previous design: hash + gather on the host, copy")):
        ax.plot(rows, [r[key] for r in results], marker="o", label=label)
    ax.axhline(busy_ms, color="k", linestyle="--", linewidth=0.8, label=f"stream kept busy {busy_ms:.0f} ms")
    finish_plot(fig, ax, path, "table rows gathered per step (2 engram layers)", "ms", x_log_base=10, y_log=True)


if __name__ == "__main__":
    main()
