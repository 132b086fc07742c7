"""Decode steps replayed through `DecodeGraphs` on the CPU: padding rows on the spare slot and block, the
static buffers, the context bounds and the engine's choice of which steps replay. The ops are the nvidia
backend's (Triton kernels through the interpreter): the reference ops plan on the host and rightly fail
a capture. The graph is a double that reruns the captured step at each replay and refreshes its output
in place, as a device graph does, and refuses, while it captures, what a device graph cannot replay: the
host lists (`NotOnHost`) and tensors built from host data. Real capture runs on the GPU
(`scripts/check_engine_gpu.py`, `scripts/bench_decode_v41.py`)."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine import decode_graphs
from deepinfer_core.models.forward_batch import NotOnHost
from deepinfer_core.reference.backend import CpuBackend
from deepinfer_core.reference.host_memory import HostMemoryManager


class RerunGraph:
    def __init__(self, fn) -> None:
        self.fn = fn
        with _no_tensors_from_host_data():  # the capture itself
            self.output = fn()

    def replay(self) -> None:
        self.output.copy_(self.fn())


@contextmanager
def _no_tensors_from_host_data():
    """`torch.tensor` raises: on a GPU, a tensor built from Python data inside a captured step is a copy from
    host memory, which a device graph cannot replay (the capture fails; the CPU double would not see it)."""
    made = torch.tensor

    def refused(*args, **kwargs):
        raise AssertionError("a captured decode step built a tensor from host data (torch.tensor): make it once, "
                             "before the capture, or on the device")

    torch.tensor = refused
    try:
        yield
    finally:
        torch.tensor = made


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> list[RerunGraph]:
    captured: list[RerunGraph] = []

    def capture_graph(self, fn, warmup_iters: int = 2):
        for _ in range(warmup_iters):
            fn()
        captured.append(RerunGraph(fn))
        return captured[-1]

    from deepinfer_nvidia.ops import TritonOps

    capabilities = CpuBackend.capabilities
    monkeypatch.setattr(CpuBackend, "ops", lambda self: TritonOps())
    monkeypatch.setattr(CpuBackend, "capabilities", lambda self: replace(capabilities(self), graphs=True))
    monkeypatch.setattr(HostMemoryManager, "supports_graphs", property(lambda self: True))
    monkeypatch.setattr(HostMemoryManager, "capture_graph", capture_graph)
    return captured


def _generate(checkpoint, enforce_eager: bool, prompts, params):
    llm = LLM(str(checkpoint), accelerator="cpu", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=4,
              max_num_batched_tokens=64, num_kv_blocks=32)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_replayed_decode_equals_eager(tiny_checkpoint, cpu_graphs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 1 to 4 sequences (padded to 1, 2, 4), contexts crossing a bound (lowered
    from 256 to keep the interpreter quick), greedy and seeded sampling, sequences finishing apart."""
    monkeypatch.setattr(decode_graphs, "MIN_SEQ_BOUND", 16)
    lengths = [5, 30, 9, 3, 12]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 97 + 1 for i in range(n)]} for n in lengths]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=(3, 4, 8, 2, 3)[i], ignore_eos=True)
              for i in range(len(prompts))]
    llm, replayed = _generate(tiny_checkpoint, False, prompts, params)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and len(cpu_graphs) == graphs.num_graphs
    sizes_and_bounds = set(graphs._captured)
    assert {size for size, _ in sizes_and_bounds} >= {1, 2, 4} and len({b for _, b in sizes_and_bounds}) >= 2
    eager_llm, eager = _generate(tiny_checkpoint, True, prompts, params)
    assert eager_llm.engine.runner.decode_graphs is None
    assert replayed == eager


def test_capture_refuses_ops_that_read_per_sequence_host_values() -> None:
    lens = NotOnHost(3, "context_lens_cpu")
    assert len(lens) == 3
    with pytest.raises(RuntimeError, match="context_lens_cpu.*enforce_eager=True"):
        max(lens)


def test_replayed_v41_decode_equals_eager(cpu_graphs, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V4.1 (the fixture with every band kind: ratios 4, 2 and 1, a candidate source, an engram
    layer; fp8 / fp4 KV): its plain decode steps read no host list (a capture would raise), and replayed
    they give the eager run's tokens, across group boundaries and a context bound."""
    from v41_fixtures import FIXTURES

    monkeypatch.setattr(decode_graphs, "MIN_SEQ_BOUND", 16)
    lengths = [14, 5]
    prompts = [{"prompt_token_ids": [(11 * i + 5 * n) % 197 + 3 for i in range(n)]} for n in lengths]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=(7, 4)[i], ignore_eos=True)
              for i in range(len(prompts))]
    checkpoint = FIXTURES / "b_mixed_ratios" / "checkpoint"

    def generate(enforce_eager: bool):
        llm = LLM(str(checkpoint), accelerator="cpu", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=4,
                  max_num_batched_tokens=64, num_kv_blocks=32, block_size=8)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    llm, replayed = generate(False)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.num_graphs == len(cpu_graphs) >= 2
    assert len({bound for _, bound in graphs._captured}) >= 2
    eager_llm, eager = generate(True)
    assert eager_llm.engine.runner.decode_graphs is None
    assert replayed == eager
