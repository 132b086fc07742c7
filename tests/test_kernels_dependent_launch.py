"""Programmatic dependent launch (`deepinfer_kernels.dependent_launch`): when `launch_options` turns it on;
that every kernel waits for the previous one before it touches memory and every launch passes the options
(static checks, so that a new kernel cannot forget either); and, on a GPU, that a captured chain of kernels
replayed with PDL equals the chain run eagerly without it."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from triton.runtime.jit import KernelInterface

import deepinfer_kernels
from deepinfer_kernels.dependent_launch import launch_options

REPO = Path(__file__).resolve().parents[1]
ON, OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}
MODULES = [importlib.import_module(f"deepinfer_kernels.{m.name}")
           for m in pkgutil.iter_modules(deepinfer_kernels.__path__)]


@pytest.fixture
def fresh_options():
    """launch_options caches its answer per device: each test decides afresh."""
    launch_options.cache_clear()
    yield
    launch_options.cache_clear()


def test_off_on_the_cpu_and_under_the_interpreter(fresh_options, monkeypatch):
    assert launch_options(torch.device("cpu")) == OFF
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert launch_options(torch.device("cuda", 0)) == OFF  # TRITON_INTERPRET=1: the kernels are Python


@pytest.mark.parametrize("capability,env,expected", [
    ((9, 0), None, ON), ((10, 0), "1", ON), ((8, 9), None, OFF), ((9, 0), "0", OFF), ((10, 0), "off", OFF),
])
def test_on_from_sm90_unless_turned_off(fresh_options, monkeypatch, capability, env, expected):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if env is None:
        monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_PDL", env)
    assert launch_options(torch.device("cuda", 0)) == expected


def _kernels():
    for module in MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, KernelInterface) and name.endswith("_kernel") and obj.fn.__module__ == module.__name__:
                yield name, obj


def test_every_kernel_waits_for_the_previous_one_first():
    """A kernel that touched memory before the wait could read what the previous kernel has not yet written."""
    kernels = dict(_kernels())
    assert {"_linear_kernel", "_scan_kernel", "_sum_slots_kernel", "_sparse_attention_kernel"} <= kernels.keys()
    for name, kernel in kernels.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
        fn = tree.body[0]
        assert "PDL" in [a.arg for a in fn.args.args], f"{name} has no PDL parameter"
        body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and ast.unparse(first.value) == "wait_for_previous_grid(PDL)"), \
            f"{name} must start with wait_for_previous_grid(PDL), starts with {ast.unparse(first)!r}"


def test_every_launch_passes_the_launch_options():
    launches = 0
    for module in MODULES:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")):
                continue
            launches += 1
            spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
            assert any(s.startswith("launch_options(") for s in spread), \
                f"{module.__name__}: {node.func.value.id} is launched without **launch_options(device)"
    assert launches >= len(dict(_kernels()))


# Eager without PDL, then captured and replayed with it: rms_norm, a split-K linear (arrival counters), rms_norm,
# linear, rms_norm; each replay on new inputs must equal the eager chain bit for bit (the kernels are deterministic).
_GRAPH_CHAIN = """
import os
import torch
from deepinfer_kernels import dependent_launch
from deepinfer_kernels.linear import linear
from deepinfer_kernels.rms_norm import rms_norm

device = torch.device("cuda", 0)
sms = torch.cuda.get_device_properties(device).multi_processor_count
gen = torch.Generator(device).manual_seed(0)
w1 = torch.randn(1024, 4096, device=device, generator=gen, dtype=torch.bfloat16) / 64
w2 = torch.randn(4096, 1024, device=device, generator=gen, dtype=torch.bfloat16) / 32
norm = torch.rand(4096, device=device, generator=gen) + 0.5

def chain(x):
    h = linear(rms_norm(x, norm, 1e-6), w1, None, None, num_sms=sms)
    return rms_norm(linear(rms_norm(h, None, 1e-6), w2, None, None), norm, 1e-6)

inputs = [torch.randn(4, 4096, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(8)]
os.environ["DEEPINFER_PDL"] = "0"
expected = [chain(x) for x in inputs]
assert not dependent_launch.launch_options(device)["PDL"]
dependent_launch.launch_options.cache_clear()
os.environ["DEEPINFER_PDL"] = "1"
assert dependent_launch.launch_options(device)["PDL"] == (torch.cuda.get_device_capability(device)[0] >= 9)
x = inputs[0].clone()
chain(x)  # compiles the PDL variants before the capture
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = chain(x)
for given, want in zip(inputs, expected):
    x.copy_(given)
    graph.replay()
    assert torch.equal(out, want), (out - want).abs().max()
print("replays equal eager")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (PDL from sm_90)")
def test_graph_replay_with_pdl_equals_eager():
    # A child process: this one runs the kernels through the interpreter (TRITON_INTERPRET=1 at import).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "kernels"), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _GRAPH_CHAIN], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replays equal eager" in result.stdout
