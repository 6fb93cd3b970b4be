"""Catalog tables (SQLAlchemy Core). Bump SCHEMA_VERSION on any change and add its step to MIGRATIONS;
`Catalog` migrates older versions in place and refuses unknown ones."""
from __future__ import annotations

from sqlalchemy import (BigInteger, Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text,
                        UniqueConstraint)

SCHEMA_VERSION = 2

# SQLite only aliases the rowid for a column typed exactly INTEGER PRIMARY KEY.
Key = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

meta = Table(
    "dp_meta", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(256), nullable=False),
)

runs = Table(
    "dp_runs", metadata,
    Column("name", String(200), primary_key=True),
    Column("created_at", Float, nullable=False),
)

policy_versions = Table(
    "dp_policy_versions", metadata,
    Column("run", String(200), ForeignKey("dp_runs.name"), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("created_at", Float, nullable=False),
    Column("checkpoint", String(1024), nullable=True),
)

shards = Table(
    "dp_shards", metadata,
    Column("id", Key, primary_key=True, autoincrement=True),
    Column("path", String(1024), nullable=False),
    Column("run", String(200), ForeignKey("dp_runs.name"), nullable=False),
    Column("rows", Integer, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("checksum", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("path", name="dp_shards_path_key"),
)

trajectories = Table(
    "dp_trajectories", metadata,
    Column("seq", Key, primary_key=True, autoincrement=True),
    Column("id", String(300), nullable=False),
    Column("run", String(200), ForeignKey("dp_runs.name"), nullable=False),
    Column("domain", String(100), nullable=False),
    Column("prompt", Text, nullable=False),
    Column("group_id", String(300), nullable=False),
    Column("length", BigInteger, nullable=False),
    Column("policy_min", Integer, nullable=False),
    Column("policy_max", Integer, nullable=False),
    Column("reward", Float, nullable=False),
    Column("status", String(16), nullable=False),
    Column("teacher_id", String(200), nullable=True),
    Column("meta", Text, nullable=True),  # JSON object of small per-trajectory facts (e.g. a cache record)
    Column("shard_id", Key, ForeignKey("dp_shards.id"), nullable=False),
    Column("row", Integer, nullable=False),
    Column("checksum", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("id", name="dp_trajectories_id_key"),
    Index("dp_trajectories_select", "run", "domain", "status"),
    Index("dp_trajectories_shard", "shard_id"),
)

# version -> SQL statements that bring a catalog of that version to the next one
MIGRATIONS: dict[int, list[str]] = {
    1: ["ALTER TABLE dp_trajectories ADD COLUMN meta TEXT"],
}
