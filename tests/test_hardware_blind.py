"""The core is hardware-blind: it imports without any vendor stack and never names one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "deepinfer_core"
VENDOR_MODULES = ("torch_npu", "triton", "cuda", "deepinfer_nvidia", "deepinfer_ascend", "deepinfer_kernels")
FORBIDDEN = re.compile(r"torch\.cuda|torch\.npu|torch_npu|[\"']nccl[\"']|[\"']hccl[\"']")

_IMPORT_ALL = f"""
import importlib, pkgutil, sys, traceback
for name in {VENDOR_MODULES!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
import deepinfer_core
failed = []
for info in pkgutil.walk_packages(deepinfer_core.__path__, "deepinfer_core."):
    try:
        importlib.import_module(info.name)
    except BaseException:
        failed.append(info.name + ": " + traceback.format_exc(limit=3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_core_module_imports_with_vendor_modules_blocked():
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], cwd=CORE.parent, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"core modules that need a vendor stack:\n{done.stdout}{done.stderr}"


def test_core_source_never_names_a_vendor_api():
    offenders = [
        f"{path.relative_to(CORE.parent)}:{number}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not offenders, "vendor names in deepinfer_core:\n" + "\n".join(offenders)
