"""Rollout drills: faults on real Ray rollout workers through the pool's hooks (`chaos.pool_faults`).

Each drill rolls out batches of arith requests on a tiny policy built from config, through one pool
that the rollout drills share, under faults of one kind, until every fault has fired; the same requests are decoded uninterrupted in one
process for the reference hashes, and the same amount of work runs calm on the pool for the wall-time
baseline. The faulted run must complete every trajectory with the reference's token hashes, lose no committed token and sample none twice, and recover the way its kind promises:

    rollout-preempt   the worker suspends its requests to KV snapshots and resumes them itself
                      (no replacement; every resume restores the snapshot, none re-prefills)
    snapshot-corrupt  preempt, then flip a bit in the snapshots: the checksum rejects them, re-prefill
    snapshot-delete   preempt, then delete the snapshots: re-prefill from the WAL
    actor-kill        ray.kill of the actor: a warm spare takes the slot and resumes from the WAL
    worker-sigkill    SIGKILL of the worker process: the same

A kill waits until the pool holds a warm spare: the drill measures a replacement with the spare
capacity it sizes, failures no closer together than a spare's start-up.
"""
from __future__ import annotations

import time

from chaos.drill import DrillContext, DrillResult, Event
from chaos.pool_faults import PoolInjector
from chaos.schedule import schedule

KIND = {"rollout-preempt": "preempt", "snapshot-corrupt": "snapshot_corrupt", "snapshot-delete": "snapshot_delete",
        "actor-kill": "actor_kill", "worker-sigkill": "sigkill"}
WORKERS = 2


def tiny_checkpoint(ctx: DrillContext) -> str:
    """A tiny Qwen2-architecture policy with seeded random weights (no download), built once per run."""
    if "checkpoint" not in ctx.cache:
        import torch

        from core.hf import save_policy
        from learner.config import PolicyConfig
        from learner.policy import build_policy

        torch.manual_seed(ctx.seed)
        cfg = PolicyConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                           max_positions=256, seed=ctx.seed)
        path = ctx.work("policy")
        save_policy(*build_policy(cfg), path)
        ctx.cache["checkpoint"] = str(path)
    return ctx.cache["checkpoint"]


def rollout_requests(prefix: str, n: int):
    from rollout.sampling import SamplingParams
    from rollout.types import Request

    params = SamplingParams(max_new_tokens=40)
    return [Request(f"{prefix}-{i:05d}", "arith", f"add {i * 13 % 97}+{i * 7 % 89}=", params) for i in range(n)]


def _pool(ctx: DrillContext):
    """One pool (two workers, two warm spares) for every rollout drill of the run; each drill rolls out
    its own trajectory ids through it."""
    if "rollout_pool" not in ctx.cache:
        from rollout.config import EngineConfig, PoolConfig
        from rollout.pool import RolloutPool

        cfg = PoolConfig(workers=WORKERS, steps_per_call=2, seed=ctx.seed, max_replacements=100_000, call_timeout_s=120)
        pool = RolloutPool(tiny_checkpoint(ctx), ctx.work("rollout-pool"), cfg, EngineConfig(max_batch=4, strict=True),
                           use_tools=False, spares=2)
        ctx.cache["rollout_pool"] = pool
        ctx.closers.append(pool.close)
    return ctx.cache["rollout_pool"]


def _run(ctx: DrillContext, requests, injector=None):
    """A pool run; its counters are this run's (the pool's are cumulative)."""
    from collections import Counter

    pool = _pool(ctx)
    before, replaced = Counter(pool.counters()), pool.replacements
    t0 = time.monotonic()
    res = pool.run(requests, injector)
    wall = time.monotonic() - t0
    if injector is not None:
        injector.finish(pool)
    counters = Counter(res.counters)
    counters.subtract(before)
    return res, counters, res.replacements - replaced, wall


def _calm_wall(ctx: DrillContext, n: int) -> float:
    """Wall time of the same amount of work without faults, on the same pool."""
    key = ("rollout-calm", n)
    if key not in ctx.cache:
        ctx.cache[key] = _run(ctx, rollout_requests(f"calm{n}", n))[3]
    return ctx.cache[key]


