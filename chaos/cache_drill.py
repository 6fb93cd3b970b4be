"""teacher-cache-corrupt: a bit flipped in a teacher hidden-state shard of the OPD cache.

The cache of one batch (a tiny teacher's last-layer states of seeded trajectories, in a real data
plane) is written in several shards. Each fault flips one bit of one shard file. Before the batch is
trained on, `distill.prefill.damaged_rows` must name exactly the rows of that shard; they are deleted
and `fill_cache` recomputes exactly those; reading every row back (checksums verified) gives states
bitwise equal to an uninterrupted prefill's.
"""
from __future__ import annotations

import random
import time

import numpy as np

from chaos.drill import DrillContext, DrillResult, Event
from chaos.files import flip_bit

BATCH, ROWS, CHUNK = "b000", 12, 2


def _states(dp, run: str, field: str) -> dict[str, np.ndarray]:
    sel = dp.select(run=run, status=None)
    plan = dp.plan(sel, tokens_per_rank=max(1, sel.num_tokens), ranks=1)
    out = {}
    for b in dp.loader(plan, rank=0, prefetch=0, extras=[field]):
        cu = b.cu_seqlens.tolist()
        h = b.extras[field]
        for j, traj in enumerate(b.traj_ids):
            out[traj] = np.asarray(h[cu[j]:cu[j + 1]]).copy()
    return out


def teacher_cache_corrupt(ctx: DrillContext, n: int) -> DrillResult:
    import dataplane
    from chaos.rollout_drills import tiny_checkpoint
    from distill.cache import FIELD, cache_run
    from distill.prefill import Prefillers, Sampled, damaged_rows, fill_cache
    from distill.teachers import describe
    from rollout.types import token_hash

    res = DrillResult("teacher-cache-corrupt", {"teacher_cache_bitflip": n})
    rng = random.Random(ctx.seed + 17)
    nrng = np.random.default_rng(ctx.seed)
    work = ctx.work("teacher-cache-corrupt")
    teacher = describe("arith", 0, tiny_checkpoint(ctx), 1.0)
    sampled = []
    for i in range(ROWS):
        tokens = nrng.integers(3, teacher.vocab_size, int(nrng.integers(8, 48))).astype(np.int32)
        sampled.append(Sampled(f"t{i:03d}", "arith", f"p{i}", tokens, np.ones(len(tokens), np.uint8),
                               np.full(len(tokens), -0.5, np.float32), token_hash(tokens.tolist()), 0))
    prefill = Prefillers(0)
    dp = dataplane.open(str(work / "catalog.db"), str(work / "store"))
    run = cache_run(BATCH)
    wrong_rows = wrong_states = 0
    try:
        fill_cache(dp, BATCH, sampled, [teacher], prefill, run_id="drill", dtype="float32", chunk=CHUNK)
        reference = _states(dp, run, FIELD)
        t0 = time.monotonic()
        for _ in range(n):
            sel = dp.select(run=run, status=None)
            victim = sel.shard_paths[rng.randrange(len(sel.shard_paths))]
            rows = sorted(str(i) for i, s in zip(sel.ids, sel.shard) if sel.shard_paths[s] == victim)
            flip_bit(dp.store.full_path(victim), rng)
            t_fault = time.monotonic()
            bad = sorted(damaged_rows(dp, run))
            dp.delete(bad)
            computed = fill_cache(dp, BATCH, sampled, [teacher], prefill, run_id="drill", dtype="float32",
                                  chunk=CHUNK)["cache_rows_computed"]
            got = _states(dp, run, FIELD)
            t_back = time.monotonic()
            wrong_rows += bad != rows or computed != len(rows)
            wrong_states += sum(1 for k, v in reference.items() if k not in got or not np.array_equal(v, got[k]))
            ok = bad == rows and computed == len(rows) and got.keys() == reference.keys() and not wrong_states
            res.events.append(Event("teacher_cache_bitflip", t_fault - t0, round(t_back - t_fault, 6) if ok else None))
        res.wall_s = time.monotonic() - t0
    finally:
        dp.close()
    res.detail = {"rows": ROWS, "rows_per_shard": CHUNK, "hidden_size": teacher.hidden_size}
    res.checks["exactly the damaged shard's rows detected and recomputed"] = wrong_rows == 0
    res.checks["recomputed states bitwise equal to the first prefill's"] = wrong_states == 0
    return res
