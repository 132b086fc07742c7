"""DeepSeek-V4.1 vision tower and aligner (MODEL_SPEC_V41 §11): image patches -> one LLM vector per 3x3 patches.

Tower: patch embed (Linear with bias on channel-major patches [3*p*p]); blocks of RMSNorm -> fused qkv
(bias) -> axial 2D RoPE -> bidirectional attention within each image -> proj (bias), then RMSNorm ->
SwiGLU (`w1` = [gate; up], `w2`, no bias); final RMSNorm. Aligner: the [h, w] feature grid zero-padded
at the bottom/right to multiples of the downsample ratio r, each r x r window unfolded channel-major
(c, dy, dx) into r*r*width features -> Linear -> GELU -> Linear = one row per window, row-major.

Parameter names are the official checkpoint's (`vision.blocks.{i}.attn.wqkv.weight`, `aligner.w1.bias`).
NOTE: no reference run of this path exists (transformers' V4.1 vision is in no PyPI release and the
fixtures are text-only); the tests check it against an independent reading of the spec. The 2D RoPE
frequency layout (inv_freq over head_dim/2 with step 2, height angles on the first head_dim/4 pairs)
follows third-party ports of the reference [docs], not a run.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.factory import RMSNorm
from deepinfer_core.models.deepseek_v4.linear import empty_param
from deepinfer_core.platform.kernel_ops import KernelOps

from .config import DeepseekV41VisionConfig

__all__ = ["Aligner", "VisionTower", "vision_rope_angles"]


class BiasedLinear(nn.Module):
    """A dense projection plus bias (the vision weights are not block-quantised)."""

    def __init__(self, in_features: int, out_features: int, ops: KernelOps, dtype: torch.dtype,
                 device: torch.device, *, bias: bool = True) -> None:
        super().__init__()
        self.ops = ops
        self.weight = empty_param((out_features, in_features), dtype, device)
        self.bias = empty_param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


def vision_rope_angles(grid_h: int, grid_w: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Rotation angles [h*w, head_dim/2] float32 of a row-major patch grid: pair i (channel i with channel
    i + head_dim/2) turns by row * f_i for i < head_dim/4 and by column * f_(i - head_dim/4) after,
    f_j = theta^(-4j / head_dim)."""
    quarter = head_dim // 4
    inv_freq = theta ** (-torch.arange(quarter, dtype=torch.float32, device=device) * 4 / head_dim)
    rows = torch.arange(grid_h, dtype=torch.float32, device=device).repeat_interleave(grid_w)
    cols = torch.arange(grid_w, dtype=torch.float32, device=device).repeat(grid_h)
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head in float32; x [N, H, d], cos/sin [N, 1, d/2]."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, c: DeepseekV41VisionConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.n_heads, self.head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        self.wqkv = BiasedLinear(c.hidden_size, 3 * c.hidden_size, ops, dtype, device)
        self.wo = BiasedLinear(c.hidden_size, c.hidden_size, ops, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [N, width] for several images concatenated (`lengths` patches each); attention stays within an image."""
        q, k, v = (part.reshape(-1, self.n_heads, self.head_dim) for part in self.wqkv(x).chunk(3, dim=-1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = [
            torch.nn.functional.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            .transpose(0, 1)
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return self.wo(torch.cat(outs).flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, c: DeepseekV41VisionConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.w1 = BiasedLinear(c.hidden_size, 2 * c.intermediate_size, ops, dtype, device, bias=False)
        self.w2 = BiasedLinear(c.intermediate_size, c.hidden_size, ops, dtype, device, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(torch.nn.functional.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, c: DeepseekV41VisionConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = RMSNorm(c.hidden_size, ops, c.rms_norm_eps, device)
        self.attn = VisionAttention(c, ops, dtype, device)
        self.norm2 = RMSNorm(c.hidden_size, ops, c.rms_norm_eps, device)
        self.mlp = VisionMLP(c, ops, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, c: DeepseekV41VisionConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.proj = BiasedLinear(3 * c.patch_size**2, c.hidden_size, ops, dtype, device)


class VisionTower(nn.Module):
    """`forward(patches [N, 3*p*p], grids [(h, w)] with sum h*w = N) -> features [N, width]`: the images'
    patches concatenated in row-major order, each image attending only to itself."""

    def __init__(self, c: DeepseekV41VisionConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config, self.dtype = c, dtype
        self.patch_embed = PatchEmbed(c, ops, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(c, ops, dtype, device) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, ops, c.rms_norm_eps, device)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        c = self.config
        lengths = [h * w for h, w in grids]
        if patches.shape != (sum(lengths), 3 * c.patch_size**2):
            raise ValueError(f"patches of shape {list(patches.shape)} do not match grids {grids}: expected "
                             f"[{sum(lengths)}, {3 * c.patch_size**2}] (channel-major {c.patch_size}-pixel patches)")
        head_dim = c.hidden_size // c.num_attention_heads
        angles = torch.cat([vision_rope_angles(h, w, head_dim, c.rope_theta, patches.device) for h, w in grids])
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        x = self.patch_embed.proj(patches.to(self.dtype))
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.norm(x)


class Aligner(nn.Module):
    """`forward(features [h*w, width], (h, w)) -> [ceil(h/r) * ceil(w/r), D]` for one image."""

    def __init__(self, c: DeepseekV41VisionConfig, text_hidden: int, ops: KernelOps, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.ratio = c.downsample_ratio
        self.w1 = BiasedLinear(c.hidden_size * self.ratio**2, text_hidden, ops, dtype, device)
        self.w2 = BiasedLinear(text_hidden, text_hidden, ops, dtype, device)

    def forward(self, features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        h, w = grid
        r = self.ratio
        image = features.reshape(h, w, -1).permute(2, 0, 1)
        image = torch.nn.functional.pad(image, (0, -w % r, 0, -h % r))
        windows = torch.nn.functional.unfold(image.unsqueeze(0), kernel_size=r, stride=r)[0].transpose(0, 1)
        return self.w2(torch.nn.functional.gelu(self.w1(windows.contiguous())))
