"""sandbox-kill: the tool sandbox service (`postrain sandbox serve`, a real child process) is SIGKILLed
while a non-idempotent tool call (`counter`, which holds, then increments a counter in the service's
state) is in flight, and restarted on the same port and log.

The caller retries until the restarted service answers: with the recorded result when the call
finished before the kill (a replay), or with ABORTED when its invocation is logged without a result,
which is never run again. Checked per call: a returned result was executed exactly once (the counter
moved by one), an aborted call at most once, and asking again returns the same answer without running
the tool.
"""
from __future__ import annotations

import random
import threading
import time

from chaos.drill import DrillContext, DrillResult, Event

TOKEN = "sandbox-drill-token"


def _counter(log_dir) -> int:
    path = log_dir / "counters" / "c"
    return int(path.read_text()) if path.exists() else 0


def _in_flight(client, sandbox: str, seq: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        entries, _ = client.entries(sandbox)
        if any(e.seq == seq and e.in_flight for e in entries):
            return True
        time.sleep(0.01)
    return False


def sandbox_kill(ctx: DrillContext, n: int) -> DrillResult:
    from rewards.sandbox.client import InvocationAborted, SandboxClient
    from rewards.sandbox.isolation import probe
    from rewards.sandbox.launch import ServerProcess

    res = DrillResult("sandbox-kill", {"sandbox_sigkill": n})
    missing = probe()
    if missing is not None:
        res.shortfall = f"sandbox isolation unavailable: {missing}"
        return res
    rng = random.Random(ctx.seed + 5)
    log_dir = ctx.work("sandbox-kill") / "svc"
    srv = ServerProcess(log_dir, TOKEN)
    port = srv.port
    client = SandboxClient(srv.target, TOKEN, timeout_s=30, retries=400, backoff_s=0.05)
    outcomes = {"result": 0, "replayed": 0, "aborted": 0, "aborted_after_effect": 0}
    mismatched_answers = 0
    t0 = time.monotonic()
    seq = 0
    try:
        while len(res.events) < n and seq < 3 * n:
            hold = rng.choice([150, 300, 600])
            before = _counter(log_dir)
            answer: dict = {}

            def call(s=seq, h=hold):
                try:
                    answer["result"] = client.execute("drill", s, "counter", f"c {h}")
                except InvocationAborted as exc:
                    answer["aborted"] = exc
                answer["t"] = time.monotonic()

            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            if not _in_flight(client, "drill", seq, time.monotonic() + 30):
                caller.join(60)
                seq += 1
                continue
            time.sleep(rng.random() * hold * 1.3 / 1000)  # in the hold, or just after the increment
            if answer:  # the call already returned: this kill would hit no call
                caller.join(60)
                seq += 1
                continue
            t_kill = time.monotonic()
            srv.kill()
            srv = ServerProcess(log_dir, TOKEN, port=port)
            caller.join(120)
            delta = _counter(log_dir) - before
            res.duplicate_side_effects += max(0, delta - 1)
            ok = "t" in answer
            if "result" in answer:
                outcomes["replayed" if answer["result"].replayed else "result"] += 1
                ok = ok and delta == 1 and answer["result"].result.output == str(_counter(log_dir))
                again = client.execute("drill", seq, "counter", f"c {hold}")
                same = again.replayed and again.raw == answer["result"].raw
            else:
                outcomes["aborted"] += 1
                outcomes["aborted_after_effect"] += delta == 1
                try:
                    client.execute("drill", seq, "counter", f"c {hold}")
                    same = False
                except InvocationAborted:
                    same = True
            same = same and _counter(log_dir) - before == delta  # asking again ran nothing
            mismatched_answers += not same
            ok = ok and same
            res.events.append(Event("sandbox_sigkill", t_kill - t0, round(answer["t"] - t_kill, 6) if ok else None))
            seq += 1
    finally:
        client.close()
        srv.kill()
    res.wall_s = time.monotonic() - t0
    if len(res.events) < n:
        res.shortfall = f"{seq} calls made, {len(res.events)} of them still in flight at the kill"
    res.completed = res.calm_completed = None
    res.detail = {"outcomes": outcomes, "calls": seq, "counter": _counter(log_dir)}
    res.checks["asking again returns the same answer and runs nothing"] = mismatched_answers == 0
    return res
