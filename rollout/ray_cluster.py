"""Ray for postrain: join the cluster a job names, or start a local one; refuse what can never be scheduled.

`init_ray(address)` joins the cluster named by `address`, else by RAY_ADDRESS (what `ray job submit`
sets for its entrypoint). Joining passes no num_cpus / num_gpus: the cluster's nodes own their
resources. Only when nothing names a cluster does it start a local Ray for this process, with
`address="local"`, so that another Ray instance on the same machine is never joined by accident.

`check_schedulable(demands, nodes)` (pure) compares what a run will ask for (rollout workers, learner
ranks as one placement group, teacher workers, service replicas) with the resources of the live
nodes, so a request that no node can hold fails at start with a message instead of waiting forever.
"""
from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field

from core.errors import UserError

RESOURCE_KEYS = ("CPU", "GPU")
# The GCS address of a local Ray that a parent job (postrain pipeline) started for its stages. Unlike
# RAY_ADDRESS it names no cluster: a stage joins it instead of starting its own Ray and otherwise runs
# as embedded (its own WAL and sandbox, no cluster checks).
SHARED_RAY_ENV = "POSTRAIN_SHARED_RAY"


def named_address(explicit: str | None = None) -> str:
    """The cluster to join: `explicit` (--ray-address, [ray] address), else RAY_ADDRESS; "" = none (start a local Ray)."""
    if explicit:
        return explicit
    return os.environ.get("RAY_ADDRESS", "").strip()


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def probe_tcp(address: str, timeout_s: float = 5.0) -> str | None:
    """None when a TCP connection to host:port opens within `timeout_s`, else why not."""
    hp = _host_port(address)
    if hp is None:
        return f"{address!r} is not host:port"
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{hp[0]}:{hp[1]}: {exc.strerror or exc}"


def init_ray(address: str | None = None, num_cpus: int = 2) -> str:
    """Join the named cluster (see `named_address`) or start a local Ray; returns the address joined ("" = local).
    An unreachable cluster is a UserError at once (ray.init itself would retry for a minute)."""
    import ray

    target = named_address(address)
    if ray.is_initialized():
        return target
    shared = os.environ.get(SHARED_RAY_ENV, "").strip()
    if target == "" and shared:  # the local Ray of the job this process is a stage of: joined, still embedded
        ray.init(address=shared, log_to_driver=False, configure_logging=False)
        return ""
    if target in ("local", ""):
        # Ray starts its workers at nice 15: on a shared machine the rollout actors then wait behind every
        # other process while the driver (nice 0) waits for them. Same priority as the driver, unless set.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        return ""
    if target != "auto" and not target.startswith("ray://"):
        why = probe_tcp(target)
        if why is not None:
            raise UserError(f"cannot reach the Ray cluster at {target} ({why}); start its head "
                            f"(`ray start --head --port PORT`) or fix RAY_ADDRESS / --ray-address / [ray] address")
    try:
        ray.init(address=target, log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise UserError(f"cannot join the Ray cluster at {target}: {exc}") from None
    return target


@contextmanager
def local_shared_ray(num_cpus: int):
    """Start a local Ray in this process for the block and name it in $POSTRAIN_SHARED_RAY, so that every
    `postrain` child started inside joins it (`init_ray`) instead of starting its own; shut down after."""
    import ray

    init_ray("local", num_cpus=num_cpus)
    os.environ[SHARED_RAY_ENV] = address = ray.get_runtime_context().gcs_address
    try:
        yield address
    finally:
        os.environ.pop(SHARED_RAY_ENV, None)
        with redirect_stdout(sys.stderr):  # the worker notices Ray still holds are printed now: not on stdout
            ray.shutdown()


@dataclass(frozen=True)
class Demand:
    """`count` bundles of `resources` that `what` needs at once; `strategy` says how bundles may be placed."""

    what: str
    count: int
    resources: dict[str, float] = field(default_factory=dict)
    strategy: str = "SPREAD"  # PACK, SPREAD (anywhere), STRICT_PACK (one node), STRICT_SPREAD (one node each)


def check_schedulable(demands: list[Demand], nodes: list[dict[str, float]]) -> list[str]:
    """Problems with running every demand at once on `nodes` (each node's total resources); [] = schedulable.

    Checked: each bundle fits one node; STRICT_PACK groups fit one node; STRICT_SPREAD groups have
    enough distinct nodes; the sum of all demands fits the cluster's total. (Fragmentation across
    nodes beyond that is left to Ray.)"""
    problems = []
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            total[k] = total.get(k, 0.0) + v
    need: dict[str, float] = {}
    for d in demands:
        if d.count <= 0:
            continue
        bundle = {k: v for k, v in d.resources.items() if v > 0}
        fits = [n for n in nodes if all(n.get(k, 0.0) >= v for k, v in bundle.items())]
        if bundle and not fits:
            problems.append(f"{d.what}: no node has {_fmt(bundle)} (largest node: {_fmt(_largest(nodes, bundle))})")
            continue
        if d.strategy == "STRICT_PACK" and bundle:
            group = {k: v * d.count for k, v in bundle.items()}
            if not any(all(n.get(k, 0.0) >= v for k, v in group.items()) for n in nodes):
                problems.append(f"{d.what}: STRICT_PACK needs {_fmt(group)} on one node; no node has that much")
        if d.strategy == "STRICT_SPREAD" and len(fits) < d.count:
            problems.append(f"{d.what}: STRICT_SPREAD needs {d.count} nodes with {_fmt(bundle)} each; "
                            f"{len(fits)} have it")
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v * d.count
    for k, v in need.items():
        if v > total.get(k, 0.0) + 1e-9:
            who = ", ".join(f"{d.what} {d.count} x {_fmt(d.resources)}" for d in demands if d.resources.get(k, 0) > 0)
            problems.append(f"the run needs {v:g} {k} at once ({who}); the cluster has {total.get(k, 0.0):g}")
    return problems


def _fmt(res: dict[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(res.items()) if v) or "nothing"


def _largest(nodes: list[dict[str, float]], bundle: dict[str, float]) -> dict[str, float]:
    keys = list(bundle) or list(RESOURCE_KEYS)
    return max(nodes, key=lambda n: tuple(n.get(k, 0.0) for k in keys), default={})


def live_nodes() -> list[dict]:
    """The alive nodes of the joined cluster: {"id", "ip", "resources"}."""
    import ray

    return [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "resources": dict(n.get("Resources", {}))}
            for n in ray.nodes() if n.get("Alive")]


def require_schedulable(demands: list[Demand]) -> None:
    """UserError naming every demand the live cluster can never satisfy (call after init_ray)."""
    nodes = live_nodes()
    problems = check_schedulable(demands, [n["resources"] for n in nodes])
    if problems:
        raise UserError("resources the cluster cannot provide: " + "; ".join(problems)
                        + f" ({len(nodes)} live nodes; lower the requests in [rollout]/[learner]/[teacher] or add nodes)")


def node_id() -> str:
    """The Ray node id of the calling process (driver or actor)."""
    import ray

    return ray.get_runtime_context().get_node_id()
