"""`postrain rollout`: N episodes of a domain through preemptible Ray rollout workers (optionally under chaos)."""
from core.cli_args import nonneg_int, positive_int
from deploy.commands._common import add_cluster_args, add_config_args

NAME = "rollout"
HELP = "roll out N episodes of a domain with Ray workers that survive preemption and kills (--chaos injects faults)"


def add_arguments(p):
    p.add_argument("--checkpoint", required=True, help="HF causal-LM checkpoint directory, or a run directory holding one "
                   "as final/ (a path or a pyarrow.fs URI)")
    p.add_argument("--domain", required=True, help="task domain (see `postrain domains`)")
    p.add_argument("--n", type=positive_int, default=16, help="episodes to roll out")
    p.add_argument("--workers", type=positive_int, help="rollout workers (overrides pool.workers)")
    p.add_argument("--seed", type=nonneg_int, help="run seed: trajectory ids and sampling (overrides pool.seed)")
    p.add_argument("--chaos", type=nonneg_int, metavar="SEED", help="inject faults on a schedule drawn from SEED")
    p.add_argument("--faults", type=nonneg_int, default=5, help="faults injected under --chaos (default 5: one of each kind); "
                   "a run that ends before all of them fired fails and says why")
    p.add_argument("--out", required=True, help="run directory (must be empty or absent): a path or a pyarrow.fs URI "
                   "(file:///abs/dir, s3://bucket/prefix, ...)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_args(p)
    add_cluster_args(p)


def run(args) -> int:
    import json

    from core import config
    from deploy.commands._common import default_config
    from core.errors import UserError
    from rollout.config import RolloutConfig
    from rollout.run import rollout_run

    overrides = list(args.overrides)
    if args.workers is not None:
        overrides.append(f"pool.workers={args.workers}")
    if args.seed is not None:
        overrides.append(f"pool.seed={args.seed}")
    import rewards
    from deploy.cluster import ClusterRun

    try:
        tools = rewards.domain(args.domain).uses_tools
    except rewards.UnknownDomain as exc:
        raise UserError(str(exc)) from None
    from deploy.run_storage import RunStorage, check_local_checkpoints, local_checkpoint

    storage = RunStorage(args.out, "rollout")
    cluster = ClusterRun(args, "rollout", storage.local, tools=tools, uri=storage.remote and storage.out)
    cfg = config.load(RolloutConfig, args.config or default_config("rollout"),
                      cluster.overrides + storage.overrides() + overrides)
    if args.dry_run:
        from deploy.cluster_check import check

        check(cluster, cfg, cluster.c.storage.catalog, checkpoint=args.checkpoint)
        return 0
    injector = None
    if args.chaos is not None:
        from chaos.pool_faults import PoolInjector
        from chaos.schedule import schedule

        injector = PoolInjector(schedule(args.chaos, cfg.pool.workers, args.faults), seed=args.chaos)
    check_local_checkpoints(args.checkpoint)
    checkpoint = local_checkpoint(args.checkpoint)
    storage.prepare()
    cluster.start(cfg)
    try:
        report = rollout_run(cfg, checkpoint, args.domain, args.n, storage.local, observer=injector,
                             spares=1 if injector else 0, quiet=args.quiet, catalog=cluster.c.storage.catalog,
                             store=cluster.c.storage.store or (f"{args.out}/store" if storage.remote else ""))
        storage.publish_files()
    finally:
        cluster.close()
    faults = report["chaos"]["injected"] if injector else {}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['completed']}/{report['n']} episodes, mean reward {report['mean_reward']:.3f}, "
              f"faults {faults}, resumes {report['resumes']}, tokens lost {report['tokens_lost']}, "
              f"resampled {report['tokens_resampled']}, tool calls {report['tool_calls']} -> {args.out}/report.json")
    if injector is not None and injector.shortfall():
        raise UserError(f"rollout --chaos: {injector.shortfall()}")
    return 0
