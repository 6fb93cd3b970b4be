"""Running a command on a cluster: `--cluster FILE`, `--ray-address`, `--dry-run`.

`ClusterRun` joins (or starts) Ray, checks that what the run will ask for can be scheduled, that the
run directory is seen by every node, starts the WAL / sandbox services the config asks for as pinned
actors, and returns the `--set` overrides that point the command's config at all of it. `check()` is
`--dry-run`: every dependency (Ray, PostgreSQL, WAL, sandbox, storage) is probed and reported, one
line each, and nothing runs.

The file comes from `--cluster`, else $POSTRAIN_CLUSTER (how `postrain pipeline` hands it to its
stages, with RAY_ADDRESS).
"""
from __future__ import annotations

import os
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

from core import config
from core.errors import UserError
from core.rundir import SERVICES_DIR
from deploy.cluster_config import ClusterConfig
from rollout import ray_cluster
from rollout.ray_cluster import Demand

CLUSTER_ENV = "POSTRAIN_CLUSTER"
WAL_TOKEN_ENV, SANDBOX_TOKEN_ENV = "POSTRAIN_WAL_TOKEN", "POSTRAIN_SANDBOX_TOKEN"


def load_cluster(path: str | None) -> ClusterConfig:
    path = path or os.environ.get(CLUSTER_ENV) or None
    return config.load(ClusterConfig, path) if path else ClusterConfig()


def demands(cfg) -> list[Demand]:
    """What a rollout / grpo / opd config will ask Ray for at once (resources as configured; 0 = none)."""
    p = cfg.pool
    out = [Demand("rollout workers", p.workers, {"CPU": p.worker_cpus, "GPU": p.worker_gpus})]
    learner = getattr(cfg, "learner", None)
    if learner is not None and learner.ranks > 1:
        gpu = 1.0 if learner.device == "cuda" else 0.0
        out.append(Demand("learner ranks", learner.ranks, {"CPU": learner.cpus_per_rank, "GPU": gpu}, learner.placement))
    opd = getattr(cfg, "opd", None)
    if opd is not None and opd.teacher_workers:
        out.append(Demand("teacher workers", opd.teacher_workers, {"CPU": opd.teacher_cpus, "GPU": opd.teacher_gpus}))
    return out


def overrides_for(c: ClusterConfig, kind: str) -> list[str]:
    """The cluster file as `--set` overrides of a rollout / grpo / opd config (laid under the user's own)."""
    r = c.rollout
    out = [f"pool.worker_cpus={r.worker_cpus}", f"pool.worker_gpus={r.worker_gpus}",
           f"pool.worker_strategy={r.strategy}",
           f"pool.local_cpus={c.ray.local_cpus}"]
    if c.storage.snapshots:
        out.append(f"pool.snapshot_uri={c.storage.snapshots}")
    if kind in ("grpo", "opd"):
        out += [f"learner.cpus_per_rank={c.learner.cpus_per_rank}", f"learner.placement={c.learner.strategy}"]
        out += [f"loop.{k}={v}" for k, v in (("catalog", c.storage.catalog), ("store", c.storage.store)) if v]
    if kind == "opd":
        out += [f"opd.teacher_cpus={c.teacher.worker_cpus}", f"opd.teacher_gpus={c.teacher.worker_gpus}"]
    return out


def _mode(mode: str, joined: bool) -> str:
    return ("actor" if joined else "embedded") if mode == "auto" else mode


def _resolve_node(spec: str, nodes: list[dict]) -> str:
    """A node id from an id or an IP ("" = the driver's node)."""
    if not spec:
        return ray_cluster.node_id()
    for n in nodes:
        if spec in (n["id"], n["ip"]):
            return n["id"]
    raise UserError(f"no live node {spec!r} in the cluster (live: {', '.join(n['ip'] + ' ' + n['id'][:8] for n in nodes)})")


def _token(env: str) -> str:
    """The service token: from the environment, else a fresh one put there (the pool hands it to its workers)."""
    if not os.environ.get(env):
        os.environ[env] = secrets.token_urlsafe(24)
    return os.environ[env]


