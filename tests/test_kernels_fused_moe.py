"""Triton grouped-GEMM MoE (through `TritonOps.fused_moe`) against `KernelOps.fused_moe`."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
import triton
import triton.language as tl
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights
from deepinfer_core.quantization import quantize_fp4, quantize_fp8_block
from deepinfer_kernels.fused_moe import _expert_tile, fp4_kernel_format, moe_routed, shared_fusable, tile_config
from deepinfer_kernels.weight_tiles import FP4_PAIR_ORDER, FP4_SMALL_SCALES
from deepinfer_nvidia.ops import TritonOps

# The reference accumulates each expert's weighted output in the compute dtype in expert order, the
# kernel sums the k outputs in float32: bfloat16 differs by a few output roundings (~1e-2 in norm);
# float32 only by summation order.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _mlp(fmt: str, hidden: int, inter: int, gen: torch.Generator, dtype: torch.dtype, magnitude: float = 1 / 6,
         block: tuple[int, int] = (64, 64)) -> MlpWeights:
    shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    mats = {name: torch.randn(*shape, generator=gen) * magnitude for name, shape in shapes.items()}
    if fmt == "fp8":
        q = {name: quantize_fp8_block(m, block) for name, m in mats.items()}
        return MlpWeights(q["w1"][0], q["w3"][0], q["w2"][0], q["w1"][1], q["w3"][1], q["w2"][1], block)
    if fmt == "fp4":
        q = {name: quantize_fp4(m) for name, m in mats.items()}
        return MlpWeights(q["w1"][0], q["w3"][0], q["w2"][0], q["w1"][1], q["w3"][1], q["w2"][1])
    return MlpWeights(mats["w1"].to(dtype), mats["w3"].to(dtype), mats["w2"].to(dtype))


def _inputs(fmt, dtype, tokens, experts=7, top_k=3, hidden=96, inter=64, seed=0):
    """The shared expert in the experts' format, or fp8 beside fp4 experts as in the fp4 checkpoints (both
    run in the experts' launches at these sizes)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    mlps = [_mlp(fmt, hidden, inter, gen, dtype) for _ in range(experts)]
    return x, weights, ids, mlps, _mlp("fp8" if fmt == "fp4" else fmt, hidden, inter, gen, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
@pytest.mark.parametrize("tokens", [1, 23])
def test_fused_moe_matches_reference(dtype, fmt, tokens):
    x, weights, ids, mlps, shared = _inputs(fmt, dtype, tokens, seed=tokens)
    ops = TritonOps()
    out = ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[dtype])
    stack = ops._stack(mlps, x.device)  # the one the call built
    assert shared_fusable(stack, shared)  # the fp8 shared expert beside fp4 experts too, at decode sizes
    assert shared_fusable(stack, shared, fp8_activations=True) == (fmt != "fp4")
    assert shared_fusable(stack, shared, pairs=8192) == (fmt != "fp4")
    assert stack.fp4_small_scales == (fmt == "fp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
def test_prescaled_moe_matches_reference(dtype, fmt):
    """DeepSeek-V4.1's MoE: the weight scales the activation before w2 (applied once: twice, or not at all,
    is off by the weights' spread in [0.1, 1.1]); the shared expert fused, and apart under fp8 activations
    beside fp4 experts."""
    x, weights, ids, mlps, shared = _inputs(fmt, dtype, 9, seed=11)
    expected = KernelOps().fused_moe_prescaled(x, weights, ids, mlps, shared, 1.5)
    assert_matches(TritonOps().fused_moe_prescaled(x, weights, ids, mlps, shared, 1.5), expected, TOLERANCE[dtype])
    if fmt == "fp4":
        ops, reference = TritonOps(), KernelOps()
        ops.fp8_activations = reference.fp8_activations = True
        assert_matches(ops.fused_moe_prescaled(x, weights, ids, mlps, shared, 1.5),
                       reference.fused_moe_prescaled(x, weights, ids, mlps, shared, 1.5), TOLERANCE[dtype])


def test_fp4_experts_with_scales_above_two_decode_exactly():
    """Scales above 2 overflow the one-product decode's float32 factor: such a stack takes the two-product
    decode (`weight_tiles.FP4_SMALL_SCALES` is only for stacks whose every scale is at most 2)."""
    gen = torch.Generator().manual_seed(5)
    x, weights, ids, _, shared = _inputs("fp4", torch.float32, 9, seed=5)
    mlps = [_mlp("fp4", 96, 64, gen, torch.float32, magnitude=40.0) for _ in range(7)]
    ops = TritonOps()
    out = ops.fused_moe(x, weights, ids, mlps, shared, 1e4)
    stack = ops._stack(mlps, x.device)  # the one the call built
    assert not stack.fp4_small_scales
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1e4), TOLERANCE[torch.float32])


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
def test_the_shared_expert_in_the_routed_launches_equals_it_run_apart(fmt):
    """Fused, the shared expert's output meets the same roundings as when it runs through `linear`; only
    the float32 order of the final sum differs (it is added last in batch-invariant mode: bitwise). fp4
    experts meet an fp8 shared expert, as in the fp4 checkpoints."""
    x, weights, ids, mlps, shared = _inputs(fmt, torch.bfloat16, 23, seed=4)
    ops = TritonOps()
    stack = ops._stack(mlps, x.device)
    apart = moe_routed(x, weights, ids, stack, 1.5) + ops._swiglu(x, shared, 1.5).float()
    assert_matches(moe_routed(x, weights, ids, stack, 1.5, shared=shared), apart, 1e-6)
    if fmt == "fp4":  # its own K tiles are not linear's: batch-invariant mode keeps it apart at every size
        assert not shared_fusable(stack, shared, pairs=None)
    else:
        invariant_apart = moe_routed(x, weights, ids, stack, 1.5, batch_invariant=True) + ops._swiglu(x, shared, 1.5).float()
        assert torch.equal(moe_routed(x, weights, ids, stack, 1.5, batch_invariant=True, shared=shared), invariant_apart)
    with pytest.raises(ValueError, match="shared expert's weights differ"):
        moe_routed(x, weights, ids, stack, 1.5, shared=_mlp("dense", 96, 32, torch.Generator(), torch.bfloat16))


