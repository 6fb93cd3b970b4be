"""wal-service-kill: `postrain wal serve` (a real child process) is SIGKILLed while a client streams
appends and commits to it over gRPC, then restarted on the same port and directory. The client
reconnects and retries on its own; every commit it saw acknowledged is in the log, once.

Faults wait for progress: each kill comes after the client has committed a random number of steps
since the previous restart, so it lands mid-stream. Recovery: from the kill to the client's next
acknowledged commit.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

from chaos.drill import DrillContext, DrillResult, Event

TRAJS, PER = 3, 5


def _tok(t: int, p: int) -> int:
    return (t * 100_003 + p * 13) % 32_000


def _start(directory, port: int) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "wal", "serve", "--dir", str(directory),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    m = re.search(r"on 127\.0\.0\.1:(\d+)", proc.stdout.readline())
    if not m:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"postrain wal serve did not start on port {port}")
    return proc, int(m.group(1))


def wal_service_kill(ctx: DrillContext, n: int) -> DrillResult:
    import wal
    from wal.verify import verify

    res = DrillResult("wal-service-kill", {"wal_service_sigkill": n})
    rng = random.Random(ctx.seed + 21)
    directory = ctx.work("wal-service-kill") / "log"
    proc, port = _start(directory, 0)
    state = {"steps": 0, "t_ack": 0.0, "stop": False}
    errors: list[BaseException] = []

    def client_loop():
        try:
            c = wal.connect(f"127.0.0.1:{port}", retry_s=120)
            s = 0
            while not state["stop"]:
                for t in range(TRAJS):
                    c.append(f"t{t}", s * PER, [_tok(t, s * PER + i) for i in range(PER)], [-0.5] * PER, 0)
                c.commit()
                s += 1
                state["steps"], state["t_ack"] = s, time.monotonic()
            state["reconnects"] = c.reconnects
            c.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    th = threading.Thread(target=client_loop, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        for _ in range(n):
            want = state["steps"] + rng.randint(1, 20)
            deadline = time.monotonic() + 120
            while state["steps"] < want and th.is_alive() and time.monotonic() < deadline:
                time.sleep(0.001)
            if not th.is_alive() or state["steps"] < want:
                res.shortfall = f"the client stopped committing ({errors[:1] or 'timeout'})"
                break
            time.sleep(rng.random() * 0.003)
            t_kill = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            steps_at_kill = state["steps"]
            proc, _ = _start(directory, port)
            while state["steps"] <= steps_at_kill + 1 and th.is_alive() and time.monotonic() < t_kill + 120:
                time.sleep(0.001)
            back = state["steps"] > steps_at_kill + 1  # a commit entirely after the restart was acknowledged
            res.events.append(Event("wal_service_sigkill", t_kill - t0, round(state["t_ack"] - t_kill, 6) if back else None))
        state["stop"] = True
        th.join(120)
        acked = state["steps"]
        c = wal.connect(f"127.0.0.1:{port}")
        for t in range(TRAJS):
            got = c.tokens(f"t{t}")
            res.tokens_lost += max(0, acked * PER - len(got))
            res.tokens_resampled += sum(1 for p, x in enumerate(got) if x != _tok(t, p))
        c.close()
    finally:
        state["stop"] = True
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    report = verify(directory)
    res.wall_s = time.monotonic() - t0
    res.detail = {"acknowledged_steps": state["steps"], "reconnects": state.get("reconnects"),
                  "log_tokens": report["tokens"], "errors": [repr(e)[:200] for e in errors]}
    res.checks["the client finished without an error"] = not errors and not th.is_alive()
    res.checks["no retried batch written twice"] = report["ok"] and report["tokens"] == TRAJS * state["steps"] * PER
    return res
