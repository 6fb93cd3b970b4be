"""The metrics row of one iteration's rollouts, shared by the GRPO and OPD loops (and the chaos check)."""
from __future__ import annotations

import time

from core.errors import UserError


def rollout_row(verb: str, k: int, n_requests: int, res, before: int, t0: float, injector, pool) -> dict:
    """Rollout time, completions, faults and token accounting of iteration k; every request must have
    finished, and a --chaos run must have injected every fault it was asked for."""
    if len(res.finished) != n_requests:
        raise RuntimeError(f"{verb}: iteration {k}: {len(res.finished)} of {n_requests} rollouts finished")
    row = {"rollout_s": round(time.monotonic() - t0, 3), "completed": len(res.finished), "faults": 0,
           "replacements": res.replacements - before, "tokens_lost": res.tokens_lost,
           "tokens_resampled": res.tokens_resampled}
    if injector is not None:
        injector.finish(pool)
        if injector.shortfall():
            raise UserError(f"{verb} --chaos: iteration {k}: {injector.shortfall()} (loop.chaos_faults)")
        rec = [e.recovery_s for e in injector.events if e.recovery_s is not None]
        row |= {"faults": injector.injected, "faults_survived": len(rec),
                "recovery_s_max": round(max(rec), 4) if rec else 0.0}
    return row