def test_a_stack_of_the_models_experts_goes_with_them():
    """Experts held as the model holds them (Parameters viewing one stacked tensor) are stacked without a copy,
    and the stack goes when they are freed: a second model built in the process does not find the first's
    memory still taken."""
    import gc

    from deepinfer_core.platform.kernel_ops import MlpWeights

    stacked = [torch.randn(4, 32, 64), torch.randn(4, 32, 64), torch.randn(4, 64, 32)]
    experts = [MlpWeights(*(torch.nn.Parameter(s[e], requires_grad=False) for s in stacked)) for e in range(4)]
    ops = TritonOps()
    stack = ops._stack(experts, torch.device("cpu"))
    assert stack.w1.data_ptr() == stacked[0].data_ptr() and torch.equal(stack.w2, stacked[2])
    del stack, experts
    gc.collect()
    assert len(ops._expert_stacks) == 0


def test_the_slot_sum_stores_the_activation_dtype_with_one_rounding():
    """With nothing added after the routed launches (shared expert fused or absent), the slot sum stores x's
    dtype itself: the float32 sum rounded once, bit for bit what converting the float32 result gives."""
    x, weights, ids, mlps, shared = _inputs("dense", torch.bfloat16, 23, seed=6)
    stack = TritonOps()._stack(mlps, x.device)
    summed = moe_routed(x, weights, ids, stack, 1.5, shared=shared)
    stored = moe_routed(x, weights, ids, stack, 1.5, shared=shared, out_dtype=torch.bfloat16)
    assert summed.dtype == torch.float32 and stored.dtype == torch.bfloat16
    assert torch.equal(stored, summed.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
@pytest.mark.parametrize("with_shared", [True, False])
def test_the_down_launch_sums_the_slots_as_the_slot_sum_launch_does(monkeypatch, fmt, with_shared):
    """The last of a token's rows to arrive (per column tile) sums its slots in the down launch: the same bits
    as the separate slot-sum launch, a token's repeated expert (hash routing may repeat one) included, and every
    arrival counter is zero again after it."""
    from deepinfer_kernels import fused_moe

    x, weights, ids, mlps, shared = _inputs(fmt, torch.bfloat16, 23, seed=12)
    ids[::4, 1] = ids[::4, 0]
    stack = TritonOps()._stack(mlps, x.device)
    shared = shared if with_shared else None
    assert fused_moe.slot_sum_in_down_launch(23, 3, held_all=True)
    in_down = moe_routed(x, weights, ids, stack, 1.5, shared=shared, out_dtype=torch.bfloat16)
    counters = fused_moe.arrival_counters("MoE slot-sum", x.device, 0)  # the pool the launch made
    assert counters.numel() == fused_moe._SLOT_SUM_COUNTERS and not counters.any(), "the last arrival resets its counter"
    monkeypatch.setattr(fused_moe, "slot_sum_in_down_launch", lambda *_: False)
    apart = moe_routed(x, weights, ids, stack, 1.5, shared=shared, out_dtype=torch.bfloat16)
    assert torch.equal(in_down, apart)
    assert_matches(in_down, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.bfloat16])


