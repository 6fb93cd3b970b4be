"""What Python gRPC alone costs per durable step: the floor under `grpc_4_clients_vs_1` on the machine it runs on.

The WAL benchmark's gRPC target asks 4 clients to reach twice the tokens/s of 1. On C cores, 4 clients can at
best keep every core busy, so

    ratio <= C x (wall time of one client's step) / (CPU time of one step, service + client, with 4 clients)

This measures the right-hand side's denominator without the log: the stream shape of a WAL service on a
sync gRPC server with gRPC's older poller (the service itself runs on grpc.aio, see wal/server.py),
client stream on grpc.aio in the caller's thread, one request of the
B=512 step's size, one 16-byte acknowledgement), the server doing nothing but acknowledge (`--mode echo`) or a
`pwrite` + `fdatasync` of the request per message (`--mode fdatasync`, a log with no index, no checks and no
group commit). CPU per step comes from /proc of every process. If the echo floor alone, at 4 clients, costs
more CPU per step than one WAL client's step takes on the wall, no log behind this transport can reach the
target here.

    python -m bench.wal_grpc_floor --json [--wal-wall-us 543]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench._device import cpu_name as device, run_meta
from bench._device import process_cpu_s as _cpu_s
from core.cli_args import positive_float, positive_int

METHOD = "/floor.Echo/Stream"
ACK = b"\x08\x01\x10\x02" + b"\x00" * 12  # 16 bytes, like an AppendAck


def serve(mode: str, directory: str) -> None:
    from concurrent import futures

    from wal.grpc_poller import grpc

    fd = None
    if mode == "fdatasync":
        fd = os.open(os.path.join(directory, "log"), os.O_RDWR | os.O_CREAT, 0o644)
        os.pwrite(fd, b"\0" * (64 << 20), 0)
        os.fsync(fd)
    pos = [0]

    def stream(request_iterator, context):
        for raw in request_iterator:
            if fd is not None:
                os.pwrite(fd, raw, pos[0] % (60 << 20))
                pos[0] += len(raw)
                os.fdatasync(fd)
            yield ACK

    handler = grpc.method_handlers_generic_handler("floor.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), handlers=[handler],
                         options=[("grpc.max_receive_message_length", 16 << 20), ("grpc.so_reuseport", 0)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def _client(port: int, nbytes: int, commands, results) -> None:
    import asyncio

    from wal.grpc_poller import grpc

    loop = asyncio.new_event_loop()

    async def make():
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 16 << 20)])
        return ch.stream_stream(METHOD)(), ch
    call, _ch = loop.run_until_complete(make())
    payload = os.urandom(nbytes)

    async def step():
        await call.write(payload)
        await call.read()
    while (cmd := commands.get()) is not None:
        start_at, seconds = cmd
        time.sleep(max(0.0, start_at - time.time()))
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            loop.run_until_complete(step())
            n += 1
        results.put((n, time.perf_counter() - t0))


def measure(mode: str, nbytes: int, seconds: float, rounds: int, directory: str) -> dict:
    server = subprocess.Popen([sys.executable, "-m", "bench.wal_grpc_floor", "--serve", mode, "--dir", directory],
                              stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    ctx = mp.get_context("spawn")
    cmds, results = [ctx.Queue() for _ in range(4)], ctx.Queue()
    procs = [ctx.Process(target=_client, args=(port, nbytes, cmds[k], results), daemon=True) for k in range(4)]
    for p in procs:
        p.start()
    out: dict = {1: [], 4: []}
    try:
        for r in range(rounds + 1):  # round 0 warms up and is dropped
            for n in ((1, 4) if r % 2 == 0 else (4, 1)):
                pids = [server.pid] + [p.pid for p in procs[:n]]
                cpu0 = [_cpu_s(p) for p in pids]
                start_at = time.time() + 0.5
                for k in range(n):
                    cmds[k].put((start_at, seconds))
                got = [results.get(timeout=seconds + 120) for _ in range(n)]
                cpu1 = [_cpu_s(p) for p in pids]
                steps = sum(s for s, _ in got)
                if r:
                    out[n].append({"steps_s": steps / max(dt for _, dt in got),
                                   "server_cpu_us": 1e6 * (cpu1[0] - cpu0[0]) / steps,
                                   "clients_cpu_us": 1e6 * (sum(cpu1[1:]) - sum(cpu0[1:])) / steps})
    finally:
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
        server.terminate()
        server.wait(timeout=30)
    res = {}
    for n, xs in out.items():
        m = {k: round(statistics.median(x[k] for x in xs), 1) for k in xs[0]}
        m["wall_us_per_step"] = round(1e6 / m["steps_s"], 1)
        m["cpu_us_per_step"] = round(m["server_cpu_us"] + m["clients_cpu_us"], 1)
        res[f"clients{n}"] = m
    res["ratio_4_vs_1"] = round(res["clients4"]["steps_s"] / res["clients1"]["steps_s"], 3)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.wal_grpc_floor", description=__doc__.splitlines()[0])
    ap.add_argument("--serve", choices=("echo", "fdatasync"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--bytes", type=positive_int, default=6200, help="request size (a B=512 step: 512 x (4 + 8) bytes + ids)")
    ap.add_argument("--seconds", type=positive_float, default=1.0)
    ap.add_argument("--rounds", type=positive_int, default=4)
    ap.add_argument("--wal-wall-us", type=positive_float, default=None,
                    help="wall time of one WAL client's step (µs) from bench.wal, for the bound")
    ap.add_argument("--dir", default=None, help="where the fdatasync server writes (default: a temp dir under /tmp)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.dir)
        return 0
    cores = len(os.sched_getaffinity(0))
    result = {"benchmark": "wal_grpc_floor", "device": device(), "cores": cores, "request_bytes": args.bytes,
              "load_average_1m_at_start": round(os.getloadavg()[0], 2)}
    root = tempfile.mkdtemp(prefix="grpc-floor-", dir=args.dir)
    try:
        for mode in ("echo", "fdatasync"):
            result[mode] = measure(mode, args.bytes, args.seconds, args.rounds, root)
            if not args.json:
                print(mode, json.dumps(result[mode]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # the best ratio any log behind this transport could reach, for a WAL whose one-client step takes wal_wall_us
    wall1 = args.wal_wall_us or result["fdatasync"]["clients1"]["wall_us_per_step"]
    result["bound"] = {"one_client_wall_us": wall1, "floor_cpu_us_4_clients": result["echo"]["clients4"]["cpu_us_per_step"],
                       "max_ratio_4_vs_1": round(cores * wall1 / result["echo"]["clients4"]["cpu_us_per_step"], 3)}
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["meta"] = run_meta(result.get("device"))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
