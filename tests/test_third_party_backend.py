"""examples/third_party_backend: found through its entry point, selected by name, conformant.

The package is made importable the way an install would: its source folder and a dist-info
folder (METADATA and entry_points.txt written from the example's own pyproject.toml) go on the
path. That exercises the real entry-point discovery without touching the test environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deepinfer_core.platform import KernelOps, select_backend
from deepinfer_core.platform.conformance import run_conformance
from deepinfer_core.platform.registry import BackendRegistry

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "third_party_backend"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """A site folder holding the example's dist-info, as `pip install` would write it."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = tmp_path_factory.mktemp("site")
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in entries.items())
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


@pytest.fixture
def example_installed(example_site, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(example_site))


def test_example_is_discovered_and_selected_by_name(example_installed, monkeypatch):
    assert "example" in BackendRegistry.from_entry_points().records()
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "example")
    backend = select_backend()
    assert backend.name == "example"
    assert type(backend.ops()).rms_norm is not KernelOps.rms_norm


def test_auto_never_prefers_the_example_over_the_reference(example_installed, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "auto")
    assert select_backend().name != "example"


def test_example_passes_conformance(example_installed):
    report = run_conformance(BackendRegistry.from_entry_points().select("example"))
    rms_norm = [r for r in report.results if r.op == "rms_norm"]
    assert rms_norm and all(r.passed for r in rms_norm), report.summary()
    assert report.passed, report.summary()


def test_check_backend_command_passes_for_the_example(example_site):
    env = dict(os.environ, DEEPINFER_ACCELERATOR="example")
    env["PYTHONPATH"] = os.pathsep.join([str(example_site), str(EXAMPLE), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.cli", "check-backend", "example"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "conformance of backend 'example'" in done.stdout
