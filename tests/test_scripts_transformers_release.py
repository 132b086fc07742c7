"""The scripts that run transformers beside DeepInfer name its release, and the engine check, which takes it as
the reference, refuses one below deepinfer's own requirement (the GPU image's 5.17 failed inside its DeepSeek-V4)."""

from __future__ import annotations

import runpy
import sys
from importlib import metadata
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import kernel_bench_common

    return kernel_bench_common


def test_the_installed_transformers_meets_the_requirement(common):
    version, wanted, meets = common.transformers_release()
    assert version == metadata.version("transformers")
    assert wanted.startswith("transformers>=") and meets
    assert common.transformers_line() == f"side by side: transformers {version}"


def test_an_older_transformers_is_named_as_below_the_requirement(common):
    assert common.transformers_release("5.17.0")[2] is False
    assert common.transformers_line("5.17.0").startswith(
        "side by side: transformers 5.17.0 (below deepinfer's transformers>=")


def test_the_engine_check_refuses_an_older_transformers(common, monkeypatch, tmp_path):
    release = common.transformers_release
    monkeypatch.setattr(common, "transformers_release", lambda: release("5.17.0"))
    monkeypatch.setattr(sys, "argv", ["check_engine_gpu.py", "--accelerator", "cpu", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="transformers 5.17.0 is installed; the reference this check compares"):
        runpy.run_path(str(SCRIPTS / "check_engine_gpu.py"), run_name="__main__")
    assert not any(tmp_path.iterdir())
