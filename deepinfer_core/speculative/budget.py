"""How many drafts to verify, from the drafter's per-position confidences (DSpark's verification budget).

c_j is the drafter's probability that draft j is accepted once drafts < j are. Draft n then survives
verification with probability s_n = prod_{j<=n} c_j, and the expected number of accepted drafts of a
request is the sum of the s_n of the drafts it verifies. Each verified draft costs one target row.
The rule (DSpark's "Algorithm 1", MODEL_SPEC_V41 §10):
- per request, verify drafts 1..n while s_n >= min_survival (a draft worth less than that fraction
  of a token is not worth its row); s is non-increasing in n, so this is a prefix;
- with a step budget of B drafts over all requests, keep the B admitted drafts of highest s (ties:
  earlier request, then earlier draft). That maximises the step's expected accepted drafts for B
  verified rows, and it keeps every request's drafts a prefix, since s falls along a request.
"""

from __future__ import annotations

import torch

__all__ = ["survival_budget"]


def survival_budget(
    confidences: torch.Tensor, limit: torch.Tensor, min_survival: float, max_total: int | None = None
) -> torch.Tensor:
    """[S] int64: drafts to verify per request.

    confidences: [S, k] float32 in [0, 1]; limit: [S] int64, most drafts request i may verify.
    """
    k = confidences.shape[1]
    survival = confidences.float().cumprod(dim=1)
    positions = torch.arange(k, device=confidences.device)
    admitted = (survival >= min_survival) & (positions[None, :] < limit[:, None])
    admitted = admitted.long().cumprod(dim=1).bool()
    if max_total is not None and int(admitted.sum()) > max_total:
        value = survival.masked_fill(~admitted, -1.0).flatten()
        best = torch.sort(value, descending=True, stable=True).indices[:max_total]
        kept = torch.zeros_like(value, dtype=torch.bool)
        kept[best] = True
        admitted = kept.view_as(admitted).long().cumprod(dim=1).bool()
    return admitted.sum(dim=1)
