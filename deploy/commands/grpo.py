"""`postrain grpo`: specialist GRPO on one domain from an SFT checkpoint (rollouts may be preempted underneath)."""
from core.cli_args import nonneg_int, positive_int
from deploy.commands._common import add_cluster_args, add_config_args

NAME = "grpo"
HELP = "specialist GRPO on a domain: Ray rollouts -> verify -> data plane -> learner -> publish weights, repeated"


def add_arguments(p):
    p.add_argument("--domain", required=True, action="append",
                   help="task domain (see `postrain domains`); repeat it for one run over a mixture of domains "
                        "(their prompts in equal shares; per-domain config tables are then not applied)")
    p.add_argument("--init", required=True, help="checkpoint to start from: an HF checkpoint directory or a run directory "
                   "holding one as final/ (a path or a pyarrow.fs URI)")
    p.add_argument("--iterations", type=positive_int, required=True, help="GRPO iterations in total (a resumed run counts the done ones)")
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, grpo.png, checkpoints/, final/; a path or "
                   "a pyarrow.fs URI (file:///abs/dir, s3://bucket/prefix, gs://..., hdfs://...)")
    p.add_argument("--chaos", type=nonneg_int, metavar="SEED", help="preempt and kill rollout workers on a schedule drawn from SEED")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its latest checkpoint")
    p.add_argument("--stop-after", type=positive_int, metavar="K", help="leave once K iterations are done and checkpointed "
                   "(as a preempted job would; one-step-off rollouts of K+1 are already in the data plane); continue with --resume")
    p.add_argument("--keep-data", action="store_true", help="keep every batch's trajectories and shards, every checkpoint "
                   "and earlier starts' WALs (default: reclaimed once a durable checkpoint covers them, see loop.keep_*)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    add_config_args(p)
    add_cluster_args(p)


def run(args) -> int:
    from deploy.commands._common import default_config
    from deploy.grpo_config import load_for_domain
    from deploy.grpo_loop import run_grpo

    import rewards
    from core.errors import UserError
    from deploy.cluster import ClusterRun

    try:
        tools = any(rewards.domain(d).uses_tools for d in args.domain)
    except rewards.UnknownDomain as exc:
        raise UserError(str(exc)) from None
    from deploy.run_storage import RunStorage, check_local_checkpoints, local_checkpoint

    storage = RunStorage(args.out, "grpo")
    cluster = ClusterRun(args, "grpo", storage.local, tools=tools, uri=storage.remote and storage.out)
    overrides = cluster.overrides + storage.overrides() + list(args.overrides)
    path = args.config or default_config("grpo_loop")
    if len(args.domain) == 1:
        cfg = load_for_domain(path, args.domain[0], overrides)
    else:
        from core import config
        from deploy.grpo_config import GRPOLoopConfig

        cfg = config.load(GRPOLoopConfig, path, overrides)
    if args.dry_run:
        from deploy.cluster_check import check

        check(cluster, cfg, cfg.loop.catalog, checkpoint=args.init)
        return 0
    if args.keep_data:
        cfg.loop.keep_data = True
    domain = args.domain[0] if len(args.domain) == 1 else args.domain
    check_local_checkpoints(args.init)
    init = local_checkpoint(args.init)
    storage.prepare(args.resume, catalog=cfg.loop.catalog)
    cluster.start(cfg)
    try:
        summary = run_grpo(cfg, domain, init, storage.local, args.iterations, chaos_seed=args.chaos,
                           resume=args.resume, quiet=args.quiet, stop_after=args.stop_after, storage=storage)
    finally:
        cluster.close()
    if not args.quiet:
        evals = ", ".join(f"{e['iteration']}: {e['pass_at_1']:.3f}" for e in summary["eval"])
        final = f"{args.out}/final" if summary["final"] and storage.remote else summary["final"]
        where = (f"final policy {final}" if final else
                 f"stopped after {summary['iterations_done']} of {summary['iterations']} iterations (continue with --resume)")
        print(f"grpo {'+'.join(args.domain)}: eval pass@1 by iteration {{{evals}}}; {where}, "
              f"metrics {args.out}/metrics.jsonl, curve {args.out}/grpo.png; run directory {summary['run_dir_mb']:.1f} MB "
              f"(largest {summary['run_dir_mb_max']:.1f} MB{', all data kept' if summary['keep_data'] else ''})")
    return 0
