"""Publishing weights: a new policy version on the learner, the weights the rollout pool receives."""
from __future__ import annotations

import torch

from learner.config import PolicyConfig
from learner.grpo_config import GRPOConfig
from learner.group import LearnerGroup
from learner.tokenizer import char_tokenizer
from learner.train_step import synthetic_packed_batch

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=2)


def test_publish_bumps_version_and_hands_out_trained_weights():
    cfg = GRPOConfig.model_validate({"learner": {"device": "cpu", "threads": 1}, "optim": {"lr": 1e-2},
                                     "staleness": {"bound": 0}})
    group = LearnerGroup(cfg, TINY)
    assert group.policy_version == 0
    before = group.weights()
    batch = synthetic_packed_batch(len(char_tokenizer()), [10, 12], seed=0, versions=(0, 0))
    group.train_step([[batch]])
    state, version = group.publish()
    assert version == 1 == group.policy_version
    assert any(not torch.equal(v, before[k]) for k, v in state.items())
    assert all(v.device.type == "cpu" for v in state.values())
    # Tokens of version 0 are now one version old: with bound 0 they leave the loss.
    m = group.train_step([[batch]])
    assert m["loss_tokens"] == 0 and m["stale_tokens_removed"] == int(batch.loss_mask_N.sum())
    assert m["staleness_hist_1"] == int(batch.loss_mask_N.sum())


def test_live_weights_are_the_parameters_and_the_copies_are_not():
    """`live`: rank 0's parameter tensors themselves (an in-process consumer copies them, device to device);
    the default: CPU copies that a later step does not change."""
    cfg = GRPOConfig.model_validate({"learner": {"device": "cpu", "threads": 1}, "optim": {"lr": 1e-2}})
    group = LearnerGroup(cfg, TINY)
    live, copies = group.weights(live=True), group.weights()
    params = group.local.model.state_dict()
    assert all(v.data_ptr() == params[k].data_ptr() for k, v in live.items())
    assert all(v.data_ptr() != params[k].data_ptr() and torch.equal(v, params[k]) for k, v in copies.items())
    batch = synthetic_packed_batch(len(char_tokenizer()), [10, 12], seed=0, versions=(0, 0))
    group.train_step([[batch]])
    state, version = group.publish(live=True)
    assert version == 1 and any(not torch.equal(v, copies[k]) for k, v in state.items())
    assert all(torch.equal(v, params[k]) for k, v in state.items())