def test_the_slot_sum_leaves_the_down_launch_when_experts_live_elsewhere_or_counters_run_out():
    """Pairs of experts held elsewhere are never stored here (their tokens' counts would never complete)."""
    from deepinfer_kernels.fused_moe import _SLOT_SUM_COUNTERS, slot_sum_in_down_launch

    assert not slot_sum_in_down_launch(1, 128, held_all=False)
    assert slot_sum_in_down_launch(_SLOT_SUM_COUNTERS // 128, 128, held_all=True)
    assert not slot_sum_in_down_launch(_SLOT_SUM_COUNTERS // 128 + 1, 128, held_all=True)


@pytest.mark.parametrize("fmt,fp8_activations", [("dense", False), ("fp8", False), ("fp8", True), ("fp4", False)])
def test_prefill_tiles_run_half_empty_row_blocks_as_half_tiles(monkeypatch, fmt, fp8_activations):
    """128-row blocks (the prefill tiles): the routed experts' runs (~43 rows) end in blocks of more than
    half padding, computed as 64-row tiles; the shared expert's 100 rows take the whole tile."""
    from deepinfer_kernels import fused_moe

    assert fused_moe.half_tails(128, False) and not fused_moe.half_tails(128, True)
    assert not fused_moe.half_tails(tile_config(8, 0, False)[0], False)
    monkeypatch.setattr(fused_moe, "tile_config", lambda *_: (128, 32, 32, 4, 2))
    x, weights, ids, mlps, shared = _inputs(fmt, torch.bfloat16, 100, seed=6)
    if fp8_activations:
        shared = _mlp("fp8", 96, 64, torch.Generator().manual_seed(9), torch.bfloat16)
    ops, reference = TritonOps(), KernelOps()
    ops.fp8_activations = reference.fp8_activations = fp8_activations
    out = ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, reference.fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.bfloat16])


@triton.jit
def _tiles_kernel(blocks_ptr, out_ptr, N, BLOCK_N: tl.constexpr, ROW_GROUP: tl.constexpr):
    expert, block, column = _expert_tile(blocks_ptr, N, BLOCK_N, ROW_GROUP)
    at = out_ptr + 3 * tl.program_id(0)
    tl.store(at, expert)
    tl.store(at + 1, block)
    tl.store(at + 2, column)


