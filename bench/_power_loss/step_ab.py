"""What the I/O layer costs the WAL: the batched-decode step (append_step of B trajectories x 1 token,
then commit) in this tree against the tree from before `core.fileio` existed, paired.

Both trees run the same worker loop in their own process (started once, warmed up); rounds alternate
A B B A so that drifts cancel, each round times a fresh log, and the slowdown is 1 - the median of the
per-pair ratios of steps/s. The logs live on a tmpfs by default: there the step is all CPU (fsync of
a tmpfs costs nothing), so any cost the layer adds shows at its full relative size.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKER = r"""
import os, shutil, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import wal
base, b = sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(b)
toks, lps = rng.integers(0, 150_000, b, dtype=np.int32), -rng.random(b)
ids = [f"traj-{k:06d}" for k in range(b)]
print("ready", os.path.dirname(wal.__file__), flush=True)
for line in sys.stdin:
    n = int(line)
    d = tempfile.mkdtemp(dir=base)
    w = wal.open(os.path.join(d, "wal"))
    for i in range(50):  # warm-up: trajectories known, first extent written
        w.append_step(ids, [i] * b, toks, lps, 0)
        w.commit()
    t0 = time.perf_counter()
    for i in range(50, 50 + n):
        w.append_step(ids, [i] * b, toks, lps, 0)
        w.commit()
    rate = n / (time.perf_counter() - t0)
    w.close()
    shutil.rmtree(d)
    print(rate, flush=True)
"""


def before_revision() -> str:
    """The commit before the one that added core/fileio.py."""
    out = subprocess.run(["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--", "core/fileio.py"],
                         capture_output=True, text=True, check=True).stdout.split()
    if not out:
        raise RuntimeError("core/fileio.py has no commit that adds it (uncommitted tree?)")
    return out[-1] + "^"


def export_tree(rev: str, dest: Path) -> str:
    """wal/ and core/ of `rev` under `dest`; returns the full commit id."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "wal", "core"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    return commit


class _Worker:
    def __init__(self, tree: Path, base: Path, b: int):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tree), str(base), str(b)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(base))
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"step worker for {tree} did not start")
        self.wal_dir = line[1]

    def rate(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(b: int = 512, rounds: int = 15, steps: int = 2000, directory: str | None = None, rev: str | None = None) -> dict:
    """Paired A/B of steps/s; `rev` is the tree before (default: before core/fileio.py was added)."""
    rev = rev or before_revision()
    base = Path(tempfile.mkdtemp(prefix="wal-step-ab-", dir=directory or ("/dev/shm" if Path("/dev/shm").is_dir() else None)))
    try:
        old_tree = base / "before"
        commit = export_tree(rev, old_tree)
        before, after = _Worker(old_tree, base, b), _Worker(ROOT, base, b)
        try:
            if Path(before.wal_dir).resolve() == Path(after.wal_dir).resolve():
                raise AssertionError("both workers import the same wal package")
            pairs = []
            for r in range(rounds):
                if r % 2 == 0:
                    a, c = before.rate(steps), after.rate(steps)
                else:
                    c, a = after.rate(steps), before.rate(steps)
                pairs.append((a, c))
        finally:
            before.close()
            after.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ratio = statistics.median(c / a for a, c in pairs)
    return {"b": b, "rounds": rounds, "steps_per_round": steps, "before_commit": commit,
            "directory": "tmpfs" if str(base).startswith("/dev/shm") else str(Path(base).parent),
            "before_steps_s": round(statistics.median(a for a, _ in pairs), 1),
            "after_steps_s": round(statistics.median(c for _, c in pairs), 1),
            "paired_ratio_after_vs_before": round(ratio, 4), "slowdown": round(1 - ratio, 4),
            "pairs_steps_s": [[round(a, 1), round(c, 1)] for a, c in pairs]}
