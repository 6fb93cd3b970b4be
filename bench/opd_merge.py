"""The merge on the CPU: OPD against both baselines, same base, same teachers, same wall budget.

From a finished pipeline run (its SFT base and specialists) or a base and teachers given directly,
for every seed, one after another on this machine:
- `opd`: `postrain opd` with the full-vocabulary reverse KL (configs/opd.toml);
- `sampled_token`: the same command with `opd.loss = "sampled_token"` (the per-token estimate as a
  policy-gradient advantage: verl, slime, NeMo-RL's MOPD);
- `mixed_grpo`: `postrain grpo` over every domain's prompts from the same base (configs/grpo_loop.toml,
  the merge OPD replaces in DeepSeek-V4's recipe).
With `--settings pipeline` (the default) both OPD runs take the `--set` overrides the pipeline gives its
merge and mixed GRPO those it gives its specialists (configs/pipeline.toml; per-domain ones left out,
since a run over every domain applies none), each method as the product runs it; `shipped` runs the
config files as they are.
Each run gets `loop.time_budget_s = BUDGET` (counted from its process start) and ends with greedy
pass@1 on every domain, n = 256. Retention on a domain = the run's pass@1 over that domain's
teacher's; a method's figure is its minimum over domains, and each target takes the worse seed.

    python -m bench.opd_merge --json --run runs/default [--budget-s 600] [--seeds 0 1] [--out bench/results/opd_merge.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from bench._device import cpu_name, emit, run_meta
from core.cli_args import nonneg_int, positive_float, positive_int

METHODS = ("opd", "sampled_token", "mixed_grpo")
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
PIPELINE_TOML = Path(__file__).resolve().parents[1] / "configs" / "pipeline.toml"


def pipeline_sets(path: Path = PIPELINE_TOML) -> dict[str, list[str]]:
    """The --set overrides the pipeline gives its merge (`opd`) and its specialists (`grpo`), the latter
    without per-domain keys."""
    doc = tomllib.loads(path.read_text())
    return {"opd": list(doc["merge"].get("set", [])),
            "grpo": [x for x in doc["specialists"].get("set", []) if not x.startswith("domain.")]}


def teachers_of_run(run: Path) -> tuple[Path, dict[str, Path]]:
    """The base and each domain's teacher of a pipeline run directory."""
    return _outputs(run, "sft")["base"], _outputs(run, "specialists")


def _outputs(run: Path, stage: str) -> dict[str, Path]:
    """A stage manifest's outputs. Manifests marked `"paths": "run_dir"` (deploy.manifest) hold them relative
    to the run directory (an absolute one stays itself); older ones as given, relative to the directory the
    pipeline ran in (`runs/NAME/...`)."""
    doc = json.loads((run / stage / "manifest.json").read_text())
    if doc.get("paths") == "run_dir":
        return {name: run / o["path"] for name, o in doc["outputs"].items()}
    return {name: _in_run(run, Path(o["path"])) for name, o in doc["outputs"].items()}


def _in_run(run: Path, path: Path) -> Path:
    """An older manifest's output path, relative to the directory the pipeline ran in (`runs/NAME/...`), found
    inside `run` when this process runs elsewhere."""
    if path.is_absolute() or path.exists() or run.name not in path.parts:
        return path
    return run / Path(*path.parts[path.parts.index(run.name) + 1:])


