"""The installed `deepinfer` command: backends listing, conformance runs, and the errors users see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEEPINFER = Path(sys.executable).with_name("deepinfer")


def _deepinfer(*args: str, accelerator: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DEEPINFER_ACCELERATOR=accelerator)
    return subprocess.run(
        [str(DEEPINFER), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_command_is_installed_next_to_python():
    assert DEEPINFER.is_file(), f"{DEEPINFER} missing: install the package (./build.sh --dev)"


def test_backends_lists_each_backend_with_its_state():
    done = _deepinfer("backends", accelerator="cpu")
    assert done.returncode == 0, done.stderr
    assert "cpu  (priority 0, available)" in done.stdout
    assert "capabilities: batch_invariant=" in done.stdout
    assert "DEEPINFER_ACCELERATOR=cpu selects: cpu" in done.stdout
    lines = done.stdout.splitlines()
    for line, following in zip(lines, lines[1:]):
        if line.endswith("unavailable)"):
            assert following.startswith("    reason: "), f"{line!r} is not followed by its reason"


def test_unknown_accelerator_fails_with_the_installed_names():
    done = _deepinfer("backends", accelerator="nope")
    assert done.returncode != 0
    assert "no backend named 'nope'" in done.stderr
    assert "Installed backends:" in done.stderr and "cpu" in done.stderr


def test_check_backend_ascend_fails_naming_torch_npu_and_cann():
    done = _deepinfer("check-backend", "ascend", accelerator="ascend")
    assert done.returncode != 0
    assert "'ascend'" in done.stderr
    assert "torch_npu" in done.stderr or "deepinfer[ascend]" in done.stderr
    assert "CANN 9.2" in done.stderr


def test_check_backend_cpu_passes():
    done = _deepinfer("check-backend", "cpu", accelerator="cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("0 failed")


@pytest.mark.parametrize("args", [("backends", "--bogus"), ("no-such-command",)])
def test_usage_errors_exit_non_zero(args):
    done = _deepinfer(*args, accelerator="cpu")
    assert done.returncode == 2 and "usage: deepinfer" in done.stderr
