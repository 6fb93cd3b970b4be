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


class Optimised:
    """What every learner kind shares: AdamW, the schedule, the step and policy-version counters, gradient
    clipping, and the state a checkpoint holds. Subclasses set `model`, `cfg` (with `.optim`) and `device`."""

    def init_optimiser(self) -> None:
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim)
        self.step = 0  # optimizer steps taken
        self.policy_version = 0

    def clip(self) -> torch.Tensor:
        """Clip the global gradient norm (when optim.grad_clip > 0); returns the norm before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.optim.grad_clip > 0:
            # CPU: per-tensor loops, the same arithmetic whatever the ranks; GPU: the foreach kernels.
            foreach = None if self.device.type == "cuda" else False
            return torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip, foreach=foreach)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))

    def clip_finite(self, kind: str) -> float:
        """`clip()`, then the norm as a float; a non-finite norm clears the gradients and raises
        FloatingPointError, since a step on it would make every weight NaN (one host sync per step)."""
        grad_norm = float(self.clip())
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"{kind} step {self.step + 1}: gradient norm {grad_norm}; the step is not taken")
        return grad_norm

    def state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step, "policy_version": self.policy_version}

    def load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])
