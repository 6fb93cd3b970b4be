"""What isolation costs a tool call, like against like, and what the sandbox service sustains.

Isolation overhead: the same call (the calculator tool: `python -I -S` running the prelude, which sets
the rlimits and waits for its program on stdin, then the calculator) sandboxed and bare, measured in
pairs (the order alternates within the pairs, so drift of the shared machine hits both sides alike);
the figure is the median of the per-pair differences:
- `cold`: process start to result, both sides started at the call: bubblewrap (namespaces, the
  filesystem view, the seccomp filter, the uid drop) + interpreter against the interpreter alone;
- `warm`: both sides pre-started and waiting on stdin (as the service keeps one sandbox per slot),
  timed from handing over the program to the result: what isolation adds once start-up is off the
  critical path (bubblewrap's pid-1 reaper, namespace teardown, the filter on each system call).
Memory cgroup: the same cold sandbox with and without the per-slot memory cgroup (both isolation figures
above include it where the machine allows one, as the service does by default).
Service: `postrain sandbox serve` as a child process; each client thread owns a sandbox and issues
calls seq 0, 1, 2, … over gRPC (token auth, environment-log fsyncs, a fresh sandbox per call),
against `subprocess.run` of the same command with no isolation, log or gRPC, 1 and 8 clients.

    python -m bench.sandbox --json [--pairs N] [--calls-1 N] [--calls-8 N] [--out bench/results/sandbox.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._device import cpu_name, run_meta
from core.cli_args import positive_int

TOKEN = "sandbox-bench-token"
SLOT = 200  # execution uid of the in-process measurements, far above the service's slots
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}  # what a sandboxed tool sees
READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


def _pct(sorted_ms: list[float], q: float) -> float:
    i = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[i]


def _summary(lat_ms: list[float], wall_s: float | None = None) -> dict:
    s = sorted(lat_ms)
    out = {"calls": len(s), "p50_ms": round(_pct(s, 0.5), 2), "p99_ms": round(_pct(s, 0.99), 2),
           "mean_ms": round(sum(s) / len(s), 2)}
    if wall_s is not None:
        out["calls_per_s"] = round(len(s) / wall_s, 2)
    return out


def _leaf(pid: int) -> int:
    """The deepest first descendant of `pid` (the interpreter under bubblewrap's two processes)."""
    while True:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return pid
        if not kids:
            return pid
        pid = int(kids[0])


def wait_ready(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the prelude of `proc` blocks reading its program from stdin (read(0, ...))."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pre-started process exited with {proc.returncode}: {proc.stderr.read()[:300]!r}")
        try:
            fields = Path(f"/proc/{_leaf(proc.pid)}/syscall").read_text().split()
        except OSError:
            fields = []
        if len(fields) > 1 and fields[0] == str(READ_SYSCALL) and int(fields[1], 16) == 0:
            return
        time.sleep(0.002)
    raise RuntimeError("pre-started process not waiting on stdin in time")


def _drive(clients: int, calls: int, one_call) -> tuple[list[float], float]:
    """`clients` threads share `calls` calls; one_call(worker, expr, expected) raises on a wrong answer."""
    lat: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(w: int):
        rng = random.Random(w)
        mine = []
        try:
            for _ in range(calls // clients):
                a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
                t0 = time.perf_counter()
                one_call(w, f"{a}*{b}", str(a * b))
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


def isolation_pairs(pairs: int) -> dict:
    """Cold and warm: per pair, the same call sandboxed and bare; medians of the differences."""
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.isolation import UID_BASE, Isolator, encode_program, prelude_command
    from rewards.sandbox.tools import calc_program

    python = os.path.realpath(sys.executable)
    iso, limits = Isolator(), SandboxConfig().limits()  # the service's defaults: its memory cgroup too

    def bare_start() -> subprocess.Popen:
        return subprocess.Popen(prelude_command(python, limits, -1, limits.processes), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                close_fds=True, cwd="/tmp", env=SANDBOX_ENV)

    def sandbox_start() -> subprocess.Popen:
        return iso.prestart(python, limits, SLOT)

    def sandbox_without_cgroup_start() -> subprocess.Popen:
        return iso.prestart(python, limits._replace(memory_bytes=0), SLOT)

    def call(start, warm: bool, expr: str, expected: str) -> float:
        program = encode_program(*calc_program(expr))
        if warm:
            proc = start()
            wait_ready(proc)
        t0 = time.perf_counter()
        if not warm:
            proc = start()
        out = iso.collect(proc, limits, UID_BASE + SLOT, time.monotonic(), program)
        ms = (time.perf_counter() - t0) * 1000
        if out.stdout.decode().strip() != expected:
            raise RuntimeError(f"{expr} gave {out}")
        return ms

    try:
        rng = random.Random(0)
        result = {"memory_cgroup": iso.memory_note or f"cgroup v{iso.cgroups.version}, {limits.memory_bytes >> 20} MiB "
                                                      "per execution (the service's default)"}
        # (mode, the baseline side, warm); the last: what the memory cgroup alone adds to a cold sandbox
        modes = [("cold", bare_start, False), ("warm", bare_start, True)]
        if iso.cgroups is not None and limits.memory_bytes:
            modes.append(("cold_memory_cgroup", sandbox_without_cgroup_start, False))
        for mode, baseline, warm in modes:
            sand, bare, diff = [], [], []
            for i in range(pairs + 2):  # the first two pairs warm caches and are dropped
                a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
                expr, want = f"{a}*{b}", str(a * b)
                if i % 2:
                    s = call(sandbox_start, warm, expr, want)
                    p = call(baseline, warm, expr, want)
                else:
                    p = call(baseline, warm, expr, want)
                    s = call(sandbox_start, warm, expr, want)
                if i >= 2:
                    sand.append(s), bare.append(p), diff.append(s - p)
            result[mode] = {"sandboxed": _summary(sand), "bare": _summary(bare),
                            "overhead_p50_ms": round(_pct(sorted(diff), 0.5), 2),
                            "overhead_p90_ms": round(_pct(sorted(diff), 0.9), 2)}
    finally:
        iso.close()
    return result


def service(calls_1: int, calls_8: int, rounds: int) -> dict:
    from rewards.sandbox.client import SandboxClient
    from rewards.sandbox.launch import ServerProcess
    from rewards.sandbox.tools import calc_command

    python = os.path.realpath(sys.executable)

    def plain(w, expr, expected):
        out = subprocess.run(calc_command(python, expr), capture_output=True, timeout=30,
                             start_new_session=True).stdout.decode().strip()
        if out != expected:
            raise RuntimeError(f"plain {expr} gave {out!r}")

    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        srv = ServerProcess(Path(tmp) / "svc", TOKEN, extra=["--max-concurrent", "8"])
        clients = [SandboxClient(srv.target, TOKEN, timeout_s=30, retries=3) for _ in range(8)]
        next_seq = [0] * 8
        run_id = [0]

        def sandboxed(w, expr, expected):
            seq = next_seq[w]
            res = clients[w].execute(f"bench-{run_id[0]}-{w}", seq, "calc", expr)
            next_seq[w] = seq + 1
            if res.result.output.strip() != expected or res.replayed:
                raise RuntimeError(f"sandbox {expr} gave {res.result}")

        try:
            for w in range(8):  # warm-up: first-call costs (channel, page cache) stay out of the figures
                sandboxed(w, "2*3", "6")
                plain(w, "2*3", "6")
            variants = {"plain_subprocess": plain, "sandbox_service": sandboxed}
            lat = {(name, n): [] for name in variants for n in (1, 8)}
            wall = dict.fromkeys(lat, 0.0)
            for _ in range(rounds):  # variants alternate, so drift of the machine hits each alike
                for n, calls in ((1, calls_1), (8, calls_8)):
                    for name, fn in variants.items():
                        run_id[0] += 1
                        next_seq[:] = [0] * 8
                        ms, secs = _drive(n, calls // rounds, fn)
                        lat[(name, n)] += ms
                        wall[(name, n)] += secs
        finally:
            for c in clients:
                c.close()
            srv.stop()
    return {f"{name}_{n}_client{'s' if n > 1 else ''}": _summary(lat[(name, n)], wall[(name, n)]) for name, n in lat}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.sandbox", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one compact JSON object (default: indented)")
    ap.add_argument("--pairs", type=positive_int, default=60, help="sandboxed/bare pairs per mode (cold, warm)")
    ap.add_argument("--calls-1", type=positive_int, default=120, help="service calls per variant with 1 client")
    ap.add_argument("--calls-8", type=positive_int, default=320, help="service calls per variant with 8 clients")
    ap.add_argument("--rounds", type=positive_int, default=2, help="alternating rounds per service variant")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)

    from rewards.sandbox.isolation import probe

    reason = probe()
    if reason is not None:
        print(json.dumps({"error": f"sandbox isolation unavailable: {reason}"}))
        return 1
    if READ_SYSCALL is None:
        print(json.dumps({"error": f"no read(2) syscall number known for {platform.machine()}"}))
        return 1
    load_start = os.getloadavg()[0]
    iso = isolation_pairs(args.pairs)
    svc = service(args.calls_1, args.calls_8, args.rounds)
    cold, warm = iso["cold"]["overhead_p50_ms"], iso["warm"]["overhead_p50_ms"]
    cps8 = svc["sandbox_service_8_clients"]["calls_per_s"]
    result = {
        "benchmark": "sandbox",
        "device": cpu_name(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},  # the machine is shared
        "tool": "calc (rewards.calculator in a fresh `python -I -S` behind the sandbox prelude)",
        "isolation": "bubblewrap (net, pid, ipc, uts, cgroup namespaces; minimal read-only view; seccomp filter), "
                     "rlimits, a uid per slot, a memory cgroup per slot where the service may create one",
        "memory_cgroup": iso["memory_cgroup"],
        "method": "isolation_*: the same prelude + program sandboxed and bare, in pairs with alternating order; "
                  "overhead = median of per-pair differences; cold = start to result, warm = both pre-started and "
                  "waiting on stdin, program to result. service: gRPC + environment log + pre-started sandboxes, "
                  "against subprocess.run of the same command",
        "isolation_cold": iso["cold"],
        "isolation_warm": iso["warm"],
        # the same cold sandbox with and without its memory cgroup ("bare" = without)
        "memory_cgroup_cold": iso.get("cold_memory_cgroup"),
        **svc,
        "targets": {
            "isolation_overhead_cold_p50_ms": {"value": cold, "goal": "<= 50", "met": cold <= 50},
            "isolation_overhead_warm_p50_ms": {"value": warm, "goal": "<= 5", "met": warm <= 5},
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
