"""`postrain bench NAME [args]`: run bench/NAME.py (each prints one JSON object)."""
NAME = "bench"
HELP = "run a benchmark from bench/ (wal, dataplane, sandbox, rollout, grpo, kl, power-loss); prints JSON"


def add_arguments(p):
    import argparse

    p.add_argument("name", help="benchmark name: a module of bench/ (a dash stands for an underscore: power-loss)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark (e.g. --json)")


def run(args) -> int:
    import importlib

    from core.errors import UserError

    name = args.name.replace("-", "_")
    try:
        mod = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"bench.{name}":
            raise
        import pkgutil

        import bench

        known = ", ".join(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))
        raise UserError(f"unknown benchmark {args.name!r}; known: {known or 'none yet'}") from None
    return int(mod.main(args.rest) or 0)
