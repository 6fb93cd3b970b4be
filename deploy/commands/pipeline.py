"""`postrain pipeline`: SFT -> specialists -> OPD merge -> evaluate -> report, one resumable job."""
from deploy.commands._common import add_config_args

NAME = "pipeline"
HELP = "the whole loop into runs/NAME/: SFT, one GRPO specialist per domain, OPD merge, evaluation, report"


def add_arguments(p):
    p.add_argument("--name", default="default", help="run name: outputs go to RUNS/NAME/")
    p.add_argument("--runs", default="runs", help="parent directory of run directories")
    p.add_argument("--chaos", type=int, metavar="SEED", help="inject rollout faults in every training stage")
    p.add_argument("--quick", action="store_true", help="the config's [quick] overrides: a smoke run in minutes")
    p.add_argument("--force", action="store_true", help="accept a changed config for an existing run directory "
                                                        "(stages whose settings changed run again, and those after)")
    p.add_argument("--json", action="store_true", help="print report.json at the end")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_config_args(p)


def run(args) -> int:
    import json

    from core import config
    from deploy.commands._common import default_config
    from deploy.pipeline import run_pipeline
    from deploy.pipeline_config import PipelineConfig
    from deploy.pipeline_report import final_table

    cfg = config.load(PipelineConfig, args.config or default_config("pipeline"), args.overrides)
    rep = run_pipeline(cfg, args.name, args.runs, chaos=args.chaos, quick=args.quick, force=args.force,
                       quiet=args.quiet or args.json)
    if args.json:
        print(json.dumps(rep))
    else:
        print(final_table(rep))
        print(f"report: {args.runs}/{args.name}/report.md (and .html, .json); total {rep['wall_min']} min")
    return 0
