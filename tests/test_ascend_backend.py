"""The ascend backend's op overrides, driven through a STAND-IN torch_npu on CPU tensors.

NOTE: the fake operators below are plain torch written from the torch_npu documentation (each
cites its page in deepinfer_ascend/ops.py). They check argument plumbing, layouts and shapes:
which operator is called, with which arguments, and that AscendOps turns its answer back into the
op's contract. They are NOT numerical proof of the real operators: nothing here ran on an NPU.
`scripts/check_ascend.py` is that proof, on hardware.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from deepinfer_core.platform.conformance import run_conformance
from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights
from deepinfer_core.platform.op_cases import OP_CASES


class FakeTorchNpu(types.ModuleType):
    """The three operators AscendOps uses, as their pages describe them, recording every call."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.__version__ = "2.13.0"
        self.calls: list[tuple[str, dict]] = []

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        assert 2 <= x.dim() <= 8 and gamma.dtype == x.dtype, "gamma must have self's dtype"
        self.calls.append(("npu_rms_norm", {"x": x, "gamma": gamma, "epsilon": epsilon}))
        x32 = x.float()
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + epsilon)
        return (x32 * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rotary_mul(self, x, r1, r2, rotary_mode="half"):
        assert x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "4-D input, r1 and r2"
        assert rotary_mode in ("half", "interleave")
        b, s, n, d = x.shape
        assert r1.shape == r2.shape == (1, s, 1, d), "BSND input takes 1S1D cos/sin"
        assert d % 2 == 0 and d < 896 and b * n < 1000
        self.calls.append(("npu_rotary_mul", {"x": x, "r1": r1, "r2": r2, "rotary_mode": rotary_mode}))
        if rotary_mode == "interleave":
            x_new = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            x_new = torch.cat((-x2, x1), dim=-1)
        return (r1.float() * x.float() + r2.float() * x_new.float()).to(x.dtype)

    def npu_grouped_matmul(self, x, weight, *, group_list=None, split_item=0, group_type=-1, group_list_type=0,
                           **unused):
        assert not unused, f"unexpected arguments {sorted(unused)}"
        assert len(x) == 1 and len(weight) == 1 and x[0].dim() == 2 and weight[0].dim() == 3
        assert group_list.dtype == torch.int64 and group_list.dim() == 1 and len(group_list) == weight[0].shape[0]
        self.calls.append(("npu_grouped_matmul", {
            "x": x[0], "weight": weight[0], "group_list": group_list, "split_item": split_item,
            "group_type": group_type, "group_list_type": group_list_type,
        }))
        assert (split_item, group_type, group_list_type) == (3, 0, 0), "single x/y split along M by cumsum"
        rows, w = x[0], weight[0]
        # Rows past the last group are not computed: NaN makes a caller that reads them fail.
        out = torch.full((rows.shape[0], w.shape[-1]), float("nan"), dtype=rows.dtype)
        start = 0
        for e, end in enumerate(group_list.tolist()):
            out[start:end] = rows[start:end] @ w[e]
            start = end
        return [out]


@pytest.fixture
def fake_npu(monkeypatch) -> FakeTorchNpu:
    module = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.fixture
def ops(fake_npu):
    from deepinfer_ascend.ops import AscendOps

    return AscendOps(fake_npu)


def _called(fake: FakeTorchNpu, name: str) -> list[dict]:
    return [args for op, args in fake.calls if op == name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_keeps_the_float32_weight_unrounded(ops, fake_npu, dtype, weighted):
    x = torch.randn(5, 3, 48).to(dtype)
    weight = torch.randn(48) if weighted else None
    got = ops.rms_norm(x, weight, 1e-6)
    (call,) = _called(fake_npu, "npu_rms_norm")
    # A float32 weight runs the operator on float32 x; an unweighted norm uses ones in x's dtype.
    assert call["x"].dtype == (torch.float32 if weighted else dtype) and call["gamma"].dtype == call["x"].dtype
    assert call["epsilon"] == 1e-6
    assert got.dtype == dtype
    # Exact: the stand-in computes what the reference computes, so any difference is plumbing.
    torch.testing.assert_close(got, KernelOps().rms_norm(x, weight, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(7, 4, 24), (7, 24), (7, 2, 3, 24)], ids=["heads", "no-heads", "two-axes"])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_calls_rotary_mul_in_bsnd_interleave_on_the_trailing_channels(ops, fake_npu, shape, inverse):
    x = torch.randn(*shape)
    positions = torch.randint(0, 4000, (shape[0],))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, dtype=torch.float32) / 8))
    got = ops.rope(x, positions, inv_freq, inverse)
    (call,) = _called(fake_npu, "npu_rotary_mul")
    heads = x[0].numel() // shape[-1]
    assert call["rotary_mode"] == "interleave"
    assert call["x"].shape == (1, shape[0], heads, 16) and call["x"].is_contiguous()
    torch.testing.assert_close(got[..., :-16], x[..., :-16], rtol=0, atol=0)  # untouched channels
    torch.testing.assert_close(got, KernelOps().rope(x, positions, inv_freq, inverse), rtol=1e-6, atol=1e-6)


