"""Triton mHC kernels (`hc_mix`, `hc_collapse` with and without the block's input norm, `hc_update` alone and
with the next site's `hc_mix`, the final head) against the reference ops, through the interpreter."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_kernels import hyper_connection
from deepinfer_kernels.hyper_connection import fn_pieces, hc_collapse, hc_mix, hc_update, hc_update_mix
from deepinfer_kernels.rms_norm import rms_norm
from deepinfer_nvidia.ops import TritonOps

# float32: reduction order only (the RMS factor applied after the dot instead of before: ~1e-7).
# bfloat16 inputs are widened exactly; the coefficients are float32 outputs either way, so the same
# bound holds. Stream updates in bf16 round each term as the reference does, up to a rare 1-ulp flip.
F32_TOL = 2e-6
UPDATE_TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def _streams(gen, t, n, d, dtype):
    return (torch.randn(t, n, d, generator=gen) * 2).to(dtype)


def _mix_args(gen, t, n, d, dtype, norm_eps=1e-6, iters=20):
    """(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) of `hc_mix` / `hc_pre`."""
    streams = _streams(gen, t, n, d, dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=gen) * 0.1
    base, scale = torch.randn((2 + n) * n, generator=gen) * 0.5, torch.rand(3, generator=gen) + 0.5
    return streams, fn, base, scale, norm_eps, 1e-6, iters


def _update_args(gen, t, n, d, dtype):
    """(block_out, streams, post, comb) of `hc_update` / `hc_post`."""
    block_out, streams = (torch.randn(t, d, generator=gen) * 2).to(dtype), _streams(gen, t, n, d, dtype)
    comb = torch.softmax(torch.randn(t, n, n, generator=gen), dim=-1)
    post = 2 * torch.sigmoid(torch.randn(t, n, generator=gen))
    return block_out, streams, post, comb


def _update_mix_args(seed, t, n, d, dtype):
    """(`hc_update`'s arguments, the next site's (fn, base, scale, norm_eps, hc_eps, sinkhorn_iters))."""
    gen = torch.Generator().manual_seed(seed)
    return _update_args(gen, t, n, d, dtype), _mix_args(gen, t, n, d, dtype)[1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n,d,iters,norm_eps", [(19, 4, 40, 20, 1e-6), (5, 2, 72, 3, 1e-20), (1, 4, 16, 1, 1e-6), (3, 4, 300, 20, 1e-6), (70, 4, 600, 20, 1e-6)])
def test_hc_mix_matches_reference(dtype, t, n, d, iters, norm_eps):
    args = _mix_args(torch.Generator().manual_seed(t * 100 + n), t, n, d, dtype, norm_eps, iters)
    for out, ref in zip(hc_mix(*args), KernelOps().hc_mix(*args)):
        assert_matches(out, ref, F32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 16), (70, 300)])
def test_hc_head_matches_reference(dtype, t, d):
    """The head's weights from hc_mix's launches with fn of n rows only (post / comb skipped), then the collapse."""
    gen = torch.Generator().manual_seed(t + d)
    n = 4
    streams = _streams(gen, t, n, d, dtype)
    fn, base, scale = torch.randn(n, n * d, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.5, torch.rand(1, generator=gen) + 0.5
    args = (streams, fn, base, scale, 1e-6, 1e-6)
    assert_matches(TritonOps().hc_head(*args), KernelOps().hc_head(*args), UPDATE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_collapse_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    streams, pre = _streams(gen, 9, 4, 1100, dtype), torch.rand(9, 4, generator=gen) + 0.1
    assert_matches(hc_collapse(streams, pre), KernelOps().hc_collapse(streams, pre), UPDATE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 40), (6, 1100)])
def test_hc_pre_norm_matches_reference(dtype, t, d):
    gen = torch.Generator().manual_seed(t + d)
    args = (*_mix_args(gen, t, 4, d, dtype), torch.rand(d, generator=gen) + 0.5, 1e-6)
    for out, ref in zip(TritonOps().hc_pre_norm(*args), KernelOps().hc_pre_norm(*args)):
        assert_matches(out, ref, UPDATE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_with_the_norm_equals_the_two_kernels(dtype):
    """One launch for the collapse and the norm, the same arithmetic as `hc_collapse` then `rms_norm`."""
    gen = torch.Generator().manual_seed(7)
    streams, pre = _streams(gen, 5, 4, 300, dtype), torch.rand(5, 4, generator=gen) + 0.1
    weight = torch.rand(300, generator=gen)
    assert torch.equal(hc_collapse(streams, pre, (weight, 1e-6)), rms_norm(hc_collapse(streams, pre), weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("round_terms", [True, False])
def test_hc_update_matches_reference(dtype, round_terms):
    args = _update_args(torch.Generator().manual_seed(4), 7, 4, 72, dtype)
    reference = KernelOps().hc_post if round_terms else KernelOps().hc_expand
    assert_matches(hc_update(*args, round_terms), reference(*args), UPDATE_TOL[dtype])


# T <= 64: decode tiles (32 columns of D a program, so 2 or 3 programs a row here); 70: prefill tiles (64 rows
# a program, the second one masked past row 70; 256 columns, 2 steps of 64 at D = 96, the second half masked).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 96), (7, 40), (70, 96)])
def test_hc_update_mix_is_hc_update_then_hc_mix(dtype, t, d):
    """The new streams are `hc_update`'s bits; the coefficients `hc_mix`'s of them but for the float32 order of
    the partial sums; all within the reference op's bounds."""
    update, mix = _update_mix_args(t + d, t, 4, d, dtype)
    streams, *coefficients = hc_update_mix(*update, *mix)
    assert torch.equal(streams, hc_update(*update, round_terms=True))
    for out, ref in zip(coefficients, hc_mix(streams, *mix)):
        assert_matches(out, ref, 1e-6)  # the partial sums' order alone: up to 3e-7 here
    for out, ref in zip((streams, *coefficients), KernelOps().hc_update_mix(*update, *mix)):
        assert_matches(out, ref, UPDATE_TOL[dtype])


