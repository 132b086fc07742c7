"""The cases `check_kernels_gpu.py` runs: real V4-Flash shapes (MODEL_SPEC §1.2), or toy ones with --tiny.

Each case builds fresh random inputs on the device and returns (kernel_fn, reference_fn, flops, bytes,
tolerance, fp8): bytes are the fewest the op must move (each input read once, each output written once);
the tolerances are the interpreter tests' with room for the longer float32 accumulations of real shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial

import torch
from bench_model import fresh_ops

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights
from deepinfer_core.quantization import dequantize_fp4, quantize_fp4, quantize_fp8_block
from deepinfer_kernels.linear import FP8_DECODE_TILES
from deepinfer_kernels.weight_tiles import FP4_PAIR_ORDER, FP4_SMALL_SCALES, decoded_weight, pair_order_columns

__all__ = ["kernel_cases"]

LINEAR_TOL = 1e-2   # bf16 output rounding + float32 accumulation order over K up to 8192
MOE_TOL = 3e-2      # + the reference's per-expert bf16 accumulation (the op's documented 3e-2)
ATTENTION_TOL = 2e-2  # bf16 probabilities, rounded at different places (online softmax)
NORM_TOL = 8e-3     # one bf16 output rounding
FLOAT32_TOL = 1e-5  # float32 products: the accumulation order over K alone


def kernel_cases(ops: KernelOps, reference: KernelOps, tiny: bool) -> Iterator:
    from check_kernels_gpu import Case

    hidden, inter, experts, top_k = (96, 64, 8, 3) if tiny else (4096, 2048, 256, 6)
    for shape in ([(17, 96), (9, 40)] if tiny else [(8192, 4096), (8192, 1024)]):
        yield Case(f"rms_norm {list(shape)}", partial(_rms_norm, ops, reference, shape))
    q_rank, kv_dim = (64, 40) if tiny else (1024, 512)  # wq_a's and wkv's outputs, one projection's column views
    for tokens in ([1, 21] if tiny else [1, 16, 64, 8192]):
        yield Case(f"latent_norms T={tokens} dq={q_rank} dkv={kv_dim}",
                   partial(_latent_norms, ops, reference, tokens, q_rank, kv_dim))
    for tokens in ([1, 21] if tiny else [1, 64, 8192]):
        yield Case(f"hc_pre_norm T={tokens} n=4 D={hidden}", partial(_hc_pre_norm, ops, reference, tokens, hidden))
        yield Case(f"hc_update_mix T={tokens} n=4 D={hidden}", partial(_hc_update_mix, ops, reference, tokens, hidden))
    # (name, N, K): wq_a, wq_b, wkv, an expert's w1
    projections = ([("wq_b", 80, 64), ("w1", 64, 96)] if tiny else
                   [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("w1", 2048, 4096)])
    yield from _projection_cases(ops, reference, [1, 33] if tiny else [1, 64, 8192], projections, tiny)
    # DeepSeek-V4.1's fp8 weights: 32 x 32 scale blocks, smaller than the tiles (FP8_SCALED_TILES); its wq_b, wo_b
    for name, n, k in ([("wq_b", 80, 64)] if tiny else [("wq_b", 32768, 1280), ("wo_b", 5120, 8192)]):
        for m in ([1, 33] if tiny else [1, 64, 8192]):
            yield Case(f"linear {name} fp8 block=32x32 M={m} N={n} K={k}",
                       partial(_linear, ops, reference, m, n, k, "fp8", tiny, block=(32, 32)))
    # DeepSeek-V4.1's compressor: float32 x, its kv and gate projections' bf16 rows in one launch
    for m in ([1, 33] if tiny else [1, 64, 8192]):
        n, k = (64, 96) if tiny else (1024, 4096)
        yield Case(f"linear compressor x=float32 bf16 M={m} N={n} K={k}",
                   partial(_linear, ops, reference, m, n, k, "bf16", tiny, x_dtype=torch.float32))
    vocab = 101 if tiny else 129280
    for m in ([1, 33] if tiny else [1, 64]):
        yield Case(f"logits M={m} V={vocab} K={hidden}", partial(_logits, ops, reference, m, vocab, hidden))
        yield Case(f"hc_embedding T={m} n=4 V={vocab} D={hidden}", partial(_hc_embedding, ops, reference, m, vocab, hidden))
    groups, group_rows = (2, 32) if tiny else (8, 1024)  # wo_a: o_groups x o_lora_rank, K = heads*dim/groups
    for m in ([1, 33] if tiny else [1, 64, 8192]):
        for fmt in ("bf16", "fp8", "fp8-a8"):
            yield Case(f"grouped_linear wo_a {fmt} M={m} G={groups} N={group_rows} K={hidden}",
                       partial(_grouped_linear, ops, reference, m, groups, group_rows, hidden, fmt, tiny))
        # W8A8's wo_a storing wo_b's fp8 codes (compared as their values)
        yield Case(f"grouped_linear_quantized wo_a fp8-a8 M={m} G={groups} N={group_rows} K={hidden}",
                   partial(_grouped_linear, ops, reference, m, groups, group_rows, hidden, "fp8-a8", tiny,
                           quantized_out=True))
    for tokens in ([1, 21] if tiny else [1, 16, 64, 8192]):
        for x_dtype in (torch.bfloat16, torch.float32):  # float32: DeepSeek-V4.1's route_fp32
            yield Case(f"router_logits x={str(x_dtype)[6:]} T={tokens} E={experts}",
                       partial(_router_logits, ops, tokens, hidden, experts, x_dtype))
    for tokens in ([1, 21] if tiny else [1, 64, 8192]):
        for hashed in (False, True):
            yield Case(f"route {'hash' if hashed else 'score'} T={tokens} E={experts} k={top_k}",
                       partial(_route, ops, reference, tokens, hidden, experts, top_k, hashed))
    width = 32 if tiny else 512
    # decode steps of S sequences; prefill steps: a fresh prompt and a chunk continuing a cached one
    steps = [("decode", [1] * s) for s in ([3] if tiny else [1, 64])] + [("prefill", [37, 19] if tiny else [8192, 4096])]
    for kind, query_lens in steps:
        for layer, ratio in (("csa", 4), ("hca", 8 if tiny else 128)):
            yield Case(f"compress_kv {kind} {layer} S={len(query_lens)} T={sum(query_lens)} width={width}",
                       partial(_compress, ops, reference, query_lens, width, ratio, layer == "csa"))
    # indexer: decode steps of S sequences at one context, and a prefill (the tiled score kernel)
    for seqs, q_len, ctx in ([(3, 1, 60), (1, 30, 0)] if tiny else [(1, 1, 8192), (64, 1, 8192), (1, 4096, 0)]):
        yield Case(f"indexer_topk {'decode' if q_len == 1 else 'prefill'} S={seqs} q={q_len} ctx={ctx}",
                   partial(_indexer, ops, reference, seqs, q_len, ctx, tiny))
    for tokens in ([1, 9] if tiny else [1, 64, 8192]):  # V4.1's Engram injection: 4 streams of 5,120
        yield Case(f"engram_gate T={tokens} n=4 D={96 if tiny else 5120}",
                   partial(_engram_gate, ops, reference, tokens, 96 if tiny else 5120))
    for rows in ([1, 9] if tiny else [1, 64, 8192]):  # V4.1's Engram hash ids: the release's 2 layers of 4-grams
        yield Case(f"ngram_hash T={rows} N=4 L=2 H=8", partial(_ngram_hash, ops, reference, rows))
    # V4.1's decode picks (one row of scores a sequence), and a prefill step's (the selection kernel)
    for rows in ([1, 5] if tiny else [1, 16, 64, 8192]):
        yield Case(f"top_entries T={rows} n={40 if tiny else 2048}",
                   partial(_top_entries, ops, reference, rows, 40 if tiny else 2048, 13 if tiny else 512))
    for seqs in ([1, 3] if tiny else [1, 64]):  # V4.1's decode: where the picks lie, their tables, cache writes
        picks, entries = (5, 40) if tiny else (512, 4096)
        yield Case(f"paged_rows S={seqs} k={picks} n={entries}",
                   partial(_paged_rows, ops, reference, seqs, picks, entries))
        yield Case(f"selection_tables S={seqs} k={picks} n={entries}",
                   partial(_selection_tables, ops, reference, seqs, picks, entries))
        for fmt, width, block in (("fp8", 512, 32), ("fp4 e4m3", 512, 16), ("fp4 ue8m0", 128, 32)):
            width = 64 if tiny else width
            yield Case(f"{fmt} encode into rows S={seqs} d={width}",
                       partial(_encode_into_rows, ops, reference, seqs, width, block, fmt))
        yield Case(f"indexer_scores visible S={seqs} n={entries}",
                   partial(_indexer_scores_visible, ops, reference, seqs, entries, tiny))
    for name, fmt in (("fp4 pair order", FP4_PAIR_ORDER), ("fp4", FP4_SMALL_SCALES)):  # an expert's w1
        yield Case(f"weight decode {name} N={inter} K={hidden}", partial(_weight_decode, fmt, inter, hidden))
    # the weight of a W8A16 projection on cuBLAS, widened to bf16: V4's 128 x 128 blocks, V4.1's 32 x 32
    for n, k, block in ([(80, 64, (32, 32))] if tiny else [(32768, 1024, (128, 128)), (32768, 1280, (32, 32))]):
        yield Case(f"dequantize_weight wq_b fp8 block={block[0]}x{block[1]} N={n} K={k}",
                   partial(_dequantize_weight, ops, reference, n, k, block))
    # the x of a W8A8 projection on cuBLAS (V4.1's 32 x 32 blocks), rounded to its fp8 values: V4.1's wq_a input
    rows, k = (21, 64) if tiny else (8192, 5120)
    yield Case(f"fake_quantize_activations fp8 group=32 M={rows} K={k}",
               partial(_fake_quantize_activations, ops, reference, rows, k))
    for tokens in ([1, 21] if tiny else [1, 16, 64, 8192]):
        for fmt in ("bf16", "fp8", "fp8-a8", "fp4"):
            yield Case(f"fused_moe {fmt} T={tokens} E={experts} k={top_k}",
                       partial(_moe, ops, reference, tokens, hidden, inter, experts, top_k, fmt, tiny))
    for tokens in ([1, 21] if tiny else [1, 64, 8192]):  # DeepSeek-V4.1: the weight scales the activation
        for fmt in ("bf16", "fp4"):
            yield Case(f"fused_moe_prescaled {fmt} T={tokens} E={experts} k={top_k}",
                       partial(_moe, ops, reference, tokens, hidden, inter, experts, top_k, fmt, tiny, prescaled=True))
        # the release layout: fp4 experts, the shared expert in fp8 of 32 x 32 blocks (FP8_SCALED_TILES)
        yield Case(f"fused_moe_prescaled fp4 shared=fp8-32x32 T={tokens} E={experts} k={top_k}",
                   partial(_moe, ops, reference, tokens, hidden, inter, experts, top_k, "fp4", tiny, prescaled=True,
                           shared_block=(32, 32)))
    heads, dim, ring = (4, 48, 8) if tiny else (64, 512, 128)
    steps = ([("decode", 3, 1, 40), ("prefill", 1, 30, 0)] if tiny else
             [("decode", 1, 1, 8192), ("decode", 64, 1, 8192), ("prefill", 1, 4096, 0)])
    for kind, seqs, q_len, ctx in steps:
        for layer, ratio in (("sliding", 0), ("csa", 4), ("hca", 8 if tiny else 128)):
            # rotary: V4's query norm and both rotations in the kernel ("fused"), or as the base class composes
            # them from the backend's rms_norm, rope and sparse_attention ("composed": what fusing saves)
            for rotary in ("", "fused", "composed"):
                op = f"rotary_attention ({rotary})" if rotary else "sparse_attention"
                yield Case(f"{op} {layer} {kind} S={seqs} q={q_len} ctx={ctx}",
                           partial(_attention, ops, reference, heads, dim, ring, seqs, q_len, ctx, layer, ratio, tiny,
                                   rotary))
    # the measured decode tiles of V4-Flash's fp8 projections (`linear.FP8_DECODE_TILES`), at the fewest and most
    # rows of their row tile (the fewest leave its last rows masked; one row takes the one-row tile)
    for block_m, n, k in ([] if tiny else FP8_DECODE_TILES):
        for m in (2 if block_m == 16 else block_m // 2 + 1, block_m):
            yield Case(f"linear decode tile fp8 M={m} N={n} K={k}",
                       partial(_linear, ops, reference, m, n, k, "fp8", tiny))
    # linear's 64-row tiles between decode and prefill sizes (`SIXTY_FOUR_ROW_TILES`: speculative verification,
    # decode at large batches, chunked-prefill tails); at 512 rows W8A16 is on cuBLAS
    yield from _projection_cases(ops, reference, [100] if tiny else [200, 512], projections, tiny)


def _projection_cases(ops, reference, rows: list[int], projections: list[tuple[str, int, int]], tiny: bool) -> Iterator:
    from check_kernels_gpu import Case

    for m in rows:
        for name, n, k in projections:
            for fmt in ("bf16", "fp8", "fp8-a8", "fp4"):
                yield Case(f"linear {name} {fmt} M={m} N={n} K={k}", partial(_linear, ops, reference, m, n, k, fmt, tiny))


def _rms_norm(ops, reference, shape, gen, device):
    x = torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)
    weight = torch.rand(shape[-1], device=device, generator=gen) + 0.5
    nbytes = 2 * x.numel() * 2 + weight.numel() * 4
    return (lambda: ops.rms_norm(x, weight, 1e-6), lambda: reference.rms_norm(x, weight, 1e-6),
            4 * x.numel(), nbytes, NORM_TOL, False)


def _latent_norms(ops, reference, tokens, q_rank, kv_dim, gen, device):
    """The attention's q and kv latent norms, kv rotated in its last 64 channels: compared as one vector."""
    both = torch.randn(tokens, q_rank + kv_dim, device=device, generator=gen).to(torch.bfloat16)
    rope = min(64, kv_dim // 4)
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, rope, 2, device=device, dtype=torch.float32) / rope))
    args = (both[:, :q_rank], torch.rand(q_rank, device=device, generator=gen) + 0.5, both[:, q_rank:],
            torch.rand(kv_dim, device=device, generator=gen) + 0.5, 1e-6,
            torch.randint(0, 65536, (tokens,), device=device, generator=gen), inv_freq)

    def flat(op):
        return lambda: torch.cat([out.float().flatten() for out in op(*args)])

    nbytes = 2 * both.numel() * 2 + (q_rank + kv_dim) * 4
    return flat(ops.latent_norms), flat(reference.latent_norms), 4 * both.numel(), nbytes, NORM_TOL, False


