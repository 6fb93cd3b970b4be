"""`--json`: the process's stdout carries the report and nothing else.

Others write to stdout whenever they like: Ray's driver prints a dead worker's notice with `print()`
from its error listener thread, and the notices it still holds when it shuts down (at interpreter exit,
after the report); native code and child processes (the raylet, GCS and workers of a local cluster,
sandboxes) write to descriptor 1. So that `postrain … --json | jq` reads the report alone: descriptor 1
is pointed at stderr before the command runs (children inherit it); `sys.stdout` writes to the original
stdout only what the main thread prints while the command runs, where the commands print their report;
other threads' prints, and everything once the command returned, go to stderr."""
from __future__ import annotations

import os
import sys
import threading


class _MainThreadStdout:
    def __init__(self, report):
        self._report = report

    def write(self, text: str) -> int:
        if threading.current_thread() is threading.main_thread():
            return self._report.write(text)
        return sys.stderr.write(text)

    def flush(self) -> None:
        self._report.flush()
        sys.stderr.flush()

    def __getattr__(self, name):
        return getattr(self._report, name)


def release_stdout() -> None:
    """The command returned: whatever prints from now on (Ray's shutdown at exit) goes to stderr."""
    if isinstance(sys.stdout, _MainThreadStdout):
        sys.stdout.flush()
        sys.stdout = sys.stderr


def reserve_stdout() -> None:
    sys.stdout.flush()
    report = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = _MainThreadStdout(open(report, "w", buffering=1, encoding="utf-8", closefd=True))  # noqa: SIM115
