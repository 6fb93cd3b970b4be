"""Run drills of the catalog and write their report: a terminal table, `drill.json`, `drill.png`."""
from __future__ import annotations

import json
import platform
import time
import traceback
from pathlib import Path

from chaos.catalog import DRILLS
from chaos.drill import DrillContext, DrillResult
from chaos.schedule import percentile


def run_drills(names: list[str], out: Path, seed: int = 0, trials: int | None = None, on_done=None,
               fast: bool = False) -> dict:
    """Run `names` in catalog order, each with `trials` faults per kind (None: its default count; `fast`: its
    fast variant's count); a drill that raises fails with the error as its reason."""
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        raise KeyError(f"unknown drill(s) {', '.join(unknown)}; `postrain drill --list` shows the catalog")
    out.mkdir(parents=True, exist_ok=True)
    ctx = DrillContext(out, seed=seed, trials=trials)
    results = []
    t0 = time.monotonic()
    try:
        for name in [n for n in DRILLS if n in names]:
            d = DRILLS[name]
            results.append(_one(ctx, d, d.fast_faults if fast else trials, t0))
            if on_done:
                on_done(results[-1])
    finally:
        ctx.close()
    return totals(results, time.monotonic() - t0, seed, "fast" if fast else trials)


def _one(ctx: DrillContext, d, trials: int | None, t0: float) -> dict:
    faults = trials if trials is not None else d.default_faults
    start = time.monotonic()
    try:
        r = d.run(ctx, faults)
    except Exception as exc:  # the drill itself broke: it fails, and says how
        r = DrillResult(d.name, {d.name: faults})
        r.checks[f"drill ran to the end ({type(exc).__name__}: {exc})"] = False
        r.detail["traceback"] = traceback.format_exc()[-4000:]
    s = r.summary()
    s["t_start_s"], s["elapsed_s"] = round(start - t0, 3), round(time.monotonic() - start, 3)
    return s


def totals(drills: list[dict], wall_s: float, seed: int, trials: int | str | None) -> dict:
    kinds = {k: v for d in drills for k, v in d["by_kind"].items()}
    rec = {k: [e["recovery_s"] for d in drills for e in d["events"] if e["kind"] == k and e["recovery_s"] is not None]
           for k in kinds}
    completed = [d for d in drills if d["calm_completed"]]
    return {
        "seed": seed, "trials": trials, "wall_s": round(wall_s, 3),
        "verdict": "pass" if drills and all(d["verdict"] == "pass" for d in drills) else "fail",
        "faults_total": sum(d["faults_injected"] for d in drills),
        "faults_survived": sum(d["faults_survived"] for d in drills),
        "fault_kinds": sum(1 for k in kinds.values() if k["injected"]),
        "tokens_lost": sum(d["tokens_lost"] for d in drills),
        "tokens_resampled": sum(d["tokens_resampled"] for d in drills),
        "duplicate_side_effects": sum(d["duplicate_side_effects"] for d in drills),
        "completion_rate": (min(d["completion_rate"] for d in completed) if completed else None),
        "cost_per_kind": {k: {"n": len(v), "recovery_p50_s": percentile(v, 50), "recovery_p99_s": percentile(v, 99)}
                          for k, v in rec.items()},
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "drills": drills,
    }


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def table(report: dict) -> str:
    head = ["drill", "faults (survived)", "lost", "resampled", "dup", "completed", "hashes", "recovery p50 / p99",
            "overhead", "verdict"]
    rows = []
    for d in report["drills"]:
        comp = f"{d['completed']}/{d['calm_completed']}" if d["calm_completed"] else "-"
        hashes = {True: "equal", False: "DIFFER", None: "-"}[d["hashes_equal"]]
        over = f"{d['wall_overhead']:.2f}x" if d["wall_overhead"] else "-"
        rows.append([d["name"], f"{d['faults_injected']}/{d['faults_asked']} ({d['faults_survived']})",
                     str(d["tokens_lost"]), str(d["tokens_resampled"]), str(d["duplicate_side_effects"]), comp, hashes,
                     f"{_ms(d['recovery_p50_s'])} / {_ms(d['recovery_p99_s'])}", over, d["verdict"].upper()])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{report['faults_total']} faults of {report['fault_kinds']} kinds in {report['wall_s']:.0f} s: "
                 f"{report['verdict'].upper()}")
    for d in report["drills"]:
        for why in d["failures"]:
            lines.append(f"  {d['name']}: {why}")
    return "\n".join(lines)


def write(report: dict, out: Path) -> None:
    from core.atomic import write_atomic

    write_atomic(out / "drill.json", json.dumps(report, indent=2).encode())
    timeline(report, out / "drill.png")


def timeline(report: dict, path: Path) -> None:
    """One row per drill: a tick per fault at its time in the run, a bar for its recovery (red: none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drills = report["drills"]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(drills) + 1.5))
    for i, d in enumerate(drills):
        for e in d["events"]:
            t = d["t_start_s"] + e["t_s"]
            if e["recovery_s"] is None:
                ax.plot([t], [i], marker="x", color="red", markersize=6)
            else:
                ax.plot([t, t + e["recovery_s"]], [i, i], color="tab:green", linewidth=4, solid_capstyle="butt")
                ax.plot([t], [i], marker="|", color="black", markersize=8)
    ax.set_yticks(range(len(drills)), [f"{d['name']} ({d['faults_injected']})" for d in drills])
    ax.invert_yaxis()
    ax.set_xlabel("time in the drill run (s): | fault, green bar recovery, x not recovered")
    ax.set_title(f"postrain drill: {report['faults_total']} faults, verdict {report['verdict']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
