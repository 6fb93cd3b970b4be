"""DataPlane end to end: a plan reads only the shards it names; OPD order by teacher; epochs differ but
cover the same tokens."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .conftest import make_records


def test_loader_touches_only_the_planned_shards(sqlite_dp):
    sqlite_dp.put(make_records(30, run="keep"))
    sqlite_dp.put(make_records(30, run="other", id_prefix="o"))
    plan = sqlite_dp.plan(tokens_per_rank=700, ranks=2, run="keep")
    assert set(plan.shard_paths) == {p for p in sqlite_dp.store.list() if "/keep/" in p}
    for rel in sqlite_dp.store.list():  # the other run's bytes are gone: the plan must not need them
        if "/other/" in rel:
            Path(sqlite_dp.store.full_path(rel)).unlink()
    got = sum(b.num_tokens for r in (0, 1) for b in sqlite_dp.loader(plan, rank=r))
    assert got == plan.num_tokens == sum(r.length for r in make_records(30, run="keep"))


def test_minibatches_follow_teacher_order(sqlite_dp):
    sqlite_dp.put(make_records(80, domains=("arith", "reverse", "calc")))
    plan = sqlite_dp.plan(tokens_per_rank=600, ranks=2, seed=5, by_teacher=True)
    order = {name: i for i, name in enumerate(plan.teachers)}
    per_mb = []
    for m in range(plan.num_minibatches):
        names = {plan.teachers[plan.teacher[k]] for r in range(plan.ranks) for k in plan.seg_traj[plan.bin(m, r)]}
        per_mb.append(sorted(order[n] for n in names))
    for a, b in zip(per_mb, per_mb[1:]):
        assert a[-1] <= b[0]  # one teacher at a time: a minibatch never goes back to an earlier teacher
    assert sum(len(set(x)) for x in per_mb) < plan.num_minibatches + len(plan.teachers)


def test_epochs_reshuffle_the_same_tokens(sqlite_dp):
    sqlite_dp.put(make_records(60))
    a = sqlite_dp.plan(tokens_per_rank=500, epoch=0)
    b = sqlite_dp.plan(tokens_per_rank=500, epoch=1)
    assert not np.array_equal(a.seg_traj, b.seg_traj)
    assert a.num_tokens == b.num_tokens and sorted(a.seg_traj.tolist()) == sorted(b.seg_traj.tolist())
