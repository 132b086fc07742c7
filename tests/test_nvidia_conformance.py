"""The nvidia backend's ops (`TritonOps`, kernels through the Triton interpreter) pass every conformance
case on the CPU, as `deepinfer check-backend nvidia` checks them on a GPU. `gather_rows` is left to the
GPU: its zero-copy read maps the host table into the device's address space, which needs CUDA."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

from deepinfer_core.platform.conformance import run_conformance
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.platform.op_cases import OP_CASES
from deepinfer_core.reference.backend import CpuBackend
from deepinfer_nvidia.ops import TritonOps


class TritonOnHost(CpuBackend):
    """The cpu backend's device with the Triton ops."""

    def ops(self) -> KernelOps:
        return TritonOps()


def test_triton_ops_pass_every_conformance_case():
    cases = [case for case in OP_CASES if case.op != "gather_rows"]
    report = run_conformance(TritonOnHost(), cases, seed=7)
    failed = [result for result in report.results if not result.passed]
    assert len(report.results) >= len(cases) and not failed, failed
