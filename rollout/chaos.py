"""Seeded fault schedule for a rollout run: which fault, on which worker, at which pool iteration.

Kinds: `preempt` (graceful notice: snapshots written, then stop), `preempt_corrupt` / `preempt_delete`
(graceful, then the written snapshots are corrupted / deleted before the replacement resumes),
`ray_kill` (ray.kill of the actor), `sigkill` (SIGKILL to the worker process). Pure: the pool applies it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("preempt", "preempt_corrupt", "preempt_delete", "ray_kill", "sigkill")


@dataclass(frozen=True)
class Fault:
    iteration: int
    kind: str
    slot: int


def schedule(seed: int, workers: int, faults: int, first: int = 2, spacing: int = 3) -> list[Fault]:
    """`faults` faults, every kind at least once when faults >= len(KINDS), on seeded iterations and workers."""
    if workers < 1 or faults < 0:
        raise ValueError(f"chaos schedule needs workers >= 1 and faults >= 0 (got {workers}, {faults})")
    rng = random.Random(seed)
    kinds = []
    while len(kinds) < faults:
        block = list(KINDS)
        rng.shuffle(block)
        kinds += block
    out, it = [], first
    for kind in kinds[:faults]:
        it += rng.randint(1, spacing)
        out.append(Fault(it, kind, rng.randrange(workers)))
    return out
