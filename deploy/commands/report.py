"""`postrain report RUN_DIR`: regenerate a pipeline run's report (also of a partly finished run)."""
NAME = "report"
HELP = "regenerate report.md / report.html / report.json of a pipeline run directory"


def add_arguments(p):
    p.add_argument("run_dir", help="a directory written by `postrain pipeline` (runs/NAME)")
    p.add_argument("--json", action="store_true", help="print report.json")


def run(args) -> int:
    import json
    from pathlib import Path

    from core.errors import UserError
    from deploy.pipeline_report import final_table, write_report

    if not (Path(args.run_dir) / "pipeline.json").is_file():
        raise UserError(f"report: {args.run_dir} is not a pipeline run (pipeline.json missing)")
    rep = write_report(args.run_dir)
    print(json.dumps(rep) if args.json else final_table(rep))
    return 0
