"""learner-kill: `postrain grpo` (the driver that holds the learner) is SIGKILLed mid-iteration, then
run again with `--resume`; its training metrics must equal those of the same run left alone.

Setup (once per drill run): a tiny policy after a short SFT on `reverse`, trained in this process
(sampled groups then have reward variance, so the learner takes real steps). The calm run of the same
GRPO command runs alongside the first faulted one (the metrics compared are the seeded computation's,
not timings). Each fault starts the command in a fresh directory, waits until its first checkpoint is
durable and a seeded extra moment, SIGKILLs it (its whole process group), and resumes it to the end.
Recovery: the wall time of the resumed run.

The runs join one local Ray that the drill starts (`local_shared_ray`), as jobs on a cluster whose
Ray outlives their driver: a run pays a connection instead of a Ray start, the killed driver's
rollout actors are reaped by Ray (their owner died), and the resumed run's workers wait for the WAL
directory lock the dead ones held.
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
POLICY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)
SFT = dict(domains=["reverse"], steps=200, threads=1, lr=3e-3, batch_size=32, warmup_steps=20, seed=0, log_every=50)
GRPO = ["sampling.max_new_tokens=12", "eval.max_new_tokens=12", "eval.n=16", "learner.threads=1", "learner.device=cpu",
        "pool.workers=1", "loop.eval_every=0", "loop.checkpoint_every=1"]
# learning metrics of a train row that a resumed run must repeat exactly (timing and pool counters differ)
COMPARED = ("iteration", "policy_version", "reward_mean", "solve_rate", "length_mean", "groups", "zero_variance_groups",
            "loss", "grad_norm", "lr", "optimizer_step", "optimizer_steps", "trained_trajectories", "tokens", "loss_tokens")


def _sets(kvs: list[str]) -> list[str]:
    return [a for kv in kvs for a in ("--set", kv)]


def _cli(log: Path, *args: str) -> subprocess.Popen:
    """`postrain ARGS` in its own session (a kill of its group reaches it all), stderr to `log`."""
    with open(log, "ab") as err:
        return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)


def _finish(p: subprocess.Popen, what: str, log: Path) -> None:
    p.wait(timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}): {log.read_text(errors='replace')[-1500:]}")


def _train_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: r[k] for k in COMPARED if k in r} for r in rows if r.get("stage") == "train"]


def sft_base(path: Path) -> Path:
    """The drill's base policy: `SFT` steps of a `POLICY`-sized model on reverse, saved to `path`."""
    import torch

    from core.hf import save_policy
    from learner.config import PolicyConfig, SFTConfig
    from learner.policy import build_policy
    from learner.sft import train_sft

    if not (path / "config.json").is_file():
        threads = torch.get_num_threads()
        try:
            model, tok = build_policy(PolicyConfig(**POLICY))
            train_sft(model, tok, SFTConfig(**SFT))
        finally:
            torch.set_num_threads(threads)  # train_sft pins its own; the drills after it keep this process's
        save_policy(model, tok, path)
    return path


def learner_kill(ctx: DrillContext, n: int) -> DrillResult:
    from concurrent.futures import ThreadPoolExecutor

    from rollout.ray_cluster import local_shared_ray

    work = ctx.work("learner-kill")

    def base() -> tuple[Path, float]:
        t = time.monotonic()
        return sft_base(work / "base"), round(time.monotonic() - t, 3)

    with ThreadPoolExecutor(1, thread_name_prefix="sft") as pool:  # the base trains while Ray starts
        sft = pool.submit(base)
        with local_shared_ray(num_cpus=2):
            return _learner_kill(ctx, n, work, *sft.result())


def _learner_kill(ctx: DrillContext, n: int, work: Path, base: Path, sft_s: float) -> DrillResult:
    res = DrillResult("learner-kill", {"learner_sigkill": n})
    rng = random.Random(ctx.seed + 23)
    phases = {"sft_s": sft_s}
    grpo = ["grpo", "--domain", "reverse", "--init", str(base), "--iterations", str(ITERATIONS), "--quiet", *_sets(GRPO)]
    calm = work / "calm"
    t_calm = time.monotonic()
    calm_log = work / "calm.log"
    calm_run = None if (calm / "final").is_dir() else _cli(calm_log, *grpo, "--out", str(calm))
    try:
        t0 = time.monotonic()
        resumed: list[tuple[Path, float, float]] = []  # run directory, kill time, recovery
        for trial in range(n):
            out, log = work / f"killed-{trial}", work / f"killed-{trial}.log"
            p = _cli(log, *grpo, "--out", str(out))
            deadline = time.monotonic() + 600
            while not (out / "checkpoints" / "latest").is_file() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.poll() is not None:  # finished (or failed) before it could be killed: no fault
                continue
            time.sleep(rng.random() * 1.5)  # somewhere in a later iteration: rollout, training, publish or checkpoint
            if p.poll() is not None:
                continue
            t_kill = time.monotonic()
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            _finish(_cli(log, *grpo, "--out", str(out), "--resume"), "postrain grpo --resume", log)
            resumed.append((out, t_kill - t0, round(time.monotonic() - t_kill, 3)))
        res.wall_s = time.monotonic() - t0
        if calm_run is not None:
            _finish(calm_run, "postrain grpo (calm)", calm_log)
    except BaseException:
        if calm_run is not None and calm_run.poll() is None:  # the drill broke: leave no run behind
            os.killpg(calm_run.pid, signal.SIGKILL)
        raise
    phases["calm_s"] = round(time.monotonic() - t_calm, 3)
    want = _train_rows(calm)
    equal = 0
    for out, t_kill, recovery_s in resumed:
        same = _train_rows(out) == want
        equal += same
        res.events.append(Event("learner_sigkill", t_kill, recovery_s if same else None))
    if len(res.events) < n:
        res.shortfall = f"{n - len(res.events)} runs finished before they could be killed"
    res.completed = sum(1 for e in res.events if e.recovery_s is not None)
    res.detail = {"iterations": ITERATIONS, "compared": list(COMPARED), "calm_rows": len(want), **phases}
    res.checks["metrics of every resumed run equal the uninterrupted run's"] = equal == len(res.events)
    return res