def test_rope_outside_the_documented_limits_is_the_reference(ops, fake_npu):
    x = torch.randn(3, 1000, 8)  # B * N = 1000 heads: the operator documents B * N < 1000
    positions, inv_freq = torch.arange(3), torch.rand(4)
    torch.testing.assert_close(ops.rope(x, positions, inv_freq), KernelOps().rope(x, positions, inv_freq))
    assert not fake_npu.calls


def _mlp(hidden: int, inter: int, dtype: torch.dtype) -> MlpWeights:
    return MlpWeights(*(torch.randn(*shape).to(dtype) * 0.2 for shape in ((inter, hidden), (inter, hidden), (hidden, inter))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_groups_rows_by_expert_and_drops_experts_not_held(ops, fake_npu, dtype):
    tokens, top_k, hidden, inter, n_experts = 9, 3, 32, 16, 7
    x = torch.randn(tokens, hidden).to(dtype)
    ids = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k) + 0.1
    experts = [_mlp(hidden, inter, dtype) if e not in (2, 5) else None for e in range(n_experts)]  # EP: 2, 5 elsewhere
    shared = _mlp(hidden, inter, dtype)
    got = ops.fused_moe(x, weights, ids, experts, shared, 1.5)

    first, second = _called(fake_npu, "npu_grouped_matmul")
    held = [e for e in range(n_experts) if experts[e] is not None]
    counts = torch.tensor([(ids == e).sum().item() for e in held])
    assert torch.equal(first["group_list"], counts.cumsum(0))
    assert first["weight"].shape == (len(held), hidden, 2 * inter)  # K-major, w1 then w3
    assert torch.equal(first["weight"][1], torch.cat([experts[held[1]].w1, experts[held[1]].w3]).t())
    assert second["weight"].shape == (len(held), inter, hidden)
    assert first["x"].shape == (tokens * top_k, hidden)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]  # the op's documented tolerance
    torch.testing.assert_close(got, KernelOps().fused_moe(x, weights, ids, experts, shared, 1.5), rtol=tol, atol=tol)


def test_fused_moe_reuses_the_expert_stack_across_calls(ops, fake_npu):
    x, ids, weights = torch.randn(4, 16), torch.tensor([[0, 1]] * 4), torch.rand(4, 2)
    experts, shared = [_mlp(16, 8, torch.float32) for _ in range(2)], _mlp(16, 8, torch.float32)
    ops.fused_moe(x, weights, ids, experts, shared, 2.0)
    ops.fused_moe(x, weights, ids, experts, shared, 2.0)
    stacks = [call["weight"] for call in _called(fake_npu, "npu_grouped_matmul")]
    assert stacks[0].data_ptr() == stacks[2].data_ptr() and stacks[1].data_ptr() == stacks[3].data_ptr()


def test_fused_moe_with_fp8_experts_is_the_reference_dequantisation(ops, fake_npu):
    from deepinfer_core.quantization import quantize_fp8_block

    def fp8_mlp():
        parts = [quantize_fp8_block(torch.randn(*s) * 0.2, (16, 32)) for s in ((32, 64), (32, 64), (64, 32))]
        return MlpWeights(*(p[0] for p in parts), *(p[1] for p in parts), (16, 32))

    x, ids, weights = torch.randn(5, 64), torch.tensor([[0, 1]] * 5), torch.rand(5, 2)
    experts, shared = [fp8_mlp(), fp8_mlp()], fp8_mlp()
    torch.testing.assert_close(
        ops.fused_moe(x, weights, ids, experts, shared, 1.0),
        KernelOps().fused_moe(x, weights, ids, experts, shared, 1.0),
    )
    assert not _called(fake_npu, "npu_grouped_matmul")


def test_conformance_passes_with_the_stand_in_operators(fake_npu):
    from deepinfer_ascend.backend import AscendBackend

    class AscendOnHost(AscendBackend):
        device_type = "cpu"  # the stand-in operators take CPU tensors

    report = run_conformance(AscendOnHost(), OP_CASES, seed=1234)
    assert report.passed, report.summary()
    assert {op for op, _ in fake_npu.calls} == {"npu_rms_norm", "npu_rotary_mul", "npu_grouped_matmul"}


def test_backend_hands_out_ascend_ops_and_claims_nothing_unproven(fake_npu):
    from deepinfer_ascend.backend import AscendBackend
    from deepinfer_ascend.ops import AscendOps

    backend = AscendBackend()
    assert isinstance(backend.ops(), AscendOps)
    caps = backend.capabilities()
    assert (caps.batch_invariant, caps.deterministic_sampling, caps.fp8, caps.fp4) == (False, False, False, False)
    assert caps.graphs is True  # torch_npu documents NPUGraph capture and replay


def test_ops_without_torch_npu_name_what_to_install(monkeypatch):
    from deepinfer_ascend.backend import AscendBackend
    from deepinfer_core.platform import BackendUnavailable

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(BackendUnavailable, match=r"torch_npu is not importable.*CANN 9\.2.*deepinfer\[ascend\]"):
        AscendBackend().ops()


