"""`postrain sandbox serve|call|log`: the tool sandbox service (gRPC, bubblewrap isolation, environment log)."""
NAME = "sandbox"
HELP = "tool sandbox service: `postrain sandbox serve --port P`; `call` and `log` talk to a running one"


def add_arguments(p):
    sub = p.add_subparsers(dest="sandbox_verb", metavar="SUBVERB")
    sub.required = True
    s = sub.add_parser("serve", help="serve tool calls over gRPC until interrupted",
                       description="Serve tool calls (calc, python, counter) isolated by bubblewrap; every call is "
                                   "recorded in the environment log under --log-dir and runs at most once.")
    s.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one; the chosen port is printed)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--token", default=None,
                   help="shared secret clients send as 'authorization: Bearer TOKEN' (default: $POSTRAIN_SANDBOX_TOKEN, "
                        "else LOG_DIR/token, created if absent)")
    s.add_argument("--log-dir", default="runs/sandbox", help="state dir: environment log, counters, token (default runs/sandbox)")
    s.add_argument("--max-concurrent", type=int, default=None, help="executions at once (default 8)")
    s.add_argument("--first-slot", type=int, default=None,
                   help="first execution slot (uid 61000 + slot; default 0): services on one host need disjoint ranges")
    s.add_argument("--max-queued", type=int, default=None, help="calls waiting for a slot before RESOURCE_EXHAUSTED (default 64)")
    s.add_argument("--wall-s", type=float, default=None, help="wall clock of one execution in seconds (default 5)")
    s.add_argument("--memory-mb", type=int, default=None,
                   help="memory of one whole execution, MiB, bounded by a memory cgroup (default 1024; 0: none)")
    s.add_argument("--memory-cgroup", choices=("auto", "required", "off"), default=None,
                   help="auto (default): a memory cgroup per slot where the service may create one, else memory is "
                        "bounded per process only; required: refuse to start without; off: none")
    s.add_argument("--allow-weaker-isolation", action="store_true", default=None,
                   help="start even where the seccomp filter or the ban on nested user namespaces is unavailable "
                        "(default: refuse, naming what is missing)")

    def client_args(c):
        c.add_argument("--target", default="127.0.0.1:50561", help="host:port of the service")
        c.add_argument("--token", default=None, help="shared secret (default: $POSTRAIN_SANDBOX_TOKEN, else LOG_DIR/token)")
        c.add_argument("--log-dir", default="runs/sandbox", help="where to find the token file (default runs/sandbox)")
        c.add_argument("--sandbox", required=True, help="sandbox id (one per trajectory)")

    c = sub.add_parser("call", help="run (or replay) one tool call and print its result as JSON")
    client_args(c)
    c.add_argument("--seq", type=int, default=None, help="call number (default: the sandbox's next)")
    c.add_argument("tool", help="calc, python or counter")
    c.add_argument("args", help="the tool's input, e.g. '37*41'")
    g = sub.add_parser("log", help="print a sandbox's recorded calls and results (fast-forward view) as JSON lines")
    client_args(g)


def _client_run(args) -> int:
    import json
    import os
    from pathlib import Path

    from core.errors import UserError

    from rewards.sandbox.client import SandboxClient, SandboxRefused
    from rewards.sandbox.server import TOKEN_ENV, TOKEN_FILE

    token = args.token or os.environ.get(TOKEN_ENV)
    path = Path(args.log_dir) / TOKEN_FILE
    if not token and path.exists():
        token = path.read_text().strip()
    if not token:
        raise UserError(f"no sandbox token: pass --token, set ${TOKEN_ENV}, or point --log-dir at the service's state dir")
    with SandboxClient(args.target, token, timeout_s=60, retries=2) as client:
        try:
            if args.sandbox_verb == "log":
                entries, nxt = client.entries(args.sandbox)
                for e in entries:
                    row = {"seq": e.seq, "tool": e.call.tool, "args": e.call.args, "in_flight": e.in_flight,
                           "result": None if e.result is None else _result_json(e.result.result)}
                    print(json.dumps(row))
                print(json.dumps({"next_seq": nxt}))
                return 0
            seq = args.seq if args.seq is not None else client.entries(args.sandbox)[1]
            res = client.execute(args.sandbox, seq, args.tool, args.args)
        except SandboxRefused as exc:
            raise UserError(f"sandbox refused: {exc}") from None
    print(json.dumps({"seq": seq, "replayed": res.replayed, **_result_json(res.result)}))
    return 0 if res.result.ok else 1


def _result_json(r) -> dict:
    return {"ok": r.ok, "output": r.output, "error_kind": r.error_kind, "error": r.error, "exit_code": r.exit_code,
            "wall_ms": r.wall_ms}


def run(args) -> int:
    if args.sandbox_verb != "serve":
        return _client_run(args)
    import signal
    import sys

    from pydantic import ValidationError

    from core.errors import UserError

    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.isolation import IsolationUnavailable
    from rewards.sandbox.server import SandboxServer

    fields = {"host": args.host, "port": args.port, "log_dir": args.log_dir, "max_concurrent": args.max_concurrent,
              "first_slot": args.first_slot,
              "max_queued": args.max_queued, "wall_s": args.wall_s,
              "memory_mb": args.memory_mb, "memory_cgroup": args.memory_cgroup,
              "allow_weaker_isolation": args.allow_weaker_isolation}
    try:
        cfg = SandboxConfig(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = f" {err['loc'][0]}" if err["loc"] else "s"  # a check across options has no single field
        raise UserError(f"bad sandbox option{where}: {err['msg']}") from None
    from wal.errors import WALError

    try:
        server = SandboxServer(cfg, token=args.token)
    except IsolationUnavailable as exc:
        raise UserError(f"sandbox isolation unavailable: {exc}") from None
    except WALError as exc:
        raise UserError(f"environment log under {cfg.log_dir}: {exc}") from None
    except OSError as exc:
        raise UserError(f"cannot start the sandbox service on {cfg.host}:{cfg.port}: {exc}") from None
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"postrain sandbox: serving on {server.target} (log dir {cfg.log_dir})", flush=True)
    sys.stdout.flush()
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
