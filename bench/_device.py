"""The device line every benchmark JSON carries, the commit it measured, and a process's CPU time."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """'<CPU model>, <n> cores' from /proc/cpuinfo (platform.processor() where that is unreadable)."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (from /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def git(cwd: str | Path, *args: str) -> str | None:
    """`git ARGS` in `cwd`, stripped stdout; None where git or the checkout is missing."""
    import subprocess

    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_meta(machine: str | None = None) -> dict:
    """What every benchmark JSON records about its run: git commit (and whether tracked files had
    uncommitted changes), UTC date, machine."""
    import time

    root = Path(__file__).resolve().parents[1]
    status = git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": git(root, "rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine or cpu_name()}


def emit(res: dict, out: Path | None, show: bool = True) -> None:
    """Print a benchmark's JSON (when `show`) and write it to `out` (when given)."""
    import json

    text = json.dumps(res, indent=2)
    if show:
        print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def drop_page_cache(path) -> None:
    """Evict a file, or every file under a directory, from the page cache (fsync, then
    POSIX_FADV_DONTNEED: clean pages go), as on a restart after a reboot or on another host."""
    p = Path(path)
    for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
