"""The WAL and sandbox services as Ray actors pinned to a node (the alternative to an external address).

A log service must live on a node whose disk is durable and stays up for the run: `start_wal` starts
one `wal.server.Server` per shard, each in an actor pinned (hard node affinity) to the given node,
bound to that node's IP with a token, and returns their addresses in shard order (the shard map).
`start_sandboxes` does the same for sandbox service replicas. `Services.close()` stops them.
"""
from __future__ import annotations

import os
from pathlib import Path

try:
    import ray

    @ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
    class WALServiceActor:
        """`postrain wal serve` inside a Ray actor, bound to the IP of the node it runs on."""

        def __init__(self, directory: str, token: str, max_workers: int = 1024):
            from wal.config import ServeConfig
            from wal.server import Server

            host = ray.util.get_node_ip_address()
            self.server = Server(directory, ServeConfig(host=host, port=0, max_workers=max_workers), token=token)

        def address(self) -> str:
            return self.server.address

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return os.getpid()

        def stop(self) -> None:
            self.server.stop()

    @ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
    class SandboxServiceActor:
        """`postrain sandbox serve` inside a Ray actor, bound to the IP of the node it runs on."""

        def __init__(self, log_dir: str, token: str, isolate_pure: bool = True, replica: int = 0):
            from rewards.sandbox.config import SandboxConfig
            from rewards.sandbox.server import SandboxServer

            host = ray.util.get_node_ip_address()
            slots = SandboxConfig.model_fields["max_concurrent"].default
            self.server = SandboxServer(SandboxConfig(host=host, port=0, log_dir=Path(log_dir),
                                                      isolate_pure_tools=isolate_pure, first_slot=replica * slots),
                                        token=token)

        def address(self) -> str:
            return self.server.target

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def stop(self) -> None:
            self.server.stop()
except ImportError:  # pragma: no cover - ray is a dependency
    WALServiceActor = SandboxServiceActor = None


def _pinned(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


class Services:
    """Actors started for a run; `close()` stops and kills them."""

    def __init__(self):
        self.actors: list = []

    def start_wal(self, directory: str | Path, shards: int, node_id: str, token: str, max_workers: int = 1024,
                  timeout_s: float = 120.0) -> list[str]:
        """`shards` log services (DIR/shard-K) pinned to `node_id`; their addresses in shard order."""
        actors = [WALServiceActor.options(scheduling_strategy=_pinned(node_id)).remote(
            str(Path(directory) / f"shard-{k}"), token, max_workers) for k in range(shards)]
        self.actors += actors
        return ray.get([a.address.remote() for a in actors], timeout=timeout_s)

    def start_sandboxes(self, log_dir: str | Path, replicas: int, node_id: str, token: str, isolate_pure: bool = True,
                        timeout_s: float = 120.0) -> list[str]:
        """`replicas` sandbox services (LOG_DIR/replica-K) pinned to `node_id`; their addresses."""
        actors = [SandboxServiceActor.options(scheduling_strategy=_pinned(node_id)).remote(
            str(Path(log_dir) / f"replica-{k}"), token, isolate_pure, k) for k in range(replicas)]  # disjoint slots
        self.actors += actors
        return ray.get([a.address.remote() for a in actors], timeout=timeout_s)

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=30)
            except Exception:  # already dead or stuck: killed below
                pass
            ray.kill(a, no_restart=True)
        self.actors = []
