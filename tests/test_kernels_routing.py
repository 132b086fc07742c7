"""Triton MoE routing (through `TritonOps.route` / `route_fp32`) against the reference ops, through the interpreter."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_nvidia.ops import TritonOps

# Both sides score the same logits: the reference routes the kernel's product (`TritonOps.router_logits`,
# tested below against the reference's) through an identity gate, which reproduces it exactly. They differ
# only by the kernel's softplus (exp + a log1p series) and its summation order over k: a few float32 ulps.
WEIGHT_TOL = 1e-5


def _router(dtype: torch.dtype, tokens: int, experts: int, seed: int, spread: float = 1.0):
    """x [T, 64] and gate [E, 64]; `spread` scales the logits (4: well past softplus's threshold of 20)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, 64, generator=gen) * spread).to(dtype)
    gate = (torch.randn(experts, 64, generator=gen) * 0.3).to(dtype)
    return x, gate, torch.randn(experts, generator=gen) * 0.1, gen


def _assert_same_routing(got, expected, keys=None):
    """ids exact; with `keys` (the selection values [T, E]) two experts whose keys tie exactly (bf16
    logits often do) may swap: then the keys picked, slot by slot, must be equal."""
    (weights, ids), (ref_weights, ref_ids) = got, expected
    assert ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    if keys is None:
        assert torch.equal(ids, ref_ids)
    else:
        assert torch.equal(keys.gather(1, ids), keys.gather(1, ref_ids))
        assert (ids.sort(1).values.diff(dim=1) != 0).all(), "an expert picked twice"
    assert_matches(weights, ref_weights, WEIGHT_TOL)


def _reference_route(x, gate, *args, **kwargs):
    """The reference routing of the logits the kernel path computed: those logits meet an identity gate."""
    logits = TritonOps().router_logits(x, gate)
    return KernelOps().route(logits, torch.eye(gate.shape[0], dtype=logits.dtype), *args, **kwargs)


def _keys(x, gate, scoring_func, bias):
    logits = TritonOps().router_logits(x, gate).float()
    scores = {"sqrtsoftplus": lambda: torch.nn.functional.softplus(logits).sqrt(), "sigmoid": logits.sigmoid,
              "softmax": lambda: logits.softmax(-1)}[scoring_func]()
    return scores if bias is None else scores + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_score_routing_matches_reference(dtype, scoring_func, with_bias):
    x, gate, bias, _ = _router(dtype, tokens=9, experts=48, seed=1)
    bias = bias if with_bias else None
    args = (x, gate, 6, 2.5, scoring_func, bias)
    keys = _keys(x, gate, scoring_func, bias) if dtype == torch.bfloat16 else None
    _assert_same_routing(TritonOps().route(*args), _reference_route(*args), keys)


def test_sqrtsoftplus_matches_across_the_threshold():
    """Logits spread over about +-40 (picked experts on softplus's linear branch above 20): no overflow,
    same picks and weights."""
    x, gate, bias, _ = _router(torch.float32, tokens=7, experts=64, seed=2, spread=4.0)
    logits = torch.nn.functional.linear(x, gate)
    assert logits.max() > 20 and logits.min() < -20
    _assert_same_routing(TritonOps().route(x, gate, 8, 1.0, bias=bias), _reference_route(x, gate, 8, 1.0, bias=bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hash_routing_matches_reference(dtype):
    x, gate, _, gen = _router(dtype, tokens=11, experts=24, seed=3)
    table = torch.stack([torch.randperm(24, generator=gen)[:4] for _ in range(50)])
    input_ids = torch.randint(0, 50, (11,), generator=gen)
    kwargs = {"tid2eid": table, "input_ids": input_ids}
    _assert_same_routing(TritonOps().route(x, gate, 4, 1.5, **kwargs), _reference_route(x, gate, 4, 1.5, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 4])
def test_route_fp32_matches_reference(dtype, top_k):
    """gate_temp divides the logits; top_k 1 keeps the raw score (no normalisation)."""
    x, gate, bias, _ = _router(dtype, tokens=10, experts=40, seed=4 + top_k, spread=2.0)
    args = (x, gate, bias, top_k, 1.5, 1.7)
    _assert_same_routing(TritonOps().route_fp32(*args), KernelOps().route_fp32(*args))


@pytest.mark.parametrize("tokens", [1, 16, 17])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_router_logits_match_reference(tokens, x_dtype):
    """The router product: the Triton linear up to ROUTER_TRITON_ROWS rows, cuBLAS's past them; a float32 x
    (`route_fp32`) meets the bf16 gate widened."""
    x, gate, _, _ = _router(torch.bfloat16, tokens=tokens, experts=48, seed=tokens)
    x = x.to(x_dtype)
    expected = torch.nn.functional.linear(x, gate.to(x_dtype))
    assert_matches(TritonOps().router_logits(x, gate), expected, 1e-2 if x_dtype == torch.bfloat16 else 1e-6)


def test_route_is_batch_invariant():
    """A token routes to the same bits alone or inside a larger batch in batch-invariant mode."""
    x, gate, bias, _ = _router(torch.bfloat16, tokens=21, experts=32, seed=6)
    ops = TritonOps()
    ops.batch_invariant = True
    weights, ids = ops.route(x, gate, 4, 1.5, bias=bias)
    alone_weights, alone_ids = ops.route(x[5:8], gate, 4, 1.5, bias=bias)
    assert torch.equal(alone_ids, ids[5:8]) and torch.equal(alone_weights, weights[5:8])
    _assert_same_routing((weights, ids), KernelOps().route(x, gate, 4, 1.5, bias=bias))


def test_score_routing_orders_ties_and_negative_keys_by_expert():
    """The kernel's packed key (order-preserving bits above the lane) picks the best key first and the
    lowest expert among exact ties, also for negative keys: a stable descending sort of the keys."""
    from deepinfer_kernels.routing import route_logits

    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 4, (5, 40), generator=gen).float() / 4  # many exact ties
    bias = -torch.randint(0, 3, (40,), generator=gen).float()  # keys below zero too
    weights, ids = route_logits(logits, 6, 1.0, "sigmoid", bias=bias)
    keys = logits.sigmoid() + bias
    expected = keys.sort(dim=1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(ids, expected)
    picked = logits.sigmoid().gather(1, expected)
    assert torch.allclose(weights, picked / (picked.sum(1, keepdim=True) + 1e-20), rtol=1e-6)
