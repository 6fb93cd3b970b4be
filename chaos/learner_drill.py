"""learner-kill: `postrain grpo` (the driver that holds the learner) is SIGKILLed mid-iteration, then
run again with `--resume`; its training metrics must equal those of the same run left alone.

Setup (once per drill run): a tiny policy after a short SFT on `reverse` (sampled groups then have
reward variance, so the learner takes real steps), and the calm run of the same GRPO command. Each
fault starts the command in a fresh directory, waits until its first checkpoint is durable and a
seeded extra moment, SIGKILLs it (its whole process group: Ray workers die with it), and resumes it
to the end. Recovery: the wall time of the resumed run.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from chaos.drill import DrillContext, DrillResult, Event

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 3
SFT = ["policy.hidden_size=64", "policy.num_layers=2", "policy.intermediate_size=128", "sft.domains=[\"reverse\"]",
       "sft.threads=1", "sft.lr=3e-3", "sft.batch_size=32", "sft.warmup_steps=20", "sft.seed=0", "policy.seed=0",
       "sft.log_every=50"]
GRPO = ["sampling.max_new_tokens=12", "eval.max_new_tokens=12", "eval.n=16", "learner.threads=1", "learner.device=cpu",
        "pool.workers=1", "loop.eval_every=0", "loop.checkpoint_every=1"]
# learning metrics of a train row that a resumed run must repeat exactly (timing and pool counters differ)
COMPARED = ("iteration", "policy_version", "reward_mean", "solve_rate", "length_mean", "groups", "zero_variance_groups",
            "loss", "grad_norm", "lr", "optimizer_step", "optimizer_steps", "trained_trajectories", "tokens", "loss_tokens")


def _sets(kvs: list[str]) -> list[str]:
    return [a for kv in kvs for a in ("--set", kv)]


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def _finish(p: subprocess.Popen, what: str) -> None:
    _, err = p.communicate(timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}): {err[-1500:]}")


def _train_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: r[k] for k in COMPARED if k in r} for r in rows if r.get("stage") == "train"]


def learner_kill(ctx: DrillContext, n: int) -> DrillResult:
    res = DrillResult("learner-kill", {"learner_sigkill": n})
    rng = random.Random(ctx.seed + 23)
    work = ctx.work("learner-kill")
    base = work / "base"
    if not (base / "final").is_dir():
        _finish(_cli("sft", "--out", str(base), "--steps", "200", "--quiet", *_sets(SFT)), "postrain sft")
    grpo = ["grpo", "--domain", "reverse", "--init", str(base), "--iterations", str(ITERATIONS), "--quiet", *_sets(GRPO)]
    calm = work / "calm"
    if not (calm / "final").is_dir():
        _finish(_cli(*grpo, "--out", str(calm)), "postrain grpo (calm)")
    want = _train_rows(calm)
    t0 = time.monotonic()
    equal = 0
    for trial in range(n):
        out = work / f"killed-{trial}"
        p = _cli(*grpo, "--out", str(out))
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "latest").is_file() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is not None:  # finished (or failed) before it could be killed: no fault
            p.communicate()
            continue
        time.sleep(rng.random() * 1.5)  # somewhere in a later iteration: rollout, training, publish or checkpoint
        if p.poll() is not None:
            p.communicate()
            continue
        t_kill = time.monotonic()
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        _finish(_cli(*grpo, "--out", str(out), "--resume"), "postrain grpo --resume")
        same = _train_rows(out) == want
        equal += same
        res.events.append(Event("learner_sigkill", t_kill - t0, round(time.monotonic() - t_kill, 3) if same else None))
    res.wall_s = time.monotonic() - t0
    if len(res.events) < n:
        res.shortfall = f"{n - len(res.events)} runs finished before they could be killed"
    res.completed = sum(1 for e in res.events if e.recovery_s is not None)
    res.detail = {"iterations": ITERATIONS, "compared": list(COMPARED), "calm_rows": len(want)}
    res.checks["metrics of every resumed run equal the uninterrupted run's"] = equal == len(res.events)
    return res
