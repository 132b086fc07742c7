"""The backend conformance suite: every op of a backend against the reference `KernelOps`.

Each `OpCase` of `op_cases.OP_CASES` is run, for each of its dtypes, on fresh random inputs through
the backend's ops and through the reference, both on the backend's device. Every output tensor and
every tensor argument (ops may mutate arguments, e.g. cache writes) must match within the case's
tolerance for that dtype; integer and boolean tensors, and float tensors of a dtype the case gives
no tolerance for (e.g. inputs an op only reads), must match exactly. An op of `KernelOps`
without a case is a failure: a backend cannot be proven on an op nobody tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.platform.interfaces import Backend
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.platform.op_cases import OP_CASES, OpCase

__all__ = ["CaseResult", "ConformanceReport", "kernel_op_names", "run_conformance"]


@dataclass(frozen=True, slots=True)
class CaseResult:
    op: str
    case: str
    dtype: torch.dtype
    passed: bool
    detail: str


@dataclass(frozen=True, slots=True)
class ConformanceReport:
    backend: str
    device: str
    seed: int
    results: tuple[CaseResult, ...]
    ops_without_case: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.ops_without_case and all(result.passed for result in self.results)

    def summary(self) -> str:
        lines = [f"conformance of backend {self.backend!r} on {self.device} (seed {self.seed})"]
        for r in self.results:
            status = "PASS" if r.passed else "FAIL"
            lines.append(f"  {status} {r.op}[{r.case}, {str(r.dtype).removeprefix('torch.')}] {r.detail}")
        lines.extend(f"  FAIL {op}: no OpCase in op_cases.py" for op in self.ops_without_case)
        passed = sum(r.passed for r in self.results)
        failed = len(self.results) - passed + len(self.ops_without_case)
        lines.append(f"{passed} cases passed, {failed} failed")
        return "\n".join(lines)


# Public methods that answer a question about the backend's own ops rather than compute: no reference output.
_QUERIES = frozenset({"quantized_input_group"})


def kernel_op_names() -> list[str]:
    """The public ops of the `KernelOps` contract."""
    return sorted(
        name for name, value in vars(KernelOps).items()
        if not name.startswith("_") and callable(value) and name not in _QUERIES
    )


def run_conformance(
    backend: Backend, cases: Iterable[OpCase] = OP_CASES, seed: int | None = None
) -> ConformanceReport:
    """Run every case on `backend` (whose `check()` must have passed); never raises for a failing op.

    `seed` defaults to a fresh one per run; the report carries it so a failure can be replayed.
    """
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    cases = list(cases)
    ops, reference, device = backend.ops(), KernelOps(), backend.device
    results = []
    for case_index, case in enumerate(cases):
        for dtype_index, dtype in enumerate(case.dtypes):
            generator = torch.Generator().manual_seed(seed + 1000 * case_index + dtype_index)
            results.append(_run_case(case, dtype, generator, ops, reference, device))
    covered = {case.op for case in cases}
    missing = tuple(op for op in kernel_op_names() if op not in covered)
    return ConformanceReport(backend.name, str(device), seed, tuple(results), missing)


def _run_case(
    case: OpCase,
    dtype: torch.dtype,
    generator: torch.Generator,
    ops: KernelOps,
    reference: KernelOps,
    device: torch.device,
) -> CaseResult:
    args, kwargs = case.make_inputs(generator, dtype)
    ref_args, ref_kwargs = _case_inputs(args, kwargs, device, case.host_args)
    got_args, got_kwargs = _case_inputs(args, kwargs, device, case.host_args)
    try:
        with _modes(reference, case.modes):
            expected = getattr(reference, case.op)(*ref_args, **ref_kwargs)
    except Exception as exc:
        return CaseResult(case.op, case.name, dtype, False, f"the reference raised {exc!r}: fix the OpCase")
    try:
        with _modes(ops, case.modes):
            got = getattr(ops, case.op)(*got_args, **got_kwargs)
    except Exception as exc:
        return CaseResult(case.op, case.name, dtype, False, f"raised {exc!r}")
    if case.compared_as is not None:
        expected, got = case.compared_as(expected), case.compared_as(got)
    try:
        rtol, atol = case.rtol.get(dtype), case.atol.get(dtype)
        worst = max(
            _compare(expected, got, rtol, atol, "result"),
            _compare(*(_kept(a, case.given_up) for a in (ref_args, got_args)), rtol, atol, "args"),
            _compare(ref_kwargs, got_kwargs, rtol, atol, "kwargs"),
        )
    except AssertionError as exc:
        return CaseResult(case.op, case.name, dtype, False, " ".join(str(exc).split()))
    return CaseResult(case.op, case.name, dtype, True, f"max abs err {worst:.3g}")


def _kept(args: tuple[Any, ...], given_up: tuple[int, ...]) -> tuple[Any, ...]:
    """The args an op must leave as they were: all but those the case lets it overwrite."""
    return tuple(None if i in given_up else arg for i, arg in enumerate(args))


@contextlib.contextmanager
def _modes(ops: KernelOps, modes: dict[str, bool]) -> Iterator[None]:
    """The case's `KernelOps` flags set on `ops` for the call, then restored."""
    saved = {name: getattr(ops, name) for name in modes}
    for name, value in modes.items():
        setattr(ops, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ops, name, value)