def test_an_experts_programs_walk_its_column_tiles_a_group_of_row_blocks_at_a_time():
    """Runs of 1, 5 and 2 row blocks and a block no run holds, 3 column tiles, groups of 2 blocks: every
    (block, column tile) once, each in its own expert's run, and the blocks of a group side by side; in groups
    of 1, row block by row block."""
    blocks = torch.tensor([[0, 0, 1], [1, 1, 5], [1, 1, 5], [1, 1, 5], [1, 1, 5], [1, 1, 5], [2, 6, 2], [2, 6, 2],
                           [3, 8, 1]], dtype=torch.int32)
    out = torch.full((blocks.shape[0] * 3, 3), -1, dtype=torch.int32)
    _tiles_kernel[(out.shape[0],)](blocks, out, 96, BLOCK_N=32, ROW_GROUP=2)
    expected = [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    expected += [(1, block, column) for column in range(3) for block in (1, 2)]
    expected += [(1, block, column) for column in range(3) for block in (3, 4)]
    expected += [(1, 5, column) for column in range(3)]
    expected += [(2, block, column) for column in range(3) for block in (6, 7)]
    expected += [(3, 8, column) for column in range(3)]
    assert out.tolist() == [list(t) for t in expected]
    _tiles_kernel[(out.shape[0],)](blocks, out, 96, BLOCK_N=32, ROW_GROUP=1)  # decode tiles: block by block
    assert out.tolist() == [[blocks[p // 3, 0].item(), p // 3, p % 3] for p in range(out.shape[0])]


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
def test_row_blocks_grouped_on_column_tiles_give_the_reference(monkeypatch, fmt):
    """16-row blocks, runs of ~3 routed and 7 shared blocks, walked 2 blocks at a time (`_expert_tile`)."""
    from deepinfer_kernels import fused_moe

    monkeypatch.setattr(fused_moe, "tile_config", lambda *_: (16, 32, 32, 4, 2))
    monkeypatch.setattr(fused_moe, "row_group", lambda kernel_format, block_m: 2)
    x, weights, ids, mlps, shared = _inputs(fmt, torch.bfloat16, 100, seed=11)
    out = TritonOps().fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.bfloat16])


def test_16_bit_experts_in_prefill_tiles_read_their_weights_through_tma_with_the_same_result(monkeypatch):
    """bf16 experts and shared expert in 64-row tiles: the TMA descriptors give the pointers' bits; fp8, fp4,
    float32 and decode tiles keep the pointers, as does a stack whose experts have gaps between them."""
    from deepinfer_kernels import fused_moe

    assert fused_moe.weights_through_tma(0, 64, ieee=False) and fused_moe.weights_through_tma(0, 128, ieee=False)
    assert not any([fused_moe.weights_through_tma(0, 16, False), fused_moe.weights_through_tma(0, 128, True),
                    fused_moe.weights_through_tma(1, 128, False), fused_moe.weights_through_tma(3, 128, False)])
    monkeypatch.setattr(fused_moe, "tile_config", lambda *_: (64, 32, 32, 4, 2))
    x, weights, ids, mlps, shared = _inputs("dense", torch.bfloat16, 100, seed=12)
    stack = TritonOps()._stack(mlps, x.device)
    built = []
    monkeypatch.setattr(fused_moe, "TensorDescriptor", _Recorded(built))
    through_tma = moe_routed(x, weights, ids, stack, 1.5, shared=shared)
    assert len(built) == 6  # w1, w3, w2 and the shared expert's
    monkeypatch.setattr(fused_moe, "weights_through_tma", lambda *_: False)
    assert torch.equal(through_tma, moe_routed(x, weights, ids, stack, 1.5, shared=shared))
    gapped = torch.empty((7, 2 * 64, 96), dtype=torch.bfloat16)[:, :64]
    assert fused_moe._weight_rows(gapped) is None and fused_moe._weight_rows(stack.w1) is not None


def test_16_bit_experts_in_128_row_tiles_take_down_tiles_twice_as_wide_with_the_same_result(monkeypatch):
    from deepinfer_kernels import fused_moe

    assert fused_moe.down_columns(0, 128, 128) == 256
    assert [fused_moe.down_columns(*case) for case in ((0, 64, 64), (1, 128, 128), (3, 128, 128))] == [64, 128, 128]
    monkeypatch.setattr(fused_moe, "tile_config", lambda *_: (128, 32, 32, 4, 2))
    x, weights, ids, mlps, shared = _inputs("dense", torch.bfloat16, 100, seed=13)
    stack = TritonOps()._stack(mlps, x.device)
    wide = moe_routed(x, weights, ids, stack, 1.5, shared=shared)
    monkeypatch.setattr(fused_moe, "down_columns", lambda kernel_format, block_m, block_n: block_n)
    assert torch.equal(wide, moe_routed(x, weights, ids, stack, 1.5, shared=shared))


class _Recorded:
    """TensorDescriptor, counting the descriptors built."""

    def __init__(self, built: list):
        self.built = built

    def from_tensor(self, *args, **kwargs):
        from triton.tools.tensor_descriptor import TensorDescriptor

        self.built.append(args[0].shape)
        return TensorDescriptor.from_tensor(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 23])
def test_fused_moe_with_fp8_activations_matches_reference(dtype, tokens):
    """W8A8 experts (x and the SwiGLU activation quantised per row and 64-column block) and an fp8
    shared expert in their launches, against the reference's rounding of the same inputs."""
    x, weights, ids, mlps, _ = _inputs("fp8", dtype, tokens, seed=tokens)
    shared = _mlp("fp8", 96, 64, torch.Generator().manual_seed(9), dtype)
    ops, reference = TritonOps(), KernelOps()
    ops.fp8_activations = reference.fp8_activations = True
    out = ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, reference.fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prescaled", [False, True])
def test_the_gate_up_launch_quantises_the_activation_as_the_quantisation_launch_does(monkeypatch, dtype, prescaled):
    """W8A8 in column tiles of one activation group (64 x 64 blocks, 64 columns): the gate/up epilogue writes
    the fp8 codes and scales, the same bits as the bf16 activation quantised by its own launch; whole and half
    tiles (runs of ~43 rows in 128-row blocks), the shared expert's 100 rows, the weight before w2 or after."""
    from deepinfer_kernels import fused_moe

    assert fused_moe.act_quantized_in_gate_up(True, 128, 128)
    assert not any([fused_moe.act_quantized_in_gate_up(False, 128, 128),
                    fused_moe.act_quantized_in_gate_up(True, 64, 128)])
    monkeypatch.setattr(fused_moe, "tile_config", lambda *_: (128, 64, 64, 4, 2))
    x, weights, ids, mlps, _ = _inputs("fp8", dtype, 100, seed=14)
    shared = _mlp("fp8", 96, 64, torch.Generator().manual_seed(15), dtype)
    stack = TritonOps()._stack(mlps, x.device)
    run = lambda: moe_routed(x, weights, ids, stack, 1.5, fp8_activations=True, shared=shared, prescaled=prescaled)
    in_epilogue = run()
    monkeypatch.setattr(fused_moe, "act_quantized_in_gate_up", lambda *_: False)
    assert torch.equal(in_epilogue, run())


@pytest.mark.parametrize("fmt,fp8_activations", [("dense", False), ("fp8", False), ("fp8", True), ("fp4", False)])
def test_eight_row_tiles_put_the_weights_on_the_tall_side_in_every_format(monkeypatch, fmt, fp8_activations):
    """Tiles of fewer rows than the MMA's 16 (the fp4 decode tiles, whose fp8 shared expert's loop shares
    them) compute w x^T, except fp8 of whole-block scales (x w^T, fp8 activations' per-token scales too):
    every format's loop at 8 rows."""
    from deepinfer_kernels import fused_moe

    monkeypatch.setattr(fused_moe, "tile_config", lambda *_: (8, 32, 64, 2, 2))
    x, weights, ids, mlps, shared = _inputs(fmt, torch.bfloat16, 11, seed=12)
    if fp8_activations:
        shared = None
    ops, reference = TritonOps(), KernelOps()
    ops.fp8_activations = reference.fp8_activations = fp8_activations
    out = ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, reference.fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.bfloat16])


