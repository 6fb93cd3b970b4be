"""`postrain wal serve|verify|dump`: the token WAL's log service and inspection tools."""
NAME = "wal"
HELP = "token write-ahead log: serve it over gRPC, verify a log directory, dump a trajectory"


def add_arguments(p):
    sub = p.add_subparsers(dest="wal_cmd", metavar="CMD")
    sub.required = True
    s = sub.add_parser("serve", help="serve a WAL directory over gRPC (binds 127.0.0.1 unless --host)")
    s.add_argument("--dir", required=True, help="log directory (created if missing)")
    s.add_argument("--port", type=int, default=None, help="TCP port (default from config: 50551; 0 = any free)")
    s.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1; others need --token)")
    s.add_argument("--token", default=None, help="shared secret clients must send (default: $POSTRAIN_WAL_TOKEN)")
    s.add_argument("--config", default=None, help="TOML with [wal] and [serve] tables (fields: wal/config.py)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. wal.segment_bytes=1048576")
    s.add_argument("--repair", action="store_true", help="if the log is corrupt in the middle, cut it there (cut bytes kept in DIR/torn/)")
    v = sub.add_parser("verify", help="scan a log directory without modifying it")
    v.add_argument("dir", help="log directory")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    d = sub.add_parser("dump", help="print every record of one trajectory (or sandbox) as JSON lines")
    d.add_argument("dir", help="log directory")
    d.add_argument("--traj", required=True, help="trajectory id (or sandbox id for environment records)")


def run(args) -> int:
    return {"serve": _serve, "verify": _verify, "dump": _dump}[args.wal_cmd](args)


def _serve(args) -> int:
    import os
    import signal
    import sys
    import threading

    from core.config import load
    from core.errors import UserError
    from wal.config import WALFileConfig
    from wal.errors import CorruptionError, LockedError
    from wal.server import Server

    flags = [f"serve.{k}={v}" for k, v in (("port", args.port), ("host", args.host)) if v is not None]
    cfg = load(WALFileConfig, args.config, list(args.set) + flags)  # bounds checked, one line on error
    token = args.token or os.environ.get("POSTRAIN_WAL_TOKEN") or None
    try:
        server = Server(args.dir, cfg.serve, cfg.wal, token=token, repair=args.repair)
    except (CorruptionError, LockedError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    rec = server.wal.recovery
    print(f"serving WAL {args.dir} on {server.address} (auth: {'token' if token else 'none'}; "
          f"recovered {rec.records} records, cut {rec.torn_bytes_cut} torn bytes)", flush=True)
    stop.wait()
    server.stop()
    print("stopped", file=sys.stderr)
    return 0


def _verify(args) -> int:
    import json

    from wal.verify import verify

    report = verify(args.dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['directory']}: {report['segments']} segments, {report['records']} records, "
              f"{report['trajectories']} live trajectories ({report['live_tokens']} tokens), {report['finalized']} finalized, "
              f"{report['bytes']} bytes; torn tail {report['torn_bytes_cut']} bytes; "
              + ("OK" if report["ok"] else f"CORRUPT: {report['corruption']}"))
    return 0 if report["ok"] else 1


def _dump(args) -> int:
    import json

    from wal.verify import dump

    import sys

    rows = dump(args.dir, args.traj)
    for row in rows:
        print(json.dumps(row))
    if not rows:
        print(f"postrain wal dump: no records of {args.traj!r} in {args.dir} (finalized and reclaimed, or never written)",
              file=sys.stderr)
    return 0 if rows else 1