def check_run_dir_visible(run_dir: Path, nodes: list[dict]) -> None:
    """Every live node must see `run_dir`: a probe file written here is read back by a task on each node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    run_dir.mkdir(parents=True, exist_ok=True)
    name, body = f".node-probe-{uuid.uuid4().hex}", uuid.uuid4().hex
    probe = run_dir.resolve() / name
    probe.write_text(body)

    @ray.remote(num_cpus=0, max_retries=0)
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as exc:
            return f"! {exc.strerror}"

    try:
        refs = [read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["id"], soft=False)).remote(str(probe))
                for n in nodes]
        blind = [f"{n['ip']} ({n['id'][:8]})" for n, got in zip(nodes, ray.get(refs, timeout=120)) if got != body]
    finally:
        probe.unlink(missing_ok=True)
    if blind:
        raise UserError(f"run directory {run_dir} is not visible from node(s) {', '.join(blind)}: workers there could "
                        f"not reach its KV snapshots, shards or logs; put it on storage every node mounts at the same "
                        f"path (or run on one machine without a cluster)")


def check_uri_visible(uri: str, nodes: list[dict]) -> None:
    """Every live node must read a probe object written here under `uri`, through pyarrow.fs."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dataplane.remote import RemoteStore

    store = RemoteStore(uri)
    name, body = f".node-probe-{uuid.uuid4().hex}", uuid.uuid4().hex
    store.put(name, body.encode())

    @ray.remote(num_cpus=0, max_retries=0)
    def read(uri: str, name: str) -> str:
        from dataplane.remote import RemoteStore

        try:
            return (RemoteStore(uri).get(name) or b"! missing").decode()
        except Exception as exc:  # reported per node below
            return f"! {exc}"

    try:
        refs = [read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["id"], soft=False)).remote(uri, name)
                for n in nodes]
        blind = [f"{n['ip']} ({n['id'][:8]}: {got[2:] if got.startswith('! ') else 'other bytes'})"
                 for n, got in zip(nodes, ray.get(refs, timeout=120)) if got != body]
    finally:
        store.delete(name)
    if blind:
        raise UserError(f"run directory {uri} cannot be read from node(s) {', '.join(blind)}: give every node "
                        "the filesystem's credentials and network access, or use storage they all reach")


class ClusterRun:
    """The cluster side of one command (see module doc): `overrides` before its config is built, `start(cfg)` after;
    `close()` stops the services it started."""

    def __init__(self, args, kind: str, run_dir: str | Path, tools: bool = False, uri: str | None = None):
        named = getattr(args, "cluster", None) or os.environ.get(CLUSTER_ENV)
        self.c = load_cluster(getattr(args, "cluster", None))
        self.kind, self.run_dir, self.tools = kind, Path(run_dir), tools
        self.uri = uri or None  # a pyarrow.fs URI run directory (run_dir is then its local staging directory)
        self.address = getattr(args, "ray_address", None) or self.c.ray.address or None
        self.services = None
        self.joined = bool(ray_cluster.named_address(self.address))
        # laid under the command's own --set (which therefore still wins)
        self.overrides = overrides_for(self.c, kind) if (self.joined or named) else []

    def start(self, cfg) -> None:
        """Join or start Ray, refuse what cannot be scheduled, check the run directory, start services; points
        cfg.pool at the services."""
        ray_cluster.init_ray(self.address, num_cpus=self.c.ray.local_cpus)
        nodes = ray_cluster.live_nodes()
        ray_cluster.require_schedulable(demands(cfg))
        if self.joined and self.c.storage.check_nodes and len(nodes) > 1:
            if self.uri:
                check_uri_visible(self.uri, nodes)
            else:
                check_run_dir_visible(self.run_dir, nodes)
        catalog = getattr(getattr(cfg, "loop", None), "catalog", "") or self.c.storage.catalog
        if catalog.startswith("postgres"):
            from deploy.cluster_check import _catalog

            _catalog(catalog)  # unreachable: one error now, not at the first put
        try:
            for key, value in self._services(nodes).items():
                setattr(cfg.pool, key, value)
            for what, spec in (("WAL service", cfg.pool.wal_addr), ("sandbox service", cfg.pool.sandbox_addr)):
                for a in filter(None, (x.strip() for x in spec.split(","))):
                    why = ray_cluster.probe_tcp(a)
                    if why:
                        raise UserError(f"{what} {a} unreachable ({why})")
        except BaseException:
            self.close()
            raise

    def _services(self, nodes: list[dict]) -> dict[str, str]:
        from rollout.services import Services

        out = {}
        self.services = Services()
        wal, sb = self.c.wal, self.c.sandbox
        wmode = _mode(wal.mode, self.joined)
        if wmode == "external":
            if not wal.addresses:
                raise UserError("[wal] mode = \"external\" needs addresses = [\"host:port\", ...]")
            out["wal_addr"] = ",".join(wal.addresses)
        elif wmode == "actor":
            d = wal.dir or str(self.run_dir.resolve() / SERVICES_DIR / uuid.uuid4().hex[:8] / "wal")
            addrs = self.services.start_wal(d, wal.shards, _resolve_node(wal.node, nodes), _token(WAL_TOKEN_ENV),
                                            wal.max_streams)
            out["wal_addr"] = ",".join(addrs)
        if self.tools:
            smode = _mode(sb.mode, self.joined)
            if smode == "external":
                if not sb.addresses:
                    raise UserError("[sandbox] mode = \"external\" needs addresses = [\"host:port\", ...]")
                out["sandbox_addr"] = ",".join(sb.addresses)
            elif smode == "actor":
                addrs = self.services.start_sandboxes(self.run_dir.resolve() / SERVICES_DIR / uuid.uuid4().hex[:8] / "sandbox", sb.replicas,
                                                      _resolve_node(sb.node, nodes), _token(SANDBOX_TOKEN_ENV))
                out["sandbox_addr"] = ",".join(addrs)
        return out

    def close(self) -> None:
        if self.services is not None:
            self.services.close()
            self.services = None
