"""`postrain data stats|plan`: inspect a trajectory catalog, and plan an epoch from its metadata."""
NAME = "data"
HELP = "data plane: `postrain data stats --catalog URL`, `postrain data plan --catalog URL ...`"


def _catalog_args(p, config_default):
    from deploy.commands._common import add_config_args

    add_config_args(p, config_default)
    p.add_argument("--catalog", default=None, help="SQLite path or postgresql:// URL (default: from the config)")
    p.add_argument("--namespace", default=None, help="PostgreSQL schema of the catalog (default: from the config)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_arguments(p):
    from deploy.commands._common import default_config

    cfg = default_config("dataplane")
    sub = p.add_subparsers(dest="data_verb", metavar="SUBVERB")
    sub.required = True
    s = sub.add_parser("stats", help="counts of trajectories, tokens, shards by run / domain / status",
                       description="Summarise a catalog: runs, policy versions, shards, trajectories and tokens by "
                                   "run, domain and status.")
    _catalog_args(s, cfg)
    s.add_argument("--verify", action="store_true", help="also re-read every shard file and check its checksum")
    s.add_argument("--store", default=None, help="shard root, for --verify (default: from the config)")
    q = sub.add_parser("plan", help="plan an epoch (shuffle, split, pack, balance) from metadata only",
                       description="Select trajectories and plan one epoch; prints a summary, writes the plan "
                                   "(JSON, loadable by dataplane.Plan.from_json) with --out.")
    _catalog_args(q, cfg)
    q.add_argument("--store", default=None, help="shard root recorded in the plan (default: from the config)")
    q.add_argument("--run", action="append", default=None, help="select this run (repeatable)")
    q.add_argument("--domain", action="append", default=None, help="select this domain (repeatable)")
    q.add_argument("--status", action="append", default=None, help="select this status (default: complete)")
    q.add_argument("--teacher", action="append", default=None, help="select this teacher id (repeatable)")
    q.add_argument("--policy-min", type=int, default=None, help="oldest policy version a trajectory may hold")
    q.add_argument("--policy-max", type=int, default=None, help="newest policy version a trajectory may hold")
    q.add_argument("--tokens-per-rank", type=int, default=None, help="token budget of one rank per minibatch")
    q.add_argument("--ranks", type=int, default=None, help="data-parallel ranks")
    q.add_argument("--seed", type=int, default=None, help="shuffle seed")
    q.add_argument("--epoch", type=int, default=0, help="epoch number (part of the shuffle's seed)")
    q.add_argument("--group-aware", action="store_true", default=None, help="shuffle GRPO groups as units")
    q.add_argument("--no-group-aware", dest="group_aware", action="store_false", help="shuffle trajectories")
    q.add_argument("--by-teacher", action="store_true", default=None, help="order minibatches by teacher")
    q.add_argument("--out", default=None, help="write the plan as JSON to this file")


def _config(args):
    from core.config import build, load
    from dataplane.config import DataPlaneConfig, DataPlaneFile

    data = load(DataPlaneFile, args.config, args.overrides).dataplane.model_dump()
    for key in ("catalog", "namespace", "store", "tokens_per_rank", "ranks", "seed", "group_aware", "by_teacher"):
        val = getattr(args, key, None)
        if val is not None:
            data[key] = val
    return build(DataPlaneConfig, data, where="data plane options")


def run(args) -> int:
    import json
    import time
    from pathlib import Path

    import dataplane
    from core.errors import UserError

    cfg = _config(args)
    if getattr(args, "epoch", 0) < 0:
        raise UserError(f"--epoch {args.epoch}: an epoch number is >= 0")
    if "://" not in cfg.catalog and not Path(cfg.catalog).is_file():  # a read: create no empty catalog
        raise UserError(f"catalog file {cfg.catalog} does not exist (give --catalog PATH or a postgresql:// URL)")
    try:
        dp = dataplane.open(cfg.catalog, cfg.store, namespace=cfg.namespace, create=False)
    except dataplane.DataPlaneError as exc:
        raise UserError(str(exc)) from None
    try:
        if args.data_verb == "stats":
            out = dp.stats()
            if args.verify:
                out["problems"] = dp.verify_shards()
            if args.json:
                print(json.dumps(out))
            else:
                print(f"{out['catalog']}: {out['trajectories']} trajectories, {out['tokens']} tokens, "
                      f"{out['shards']} shards ({out['shard_bytes'] / 2**20:.1f} MiB), {out['runs']} runs")
                for g in out["by_run_domain_status"]:
                    print(f"  {g['run']:20s} {g['domain']:12s} {g['status']:10s} {g['trajectories']:9d} traj "
                          f"{g['tokens']:12d} tok  max {g['max_length']}")
                for line in out.get("problems", []):
                    print(f"  PROBLEM: {line}")
            return 1 if out.get("problems") else 0
        t0 = time.perf_counter()
        sel = dp.select(run=args.run, domain=args.domain, status=args.status or ("complete",),
                        policy_min=args.policy_min, policy_max=args.policy_max, teacher=args.teacher)
        t1 = time.perf_counter()
        plan = dp.plan(sel, tokens_per_rank=cfg.tokens_per_rank, ranks=cfg.ranks, seed=cfg.seed, epoch=args.epoch,
                       group_aware=cfg.group_aware, by_teacher=cfg.by_teacher)
        t2 = time.perf_counter()
        out = plan.summary() | {"select_s": round(t1 - t0, 4), "plan_s": round(t2 - t1, 4)}
        if args.out:
            from core.atomic import write_atomic

            write_atomic(Path(args.out), json.dumps(plan.to_json()).encode())
            out["out"] = args.out
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{out['trajectories']} trajectories -> {out['segments']} segments, {out['minibatches']} minibatches x "
                  f"{out['ranks']} ranks of <= {out['tokens_per_rank']} tokens; fill {out['fill']:.3f}, "
                  f"mean rank spread {out['mean_rank_spread_frac']:.3f}; planned in {out['plan_s']:.3f}s"
                  + (f"; written to {args.out}" if args.out else ""))
        return 0
    except dataplane.DataPlaneError as exc:
        raise UserError(str(exc)) from None
    finally:
        dp.close()
