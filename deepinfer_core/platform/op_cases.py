"""Conformance cases: for each `KernelOps` op, fresh random inputs and the tolerance it must meet.

The conformance suite (`platform/conformance.py`, `deepinfer check-backend NAME`) runs every case
through the backend's ops and through the reference `KernelOps`, and compares outputs. Inputs are
drawn from a seeded generator on the CPU and moved to the device, never zeros.

Add a case here whenever an op is added to `KernelOps`: a test fails for any op without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights, QuantizedActivations

__all__ = ["OpCase", "OP_CASES"]


@dataclass(frozen=True, slots=True)
class OpCase:
    """One conformance case.

    make_inputs(gen, dtype) returns (args, kwargs) on the CPU; the runner moves tensors to the
    backend's device. rtol/atol map each dtype to the tolerance (with the reason in a comment
    where it is defined); the comparison is torch.testing-style on every output tensor.
    """

    op: str
    name: str
    make_inputs: Callable[[torch.Generator, torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    rtol: dict[torch.dtype, float] = field(default_factory=dict)
    atol: dict[torch.dtype, float] = field(default_factory=dict)
    host_args: tuple[int, ...] = ()  # positional args that stay in host memory (e.g. an engram table)
    modes: dict[str, bool] = field(default_factory=dict)  # `KernelOps` flags set on both sides, e.g. fp8_activations
    given_up: tuple[int, ...] = ()  # positional args the op may overwrite (e.g. rope's x with inplace=True)
    compared_as: Callable[[Any], Any] | None = None  # both results mapped before the comparison (fp8 codes: values)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


# float32: a different summation order moves results by a few ulps.
# bfloat16: inputs are bf16 but reference and kernel may accumulate differently before rounding.
_TOL_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
_TOL_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _step_batch(
    gen: torch.Generator, query_lens: list[int], context_lens: list[int], num_slots: int, blocks_per_seq: int,
    num_blocks: int,
) -> ForwardBatch:
    """A step over several sequences with distinct random slots and shuffled block tables."""
    slots = torch.randperm(num_slots, generator=gen)[: len(query_lens)].tolist()
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [blocks[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(len(query_lens))]
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(starts[-1])
    return ForwardBatch(
        input_ids=torch.randint(0, 97, (total,), generator=gen),
        positions=positions,
        query_start_loc=starts,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=starts[1:].long() - 1,
        query_lens_cpu=list(query_lens),
        context_lens_cpu=list(context_lens),
        slot_ids_cpu=slots,
        block_tables_cpu=tables,
    )


# Mixed step: a fresh prefill, a chunk continuing a prefill, two decodes.
_QUERY_LENS, _CONTEXT_LENS = [11, 6, 1, 1], [0, 9, 22, 5]
# a decode step: one query a sequence (backends specialise these: e.g. the nvidia indexer's decode scores)
_DECODE_QUERY_LENS, _DECODE_CONTEXT_LENS = [1, 1, 1, 1], [12, 9, 22, 5]


def _rope_inputs(gen, dt, inverse, inplace=False):
    x = _randn(gen, 9, 3, 24, dtype=dt)
    positions = torch.randint(0, 5000, (9,), generator=gen)
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    return (x, positions, inv_freq, inverse), {"inplace": inplace}


def _latent_norms_inputs(gen, dt):
    # the latents as column views of one output, of unequal widths (as V4's 1,024 and 512)
    both = _randn(gen, 9, 100 + 40 + 3, dtype=dt)
    positions = torch.randint(0, 5000, (9,), generator=gen)
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    weights = torch.rand(100, generator=gen) + 0.5, torch.rand(40, generator=gen) + 0.5
    return (both[:, :100], weights[0], both[:, 100:140], weights[1], 1e-6, positions, inv_freq), {}


def _hc_pre_inputs(gen, dt):
    n, d = 4, 40
    streams = _randn(gen, 7, n, d, dtype=dt)
    fn = _randn(gen, (2 + n) * n, n * d) * 0.1
    return (streams, fn, _randn(gen, (2 + n) * n) * 0.5, torch.rand(3, generator=gen) + 0.5, 1e-6, 1e-6, 20), {}


def _tied_scores(gen, dt):
    scores = torch.randint(0, 8, (7, 40), generator=gen).to(dt)
    scores[torch.rand(7, 40, generator=gen) < 0.3] = float("-inf")
    scores[3] = float("-inf")
    return scores


def _hc_pre_norm_inputs(gen, dt):
    (streams, *rest), _ = _hc_pre_inputs(gen, dt)
    return (streams, *rest, torch.rand(streams.shape[-1], generator=gen) + 0.5, 1e-6), {}


def _hc_post_inputs(gen, dt):
    n, d = 4, 40
    comb = torch.softmax(_randn(gen, 7, n, n), dim=-1)
    post = 2 * torch.sigmoid(_randn(gen, 7, n))
    return (_randn(gen, 7, d, dtype=dt), _randn(gen, 7, n, d, dtype=dt), post, comb), {}


def _hc_collapse_norm_inputs(gen, dt):
    streams, pre = _randn(gen, 7, 4, 40, dtype=dt), torch.rand(7, 4, generator=gen) + 0.1
    return (streams, pre, torch.rand(40, generator=gen) + 0.5, 1e-6), {}


def _hc_update_mix_inputs(gen, dt):
    """A site's update (`hc_post`'s inputs), then the next site's mix on the new streams."""
    update, _ = _hc_post_inputs(gen, dt)
    (_, *mix), _ = _hc_pre_inputs(gen, dt)
    return (*update, *mix), {}


