"""postrain on a real multi-node Ray cluster on this machine: a head (no CPUs of its own) and two worker
nodes, each its own raylet (rollout/local_cluster.py). `ray job submit` of `postrain rollout` and of
`postrain grpo` completes with workers on both worker nodes; a worker node killed in the middle of a
rollout loses no acknowledged token and the run ends with the calm run's token hashes; every process
the cluster started is gone afterwards."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT

from rollout.local_cluster import LocalCluster, alive

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
CLUSTER_TOML = str(ROOT / "configs" / "cluster.toml")


@pytest.fixture(scope="module")
def cluster():
    # Ray's default port of a node's job agent held, as another Ray cluster on this machine holds it: the
    # cluster must not need it (its job API never came up when it did)
    held = socket.socket()
    with contextlib.suppress(OSError):  # already taken: by another cluster, which is the case under test
        held.bind(("0.0.0.0", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))
        held.listen()
    # A local Ray started and stopped in this process first, as other tests (and drivers) do: it leaves Ray's
    # token authentication on in the process, so every process that joins from outside must carry it
    # (LocalCluster.client_env)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.shutdown()
    # one GPU declared per worker node (no device behind it): the RayJob's learner ranks ask for one each
    try:
        c = LocalCluster(workers=2, cpus_per_worker=2, gpus_per_worker=1)
    finally:
        held.close()  # the agent is up (or never will be): the port has done its part
    assert c.auth_env.get("RAY_AUTH_MODE") == "token"
    yield c
    if ray.is_initialized():
        ray.shutdown()
    pids = c.pids()
    assert c.stop() == [] and alive(pids) == [], "processes of the test cluster survived its stop"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from core.hf import save_policy
    from learner.config import PolicyConfig
    from learner.policy import build_policy

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("ckpt")
    save_policy(*build_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                           intermediate_size=64, max_positions=128)), path)
    return path


def submit(cluster, *argv, timeout=400):
    """`ray job submit` of `postrain ARGV` (the CLI a user types), blocking until the job ends."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", cluster.dashboard_url,
           "--", sys.executable, "-m", "deploy.cli", *argv]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cluster.client_env(ENV), cwd=ROOT)
    assert res.returncode == 0 and "succeeded" in res.stdout, f"job failed:\n{res.stdout[-4000:]}\n{res.stderr[-2000:]}"
    return res


def test_ray_job_submit_rollout_uses_both_worker_nodes(cluster, ckpt, tmp_path):
    out = tmp_path / "rollout"
    submit(cluster, "rollout", "--checkpoint", str(ckpt), "--domain", "reverse", "--n", "8", "--workers", "2",
           "--out", str(out), "--cluster", CLUSTER_TOML, "--quiet", "--set", "sampling.max_new_tokens=12")
    rep = json.loads((out / "report.json").read_text())
    assert rep["completed"] == 8 and rep["tokens_lost"] == 0 and rep["tokens_resampled"] == 0
    nodes = {slot: ids[-1] for slot, ids in rep["worker_nodes"].items()}
    assert sorted(nodes.values()) == sorted(cluster.worker_node_ids), "one worker on each worker node"
    # the WAL went over gRPC to a service (actor on the driver's node), not into per-worker directories
    assert not (out / "wal").exists() and list((out / "services").glob("*/wal/shard-0"))


@pytest.mark.slow
def test_ray_job_submit_grpo_completes_on_both_worker_nodes(cluster, ckpt, tmp_path):
    out = tmp_path / "grpo"
    submit(cluster, "grpo", "--domain", "reverse", "--init", str(ckpt), "--iterations", "1", "--out", str(out),
           "--cluster", CLUSTER_TOML, "--quiet",
           *[x for kv in ("loop.prompts_per_iteration=2", "loop.group_size=2", "eval.n=4", "eval.max_new_tokens=8",
                          "sampling.max_new_tokens=8", "learner.device=cpu", "loop.eval_every=0")
             for x in ("--set", kv)])
    assert (out / "final" / "config.json").is_file()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["completed"] for r in rows if r.get("stage") == "train"] == [4]
    used = json.loads((out / "rollout" / "worker_nodes.jsonl").read_text().splitlines()[0])["worker_nodes"]
    assert sorted(ids[-1] for ids in used.values()) == sorted(cluster.worker_node_ids)


