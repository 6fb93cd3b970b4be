"""`configs/cluster.toml`: where a run finds its cluster, services and storage, and what it asks the cluster for.

One file a user edits for a cluster (`--cluster FILE` on rollout / grpo / opd / pipeline). It is laid
over the command's own config (its `--set` still wins), see `deploy/cluster.py`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config import Config

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RayTable(Config):
    """Which Ray to run on."""

    address: str = Field("", description="GCS host:port (or ray://host:port) of the cluster to join; empty: RAY_ADDRESS "
                         "(set by `ray job submit`), else a local Ray started for this run")
    local_cpus: int = Field(2, ge=1, le=4096, description="CPUs of that local Ray")


class RolloutPlacement(Config):
    """Rollout worker actors."""

    worker_cpus: float = Field(1.0, ge=0, le=1024, description="Ray CPUs each rollout worker reserves")
    worker_gpus: float = Field(0.0, ge=0, le=64, description="Ray GPUs each rollout worker reserves")
    strategy: Literal["DEFAULT", "SPREAD"] = Field("SPREAD", description="SPREAD: over as many nodes as possible")


class LearnerPlacement(Config):
    """Learner ranks: one placement group of `learner.ranks` bundles."""

    cpus_per_rank: float = Field(1.0, ge=0, le=1024, description="Ray CPUs per learner rank")
    strategy: Strategy = Field("PACK", description="placement group strategy of the ranks (PACK keeps them close)")


class TeacherPlacement(Config):
    """OPD teacher prefill workers (their count is opd.teacher_workers)."""

    worker_cpus: float = Field(1.0, ge=0, le=1024, description="Ray CPUs per teacher worker")
    worker_gpus: float = Field(0.0, ge=0, le=64, description="Ray GPUs per teacher worker")


class StorageTable(Config):
    """What every node must reach: the run directory, the catalog, shards and KV snapshots."""

    catalog: str = Field("", description="data-plane catalog: postgresql://user@host:port/db on a cluster; empty: "
                         "SQLite in the run directory (one machine only)")
    store: str = Field("", description="shard store: a shared directory or a pyarrow.fs URI (s3://, gs://, hdfs://, "
                       "file://); empty: in the run directory")
    snapshots: str = Field("", description="KV snapshot store, same forms; empty: in the run directory")
    check_nodes: bool = Field(True, description="check at start that every live node sees the run directory")


class WALTable(Config):
    """The token WAL that rollout workers append to."""

    mode: Literal["auto", "embedded", "external", "actor"] = Field(
        "auto", description="embedded: in-process logs in the run directory (one machine); external: the services "
        "at `addresses`; actor: `shards` services started as Ray actors pinned to `node`; auto: embedded on a local "
        "Ray, actor on a joined cluster")
    addresses: list[str] = Field(default_factory=list, description="external services, host:port each, in shard order "
                                 "(the shard map: trajectory -> crc32(id) mod n; keep the order for a run's life); "
                                 "token in $POSTRAIN_WAL_TOKEN")
    shards: int = Field(1, ge=1, le=256, description="services started in actor mode")
    node: str = Field("", description="node id or IP the actor-mode services are pinned to (a durable disk); "
                      "empty: the driver's node")
    dir: str = Field("", description="log directory on that node; empty: a fresh RUN_DIR/services/ID/wal per start")
    max_streams: int = Field(1024, ge=2, le=65536, description="concurrent streams each actor-mode service holds")


class SandboxTable(Config):
    """The tool sandbox service of tool-using domains."""

    mode: Literal["auto", "embedded", "external", "actor"] = Field(
        "auto", description="embedded: a local service on the driver's loopback (one machine); external: "
        "`addresses`; actor: `replicas` services as Ray actors pinned to `node`; auto: embedded on a local Ray, "
        "actor on a joined cluster")
    addresses: list[str] = Field(default_factory=list, description="external replicas, host:port each (worker k uses "
                                 "replica k mod n); token in $POSTRAIN_SANDBOX_TOKEN")
    replicas: int = Field(1, ge=1, le=32, description="services started in actor mode (each takes its own 8 of the host's 256 execution slots)")
    node: str = Field("", description="node id or IP of the actor-mode replicas; empty: the driver's node")


class ClusterConfig(Config):
    """`configs/cluster.toml`."""

    ray: RayTable = Field(default_factory=RayTable, description="the Ray cluster")
    rollout: RolloutPlacement = Field(default_factory=RolloutPlacement, description="rollout worker resources")
    learner: LearnerPlacement = Field(default_factory=LearnerPlacement, description="learner rank resources")
    teacher: TeacherPlacement = Field(default_factory=TeacherPlacement, description="teacher worker resources")
    storage: StorageTable = Field(default_factory=StorageTable, description="shared storage")
    wal: WALTable = Field(default_factory=WALTable, description="token WAL services")
    sandbox: SandboxTable = Field(default_factory=SandboxTable, description="sandbox services")
