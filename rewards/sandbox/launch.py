"""Start `postrain sandbox serve` as a child process and wait until it serves (used by tests and bench)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

_READY_RE = re.compile(r"serving on (\S+):(\d+)")


class ServerProcess:
    """A service in its own process: `.target`, `.kill()` (SIGKILL), `.stop()` (SIGTERM)."""

    def __init__(self, log_dir: Path, token: str, port: int = 0, extra: list[str] = (), ready_timeout_s: float = 60.0):
        cmd = [sys.executable, "-m", "deploy.cli", "sandbox", "serve", "--port", str(port), "--log-dir", str(log_dir),
               "--token", token, *extra]
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.out_path = Path(log_dir) / f"serve.{time.time_ns()}.out"  # a file, not a pipe: never blocks the child
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = _READY_RE.search(self.out_path.read_text())
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("sandbox service did not start:\n" + self.out_path.read_text()[-2000:])

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def kill(self) -> None:
        """SIGKILL the service (and, through --die-with-parent, every sandbox it runs)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
