"""Greedy eval pass@1 of `postrain grpo` runs against wall time: docs/grpo_runs.png (docs/learner.md).

Usage: python docs/plot_grpo_runs.py OUT.png [LABEL=]RUN_DIR...   (each RUN_DIR holds a run's metrics.jsonl;
the label defaults to the domain, plus "--chaos 7" where the directory name says chaos)
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"arith": "tab:blue", "reverse": "tab:green", "calc": "tab:red"}


def main(out: str, runs: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    lowest = 0.5
    for arg in runs:
        label, _, path = arg.rpartition("=")
        run = Path(path)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if r.get("stage") == "eval"]
        domain = json.loads((run / "grpo_run.json").read_text())["domain"]
        chaos = "chaos" in run.name
        lowest = min(lowest, *(r["eval_pass_at_1"] - 0.05 for r in evals))
        ax.plot([r["time_s"] / 60 for r in evals], [r["eval_pass_at_1"] for r in evals], marker="o", markersize=3,
                color=None if label else COLORS.get(domain), linestyle="--" if chaos else "-", label=label or f"{domain}{' --chaos 7' if chaos else ''}")
    ax.set_xlabel("wall time of the run (min, start-up included)")
    ax.set_ylabel("greedy eval pass@1 (n = 256)")
    ax.set_xlim(0, 15)
    ax.set_ylim(max(0.0, lowest), 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("postrain grpo from the default SFT base (2 shared CPU cores)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
