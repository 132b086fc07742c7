"""The three first-party backends: cpu runs here; nvidia and ascend explain why they cannot.

The nvidia and ascend device checks are also driven through faked vendor modules, so every
branch of their decisions (CUDA version, driver, GPU count, compute capability; torch_npu, CANN
version, NPU count) is exercised on a machine that has neither device.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deepinfer_core.platform import BackendUnavailable
from deepinfer_core.platform.errors import GraphCaptureUnsupported
from deepinfer_core.platform.interfaces import Event, Stream
from deepinfer_core.platform.registry import BackendRegistry
from deepinfer_core.reference.backend import CpuBackend


@pytest.fixture(scope="module")
def registry() -> BackendRegistry:
    return BackendRegistry.from_entry_points()


def test_first_party_backends_are_installed_with_their_priorities(registry):
    records = registry.records()
    assert {name: records[name].priority for name in ("cpu", "nvidia", "ascend")} == {
        "cpu": 0, "nvidia": 100, "ascend": 90,
    }


def test_cpu_backend_contract():
    backend = CpuBackend()
    backend.check()
    assert backend.device == torch.device("cpu")
    assert backend.distributed_backend == "gloo"
    caps = backend.capabilities()
    assert caps.graphs is False and caps.fp8 is False and caps.fp4 is False


def test_host_memory_manager():
    memory = CpuBackend().memory()
    pool = memory.allocate((3, 5, 7), torch.bfloat16)
    assert pool.shape == (3, 5, 7) and pool.dtype == torch.bfloat16 and pool.device.type == "cpu"
    info = memory.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    staging = memory.pinned_buffer((4, 2), torch.int64)
    assert staging.shape == (4, 2) and staging.dtype == torch.int64

    stream = memory.new_stream()
    assert isinstance(stream, Stream) and isinstance(memory.current_stream(), Stream)
    event = memory.new_event(enable_timing=True)
    assert isinstance(event, Event)
    with memory.use_stream(stream) as active:
        assert active is stream
        assert stream.record_event(event) is event
    stream.wait_event(event)
    memory.current_stream().wait_stream(stream)
    assert event.query() and stream.query()
    memory.synchronize()
    end = memory.new_event(enable_timing=True)
    end.record(stream)
    assert event.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        memory.new_event().elapsed_time(end)

    assert memory.supports_graphs is False
    with pytest.raises(GraphCaptureUnsupported, match="no graph capture"):
        memory.capture_graph(lambda: pool.sum())


def test_nvidia_reports_why_it_cannot_run_here(registry):
    if torch.cuda.is_available():
        backend = registry.create("nvidia")
        backend.check()
        assert "compute capability" in backend.describe()
        return
    backend = registry.create("nvidia")
    assert backend.device_type == "cuda" and backend.distributed_backend == "nccl"
    with pytest.raises(BackendUnavailable, match="CUDA|cuda-python|GPU"):
        backend.check()


def test_ascend_reports_missing_torch_npu_and_cann(registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    backend = registry.create("ascend")
    assert backend.device_type == "npu" and backend.distributed_backend == "hccl"
    with pytest.raises(BackendUnavailable, match=r"torch_npu.*CANN 9\.2.*deepinfer\[ascend\]"):
        backend.check()


# --- nvidia's check, one decision at a time -----------------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA 13 torch with one sm_100 GPU and cuda-python reporting a CUDA 13.0 driver."""
    from deepinfer_nvidia import device_check

    runtime = types.SimpleNamespace(
        cudaError_t=types.SimpleNamespace(cudaSuccess=0),
        cudaDriverGetVersion=lambda: (0, 13000),
    )
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
    monkeypatch.setattr(device_check.importlib.metadata, "version", lambda name: "13.4.4")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties",
        lambda index: types.SimpleNamespace(name="NVIDIA B200", total_memory=180 * 2**30),
    )
    return runtime


def _raise_cuda_error(index: int):
    raise RuntimeError("CUDA error: unknown error")


