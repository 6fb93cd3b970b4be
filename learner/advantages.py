"""Group-relative advantages (pure): each prompt's G samples are scored against their own group.

A_i = (r_i − b_i) / (σ_group + eps) where b_i is the group mean (GRPO) or, with leave-one-out, the
mean of the other G−1 rewards (RLOO); the std division is optional (Dr. GRPO drops it). A group whose
rewards are all equal carries no signal (every A_i = 0): such groups are counted, and can be filtered
so that they do not dilute the token-mean with zero-gradient tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    advantages_B: torch.Tensor  # one per trajectory, float64
    keep_B: torch.Tensor  # bool: False for trajectories of filtered zero-variance groups
    zero_variance_groups: int
    groups: int

    @property
    def zero_variance_frac(self) -> float:
        return self.zero_variance_groups / max(self.groups, 1)


def group_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor, *, std_normalise: bool = True,
                     leave_one_out: bool = False, filter_zero_variance: bool = False,
                     eps: float = 1e-6) -> Advantages:
    """`group_ids_B` names each trajectory's prompt group (any integers; groups may differ in size)."""
    if rewards_B.shape != group_ids_B.shape or rewards_B.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards_B.shape)} and group ids {tuple(group_ids_B.shape)} must be one [B]")
    if not torch.isfinite(rewards_B).all():
        raise ValueError("rewards must be finite")
    r_B = rewards_B.to(torch.float64)
    _, gidx_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(gidx_B.max().item()) + 1 if len(gidx_B) else 0
    size_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gidx_B, torch.ones_like(r_B))
    sum_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gidx_B, r_B)
    mean_G = sum_G / size_G
    sq_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gidx_B, (r_B - mean_G[gidx_B]).square())
    # Unbiased std like torch.std; a group of one has no spread.
    std_G = torch.where(size_G > 1, (sq_G / (size_G - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq_G))
    rmax_G = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, gidx_B, r_B, "amax")
    rmin_G = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, gidx_B, r_B, "amin")
    zero_var_G = rmax_G == rmin_G

    if leave_one_out:
        n_B = size_G[gidx_B]
        others_B = torch.where(n_B > 1, (sum_G[gidx_B] - r_B) / (n_B - 1).clamp(min=1), r_B)
        adv_B = r_B - others_B
    else:
        adv_B = r_B - mean_G[gidx_B]
    if std_normalise:
        adv_B = adv_B / (std_G[gidx_B] + eps)
    adv_B = torch.where(zero_var_G[gidx_B], torch.zeros_like(adv_B), adv_B)
    keep_B = ~zero_var_G[gidx_B] if filter_zero_variance else torch.ones_like(adv_B, dtype=torch.bool)
    return Advantages(adv_B, keep_B, int(zero_var_G.sum().item()), num_groups)
