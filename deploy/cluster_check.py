"""`--dry-run`: probe everything a run on the cluster depends on, print one line per dependency, run nothing.

Checks: Ray (reachable, live nodes, the run's resource demands schedulable), the catalog (PostgreSQL
answers `SELECT 1`), the WAL services (each shard answers Stats with the token), the sandbox
services (each replica answers Info), and storage (the run directory writable and seen by every
node; a URI run directory, shard and snapshot URIs: a probe object written, read back and deleted).
A failed check is reported with the reason; any failure makes the command exit with one error line
after the report.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from core.errors import UserError
from deploy.cluster import (SANDBOX_TOKEN_ENV, WAL_TOKEN_ENV, ClusterRun, _mode, _resolve_node, check_run_dir_visible,
                            check_uri_visible, demands)
from rollout import ray_cluster

TIMEOUT_S = 5.0


def _ray(run: ClusterRun, cfg) -> str:
    if not run.joined:
        nodes = [{"CPU": float(run.c.ray.local_cpus)}]
        problems = ray_cluster.check_schedulable(demands(cfg), nodes)
        if problems:
            raise UserError("; ".join(problems))
        return f"no cluster named: a local Ray with {run.c.ray.local_cpus} CPUs will be started; demands fit"
    target = ray_cluster.init_ray(run.address)
    nodes = ray_cluster.live_nodes()
    ray_cluster.require_schedulable(demands(cfg))
    cpus = sum(n["resources"].get("CPU", 0) for n in nodes)
    gpus = sum(n["resources"].get("GPU", 0) for n in nodes)
    return f"{target}: {len(nodes)} live nodes, {cpus:g} CPU, {gpus:g} GPU; demands fit"


def _catalog(url: str) -> str:
    if not url.startswith(("postgresql", "postgres://")):
        return f"SQLite {url or '(in the run directory)'}: read and written by the driver only"
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": int(TIMEOUT_S)})
    try:
        with engine.connect() as conn:
            version = conn.execute(sqlalchemy.text("select version()")).scalar()
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise UserError(f"PostgreSQL {engine.url.render_as_string(hide_password=True)}: "
                        f"{str(exc.orig or exc).splitlines()[0]}") from None
    finally:
        engine.dispose()
    return f"{engine.url.render_as_string(hide_password=True)}: {str(version).split(',')[0]}"


def _wal(run: ClusterRun, cfg, nodes: list[dict]) -> str:
    import wal

    w = run.c.wal
    mode = _mode(w.mode, run.joined)
    if mode == "embedded":
        if cfg.pool.wal_addr:
            mode, addresses = "external", cfg.pool.wal_addr.split(",")
        elif run.joined and len(nodes) > 1:
            raise UserError("an embedded WAL on a cluster: workers on other nodes would append to files in the run "
                            "directory; set [wal] mode = \"actor\" or \"external\"")
        else:
            return "in-process logs in the run directory (one machine)"
    if mode == "actor":
        node = _resolve_node(w.node, nodes)
        return f"{w.shards} service(s) to start as actors on node {node[:8]}"
    addresses = w.addresses if mode == "external" and w.addresses else cfg.pool.wal_addr.split(",")
    if not [a for a in addresses if a]:
        raise UserError("[wal] mode = \"external\" needs addresses")
    for a in addresses:
        why = ray_cluster.probe_tcp(a, TIMEOUT_S)
        if why:
            raise UserError(f"WAL service {a} unreachable ({why})")
        log = wal.connect(a, token=os.environ.get(WAL_TOKEN_ENV) or None, retry_s=TIMEOUT_S)
        try:
            log.stats()
        except wal.WALError as exc:
            raise UserError(f"WAL service {a}: {exc}") from None
        finally:
            log.close()
    return f"{len(addresses)} shard(s) answer: {', '.join(addresses)}"


def _sandbox(run: ClusterRun, cfg, nodes: list[dict]) -> str:
    s = run.c.sandbox
    mode = _mode(s.mode, run.joined)
    if mode == "embedded":
        if cfg.pool.sandbox_addr:
            mode = "external"
        elif run.joined and len(nodes) > 1:
            raise UserError("an embedded sandbox binds the driver's loopback, which workers on other nodes cannot "
                            "reach; set [sandbox] mode = \"actor\" or \"external\"")
        else:
            return "a local service on the driver's loopback (one machine)"
    if mode == "actor":
        return f"{s.replicas} replica(s) to start as actors on node {_resolve_node(s.node, nodes)[:8]}"
    from rewards.sandbox.client import SandboxClient, SandboxRefused

    addresses = s.addresses or cfg.pool.sandbox_addr.split(",")
    for a in addresses:
        why = ray_cluster.probe_tcp(a, TIMEOUT_S)
        if why:
            raise UserError(f"sandbox service {a} unreachable ({why})")
        try:
            with SandboxClient(a, os.environ.get(SANDBOX_TOKEN_ENV, ""), timeout_s=TIMEOUT_S, retries=1) as client:
                client.info()
        except SandboxRefused as exc:
            raise UserError(f"sandbox service {a}: {exc}") from None
    return f"{len(addresses)} replica(s) answer: {', '.join(addresses)}"


def _uri(uri: str) -> str:
    if "://" not in uri:
        p = Path(uri)
        p.mkdir(parents=True, exist_ok=True)
        if not os.access(p, os.W_OK):
            raise UserError(f"{uri}: not writable")
        return uri
    from dataplane.remote import RemoteStore

    RemoteStore(uri).probe()
    return uri


def _storage(run: ClusterRun, cfg, nodes: list[dict]) -> str:
    extra = [_uri(u) for u in (run.c.storage.store, run.c.storage.snapshots, cfg.pool.snapshot_uri)
             if u and not (run.uri and u.startswith(run.uri))]
    extra = f"; {', '.join(dict.fromkeys(extra))} written and read back" if extra else ""
    if run.uri:
        from dataplane.remote import RemoteStore

        line = f"run directory {RemoteStore(run.uri).probe()}"
        if run.joined and len(nodes) > 1:
            check_uri_visible(run.uri, nodes)
            line += f", read by all {len(nodes)} nodes"
        return line + extra
    created = [p for p in (run.run_dir, *run.run_dir.parents) if not p.exists()]  # removed again if left empty
    run.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        if not os.access(run.run_dir, os.W_OK):
            raise UserError(f"run directory {run.run_dir}: not writable")
        seen = "this machine"
        if run.joined and len(nodes) > 1:
            check_run_dir_visible(run.run_dir, nodes)
            seen = f"all {len(nodes)} nodes"
    finally:
        for p in created:
            if p.exists() and not any(p.iterdir()):
                p.rmdir()
    return f"run directory {run.run_dir} seen by {seen}" + extra


def _checkpoint(uri: str) -> str:
    from dataplane.remote import RemoteStore

    store = RemoteStore(uri)
    for rel in ("", "final"):
        m = store.manifest(rel)
        if m is not None:
            size = sum(e["bytes"] for e in m["files"].values())
            return f"{store.url(rel)}: committed, {len(m['files'])} files, {size} bytes (sha256 checked on download)"
    raise UserError(f"checkpoint {uri}: no committed checkpoint there (no MANIFEST.json in it or in its final/)")


def check(run: ClusterRun, cfg, catalog: str, out=sys.stdout, checkpoint: str | list[str] = "") -> None:
    """Print one line per dependency; UserError naming the failed ones after the report. `checkpoint`: the
    checkpoint(s) the run reads (its start; OPD's teachers), each checked when it is a URI."""
    results, nodes = [], []

    def one(name, fn, *a):
        try:
            results.append((name, True, fn(*a)))
        except UserError as exc:
            results.append((name, False, str(exc)))
        except Exception as exc:  # a probe that failed in an unexpected way is still that dependency's failure
            results.append((name, False, f"{type(exc).__name__}: {exc}"))
        print(f"  {name:<9} {'ok' if results[-1][1] else 'FAILED':<7} {results[-1][2]}", file=out, flush=True)

    print(f"dry run ({'cluster ' + ray_cluster.named_address(run.address) if run.joined else 'embedded'}):", file=out)
    one("ray", _ray, run, cfg)
    if run.joined and results[-1][1]:
        nodes = ray_cluster.live_nodes()
    elif run.joined:
        failed = [n for n, ok, _ in results if not ok]
        raise UserError(f"dry run: {', '.join(failed)} failed; nothing else can be checked without Ray")
    one("catalog", _catalog, catalog)
    one("wal", _wal, run, cfg, nodes)
    if run.tools:
        one("sandbox", _sandbox, run, cfg, nodes)
    one("storage", _storage, run, cfg, nodes)
    for spec in [checkpoint] if isinstance(checkpoint, str) else checkpoint:
        if "://" in str(spec):
            one("checkpoint", _checkpoint, str(spec))
    failed = [n for n, ok, _ in results if not ok]
    if failed:
        raise UserError(f"dry run: {len(failed)} of {len(results)} checks failed ({', '.join(failed)})")
    print(f"dry run: all {len(results)} checks passed", file=out, flush=True)
