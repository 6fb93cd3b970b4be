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


def git_commit() -> str:
    """HEAD of the checkout the benchmark runs from, '+dirty' when tracked files differ from it."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
