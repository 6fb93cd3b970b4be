"""Shared fixtures: a tiny policy built from config and saved as an HF checkpoint directory."""
from __future__ import annotations

import pytest
import torch

from learner.config import PolicyConfig
from learner.policy import build_policy
from core.hf import save_policy

TINY = PolicyConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_positions=256)


@pytest.fixture(scope="session")
def tiny_policy():
    torch.set_num_threads(1)
    return build_policy(TINY)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_policy):
    path = tmp_path_factory.mktemp("ckpt")
    save_policy(*tiny_policy, path)
    return path