def _hc_pre_norm(ops, reference, tokens, hidden, gen, device):
    """mHC before a block with the block's input norm: (block input, post, comb) compared as one vector."""
    streams, mix = _hc_streams(tokens, hidden, gen, device), _hc_mix_weights(hidden, gen, device)
    args = (streams, *mix, torch.rand(hidden, device=device, generator=gen) + 0.5, 1e-6)
    fn = mix[0]
    nbytes = streams.numel() * 2 + fn.numel() * 4 + tokens * hidden * 2
    return (_flattened(ops.hc_pre_norm, args), _flattened(reference.hc_pre_norm, args), 2 * fn.numel() * tokens,
            nbytes, NORM_TOL, False)


def _hc_update_mix(ops, reference, tokens, hidden, gen, device):
    """A V4 block's stream update (`hc_post`) with the next site's mix of the new streams:
    (new streams, pre, post, comb) compared as one vector, the bf16 streams' rounding bounding it."""
    streams, mix = _hc_streams(tokens, hidden, gen, device), _hc_mix_weights(hidden, gen, device)
    n = streams.shape[1]
    block_out = (torch.randn(tokens, hidden, device=device, generator=gen) * 2).to(torch.bfloat16)
    comb = torch.softmax(torch.randn(tokens, n, n, device=device, generator=gen), dim=-1)
    post = 2 * torch.sigmoid(torch.randn(tokens, n, device=device, generator=gen))
    args = (block_out, streams, post, comb, *mix)
    fn = mix[0]
    flops = 2 * fn.numel() * tokens + 2 * n * (n + 1) * hidden * tokens
    nbytes = 2 * streams.numel() * 2 + block_out.numel() * 2 + fn.numel() * 4
    return (_flattened(ops.hc_update_mix, args), _flattened(reference.hc_update_mix, args), flops, nbytes,
            NORM_TOL, False)