def reference_hashes(ctx: DrillContext, requests) -> dict[str, str]:
    """Token hash of every trajectory decoded uninterrupted, in one process (strict decode is batch-invariant)."""
    from rollout.config import EngineConfig
    from rollout.worker import RolloutWorker, WorkerSpec

    d = ctx.work("rollout-reference") / requests[0].traj_id
    w = RolloutWorker(WorkerSpec("calm", tiny_checkpoint(ctx), str(d / "wal"), str(d / "kv"), seed=ctx.seed,
                                 engine=EngineConfig(max_batch=8, strict=True)))
    w.submit(requests)
    out = {}
    try:
        while True:
            rep = w.run(16)
            out.update({f.traj_id: f.token_hash for f in rep.finished})
            w.finalize([f.traj_id for f in rep.finished])
            if rep.idle:
                return out
    finally:
        w.close()


def _wait_for_spares(ctx: DrillContext, timeout_s: float = 300.0) -> None:
    """Before a kill drill: the pool's spares are up (a replacement's cost is then what the drill measures)."""
    pool = _pool(ctx)
    deadline = time.monotonic() + timeout_s
    while pool.warm_spares() < pool.spares and time.monotonic() < deadline:
        time.sleep(0.05)


def run_rollout_drill(ctx: DrillContext, name: str, faults: int) -> DrillResult:
    """Batches of `n` requests through the pool until every fault has fired (at most `faults` + 1 batches):
    a kill waits for a warm spare, and a batch may end before the next spare is up."""
    from collections import Counter

    kind = KIND[name]
    n = 4 + 2 * faults
    calm_wall = _calm_wall(ctx, n)
    kills = kind not in ("preempt", "snapshot_corrupt", "snapshot_delete")
    if kills:
        _wait_for_spares(ctx)
    injector = PoolInjector(schedule(ctx.seed, WORKERS, faults, kinds=(kind,)), seed=ctx.seed, wait_for_spare=kills)
    out = DrillResult(name, {kind: faults})
    c, replacements, finished, calm, batches = Counter(), 0, {}, {}, 0
    out.wall_s = out.calm_wall_s = 0.0
    while injector.injected < faults and batches <= faults:
        requests = rollout_requests(f"{name}-b{batches}", n)
        calm.update(reference_hashes(ctx, requests))
        res, counters, replaced, wall = _run(ctx, requests, injector)
        c.update(counters)
        replacements += replaced
        finished.update({t: f.token_hash for t, f in res.finished.items()})
        out.tokens_lost += res.tokens_lost
        out.tokens_resampled += res.tokens_resampled
        out.wall_s += wall
        out.calm_wall_s += calm_wall
        batches += 1
    out.shortfall = injector.shortfall()
    out.events = [Event(e.kind, e.t_s, e.recovery_s) for e in injector.events]
    out.completed, out.calm_completed = len(finished), len(calm)
    out.hashes_equal = finished == calm
    out.detail = {"trajectories": n * batches, "batches": batches, "replacements": replacements,
                  "rounds_a_kill_waited_for_a_warm_spare": injector.spare_waits, "suspended": c["suspended"],
                  "kv_restore": c["kv_restore"], "reprefill": c["reprefill"],
                  "snapshot_rejected": {k.removeprefix("snapshot_"): v for k, v in c.items()
                                        if k.startswith("snapshot_")},
                  "tokens_committed": c["tokens_committed"]}
    if kind == "preempt":
        out.checks["preemption keeps the worker (no replacement)"] = replacements == 0
        out.checks["every preempted request resumed from its KV snapshot"] = c["reprefill"] == 0 and c["kv_restore"] >= faults
    elif kind == "snapshot_corrupt":
        rejected = sum(v for k, v in out.detail["snapshot_rejected"].items() if k != "missing")
        # a split resume (accelerator, cold snapshot, two blocks or more) reads only the blocks after its split,
        # each checked: damage before the split is never read, and the head is re-prefilled from the WAL
        split = c["kv_restore_split"]
        out.detail["kv_restore_split"] = split
        out.checks["every damaged snapshot rejected (or, split, only its checked blocks used), re-prefilled from "
                   "the WAL"] = rejected + split >= faults and c["kv_restore"] == split
    elif kind == "snapshot_delete":
        out.checks["every deleted snapshot missed, re-prefilled from the WAL"] = (c["snapshot_missing"] >= faults
                                                                                 and c["kv_restore"] == 0)
    else:
        out.checks["each killed worker replaced once"] = replacements == len(injector.events)
    return out
