"""DeepSeek-V4.1's candidate mask (MODEL_SPEC_V41 §4.2) against its definition: the top blocks by max score."""

import pytest
import torch

from deepinfer_core.models.deepseek_v41.indexer import candidate_mask


def _ranked_mask(scores, visible_counts, top_blocks, block_size):
    """The definition, every block ranked: a block scores its max entry, the newest visible block +inf."""
    rows, n = scores.shape
    n_blocks = -(-n // block_size)
    keep = torch.zeros(rows, n, dtype=torch.bool)
    for r in range(rows):
        block_max = [max(scores[r, b * block_size:(b + 1) * block_size].tolist()) for b in range(n_blocks)]
        newest = (int(visible_counts[r]) - 1) // block_size
        if newest >= 0:
            block_max[newest] = float("inf")
        order = sorted(range(n_blocks), key=lambda b: -block_max[b])[:top_blocks]
        for b in order:
            if block_max[b] > float("-inf"):
                keep[r, b * block_size:(b + 1) * block_size] = True
    return keep


@pytest.mark.parametrize("top_blocks", [3, 7, 8, 40])  # fewer blocks than the row has, and all of them
def test_candidate_mask_keeps_the_top_blocks(top_blocks):
    gen = torch.Generator().manual_seed(top_blocks)
    n, block_size = 29, 4  # 8 blocks, the last one short
    scores = torch.randn(5, n, generator=gen)
    visible_counts = torch.tensor([0, 1, 9, 20, 29])
    scores = scores.masked_fill(torch.arange(n) >= visible_counts[:, None], float("-inf"))
    got = candidate_mask(scores, visible_counts, top_blocks, block_size)
    assert torch.equal(got, _ranked_mask(scores, visible_counts, top_blocks, block_size))
    assert not got[0].any() and got[4, ::block_size].sum() == min(top_blocks, 8)  # the kept blocks' first entries
