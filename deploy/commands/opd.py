"""`postrain opd`: multi-teacher on-policy distillation that merges specialists into one student."""
from core.cli_args import nonneg_int, positive_int
from deploy.commands._common import add_cluster_args, add_config_args

NAME = "opd"
HELP = "on-policy distillation: the student samples every domain, each domain's teacher scores every token (full vocabulary)"


def add_arguments(p):
    p.add_argument("--student", required=True, help="checkpoint to start the student from: an HF checkpoint directory "
                   "or a run directory holding one as final/ (a path or a pyarrow.fs URI)")
    p.add_argument("--teacher", action="append", default=[], metavar="DOMAIN[:WEIGHT]=DIR",
                   help="the teacher of a domain (repeatable; several per domain with weights; DIR as --student); "
                        "adds to [opd.teachers]")
    p.add_argument("--iterations", type=positive_int, required=True, help="OPD iterations in total (a resumed run counts the done ones)")
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, opd.png, checkpoints/, final/; a path or "
                   "a pyarrow.fs URI (file:///abs/dir, s3://bucket/prefix, gs://..., hdfs://...)")
    p.add_argument("--chaos", type=nonneg_int, metavar="SEED", help="preempt and kill rollout workers on a schedule drawn from SEED")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its latest checkpoint")
    p.add_argument("--stop-after", type=positive_int, metavar="K", help="leave once K iterations are done and checkpointed")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    add_config_args(p)
    add_cluster_args(p)


def run(args) -> int:
    import json

    from core import config
    from deploy.commands._common import default_config
    from deploy.opd_config import OPDLoopConfig
    from deploy.opd_loop import run_opd
    from distill.teachers import parse_teacher_arg, table_entries

    from deploy.cluster import ClusterRun
    from deploy.run_storage import RunStorage, check_local_checkpoints

    teachers = [parse_teacher_arg(t) for t in args.teacher]
    storage = RunStorage(args.out, "opd")
    cluster = ClusterRun(args, "opd", storage.local, tools=True, uri=storage.remote and storage.out)
    cfg = config.load(OPDLoopConfig, args.config or default_config("opd"),
                      cluster.overrides + storage.overrides() + list(args.overrides))
    checkpoints = [args.student, *(p for _, p, _ in table_entries(cfg.opd.teachers) + teachers)]
    if args.dry_run:
        from deploy.cluster_check import check

        check(cluster, cfg, cfg.loop.catalog, checkpoint=checkpoints)
        return 0
    check_local_checkpoints(*checkpoints)
    storage.prepare(args.resume, catalog=cfg.loop.catalog)
    cluster.start(cfg)
    try:
        summary = run_opd(cfg, args.student, teachers, storage.local, args.iterations, chaos_seed=args.chaos,
                          resume=args.resume, quiet=args.quiet or args.json, stop_after=args.stop_after,
                          storage=storage)
    finally:
        cluster.close()
    if storage.remote is not None:  # where the user asked for it, not the staging directory
        summary |= {"out": args.out, "final": summary["final"] and f"{args.out}/final", "staging": str(storage.local)}
    if args.json:
        print(json.dumps(summary, default=str))
    elif not args.quiet:
        print(f"run directory: {summary['out']}  (final: {summary['final']})")
    return 0