def test_nvidia_accepts_sm100_as_the_tuned_target(fake_cuda):
    from deepinfer_nvidia.backend import NvidiaBackend

    backend = NvidiaBackend()
    backend.check()
    facts = backend.describe()
    assert facts["compute capability"] == "10.0 (sm_100: the tuned target)"
    assert "NVIDIA B200" in facts["device"] and "driver 13.0" in facts["CUDA"]


def test_nvidia_accepts_sm90_and_says_so(fake_cuda, monkeypatch):
    from deepinfer_nvidia.device_check import probe_cuda

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert probe_cuda(0).support == "sm_90: supported (Hopper); kernels are tuned for sm_100"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda mp, rt: mp.setattr(torch.version, "cuda", None), "built without CUDA"),
        (lambda mp, rt: mp.setattr(torch.version, "cuda", "12.8"), "needs a torch built for CUDA 13"),
        (lambda mp, rt: mp.setitem(sys.modules, "cuda.bindings", None), r"cuda-python.*deepinfer\[nvidia\]"),
        (lambda mp, rt: mp.setattr(rt, "cudaDriverGetVersion", lambda: (0, 12080)), "driver supports CUDA 12.8"),
        (lambda mp, rt: mp.setattr(rt, "cudaDriverGetVersion", lambda: (35, 0)), "no NVIDIA driver"),
        (lambda mp, rt: mp.setattr(torch.cuda, "device_count", lambda: 0), "no CUDA GPU is visible"),
        (lambda mp, rt: mp.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0)), "needs sm_90"),
        (lambda mp, rt: mp.setattr(torch.cuda, "get_device_capability", _raise_cuda_error), "cannot be initialised"),
    ],
    ids=["cpu-torch", "cuda12-torch", "no-cuda-python", "old-driver", "no-driver", "no-gpu", "ampere", "broken-gpu"],
)
def test_nvidia_check_names_what_is_missing(fake_cuda, monkeypatch, change, reason):
    from deepinfer_nvidia.device_check import probe_cuda

    change(monkeypatch, fake_cuda)
    with pytest.raises(BackendUnavailable, match=reason):
        probe_cuda(0)


def test_nvidia_check_rejects_a_gpu_index_beyond_the_visible_ones(fake_cuda):
    from deepinfer_nvidia.device_check import probe_cuda

    with pytest.raises(BackendUnavailable, match="GPU index 3 requested but only 1"):
        probe_cuda(3)


# --- ascend's check, one decision at a time ------------------------------------------------------

@pytest.fixture
def fake_torch_npu(monkeypatch):
    """torch_npu with CANN 9.2.0 and one NPU."""
    module = types.ModuleType("torch_npu")
    module.__version__ = "2.13.0"
    module.utils = types.SimpleNamespace(get_cann_version=lambda module="CANN": "9.2.0")
    module.npu = types.SimpleNamespace(device_count=lambda: 1, get_device_name=lambda index: "Ascend910_9392")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")
    return module


def test_ascend_accepts_cann_92_with_an_npu(fake_torch_npu):
    from deepinfer_ascend.backend import AscendBackend

    backend = AscendBackend()
    backend.check()
    assert backend.describe() == {"device": "npu:0 Ascend910_9392", "CANN": "9.2.0", "torch_npu": "2.13.0"}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda mp, npu: mp.delenv("ASCEND_TOOLKIT_HOME"), "ASCEND_TOOLKIT_HOME is unset"),
        (lambda mp, npu: mp.setattr(npu.utils, "get_cann_version", lambda module: "8.3.RC1"),
         r"CANN 8\.3\.RC1 found.*needs CANN 9\.2"),
        (lambda mp, npu: mp.setattr(npu.utils, "get_cann_version", lambda module: ""), "unknown version"),
        (lambda mp, npu: mp.setattr(npu.npu, "device_count", lambda: 0), "no NPU is visible"),
    ],
    ids=["no-cann-env", "old-cann", "unknown-cann", "no-npu"],
)
def test_ascend_check_names_what_is_missing(fake_torch_npu, monkeypatch, change, reason):
    from deepinfer_ascend.device_check import probe_npu

    change(monkeypatch, fake_torch_npu)
    with pytest.raises(BackendUnavailable, match=reason):
        probe_npu(0)