def _hc_streams(tokens, hidden, gen, device):
    """n = 4 bf16 residual streams [tokens, 4, hidden]."""
    return (torch.randn(tokens, 4, hidden, device=device, generator=gen) * 2).to(torch.bfloat16)


def _hc_mix_weights(hidden, gen, device):
    """(fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) of a site's mix over 4 streams of `hidden`."""
    n, k = 4, 4 * hidden
    fn = torch.randn((2 + n) * n, k, device=device, generator=gen) / math.sqrt(k)
    base = torch.randn((2 + n) * n, device=device, generator=gen) * 0.5
    return fn, base, torch.rand(3, device=device, generator=gen) + 0.5, 1e-6, 1e-6, 20


def _flattened(op, args):
    """op(*args)'s outputs as one float32 vector."""
    return lambda: torch.cat([out.float().flatten() for out in op(*args)])


def _quantized(w: torch.Tensor, fmt: str, block: tuple[int, int]):
    if fmt in ("fp8", "fp8-a8"):
        q, s = quantize_fp8_block(w, block)
        return q, s, block, 1.0 + 1.0 / (block[0] * block[1])
    if fmt == "fp4":
        q, s = quantize_fp4(w)
        return q, s, None, 0.5 + 1.0 / 32
    return w.to(torch.bfloat16), None, None, 2.0


