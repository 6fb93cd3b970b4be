"""The `postrain` command. Each verb is a module in `deploy/commands/` exposing NAME, HELP,
`add_arguments(parser)` and `run(args) -> int`; those modules import only argparse-level things at top
level so that `postrain --help` stays instant, and do their heavy imports inside `run`."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback

from core.progress import quiet_library_bars
from deploy import commands
from deploy.json_stdout import release_stdout, reserve_stdout


def _verb_modules():
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"deploy.commands.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="postrain",
        description="Agentic RL post-training: SFT -> specialist GRPO -> multi-teacher on-policy distillation.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for mod in _verb_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _one_line(exc: BaseException) -> str:
    from core.errors import UserError

    exc = _unwrap_remote(exc)
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, KeyError) and type(exc) is not KeyError:  # e.g. rewards.UnknownDomain
        return str(exc)
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return f"{exc.strerror}: {exc.filename}"
    return f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)"


def _unwrap_remote(exc: BaseException) -> BaseException:
    """The error a Ray actor or task raised, out of the RayTaskError (a multi-line remote traceback with
    terminal colours) that carries it; ray is imported only when already loaded."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    while ray_exceptions is not None and isinstance(exc, ray_exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_library_bars(getattr(args, "quiet", False))
    if argv is None and getattr(args, "json", False):  # run as a program: stdout is the report's alone
        reserve_stdout()
    try:
        code = args._run(args)
    except KeyboardInterrupt:
        print("postrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # operating errors: one line, unless --debug
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"postrain {args.verb}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    finally:
        release_stdout()
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
