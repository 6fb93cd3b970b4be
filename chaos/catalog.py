"""The drill catalog: name -> what it does and the function that runs it. Order is run order (the WAL
drills fork writer processes, learner-kill starts a local Ray for its `postrain grpo` runs and shuts
it down, node-loss joins its own multi-node cluster, so they run before this process starts Ray for
the rollout drills). `fast_faults`: faults per kind of the drill's fast variant (`postrain drill
--fast`, the default test suite's run of every drill)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from chaos import (cache_drill, catalog_drill, disk_drill, learner_drill, node_loss_drill, rollout_drills, sandbox_drill,
                   wal_drills, wal_service_drill)
from chaos.drill import DrillContext, DrillResult


@dataclass(frozen=True)
class Drill:
    name: str
    what: str
    run: Callable[[DrillContext, int], DrillResult]  # (context, faults to inject)
    default_faults: int
    fast_faults: int = 2


def _rollout(name: str) -> Callable[[DrillContext, int], DrillResult]:
    return lambda ctx, n: rollout_drills.run_rollout_drill(ctx, name, n)


DRILLS = {d.name: d for d in [
    Drill("wal-kill", "SIGKILL of WAL writer processes at random points; every acknowledged token kept", wal_drills.wal_kill, 400),
    Drill("wal-torn", "the last flush of a log torn as a power cut leaves it; the log opens, earlier tokens kept", wal_drills.wal_torn, 200),
    Drill("wal-bitflip", "one bit of committed log data flipped; the log is refused, never skipped", wal_drills.wal_bitflip, 200),
    Drill("wal-service-kill", "SIGKILL of `postrain wal serve` mid-stream, then a restart; the client reconnects, "
          "nothing acknowledged lost, nothing written twice", wal_service_drill.wal_service_kill, 12),
    Drill("disk-full", "ENOSPC on the WAL and data-plane directories (a size-capped tmpfs); one clear error, "
          "nothing acknowledged lost, writing resumes when space returns", disk_drill.disk_full, 30),
    Drill("catalog-drop", "PostgreSQL backends terminated mid-put, SQLite writers SIGKILLed mid-transaction; nothing half-visible",
          catalog_drill.catalog_drop, 40),
    Drill("sandbox-kill", "the sandbox service SIGKILLed during a non-idempotent tool call; the call runs at most once, "
          "a returned result exactly once", sandbox_drill.sandbox_kill, 15),
    Drill("teacher-cache-corrupt", "a bit flipped in a teacher hidden-state shard of the OPD cache; the damaged rows "
          "are detected and recomputed, bitwise equal", cache_drill.teacher_cache_corrupt, 60),
    Drill("learner-kill", "SIGKILL of `postrain grpo` mid-iteration, then --resume; the training metrics equal the "
          "uninterrupted run's", learner_drill.learner_kill, 2, fast_faults=1),
    Drill("node-loss", "a worker node of a local multi-node Ray cluster killed mid-decode (its raylet and processes); "
          "the pool replaces its workers on a surviving node and resumes from the WAL", node_loss_drill.node_loss, 3,
          fast_faults=1),
    Drill("rollout-preempt", "requests preempted to KV snapshots, resumed on the same worker", _rollout("rollout-preempt"), 40),
    Drill("snapshot-corrupt", "preempted, then a bit of every snapshot flipped; re-prefill from the WAL", _rollout("snapshot-corrupt"), 30),
    Drill("snapshot-delete", "preempted, then the snapshots deleted; re-prefill from the WAL", _rollout("snapshot-delete"), 30),
    Drill("actor-kill", "ray.kill of rollout actors; a warm spare takes over and resumes from the WAL", _rollout("actor-kill"), 20),
    Drill("worker-sigkill", "SIGKILL of rollout worker processes; a warm spare takes over", _rollout("worker-sigkill"), 20),
]}
