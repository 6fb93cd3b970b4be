"""The shipped GRPO config parses; bounds are enforced; the LR schedule has its shape."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from core.config import load
from core.errors import UserError
from learner.grpo_config import GRPOConfig, OptimConfig
from learner.optim import build_optimizer, lr_factor

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_config_parses():
    cfg = load(GRPOConfig, ROOT / "configs" / "grpo.toml")
    assert cfg.loss.options().dual_clip is None  # 0 means off
    assert cfg.staleness.bound == 1


def test_bounds_and_unknown_keys_fail_with_the_key():
    with pytest.raises(UserError, match="loss.eps_low"):
        load(GRPOConfig, None, ["loss.eps_low=1.5"])
    with pytest.raises(UserError, match="unknown key"):
        load(GRPOConfig, None, ["loss.clip=0.2"])
    with pytest.raises(UserError, match="aggregation"):
        load(GRPOConfig, None, ["loss.aggregation=mean"])


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    f = [lr_factor(s, cfg) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f[14] == pytest.approx(0.1) and f[19] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt, _ = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
