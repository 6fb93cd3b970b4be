"""`postrain sft`: supervised fine-tuning on domain demonstrations."""
from deploy.commands._common import add_config_args

NAME = "sft"
HELP = "supervised fine-tuning on domain demonstrations (loss on completion tokens)"


def add_arguments(p):
    p.add_argument("--domain", action="append", help="domain to train on (repeatable; default: the config's)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides sft.steps)")
    p.add_argument("--init", help="start from this checkpoint (HF checkpoint directory or run directory) instead of a fresh policy")
    p.add_argument("--out", required=True, help="run directory; the policy goes to OUT/final/")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_args(p)


def run(args) -> int:
    import json

    from deploy.commands._common import default_config
    from deploy.job import run_sft
    from deploy.job_config import JobConfig
    from core import config

    overrides = list(args.overrides)
    if args.domain:
        overrides.append("sft.domains=" + json.dumps(args.domain))
    if args.steps is not None:
        overrides.append(f"sft.steps={args.steps}")
    cfg = config.load(JobConfig, args.config or default_config("job"), overrides)
    run_sft(cfg, args.out, init=args.init, quiet=args.quiet)
    return 0
