"""Sandbox service throughput and latency for the calculator tool, against plain `subprocess.run`.

Measured in one run, same interpreter, same calculator entry point, same expressions:
- `sandbox`: `postrain sandbox serve` as a child process; each client thread owns a sandbox and issues
  calls seq 0, 1, 2, … over gRPC (token auth, env-log invoke + result fsyncs, a fresh bubblewrap sandbox
  per call with rlimits and its slot's uid). The service pre-starts one sandbox per slot, so a call
  finds one booted and waiting for its program when the service is not saturated;
- `isolation_only` (1 client): a sandbox started cold for each call, in-process, no gRPC and no log
  (what isolation costs when nothing is pre-started);
- `plain_subprocess`: `subprocess.run` of the same command, no isolation, no log (the baseline), started
  in a new session as bubblewrap starts the tool (kernel autogroup scheduling gives every session its own
  CPU share, which on a loaded shared machine would otherwise favour the sandbox);
  `plain_subprocess_same_session`: the same in the caller's session.
Runs alternate in rounds so drift of the shared machine hits every variant alike.

    python -m bench.sandbox --json [--calls-1 N] [--calls-8 N] [--out bench/results/sandbox.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._device import cpu_name, run_meta

TOKEN = "bench-token"


def _autogroup() -> bool | None:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def _pct(sorted_ms: list[float], q: float) -> float:
    i = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[i]


def _summary(lat_ms: list[float], wall_s: float) -> dict:
    s = sorted(lat_ms)
    return {"calls": len(s), "calls_per_s": round(len(s) / wall_s, 2), "p50_ms": round(_pct(s, 0.5), 2),
            "p99_ms": round(_pct(s, 0.99), 2), "mean_ms": round(sum(s) / len(s), 2)}


def _drive(clients: int, calls: int, one_call) -> tuple[list[float], float]:
    """`clients` threads share `calls` calls; one_call(worker, i, expr, expected) raises on a wrong answer."""
    lat: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(w: int):
        rng = random.Random(w)
        mine = []
        try:
            for i in range(calls // clients):
                a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
                t0 = time.perf_counter()
                one_call(w, i, f"{a}*{b}", str(a * b))
                mine.append((time.perf_counter() - t0) * 1000)
        except BaseException as exc:  # reported after join
            errors.append(exc)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return lat, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.sandbox", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one compact JSON object (default: indented)")
    ap.add_argument("--calls-1", type=int, default=120, help="calls per variant with 1 client")
    ap.add_argument("--calls-8", type=int, default=320, help="calls per variant with 8 clients")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per variant")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)

    from rewards.sandbox.client import SandboxClient
    from rewards.sandbox.isolation import Isolator, probe
    from rewards.sandbox.launch import ServerProcess
    from rewards.sandbox.tools import calc_command, calc_program
    from rewards.sandbox.types import Limits

    reason = probe()
    if reason is not None:
        print(json.dumps({"error": f"sandbox isolation unavailable: {reason}"}))
        return 1
    python = os.path.realpath(sys.executable)
    iso = Isolator()

    def plain(w, i, expr, expected, new_session=True):
        out = subprocess.run(calc_command(python, expr), capture_output=True, timeout=30,
                             start_new_session=new_session).stdout.decode().strip()
        if out != expected:
            raise RuntimeError(f"plain {expr} gave {out!r}")

    def plain_same_session(w, i, expr, expected):
        plain(w, i, expr, expected, new_session=False)

    def isolated(w, i, expr, expected):
        out = iso.run_python(python, *calc_program(expr), Limits(), slot=60 + w).stdout.decode().strip()
        if out != expected:
            raise RuntimeError(f"isolated {expr} gave {out!r}")

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        srv = ServerProcess(Path(tmp) / "svc", TOKEN, extra=["--max-concurrent", "8"])
        clients = [SandboxClient(srv.target, TOKEN, timeout_s=30, retries=3) for _ in range(8)]
        next_seq = [0] * 8
        run_id = [0]

        def sandboxed(w, i, expr, expected):
            seq = next_seq[w]
            res = clients[w].execute(f"bench-{run_id[0]}-{w}", seq, "calc", expr)
            next_seq[w] = seq + 1
            if res.result.output.strip() != expected or res.replayed:
                raise RuntimeError(f"sandbox {expr} gave {res.result}")

        try:
            for w in range(8):  # warm-up: first-call costs (channel, page cache) stay out of the figures
                sandboxed(w, 0, "2*3", "6")
                plain(w, 0, "2*3", "6")
            variants = {"plain_subprocess": plain, "plain_subprocess_same_session": plain_same_session,
                        "sandbox": sandboxed}
            lat = {(name, n): [] for name in variants for n in (1, 8)} | {("isolation_only", 1): []}
            wall = dict.fromkeys(lat, 0.0)
            for _ in range(args.rounds):
                for n, calls in ((1, args.calls_1), (8, args.calls_8)):
                    todo = [*variants.items(), *([("isolation_only", isolated)] if n == 1 else [])]
                    for name, fn in todo:
                        run_id[0] += 1
                        next_seq[:] = [0] * 8
                        ms, secs = _drive(n, calls // args.rounds, fn)
                        lat[(name, n)] += ms
                        wall[(name, n)] += secs
        finally:
            for c in clients:
                c.close()
            srv.stop()

    figures = {f"{name}_{n}_client{'s' if n > 1 else ''}": _summary(lat[(name, n)], wall[(name, n)]) for name, n in lat}
    overhead = figures["sandbox_1_client"]["p50_ms"] - figures["plain_subprocess_1_client"]["p50_ms"]
    cps8 = figures["sandbox_8_clients"]["calls_per_s"]
    result = {
        "benchmark": "sandbox",
        "device": cpu_name(),
        "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},  # the machine is shared
        "tool": "calc (rewards.calculator in a fresh `python -I -S`)",
        "baseline": "plain subprocess.run of the same command: no isolation, no log, no gRPC; in a new session "
                    "like the sandboxed tool (with kernel autogroup scheduling a new session gets its own CPU share "
                    "on a loaded machine); *_same_session: the same without a new session",
        "sched_autogroup": _autogroup(),
        "sandbox_mode": "service pre-starts one sandbox per slot (booted, waiting for its program); "
                        "isolation_only starts each sandbox cold",
        **figures,
        "isolation_only_overhead_p50_ms": round(figures["isolation_only_1_client"]["p50_ms"]
                                                - figures["plain_subprocess_1_client"]["p50_ms"], 2),
        "calls_per_s_ratio_8_clients": round(cps8 / figures["plain_subprocess_8_clients"]["calls_per_s"], 3),
        "targets": {
            "isolation_overhead_p50_ms": {"value": round(overhead, 2), "goal": "<= 50", "met": overhead <= 50},
            "calls_per_s_8_clients": {"value": cps8, "goal": ">= 20", "met": cps8 >= 20},
        },
    }
    result["meta"] = run_meta(result.get("device"))
    text = json.dumps(result, indent=None if args.json else 2)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
