"""AdamW (decay on matrices only) and the warm-up + cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch

from learner.grpo_config import OptimConfig


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warm-up, cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # GPU: the fused kernel. CPU: plain per-parameter loops, the same arithmetic whatever the ranks.
    fast = dict(fused=True) if any(p.is_cuda for p in decay + no_decay) else dict(foreach=False)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, **fast)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
    return opt, sched