# --- build.sh's ascend checks (each stops before anything is built or installed) ------------------

BUILD_SH = Path(__file__).resolve().parent.parent / "build.sh"


def _toolkit(tmp_path: Path, version: str) -> Path:
    info = tmp_path / "ascend-toolkit" / "latest" / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\n")
    return info.parent.parent


def _build_ascend(tmp_path: Path, toolkit: Path | None, torch_npu_version: str | None = None, npus: int | None = None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if npus is not None:
        smi = bin_dir / "npu-smi"
        smi.write_text("#!/bin/sh\n" + "".join(f"echo 'NPU ID : {i}'\n" for i in range(npus)))
        smi.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": sys.executable, "DEEPINFER_ACCELERATOR": "ascend",
        "HOME": str(tmp_path),
    }
    if toolkit is not None:
        env["ASCEND_TOOLKIT_HOME"] = str(toolkit)
    if torch_npu_version is not None:
        package = tmp_path / "site" / "torch_npu"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"__version__ = {torch_npu_version!r}\n")
        env["PYTHONPATH"] = str(package.parent)
    return subprocess.run(["bash", str(BUILD_SH)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda tmp: {"toolkit": None}, r"CANN environment is not set \(ASCEND_TOOLKIT_HOME\).*set_env\.sh"),
        (lambda tmp: {"toolkit": _toolkit(tmp, "8.3.RC1")}, r"CANN 8\.3\.RC1 found under .* needs CANN 9\.2"),
        (lambda tmp: {"toolkit": _toolkit(tmp, "9.2.0"), "torch_npu_version": "2.9.0.post1", "npus": 1},
         r"torch_npu 2\.9\.0\.post1 does not match torch 2\.\d+.*torch==2\.9\.0 torch-npu==2\.9\.0\.post1"),
        (lambda tmp: {"toolkit": _toolkit(tmp, "9.2.0")}, r"npu-smi not found: install the Ascend NPU driver"),
        (lambda tmp: {"toolkit": _toolkit(tmp, "9.2.0"), "npus": 0}, r"npu-smi lists no NPU"),
    ],
    ids=["no-cann-env", "old-cann", "torch-npu-mismatch", "no-driver", "no-npu"],
)
def test_build_sh_names_what_the_ascend_machine_lacks(tmp_path, setup, message):
    done = _build_ascend(tmp_path, **setup(tmp_path))
    assert done.returncode != 0
    assert re.search(message, done.stderr), done.stderr
    assert "building wheels" not in done.stdout


# --- NPU memory manager: graph capture protocol, on a stand-in torch.npu ---------------------------

class _FakeStream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits {other.name}")


class _FakeNpuRuntime(types.SimpleNamespace):
    """torch_npu.npu's stream and graph API, recording the order of calls."""

    def __init__(self) -> None:
        log: list[str] = []
        current = _FakeStream(log, "current")
        active = [current]

        class Graph:
            def replay(self) -> None:
                log.append("replay")

        class UseStream:
            def __init__(self, stream) -> None:
                self.stream = stream

            def __enter__(self):
                active.append(self.stream)
                log.append(f"enter {self.stream.name}")
                return self.stream

            def __exit__(self, *exc) -> None:
                active.pop()

        class Capture:
            def __init__(self, graph) -> None:
                assert isinstance(graph, Graph)

            def __enter__(self) -> None:
                log.append("capture begins")

            def __exit__(self, *exc) -> None:
                log.append("capture ends")

        super().__init__(
            log=log, current_stream=lambda device=None: active[-1], Stream=lambda device=None: _FakeStream(log, "side"),
            stream=UseStream, NPUGraph=Graph, graph=Capture,
        )


def test_npu_graph_capture_warms_up_on_a_side_stream_then_captures_once(monkeypatch):
    module = types.ModuleType("torch_npu")
    module.npu = _FakeNpuRuntime()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    from deepinfer_ascend.npu_memory import NpuMemoryManager

    memory = NpuMemoryManager(torch.device("cpu"))
    calls = []
    graph = memory.capture_graph(lambda: calls.append(len(calls)) or len(calls), warmup_iters=2)
    assert calls == [0, 1, 2] and graph.output == 3  # two warm-ups, then the captured call
    assert module.npu.log == [
        "side waits current", "enter side", "current waits side", "capture begins", "capture ends",
    ]
    graph.replay()
    assert module.npu.log[-1] == "replay"


def test_build_sh_accepts_the_torch_npu_of_the_installed_torch(tmp_path):
    matching = torch.__version__.split("+")[0] + "rc1"
    done = _build_ascend(tmp_path, _toolkit(tmp_path, "9.2.0"), torch_npu_version=matching, npus=0)
    assert f"torch_npu {matching} (torch {torch.__version__.split('+')[0]})" in done.stdout, done.stderr
    assert "CANN 9.2.0" in done.stdout
    assert "npu-smi lists no NPU" in done.stderr  # the next check still runs, and stops before building
