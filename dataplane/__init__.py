"""dataplane: trajectory catalog (SQLite embedded / PostgreSQL), Arrow heavy-field store, metadata-only
planner (shuffle, pack, balance) and a streaming loader for million-token trajectories.

API (what rollout workers and learners call)::

    import dataplane
    dp = dataplane.open("runs/x/catalog.db", "runs/x/store")      # or "postgresql://...", "s3://..."
    dp.put([dataplane.TrajectoryRecord(id=..., run=..., domain=..., prompt=..., group_id=...,
                                        tokens=..., loss_mask=..., logprobs=..., reward=...,
                                        policy_min=v, policy_max=v, extras={"teacher_hidden": h})])
    sel = dp.select(run="x", domain="arith", policy_min=3, status="complete")   # light metadata only
    plan = dp.plan(sel, tokens_per_rank=65536, ranks=8, seed=0, epoch=0, group_aware=True)
    for batch in dp.loader(plan, rank=r, extras=["teacher_hidden"]):        # a remote rank can use
        batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.loss_mask, batch.logprobs  # dataplane.loader(plan, r)

Contract: `put` makes a trajectory visible only after its shard is durable (a crash in between leaves
an orphan file for `gc`, never a half-visible row). A plan covers every selected token exactly once;
a trajectory longer than `tokens_per_rank` comes as contiguous pieces that move forward in (minibatch,
rank), with `position_ids` continuing from the piece's start. Batches stay valid as long as they are
referenced (buffers are reused only once released). Failures raise a DataPlaneError subclass whose
message names the trajectory and the file.

Files:
    __init__.py  `open()` factory, `loader()` for ranks that only hold a plan, public names
    types.py     TrajectoryRecord, Selection, Plan (picklable, JSON-able), Batch, STATUSES
    errors.py    DataPlaneError and its kinds: schema version, bad record, missing shard, checksum, stale row
    schema.py    catalog tables (SQLAlchemy Core) and SCHEMA_VERSION
    catalog.py   Catalog: open + schema check, transactional insert, select -> numpy metadata, stats
    columns.py   bulk column transfer for select: one text per column, parsed in numpy / Arrow (no object per row)
    sqlite.py    SQLite backend: WAL, synchronous=FULL, BEGIN IMMEDIATE, busy timeout, column aggregates
    postgres.py  PostgreSQL backend: psycopg 3, optional namespace (schema) per catalog, column aggregates
    codec.py     pure shard codec: records <-> Arrow record batch, row checksums, zero-copy views
    store.py     ShardStore: atomic checksummed IPC shard files on local disk (mmap) or pyarrow.fs
    remote.py    RemoteStore: objects and manifest-committed trees under a pyarrow.fs URI (atomic without rename)
    packing.py   pure numpy kernels: split, next-fit chain by pointer doubling, greedy rank balance
    planner.py   pure numpy planner: seeded (group-aware, by-teacher) shuffle -> split -> pack -> Plan
    streaming.py Loader: per-minibatch reads of needed rows/ranges, packed torch tensors, bounded prefetch
    plane.py     DataPlane: put (shard durable before catalog), select, plan, loader, stats, verify, gc
    config.py    DataPlaneConfig (typed, bounded) for configs/dataplane.toml
"""
from __future__ import annotations

import os

from dataplane.errors import (BadRecordError, ChecksumError, DataPlaneError, SchemaVersionError, ShardMissingError,
                              StaleRowError)
from dataplane.types import STATUSES, Batch, Plan, Selection, TrajectoryRecord

__all__ = ["open", "loader", "DataPlane", "TrajectoryRecord", "Selection", "Plan", "Batch", "STATUSES",
           "DataPlaneError", "SchemaVersionError", "BadRecordError", "ShardMissingError", "ChecksumError",
           "StaleRowError"]


def open(catalog_url: str | os.PathLike, store_root: str | os.PathLike, *, namespace: str | None = None,
         filesystem=None, shard_bytes: int = 256 << 20, create: bool = True, use_mmap: bool = True):
    """Open (or create) a data plane: `catalog_url` is a SQLite path / `sqlite:///` URL or a PostgreSQL
    URL (`namespace`: a PostgreSQL schema to keep catalogs apart); `store_root` a local directory or a
    `pyarrow.fs` URI (or a path inside `filesystem`). `create=False` opens an existing catalog and creates
    neither it nor the store's directory (a reader)."""
    from dataplane.catalog import Catalog
    from dataplane.plane import DataPlane
    from dataplane.store import ShardStore

    store = ShardStore(store_root, filesystem=filesystem, use_mmap=use_mmap, create=create)
    return DataPlane(Catalog(catalog_url, namespace=namespace, create=create), store, shard_bytes=shard_bytes)


def loader(plan: Plan, rank: int = 0, **kwargs):
    """A loader for a rank that holds only the plan (no catalog): shards come from `plan.store_root`."""
    from dataplane.streaming import Loader

    return Loader(plan, rank=rank, **kwargs)


def __getattr__(name):
    if name == "DataPlane":
        from dataplane.plane import DataPlane

        return DataPlane
    raise AttributeError(name)
