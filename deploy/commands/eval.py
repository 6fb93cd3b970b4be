"""`postrain eval`: pass@1 of a checkpoint on domains' eval splits."""
from deploy.commands._common import add_config_args

NAME = "eval"
HELP = "pass@1 of a checkpoint on each domain's eval split"


def add_arguments(p):
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory, or a run directory holding one as final/ (e.g. runs/NAME)")
    p.add_argument("--domain", action="append", help="domain (repeatable; default: every domain)")
    p.add_argument("--n", type=int, help="eval prompts per domain (overrides eval.n)")
    p.add_argument("--seed", type=int, help="prompt and sampling seed (overrides eval.seed)")
    p.add_argument("--json", action="store_true", help="print one JSON object per domain")
    add_config_args(p)


def run(args) -> int:
    import json

    import rewards
    from core import config
    from deploy.commands._common import default_config
    from deploy.job_config import JobConfig
    from learner.evaluate import evaluate
    from core.hf import load_policy

    overrides = list(args.overrides)
    if args.n is not None:
        overrides.append(f"eval.n={args.n}")
    if args.seed is not None:
        overrides.append(f"eval.seed={args.seed}")
    cfg = config.load(JobConfig, args.config or default_config("job"), overrides).eval
    names = args.domain or rewards.domains()
    for name in names:
        rewards.domain(name)  # unknown domain: fail before loading the model
    model, tok = load_policy(args.checkpoint)
    for name in names:
        res = evaluate(model, tok, name, cfg)
        if args.json:
            print(json.dumps({k: v for k, v in res.items() if k != "samples"}), flush=True)
        else:
            print(f"{name:10s} pass@1={res['pass_at_1']:.3f}  n={res['n']}", flush=True)
    return 0
