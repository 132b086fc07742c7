"""The compute contract: every op the models call, with its plain-torch reference.

`KernelOps` *is* the reference implementation. It is correct on any device torch supports and
is the ground truth of the conformance suite (`deepinfer check-backend`). A backend subclasses it
and overrides the ops it accelerates; whatever it does not override keeps working.

Conventions for every op:
- Tensors arrive on the backend's device; outputs are new tensors unless the docstring says
  an argument is mutated.
- "T" is the number of tokens in the flat (unpadded) step batch, "D" the hidden size.
- Each op's docstring states the tolerance a backend must meet against this reference; the
  matching input generator and tolerance live in `op_cases.py`.
"""

from __future__ import annotations

import torch

__all__ = ["KernelOps"]


class KernelOps:
    """Reference ops in plain torch. Subclass and override to accelerate."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim.

        x: [..., D] any float dtype; weight: [D] (float32 in the models) or None (unweighted).
        Computes in float32: x * rsqrt(mean(x^2) + eps) * weight, cast back to x.dtype.
        Tolerance: float32 1e-5 relative, bfloat16 one bf16 ulp (rtol 1e-2).
        """
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
        return y.to(x.dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y = x @ weight.T for a dense weight.

        x: [..., K]; weight: [N, K], same dtype as x. Returns [..., N] in x.dtype.
        Tolerance: float32 1e-5 relative, bfloat16 1e-2 relative (accumulation order).
        """
        return torch.nn.functional.linear(x, weight)
