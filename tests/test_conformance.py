"""The conformance suite: the reference passes, broken ops fail, every op has a case."""

from __future__ import annotations

import torch

from deepinfer_core.platform import KernelOps
from deepinfer_core.platform.conformance import kernel_op_names, run_conformance
from deepinfer_core.platform.op_cases import OP_CASES
from deepinfer_core.reference.backend import CpuBackend


class _OpsBackend(CpuBackend):
    """The cpu backend with a given KernelOps instance."""

    def __init__(self, ops: KernelOps) -> None:
        super().__init__()
        self._ops = ops

    def ops(self) -> KernelOps:
        return self._ops


class ScaledNorm(KernelOps):
    def rms_norm(self, x, *args, **kwargs):
        return super().rms_norm(x, *args, **kwargs) * 1.01


class RaisingLinear(KernelOps):
    def linear(self, *args, **kwargs):
        raise RuntimeError("kernel launch failed")


class MutatingNorm(KernelOps):
    def rms_norm(self, x, *args, **kwargs):
        out = super().rms_norm(x, *args, **kwargs)
        x.mul_(2)
        return out


class Float32Norm(KernelOps):
    def rms_norm(self, x, *args, **kwargs):
        return super().rms_norm(x.float(), *args, **kwargs)


def _failed_ops(report) -> set[str]:
    return {result.op for result in report.results if not result.passed}


def _cases(op: str):
    return [case for case in OP_CASES if case.op == op]


def test_every_kernel_op_has_a_case():
    missing = set(kernel_op_names()) - {case.op for case in OP_CASES}
    assert not missing, f"ops without an OpCase in op_cases.py: {sorted(missing)}"


def test_every_case_names_an_existing_op():
    unknown = {case.op for case in OP_CASES} - set(kernel_op_names())
    assert not unknown, f"OpCases for ops KernelOps does not have: {sorted(unknown)}"


def test_reference_backend_passes():
    report = run_conformance(CpuBackend())
    assert report.passed, report.summary()
    assert len(report.results) == sum(len(case.dtypes) for case in OP_CASES)


def test_wrong_values_fail_only_that_op():
    report = run_conformance(_OpsBackend(ScaledNorm()), cases=_cases("rms_norm") + _cases("linear"), seed=1)
    assert not report.passed
    assert _failed_ops(report) == {"rms_norm"}
    assert "not close" in next(r.detail for r in report.results if not r.passed)


def test_an_op_that_raises_is_a_failure_not_a_crash():
    report = run_conformance(_OpsBackend(RaisingLinear()), cases=_cases("linear") + _cases("rms_norm"), seed=2)
    assert _failed_ops(report) == {"linear"}
    assert all("kernel launch failed" in r.detail for r in report.results if not r.passed)


def test_mutating_an_input_the_reference_only_reads_fails():
    report = run_conformance(_OpsBackend(MutatingNorm()), cases=_cases("rms_norm"), seed=3)
    assert _failed_ops(report) == {"rms_norm"}


def test_wrong_output_dtype_fails():
    report = run_conformance(_OpsBackend(Float32Norm()), cases=_cases("rms_norm"), seed=4)
    failed = [r for r in report.results if not r.passed]
    assert {r.op for r in failed} == {"rms_norm"}
    assert all(r.dtype == torch.bfloat16 and "torch.float32" in r.detail for r in failed)


def test_an_op_without_a_case_fails_the_report():
    report = run_conformance(CpuBackend(), cases=_cases("rms_norm"), seed=5)
    assert "linear" in report.ops_without_case and "rms_norm" not in report.ops_without_case
    assert not report.passed
    assert "FAIL linear: no OpCase" in report.summary()


def test_seed_is_reported_and_replays_the_same_inputs():
    first = run_conformance(_OpsBackend(ScaledNorm()), cases=_cases("rms_norm"), seed=11)
    second = run_conformance(_OpsBackend(ScaledNorm()), cases=_cases("rms_norm"), seed=11)
    assert first.seed == 11
    assert [r.detail for r in first.results] == [r.detail for r in second.results]
    fresh = {run_conformance(CpuBackend(), cases=_cases("rms_norm")).seed for _ in range(3)}
    assert len(fresh) == 3
