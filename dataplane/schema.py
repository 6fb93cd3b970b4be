"""Catalog tables (SQLAlchemy Core). Bump SCHEMA_VERSION on any change and add its step to MIGRATIONS;
`Catalog` migrates older versions in place and refuses unknown ones."""
from __future__ import annotations

from sqlalchemy import (BigInteger, Column, Float, ForeignKey, Index, Integer, LargeBinary, MetaData, String, Table,
                        Text, UniqueConstraint, bindparam, func, select, text, update)

from dataplane import columns

SCHEMA_VERSION = 4

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
    # columns.pack record of the write-once fields above (select reads these, not the columns); nullable
    # only so that older catalogs can add it: put and the migration fill it for every row
    Column("pack", LargeBinary, nullable=True),
    UniqueConstraint("id", name="dp_trajectories_id_key"),
    Index("dp_trajectories_select", "run", "domain", "status"),
    Index("dp_trajectories_shard", "shard_id"),
)



def pack_rows(rows) -> list[bytes]:
    """columns.PACK records of catalog rows (mappings with the trajectory columns; teacher as teacher_id)."""
    return columns.pack(*([r[c] for r in rows] for c in (
        "length", "shard_id", "reward", "policy_min", "policy_max", "row", "checksum", "id", "group_id", "run",
        "teacher_id")))


def _add_pack(conn) -> None:
    conn.execute(text(f"ALTER TABLE {trajectories.name} ADD COLUMN pack {LargeBinary().compile(dialect=conn.dialect)}"))


PACK_FILL_BATCH = 50_000  # rows per batch when a migration (re)writes the packed records


def _fill_pack(conn) -> None:
    """(Re)write every row's packed record, in seq order by batches."""
    T = trajectories
    cols = [T.c[c] for c in ("seq", "length", "shard_id", "reward", "policy_min", "policy_max", "row", "checksum",
                             "id", "group_id", "run", "teacher_id")]
    last = conn.execute(select(func.min(T.c.seq) - 1)).scalar()
    while last is not None:
        rows = conn.execute(select(*cols).where(T.c.seq > last).order_by(T.c.seq).limit(PACK_FILL_BATCH)).mappings().all()
        if not rows:
            break
        conn.execute(update(T).where(T.c.seq == bindparam("k")).values(pack=bindparam("p")),
                     [{"k": r["seq"], "p": p} for r, p in zip(rows, pack_rows(rows))])
        last = rows[-1]["seq"]


# version -> steps (SQL text, or a function of the connection) that bring a catalog of that version to the next
MIGRATIONS: dict[int, list] = {
    1: ["ALTER TABLE dp_trajectories ADD COLUMN meta TEXT"],
    2: [_add_pack, _fill_pack],
    3: [_fill_pack],  # version 3's records had no names in them
}
