"""Power-loss benchmark: simulated power cuts (core.powercut) across the WAL, the environment log, the
data plane's put, KV snapshots and learner checkpoints; the canaries; the I/O layer's cost on the WAL.

Each case's workload is recorded through core.fileio, its operation log cut at many points, and one
seeded crash image per cut (unsynced writes dropped, kept or torn per 512-byte sector, unsynced
directory entries there or not) recovered and checked; from a quarter of the images recovery itself
is recorded and cut again. Then the three canaries (builds without the WAL's commit fdatasync, with
its direct commit write sent without RWF_DSYNC, and without the directory fsync after a new segment)
run the WAL case's default trials and must be caught, and the WAL's batched-decode step is timed against the same tree with the I/O layer bypassed.

    python -m bench.power_loss --json        (or: postrain bench power-loss --json)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench._device import cpu_name as device
from bench._device import run_meta
from bench._power_loss import canaries as canary_defs
from bench._power_loss import step_ab
from bench._power_loss.cases import CASES, make_case, run_default
from bench._power_loss.trials import KINDS, Outcome, run_trial
from core.cli_args import positive_int

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "power_loss.json"
SHARES = {"wal": 0.42, "envlog": 0.14, "dataplane": 0.16, "snapshot": 0.14, "checkpoint": 0.14}


def run_cases(total_cuts: int, say) -> dict[str, Outcome]:
    """Trials of every case until its share of `total_cuts` crash images has been checked."""
    out = {}
    for name in CASES:
        case = make_case(name)
        want = int(total_cuts * SHARES[name] + 0.5)
        acc = Outcome(name, trials=0)
        seed = 1000
        while acc.cuts < want:  # every point of each workload's log, until the share is reached
            left = want - acc.cuts
            acc.add(run_trial(case, seed, images=1, recovery_cuts=3, cuts=left if left < 200 else None))
            seed += 1
        out[name] = acc
        say(f"{name}: {acc.trials} workloads, {acc.cuts} cuts ({acc.recovery_cuts} during recovery), "
            f"problems {dict(acc.problems) or 'none'}")
    return out


def run_canary(c, say) -> dict:
    t0 = time.perf_counter()
    acc = run_default(c.case, canary=c)
    caught = acc.failed > 0
    say(f"canary {c.name}: {'caught' if caught else 'NOT caught'} ({acc.failed} of {acc.cuts} images fail)")
    return {"removed": c.what, "case": c.case, "default_trials": acc.trials, "cuts": acc.cuts, "caught": caught,
            "images_with_problems": {k: acc.problems.get(k, 0) for k in KINDS},
            "first_failure": list(acc.first[0]) if acc.first else None, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the result as JSON (progress goes to stderr)")
    ap.add_argument("--cuts", type=positive_int, default=10_000, help="crash images to check across the five cases")
    ap.add_argument("--ab-rounds", type=positive_int, default=20, help="rounds of the WAL step A/B (fresh processes and logs)")
    ap.add_argument("--ab-chunks", type=positive_int, default=30, help="timed chunk pairs per A/B round")
    ap.add_argument("--no-extra-canaries", action="store_true", help="skip the canaries that are not targets")
    ap.add_argument("--out", default=str(RESULTS), help="write the JSON here too ('-' for nowhere)")
    args = ap.parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    result: dict = {"benchmark": "power_loss", "device": device(), "meta": run_meta(),  # the commit measured
                    "load_average_1m_at_start": round(os.getloadavg()[0], 2)}
    t_start = time.perf_counter()
    outcomes = run_cases(args.cuts, say)
    cut_s = time.perf_counter() - t_start
    cuts = sum(o.cuts for o in outcomes.values())
    lost = sum(o.problems.get("lost", 0) + o.problems.get("refused", 0) for o in outcomes.values())
    violations = sum(o.failed for o in outcomes.values())
    result["cases"] = {name: o.to_json() for name, o in outcomes.items()}
    result["simulated_cuts"] = cuts
    result["simulated_cuts_s"] = round(cut_s, 1)
    result["canaries"] = {c.name: run_canary(c, say) for c in canary_defs.CANARIES}
    if not args.no_extra_canaries:
        result["extra_canaries"] = {c.name: run_canary(c, say) for c in canary_defs.EXTRA}
    caught = sum(v["caught"] for v in result["canaries"].values())
    say("timing the WAL step against the same tree with the I/O layer bypassed ...")
    try:
        ab = step_ab.measure(rounds=args.ab_rounds, chunks=args.ab_chunks)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:  # no git history here: reported, not met
        ab = {"error": f"{type(exc).__name__}: {exc}"}
    result["wal_step_ab"] = ab
    slowdown = ab.get("slowdown")
    result["targets"] = {
        "simulated_cuts": {"value": cuts, "goal": f">= 10000 in <= 600 s (took {cut_s:.0f} s)",
                           "met": cuts >= 10_000 and cut_s <= 600},
        "acknowledged_lost": {"value": lost, "goal": "<= 0 (images where something acknowledged was missing, or "
                                                     "recovery refused to open)", "met": lost <= 0},
        "canaries_caught": {"value": caught, "goal": f">= {len(canary_defs.CANARIES)} of {len(canary_defs.CANARIES)}",
                            "met": caught >= len(canary_defs.CANARIES)},
        "wal_step_b512_slowdown": {"value": slowdown, "goal": "<= 0.02 (1 - median paired ratio of steps per CPU "
                                                              "second, this tree vs this tree's commit with its flush straight on os)",
                                   "met": slowdown is not None and slowdown <= 0.02},
        "property_violations": {"value": violations, "goal": "<= 0 (images failing any property, lost, refused or "
                                                             "wrong)", "met": violations <= 0},
    }
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    if args.out != "-":
        Path(args.out).write_text(text + "\n")
    print(text if args.json else "\n".join(f"{k}: {v['value']} ({'met' if v['met'] else 'NOT met'}: {v['goal']})"
                                          for k, v in result["targets"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