def test_rayjob_entrypoint_passes_dry_run_on_the_cluster(cluster, tmp_path):
    """The KubeRay manifest's entrypoint, with the pod's environment mapped onto this machine (/app -> the checkout,
    /shared -> a temporary directory, the Secrets -> the local PostgreSQL and fresh tokens), checks out against the
    local cluster: Ray and the resources it asks for, PostgreSQL, the WAL and sandbox services, shared storage."""
    from tests.deploy.test_packaging import entrypoint_argv, pod_env, rayjob

    doc = rayjob()
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    secrets = {"POSTRAIN_CATALOG_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
               "POSTRAIN_WAL_TOKEN": "t-wal", "POSTRAIN_SANDBOX_TOKEN": "t-sandbox"}
    env = {k: secrets[k] if not isinstance(v, str) else v.replace("/shared", str(tmp_path)) for k, v in pod_env(head).items()}
    argv = [a.replace("/app/", f"{ROOT}/") for a in entrypoint_argv(doc, env)]
    res = subprocess.run([sys.executable, "-m", "deploy.cli", *argv[1:], "--dry-run"], capture_output=True, text=True,
                         timeout=300, env={**cluster.client_env(ENV), **env, "RAY_ADDRESS": cluster.address}, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [ln.split()[:2] for ln in res.stdout.splitlines()[1:-1]]
    assert rows == [["ray", "ok"], ["catalog", "ok"], ["wal", "ok"], ["sandbox", "ok"], ["storage", "ok"]], res.stdout
    assert "3 live nodes" in res.stdout and "seen by all 3 nodes" in res.stdout


def _postrain(cluster, *argv, timeout=180):
    return subprocess.run([sys.executable, "-m", "deploy.cli", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**cluster.client_env(ENV), "RAY_ADDRESS": cluster.address}, cwd=ROOT)


def test_demands_the_cluster_cannot_hold_fail_at_start(cluster, ckpt, tmp_path):
    res = _postrain(cluster, "rollout", "--checkpoint", str(ckpt), "--domain", "reverse", "--workers", "5",
                    "--out", str(tmp_path / "o"), "--cluster", CLUSTER_TOML)
    err = [ln for ln in res.stderr.splitlines() if "error" in ln]  # (Ray may print a notice of its own)
    assert res.returncode == 2 and len(err) == 1, res.stderr
    assert "needs 5 CPU at once (rollout workers 5 x CPU=1); the cluster has 4" in err[0]
    assert not (tmp_path / "o" / "config.json").exists(), "refused before the run began (no worker was started)"


def _rollout_in_driver_only_dir(cluster, ckpt, tmp_path, out_of):
    """`postrain rollout --cluster` run by a driver in a mount namespace of its own, where the directory
    `out_of(private)` lies on a private tmpfs (as a node-local disk would be)."""
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    private = tmp_path / "driver-only"
    private.mkdir()
    return subprocess.run(["bwrap", "--dev-bind", "/", "/", "--tmpfs", str(private), "--", sys.executable, "-m",
                           "deploy.cli", "rollout", "--checkpoint", str(ckpt), "--domain", "reverse", "--n", "2",
                           "--out", out_of(private), "--cluster", CLUSTER_TOML],
                          capture_output=True, text=True, timeout=180, env={**cluster.client_env(ENV), "RAY_ADDRESS": cluster.address},
                          cwd=ROOT)


def test_run_dir_only_the_driver_sees_is_refused(cluster, ckpt, tmp_path):
    """The driver runs in a mount namespace of its own where the run directory is a private tmpfs (as a
    node-local disk would be): the probe from the other nodes finds nothing there."""
    res = _rollout_in_driver_only_dir(cluster, ckpt, tmp_path, lambda private: str(private / "run"))
    private = tmp_path / "driver-only"
    err = [ln for ln in res.stderr.splitlines() if "error" in ln]  # (Ray may print a notice of its own)
    assert res.returncode == 2 and len(err) == 1, res.stderr
    assert f"run directory {private / 'run'} is not visible from node(s)" in err[0]


def _rollout_on_cluster(cluster, ckpt, run_dir: Path, on_progress=None):
    """A pool of 2 workers (1 CPU each, SPREAD) on the cluster, its WAL a service pinned to the head node."""
    from rollout.config import PoolConfig, RolloutConfig, SamplingConfig
    from rollout.pool import RolloutPool
    from rollout.ray_cluster import init_ray
    from rollout.run import requests_for
    from rollout.services import Services

    init_ray(cluster.address)
    services = Services()
    os.environ["POSTRAIN_WAL_TOKEN"] = "cluster-test-token"
    try:
        wal_addr = services.start_wal(run_dir / "wal", 1, cluster.head_node_id, "cluster-test-token")[0]
        cfg = RolloutConfig(pool=PoolConfig(workers=2, worker_cpus=1, worker_strategy="SPREAD", wal_addr=wal_addr,
                                            steps_per_call=2, seed=5, call_timeout_s=60),
                            sampling=SamplingConfig(max_new_tokens=32))
        pool = RolloutPool(ckpt, run_dir, cfg.pool, cfg.engine, use_tools=False)
        try:
            watcher = on_progress(pool) if on_progress else None
            res = pool.run(requests_for("reverse", 12, cfg))
            if watcher is not None:
                watcher.join(30)
            return pool, res
        finally:
            pool.close()
    finally:
        services.close()
        os.environ.pop("POSTRAIN_WAL_TOKEN", None)


def test_worker_node_loss_mid_rollout_loses_no_acknowledged_token(cluster, ckpt, tmp_path):
    _, calm = _rollout_on_cluster(cluster, ckpt, tmp_path / "calm")
    seen = {}

    def kill_a_node_mid_decode(pool):
        def watch():
            slot = pool.slots[0]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:  # the pool's audit of what it was shown: committed (acknowledged) tokens per trajectory
                    held = {r.traj_id: len(pool._stream.get(r.traj_id, {})) for r in list(slot.inside)}
                except (RuntimeError, AttributeError):  # mutated while read; the run not started yet
                    time.sleep(0.01)
                    continue
                if held and max(held.values()) >= 3:  # `inside`: handed to this worker and not finished
                    seen.update(node=slot.node, held=held, incarnation=slot.incarnation, t=time.monotonic())
                    cluster.remove_worker(cluster.worker_node_ids.index(slot.node))
                    return
                time.sleep(0.01)
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        return t

    pool, hurt = _rollout_on_cluster(cluster, ckpt, tmp_path / "hurt", kill_a_node_mid_decode)
    cluster.add_worker()  # the next test (if any) gets two worker nodes again
    assert seen, "the node was never removed mid-decode"
    assert sum(seen["held"].values()) > 0, "the removed node held no acknowledged token"
    slot = pool.slots[0]
    assert slot.incarnation > seen["incarnation"] and slot.nodes[-1] != seen["node"], "replaced on a surviving node"
    assert hurt.tokens_lost == 0 and hurt.tokens_resampled == 0
    assert len(hurt.finished) == len(calm.finished) == 12
    assert {t: f.token_hash for t, f in hurt.finished.items()} == {t: f.token_hash for t, f in calm.finished.items()}
    recovery_s = slot.running_since[slot.incarnation] - seen["t"]
    assert 0 < recovery_s < 60


def test_uri_run_directory_is_probed_from_every_node(cluster, ckpt, tmp_path):
    """A `pyarrow.fs` URI as the run directory: every node reads the driver's probe object through pyarrow; a URI
    only the driver reaches (a private tmpfs in its own mount namespace) is one error naming it."""
    uri = f"file://{tmp_path}/uri-run"
    res = _postrain(cluster, "rollout", "--checkpoint", str(ckpt), "--domain", "reverse", "--out", uri,
                    "--cluster", CLUSTER_TOML, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"storage   ok      run directory {uri} (local): probe object written, read back, deleted, read by all 3 " \
           "nodes" in res.stdout
    res = _rollout_in_driver_only_dir(cluster, ckpt, tmp_path, lambda private: f"file://{private}/run")
    private = tmp_path / "driver-only"
    err = [ln for ln in res.stderr.splitlines() if "error" in ln]
    assert res.returncode == 2 and len(err) == 1, res.stderr
    assert f"run directory file://{private}/run cannot be read from node(s)" in err[0] and "missing" in err[0]


@pytest.mark.slow
def test_rollout_into_a_uri_on_the_cluster(cluster, ckpt, tmp_path):
    """A rollout on the cluster whose run directory is a file:// URI: workers on both worker nodes, the report and
    the shards land under the URI (through pyarrow.fs)."""
    from dataplane.remote import RemoteStore

    uri = f"file://{tmp_path}/uri-rollout"
    res = _postrain(cluster, "rollout", "--checkpoint", str(ckpt), "--domain", "reverse", "--n", "8", "--workers", "2",
                    "--out", uri, "--cluster", CLUSTER_TOML, "--quiet", "--set", "sampling.max_new_tokens=12", timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    store = RemoteStore(uri)
    rep = json.loads(store.get("report.json"))
    assert rep["completed"] == 8 and rep["tokens_lost"] == 0 and rep["tokens_resampled"] == 0
    assert sorted(ids[-1] for ids in rep["worker_nodes"].values()) == sorted(cluster.worker_node_ids)
    assert store.list("store/shards", recursive=True) and store.exists("metrics.jsonl")