def test_fp4_experts_with_the_fp8_shared_expert_are_batch_invariant():
    """Batch-invariant mode keeps the fp8 shared expert apart at every step size: a token's output is the
    same bits alone and in a batch."""
    x, weights, ids, mlps, shared = _inputs("fp4", torch.bfloat16, 9, seed=6)
    ops = TritonOps()
    ops.batch_invariant = True
    asked = []
    ops._shared_fusable = lambda *args: asked.append(args[3]) or shared_fusable(*args)
    batch = ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    alone = ops.fused_moe(x[4:5], weights[4:5], ids[4:5], mlps, shared, 1.5)
    assert asked == [None, None]  # one answer for every step size: apart
    assert torch.equal(alone, batch[4:5])


def test_fp4_experts_under_fp8_activations_run_the_fp8_shared_expert_apart():
    """fp8 activations would quantise the fp8 shared expert's input and not the fp4 experts': it runs
    through `linear` (W8A8) after the routed launches."""
    x, weights, ids, mlps, shared = _inputs("fp4", torch.bfloat16, 5, seed=8)
    ops, reference = TritonOps(), KernelOps()
    ops.fp8_activations = reference.fp8_activations = True
    out = ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, reference.fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.bfloat16])


def test_fp4_decode_tiles_take_the_weights_in_pair_order_and_the_others_keep_column_order():
    """Decode-sized steps put the fp4 weights on the MMA's tall side in pair order; prefill tiles and
    batch-invariant mode (one tile for every step size, its results unchanged) keep the float32 decode."""
    for pairs in (7, 112, 448, 5000):  # 5000: the 16 x 64 tiles (`_FP4_NARROW_PAIRS`)
        assert fp4_kernel_format(tile_config(pairs, 2, False)[0]) == FP4_PAIR_ORDER
    assert fp4_kernel_format(tile_config(9000, 2, False)[0]) == FP4_SMALL_SCALES
    assert fp4_kernel_format(tile_config(7, 2, True)[0]) == FP4_SMALL_SCALES


