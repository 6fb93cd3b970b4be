"""`postrain bench drill`: every drill of `postrain drill --all` at its default fault counts, plus the
cost of faults to GRPO: the median iteration time of `postrain grpo` on arith with one fault per
iteration (`--chaos`, loop.chaos_faults=1) against the same run without faults (shipped loop config
with pool.steps_per_call=2 and engine.max_batch=32 on both sides, a tiny policy after a short SFT, the same
iterations).

Prints one JSON object: the drill report (`chaos.runner`), `grpo_chaos_vs_calm`, `meta` and `targets`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core.cli_args import nonneg_int, positive_int

ROOT = Path(__file__).resolve().parents[1]
TINY = ["policy.hidden_size=64", "policy.num_layers=2", "policy.intermediate_size=128", "sft.threads=1",
        "sft.lr=3e-3", "sft.batch_size=32", "sft.warmup_steps=20", "sft.seed=0", "policy.seed=0"]


def _postrain(*args: str) -> None:
    p = subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"postrain {args[0]} failed: {p.stderr[-2000:]}")


def _iteration_s(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["iteration_s"] for r in rows if r.get("stage") == "train"]


def grpo_chaos_vs_calm(work: Path, iterations: int, sft_steps: int, seed: int) -> dict:
    base = work / "base"
    _postrain("sft", "--out", str(base), "--domain", "arith", "--steps", str(sft_steps), "--quiet",
              *(a for kv in TINY for a in ("--set", kv)))
    # steps_per_call=2 and max_batch=32 on both sides, what the injector caps the chaos side at: arith
    # completions are a few tokens, so longer calls over a wider batch finish their requests and leave nothing
    # in flight to preempt; the calm side decodes the same shape
    common = ["grpo", "--domain", "arith", "--init", str(base), "--iterations", str(iterations), "--quiet",
              "--set", "loop.eval_every=0", "--set", "eval.n=16", "--set", "pool.steps_per_call=2",
              "--set", "engine.max_batch=32"]
    runs = {}
    for name, extra in (("calm", []), ("chaos", ["--chaos", str(seed), "--set", "loop.chaos_faults=1"])):
        out = work / name
        _postrain(*common, "--out", str(out), *extra)
        runs[name] = out
    calm, chaos = _iteration_s(runs["calm"]), _iteration_s(runs["chaos"])
    faults = sum(json.loads(line).get("faults", 0) for line in (runs["chaos"] / "metrics.jsonl").read_text().splitlines())
    return {"iterations": iterations, "sft_steps": sft_steps, "faults": faults,
            "calm_iteration_s": calm, "chaos_iteration_s": chaos,
            "calm_median_s": statistics.median(calm), "chaos_median_s": statistics.median(chaos),
            "ratio": round(statistics.median(chaos) / statistics.median(calm), 3)}


def _target(value, goal: str) -> dict:
    op, bound = goal.split()
    met = value is not None and (value <= float(bound) if op == "<=" else value >= float(bound))
    return {"value": value, "goal": goal, "met": bool(met)}


def targets(report: dict, grpo: dict | None) -> dict:
    cost = report["cost_per_kind"]
    pre = (cost.get("preempt") or {}).get("recovery_p50_s")
    from chaos.schedule import percentile

    loss = [e["recovery_s"] for d in report["drills"] for e in d["events"]
            if e["kind"] in ("actor_kill", "sigkill") and e["recovery_s"] is not None]
    loss_p50 = percentile(loss, 50)
    return {
        "faults_total": _target(report["faults_total"], ">= 1000"),
        "fault_kinds": _target(report["fault_kinds"], ">= 10"),
        "wall_s": _target(report["wall_s"], "<= 1200"),
        "tokens_lost": _target(report["tokens_lost"], "<= 0"),
        "tokens_resampled": _target(report["tokens_resampled"], "<= 0"),
        "duplicate_side_effects": _target(report["duplicate_side_effects"], "<= 0"),
        "completion_rate": _target(report["completion_rate"], ">= 1.0"),
        "preempt_recovery_p50_ms": _target(round(pre * 1e3, 1) if pre is not None else None, "<= 100"),
        "actor_loss_recovery_p50_s": _target(round(loss_p50, 3) if loss_p50 is not None else None, "<= 1.0"),
        "grpo_chaos_vs_calm_iteration_time": _target((grpo or {}).get("ratio"), "<= 2.0"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.drill", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one compact JSON object")
    ap.add_argument("--trials", type=positive_int, default=None, help="faults per drill (default: each drill's own)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--grpo-iterations", type=nonneg_int, default=8, help="GRPO iterations on each side (0: skip)")
    ap.add_argument("--sft-steps", type=positive_int, default=300, help="SFT steps of the tiny GRPO base")
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    ap.add_argument("--png", default=None, help="also copy the drill timeline (drill.png) to this file")
    args = ap.parse_args(argv)

    from bench._device import cpu_name, run_meta
    from chaos.catalog import DRILLS
    from chaos.runner import run_drills, write

    work = Path(args.work or tempfile.mkdtemp(prefix="postrain-drill-"))
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    report = run_drills(list(DRILLS), work / "drills", args.seed, args.trials,
                        on_done=lambda s: print(f"{s['name']}: {s['faults_injected']} faults, {s['verdict']}",
                                                file=sys.stderr, flush=True))
    write(report, work / "drills")
    grpo = None
    if args.grpo_iterations:
        try:
            grpo = grpo_chaos_vs_calm(work / "grpo", args.grpo_iterations, args.sft_steps, args.seed + 7)
        except RuntimeError as exc:  # reported, and its target unmet
            grpo = {"error": str(exc)[-1500:]}
    drills = [{k: v for k, v in d.items() if k not in ("events",)} for d in report["drills"]]  # the timeline has them
    result = {"benchmark": "drill", "device": cpu_name(),
              "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
              "method": "postrain drill --all (default fault counts) in one process; GRPO arith calm vs "
                        "--chaos with one fault per iteration, median iteration_s of each run",
              "bench_wall_s": round(time.monotonic() - t0, 1), **report, "drills": drills, "grpo_chaos_vs_calm": grpo,
              "targets": targets(report, grpo), "meta": run_meta()}
    text = json.dumps(result) if args.json else json.dumps(result, indent=2)
    print(text)
    if args.out:
        from core.atomic import write_atomic

        write_atomic(Path(args.out), (json.dumps(result, indent=2) + "\n").encode())
    if args.png:
        import shutil

        shutil.copy(work / "drills" / "drill.png", args.png)
    return 0