def test_fn_pieces_are_fn_in_three_bf16_parts():
    """hi is fn rounded to bf16, and hi + mid + lo is fn exactly; the padded rows are zeros."""
    fn = torch.randn(24, 1100, generator=torch.Generator().manual_seed(8)) * 0.1
    hi, mid, lo = fn_pieces(fn, 32).float()
    assert torch.equal(hi[:24], fn.to(torch.bfloat16).float())
    assert torch.equal(hi[:24] + mid[:24] + lo[:24], fn)
    assert not (hi[24:].any() or mid[24:].any() or lo[24:].any())


def test_prefill_update_mix_takes_fn_pieces_with_the_same_bits(monkeypatch):
    """bf16 streams at prefill sizes (70 rows) load fn's pieces split before the launch: through the interpreter,
    the same results as the launch that splits fn in its K loop (made to here), with the same tiles."""
    update, mix = _update_mix_args(9, 70, 4, 96, torch.bfloat16)
    assert hyper_connection.takes_fn_pieces(70, torch.bfloat16, False)
    with_pieces = hc_update_mix(*update, *mix)
    monkeypatch.setattr(hyper_connection, "fn_pieces", lambda fn, fnp: pytest.fail("pieces split"))
    monkeypatch.setattr(hyper_connection, "takes_fn_pieces", lambda *_: False)
    for out, ref in zip(with_pieces, hc_update_mix(*update, *mix)):
        assert torch.equal(out, ref)


def test_hc_update_mix_rows_are_batch_invariant():
    """With batch_invariant, a row's four results are the same bits alone as in a batch of 70 (prefill-sized:
    other tiles without it)."""
    update, mix = _update_mix_args(5, 70, 4, 96, torch.bfloat16)
    batch = hc_update_mix(*update, *mix, batch_invariant=True)
    for row in (0, 69):
        alone = hc_update_mix(*(x[row:row + 1] for x in update), *mix, batch_invariant=True)
        for out, in_batch in zip(alone, batch):
            assert torch.equal(out, in_batch[row:row + 1])


def test_hc_update_mix_of_no_rows():
    update, mix = _update_mix_args(6, 0, 4, 40, torch.bfloat16)
    shapes = [tuple(out.shape) for out in hc_update_mix(*update, *mix)]
    assert shapes == [(0, 4, 40), (0, 4), (0, 4), (0, 4, 4)]
