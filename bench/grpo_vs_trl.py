"""`postrain grpo` against TRL's `GRPOTrainer`, side by side: pass@1 reached per wall-clock second.

For each domain and seed, one after the other on the same machine: `postrain grpo` (a subprocess, the
shipped `configs/grpo_loop.toml` unless --config, `loop.time_budget_s` = the budget, seed on
`loop.seed`, `pool.seed`, `learner.seed`), then TRL (`python -m bench.trl_grpo`, a subprocess) mapped
from the resolved config that run wrote (`bench/trl_grpo.py` holds the mapping). Both start from the
same checkpoint, get the same train prompts in the same order, the same reward function
(`rewards.domain(d).verify`) and the same budget; each clock starts before the side loads anything.

Scoring: greedy pass@1 on the domain's eval split with `postrain eval`'s evaluator and the run's
`[eval]` table. Ours: the loop's own evals (every `loop.eval_every` iterations, inside its budget);
its final pass@1 is that of `final/`, what the run hands its user (the average of the iterates under
`loop.final = "ema"`, its `final` row). TRL: a snapshot of the policy every `--snapshot-every-s` seconds (the weights after the last optimizer
step that ended before the mark) and the final one, scored after the run, outside its budget. The
pass@1 of a side at time t is that of its policy as of t (its latest eval at or before t; the final
policy after its run ended). Matched times: every snapshot period up to the budget.

Targets (CPU): `matched_time_pass_at_1_vs_trl_cpu` — per domain, the mean over matched times and seeds
of ours over the same mean of TRL's, the worse domain; `final_pass_at_1_vs_trl_cpu` — per domain the
mean over seeds of the final pass@1, ours over TRL's, the worse domain; `run_dir_gb_per_hour_cpu` — the
largest size of an arith run directory of ours (`run_dir_mb_max`) over the run's hours, the worst seed
(a bounded directory of a short run overstates it). All three are defined at a 420 s budget: a shorter run reports its ratios as measured and the
targets as unmet at 420 s (not measured). The H200 target (`iteration_tokens_s_vs_trl_h200`, tokens/s of a
whole iteration) is `bench/grpo_iteration.py`'s, in `bench/results/grpo_vs_trl_h200.json`.

    python -m bench.grpo_vs_trl --json [--budget-s 420] [--seeds 0,1] [--domains arith,reverse]
        [--init CKPT] [--work DIR] [--set KEY=VALUE ...] [--out bench/results/grpo_vs_trl.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from core.cli_args import nonneg_ints, positive_float

ROOT = Path(__file__).resolve().parents[1]
TARGET_BUDGET_S = 420.0
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}


def _log(msg: str) -> None:
    print(f"[bench grpo-vs-trl] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    if res.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {res.returncode}); log {log}:\n{tail}")


BASE_SETS = ["sft.steps=900", "sft.seed=1", "policy.seed=1"]


def make_base(work: Path) -> Path:
    """`postrain sft` from configs/job.toml, 900 steps, seed 1: a base with room on arith and reverse on every
    CPU measured (greedy pass@1 0.51 / 0.52 on a 2-core Intel Xeon). The pipeline's seed-1 base (1,200 steps)
    left room on a 2-core AMD EPYC (0.88 / 0.74) but not on that Xeon (0.97 / 0.75), where arith could not
    tell the two sides apart."""
    out = work / "sftbase"
    if not (out / "final" / "config.json").is_file():
        _log(f"building the base checkpoint in {out} (postrain sft, {', '.join(BASE_SETS)})")
        _run([sys.executable, "-m", "deploy.cli", "sft", "--config", str(ROOT / "configs" / "job.toml"),
              *(a for kv in BASE_SETS for a in ("--set", kv)), "--out", str(out), "--quiet"], work / "sft.log")
    return out / "final"


def run_ours(init: Path, domain: str, seed: int, budget_s: float, out: Path, config: str, sets: list[str]) -> dict:
    seeds = [f"{k}={seed}" for k in ("loop.seed", "pool.seed", "learner.seed")]
    cmd = [sys.executable, "-m", "deploy.cli", "grpo", "--domain", domain, "--init", str(init), "--iterations",
           "1000000", "--out", str(out), "--quiet", "--config", config]
    for kv in [f"loop.time_budget_s={budget_s}", *seeds, *sets]:
        cmd += ["--set", kv]
    t0 = time.monotonic()
    _run(cmd, out.parent / f"{out.name}.log")
    wall = time.monotonic() - t0
    return read_ours([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], wall)


def read_ours(rows: list[dict], wall: float) -> dict:
    """One run of ours from its metrics rows: the eval curve, the final pass@1 (of `final/`), throughput, disk."""
    train = [r for r in rows if r["stage"] == "train"]
    evals = [(r["time_s"], r["eval_pass_at_1"]) for r in rows if r["stage"] == "eval"]
    final = [r["eval_pass_at_1"] for r in rows if r["stage"] == "final"]  # final/ when it is not the last iterate
    disk = [r for r in rows if r["stage"] == "disk"][-1]
    end = train[-1]["time_s"]
    completions = sum(r.get("completed", 0) for r in train)
    return {"evals": evals, "final_pass_at_1": final[-1] if final else evals[-1][1],
            "last_iterate_pass_at_1": evals[-1][1], "iterations": len(train),
            "optimizer_steps": sum(r["optimizer_steps"] for r in train), "completions": completions,
            "train_end_s": end, "completions_per_s": completions / end, "process_wall_s": round(wall, 3),
            "first_eval_s": evals[0][0], "run_dir_mb": disk["run_dir_mb"], "run_dir_mb_max": disk["run_dir_mb_max"],
            "sampled_reward_mean": statistics.fmean(r["reward_mean"] for r in train)}


def run_trl(init: Path, domain: str, seed: int, budget_s: float, every_s: float, out: Path, cfg: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    spec = {"init": str(init), "domain": domain, "seed": seed, "budget_s": budget_s, "snapshot_every_s": every_s,
            "out": str(out), "config": cfg, "threads": 2}
    (out / "spec.json").write_text(json.dumps(spec))
    t0 = time.monotonic()
    _run([sys.executable, "-m", "bench.trl_grpo", str(out / "spec.json")], out.parent / f"{out.name}.log")
    wall = time.monotonic() - t0
    res = json.loads((out / "trl_run.json").read_text())
    return res | {"process_wall_s": round(wall, 3)}


def score_snapshots(init: Path, domain: str, snapshots: list[dict], eval_cfg: dict) -> list[tuple[float, float]]:
    """(time, greedy pass@1) of every TRL snapshot, with `postrain eval`'s evaluator."""
    import torch
    from safetensors.torch import load_file

    from core.hf import load_policy
    from learner.config import EvalConfig
    from learner.evaluate import evaluate

    torch.set_num_threads(2)
    model, tok = load_policy(init)
    cfg = EvalConfig.model_validate(eval_cfg)
    out = []
    for s in snapshots:
        model.load_state_dict(load_file(s["path"]))
        out.append((s["time_s"], evaluate(model, tok, domain, cfg)["pass_at_1"]))
    return out


