"""A real multi-node Ray cluster on this machine: a head and N worker nodes, each its own raylet.

For tests, benchmarks and drills: `LocalCluster(workers=2)` starts a head (GCS, dashboard with the job
API, no CPUs of its own by default, so actors land on the worker nodes) and N worker raylets, all on
free ports (never Redis' 6379). `remove_worker(i)` kills one worker node's processes (SIGKILL: a node
failure, not a drain); `stop()` kills every process the cluster started, by pid. Nothing here joins
the cluster: callers use `.address` (GCS, for ray.init / RAY_ADDRESS) or `.dashboard_url` (for
`ray job submit --address`).
"""
from __future__ import annotations

import os
import signal
import socket
import time

OBJECT_STORE_BYTES = 80 << 20  # small: several nodes share one machine's /dev/shm


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 6379:
            return port


class LocalCluster:
    def __init__(self, workers: int = 2, cpus_per_worker: int = 2, head_cpus: int = 0, dashboard: bool = True,
                 worker_resources: dict | None = None, env: dict | None = None):
        from ray.cluster_utils import Cluster

        self.cpus_per_worker, self.worker_resources = cpus_per_worker, worker_resources or {}
        self._env = dict(env or {})
        self._saved_env = {k: os.environ.get(k) for k in self._env}
        os.environ.update(self._env)  # the raylets inherit it (e.g. PYTHONPATH of the code under test)
        self.dashboard_port = free_port() if dashboard else None
        head = dict(gcs_server_port=free_port(), num_cpus=head_cpus, object_store_memory=OBJECT_STORE_BYTES,
                    include_dashboard=dashboard, dashboard_host="127.0.0.1")
        if dashboard:
            head["dashboard_port"] = self.dashboard_port
        self._cluster = Cluster(initialize_head=True, connect=False, head_node_args=head, shutdown_at_exit=True)
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
        node = self._cluster.add_node(wait=wait, num_cpus=self.cpus_per_worker, object_store_memory=OBJECT_STORE_BYTES,
                                      resources=dict(self.worker_resources))
        self.workers.append(node)
        return node

    def remove_worker(self, index: int) -> str:
        """Kill worker node `index` (all its processes, SIGKILL); returns its node id."""
        node = self.workers.pop(index)
        self._cluster.remove_node(node, allow_graceful=False)
        return node.node_id

    def pids(self) -> list[int]:
        """Pids of every process the cluster started (head and workers)."""
        out = []
        for node in [self._cluster.head_node, *self.workers]:
            if node is None:
                continue
            for infos in node.all_processes.values():
                out += [i.process.pid for i in infos if i.process is not None]
        return out

    def _wait_for_jobs_api(self, timeout_s: float = 60.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard at {self.dashboard_url} did not come up in {timeout_s:.0f}s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Kill every process of the cluster (workers first), by pid; the pids must be gone afterwards."""
        pids = self.pids()
        try:
            self._cluster.shutdown()
        finally:
            for pid in pids:  # anything shutdown() left (it waits for each; this is the backstop)
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