def _recorded_gate_up_launches(monkeypatch, keyword: str) -> list:
    """The value of `keyword` in each gate/up launch from here on (launch options and constexprs alike: the
    interpreter ignores the former, so they are read from the call)."""
    from deepinfer_kernels import fused_moe

    recorded, kernel = [], fused_moe._gate_up_kernel

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append(kwargs[keyword]) or kernel[grid](*args, **kwargs)

    monkeypatch.setattr(fused_moe, "_gate_up_kernel", Recorded())
    return recorded


@pytest.mark.parametrize("fmt,shared_block,expected", [
    ("fp4", (64, 64), 128),  # V4's fp4 checkpoints at decode sizes: an fp8 shared expert of whole-block scales
    ("fp4", (32, 32), None),  # V4.1's: its shared loop scales 32 x 32 blocks in the tile
    ("fp4", None, None),  # no shared expert in the launches
    ("fp8", (64, 64), None),
    ("dense", None, None),
])
def test_the_gate_up_launch_caps_registers_only_beside_an_fp8_shared_expert_of_whole_blocks(
        monkeypatch, fmt, shared_block, expected):
    """The cap is a launch option, which the interpreter ignores: the launch's keyword arguments are recorded."""
    launched = _recorded_gate_up_launches(monkeypatch, "maxnreg")
    x, weights, ids, mlps, _ = _inputs(fmt, torch.bfloat16, 3, seed=15)
    shared = None
    if shared_block is not None:
        shared = _mlp("fp8", 96, 64, torch.Generator().manual_seed(16), torch.bfloat16, block=shared_block)
    out = TritonOps().fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert launched == [expected]
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("pairs_threshold,with_shared", [(None, False), (16, False), (16, True)])
def test_fp4_experts_of_small_scales_decode_with_one_product_whatever_runs_beside_them(
        monkeypatch, pairs_threshold, with_shared):
    """fp4 experts whose scales are all at most 2 take the one-product decode (FP4_PAIR_ORDER / FP4_SMALL_SCALES)
    with no shared expert in their launches: a decode step without one, or a prefill-sized step (its fp8 shared
    expert runs apart); the format is a constexpr of the launch."""
    from deepinfer_kernels import fused_moe

    if pairs_threshold is not None:  # prefill tiles at this test's size
        monkeypatch.setattr(fused_moe, "_PREFILL_PAIRS", pairs_threshold)
    formats = _recorded_gate_up_launches(monkeypatch, "FORMAT")
    x, weights, ids, mlps, shared = _inputs("fp4", torch.bfloat16, 9, seed=17)
    shared = shared if with_shared else None
    out = TritonOps().fused_moe(x, weights, ids, mlps, shared, 1.5)
    block_m = fused_moe.tile_config(9 * 3, 2, False)[0]
    assert formats == [fp4_kernel_format(block_m)]
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.bfloat16])


def test_experts_not_held_contribute_nothing():
    x, weights, ids, mlps, shared = _inputs("dense", torch.float32, 23, seed=5)
    mlps = [m if i % 3 else None for i, m in enumerate(mlps)]
    out = TritonOps().fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.float32])


def test_experts_viewing_one_stack_are_used_without_a_copy():
    x, weights, ids, mlps, shared = _inputs("dense", torch.float32, 9, seed=11)
    stacks = {name: torch.stack([getattr(m, name) for m in mlps]) for name in ("w1", "w3", "w2")}
    # Parameters wrapping the slices, as a model holding its experts stacked would
    views = [
        MlpWeights(*(torch.nn.Parameter(stacks[name][i], requires_grad=False) for name in ("w1", "w3", "w2")))
        for i in range(len(mlps))
    ]
    ops = TritonOps()
    out = ops.fused_moe(x, weights, ids, views, shared, 1.5)
    stacked = ops._stack(views, x.device)
    assert stacked.w1.data_ptr() == stacks["w1"].data_ptr()
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, views, shared, 1.5), TOLERANCE[torch.float32])


def test_an_in_place_reload_rebuilds_the_stack():
    x, weights, ids, mlps, shared = _inputs("dense", torch.float32, 9, seed=13)
    ops = TritonOps()
    ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    for m in mlps:
        m.w1.copy_(torch.randn(m.w1.shape))
    out = ops.fused_moe(x, weights, ids, mlps, shared, 1.5)
    assert_matches(out, KernelOps().fused_moe(x, weights, ids, mlps, shared, 1.5), TOLERANCE[torch.float32])