def at(curve: list[tuple[float, float]], t: float) -> float:
    """Pass@1 of the policy as of time t: the latest point at or before t (the last one after the run)."""
    best = curve[0][1]
    for when, value in curve:
        if when <= t + 1e-9:
            best = value
    return best


def matched_times(budget_s: float, every_s: float) -> list[float]:
    n = int(budget_s // every_s)
    return [every_s * (i + 1) for i in range(n)]


def summarise(runs: list[dict], budget_s: float, every_s: float) -> dict:
    """Per domain and seed: pass@1 at matched times and the means; per domain the ratios; the targets."""
    times = matched_times(budget_s, every_s)
    per_domain: dict[str, dict] = {}
    for r in runs:
        ours = [at(r["ours"]["evals"], t) for t in times]
        trl = [at(r["trl"]["evals"], t) for t in times]
        r["matched"] = {"times_s": times, "ours": ours, "trl": trl,
                        "ours_mean": statistics.fmean(ours), "trl_mean": statistics.fmean(trl)}
        d = per_domain.setdefault(r["domain"], {"ours": [], "trl": [], "ours_final": [], "trl_final": []})
        d["ours"] += ours
        d["trl"] += trl
        d["ours_final"].append(r["ours"]["final_pass_at_1"])
        d["trl_final"].append(r["trl"]["final_pass_at_1"])
    ratios = {}
    for name, d in per_domain.items():
        ratios[name] = {"matched_mean_ours": statistics.fmean(d["ours"]), "matched_mean_trl": statistics.fmean(d["trl"]),
                        "final_mean_ours": statistics.fmean(d["ours_final"]),
                        "final_mean_trl": statistics.fmean(d["trl_final"])}
        ratios[name]["matched_ratio"] = ratios[name]["matched_mean_ours"] / max(ratios[name]["matched_mean_trl"], 1e-9)
        ratios[name]["final_ratio"] = ratios[name]["final_mean_ours"] / max(ratios[name]["final_mean_trl"], 1e-9)
    return ratios


def targets(ratios: dict, runs: list[dict], budget_s: float) -> dict:
    full = abs(budget_s - TARGET_BUDGET_S) < 1e-6
    where = "" if full else (f"measured at a {budget_s:g} s budget, not the {TARGET_BUDGET_S:g} s the target names: "
                             "the target stays unmet until a 420 s run measures it")
    matched = min(r["matched_ratio"] for r in ratios.values())
    final = min(r["final_ratio"] for r in ratios.values())
    arith = [r["ours"] for r in runs if r["domain"] == "arith"]
    gb_h = max(o["run_dir_mb_max"] / 1000 / (o["train_end_s"] / 3600) for o in arith) if arith else None
    out = {
        "matched_time_pass_at_1_vs_trl_cpu": {"value": matched if full else None, "goal": ">= 1.02",
                                              "met": (matched >= 1.02) if full else False},
        "final_pass_at_1_vs_trl_cpu": {"value": final if full else None, "goal": ">= 1.0",
                                       "met": (final >= 1.0) if full else False},
        "run_dir_gb_per_hour_cpu": {"value": gb_h if full else None, "goal": "<= 0.5",
                                    "met": (gb_h <= 0.5) if full and gb_h is not None else False},
    }
    if not full:
        for key, value in (("matched_time_pass_at_1_vs_trl_cpu", matched), ("final_pass_at_1_vs_trl_cpu", final),
                           ("run_dir_gb_per_hour_cpu", gb_h)):
            out[key] |= {"measured_here": value, "note": where}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="postrain bench grpo-vs-trl", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--budget-s", type=positive_float, default=TARGET_BUDGET_S, help="wall budget of each side and run")
    p.add_argument("--snapshot-every-s", type=positive_float, default=30.0, help="matched-time period (TRL snapshots)")
    p.add_argument("--seeds", type=nonneg_ints, default="0,1", help="comma-separated seeds")
    p.add_argument("--domains", default="arith,reverse", help="comma-separated domains")
    p.add_argument("--init", help="base checkpoint (default: built with postrain sft, configs/job.toml, 900 steps, "
                                  "seed 1)")
    p.add_argument("--work", default="/tmp/grpo_vs_trl", help="run directories of both sides")
    p.add_argument("--config", default=str(ROOT / "configs" / "grpo_loop.toml"), help="ours: the loop config")
    p.add_argument("--set", dest="sets", action="append", default=[], help="ours: extra config override")
    p.add_argument("--sides", default="ours,trl", help="which sides to run (an investigation may run ours alone)")
    p.add_argument("--out", help="write the JSON here (default: bench/results/grpo_vs_trl.json with --json "
                                 "when the shipped config ran unchanged; else nowhere)")
    args = p.parse_args(argv)
    try:
        import trl
    except ImportError:
        if "trl" in args.sides:
            print("grpo-vs-trl: TRL is not installed; pip install 'postrain[bench]'", file=sys.stderr)
            return 2
        trl = None
    from bench._device import cpu_name, run_meta

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    init = Path(args.init) if args.init else make_base(work)
    seeds = args.seeds
    domains = args.domains.split(",")
    sides = args.sides.split(",")
    runs = []
    for domain in domains:
        for seed in seeds:
            tag = f"{domain}-s{seed}"
            run = {"domain": domain, "seed": seed}
            ours_out = work / f"ours-{tag}"
            if "ours" in sides:
                _log(f"{tag}: postrain grpo, {args.budget_s:g} s")
                import shutil

                shutil.rmtree(ours_out, ignore_errors=True)
                run["ours"] = run_ours(init, domain, seed, args.budget_s, ours_out, args.config, args.sets)
                _log(f"{tag}: ours {run['ours']['iterations']} iterations, final pass@1 {run['ours']['final_pass_at_1']:.3f}")
            if "trl" in sides:
                cfg = json.loads((ours_out / "config.json").read_text())
                _log(f"{tag}: TRL GRPOTrainer, {args.budget_s:g} s")
                res = run_trl(init, domain, seed, args.budget_s, args.snapshot_every_s, work / f"trl-{tag}", cfg)
                res["evals"] = score_snapshots(init, domain, res.pop("snapshots"), cfg["eval"])
                res["final_pass_at_1"] = res["evals"][-1][1]
                run["trl"] = res
                _log(f"{tag}: TRL {res['optimizer_steps']} steps, final pass@1 {res['final_pass_at_1']:.3f}")
            runs.append(run)
    out = {"benchmark": "grpo_vs_trl", "device": cpu_name(), "budget_s": args.budget_s,
           "snapshot_every_s": args.snapshot_every_s, "seeds": seeds, "domains": domains,
           "init": str(init), "config": args.config, "sets": args.sets, "load_avg_1m": os.getloadavg()[0],
           "trl_version": getattr(trl, "__version__", None), "runs": runs}
    if all("ours" in r and "trl" in r for r in runs):
        out["ratios"] = summarise(runs, args.budget_s, args.snapshot_every_s)
        out["targets"] = targets(out["ratios"], runs, args.budget_s)
    out["meta"] = run_meta(out["device"])
    dest = args.out or (str(ROOT / "bench" / "results" / "grpo_vs_trl.json")
                        if args.json and not args.sets and "targets" in out else None)
    if dest:
        Path(dest).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1) if args.json else json.dumps(out.get("ratios", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
