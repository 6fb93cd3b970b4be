"""`postrain drill`: fault-injection drills on real processes, files and connections, with a verdict."""

NAME = "drill"
HELP = "fault-injection drills: inject real faults on a seeded schedule, check nothing is lost, report a verdict"


def add_arguments(p):
    p.add_argument("names", nargs="*", metavar="NAME", help="drills to run (see --list)")
    p.add_argument("--all", action="store_true", help="run every drill of the catalog")
    p.add_argument("--list", action="store_true", help="print the catalog and exit")
    p.add_argument("--trials", type=int, help="faults per drill (default: each drill's own count)")
    p.add_argument("--fast", action="store_true", help="each drill's fast variant: the fewest faults that check it "
                   "(1-2 per kind, about 2 minutes for --all on 2 cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of every fault schedule")
    p.add_argument("--out", default="runs/drill", help="directory for drill.json, drill.png and the drills' work")
    p.add_argument("--json", action="store_true", help="print drill.json instead of the table")


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from chaos.catalog import DRILLS
    from core.errors import UserError

    if args.list:
        width = max(map(len, DRILLS))
        for d in DRILLS.values():
            print(f"{d.name.ljust(width)}  {d.default_faults:4d} faults per kind ({d.fast_faults} with --fast)  {d.what}")
        return 0
    if args.all == bool(args.names):
        raise UserError("drill: name drills to run, or pass --all (--list shows the catalog)")
    unknown = [n for n in args.names if n not in DRILLS]
    if unknown:
        raise UserError(f"drill: unknown drill(s) {', '.join(unknown)}; known: {', '.join(DRILLS)}")
    if args.trials is not None and args.trials < 1:
        raise UserError("drill: --trials must be >= 1")
    if args.fast and args.trials is not None:
        raise UserError("drill: --fast sets each drill's fault count; leave out --trials")
    if args.seed < 0:
        raise UserError("drill: --seed must be >= 0")
    from chaos.runner import run_drills, table, write

    out = Path(args.out)

    def progress(s):
        if not args.json:
            print(f"{s['name']}: {s['faults_injected']} faults in {s['elapsed_s']:.1f} s, {s['verdict']}",
                  file=sys.stderr, flush=True)

    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # Ray and the services print notices; stdout keeps the report
        report = run_drills(list(DRILLS) if args.all else args.names, out, args.seed, args.trials, progress,
                            fast=args.fast)
        write(report, out)
    print(json.dumps(report) if args.json else table(report) + f"\n-> {out}/drill.json, {out}/drill.png", flush=True)
    return 0 if report["verdict"] == "pass" else 1
