"""What the I/O layer costs the WAL: the batched-decode step (append_step of B trajectories x 1 token,
then commit) in this tree against the same tree with the commit's write and flush made straight on `os`
(`bypass_layer`: what the step would cost without `core.fileio`), paired. The tree from before
`core.fileio` existed (`rev=before_revision()`) was the first comparison; the WAL has since become many
times faster for reasons that have nothing to do with the layer, so against it the ratio no longer says
what the layer costs.

Both trees run the same worker loop, each in its own process, started afresh every round (so that one
process's luck in placement and memory layout does not bias the result); each round opens a fresh log
in both and warms it up, then times chunks of a few steps alternately in one and the other (A B, then
B A, …), so that the two chunks of a pair see the same load. The slowdown is 1 - the median
over all pairs of the ratio of steps per CPU second of the worker process (CPU time, not wall time:
on a shared 2-core machine the wall clock mostly measures the other jobs). The logs live on a tmpfs by default: there the
step is all CPU (fsync of a tmpfs costs nothing), so any cost the layer adds shows at its full relative
size. Wall-clock steps/s are reported beside it.
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
base, b, chunk = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(b)
toks, lps = rng.integers(0, 150_000, b, dtype=np.int32), -rng.random(b)
ids = [f"traj-{k:06d}" for k in range(b)]
print("ready", os.path.dirname(wal.__file__), flush=True)
w = d = None
pos = 0
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "open":  # a fresh log, warmed up: trajectories known, first extent written
        d = tempfile.mkdtemp(dir=base)
        w = wal.open(os.path.join(d, "wal"))
        for pos in range(50):
            w.append_step(ids, [pos] * b, toks, lps, 0)
            w.commit()
        pos += 1
        print("ok", flush=True)
    elif cmd == "chunk":
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(pos, pos + chunk):
            w.append_step(ids, [i] * b, toks, lps, 0)
            w.commit()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        pos += chunk
        print(cpu, wall, flush=True)
    elif cmd == "close":
        w.close()
        shutil.rmtree(d)
        print("ok", flush=True)
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


# The step's I/O through the layer (wal/log.py's flush, wal/direct.py's direct write) and the same calls
# straight on os, for bypass_layer.
_BYPASS = {
    "wal/log.py": {"fileio.pwrite_all(self._fd, data, self._pos)": "os.pwrite(self._fd, data, self._pos)",
                   "fileio.fdatasync(self._fd)": "os.fdatasync(self._fd)",
                   # the C commit's write (wal/_commitc.c calls the function it is handed)
                   "_commitc.commit(self, fileio.pwrite_sync)": "_commitc.commit(self, _pwritev_dsync)",
                   "    _commitc = None\n": "    _commitc = None\n\n\ndef _pwritev_dsync(fd, data, offset):\n"
                                           "    return os.pwritev(fd, [data], offset, os.RWF_DSYNC)\n"},
    "wal/direct.py": {"fileio.pwrite_sync(self.fd, mv[:total], pos - t)": "os.pwritev(self.fd, [mv[:total]], pos - t, os.RWF_DSYNC)"},
}


def bypass_layer(tree: Path) -> None:
    """Rewrite an exported tree's flush to call os directly (one pwrite, as the layer's pwrite_all makes
    when the write is whole, and fdatasync; the direct write's pwritev2, in Python and as the C commit's
    write function). Raises if the code no longer reads as expected."""
    for name, calls in _BYPASS.items():
        path = tree / name
        text = path.read_text()
        for through, straight in calls.items():
            if text.count(through) != 1:
                raise RuntimeError(f"bench.power_loss step A/B: {name} no longer has exactly one {through!r}")
            text = text.replace(through, straight)
        path.write_text(text)


class _Worker:
    def __init__(self, tree: Path, base: Path, b: int, chunk: int):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tree), str(base), str(b), str(chunk)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(base))
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"step worker for {tree} did not start")
        self.wal_dir = line[1]

    def ask(self, cmd: str) -> list[str]:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().split()
        if not reply:
            raise RuntimeError(f"step worker died on {cmd!r}")
        return reply

    def chunk(self) -> tuple[float, float]:
        """(CPU seconds of the worker process, wall seconds) of one chunk of steps."""
        cpu, wall = self.ask("chunk")
        return float(cpu), float(wall)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(b: int = 512, rounds: int = 10, chunks: int = 40, chunk: int = 20, directory: str | None = None,
            rev: str | None = None) -> dict:
    """Paired A/B of the step's cost; `rev`: the tree before, as it was, against this tree (default: HEAD
    with its flush rewritten by bypass_layer against HEAD as it is, both exported side by side with the
    same compiled modules). Run with the same code on both sides, it gave 0.997-1.084 (docs/power_loss.md):
    it resolves a few percent, not the 2 % limit it is checked against."""
    base = Path(tempfile.mkdtemp(prefix="wal-step-ab-", dir=directory or ("/dev/shm" if Path("/dev/shm").is_dir() else None)))
    pairs = []
    try:
        commit = export_tree(rev or "HEAD", base / "before")
        after_tree = ROOT
        if rev is None:
            bypass_layer(base / "before")
            export_tree(commit, base / "after")
            after_tree = base / "after"
            for side in ("before", "after"):
                for pattern in ("_stepc*.so", "_commitc*.so"):  # the same compiled step and commit on both sides
                    for built in (ROOT / "wal").glob(pattern):
                        shutil.copy2(built, base / side / "wal" / built.name)
        for r in range(rounds):  # fresh processes each round: a process's own luck (placement, layout) averages out;
            trees = [base / "before", after_tree]  # and each round alternates which one starts, opens and times first
            if r % 2:
                trees.reverse()
            first, second = (_Worker(t, base, b, chunk) for t in trees)
            before, after = (first, second) if r % 2 == 0 else (second, first)
            try:
                if Path(before.wal_dir).resolve() == Path(after.wal_dir).resolve():
                    raise AssertionError("both workers import the same wal package")
                first.ask("open"), second.ask("open")
                for k in range(chunks):
                    if (k + r) % 2 == 0:
                        a, c = before.chunk(), after.chunk()
                    else:
                        c, a = after.chunk(), before.chunk()
                    pairs.append((a, c))
                before.ask("close"), after.ask("close")
            finally:
                before.close()
                after.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ratios = sorted(a[0] / c[0] for a, c in pairs)  # steps/s after over before = CPU time before over after
    ratio = statistics.median(ratios)
    wall = statistics.median(a[1] / c[1] for a, c in pairs)
    half = 0.98 * len(ratios) ** 0.5  # distribution-free 95% interval of the median: order statistics n/2 -+ 1.96 sqrt(n)/2
    lo, hi = ratios[max(0, int(len(ratios) / 2 - half))], ratios[min(len(ratios) - 1, int(len(ratios) / 2 + half))]
    return {"b": b, "rounds": rounds, "chunks_per_round": chunks, "steps_per_chunk": chunk, "before_commit": commit,
            "before": "that commit as it was" if rev else "that commit with the flush's pwrite and fdatasync straight on os",
            "directory": "tmpfs" if str(base).startswith("/dev/shm") else str(base.parent),
            "before_steps_per_cpu_s": round(chunk / statistics.median(a[0] for a, _ in pairs), 1),
            "after_steps_per_cpu_s": round(chunk / statistics.median(c[0] for _, c in pairs), 1),
            "paired_ratio_after_vs_before": round(ratio, 4), "slowdown": round(1 - ratio, 4),
            "paired_ratio_median_95ci": [round(lo, 4), round(hi, 4)], "pairs": len(ratios),
            "paired_ratio_quartiles": [round(ratios[len(ratios) // 4], 4), round(ratios[3 * len(ratios) // 4], 4)],
            "wall_paired_ratio_after_vs_before": round(wall, 4)}
