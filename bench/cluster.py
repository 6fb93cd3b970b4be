"""postrain on a local 3-node Ray cluster (head + 2 worker raylets on this machine): placement cost,
node-loss recovery, WAL streams one service holds.

    postrain bench cluster --json [--rounds 5] [--out FILE]

- two_nodes_vs_one_node_tokens_s: rollout tokens/s with the workers spread over the two worker nodes
  and the WAL over gRPC (a log service actor on the head node), divided by the tokens/s of the same
  worker count on one node (the cluster with one worker node) with in-process WALs. The workload is
  one GRPO iteration's rollouts as `configs/grpo_loop.toml` ships them (its [engine], [sampling] and
  [pool] tables: 256 requests, batched decode, a WAL commit per 4 decode steps), four iterations one
  after another on one pool per run. Same requests, seed, model and worker count on both sides; rounds
  alternate the order; median of each side over the rounds; tokens/s counts committed sampled tokens
  over the pool's run time (actor start-up excluded).
  The same ratio on a small strict-decode workload (16 episodes of 32 tokens, under a second a run,
  where per-call costs weigh most) is kept as `placement_small`.
- node_loss_recovery_s: a worker node is killed (SIGKILL of its raylet and every process under it)
  while its worker holds trajectories with committed tokens; recovery ends when the replacement
  worker on a surviving node has run those trajectories again (its first call came back). The pool
  keeps one warm spare actor per node (the production recovery path: imports done, model not yet
  loaded); Ray declares the node dead after 3 missed 1 s health checks. Median
  over the rounds; every round also checks that no acknowledged token was lost and the token hashes
  equal a calm run's.
- wal_streams_held: N clients (threads over several processes) each open an append stream to one
  `postrain wal serve`, meet at a barrier (all N streams open at once), then append and commit in a
  loop; the value is N when no client failed and every acknowledged token reads back, else 0.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._device import cpu_name, run_meta
from core.cli_args import positive_int
from rollout.local_cluster import LocalCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
N_TRAJ, MAX_NEW, WORKERS, SEED = 16, 32, 2, 11
PRODUCT_REQUESTS = 256  # one GRPO iteration: loop.prompts_per_iteration x loop.group_size of the shipped config
PRODUCT_ITERATIONS = 4  # iterations per measured run: one takes ~0.6 s here, where the machine's noise is +-30 %


def _checkpoint(path: Path) -> Path:
    import torch

    from core.hf import save_policy
    from learner.config import PolicyConfig
    from learner.policy import build_policy

    torch.manual_seed(0)
    save_policy(*build_policy(PolicyConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                           intermediate_size=128, max_positions=256)), path)
    return path


def _pool_cfg(**pool):
    from rollout.config import PoolConfig, RolloutConfig, SamplingConfig

    # commit_group_steps as the shipped GRPO loop runs it (configs/grpo_loop.toml), on both sides
    return RolloutConfig(pool=PoolConfig(workers=WORKERS, seed=SEED, steps_per_call=4, call_timeout_s=120,
                                         commit_group_steps=4, **pool),
                         sampling=SamplingConfig(max_new_tokens=MAX_NEW))


def _product_cfg(**pool):
    """The rollout tables of the shipped GRPO loop config, with the pool placed as `pool` says."""
    import tomllib

    from rollout.config import RolloutConfig

    shipped = tomllib.loads((ROOT / "configs" / "grpo_loop.toml").read_text())
    tables = {k: dict(shipped.get(k, {})) for k in ("engine", "sampling", "pool")}
    tables["pool"] |= dict(workers=WORKERS, seed=SEED, call_timeout_s=120, **pool)
    return RolloutConfig.model_validate(tables)


def _run_pool(ckpt: Path, run_dir: Path, cfg, watch=None, spares: int = 0, n: int = N_TRAJ, iterations: int = 1):
    """`iterations` batches of `n` requests one after another on one pool (as the GRPO loop's iterations are);
    returns the pool and each batch's result."""
    import dataclasses

    from rollout.pool import RolloutPool
    from rollout.run import requests_for

    pool = RolloutPool(ckpt, run_dir, cfg.pool, cfg.engine, use_tools=False, spares=spares)
    try:
        watcher = watch(pool) if watch else None
        reqs = requests_for("reverse", n, cfg)
        out = [pool.run([dataclasses.replace(r, traj_id=f"{r.traj_id}-it{k}") for r in reqs] if k else reqs)
               for k in range(iterations)]
        if watcher is not None:
            watcher.join(60)
        return pool, out
    finally:
        pool.close()


def _tokens_s(results) -> float:
    """Committed sampled tokens over the pool's run time, summed over the batches."""
    return sum(r.counters["tokens_committed"] for r in results) / sum(r.wall_s for r in results)


def _nodes(cluster: LocalCluster, n: int) -> None:
    """Exactly `n` worker nodes (nodes removed are killed; new ones start fresh)."""
    while len(cluster.workers) > n:
        cluster.remove_worker(len(cluster.workers) - 1)
    while len(cluster.workers) < n:
        cluster.add_worker()


def _on_cluster(cluster: LocalCluster, ckpt: Path, work: Path, wal_service: bool, watch=None, spares: int = 0,
                product: bool = False):
    """A rollout on the cluster: 2 workers of 1 CPU each, SPREAD; the WAL a service actor on the head node, or
    (wal_service False) in-process logs in the run directory. `product`: PRODUCT_ITERATIONS of the shipped GRPO
    iteration's rollouts (`_product_cfg`, 256 requests each) instead of the small strict workload. Returns the
    pool and the result of each batch."""
    import ray

    from rollout.ray_cluster import init_ray
    from rollout.services import Services

    init_ray(cluster.address)
    services = Services()
    os.environ["POSTRAIN_WAL_TOKEN"] = "bench-cluster"
    try:
        addr = services.start_wal(work / "wal-service", 1, cluster.head_node_id, "bench-cluster")[0] if wal_service else ""
        place = dict(worker_cpus=1, worker_strategy="SPREAD", wal_addr=addr)
        cfg = _product_cfg(**place) if product else _pool_cfg(**place)
        pool, res = _run_pool(ckpt, work, cfg, watch, spares, n=PRODUCT_REQUESTS if product else N_TRAJ,
                              iterations=PRODUCT_ITERATIONS if product else 1)
    finally:
        services.close()
        os.environ.pop("POSTRAIN_WAL_TOKEN", None)
        ray.shutdown()
    return pool, res


def two_nodes(cluster: LocalCluster, ckpt: Path, work: Path, watch=None, spares: int = 0):
    return _on_cluster(cluster, ckpt, work, True, watch, spares)


def placement(cluster: LocalCluster, ckpt: Path, work: Path, rounds: int, product: bool = False) -> dict:
    """One node: the cluster with a single worker node (both workers on it), in-process WALs. Two nodes: two
    worker nodes (one worker on each), the WAL over gRPC. Alternating order, same requests."""
    one, two, hashes = [], [], []
    tag = "product" if product else "small"
    for r in range(rounds):
        for side in (("one", "two") if r % 2 == 0 else ("two", "one")):
            _nodes(cluster, 1 if side == "one" else 2)
            _, results = _on_cluster(cluster, ckpt, work / f"{tag}-{side}-{r}", wal_service=side == "two", product=product)
            res = results[0]
            nodes = {ids[-1] for r_ in results for ids in r_.worker_nodes.values()}
            if len(nodes) != (1 if side == "one" else 2) or not nodes <= set(cluster.worker_node_ids):
                raise RuntimeError(f"{side} node(s): the workers ran on {nodes}")
            (one if side == "one" else two).append(_tokens_s(results))
            hashes.append({t: f.token_hash for r_ in results for t, f in r_.finished.items()})
    _nodes(cluster, 2)
    same = all(h == hashes[0] for h in hashes)
    return {"one_node_tokens_s": [round(x, 1) for x in one], "two_nodes_tokens_s": [round(x, 1) for x in two],
            "one_node_median": round(statistics.median(one), 1), "two_nodes_median": round(statistics.median(two), 1),
            "ratio": round(statistics.median(two) / statistics.median(one), 3), "same_tokens_every_run": same,
            "calm_hashes": hashes[0]}


def node_loss(cluster: LocalCluster, ckpt: Path, work: Path, rounds: int, calm: dict) -> dict:
    out = []
    for r in range(rounds):
        seen: dict = {}

        def watch(pool):
            def go():
                slot, deadline = pool.slots[0], time.monotonic() + 120
                while time.monotonic() < deadline:
                    try:
                        held = {q.traj_id: len(pool._stream.get(q.traj_id, {})) for q in list(slot.inside)}
                    except (RuntimeError, AttributeError):
                        time.sleep(0.01)
                        continue
                    if held and max(held.values()) >= 4:
                        seen.update(node=slot.node, inc=slot.incarnation, held=sum(held.values()), t=time.monotonic())
                        cluster.remove_worker(cluster.worker_node_ids.index(slot.node))
                        return
                    time.sleep(0.01)
            t = threading.Thread(target=go, daemon=True)
            t.start()
            return t

        # one warm spare per worker node (SPREAD): a replacement on the surviving node needs no cold start
        pool, (res,) = two_nodes(cluster, ckpt, work / f"loss-{r}", watch, spares=2)
        cluster.add_worker()
        if not seen:
            raise RuntimeError("node loss: the node was never removed mid-decode")
        slot = pool.slots[0]
        after = [i for i in slot.running_since if i > seen["inc"]]
        row = {"acknowledged_tokens_on_lost_node": seen["held"], "replacement_node_survived": slot.nodes[-1] != seen["node"],
               "recovery_s": round(slot.running_since[after[0]] - seen["t"], 3) if after else None,
               "tokens_lost": res.tokens_lost, "tokens_resampled": res.tokens_resampled,
               "completed": len(res.finished),
               "same_token_hashes_as_calm": {t: f.token_hash for t, f in res.finished.items()} == calm}
        out.append(row)
    rec = [r["recovery_s"] for r in out if r["recovery_s"] is not None]
    return {"rounds": out, "recovery_s_median": round(statistics.median(rec), 3) if len(rec) == len(out) else None,
            "all_correct": all(r["tokens_lost"] == 0 and r["tokens_resampled"] == 0 and r["completed"] == N_TRAJ
                               and r["same_token_hashes_as_calm"] and r["replacement_node_survived"] for r in out)}


# -- WAL streams ------------------------------------------------------------------------------------------------
def _stream_client(address: str, names: list[str], rounds: int, barrier, results) -> None:
    import wal

    def one(name: str, out: dict) -> None:
        try:
            log = wal.connect(address, retry_s=120)
            log.append(name, 0, [1], [-1.0], 0)
            log.commit()  # the stream is open and acknowledged
            barrier.wait(timeout=300)  # every client's stream open at once
            for i in range(1, rounds + 1):
                log.append(name, i, [i + 1], [-0.5], 0)
                log.commit()
            out[name] = ("ok", rounds + 1, log.overload_waits)
            log.close()
        except Exception as exc:  # reported as a failed client
            out[name] = ("failed", 0, f"{type(exc).__name__}: {exc}")

    out: dict = {}
    threads = [threading.Thread(target=one, args=(n, out)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(out)


def wal_streams(streams: int, procs: int, rounds: int, work: Path) -> dict:
    import wal

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "deploy.cli", "wal", "serve", "--dir", str(work / "wal-streams"),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = server.stdout.readline()
        if "serving WAL" not in line:
            raise RuntimeError(f"wal serve did not start: {line}")
        address = f"127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(streams), ctx.Queue()
        names = [f"s{i:04d}" for i in range(streams)]
        t0 = time.monotonic()
        workers = [ctx.Process(target=_stream_client, args=(address, names[p::procs], rounds, barrier, results))
                   for p in range(procs)]
        for w in workers:
            w.start()
        out: dict = {}
        for _ in workers:
            out.update(results.get(timeout=600))
        for w in workers:
            w.join(60)
        wall = time.monotonic() - t0
        failed = {k: v[2] for k, v in out.items() if v[0] != "ok"}
        reader = wal.connect(address, retry_s=30)
        unread = [k for k, v in out.items() if v[0] == "ok" and reader.tokens(k) != list(range(1, v[1] + 1))]
        reader.close()
        return {"streams": streams, "client_processes": procs, "commits_per_stream": rounds + 1,
                "failed_clients": len(failed), "failures": dict(list(failed.items())[:5]),
                "acked_tokens_not_read_back": len(unread),
                "overload_waits": sum(v[2] for v in out.values() if v[0] == "ok"),
                "commits_per_s": round(sum(v[1] for v in out.values() if v[0] == "ok") / wall, 1),
                "held": streams if not failed and not unread and len(out) == streams else 0}
    finally:
        server.terminate()
        server.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one compact JSON object (default: indented)")
    ap.add_argument("--rounds", type=positive_int, default=5, help="rounds of the placement and node-loss measurements")
    ap.add_argument("--streams", type=positive_int, default=256, help="concurrent WAL writer streams")
    ap.add_argument("--stream-procs", type=positive_int, default=8, help="client processes the streams are spread over")
    ap.add_argument("--stream-commits", type=positive_int, default=20, help="commits per stream after the barrier")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        ckpt = _checkpoint(work / "ckpt")
        streams = wal_streams(args.streams, args.stream_procs, args.stream_commits, work)
        cluster = LocalCluster(workers=2, cpus_per_worker=2, dashboard=False)  # no jobs submitted here
        try:
            place = placement(cluster, ckpt, work, args.rounds, product=True)
            place.pop("calm_hashes")
            small = placement(cluster, ckpt, work, args.rounds)
            loss = node_loss(cluster, ckpt, work, args.rounds, small.pop("calm_hashes"))
        finally:
            left = cluster.stop()
    ratio, rec, held = place["ratio"], loss["recovery_s_median"], streams["held"]
    result = {
        "benchmark": "cluster",
        "device": cpu_name(),
        "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},  # the machine is shared
        "cluster": "rollout/local_cluster.py: head (0 CPUs, GCS) + 2 worker raylets of 2 CPUs each on this "
                   "machine; node failure noticed after 3 missed 1 s health checks",
        "workload": f"placement: one GRPO iteration's rollouts as configs/grpo_loop.toml ships them ({PRODUCT_REQUESTS} "
                    f"`reverse` requests, {WORKERS} workers), {PRODUCT_ITERATIONS} iterations per run; placement_small and node-loss: {N_TRAJ} `reverse` "
                    f"episodes, {MAX_NEW} new tokens each, strict decode; tiny Qwen2-architecture policy (64 hidden, 2 layers)",
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "placement": place,
        "placement_small": small,
        "node_loss": loss,
        "wal_streams": streams,
        "processes_left_after_stop": len(left),
        "targets": {
            "two_nodes_vs_one_node_tokens_s": {"value": ratio, "goal": ">= 0.9 (median tokens/s, workers over 2 nodes "
                                               "+ gRPC WAL vs 1 node + in-process WAL)", "met": ratio >= 0.9},
            "node_loss_recovery_s": {"value": rec, "goal": "<= 10 (median; no acknowledged token lost, calm token hashes)",
                                     "met": rec is not None and rec <= 10 and loss["all_correct"]},
            "wal_streams_held": {"value": held, "goal": ">= 256 (0 failed clients, every acknowledged token read back)",
                                 "met": held >= 256},
        },
    }
    result["meta"] = run_meta(result.get("device"))
    print(json.dumps(result, indent=None if args.json else 2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
