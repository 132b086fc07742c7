"""Where an image sits in the token sequence (MODEL_SPEC_V41 §11), and the image rows of one step.

An image whose aligner output is an h' x w' grid occupies a span of h' * (w' + 1) + 2 positions:
IMAGE_START, then per row its w' slots and an IMAGE_NEWLINE, then IMAGE_END. Every span position
carries the image token id in `input_ids`; the model replaces its embedding row by the span vector
(an aligner row for a slot, the learned `image_start` / `image_newline` / `image_end` for a delimiter).
Span tokens route with `gate.bias_vl` and are DEAD for the engram; attention treats them as text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepImages", "llm_grid", "span_length", "span_vectors"]


def llm_grid(grid_h: int, grid_w: int, downsample_ratio: int) -> tuple[int, int]:
    """The aligner's output grid (h', w') for a patch grid (h, w): ceil(h / r), ceil(w / r)."""
    return -(-grid_h // downsample_ratio), -(-grid_w // downsample_ratio)


def span_length(grid_h: int, grid_w: int, downsample_ratio: int) -> int:
    """Token positions of one image's span."""
    rows, cols = llm_grid(grid_h, grid_w, downsample_ratio)
    return rows * (cols + 1) + 2


def span_vectors(
    slots: torch.Tensor, rows: int, cols: int, start: torch.Tensor, newline: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """The span's input vectors [rows * (cols + 1) + 2, D] from aligner rows `slots` [rows * cols, D]."""
    grid = torch.cat([slots.view(rows, cols, -1), newline.expand(rows, 1, -1).to(slots.dtype)], dim=1)
    return torch.cat([start[None].to(slots.dtype), grid.flatten(0, 1), end[None].to(slots.dtype)])


@dataclass(frozen=True, slots=True)
class StepImages:
    """The image-span rows of one step's flat batch and their input vectors.

    rows: [n] int64 on the device, ascending; rows_cpu: the same on the host (the engram hashes there);
    vectors: [n, D] in the model dtype, vectors[i] replacing the embedding of row rows[i].
    """

    rows: torch.Tensor
    rows_cpu: list[int]
    vectors: torch.Tensor
