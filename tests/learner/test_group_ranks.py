"""1 vs 2 learner ranks (real Ray actors over a gloo process group) give the same update."""
from __future__ import annotations

import pytest
import torch

from learner.config import PolicyConfig
from learner.grpo_config import GRPOConfig
from learner.group import RESERVED_PORTS, LearnerGroup, free_port
from learner.tokenizer import char_tokenizer
from learner.train_step import PackedBatch, synthetic_packed_batch

ray = pytest.importorskip("ray")

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=5)
VOCAB = len(char_tokenizer())


def config(ranks: int, aggregation: str) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "learner": {"device": "cpu", "threads": 1, "ranks": ranks},
        "loss": {"aggregation": aggregation, "entropy_coef": 0.01, "kl_coef": 0.05, "norm_len": 16},
        "optim": {"lr": 1e-2, "grad_clip": 0.5},
    })


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def steps(group: LearnerGroup, per_step: list[list[list]]) -> list[dict]:
    return [group.train_step(per_rank) for per_rank in per_step]


def test_free_port_avoids_reserved():
    port = free_port()
    assert port not in RESERVED_PORTS and 0 < port < 65536


def plan_two_ranks(root):
    """A real data plane with 12 trajectories in 3 groups and a 2-rank, 2-minibatch plan over it."""
    import numpy as np

    import dataplane

    rng = np.random.default_rng(0)
    recs = []
    for i in range(12):
        n = int(rng.integers(8, 24))
        recs.append(dataplane.TrajectoryRecord(
            id=f"t{i:02d}", run="r", domain="arith", prompt=f"p{i // 4}", group_id=f"g{i // 4}",
            tokens=rng.integers(0, VOCAB, n), loss_mask=(np.arange(n) >= 4).astype(np.uint8),
            logprobs=(-rng.random(n) * 3 - 3).astype(np.float32), reward=float(i % 3 == 0)))
    dp = dataplane.open(root / "catalog.db", root / "store")
    dp.put(recs)
    sel = dp.select(run="r")
    plan = dp.plan(sel, tokens_per_rank=64, ranks=2, seed=0, group_aware=True)
    advantages = {str(t): float(r) - 0.25 for t, r in zip(sel.ids, sel.reward)}
    both = [[pb for rank in range(2) for b in dataplane.loader(plan, rank=rank, minibatches=[m])
             if (pb := PackedBatch.from_dataplane(b, advantages)) is not None] for m in range(plan.num_minibatches)]
    return plan, advantages, both


def test_one_vs_two_ranks_same_update(ray_local, tmp_path):
    # Two steps; each step has four micro-batches of uneven sizes (ranks get unequal token counts).
    data = [[synthetic_packed_batch(VOCAB, lens, seed=10 * step + i)
             for i, lens in enumerate([[9, 14], [6, 11, 8], [12], [7, 7, 10]])] for step in range(2)]
    # Then the minibatches of a real 2-rank data-plane plan: each actor loads its own share.
    plan, advantages, both_ranks = plan_two_ranks(tmp_path)
    assert plan.num_minibatches >= 2
    # seq-mean-token-mean: sequences must be counted globally, the harder aggregation to get right.
    agg = "seq-mean-token-mean"
    one = LearnerGroup(config(1, agg), TINY, dtype="float64")
    first_weights = one.weights()
    m1 = steps(one, [[mbs] for mbs in data]) + [one.train_step([mbs]) for mbs in both_ranks]
    w1 = one.weights()
    one.close()
    two = LearnerGroup(config(2, agg), TINY, dtype="float64")
    m2 = steps(two, [[mbs[:1], mbs[1:]] for mbs in data])
    m2 += [two.train_plan_step(plan, m, advantages) for m in range(plan.num_minibatches)]
    w2 = two.weights()
    w2_rank1 = ray.get(two.actors[1].weights.remote())
    two.close()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-9, atol=1e-12, msg=k)
        torch.testing.assert_close(w2_rank1[k], w2[k], rtol=0, atol=0, msg=k)  # replicas stay identical
    assert len(m1) == len(m2) == 2 + plan.num_minibatches
    for a, b in zip(m1, m2):
        for key in ("loss", "grad_norm", "clip_frac", "entropy", "kl_ref", "loss_tokens", "seqs", "tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-8, abs=1e-12), key
    assert any(w1[k].ne(w0).any() for k, w0 in first_weights.items())  # the steps moved the weights


def test_dead_rank_fails_fast_with_a_clear_error(ray_local):
    group = LearnerGroup(config(2, "token-mean"), TINY)
    batch = synthetic_packed_batch(VOCAB, [9, 12], seed=0)
    group.train_step([[batch], [batch]])
    ray.kill(group.actors[1])
    with pytest.raises(RuntimeError, match="learner rank died"):
        group.train_step([[batch], [batch]])
    group.close()


@pytest.mark.slow
def test_two_rank_resume_matches_uninterrupted(ray_local, tmp_path):
    batches = [synthetic_packed_batch(VOCAB, [9, 14, 6], seed=s) for s in range(3)]

    def run(group, steps):
        out = []
        for b in steps:
            m = group.train_step([[b.select(0, 1)], [b.select(1, 3)]])
            m.pop("step_time_s"), m.pop("tokens_per_s")
            out.append(m)
        return out

    straight = LearnerGroup(config(2, "token-mean"), TINY)
    want, want_w = run(straight, batches), straight.weights()
    straight.close()
    first = LearnerGroup(config(2, "token-mean"), TINY)
    got = run(first, batches[:1])
    first.save_checkpoint(tmp_path / "ckpt", iteration=1)
    first.close()
    resumed = LearnerGroup(config(2, "token-mean"), TINY)
    assert resumed.load_checkpoint(tmp_path / "ckpt")["world_size"] == 2
    got += run(resumed, batches[1:])
    w = resumed.weights()
    resumed.close()
    assert got == want
    for k in want_w:
        assert torch.equal(w[k], want_w[k]), k


def test_bad_policy_fails_the_group_without_hanging(ray_local, tmp_path):
    with pytest.raises(Exception, match="expected an HF checkpoint directory"):
        LearnerGroup(config(2, "token-mean"), str(tmp_path / "missing"))
