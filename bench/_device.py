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


def run_meta(machine: str | None = None) -> dict:
    """What every benchmark JSON records about its run: git commit (and whether tracked files had
    uncommitted changes), UTC date, machine."""
    import subprocess
    import time

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine or cpu_name()}
