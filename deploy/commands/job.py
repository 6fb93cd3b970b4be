"""`postrain job`: the main job on the embedded default (today: SFT on every domain, then eval)."""
from core.cli_args import run_name
from deploy.commands._common import add_config_args

NAME = "job"
HELP = "run the main pipeline job (SFT then eval on every domain) into runs/NAME/"


def add_arguments(p):
    p.add_argument("--name", type=run_name, default="default", help="run name: outputs go to runs/NAME/")
    p.add_argument("--runs", default="runs", help="parent directory of run directories")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_config_args(p)


def run(args) -> int:
    from pathlib import Path

    from core import config
    from deploy.commands._common import default_config
    from deploy.job import run_job
    from deploy.job_config import JobConfig

    cfg = config.load(JobConfig, args.config or default_config("job"), args.overrides)
    run_job(cfg, Path(args.runs) / args.name, quiet=args.quiet)
    return 0