def _last_eval(out: Path, domains: list[str]) -> dict[str, float]:
    """Pass@1 of what the run leaves in final/: its `final` row where final/ is an average (loop.final = ema),
    else its last eval (final/ is the last iterate)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("stage") == "final"] or [r for r in rows if r.get("stage") == "eval"]
    last = rows[-1]
    return {d: last[f"eval_pass_at_1_{d}"] for d in domains}


def _run(method: str, base: Path, teachers: dict[str, Path], out: Path, budget_s: float, seed: int,
         n: int, sets: dict[str, list[str]] | None = None) -> dict:
    domains = list(teachers)
    extra = (sets or {}).get("grpo" if method == "mixed_grpo" else "opd", [])
    common = [*(a for x in extra for a in ("--set", x)), "--set", f"loop.time_budget_s={budget_s}",
              "--set", f"loop.seed={seed}", "--set", f"eval.n={n}", "--set", "loop.eval_every=0", "--quiet"]
    if method == "mixed_grpo":
        cmd = ["grpo", *(a for d in domains for a in ("--domain", d)), "--init", str(base)]
    else:
        cmd = ["opd", "--student", str(base), *(f"--teacher={d}={p}" for d, p in teachers.items())]
        if method == "sampled_token":
            common += ["--set", "opd.loss=sampled_token"]
    cmd += ["--iterations", "100000", "--out", str(out), *common]
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "deploy.cli", *cmd], capture_output=True, text=True, env=ENV)
    if res.returncode != 0:
        raise RuntimeError(f"{method} seed {seed} failed: {res.stderr[-2000:]}")
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    return {"method": method, "seed": seed, "wall_s": round(time.monotonic() - t0, 1), "iterations": len(train),
            "pass_at_1": _last_eval(out, domains), "out": str(out)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="postrain bench opd-merge", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, help="a finished `postrain pipeline` run directory (its base and teachers)")
    p.add_argument("--base", type=Path, help="the SFT base (instead of --run)")
    p.add_argument("--teacher", action="append", default=[], metavar="DOMAIN=DIR", help="instead of --run")
    p.add_argument("--budget-s", type=positive_float, default=600.0, help="wall budget of every run")
    p.add_argument("--seeds", type=nonneg_int, nargs="+", default=[0, 1], help="loop seeds (every method runs each)")
    p.add_argument("--n", type=positive_int, default=256, help="eval prompts per domain")
    p.add_argument("--work", type=Path, default=Path("runs/bench-opd-merge"), help="where the runs go")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--settings", choices=["pipeline", "shipped"], default="pipeline",
                   help="pipeline: each method with the --set overrides the pipeline gives it; shipped: the config files alone")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    from core.errors import UserError
    from core.hf import load_policy
    from learner.config import EvalConfig
    from learner.evaluate import evaluate

    if a.run:
        base, teachers = teachers_of_run(a.run)
    elif a.base and a.teacher:
        base, teachers = a.base, {t.split("=", 1)[0]: Path(t.split("=", 1)[1]) for t in a.teacher}
    else:
        raise UserError("bench opd-merge: give --run RUN_DIR, or --base DIR and --teacher DOMAIN=DIR for every domain")
    if a.work.exists() and any(a.work.iterdir()):
        raise UserError(f"bench opd-merge: {a.work} is not empty; pick a fresh --work")
    t_start = time.monotonic()
    cfg = EvalConfig(n=a.n)
    teacher_pass, base_pass = {}, {}
    model, tok = load_policy(base)
    for d in teachers:
        base_pass[d] = evaluate(model, tok, d, cfg)["pass_at_1"]
    for d, path in teachers.items():
        model, tok = load_policy(path)
        teacher_pass[d] = evaluate(model, tok, d, cfg)["pass_at_1"]
    sets = pipeline_sets() if a.settings == "pipeline" else {}
    runs = []
    for seed in a.seeds:
        for method in a.methods:
            r = _run(method, base, teachers, a.work / f"{method}-s{seed}", a.budget_s, seed, a.n, sets)
            r["retention"] = {d: r["pass_at_1"][d] / teacher_pass[d] for d in teachers if teacher_pass[d] > 0}
            r["retention_min"] = min(r["retention"].values())
            runs.append(r)
            print(f"{method} seed {seed}: " + " ".join(f"{d} {v:.3f}" for d, v in r["pass_at_1"].items())
                  + f" retention_min {r['retention_min']:.3f}", file=sys.stderr, flush=True)
    by = {(r["method"], r["seed"]): r for r in runs}
    ours = min(by[("opd", s)]["retention_min"] for s in a.seeds) if "opd" in a.methods else None
    targets = {}
    if ours is not None:
        targets["retention_min_cpu"] = {"value": ours, "goal": ">= 0.97 (worse seed)", "met": ours >= 0.97}
        for base_m, key in (("sampled_token", "retention_gain_vs_sampled_token"), ("mixed_grpo", "retention_gain_vs_mixed_grpo")):
            if base_m in a.methods:
                gain = min(by[("opd", s)]["retention_min"] - by[(base_m, s)]["retention_min"] for s in a.seeds)
                targets[key] = {"value": gain, "goal": ">= 0 (same budget, worse seed)", "met": gain >= 0}
    res = {"benchmark": "opd_merge", "device": cpu_name(), "budget_s": a.budget_s, "seeds": a.seeds, "n": a.n,
           "settings": a.settings, "sets": sets,
           "base": str(base), "teachers": {d: str(p) for d, p in teachers.items()}, "base_pass_at_1": base_pass,
           "teacher_pass_at_1": teacher_pass, "runs": runs, "wall_s": round(time.monotonic() - t_start, 1),
           "load_avg_1m_end": round(os.getloadavg()[0], 2), "targets": targets}
    res["meta"] = run_meta(res["device"])
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
