"""node-loss: a Ray worker node killed mid-rollout on a real multi-node cluster on this machine.

A head (GCS, no CPUs) and two worker nodes, each its own raylet (`rollout.local_cluster`); the WAL
is a service on the head node, as on a cluster. A pool of two workers (one CPU each, SPREAD: one
per worker node) rolls out batches of arith requests; in each batch one fault, scheduled on observed
progress, kills the node of a worker that holds requests in flight: SIGKILL of its raylet and every
process under it, by pid, as a machine failure would. The pool must replace the lost workers on a
surviving node and resume their requests from the WAL: every trajectory completes with the token
hashes of the same requests decoded uninterrupted in one process, no committed token lost, none
sampled twice. A fresh worker node joins between batches, so each fault again has a node to take.

Recovery time: from the kill until every trajectory the lost worker held has shown a committed
token reported by its replacement (`chaos.pool_faults`); it includes the cluster noticing the
dead node and the replacement's start.

It joins its own cluster, so it runs before any drill that starts a local Ray in this process, and
leaves Ray shut down.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

from chaos.drill import DrillContext, DrillResult, Event
from chaos.pool_faults import PoolInjector
from chaos.rollout_drills import reference_hashes, rollout_requests, tiny_checkpoint
from chaos.schedule import schedule

KIND = "node_loss"
WORKERS = 2
TOKEN = "node-loss-drill-token"


def node_loss(ctx: DrillContext, faults: int) -> DrillResult:
    import ray

    from rollout.local_cluster import LocalCluster

    if ray.is_initialized():
        raise RuntimeError("node-loss joins its own multi-node cluster; it must run before the drills that start "
                           "a local Ray in this process (run it alone or in catalog order)")
    checkpoint = tiny_checkpoint(ctx)
    t0 = time.monotonic()
    cluster = LocalCluster(workers=2, cpus_per_worker=2, dashboard=False)
    try:
        start_s = time.monotonic() - t0
        out = _drill(ctx, cluster, checkpoint, faults)
        out.detail["cluster_start_s"] = round(start_s, 3)
        out.detail["pool_start_s"] = ctx.cache.pop("node_loss_pool_start_s", None)
        return out
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


def _drill(ctx: DrillContext, cluster, checkpoint: str, faults: int) -> DrillResult:
    from rollout.config import EngineConfig, PoolConfig
    from rollout.pool import RolloutPool
    from rollout.ray_cluster import init_ray
    from rollout.services import Services

    init_ray(cluster.address)
    services = Services()
    run_dir = ctx.work("node-loss")
    os.environ["POSTRAIN_WAL_TOKEN"] = TOKEN
    try:
        wal_addr = services.start_wal(run_dir / "wal", 1, cluster.head_node_id, TOKEN)[0]
        cfg = PoolConfig(workers=WORKERS, worker_cpus=1, worker_strategy="SPREAD", wal_addr=wal_addr, steps_per_call=2,
                         seed=ctx.seed, max_replacements=100_000, call_timeout_s=120)
        t0 = time.monotonic()
        pool = RolloutPool(checkpoint, run_dir, cfg, EngineConfig(max_batch=4, strict=True), use_tools=False)
        ctx.cache["node_loss_pool_start_s"] = round(time.monotonic() - t0, 3)
        try:
            return _batches(ctx, cluster, pool, faults)
        finally:
            pool.close()
    finally:
        services.close()
        os.environ.pop("POSTRAIN_WAL_TOKEN", None)


def _batches(ctx: DrillContext, cluster, pool, faults: int) -> DrillResult:
    """One batch per fault: the fault kills a worker's node, then a fresh node joins for the next one."""
    out = DrillResult("node-loss", {KIND: faults})
    first_nodes = [pool.worker_node(k) for k in range(WORKERS)]
    killed: list[str] = []
    held: list[int] = []
    nodes: list[dict] = []  # per batch: slot -> node of each incarnation it ran on

    def kill_node(node_id: str) -> None:
        on_it = [k for k in range(WORKERS) if pool.worker_node(k) == node_id]
        held.append(sum(pool.seen(t) for k in on_it for t in pool.in_flight(k)))  # committed positions it held
        killed.append(node_id)
        cluster.remove_worker(cluster.worker_node_ids.index(node_id))

    n = 4 + 2 * WORKERS
    finished, calm, landed = {}, {}, []  # landed: per replacement, whether it runs on a node that survived
    # mid-decode: the worker has reported committed tokens before its node goes (2 rounds more than the schedule's gap)
    plan = [replace(f, gap=f.gap + 2) for f in schedule(ctx.seed, WORKERS, faults, kinds=(KIND,))]
    t0 = time.monotonic()
    for b, fault in enumerate(plan):
        requests = rollout_requests(f"node-loss-b{b}", n)
        calm.update(reference_hashes(ctx, requests))
        injector = PoolInjector([fault], seed=ctx.seed + b, kill_node=kill_node, mid_decode=True)
        incarnations = [pool.incarnation(k) for k in range(WORKERS)]
        t_batch = time.monotonic()
        res = pool.run(requests, injector)
        out.wall_s += time.monotonic() - t_batch
        injector.finish(pool)
        finished.update({t: f.token_hash for t, f in res.finished.items()})
        out.tokens_lost += res.tokens_lost
        out.tokens_resampled += res.tokens_resampled
        offset = t_batch - t0
        out.events += [Event(e.kind, round(offset + e.t_s, 6), e.recovery_s) for e in injector.events]
        if not injector.events:
            out.shortfall = injector.shortfall()
            break
        # every worker that lived on the killed node came back on another one
        gone = set(killed[-len(injector.events):])  # the node this batch's fault killed
        landed += [res.worker_nodes[k][-1] not in gone for k in range(WORKERS) if pool.incarnation(k) > incarnations[k]]
        nodes.append({str(k): v[incarnations[k] - 1:] for k, v in res.worker_nodes.items()})
        if b + 1 < len(plan):
            cluster.add_worker()
    out.completed, out.calm_completed = len(finished), len(calm)
    out.hashes_equal = finished == calm
    out.checks["the two workers started on the two worker nodes"] = len(set(first_nodes)) == WORKERS
    out.checks["each lost node held committed tokens of the killed worker"] = len(held) == len(out.events) and all(held)
    out.checks["every lost worker replaced on a surviving node"] = bool(landed) and all(landed)
    out.detail = {"trajectories": len(finished), "batches": len(plan), "nodes_killed": len(killed),
                  "replacements": pool.replacements, "committed_positions_at_each_kill": held,
                  "killed_nodes": killed, "worker_nodes_per_batch": nodes}
    return out
