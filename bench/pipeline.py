"""The pipeline's targets from finished `postrain pipeline` runs (one per seed, same config).

Each run is a whole `make run` (SFT -> specialists -> OPD merge -> evaluate) made on this machine;
this module only reads their `report.json` files and takes, for every target, the worse run:
- `wall_min_cpu`: the sum of the stages' wall times, in minutes (the largest run);
- `specialist_gain_min`: pass@1 of a specialist minus the base's on its domain, over the domains
  whose base was below the pipeline's `skip_at` (the smallest gain of any run);
- `retention_min`: the merged student's pass@1 over its domain's teacher's (the smallest).

    python -m bench.pipeline --run runs/default --run ../seed1/runs/default --json \
        [--copy-reports docs/results] [--out bench/results/pipeline.json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench._device import emit, git, run_meta

GOALS = {"wall_min_cpu": (30.0, "<="), "specialist_gain_min": (0.10, ">="), "retention_min": (0.95, ">=")}


def _code_of(run_dir: Path) -> dict:
    """The commit of the checkout that holds `run_dir` (runs/ lives inside the clone that ran it) and its
    tracked files changed since that commit."""
    changed = git(run_dir, "status", "--porcelain", "--untracked-files=no")
    return {"commit": git(run_dir, "rev-parse", "HEAD") or None,
            "changed_files": sorted(line[3:] for line in changed.splitlines()) if changed else []}


def figures(report: dict) -> dict:
    """One run's figures for the targets; raises ValueError for a run that did not finish."""
    missing = [s for s, v in report.get("stages", {}).items() if v.get("status") != "done"]
    if missing or not report.get("retention"):
        raise ValueError(f"run {report.get('name')!r} is not finished (stages not done: {missing or 'evaluate'})")
    return {"wall_min": report["wall_min"], "specialist_gain_min": report.get("specialist_gain_min"),
            "retention_min": report["retention_min"], "specialist_gain": report.get("specialist_gain", {}),
            "retention": report["retention"], "pass_at_1": report["pass_at_1"], "trained": report.get("trained", [])}


def targets(runs: list[dict]) -> dict:
    """The worse run for each target; a gain is None when no run trained a specialist."""
    walls = [r["wall_min"] for r in runs]
    gains = [r["specialist_gain_min"] for r in runs if r["specialist_gain_min"] is not None]
    values = {"wall_min_cpu": max(walls), "specialist_gain_min": min(gains) if gains else None,
              "retention_min": min(r["retention_min"] for r in runs)}
    out = {}
    for key, (goal, op) in GOALS.items():
        v = values[key]
        met = None if v is None else (v <= goal if op == "<=" else v >= goal)
        out[key] = {"value": v, "goal": f"{op} {goal:g} (worse of {len(runs)} runs)", "met": met}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="postrain bench pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, action="append", required=True, help="a finished pipeline run directory")
    p.add_argument("--copy-reports", type=Path, help="also copy each run's report.json here as pipeline_seedS.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    from core.errors import UserError

    runs = []
    for run_dir in a.run:
        path = run_dir / "report.json"
        if not path.is_file():
            raise UserError(f"bench pipeline: {path} not found; give a `postrain pipeline` run directory")
        report = json.loads(path.read_text())
        seed = report.get("config", {}).get("pipeline", {}).get("seed", 0)
        try:
            fig = figures(report)
        except ValueError as exc:
            raise UserError(f"bench pipeline: {exc}") from None
        runs.append({"run": str(run_dir), "seed": seed, **_code_of(run_dir), **fig})
        if a.copy_reports:
            a.copy_reports.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, a.copy_reports / f"pipeline_seed{seed}.json")
    if len({r["seed"] for r in runs}) != len(runs):
        raise UserError("bench pipeline: two runs have the same pipeline.seed; give one run per seed")
    res = {"benchmark": "pipeline", "method": "`make run` (postrain pipeline --name default) on a fresh clone, one "
           "run per pipeline.seed; every target takes the worse run", "runs": runs, "targets": targets(runs)}
    res["meta"] = run_meta()
    res["device"] = res["meta"]["machine"]
    emit(res, a.out, show=a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
