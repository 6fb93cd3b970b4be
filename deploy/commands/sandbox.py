"""`postrain sandbox serve`: the tool sandbox service (gRPC, bubblewrap isolation, environment log)."""
NAME = "sandbox"
HELP = "tool sandbox service: `postrain sandbox serve --port P`"


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
    s.add_argument("--max-queued", type=int, default=None, help="calls waiting for a slot before RESOURCE_EXHAUSTED (default 64)")
    s.add_argument("--wall-s", type=float, default=None, help="wall clock of one execution in seconds (default 5)")


def run(args) -> int:
    import signal
    import sys

    from pydantic import ValidationError

    from deploy.errors import UserError

    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.isolation import IsolationUnavailable
    from rewards.sandbox.server import SandboxServer

    fields = {"host": args.host, "port": args.port, "log_dir": args.log_dir, "max_concurrent": args.max_concurrent,
              "max_queued": args.max_queued, "wall_s": args.wall_s}
    try:
        cfg = SandboxConfig(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UserError(f"bad sandbox option {err['loc'][0]}: {err['msg']}") from None
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
