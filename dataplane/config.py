"""Typed config of the data plane ([dataplane] in configs/dataplane.toml)."""
from __future__ import annotations

from pydantic import Field

from core.config import Config


class DataPlaneConfig(Config):
    """Where trajectories live and how epochs are planned."""

    catalog: str = Field("runs/default/catalog.db", min_length=1, description="SQLite path or postgresql:// URL")
    namespace: str | None = Field(None, description="PostgreSQL schema holding this catalog's tables")
    store: str = Field("runs/default/store", min_length=1, description="shard root: directory or pyarrow.fs URI")
    shard_mb: int = Field(256, ge=1, le=65536, description="target shard file size, MiB")
    tokens_per_rank: int = Field(65536, ge=1, le=1 << 30, description="token budget of one rank's bin per minibatch")
    ranks: int = Field(1, ge=1, le=65536, description="data-parallel ranks a minibatch is balanced across")
    seed: int = Field(0, ge=0, description="shuffle seed (an epoch's order is a function of seed and epoch)")
    group_aware: bool = Field(True, description="shuffle GRPO groups as units, never split one across minibatches")
    by_teacher: bool = Field(False, description="order minibatches by teacher (OPD: one teacher head resident)")
    prefetch: int = Field(1, ge=0, le=8, description="minibatches the loader builds ahead")
    verify: bool = Field(True, description="check each trajectory's checksum when the loader reads it")


class DataPlaneFile(Config):
    """configs/dataplane.toml: one [dataplane] table."""

    dataplane: DataPlaneConfig = Field(default_factory=DataPlaneConfig, description="the data plane")
