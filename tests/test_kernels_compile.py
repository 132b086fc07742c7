"""The kernels compile for sm_90 and sm_100 with no GPU (ptxas ships with Triton), each within a block's shared
memory: every variant the nvidia backend's ops launch in the conformance cases (and a decode step's attention
split over its keys), as the JIT would specialise it on a GPU, and `scripts/compile_kernels.py`'s heaviest
kernels at their real tiles. The interpreter, which runs the other kernel tests, runs code that the compiler
refuses (e.g. a name bound to two shapes in an `if`'s branches) and has no shared memory to run out of."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from kernel_launches import recorded_launches
from test_nvidia_conformance import TritonOnHost

from deepinfer_core.platform.conformance import run_conformance
from deepinfer_core.platform.op_cases import OP_CASES
from deepinfer_kernels.sparse_attention import sparse_attention

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
    reason="this Triton build ships no ptxas",
)


def _compiled(*args: str) -> int:
    """Runs compile_kernels.py (outside the interpreter) and returns how many variants compiled; fails on any other."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "compile_kernels.py"), *args],
                          env=env, capture_output=True, text=True, timeout=1200)
    lines = done.stdout.splitlines()
    failures = [line for line in lines if not line.startswith("ok ")]
    assert done.returncode == 0 and not failures, "\n".join(failures) + done.stderr[-3000:]
    return len(lines)


def _split_decode_attention() -> None:
    """A decode step on 48 multiprocessors: its keys split, then combined (a launch of its own that no conformance
    case reaches without a GPU's multiprocessor count)."""
    from test_kernels_sparse_attention import NUM_SLOTS, RING, STEPS, _batch, _layer_kwargs

    gen, heads, dim = torch.Generator().manual_seed(0), 20, 48
    batch = _batch(*STEPS["decode"], gen)
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(batch.num_tokens, dim, generator=gen).to(torch.bfloat16)
    window = torch.randn(NUM_SLOTS, RING, dim, generator=gen).to(torch.bfloat16)
    kwargs = _layer_kwargs("selected", batch, dim, torch.bfloat16, gen)
    sparse_attention(q, kv, window, torch.randn(heads, generator=gen), dim**-0.5, batch, **kwargs, num_sms=48)


def test_every_launched_kernel_variant_compiles(tmp_path):
    with recorded_launches() as variants:
        run_conformance(TritonOnHost(), [case for case in OP_CASES if case.op != "gather_rows"], seed=7)
        _split_decode_attention()
    kernels = {variant["kernel"].rsplit(":", 1)[1] for variant in variants}
    assert {"_combine_splits_kernel", "_one_launch_plan_kernel", "_decode_scores_kernel"} <= kernels
    recorded = tmp_path / "launches.json"
    recorded.write_text(json.dumps(variants))
    assert _compiled("--recorded", str(recorded)) == 2 * len(variants)  # sm_90 and sm_100


def test_the_heaviest_kernels_compile_at_their_real_tiles():
    assert _compiled() > 0