def _hc_head_inputs(gen, dt):
    n, d = 2, 40
    fn, base, scale = _randn(gen, n, n * d) * 0.1, _randn(gen, n) * 0.5, torch.rand(1, generator=gen) + 0.5
    return (_randn(gen, 7, n, d, dtype=dt), fn, base, scale, 1e-6, 1e-6), {}


def _compress_inputs(gen, dt, ratio, overlap, column_views=False):
    """column_views: kv and gate as column slices of one wider projection output (`LinearGroup`)."""
    width, block_size, num_blocks, num_slots = 16, 8, 24, 6
    batch = _step_batch(gen, _QUERY_LENS, _CONTEXT_LENS, num_slots, blocks_per_seq=4, num_blocks=num_blocks)
    proj = 2 * width if overlap else width
    span = 2 * ratio if overlap else ratio
    tokens = batch.num_tokens
    if column_views:
        kv, gate = _randn(gen, tokens, 2 * proj + 8, dtype=dt)[:, 8:].split(proj, dim=1)
    else:
        kv, gate = _randn(gen, tokens, proj, dtype=dt), _randn(gen, tokens, proj, dtype=dt)
    args = (
        kv, gate, _randn(gen, ratio, proj) * 0.5,
        torch.rand(width, generator=gen) + 0.5, 1e-6,
        1.0 / (160000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)), ratio, overlap,
        _randn(gen, num_slots, span, proj, dtype=dt), _randn(gen, num_slots, span, proj, dtype=dt),
        _randn(gen, num_blocks, block_size // ratio, width, dtype=dt), batch,
    )
    return args, {}


