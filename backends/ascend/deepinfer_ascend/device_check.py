"""What `AscendBackend.check()` verifies: torch_npu, a CANN 9.2 environment, an NPU.

torch_npu is imported here and only here (lazily, inside `probe_npu`): importing it loads CANN's
libraries, which fails on a machine without CANN.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import ModuleType

from deepinfer_core.platform.errors import BackendUnavailable

__all__ = ["MIN_CANN", "NpuDeviceInfo", "import_torch_npu", "probe_npu"]

MIN_CANN = (9, 2)

_INSTALL = (
    "install CANN 9.2 (toolkit and kernels), `source <CANN>/set_env.sh` (e.g. "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh), then DEEPINFER_ACCELERATOR=ascend ./build.sh (the deepinfer[ascend] extra)"
)


@dataclass(frozen=True, slots=True)
class NpuDeviceInfo:
    name: str
    cann: str
    torch_npu: str


def import_torch_npu() -> ModuleType:
    """Import torch_npu (which registers `torch.npu`), or raise `BackendUnavailable`."""
    try:
        import torch_npu
    except ImportError as exc:
        raise BackendUnavailable(f"torch_npu is not importable ({exc}): {_INSTALL}") from exc
    except OSError as exc:
        raise BackendUnavailable(f"torch_npu cannot load CANN's libraries ({exc}): {_INSTALL}") from exc
    return torch_npu


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def probe_npu(device_index: int) -> NpuDeviceInfo:
    """Describe NPU `device_index`, or raise `BackendUnavailable` naming what is missing."""
    torch_npu = import_torch_npu()
    if not os.environ.get("ASCEND_TOOLKIT_HOME"):
        raise BackendUnavailable(f"the CANN environment is not set (ASCEND_TOOLKIT_HOME is unset): {_INSTALL}")
    cann = torch_npu.utils.get_cann_version(module="CANN")
    found = _major_minor(cann)
    if found is None or found < MIN_CANN:
        raise BackendUnavailable(f"CANN {cann or 'of unknown version'} found; the ascend backend needs CANN 9.2: {_INSTALL}")
    npu = torch_npu.npu
    count = npu.device_count()
    if count == 0:
        raise BackendUnavailable("no NPU is visible: check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES")
    if device_index >= count:
        raise BackendUnavailable(f"NPU index {device_index} requested but only {count} NPU(s) are visible")
    return NpuDeviceInfo(name=npu.get_device_name(device_index), cann=cann, torch_npu=torch_npu.__version__)
