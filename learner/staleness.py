"""Token staleness (pure): how many policy versions behind the learner each trained token was sampled.

Rollouts pick up new weights mid-trajectory, so one trajectory's tokens may carry several versions;
each token keeps the behaviour log-prob recorded in the WAL under the version that sampled it, and
its staleness is `current_version − token_version`. Tokens beyond a bound are either masked out of
the loss (`mask`) or their whole trajectory is dropped (`drop`, which keeps trajectories intact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

StalenessMode = Literal["mask", "drop"]


@dataclass
class StalenessReport:
    loss_mask_N: torch.Tensor  # the input mask with out-of-bound tokens (or trajectories) removed
    keep_seq_S: torch.Tensor  # bool per sequence: False where `drop` removed it
    histogram: dict[int, int]  # staleness -> loss tokens at that staleness (before the bound)
    max_staleness: int
    tokens_over_bound: int  # loss tokens beyond the bound
    tokens_removed: int  # loss tokens taken out of the loss (== over bound for mask; more for drop)
    seqs_dropped: int


def token_staleness(current_version: int, token_versions_N: torch.Tensor) -> torch.Tensor:
    stale_N = current_version - token_versions_N.to(torch.long)
    if (stale_N < 0).any():
        bad = int(token_versions_N.max().item())
        raise ValueError(f"token recorded under policy version {bad}, newer than the learner's {current_version}")
    return stale_N


def staleness_histogram(stale_N: torch.Tensor, loss_mask_N: torch.Tensor) -> dict[int, int]:
    counts = torch.bincount(stale_N[loss_mask_N.bool()])
    return {k: int(c) for k, c in enumerate(counts.tolist()) if c}


def apply_staleness_bound(current_version: int, token_versions_N: torch.Tensor, loss_mask_N: torch.Tensor,
                          seq_ids_N: torch.Tensor, bound: int | None, mode: StalenessMode = "mask"
                          ) -> StalenessReport:
    """`bound=None` keeps everything (the histogram is still reported)."""
    if mode not in ("mask", "drop"):
        raise ValueError(f"staleness mode {mode!r} not in ('mask', 'drop')")
    if bound is not None and bound < 0:
        raise ValueError(f"staleness bound must be >= 0, got {bound}")
    mask_N = loss_mask_N.bool()
    stale_N = token_staleness(current_version, token_versions_N)
    num_seqs = int(seq_ids_N.max().item()) + 1 if seq_ids_N.numel() else 0
    hist = staleness_histogram(stale_N, mask_N)
    over_N = mask_N & (stale_N > bound) if bound is not None else torch.zeros_like(mask_N)
    keep_seq_S = torch.ones(num_seqs, dtype=torch.bool, device=mask_N.device)
    if mode == "mask":
        new_mask_N = mask_N & ~over_N
    else:
        bad_S = torch.zeros(num_seqs, dtype=torch.long, device=mask_N.device).index_add_(0, seq_ids_N, over_N.long()) > 0
        keep_seq_S = ~bad_S
        new_mask_N = mask_N & keep_seq_S[seq_ids_N]
    return StalenessReport(
        loss_mask_N=new_mask_N, keep_seq_S=keep_seq_S, histogram=hist,
        max_staleness=max(hist) if hist else 0, tokens_over_bound=int(over_N.sum()),
        tokens_removed=int((mask_N & ~new_mask_N).sum()), seqs_dropped=int((~keep_seq_S).sum()),
    )
