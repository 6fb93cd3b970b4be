"""A run directory `runs/<name>/`: resolved config, metrics.jsonl, checkpoints/, PNG plots."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from core import config as config_mod

SERVICES_DIR = "services"  # RUN_DIR/services/: state of services a run started for itself (a fresh run dir may hold it)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self._t0 = time.monotonic()

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def disk_bytes(self) -> int:
        """Bytes the run directory takes on disk (allocated blocks, as `du` counts them)."""
        return tree_disk_bytes(self.path)

    def save_config(self, cfg: BaseModel, name: str = "config.json") -> None:
        config_mod.dump(cfg, self.path / name)

    def log(self, **metrics: Any) -> None:
        """Append one JSON line (flushed) with the elapsed seconds added."""
        row = {"time_s": round(time.monotonic() - self._t0, 3), **metrics}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def plot(self, x: str, ys: list[str], name: str, title: str = "") -> Path | None:
        """One PNG with a panel per metric in `ys` against `x`; None when nothing was logged."""
        rows = [r for r in self.read_metrics() if x in r]
        ys = [y for y in ys if any(y in r for r in rows)]
        if not ys:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(ys), figsize=(4.2 * len(ys), 3.2), squeeze=False)
        for ax, y in zip(axes[0], ys):
            pts = [(r[x], r[y]) for r in rows if isinstance(r.get(y), (int, float)) and math.isfinite(r[y])]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 40 else None)
            ax.set_xlabel(x)
            ax.set_title(y)
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out = self.path / name
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def tree_disk_bytes(path: str | Path) -> int:
    """Allocated bytes of every file under `path` (files that vanish meanwhile count 0)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
