"""Programmatic dependent launch (PDL): on sm_90 and newer each kernel may be launched while the kernel
before it in the stream drains, which hides most of a kernel boundary's cost. A decode step replays ~200
small kernels from a CUDA graph; on an H200 a boundary there went from 1.19 to 0.74 us with both calls of
`wait_for_previous_grid` at the top of each kernel.

Every kernel of this package takes `PDL: tl.constexpr`, calls `wait_for_previous_grid(PDL)` as its first
statement and is launched with `**launch_options(device)`. Why that is safe:
- griddepcontrol.wait returns once the previous grid has completed and its writes are visible. Every PDL
  kernel waits before it touches memory, so by induction each kernel sees every earlier kernel's writes.
- Kernels launched without the attribute (torch's, copies) are serialised by the stream as usual.
- griddepcontrol.launch_dependents, after the wait, lets the next grid be scheduled only once every CTA
  of this one has run it (or exited), i.e. has started: the next grid's CTAs, which only wait, take what
  is left and cannot starve this grid, and no more than two grids are ever in flight.

PDL is off under Triton's interpreter and before sm_90, and with DEEPINFER_PDL=0 (read at a device's
first launch), so that its effect can be measured.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer_core import envs

__all__ = ["launch_options", "wait_for_previous_grid"]


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def launch_options(device: torch.device) -> dict[str, bool]:
    """The `PDL` constexpr and, when it is on, the `launch_pdl` launch option for kernels on `device`;
    cached, so that a launch costs no capability lookup."""
    # triton.jit reads the same knob: interpreted kernels are Python, for which launch_pdl means nothing
    enabled = (device.type == "cuda" and not triton.knobs.runtime.interpret and envs.pdl()
               and torch.cuda.get_device_capability(device)[0] >= 9)
    return {"PDL": True, "launch_pdl": True} if enabled else {"PDL": False}
