"""A real multi-node Ray cluster on this machine: a head and N worker nodes, each its own raylet.

For tests, benchmarks and drills (`postrain drill node-loss`): `LocalCluster(workers=2)` starts a head (GCS,
dashboard with the job API, no CPUs of its own by default, so actors land on the worker nodes) and N worker
raylets, all on free ports (never Redis' 6379, nor Ray's fixed defaults, which another cluster on the
machine may hold). `remove_worker(i)` kills one worker node's processes (SIGKILL: a node failure, not a
drain); `stop()` kills every process the cluster started, by pid. Nothing here joins the cluster: callers
use `.address` (GCS, for ray.init / RAY_ADDRESS) or `.dashboard_url` (for `ray job submit --address`).
"""
from __future__ import annotations

import os
import signal
import socket
import time

OBJECT_STORE_BYTES = 80 << 20  # small: several nodes share one machine's /dev/shm
# The GCS declares a node dead after `failure_threshold` missed health checks `period_ms` apart (Ray's
# defaults add up to ~15 s); a node failure here is noticed in ~3 s (set the same RAY_health_check_* on a real cluster).
FAST_FAILURE_DETECTION = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                          "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # Ray's token authentication settings


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 6379:
            return port


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (zombies count as gone)."""
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(p)
        except OSError:
            pass
    return out


class LocalCluster:
    def __init__(self, workers: int = 2, cpus_per_worker: int = 2, head_cpus: int = 0, dashboard: bool = True,
                 gpus_per_worker: int = 0,
                 worker_resources: dict | None = None, env: dict | None = None,
                 system_config: dict | None = None):
        from ray.cluster_utils import Cluster

        self.cpus_per_worker, self.worker_resources = cpus_per_worker, worker_resources or {}
        self.gpus_per_worker = gpus_per_worker  # declared to Ray only (for placement checks); no device behind it
        self._env = dict(env or {})
        self._saved_env = {k: os.environ.get(k) for k in self._env}
        os.environ.update(self._env)  # the raylets inherit it (e.g. PYTHONPATH of the code under test)
        self.dashboard_port = free_port() if dashboard else None
        head = dict(gcs_server_port=free_port(), num_cpus=head_cpus, object_store_memory=OBJECT_STORE_BYTES,
                    include_dashboard=dashboard, dashboard_host="127.0.0.1",
                    _system_config=dict(FAST_FAILURE_DETECTION if system_config is None else system_config))
        if dashboard:  # the head's job agent too: Ray's fixed default (52365) may be another cluster's on this machine
            head.update(dashboard_port=self.dashboard_port, dashboard_agent_listen_port=free_port())
        self._cluster = Cluster(initialize_head=True, connect=False, head_node_args=head, shutdown_at_exit=True)
        # Ray's authentication as the head started with it (a Ray started earlier in this process turns token
        # mode on in os.environ): a process joining from outside needs the same (`client_env`)
        self.auth_env = {k: os.environ[k] for k in AUTH_ENV if k in os.environ}
        self.workers: list = []
        try:
            for _ in range(workers):
                self.add_worker()
            if dashboard:
                self._wait_for_jobs_api()
        except BaseException:
            self.stop()
            raise

    # -- addresses ------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """GCS address (RAY_ADDRESS / ray.init(address=...))."""
        return self._cluster.address

    def client_env(self, base: dict | None = None) -> dict:
        """The environment for a process that joins this cluster from outside (`ray job submit`, a driver with
        RAY_ADDRESS): `base` (default os.environ) with the cluster's authentication mode and token source."""
        env = dict(os.environ if base is None else base)
        for k in AUTH_ENV:
            env.pop(k, None)
        return env | self.auth_env

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def head_node_id(self) -> str:
        return self._cluster.head_node.node_id

    @property
    def worker_node_ids(self) -> list[str]:
        return [n.node_id for n in self.workers]

    # -- nodes ----------------------------------------------------------------------------------------
    def add_worker(self, wait: bool = True):
        node = self._cluster.add_node(wait=wait, num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                                      object_store_memory=OBJECT_STORE_BYTES,
                                      resources=dict(self.worker_resources))
        self.workers.append(node)
        return node

    def remove_worker(self, index: int) -> str:
        """Kill worker node `index` (its raylet and every process under it, SIGKILL): a node failure. Returns its id."""
        node = self.workers[index]
        doomed = set()
        for infos in node.all_processes.values():
            doomed |= {d for i in infos if i.process is not None for d in descendants(i.process.pid)}
        for pid in doomed:  # the node's workers die with it, as they would with the machine
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._cluster.remove_node(node, allow_graceful=False)
        self.workers.pop(index)
        return node.node_id

    def pids(self) -> list[int]:
        """Pids of every process the cluster runs: each node's own and their descendants (agents, workers)."""
        roots = []
        for node in [self._cluster.head_node, *self.workers]:
            if node is None:
                continue
            for infos in node.all_processes.values():
                roots += [i.process.pid for i in infos if i.process is not None]
        return sorted(set(roots) | {d for r in roots for d in descendants(r)})

    def _wait_for_jobs_api(self, timeout_s: float = 300.0) -> None:
        """Until the head's job agent takes a job: the dashboard answers before its agent has registered
        ("No available agent to submit job"), so a trivial job is submitted until one runs to the end."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                client = JobSubmissionClient(self.dashboard_url)
                job = client.submit_job(entrypoint="true")
                while time.monotonic() < deadline:
                    status = client.get_job_status(job)
                    if status == JobStatus.SUCCEEDED:
                        return
                    if status in (JobStatus.FAILED, JobStatus.STOPPED):
                        raise RuntimeError(f"the readiness job ended {status}")
                    time.sleep(0.25)
            except (RuntimeError, ConnectionError, OSError) as exc:
                last = exc
                time.sleep(0.5)
        raise RuntimeError(f"the job API at {self.dashboard_url} did not take a job in {timeout_s:.0f}s (last: {last})")

    def stop(self, wait_s: float = 30.0) -> list[int]:
        """Kill every process of the cluster (workers first), by pid, and wait until they are gone; returns those
        still alive after `wait_s` (none, normally)."""
        pids = self.pids()
        try:
            self._cluster.shutdown()
        finally:
            for pid in alive(pids):  # anything shutdown() left (it waits for each; this is the backstop)
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + wait_s
            while alive(pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return alive(pids)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
