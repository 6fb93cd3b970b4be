"""`postrain bench NAME [args]`: run bench/NAME.py (each prints one JSON object)."""
NAME = "bench"
HELP = "run a benchmark from bench/ (prints JSON), or `report`: the targets of every latest result"


def add_arguments(p):
    import argparse

    p.add_argument("name", help="benchmark name: a module of bench/ (dashes or underscores), or report")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark (e.g. --json)")


def run(args) -> int:
    import importlib

    from core.errors import UserError

    module = args.name.replace("-", "_")
    try:
        if module.startswith("_"):
            raise ModuleNotFoundError(name=f"bench.{module}")
        mod = importlib.import_module(f"bench.{module}")
    except ModuleNotFoundError as exc:
        if exc.name != f"bench.{module}":
            raise
        import pkgutil

        import bench

        known = ", ".join(m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__)
                          if not m.name.startswith("_"))
        raise UserError(f"unknown benchmark {args.name!r}; known: {known or 'none yet'}") from None
    return int(mod.main(args.rest) or 0)