def _linear(ops, reference, m, n, k, fmt, tiny, gen, device, block=None, x_dtype=torch.bfloat16):
    ops, reference = fresh_ops(type(ops), fmt), fresh_ops(type(reference), fmt)
    x = torch.randn(m, k, device=device, generator=gen).to(x_dtype)
    w = torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)
    weight, scale, block, bytes_per_weight = _quantized(w, fmt, block or ((32, 32) if tiny else (128, 128)))
    nbytes = x.element_size() * m * (k + n) + bytes_per_weight * n * k
    return (lambda: ops.linear(x, weight, scale, block), lambda: reference.linear(x, weight, scale, block),
            2 * m * n * k, nbytes, LINEAR_TOL if x_dtype == torch.bfloat16 else FLOAT32_TOL, ops.fp8_activations)


def _logits(ops, reference, m, vocab, k, gen, device):
    """The LM head: float32 logits of bf16 rows."""
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(vocab, k, device=device, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    return (lambda: ops.logits(x, w), lambda: reference.logits(x, w), 2 * m * vocab * k,
            2 * m * k + 2 * vocab * k + 4 * m * vocab, LINEAR_TOL, False)


def _hc_embedding(ops, reference, tokens, vocab, dim, gen, device):
    """The streams' start: each token's row in four streams (exact, so the tolerance never matters)."""
    ids = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    table = torch.randn(vocab, dim, device=device, generator=gen).to(torch.bfloat16)
    return (lambda: ops.hc_embedding(ids, table, 4), lambda: reference.hc_embedding(ids, table, 4), 0,
            2 * tokens * dim * 5, 0.0, False)


def _engram_gate(ops, reference, tokens, dim, gen, device):
    """key and value as row-strided views of one projection's output, as V4.1's Engram passes them."""
    n = 4
    streams = torch.randn(tokens, n, dim, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(tokens, n * dim + dim, device=device, generator=gen).to(torch.bfloat16)
    key, value = kv[:, : n * dim].view(tokens, n, dim), kv[:, n * dim:]
    q_weight = (torch.rand(n, dim, device=device, generator=gen) + 0.5).to(torch.bfloat16)
    k_weight = torch.randn(n, dim, device=device, generator=gen).to(torch.bfloat16)
    args = (streams, key, value, q_weight, k_weight, 1e-6)
    return (lambda: ops.engram_gate(*args), lambda: reference.engram_gate(*args), 6 * tokens * n * dim,
            2 * (3 * tokens * n * dim + tokens * dim), NORM_TOL, False)


def _ngram_hash(ops, reference, rows, gen, device):
    """The release's hash layout (2 layers, 4-grams, 8 heads, 16M-bucket primes) over compressed ids, a tenth
    of the shifts DEAD (padded from there on): ids compared exactly."""
    from deepinfer_core.models.deepseek_v41.engram_layout import engram_multipliers, engram_offsets, engram_primes

    n, compressed_vocab = 4, 99092
    primes = engram_primes((1, 14), n, 8, 16000000)
    multipliers = torch.from_numpy(engram_multipliers((1, 14), n, compressed_vocab)).to(device)
    primes, offsets = torch.tensor(primes, device=device), torch.tensor(engram_offsets(primes), device=device)
    tokens = torch.randint(0, compressed_vocab, (rows, n), device=device, generator=gen)
    tokens[torch.rand(rows, n, device=device, generator=gen) < 0.1] = -1
    args = (tokens, 2, multipliers, primes, offsets)
    return (lambda: ops.ngram_hash(*args), lambda: reference.ngram_hash(*args), 0,
            8 * (rows * n + rows * offsets.numel()), 0.0, False)


def _top_entries(ops, reference, rows, width, k, gen, device):
    """Scores of 64 values (many ties) with a third of the entries unseen (-inf): ids compared exactly."""
    scores = torch.randint(0, 64, (rows, width), device=device, generator=gen).float()
    scores[torch.rand(rows, width, device=device, generator=gen) < 0.3] = float("-inf")
    return (lambda: ops.top_entries(scores, k), lambda: reference.top_entries(scores, k), 0, 4 * rows * width, 0.0,
            False)


def _grouped_linear(ops, reference, m, groups, rows, k, fmt, tiny, gen, device, quantized_out=False):
    """`grouped_linear`, or with `quantized_out` `grouped_linear_quantized` in groups of the weight's K block (timed
    as it is; the check compares the codes' values)."""
    ops, reference = fresh_ops(type(ops), fmt), fresh_ops(type(reference), fmt)
    x = torch.randn(m, groups, k, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(groups * rows, k, device=device, generator=gen) / math.sqrt(k)
    weight, scale, block, bytes_per_weight = _quantized(w, fmt, (32, 32) if tiny else (128, 128))
    out_bytes = (1 + 4 / block[1]) if quantized_out else 2
    nbytes = 2 * m * groups * k + bytes_per_weight * groups * rows * k + out_bytes * m * groups * rows

    def product(o):
        if quantized_out:
            return o.grouped_linear_quantized(x, weight, scale, block, block[1])
        return o.grouped_linear(x, weight, scale, block)

    return (lambda: product(ops), lambda: product(reference), 2 * m * groups * rows * k, nbytes, LINEAR_TOL,
            ops.fp8_activations)


def _route(ops, reference, tokens, hidden, experts, top_k, hashed, gen, device):
    """Weights scattered to [T, E], so the comparison does not depend on the order of equal picks."""
    x, gate = _router_inputs(tokens, hidden, experts, gen, device)
    bias = torch.randn(experts, device=device, generator=gen) * 0.1
    table = torch.rand(97, experts, device=device, generator=gen).topk(top_k, dim=-1).indices
    input_ids = torch.randint(0, 97, (tokens,), device=device, generator=gen)
    extra = {"tid2eid": table, "input_ids": input_ids} if hashed else {"bias": bias}
    # the reference routes the kernel path's own product (`router_logits`, its own case): through an
    # identity gate, which keeps it exact, so that a one-ulp difference in a logit cannot flip a pick
    logits, identity = ops.router_logits(x, gate), torch.eye(experts, dtype=x.dtype, device=device)

    def dense(routed):
        weights, ids = routed
        return torch.zeros(tokens, experts, device=device).scatter_(1, ids, weights)

    nbytes = 2 * tokens * hidden + 2 * experts * hidden + 12 * tokens * top_k
    return (lambda: dense(ops.route(x, gate, top_k, 2.5, **extra)),
            lambda: dense(reference.route(logits, identity, top_k, 2.5, **extra)),
            2 * tokens * experts * hidden, nbytes, 1e-5, False)


def _router_inputs(tokens, hidden, experts, gen, device):
    """(x [T, D], the router's gate [E, D]) in bf16, the logits of order one."""
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    return x, (torch.randn(experts, hidden, device=device, generator=gen) / math.sqrt(hidden)).to(torch.bfloat16)


def _router_logits(ops, tokens, hidden, experts, x_dtype, gen, device):
    """bf16 gate; a float32 x meets it widened (the reference: a float32 copy of the gate, then cuBLAS)."""
    x, gate = _router_inputs(tokens, hidden, experts, gen, device)
    x = x.to(x_dtype)
    size = x.element_size()
    return (lambda: ops.router_logits(x, gate), lambda: torch.nn.functional.linear(x, gate.to(x_dtype)),
            2 * tokens * experts * hidden, size * tokens * hidden + 2 * experts * hidden + size * tokens * experts,
            LINEAR_TOL if x_dtype == torch.bfloat16 else FLOAT32_TOL, False)


def _compress(ops, reference, query_lens, width, ratio, overlap, gen, device):
    """A step of sequences bringing query_lens tokens: one token each with contexts spread so that some
    close their window, or (several tokens) a fresh prompt followed by chunks continuing cached ones. The
    entries the reference changes are compared (the untouched ones would dilute the error); the kernel's
    states must equal the reference's bitwise, else its output reads as NaN (a failure)."""
    from dataclasses import replace

    from deepinfer_core.platform.op_cases import _step_batch

    span, proj = (2 * ratio, 2 * width) if overlap else (ratio, width)
    seqs, tokens = len(query_lens), sum(query_lens)
    per_block = 2
    if max(query_lens) == 1:  # inside each sequence's blocks; even sequences close a window
        contexts = [((7 * i) % 16 + 1) * ratio - 1 if i % 2 == 0 else (5 + i % 7) * ratio + i % ratio
                    for i in range(seqs)]
    else:  # the first prompt fresh, the others after a cached part that ends inside a window
        contexts = [0] + [q // 3 + ratio // 2 + 1 for q in query_lens[1:]]
    blocks_per_seq = max(64, (max(c + q for c, q in zip(contexts, query_lens)) // (per_block * ratio)) + 1)
    num_blocks = seqs * blocks_per_seq
    host = _step_batch(torch.Generator().manual_seed(seqs), query_lens, contexts, seqs + 1, blocks_per_seq, num_blocks)
    batch = replace(host, **{name: getattr(host, name).to(device) for name in (
        "input_ids", "positions", "query_start_loc", "context_lens", "slot_ids", "block_tables", "logits_indices")})
    kv, gate = (torch.randn(tokens, proj, device=device, generator=gen).to(torch.bfloat16) for _ in range(2))
    ape = torch.randn(ratio, proj, device=device, generator=gen) * 0.5
    norm = torch.rand(width, device=device, generator=gen) + 0.5
    rope = min(64, width // 4)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, device=device, dtype=torch.float32) / rope))
    states = [torch.randn(seqs + 1, span, proj, device=device, generator=gen).to(torch.bfloat16) for _ in range(2)]
    entries = torch.randn(num_blocks, per_block, width, device=device, generator=gen).to(torch.bfloat16)

    def run(o):
        state_kv, state_gate, out = states[0].clone(), states[1].clone(), entries.clone()
        o.compress_kv(kv, gate, ape, norm, 1e-6, inv_freq, ratio, overlap, state_kv, state_gate, out, batch)
        return state_kv, state_gate, out

    *expected_states, expected = run(reference)
    changed = (expected != entries).any(-1)

    def kernel():
        state_kv, state_gate, out = run(ops)
        same = torch.equal(state_kv, expected_states[0]) and torch.equal(state_gate, expected_states[1])
        return out[changed] if same else torch.full_like(out[changed], float("nan"))

    windows = sum((c + q) // ratio - c // ratio for c, q in zip(contexts, query_lens))
    nbytes = 2 * (2 * tokens * proj + 2 * seqs * span * proj + windows * width)
    return kernel, lambda: run(reference)[2][changed], 0, nbytes, NORM_TOL, False


def _indexer(ops, reference, seqs, q_len, ctx, tiny, gen, device):
    """Picked entries as a [T, entries] membership, so that two entries whose float32 scores tie to the
    summation order's rounding may swap (the order of the rest is compared by the tests)."""
    heads, dim, topk, ratio = (8, 16, 5, 4) if tiny else (64, 128, 512, 4)
    batch, num_blocks = attention_batch(seqs, q_len, ctx, 128, device)
    keys = torch.randn(num_blocks, 128 // ratio, dim, device=device, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch.num_tokens, heads, dim, device=device, generator=gen).to(torch.bfloat16)
    weights = torch.randn(batch.num_tokens, heads, device=device, generator=gen).to(torch.bfloat16)
    width = (ctx + q_len) // ratio

    def picked(o):
        ids = o.indexer_topk(q, weights, keys, ratio, topk, batch)
        member = torch.zeros(ids.shape[0], width + 1, device=device)
        return member.scatter_(1, torch.where(ids < 0, width, ids), 1.0)[:, :width]

    flops = 2 * batch.num_tokens * heads * dim * width
    nbytes = 2 * (seqs * width * dim + batch.num_tokens * heads * dim) + 8 * batch.num_tokens * topk
    return lambda: picked(ops), lambda: picked(reference), flops, nbytes, 2e-2, False


def _paged_rows(ops, reference, seqs, picks, entries, gen, device):
    """Picks of a decode step (a tenth -1) through block tables of 2 entries a block: ids compared exactly."""
    tables = torch.randperm(seqs * entries, device=device, generator=gen)[: seqs * entries // 2].view(seqs, -1)
    ids = torch.randint(0, entries, (seqs, picks), device=device, generator=gen)
    ids[torch.rand(seqs, picks, device=device, generator=gen) < 0.1] = -1
    tables = tables.to(torch.int32)
    return (lambda: ops.paged_rows(tables, ids, 2), lambda: reference.paged_rows(tables, ids, 2), 0,
            12 * seqs * picks, 0.0, False)


def _selection_tables(ops, reference, seqs, picks, entries, gen, device):
    """Distinct picks a row (the last tenth -1): tables compared exactly."""
    selected = torch.rand(seqs, entries, device=device, generator=gen).argsort(dim=1)[:, :picks]
    selected[:, picks - picks // 10:] = -1
    return (lambda: ops.selection_tables(selected, entries), lambda: reference.selection_tables(selected, entries),
            0, 4 * seqs * (entries + 1) + 8 * seqs * picks, 0.0, False)


def _encode_into_rows(ops, reference, seqs, width, block, fmt, gen, device):
    """A decode step's vectors encoded into distinct rows of a pool of 1,024 that holds codes: every byte of the
    pool compared exactly (the untouched rows too)."""
    args = (block,) if fmt == "fp8" else (block, fmt.split()[1])
    quantize = "fp8_block_quantize" if fmt == "fp8" else "fp4_block_quantize"
    pool = getattr(reference, quantize)(torch.randn(1024, width, device=device, generator=gen), *args)
    x = torch.randn(seqs, width, device=device, generator=gen).to(torch.bfloat16)
    rows = torch.randperm(1024, device=device, generator=gen)[:seqs]

    def written(o):
        parts = getattr(o, quantize)(x, *args, out=tuple(part.clone() for part in pool), rows=rows)
        return torch.cat([part.view(torch.uint8).flatten() for part in parts])

    return lambda: written(ops), lambda: written(reference), 0, 2 * seqs * width, 0.0, False


def _indexer_scores_visible(ops, reference, seqs, entries, tiny, gen, device):
    """A decode step's scores, each row seeing a random count of its keys: the visible scores compared at the
    op's tolerance, a masked entry that is not -inf (or a visible one that is) made NaN, which fails."""
    heads, dim = (4, 32) if tiny else (64, 128)
    q = torch.randn(seqs, heads, dim, device=device, generator=gen).to(torch.bfloat16)
    keys = torch.randn(seqs, entries, dim, device=device, generator=gen).to(torch.bfloat16)
    weights = torch.randn(seqs, heads, device=device, generator=gen).to(torch.bfloat16)
    visible = torch.randint(0, entries + 1, (seqs,), device=device, generator=gen)
    hidden = torch.arange(entries, device=device) >= visible[:, None]

    def scores(o):
        out = o.indexer_scores(q, keys, weights, visible)
        return torch.where(hidden, torch.where(out == float("-inf"), 0.0, float("nan")), out)

    flops = 2 * seqs * heads * dim * entries
    return lambda: scores(ops), lambda: scores(reference), flops, 2 * seqs * entries * dim, 1e-5, False


def _dequantize_weight(ops, reference, n, k, block, gen, device):
    """fp8 block-scaled codes widened to bf16 against the reference's widening, bit for bit (tolerance 0)."""
    weight, scale = quantize_fp8_block(torch.randn(n, k, device=device, generator=gen), block)
    return (lambda: ops.dequantize_weight(weight, scale, block, torch.bfloat16),
            lambda: reference.dequantize_weight(weight, scale, block, torch.bfloat16), 0,
            3 * n * k + n * k // (block[0] * block[1]), 0.0, False)


def _fake_quantize_activations(ops, reference, rows, k, gen, device):
    """x rounded to fp8 per row and 32 columns, in bf16, against the reference rounding, bit for bit (tolerance 0);
    rows over 40 binades."""
    x = torch.randn(rows, k, device=device, generator=gen)
    x = (x * torch.exp2(torch.randint(-20, 20, (rows, 1), device=device, generator=gen).float())).to(torch.bfloat16)
    weight, _ = quantize_fp8_block(torch.randn(64, k, device=device, generator=gen), (32, 32))
    ops, reference = fresh_ops(type(ops), "fp8-a8"), fresh_ops(type(reference), "fp8-a8")
    return (lambda: ops.fake_quantize_activations(x, weight, (32, 32)),
            lambda: reference.fake_quantize_activations(x, weight, (32, 32)), 0, 4 * rows * k, 0.0, False)


def _weight_decode(fmt, n, k, gen, device):
    """The kernels' fp4 decode (`load_weight_tile`; FP4_PAIR_ORDER's is inline PTX on a GPU) against the
    dequantised weight, bit for bit (tolerance 0): random bytes, so every code in every nibble, and scale
    bytes 0..128 (all those of one-product scales)."""
    packed = torch.randint(0, 256, (n, k // 2), device=device, generator=gen).to(torch.uint8).view(torch.int8)
    scale = torch.randint(0, 129, (n, k // 32), device=device, generator=gen).to(torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)

    def reference():
        expected = dequantize_fp4(packed, scale, torch.bfloat16)
        return pair_order_columns(expected) if fmt == FP4_PAIR_ORDER else expected

    return (lambda: decoded_weight(packed, scale, fmt, torch.bfloat16), reference, 0, n * k // 2 + n * k // 32 + 2 * n * k,
            0.0, False)


def stacked_experts(num: int, hidden: int, inter: int, fmt: str, gen, device, block) -> tuple[list[MlpWeights], float]:
    """Random experts quantised one at a time into stacked tensors; each MlpWeights views its slice."""
    stacks: dict[str, torch.Tensor] = {}
    for e in range(num):
        for name, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            w = torch.randn(*shape, device=device, generator=gen) / math.sqrt(shape[1])
            q, s, _, bytes_per_weight = _quantized(w, fmt, block)
            if e == 0:
                stacks[name] = torch.empty((num, *q.shape), dtype=q.dtype, device=device)
                if s is not None:
                    stacks[name + "_scale"] = torch.empty((num, *s.shape), dtype=s.dtype, device=device)
            stacks[name][e].copy_(q)
            if s is not None:
                stacks[name + "_scale"][e].copy_(s)
    blk = block if fmt in ("fp8", "fp8-a8") else None
    mlps = [MlpWeights(*(stacks[n][e] for n in ("w1", "w3", "w2")),
                       *((stacks[n + "_scale"][e] if n + "_scale" in stacks else None) for n in ("w1", "w3", "w2")),
                       blk) for e in range(num)]
    return mlps, bytes_per_weight


def _moe(ops, reference, tokens, hidden, inter, experts, top_k, fmt, tiny, gen, device, prescaled=False,
         shared_block=None):
    # fresh ops: fp8 activations as the format asks
    ops, reference = fresh_ops(type(ops), fmt), fresh_ops(type(reference), fmt)
    block = (32, 32) if tiny else (128, 128)
    mlps, bytes_per_weight = stacked_experts(experts, hidden, inter, fmt, gen, device, block)
    (shared,), _ = stacked_experts(1, hidden, inter, "bf16" if fmt == "bf16" else "fp8", gen, device,
                                   shared_block or block)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=device, generator=gen) + 0.1
    touched = int(torch.unique(ids).numel())
    flops = 2 * tokens * (top_k + 1) * 3 * hidden * inter
    nbytes = (touched * bytes_per_weight + 2) * 3 * hidden * inter + 2 * 2 * tokens * hidden
    op, reference_op = ((ops.fused_moe_prescaled, reference.fused_moe_prescaled) if prescaled else
                        (ops.fused_moe, reference.fused_moe))
    return (lambda: op(x, weights, ids, mlps, shared, 10.0), lambda: reference_op(x, weights, ids, mlps, shared, 10.0),
            flops, nbytes, MOE_TOL, ops.fp8_activations)


def attention_batch(seqs: int, q_len: int, ctx: int, block_size: int, device) -> tuple[ForwardBatch, int]:
    """seqs sequences of q_len new tokens after ctx cached ones, consecutive blocks; returns (batch, blocks)."""
    per_seq = (ctx + q_len) // block_size + 1
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    starts = torch.arange(seqs + 1, dtype=torch.int32) * q_len
    batch = ForwardBatch(
        input_ids=torch.zeros(seqs * q_len, dtype=torch.long, device=device),
        positions=torch.arange(ctx, ctx + q_len).repeat(seqs).to(device),
        query_start_loc=starts.to(device),
        context_lens=torch.full((seqs,), ctx, dtype=torch.int32, device=device),
        slot_ids=torch.arange(seqs, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        logits_indices=(starts[1:] - 1).long().to(device),
        query_lens_cpu=[q_len] * seqs, context_lens_cpu=[ctx] * seqs,
        slot_ids_cpu=list(range(seqs)), block_tables_cpu=tables,
    )
    return batch, seqs * per_seq


def _attention(ops, reference, heads, dim, ring, seqs, q_len, ctx, layer, ratio, tiny, rotary, gen, device):
    block_size = 16 if tiny else 128
    batch, num_blocks = attention_batch(seqs, q_len, ctx, block_size, device)
    tokens = seqs * q_len
    q = torch.randn(tokens, heads, dim, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(tokens, dim, device=device, generator=gen).to(torch.bfloat16)
    window = torch.randn(seqs, ring, dim, device=device, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, device=device, generator=gen)
    positions = batch.positions
    keys = torch.clamp(positions + 1, max=ring)  # window keys per query
    kwargs = {}
    if ratio:
        per_block = block_size // ratio
        kwargs = {"entries": torch.randn(num_blocks, per_block, dim, device=device, generator=gen).to(torch.bfloat16),
                  "ratio": ratio}
        visible = (positions + 1) // ratio
        if layer == "csa":
            top_k = 4 if tiny else 512
            n_entries = (ctx + q_len) // ratio
            scores = torch.rand(tokens, max(n_entries, top_k), device=device, generator=gen)
            scores[torch.arange(scores.shape[1], device=device)[None, :] >= visible[:, None]] = -1.0
            best = scores.topk(top_k, dim=-1)
            kwargs["selected"] = torch.where(best.values >= 0, best.indices, -1)
            keys = keys + visible.clamp(max=top_k)
        else:
            keys = keys + visible
    attended = int(keys.sum())
    unique_keys = seqs * (min(ctx, ring) + q_len + ((ctx + q_len) // ratio if ratio else 0))
    nbytes = 2 * (2 * tokens * heads * dim + unique_keys * dim)
    rope_dim = dim // 8  # V4: the last 64 of 512 channels
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim))

    def run(o):
        if not rotary:
            return o.sparse_attention(q, kv, window, sinks, dim**-0.5, batch, **kwargs)
        op = partial(KernelOps.rotary_attention, o) if rotary == "composed" else o.rotary_attention
        return op(q, kv, window, sinks, dim**-0.5, batch, inv_freq, 1e-6, **kwargs)

    return (lambda: run(ops), lambda: run(reference), 4 * heads * dim * attended, nbytes, ATTENTION_TOL, False)
