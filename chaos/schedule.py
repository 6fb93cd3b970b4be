"""Seeded fault schedules (pure): which fault, on which worker, after how many rounds of progress.

A fault is not pinned to a token position or a wall-clock time, which a short run may never reach:
it waits `gap` rounds of the pool after the previous one and then fires on the first round where a
worker holds requests in flight, so every fault of the schedule fires as long as the run has rounds
left. A run that ends first reports the faults it could not inject, and the drill fails.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# rollout fault kinds, in the order a drill report lists them
ROLLOUT_KINDS = ("preempt", "snapshot_corrupt", "snapshot_delete", "actor_kill", "sigkill")
# faults that need more than the pool: a multi-node cluster to take a node from (the node-loss drill)
CLUSTER_KINDS = ("node_loss",)


@dataclass(frozen=True)
class Fault:
    kind: str
    slot: int  # preferred worker; another one with requests in flight when it has none
    gap: int  # rounds of the pool to let pass after the previous fault (0: the next round)


def schedule(seed: int, workers: int, faults: int, kinds: tuple[str, ...] = ROLLOUT_KINDS,
             max_gap: int = 1) -> list[Fault]:
    """`faults` faults; every kind once per block of len(kinds), shuffled within the block."""
    if workers < 1 or faults < 0 or not kinds or max_gap < 0:
        raise ValueError(f"fault schedule needs workers >= 1, faults >= 0, kinds and max_gap >= 0 "
                         f"(got {workers}, {faults}, {kinds}, {max_gap})")
    unknown = set(kinds) - set(ROLLOUT_KINDS) - set(CLUSTER_KINDS)
    if unknown:
        raise ValueError(f"unknown rollout fault kinds {sorted(unknown)}; known: {', '.join(ROLLOUT_KINDS + CLUSTER_KINDS)}")
    rng = random.Random(seed)
    out: list[Fault] = []
    while len(out) < faults:
        block = list(kinds)
        rng.shuffle(block)
        out += [Fault(k, rng.randrange(workers), rng.randint(0, max_gap)) for k in block]
    return out[:faults]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of `values`; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))
    return s[int(k)]
