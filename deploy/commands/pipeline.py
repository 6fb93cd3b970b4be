"""`postrain pipeline`: SFT -> specialists -> OPD merge -> evaluate -> report, one resumable job."""
from core.cli_args import nonneg_int, run_name
from deploy.commands._common import add_cluster_args, add_config_args

NAME = "pipeline"
HELP = "the whole loop into runs/NAME/: SFT, one GRPO specialist per domain, OPD merge, evaluation, report"


def add_arguments(p):
    p.add_argument("--name", type=run_name, default="default", help="run name: outputs go to RUNS/NAME/")
    p.add_argument("--runs", default="runs", help="parent directory of run directories")
    p.add_argument("--chaos", type=nonneg_int, metavar="SEED", help="inject rollout faults in every training stage")
    p.add_argument("--quick", action="store_true", help="the config's [quick] overrides: a smoke run in minutes")
    p.add_argument("--force", action="store_true", help="accept a changed config for an existing run directory "
                                                        "(stages whose settings changed run again, and those after)")
    p.add_argument("--json", action="store_true", help="print report.json at the end")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_config_args(p)
    add_cluster_args(p)


def run(args) -> int:
    import json

    from core import config
    from deploy.commands._common import default_config
    from deploy.pipeline import refuse_uri, run_pipeline
    from deploy.pipeline_config import PipelineConfig
    from deploy.pipeline_report import final_table

    cfg = config.load(PipelineConfig, args.config or default_config("pipeline"), args.overrides)
    refuse_uri("--runs", args.runs)  # before a dry run probes it as a path
    if args.cluster or args.ray_address or args.dry_run:
        _cluster(args, cfg)
        if args.dry_run:
            return 0
    rep = run_pipeline(cfg, args.name, args.runs, chaos=args.chaos, quick=args.quick, force=args.force,
                       quiet=args.quiet or args.json)
    if args.json:
        print(json.dumps(rep))
    else:
        print(final_table(rep))
        print(f"report: {args.runs}/{args.name}/report.md (and .html, .json); total {rep['wall_min']} min")
    return 0


def _cluster(args, cfg) -> None:
    """The stages run on the cluster: they inherit the file and the address through the environment. A dry run
    checks what the GRPO and OPD stages will need (their configs with the cluster file laid under them)."""
    import os
    from pathlib import Path

    from core import config
    from deploy.cluster import CLUSTER_ENV, ClusterRun
    from deploy.cluster_check import check
    from deploy.commands._common import default_config
    from deploy.grpo_config import GRPOLoopConfig

    if args.cluster:
        os.environ[CLUSTER_ENV] = str(Path(args.cluster).resolve())
    if args.ray_address:
        os.environ["RAY_ADDRESS"] = args.ray_address
    if args.dry_run:
        cluster = ClusterRun(args, "grpo", Path(args.runs) / args.name, tools=True)
        spec = cfg.specialists
        path = Path(default_config("pipeline")).parent / spec.config
        grpo = config.load(GRPOLoopConfig, path, cluster.overrides + list(spec.set))
        check(cluster, grpo, grpo.loop.catalog)
