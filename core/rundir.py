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
from core.errors import UserError

SERVICES_DIR = "services"  # RUN_DIR/services/: state of services a run started for itself (a fresh run dir may hold it)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self._drop_cut_tail()
        # time_s counts the run's whole wall time: a resumed process goes on from the last row's
        rows = self.read_metrics()
        self._t0 = time.monotonic() - float(rows[-1].get("time_s", 0.0) if rows else 0.0)

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
        """Every row; a last line cut short (a kill or a full disk mid-append) is left out, a damaged line
        before it is an error naming the file and line."""
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text().split("\n")
        rows = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                if n == len(lines):  # no newline after it: the append was cut off
                    continue
                raise UserError(f"{self.metrics_path} line {n} is damaged ({exc}); delete that line or the file "
                                "to go on") from None
        return rows

    def _drop_cut_tail(self) -> None:
        """End the file on a newline, so the next row does not append to its last line: a cut-off last line
        is removed, a whole one (only its newline lost) kept."""
        if not self.metrics_path.is_file():
            return
        data = self.metrics_path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
        except ValueError:
            with open(self.metrics_path, "r+b") as f:
                f.truncate(cut)
            return
        with open(self.metrics_path, "ab") as f:
            f.write(b"\n")

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


def last_metrics(path: Path, max_bytes: int = 1 << 16) -> list[dict[str, Any]]:
    """The rows among the last `max_bytes` of a metrics.jsonl that another process may be appending to, for a
    progress display: only whole lines that parse (a row being written, or one cut by the window, is left out).
    [] when the file is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            data = f.read(max_bytes)
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the window began inside a line
    rows = []
    for line in lines[:-1]:  # the last piece has no newline after it yet: still being written, or empty
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


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