def _indexer_inputs(gen, dt, column_view=False, decode=False):
    """column_view: the head weights as columns of a wider projection output (`LinearGroup`); decode: a
    decode step's batch."""
    ratio, block_size = 4, 8
    lens = (_DECODE_QUERY_LENS, _DECODE_CONTEXT_LENS) if decode else (_QUERY_LENS, _CONTEXT_LENS)
    batch = _step_batch(gen, *lens, 6, blocks_per_seq=4, num_blocks=24)
    keys = _randn(gen, 24, block_size // ratio, 16, dtype=dt)
    if column_view:
        head_weights = _randn(gen, batch.num_tokens, 24, dtype=dt)[:, 16:]
    else:
        head_weights = _randn(gen, batch.num_tokens, 8, dtype=dt)
    return (_randn(gen, batch.num_tokens, 8, 16, dtype=dt), head_weights, keys, ratio, 3, batch), {}


def _attention_inputs(gen, dt, ratio, with_selection, decode=False):
    heads, dim, window, block_size = 4, 32, 8, 8
    lens = (_DECODE_QUERY_LENS, _DECODE_CONTEXT_LENS) if decode else (_QUERY_LENS, _CONTEXT_LENS)
    batch = _step_batch(gen, *lens, 6, blocks_per_seq=4, num_blocks=24)
    tokens = batch.num_tokens
    kwargs = {}
    if ratio:
        kwargs = {"entries": _randn(gen, 24, block_size // ratio, dim, dtype=dt), "ratio": ratio}
        if with_selection:
            kwargs["selected"] = KernelOps().indexer_topk(
                _randn(gen, tokens, 8, 16), _randn(gen, tokens, 8), _randn(gen, 24, block_size // ratio, 16),
                ratio, 3, batch,
            )
    args = (_randn(gen, tokens, heads, dim, dtype=dt), _randn(gen, tokens, dim, dtype=dt),
            _randn(gen, 6, window, dim, dtype=dt), _randn(gen, heads) * 0.5, dim**-0.5, batch)
    return args, kwargs


def _bounded_replay_attention_inputs(gen, dt):
    """The HCA case with window KV missing below a start inside each sequence's window (bounded prefix
    replay, `ForwardBatch.window_starts_cpu`): those ring rows hold garbage the op must not read."""
    args, kwargs = _attention_inputs(gen, dt, 8, False)
    batch = args[5]
    starts = [max(0, c - 3) for c in batch.context_lens_cpu]
    return (*args[:5], replace(batch, window_starts_cpu=starts)), kwargs


def _rotary_attention_inputs(gen, dt, ratio, with_selection, q_norm, group=None):
    """`_attention_inputs` with an inv_freq for the last 8 of 32 channels and, for V4's layers, the
    query heads' norm; q is scaled off unit RMS so that the norm matters. `group`: the output's
    quantisation group (`rotary_attention_quantized`)."""
    (q, *rest), kwargs = _attention_inputs(gen, dt, ratio, with_selection)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    args = (3 * q, *rest, inv_freq, *(() if group is None else (group,)))
    return args, {**kwargs, "q_norm_eps": 1e-6 if q_norm else None}


def _gather_rows_inputs(gen, dt, width):
    if dt == torch.float8_e8m0fnu:
        table = torch.randint(100, 150, (300, width), generator=gen, dtype=torch.uint8).view(dt)
    else:
        table = _randn(gen, 300, width, dtype=dt)
    ids = torch.randint(0, 300, (37,), generator=gen)
    ids[5] = ids[20] = 299  # a repeated id and the last row
    return (table, ids), {}


def _store_window_inputs(gen, dt):
    batch = _step_batch(gen, _QUERY_LENS, _CONTEXT_LENS, 6, blocks_per_seq=4, num_blocks=24)
    return (_randn(gen, batch.num_tokens, 32, dtype=dt), _randn(gen, 6, 8, 32, dtype=dt), batch), {}


def _route_inputs(gen, dt, hashed):
    experts, top_k, tokens = 16, 4, 13
    kwargs = {"bias": _randn(gen, experts) * 0.1}
    if hashed:
        ids = torch.randint(0, 97, (tokens,), generator=gen)
        table = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(97)])
        kwargs = {"tid2eid": table, "input_ids": ids}
    return (_randn(gen, tokens, 64, dtype=dt), _randn(gen, experts, 64, dtype=dt) * 0.2, top_k, 1.5), kwargs


def _mlp(gen, dt, hidden, inter, fmt):
    if fmt == "fp8":
        from deepinfer_core.quantization import quantize_fp8_block

        parts = [quantize_fp8_block(_randn(gen, *shape) * 0.2, (16, 32)) for shape in
                 ((inter, hidden), (inter, hidden), (hidden, inter))]
        return MlpWeights(parts[0][0], parts[1][0], parts[2][0], parts[0][1], parts[1][1], parts[2][1], (16, 32))
    if fmt == "fp4":
        from deepinfer_core.quantization import quantize_fp4

        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        parts = [quantize_fp4(_randn(gen, *shape) * 0.2) for shape in shapes]
        return MlpWeights(parts[0][0], parts[1][0], parts[2][0], parts[0][1], parts[1][1], parts[2][1])
    return MlpWeights(_randn(gen, inter, hidden, dtype=dt) * 0.2, _randn(gen, inter, hidden, dtype=dt) * 0.2,
                      _randn(gen, hidden, inter, dtype=dt) * 0.2)


def _moe_inputs(gen, dt, expert_fmt, shared_fmt, tokens=11):
    experts, top_k, hidden, inter = 6, 2, 64, 32
    x = _randn(gen, tokens, hidden, dtype=dt) * 2
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    mlps = [_mlp(gen, dt, hidden, inter, expert_fmt) for _ in range(experts)]
    return (x, weights, ids, mlps, _mlp(gen, dt, hidden, inter, shared_fmt), 1.5), {}


def _moe_ep_inputs(gen, dt, part):
    """Expert parallelism's two calls: one routed pair a row (some experts not held) with no shared
    term, or the shared expert alone (no expert held)."""
    (x, weights, ids, mlps, shared, limit), _ = _moe_inputs(gen, dt, "dense", "dense")
    if part == "pairs":
        held = [mlp if e % 3 else None for e, mlp in enumerate(mlps)]
        return (x, weights[:, :1].contiguous(), ids[:, :1].contiguous(), held, None, limit), {}
    return (x, weights, ids, [None] * len(mlps), shared, limit), {}


def _quantized_linear_inputs(gen, dt, fmt, groups=0):
    from deepinfer_core.quantization import quantize_fp4, quantize_fp8_block

    w = _randn(gen, max(groups, 1) * 40, 96) / 10
    x = _randn(gen, 13, *((groups,) if groups else ()), 96, dtype=dt)
    if fmt == "fp8":
        block = (8 if groups else 16, 32)  # grouped: 40-row groups hold whole 8-row blocks
        weight, scale = quantize_fp8_block(w, block)
        return (x, weight, scale, block), {}
    weight, scale = quantize_fp4(w)
    return (x, weight, scale), {}


def _grouped_linear_quantized_inputs(gen, dt):
    from deepinfer_core.quantization import quantize_fp8_block

    weight, scale = quantize_fp8_block(_randn(gen, 2 * 64, 128) / 10, (64, 64))
    return (_randn(gen, 13, 2, 128, dtype=dt), weight, scale, (64, 64), 64), {}


def _weight_dequant_inputs(gen, dt):
    """An fp8 weight whose last row and column blocks are cut short, scales spread over 40 binades."""
    from deepinfer_core.quantization import quantize_fp8_block

    block = (32, 64)
    weight, _ = quantize_fp8_block(_randn(gen, 70, 200), block)
    exponents = torch.randint(107, 148, (3, 4), generator=gen, dtype=torch.uint8)
    return (weight, exponents.view(torch.float8_e8m0fnu), block, dt), {}


def _activation_fake_quant_inputs(gen, dt):
    """x [2, 9, 80] over 40 binades (a scale a row), one row of tiny values under the amax floor, meeting an fp8
    weight of 32-column K blocks (the last cut short)."""
    from deepinfer_core.quantization import quantize_fp8_block

    x = _randn(gen, 2, 9, 80) * torch.exp2(torch.randint(-20, 20, (2, 9, 1), generator=gen).float())
    x[1, 4] *= 1e-9
    weight, _ = quantize_fp8_block(_randn(gen, 64, 80), (32, 32))
    return (x.to(dt), weight, (32, 32)), {}


# Attention / MoE-sized reductions: bf16 rounding of each product and of the outputs.
_WIDE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
_WIDE_ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# fp8 codes compared as their values: the values before quantisation within the attention's tolerance (_WIDE_*),
# plus one e4m3 step where a code rounds the other way (at most 1/8 of the value; below the normal range 2^-9 of the
# group's scale, which 5e-4 covers for groups whose largest value is below ~110).
_CODE_STEP_RTOL = {dtype: rtol + 0.13 for dtype, rtol in _WIDE_RTOL.items()}
_CODE_STEP_ATOL = {dtype: atol + 5e-4 for dtype, atol in _WIDE_ATOL.items()}

OP_CASES: list[OpCase] = [
    OpCase(
        "rms_norm", "weighted_odd_width",
        lambda g, dt: ((_randn(g, 7, 3, 131, dtype=dt), _randn(g, 131).abs() + 0.5, 1e-6), {}),
        rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase(
        "rms_norm", "unweighted",
        lambda g, dt: ((_randn(g, 5, 64, dtype=dt), None, 1e-6), {}),
        rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase(  # a column slice of a wider output, as the models' grouped projections give it
        "rms_norm", "column_view",
        lambda g, dt: ((_randn(g, 9, 160, dtype=dt)[:, 32:], _randn(g, 128).abs() + 0.5, 1e-6), {}),
        rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase(
        "linear", "odd_shapes",
        lambda g, dt: ((_randn(g, 13, 96, dtype=dt), _randn(g, 37, 96, dtype=dt) / 10), {}),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2},
    ),
    OpCase(
        "linear", "fp8_block",
        lambda g, dt: _quantized_linear_inputs(g, dt, "fp8"),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2},
    ),
    OpCase(
        "linear", "fp4",
        lambda g, dt: _quantized_linear_inputs(g, dt, "fp4"),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2},
    ),
    OpCase(  # W8A8: x rounded to fp8 per row and 32-column block
        "linear", "fp8_block_fp8_activations",
        lambda g, dt: _quantized_linear_inputs(g, dt, "fp8"),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2}, modes={"fp8_activations": True},
    ),
    OpCase(
        "grouped_linear", "fp8_fp8_activations",
        lambda g, dt: _quantized_linear_inputs(g, dt, "fp8", groups=2),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2}, modes={"fp8_activations": True},
    ),
    OpCase(  # W8A8 tiles whose column tiles are the output's quantisation groups (64 x 64 blocks, groups of 64)
        "grouped_linear_quantized", "fp8_fp8_activations_group_64",
        lambda g, dt: _grouped_linear_quantized_inputs(g, dt), rtol=_CODE_STEP_RTOL, atol=_CODE_STEP_ATOL,
        modes={"fp8_activations": True}, compared_as=QuantizedActivations.dequantize,
    ),
    OpCase(
        "grouped_linear", "two_groups",
        lambda g, dt: ((_randn(g, 9, 2, 48, dtype=dt), _randn(g, 2 * 24, 48, dtype=dt) / 10), {}),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2},
    ),
    OpCase(  # rows past one tile and an odd vocabulary, float32 out of either dtype
        "logits", "lm_head",
        lambda g, dt: ((_randn(g, 19, 96, dtype=dt), _randn(g, 101, 96, dtype=dt) / 10), {}),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2},
    ),
    OpCase(  # many ties (scores of eight values), -inf entries, a row all -inf
        "top_entries", "ties_and_unseen", lambda g, dt: ((_tied_scores(g, dt), 13), {}),
    ),
    OpCase(
        "embedding", "rows",
        lambda g, dt: ((torch.randint(0, 50, (17,), generator=g), _randn(g, 50, 24, dtype=dt)), {}),
    ),
    OpCase(
        "hc_embedding", "four_streams",
        lambda g, dt: ((torch.randint(0, 50, (17,), generator=g), _randn(g, 50, 24, dtype=dt), 4), {}),
    ),
    OpCase("gather_rows", "host_table_repeated_ids", lambda g, dt: _gather_rows_inputs(g, dt, 40), host_args=(0,)),
    OpCase(
        "gather_rows", "host_fp8_rows", lambda g, dt: _gather_rows_inputs(g, torch.float8_e4m3fn, 48),
        dtypes=(torch.float32,), host_args=(0,),
    ),
    OpCase(  # e8m0 row scales: 3 bytes a row, not a whole number of words
        "gather_rows", "host_e8m0_scales", lambda g, dt: _gather_rows_inputs(g, torch.float8_e8m0fnu, 3),
        dtypes=(torch.float32,), host_args=(0,),
    ),
    OpCase("rope", "forward", lambda g, dt: _rope_inputs(g, dt, False), rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase("rope", "inverse", lambda g, dt: _rope_inputs(g, dt, True), rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase("rope", "inplace_permitted", lambda g, dt: _rope_inputs(g, dt, False, inplace=True),
           rtol=_TOL_RTOL, atol=_TOL_ATOL, given_up=(0,)),
    OpCase("latent_norms", "column_views", _latent_norms_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase("hc_pre", "four_streams", _hc_pre_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase("hc_pre_norm", "four_streams", _hc_pre_norm_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase("hc_collapse_norm", "four_streams", _hc_collapse_norm_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase("hc_post", "four_streams", _hc_post_inputs, rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    # the streams as `hc_post` (each term rounded), the coefficients from them
    OpCase("hc_update_mix", "post_then_mix", _hc_update_mix_inputs, rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase("hc_head", "two_streams", _hc_head_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase(
        "compress_kv", "csa_overlap",
        lambda g, dt: _compress_inputs(g, dt, 4, True), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "compress_kv", "hca",
        lambda g, dt: _compress_inputs(g, dt, 8, False), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "compress_kv", "csa_column_views",
        lambda g, dt: _compress_inputs(g, dt, 4, True, column_views=True), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    # Integer output: exact. Random scores over <= 8 entries essentially never tie.
    OpCase("indexer_topk", "mixed_step", _indexer_inputs, dtypes=(torch.float32,)),
    OpCase("indexer_topk", "head_weights_column_view", lambda g, dt: _indexer_inputs(g, dt, column_view=True),
           dtypes=(torch.float32,)),
    OpCase("indexer_topk", "decode_step", lambda g, dt: _indexer_inputs(g, dt, decode=True), dtypes=(torch.float32,)),
    OpCase(
        "sparse_attention", "sliding",
        lambda g, dt: _attention_inputs(g, dt, 0, False), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "sparse_attention", "hca",
        lambda g, dt: _attention_inputs(g, dt, 8, False), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "sparse_attention", "csa_selected",
        lambda g, dt: _attention_inputs(g, dt, 4, True), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "sparse_attention", "csa_decode_step",
        lambda g, dt: _attention_inputs(g, dt, 4, True, decode=True), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase("sparse_attention", "bounded_replay_window_starts", _bounded_replay_attention_inputs,
           rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase(
        "rotary_attention", "sliding_normed_queries",
        lambda g, dt: _rotary_attention_inputs(g, dt, 0, False, True), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
        given_up=(0,),
    ),
    OpCase(
        "rotary_attention", "csa_selected_normed_queries",
        lambda g, dt: _rotary_attention_inputs(g, dt, 4, True, True), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
        given_up=(0,),
    ),
    OpCase(
        "rotary_attention", "hca",
        lambda g, dt: _rotary_attention_inputs(g, dt, 8, False, False), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
        given_up=(0,),
    ),
    OpCase(
        "rotary_attention_quantized", "csa_selected_normed_queries_group_16",
        lambda g, dt: _rotary_attention_inputs(g, dt, 4, True, True, group=16), rtol=_CODE_STEP_RTOL,
        atol=_CODE_STEP_ATOL, given_up=(0,), compared_as=QuantizedActivations.dequantize,
    ),
    OpCase("store_window", "mixed_step", _store_window_inputs),
    OpCase(
        "route", "score", lambda g, dt: _route_inputs(g, dt, False),
        dtypes=(torch.float32,), rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase(
        "route", "hash", lambda g, dt: _route_inputs(g, dt, True), rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "fused_moe", "dense", lambda g, dt: _moe_inputs(g, dt, "dense", "dense"),
        rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "fused_moe", "fp4_experts_fp8_shared", lambda g, dt: _moe_inputs(g, dt, "fp4", "fp8"),
        rtol=_WIDE_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 6e-2},
    ),
    # A SwiGLU value a rounding apart can land on the next e4m3 code, 1/16 away, before w2: in bf16 one ulp of exp
    # does it; in float32 Hopper's fp8 wgmma (tiles of 64+ rows: prefill sizes, batch-invariant mode) does, as it
    # adds a K block's products below float32 precision (H100, this case at 64-row tiles: 86-90% of the outputs off
    # the reference by more than 1e-5, up to 3.5e-2; at 16-row tiles, mma.sync, none; BENCHMARKS.md, 2026-12-07).
    OpCase(
        "fused_moe", "fp8_experts_fp8_activations", lambda g, dt: _moe_inputs(g, dt, "fp8", "fp8"),
        rtol=_WIDE_RTOL, atol={torch.float32: 1e-1, torch.bfloat16: 1e-1}, modes={"fp8_activations": True},
    ),
    OpCase(  # a decode token: the nvidia backend's one-launch plan, and fp4 weights in its decode tiles
        "fused_moe", "one_token_fp4_experts_fp8_shared", lambda g, dt: _moe_inputs(g, dt, "fp4", "fp8", tokens=1),
        rtol=_WIDE_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 6e-2},
    ),
    OpCase("fused_moe", "ep_pairs_no_shared", lambda g, dt: _moe_ep_inputs(g, dt, "pairs"),
           rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase("fused_moe", "ep_shared_only", lambda g, dt: _moe_ep_inputs(g, dt, "shared"),
           rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase(
        "sample", "mixed_rows_all_filters",
        lambda g, dt: (
            (
                _randn(g, 7, 301, dtype=dt) * 3,
                torch.tensor([0.0, 0.6, 1.0, 1.4, 0.0, 0.9, 2.0]),
                torch.randint(0, 2**62, (7,), generator=g),
                torch.randint(0, 5000, (7,), generator=g),
            ),
            {
                "top_k": torch.tensor([0, 5, 0, 40, 3, 0, 1]),
                "top_p": torch.tensor([1.0, 0.9, 0.5, 1.0, 0.8, 0.95, 1.0]),
                "min_p": torch.tensor([0.0, 0.0, 0.05, 0.1, 0.0, 0.0, 0.2]),
            },
        ),
        # token ids compare exactly; float32 logits only (the op's contract)
        dtypes=(torch.float32,),
    ),
    OpCase(
        "sample", "unfiltered",
        lambda g, dt: (
            (
                _randn(g, 5, 129, dtype=dt),
                torch.tensor([1.0, 0.3, 0.0, 1.0, 5.0]),
                torch.randint(0, 2**62, (5,), generator=g),
                torch.randint(0, 5000, (5,), generator=g),
            ),
            {},
        ),
        dtypes=(torch.float32,),
    ),
]


# --- DeepSeek-V4.1 ops ------------------------------------------------------------------------------

def _v41_hc_mix_inputs(gen, dt):
    (streams, fn, base, scale, _, hc_eps, iters), _ = _hc_pre_inputs(gen, dt)
    return (streams, fn, base, scale, 1e-20, hc_eps, iters), {}


def _v41_route_inputs(gen, dt):
    experts, tokens = 16, 13
    return (_randn(gen, tokens, 64, dtype=dt), _randn(gen, experts, 64, dtype=dt) * 0.2, _randn(gen, experts) * 0.1,
            4, 1.5, 1.5), {}


def _v41_quant_input(gen, dt):
    # magnitudes over many binades so the blocks get different scales
    x = _randn(gen, 5, 64) * torch.exp2(torch.randint(-12, 6, (5, 1), generator=gen).float())
    return x.to(dt)


def _v41_fp8_dequant_inputs(gen, dt):
    values, exponents = KernelOps().fp8_block_quantize(_v41_quant_input(gen, torch.float32))
    return (values, exponents, dt), {}


def _v41_fp4_dequant_inputs(gen, dt, block, scale_format):
    packed, scales = KernelOps().fp4_block_quantize(_v41_quant_input(gen, torch.float32), block, scale_format)
    return (packed, scales, dt), {}


def _v41_paged_read_inputs(gen, dt, fmt):
    """A paged cache read: parts [blocks, per_block, ...] of quantised vectors, rows [S, n] into them
    (repeats included, as for entries several layers pick)."""
    x = torch.cat([_v41_quant_input(gen, torch.float32) for _ in range(3)]).view(3, 5, 64)
    parts = (KernelOps().fp8_block_quantize(x) if fmt == "fp8" else KernelOps().fp4_block_quantize(x, 16, "e4m3"))
    return (*parts, dt), {"rows": torch.randint(0, 15, (4, 7), generator=gen)}


def _paged_rows_inputs(gen, shared_ids):
    """Block tables [3, 6] with unallocated (-1) tails; picks [3, 7] with -1s (or one id row shared by every
    sequence, as a read of all entries passes it: a stride-0 view), 4 entries a block."""
    tables = torch.randperm(40, generator=gen)[:18].view(3, 6).to(torch.int32)
    tables[1, 4:] = tables[2, 5] = -1
    if shared_ids:
        return (tables, torch.arange(13).expand(3, 13), 4), {}
    ids = torch.randint(0, 24, (3, 7), generator=gen)
    ids[0, 2] = ids[2, 6] = -1
    return (tables, ids, 4), {}


def _selection_tables_inputs(gen):
    """Picks [3, 6] of 20 entries, distinct in a row, with -1s (a row of them, too)."""
    selected = torch.stack([torch.randperm(20, generator=gen)[:6] for _ in range(3)])
    selected[0, 4:] = selected[2] = -1
    return (selected, 20), {}


def _v41_paged_write_inputs(gen, dt, fmt):
    """A paged cache write: new vectors x [5, d] quantised into 5 distinct vectors `rows` of parts [3, 5, ...]
    that already hold codes (the others must stay as they were)."""
    old = torch.cat([_v41_quant_input(gen, torch.float32) for _ in range(3)]).view(3, 5, 64)
    args = () if fmt == "fp8" else (16, "e4m3")
    parts = getattr(KernelOps(), f"{fmt}_block_quantize")(old, *args)
    return (_v41_quant_input(gen, dt), *args), {"out": parts, "rows": torch.randperm(15, generator=gen)[:5]}


def _v41_ngram_hash_inputs(gen, dt):
    """The release's hash layout (2 layers, 4-grams, 8 heads); rows DEAD at the first shift, in the middle
    (live ids after it), nowhere and everywhere, the rest at random."""
    from deepinfer_core.models.deepseek_v41.engram_layout import engram_multipliers, engram_offsets, engram_primes

    n, compressed_vocab = 4, 99092
    primes = engram_primes((1, 3), n, 8, 16000000)
    tokens = torch.randint(0, compressed_vocab, (11, n), generator=gen)
    tokens[torch.rand(11, n, generator=gen) < 0.15] = -1
    tokens[:4] = torch.randint(0, compressed_vocab, (4, n), generator=gen)
    tokens[0, 0] = tokens[1, 2] = -1
    tokens[3] = -1
    multipliers = torch.from_numpy(engram_multipliers((1, 3), n, compressed_vocab))
    return (tokens, 2, multipliers, torch.tensor(primes), torch.tensor(engram_offsets(primes))), {}


OP_CASES += [
    OpCase("hc_mix", "sinkhorn_eps_1e-20", _v41_hc_mix_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase(
        "hc_collapse", "four_streams",
        lambda g, dt: ((_randn(g, 7, 4, 40, dtype=dt), torch.rand(7, 4, generator=g) + 0.1), {}),
        rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase("hc_expand", "four_streams", _hc_post_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    # ids compare exactly (random scores do not tie); weights float32 in both dtypes
    OpCase("route_fp32", "gate_temp", _v41_route_inputs, rtol=_TOL_RTOL, atol=_TOL_ATOL),
    OpCase("fused_moe_prescaled", "dense", lambda g, dt: _moe_inputs(g, dt, "dense", "dense"),
           rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase("fused_moe_prescaled", "fp4_experts_fp8_shared", lambda g, dt: _moe_inputs(g, dt, "fp4", "fp8"),
           rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase("fused_moe_prescaled", "ep_pairs_no_shared", lambda g, dt: _moe_ep_inputs(g, dt, "pairs"),
           rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase("fused_moe_prescaled", "ep_shared_only", lambda g, dt: _moe_ep_inputs(g, dt, "shared"),
           rtol=_WIDE_RTOL, atol=_WIDE_ATOL),
    OpCase(
        "gated_pool", "ratio_3",
        lambda g, dt: ((_randn(g, 5, 3, 24), _randn(g, 5, 3, 24) * 2), {}),
        dtypes=(torch.float32,), rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase(
        "indexer_scores", "odd_lengths",
        lambda g, dt: ((_randn(g, 9, 8, 32, dtype=dt), _randn(g, 13, 32, dtype=dt), _randn(g, 9, 8, dtype=dt)), {}),
        rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(  # a decode step: each query row against its own sequence's keys
        "indexer_scores", "keys_per_query",
        lambda g, dt: ((_randn(g, 5, 8, 32, dtype=dt), _randn(g, 5, 13, 32, dtype=dt), _randn(g, 5, 8, dtype=dt)), {}),
        rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(  # a decode step's rows seeing 0, some and all of their keys
        "indexer_scores", "visible_counts",
        lambda g, dt: ((_randn(g, 5, 8, 32, dtype=dt), _randn(g, 5, 13, 32, dtype=dt), _randn(g, 5, 8, dtype=dt),
                        torch.tensor([0, 4, 13, 1, 9])), {}),
        rtol=_WIDE_RTOL, atol=_WIDE_ATOL,
    ),
    OpCase(
        "engram_gate", "two_streams",
        lambda g, dt: ((_randn(g, 7, 2, 48, dtype=dt), _randn(g, 7, 2, 48, dtype=dt), _randn(g, 7, 48, dtype=dt),
                        (torch.rand(2, 48, generator=g) + 0.5).to(dt), _randn(g, 2, 48, dtype=dt), 1e-20), {}),
        rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    # integer ids, compared exactly; the op takes no float input to vary the dtype of (int64 labels the one run)
    OpCase("ngram_hash", "dead_shifts", _v41_ngram_hash_inputs, dtypes=(torch.int64,)),
    # the KV formats are exact: codes, scales and dequantised values compare bit for bit
    OpCase("fp8_block_quantize", "binades", lambda g, dt: ((_v41_quant_input(g, dt),), {})),
    OpCase("fp8_block_dequantize", "binades", _v41_fp8_dequant_inputs),
    OpCase("fp4_block_quantize", "e4m3_block16", lambda g, dt: ((_v41_quant_input(g, dt), 16, "e4m3"), {})),
    OpCase("fp4_block_quantize", "ue8m0_block32", lambda g, dt: ((_v41_quant_input(g, dt), 32, "ue8m0"), {})),
    OpCase("fp4_block_dequantize", "e4m3_block16", lambda g, dt: _v41_fp4_dequant_inputs(g, dt, 16, "e4m3")),
    OpCase("fp4_block_dequantize", "ue8m0_block32", lambda g, dt: _v41_fp4_dequant_inputs(g, dt, 32, "ue8m0")),
    OpCase("fp8_block_dequantize", "paged_rows", lambda g, dt: _v41_paged_read_inputs(g, dt, "fp8")),
    OpCase("fp4_block_dequantize", "paged_rows", lambda g, dt: _v41_paged_read_inputs(g, dt, "fp4")),
    # integer ids, compared exactly (int64 labels the one run)
    OpCase("paged_rows", "picks", lambda g, dt: _paged_rows_inputs(g, False), dtypes=(torch.int64,)),
    OpCase("paged_rows", "shared_ids", lambda g, dt: _paged_rows_inputs(g, True), dtypes=(torch.int64,)),
    OpCase("selection_tables", "picks", lambda g, dt: _selection_tables_inputs(g), dtypes=(torch.int64,)),
    OpCase("fp8_block_quantize", "paged_rows", lambda g, dt: _v41_paged_write_inputs(g, dt, "fp8")),
    OpCase("fp4_block_quantize", "paged_rows", lambda g, dt: _v41_paged_write_inputs(g, dt, "fp4")),
    # exact: a code times a power of two, compared bit for bit
    OpCase("dequantize_weight", "fp8_block", _weight_dequant_inputs),
    OpCase("fake_quantize_activations", "fp8_block", _activation_fake_quant_inputs, modes={"fp8_activations": True}),
]
