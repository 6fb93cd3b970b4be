"""The learner eats the real data plane's loader output: put → select → advantages → plan → load → step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.advantages import group_advantages
from learner.config import PolicyConfig
from learner.grpo_config import GRPOConfig
from learner.policy import build_policy
from learner.train_step import Learner, PackedBatch

dataplane = pytest.importorskip("dataplane")

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=1)


def records(vocab: int, n_groups=3, per_group=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        for k in range(per_group):
            length = int(rng.integers(8, 30))
            mask = np.zeros(length, dtype=np.uint8)
            mask[5:] = 1  # five prompt tokens
            out.append(dataplane.TrajectoryRecord(
                id=f"t{g}-{k}", run="r", domain="arith", prompt=f"p{g}", group_id=f"g{g}",
                tokens=rng.integers(0, vocab, length), loss_mask=mask,
                logprobs=(-rng.random(length) * 3).astype(np.float32), reward=float(rng.integers(0, 2)),
                policy_min=g, policy_max=g + 1))
    return out


def test_loader_batches_train(tmp_path):
    model, tok = build_policy(TINY)
    recs = records(len(tok))
    dp = dataplane.open(tmp_path / "catalog.db", tmp_path / "store")
    dp.put(recs)
    sel = dp.select(run="r")
    adv = group_advantages(torch.as_tensor(sel.reward), torch.as_tensor(sel.group))
    advantages = dict(zip(map(str, sel.ids), adv.advantages_B.tolist()))
    plan = dp.plan(sel, tokens_per_rank=64, ranks=2, seed=0, group_aware=True)
    by_id = {r.id: r for r in recs}
    per_rank: list[list[PackedBatch]] = [[], []]
    for rank in range(2):
        for b in dp.loader(plan, rank=rank):
            pb = PackedBatch.from_dataplane(b, advantages)
            if pb is None:
                continue
            for s, tid in enumerate(b.traj_ids):  # fields land where the trajectory's tokens are
                one = pb.select(s, s + 1)
                assert one.input_ids_N.tolist() == by_id[tid].tokens.tolist()
                assert one.loss_mask_N.tolist() == by_id[tid].loss_mask.astype(bool).tolist()
                assert torch.allclose(one.behaviour_logprobs_N, torch.as_tensor(by_id[tid].logprobs))
                assert (one.advantages_N == advantages[tid]).all()
            per_rank[rank].append(pb)
    assert sum(pb.num_seqs for mbs in per_rank for pb in mbs) == len(recs)
    cfg = GRPOConfig.model_validate({"learner": {"device": "cpu", "threads": 1}, "optim": {"lr": 1e-2}})
    learner = Learner(model, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = learner.train_step(per_rank[0] + per_rank[1])
    assert m["seqs"] == sum(1 for r in recs if r.loss_mask.any()) and np.isfinite(m["loss"])
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # Trajectory-level versions (the selection's oldest) bound staleness when tokens carry none.
    oldest = dict(zip(map(str, sel.ids), sel.policy_min.tolist()))
    b = next(b for b in dp.loader(plan, rank=0) if b.num_tokens)
    pb = PackedBatch.from_dataplane(b, advantages, trajectory_versions=oldest)
    for s, tid in enumerate(b.traj_ids):
        assert (pb.select(s, s + 1).token_versions_N == int(tid[1])).all()  # t{group}-k: policy_min = group

    # A plan that cuts trajectories is refused with the trajectory named.
    cut = dp.plan(sel, tokens_per_rank=16, ranks=1, seed=0)
    with pytest.raises(ValueError, match="was split"):
        for b in dp.loader(cut, rank=0):
            PackedBatch.from_dataplane(b, advantages)


def test_empty_rank_still_steps():
    model, tok = build_policy(TINY)
    cfg = GRPOConfig.model_validate({"learner": {"device": "cpu", "threads": 1}})
    m = Learner(model, cfg).train_step([])
    assert m["loss_tokens"] == 0 and m["loss"] == 0
