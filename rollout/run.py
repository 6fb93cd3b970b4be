"""One `postrain rollout` run: N episodes of a domain through the pool, into the data plane, with a report.

Trajectory ids and sampling follow from the run seed, so two runs of the same command produce the
same trajectories (`token_hash` per trajectory), with or without injected faults.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import rewards
from core.atomic import write_atomic
from core.errors import UserError
from core.hf import resolve_checkpoint
from rollout.config import RolloutConfig
from core.rundir import SERVICES_DIR
from rollout.sampling import SamplingParams
from rollout.types import Request


def requests_for(domain: str, n: int, cfg: RolloutConfig) -> list[Request]:
    d = rewards.domain(domain)
    s = cfg.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                            stop=("</call>",) if d.uses_tools else ())
    prompts = d.prompts("train", n, cfg.pool.seed)
    return [Request(f"{domain}-{cfg.pool.seed}-{i:06d}", domain, p, params) for i, p in enumerate(prompts)]


def rollout_run(cfg: RolloutConfig, checkpoint: str | Path, domain: str, n: int, out: str | Path,
                observer=None, spares: int = 0, quiet: bool = False, catalog: str = "", store: str = "") -> dict:
    """`observer(pool)` is called after every round of the pool (fault injection drives the pool's hooks
    from there); when it has `finish(pool)` and `summary()`, its summary goes into the report as `chaos`.
    `catalog` / `store`: the data plane (a PostgreSQL URL, a pyarrow.fs URI); empty = in `out`."""
    from core.progress import progress
    from rollout.pool import RolloutPool
    from rollout.sink import DataPlaneSink

    out = Path(out)
    if out.exists() and any(p.name != SERVICES_DIR for p in out.iterdir()):
        raise UserError(f"rollout: output directory {out} is not empty; pick a fresh --out (its WAL would resume an old run)")
    checkpoint = resolve_checkpoint(checkpoint)
    try:
        dom = rewards.domain(domain)
    except rewards.UnknownDomain as exc:
        raise UserError(str(exc)) from None
    from core.rundir import RunDir

    rd = RunDir(out)
    rd.save_config(cfg)
    requests = requests_for(domain, n, cfg)
    sink = DataPlaneSink(catalog or str(out / "catalog.db"), store or str(out / "store"), run=out.name)
    t0 = time.monotonic()
    # Ray prints worker-death notices on stdout; keep stdout for the report (`--json`)
    with progress("rollout", len(requests), quiet=quiet) as advance, contextlib.redirect_stdout(sys.stderr):
        pool = RolloutPool(checkpoint, out, cfg.pool, cfg.engine, sink=sink, max_tool_calls=cfg.sampling.max_tool_calls,
                           use_tools=dom.uses_tools, progress=lambda k: advance(k), spares=spares)
        try:
            res = pool.run(requests, observer)
            if hasattr(observer, "finish"):
                observer.finish(pool)
        finally:
            pool.close()
    wall = time.monotonic() - t0
    c = res.counters
    chaos = observer.summary() if hasattr(observer, "summary") else None
    trajs = [{"id": r.traj_id, "length": len(res.finished[r.traj_id].tokens), "reward": res.finished[r.traj_id].reward,
              "token_hash": res.finished[r.traj_id].token_hash} for r in requests if r.traj_id in res.finished]
    report = {
        "domain": domain, "n": n, "workers": cfg.pool.workers, "seed": cfg.pool.seed,
        "completed": len(trajs), "completion_rate": len(trajs) / max(1, n),
        "mean_reward": sum(t["reward"] for t in trajs) / max(1, len(trajs)),
        "trajectories": trajs,
        "chaos": chaos,
        "faults_injected": (chaos or {}).get("injected", {}),
        "resumes": {"kv_restore": c["kv_restore"], "reprefill": c["reprefill"], "complete": c["resumed_complete"]},
        "snapshots": {"written": c["snapshots_written"], "failed": c["snapshots_failed"]},
        "snapshot_rejected": {k.removeprefix("snapshot_"): v for k, v in c.items()
                              if k.startswith("snapshot_")},
        "tokens_lost": res.tokens_lost, "tokens_resampled": res.tokens_resampled,
        "tool_calls": {"executed": c["tool_executed"], "recorded": c["tool_recorded"]},
        "tokens_committed": c["tokens_committed"], "replacements": res.replacements, "wall_s": round(wall, 3),
        "worker_nodes": {str(k): v for k, v in res.worker_nodes.items()},
    }
    write_atomic(out / "report.json", json.dumps(report, indent=2).encode())
    for i, t in enumerate(trajs):  # per-trajectory metrics (seed order) and their plot next to the report
        rd.log(trajectory=i, length=t["length"], reward=t["reward"])
    rd.log(summary=True, **{k: v for k, v in report.items() if isinstance(v, (int, float)) and v is not None})
    rd.plot("trajectory", ["length", "reward"], "rollout.png", title=f"rollout {domain}: {len(trajs)}/{n} complete")
    return report