def _case_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device, host_args: tuple[int, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A fresh copy of a case's inputs on `device`, except the positional args listed in `host_args`,
    which stay in host memory."""
    moved = tuple(arg.clone() if i in host_args else _to_device(arg, device) for i, arg in enumerate(args))
    return moved, _to_device(kwargs, device)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        base = value._base
        if base is not None and base.is_contiguous() and not value.is_contiguous():  # a view: ops read its strides
            moved = base.to(device, copy=True)
            return moved.as_strided(value.shape, value.stride(), value.storage_offset() - base.storage_offset())
        return value.to(device, copy=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # e.g. a ForwardBatch: its device tensors move, its host lists stay.
        return dataclasses.replace(
            value, **{f.name: _to_device(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        )
    return value


def _leaves(value: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(value, (tuple, list)):
        return [leaf for i, item in enumerate(value) for leaf in _leaves(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [leaf for key in sorted(value) for leaf in _leaves(value[key], f"{path}[{key!r}]")]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [  # compare=False fields are memos (ForwardBatch's row map), not values an op may change
            leaf for f in dataclasses.fields(value) if f.compare
            for leaf in _leaves(getattr(value, f.name), f"{path}.{f.name}")
        ]
    return [(path, value)]


def _compare(expected: Any, got: Any, rtol: float | None, atol: float | None, path: str) -> float:
    """Assert `got` matches `expected` leaf by leaf; return the largest absolute float error."""
    expected_leaves, got_leaves = _leaves(expected, path), _leaves(got, path)
    if [p for p, _ in expected_leaves] != [p for p, _ in got_leaves]:
        raise AssertionError(
            f"output structure differs: expected {[p for p, _ in expected_leaves]}, "
            f"got {[p for p, _ in got_leaves]}"
        )
    worst = 0.0
    for (path, want), (_, have) in zip(expected_leaves, got_leaves):
        if not isinstance(want, torch.Tensor):
            if want != have:
                raise AssertionError(f"{path}: expected {want!r}, got {have!r}")
            continue
        if not isinstance(have, torch.Tensor) or have.shape != want.shape or have.dtype != want.dtype:
            found = f"{tuple(have.shape)} {have.dtype}" if isinstance(have, torch.Tensor) else repr(have)
            raise AssertionError(f"{path}: expected a {tuple(want.shape)} {want.dtype} tensor, got {found}")
        if want.is_floating_point() and want.element_size() == 1:
            have, want = have.view(torch.uint8), want.view(torch.uint8)  # fp8 / e8m0: exact bytes
        if want.is_floating_point():
            bad = ~torch.isclose(have, want, rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True)
        else:
            bad = have != want
        if bad.any():
            raise AssertionError(_mismatch(path, have, want, bad, rtol or 0.0, atol or 0.0))
        if want.is_floating_point() and want.numel():
            worst = max(worst, (have.float() - want.float()).abs().nan_to_num().max().item())
    return worst


def _mismatch(
    path: str, have: torch.Tensor, want: torch.Tensor, bad: torch.Tensor, rtol: float, atol: float
) -> str:
    diff = torch.where(bad, (have.double() - want.double()).abs().nan_to_num(nan=float("inf")), 0.0)
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    tolerance = f"rtol={rtol:g}, atol={atol:g}" if want.is_floating_point() else "exact"
    return (
        f"{path}: not close ({tolerance}): {int(bad.sum())} of {bad.numel()} elements differ; "
        f"worst at {index}: expected {want[index].item()!r}, got {have[index].item()!r}"
    )
