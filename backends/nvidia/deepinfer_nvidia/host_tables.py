"""Host tables the GPU reads in place: page-locks and maps an ordinary host tensor (cudaHostRegister)
without copying it, so a 100 GB engram table needs no second, pinned copy."""

from __future__ import annotations

import logging
import time
import weakref

import torch

__all__ = ["device_readable"]

logger = logging.getLogger(__name__)

_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def device_readable(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`table` itself, once `device` can address it: device memory, pinned host memory and any host memory
    read from the host (the kernels under Triton's interpreter) as they are; other host memory registered
    in place the first time (undone when the tensor is freed)."""
    if device.type == "cpu" or table.is_cuda or table.is_pinned():
        return table
    if not table.is_contiguous():
        raise ValueError("a host table read by the GPU must be contiguous (it is registered in place)")
    started = time.perf_counter()
    cudart = torch.cuda.cudart()
    pointer, size = table.data_ptr(), table.numel() * table.element_size()
    torch.cuda.check_error(cudart.cudaHostRegister(pointer, size, _REGISTER_PORTABLE_MAPPED))
    weakref.finalize(table, cudart.cudaHostUnregister, pointer)
    logger.info("registered a %.2f GB host table for zero-copy reads in %.2f s", size / 1e9,
                time.perf_counter() - started)
    return table
