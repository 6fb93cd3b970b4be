"""Trajectory catalog on SQLAlchemy 2: runs, policy versions, shards and trajectories' light metadata.
One class for every backend; the backend module (`sqlite`, `postgres`) supplies the engine, the
bytewise collation and insert-or-ignore. The schema version is checked at open."""
from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import collate, delete, func, inspect, select, text, update
from sqlalchemy.exc import DatabaseError, IntegrityError

from dataplane import columns, postgres, sqlite
from dataplane.errors import BadRecordError, DataPlaneError, SchemaVersionError
from dataplane.schema import (MIGRATIONS, SCHEMA_VERSION, meta, metadata, pack_rows, policy_versions, runs,
                              shards, trajectories)
from dataplane.types import STATUSES, Selection

T = trajectories


def _order(ids: pa.Array, run: pa.Array, group_id: pa.Array) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """(order, group, ids in order): the permutation into bytewise (run, group id, id) order, and each
    row's dense rank of (run, group id) along it. Runs and group ids are ranked through their distinct values and rows sorted
    by that rank; ids are compared only where some group's rows do not already come in id order (rows
    usually arrive in insertion order, which keeps a group's ids in order)."""
    n = len(ids)
    key = np.zeros(n, dtype=np.int64)
    for col in (run, group_id):
        enc = pc.dictionary_encode(col)
        rank = np.empty(len(enc.dictionary), dtype=np.int64)
        rank[pc.sort_indices(enc.dictionary).to_numpy()] = np.arange(len(enc.dictionary))
        key = key * len(enc.dictionary) + rank[enc.indices.to_numpy(zero_copy_only=False)]
    order = np.argsort(key * n + np.arange(n, dtype=np.int64))  # distinct keys: the same as a stable sort by key
    k = key[order]
    s = ids.take(pa.array(order))
    if n > 1 and ((k[1:] == k[:-1]) & ~pc.greater(s[1:], s[:-1]).to_numpy(zero_copy_only=False)).any():
        order = order[pc.sort_indices(pa.table({"k": k, "i": s}),
                                      sort_keys=[("k", "ascending"), ("i", "ascending")]).to_numpy()]
        k, s = key[order], ids.take(pa.array(order))
    dense = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(k[1:] != k[:-1], out=dense[1:])
    return order, dense, s


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values ascending, each value's index among them); by a table when the values are compact
    (shard ids: autoincremented), else by sorting."""
    lo, hi = (int(values.min()), int(values.max())) if values.size else (0, -1)
    if lo < 0 or hi >= 4 * values.size + 1024:
        return np.unique(values, return_inverse=True)
    table = np.zeros(hi + 2, dtype=np.int64)
    table[values] = 1
    distinct = np.flatnonzero(table)
    np.cumsum(table, out=table)
    return distinct, table[values] - 1


def _selection(n: int, rec: np.ndarray, seq: np.ndarray, names: dict[str, pa.Array], shard_ids: np.ndarray,
               shard: np.ndarray, paths: dict) -> Selection:
    """A Selection from unordered, aligned columns (seq, columns.PACK records, names as Arrow binary
    arrays): canonical (run, group id, id) bytewise order, dense group codes over (run, group id), dense
    teacher codes in bytewise name order."""
    if not n:
        z = np.zeros(0, dtype=np.int64)
        return Selection(ids=np.zeros(0, dtype="<U1"), seq=z, length=z, group=z, teacher=z, reward=np.zeros(0),
                         policy_min=z, policy_max=z, shard=z, row=z, checksum=np.zeros(0, dtype=np.uint32),
                         shard_paths=[], teachers=[])
    order, group, ids = _order(names["id"], names["run"], names["group_id"])
    enc = pc.dictionary_encode(names["teacher"])
    teachers = enc.dictionary.to_pylist()  # bytes
    rank = np.empty(len(teachers), dtype=np.int64)
    rank[sorted(range(len(teachers)), key=teachers.__getitem__)] = np.arange(len(teachers))
    teacher_code = rank[enc.indices.to_numpy(zero_copy_only=False)]
    field = lambda name, dtype=np.int64: rec[name][order].astype(dtype, copy=False)  # noqa: E731
    return Selection(
        ids=columns.to_numpy_str(ids),
        seq=seq[order], length=field("length"), group=group, teacher=teacher_code[order],
        reward=field("reward", np.float64), policy_min=field("policy_min"), policy_max=field("policy_max"),
        shard=shard[order], row=field("row"), checksum=field("checksum", np.uint32),
        shard_paths=[paths[s] for s in shard_ids.tolist()],
        teachers=[b.decode("utf-8") for b in sorted(teachers)],
    )


def backend_for(url: str):
    if url.startswith("sqlite"):
        return sqlite
    if url.startswith(("postgresql", "postgres")):
        return postgres
    raise DataPlaneError(f"catalog URL {url!r}: expected sqlite:///PATH, a file path, or postgresql://...")


def normalize_url(url: str | Path) -> str:
    url = str(url)
    if "://" not in url:  # a bare path means an embedded SQLite file; quoted, so '?' and '%' stay in the path
        from sqlalchemy.engine import URL

        return URL.create("sqlite", database=str(Path(url).resolve())).render_as_string(hide_password=False)
    return postgres.normalize_url(url) if url.startswith(("postgresql", "postgres")) else url


def _full_device(url: str) -> str:
    """SQLite reports a full device met while opening as a 'disk I/O error': say what it is."""
    if not url.startswith("sqlite:///"):
        return ""
    try:
        from sqlalchemy.engine import make_url

        free = shutil.disk_usage(Path(make_url(url).database).parent).free
    except OSError:
        return ""
    return " (no space left on the device that holds it: free space, then open again)" if free < (64 << 10) else ""


class Catalog:
    def __init__(self, url: str | Path, namespace: str | None = None, create: bool = True):
        self.url = normalize_url(url)
        self.namespace = namespace
        self.backend = backend_for(self.url)
        try:
            self.engine = self.backend.make_engine(self.url, namespace)
            self._check_schema(create)
        except DatabaseError as exc:  # cannot connect, or not a database at all (a file of another kind)
            why = " ".join(str(exc.orig).split())  # a driver's message may span lines (psycopg adds a hint)
            raise DataPlaneError(f"catalog {self._safe_url()}: cannot open: {why}{_full_device(self.url)}") from None

    def _safe_url(self) -> str:
        return self.url.split("@")[-1] if "@" in self.url else self.url

    def _check_schema(self, create: bool) -> None:
        if not inspect(self.engine).has_table(meta.name):
            if not create:
                raise DataPlaneError(f"catalog {self._safe_url()} is empty (no data-plane schema)")
            metadata.create_all(self.engine)
            with self._writing() as conn:
                self.backend_insert_ignore(conn, meta, [{"key": "schema_version", "value": str(SCHEMA_VERSION)}])
        with self.engine.connect() as conn:
            found = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        if found is not None and found.isdigit() and int(found) in MIGRATIONS:
            found = self._migrate(int(found))
        if found != str(SCHEMA_VERSION):
            raise SchemaVersionError(f"catalog {self._safe_url()} has schema version {found!r}; this postrain reads "
                                     f"version {SCHEMA_VERSION}: use a fresh catalog or migrate it")

    def _migrate(self, version: int) -> str:
        """Bring a catalog of an older schema version to SCHEMA_VERSION, one transaction per step."""
        while version in MIGRATIONS:
            with self._writing() as conn:
                current = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
                if current == str(version):  # another process may have migrated it meanwhile
                    for step in MIGRATIONS[version]:
                        conn.execute(text(step)) if isinstance(step, str) else step(conn)
                    conn.execute(update(meta).where(meta.c.key == "schema_version").values(value=str(version + 1)))
            version += 1
        return str(version)

    @contextmanager
    def _writing(self):
        """A write transaction: SQLite takes the write lock up front (BEGIN IMMEDIATE), so concurrent
        writers queue on the busy timeout instead of failing to upgrade; reads stay plain BEGIN."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(dp_write=True)
            with conn.begin():
                yield conn

    def backend_insert_ignore(self, conn, table, rows: list[dict]) -> None:
        if rows:
            conn.execute(self.backend.insert_ignore(table), rows)

    def _c(self, col):
        return collate(col, self.backend.COLLATION)

    def close(self) -> None:
        self.engine.dispose()

    def _fetch(self, conn, stmt, binary: bool = False) -> list[tuple]:
        """All rows as plain tuples straight from the driver: SQLAlchemy's Row objects cost ~3 us each,
        which dominates reading the metadata of many trajectories. `binary`: in the backend's binary
        result format where it has one (bytes arrive as bytes)."""
        compiled = stmt.compile(dialect=self.engine.dialect, compile_kwargs={"render_postcompile": True})
        params = compiled.construct_params()
        args = tuple(params[k] for k in compiled.positiontup) if compiled.positional else params
        raw = conn.connection.dbapi_connection
        cur = self.backend.cursor(raw) if binary else raw.cursor()
        try:
            cur.execute(str(compiled), args)
            return cur.fetchall()
        finally:
            cur.close()

    # -- write ---------------------------------------------------------------------------------------
    def insert_shard(self, shard_row: dict, traj_rows: list[dict]) -> int:
        """One transaction: the shard and all its trajectories become visible together, or none do."""
        now = time.time()
        run_names = sorted({shard_row["run"], *(r["run"] for r in traj_rows)})
        versions = sorted({(r["run"], v) for r in traj_rows for v in (r["policy_min"], r["policy_max"])})
        try:
            with self._writing() as conn:
                self.backend_insert_ignore(conn, runs, [{"name": n, "created_at": now} for n in run_names])
                self.backend_insert_ignore(conn, policy_versions, [
                    {"run": r, "version": v, "created_at": now, "checkpoint": None} for r, v in versions])
                shard_id = conn.execute(shards.insert().returning(shards.c.id),
                                        {**shard_row, "created_at": now}).scalar_one()
                rows = [{**r, "shard_id": shard_id, "created_at": now} for r in traj_rows]
                for r, p in zip(rows, pack_rows(rows)):
                    r["pack"] = p
                conn.execute(T.insert(), rows)
        except IntegrityError as exc:
            ids = [r["id"] for r in traj_rows]
            with self.engine.connect() as conn:
                taken = conn.execute(select(T.c.id).where(T.c.id.in_(ids[:10000]))).scalars().all()
            what = f"trajectory ids already in the catalog: {sorted(taken)[:5]}" if taken else str(exc.orig)
            raise BadRecordError(f"put rejected, nothing made visible: {what}") from None
        return int(shard_id)

    def publish_policy_version(self, run: str, version: int, checkpoint: str | None) -> None:
        now = time.time()
        with self._writing() as conn:
            self.backend_insert_ignore(conn, runs, [{"name": run, "created_at": now}])
            self.backend_insert_ignore(conn, policy_versions, [
                {"run": run, "version": version, "created_at": now, "checkpoint": checkpoint}])
            conn.execute(update(policy_versions).where(policy_versions.c.run == run, policy_versions.c.version == version)
                         .values(checkpoint=checkpoint))

    def set_status(self, ids: list[str], status: str) -> int:
        if status not in STATUSES:
            raise DataPlaneError(f"status {status!r}: expected one of {STATUSES}")
        with self._writing() as conn:
            return conn.execute(update(T).where(T.c.id.in_(ids)).values(status=status)).rowcount

    def delete(self, ids: list[str]) -> int:
        with self._writing() as conn:
            return conn.execute(delete(T).where(T.c.id.in_(ids))).rowcount

    def drop_empty_shards(self) -> list[str]:
        """Forget shards no trajectory points at; returns their paths (the caller deletes the files)."""
        with self._writing() as conn:
            empty = conn.execute(select(shards.c.id, shards.c.path).where(
                ~select(T.c.seq).where(T.c.shard_id == shards.c.id).exists())).all()
            if empty:
                conn.execute(delete(shards).where(shards.c.id.in_([i for i, _ in empty])))
        return [p for _, p in empty]

    # -- read ----------------------------------------------------------------------------------------
    def _where(self, run, domain, status, policy_min, policy_max, teacher):
        conds = []
        for col, val in ((T.c.run, run), (T.c.domain, domain), (T.c.status, status), (T.c.teacher_id, teacher)):
            if val is None:
                continue
            vals = [val] if isinstance(val, str) else list(val)
            conds.append(col.in_(vals))
        if policy_min is not None:
            conds.append(T.c.policy_min >= int(policy_min))
        if policy_max is not None:
            conds.append(T.c.policy_max <= int(policy_max))
        return conds

    def select(self, run=None, domain=None, status=("complete",), policy_min=None, policy_max=None,
               teacher=None) -> Selection:
        """Light metadata of matching trajectories in bytewise (run, group, id) order: members of a group are
        adjacent and group codes nondecreasing; group and teacher codes are dense.

        The database filters and hands the rows back as three values (one aggregate each over the same
        scan, so they align): the seqs as text, the rows' packed records (columns.pack) concatenated, and
        their sizes as text; ordering and codes are computed in numpy and Arrow. Rows as Python tuples cost
        ~7 us each, seconds at a million trajectories."""
        if status is not None:
            for s in [status] if isinstance(status, str) else status:
                if s not in STATUSES:
                    raise DataPlaneError(f"status {s!r}: expected one of {STATUSES}")
        conds = self._where(run, domain, status, policy_min, policy_max, teacher)
        b = self.backend
        stmt = select(func.count(), func.count(T.c.pack), b.join_numbers(T.c.seq), b.join_bytes(T.c.pack),
                      b.join_numbers(b.byte_length(T.c.pack))).where(*conds)
        with self.engine.connect() as conn:
            n, n_packed, seq, packed, sizes = self._fetch(conn, stmt, binary=True)[0]
            if n_packed != n:
                raise DataPlaneError(f"catalog {self._safe_url()}: {n - n_packed} selected trajectories have no "
                                     "packed metadata (rows written around the data plane's put)")
            rec, strs = columns.unpack(packed, columns.numbers(sizes, n, np.int64))
            shard_ids, shard = _codes(rec["shard_id"])
            paths = dict(conn.execute(select(shards.c.id, shards.c.path).where(
                shards.c.id.in_(shard_ids.tolist()))).all()) if n else {}
        return _selection(n, rec, columns.numbers(seq, n, np.int64), strs, shard_ids, shard, paths)

    def meta(self, ids) -> dict[str, dict]:
        """The `meta` object of each trajectory in `ids` that has one."""
        ids = [str(i) for i in ids]
        out: dict[str, dict] = {}
        with self.engine.connect() as conn:
            for k in range(0, len(ids), 10_000):
                stmt = select(T.c.id, T.c.meta).where(T.c.id.in_(ids[k:k + 10_000]), T.c.meta.is_not(None))
                for traj, raw in self._fetch(conn, stmt):
                    try:
                        out[traj] = json.loads(raw)
                    except ValueError:
                        raise DataPlaneError(f"trajectory {traj!r}: its catalog meta is not JSON") from None
        return out

    def ids_between(self, seq_lo: int, seq_hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(seq, id) of every catalogued trajectory with seq_lo <= seq <= seq_hi."""
        with self.engine.connect() as conn:
            rows = self._fetch(conn, select(T.c.seq, T.c.id).where(T.c.seq.between(int(seq_lo), int(seq_hi))))
        if not rows:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=object)
        seq, ids = zip(*rows)
        return np.array(seq, dtype=np.int64), np.array(ids, dtype=object)

    def shard_rows(self) -> list[tuple[int, str, int, int, int]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(select(shards.c.id, shards.c.path, shards.c.rows, shards.c.bytes,
                                                          shards.c.checksum).order_by(shards.c.id)).all()]

    def stats(self) -> dict:
        with self.engine.connect() as conn:
            by = conn.execute(select(T.c.run, T.c.domain, T.c.status, func.count(), func.sum(T.c.length),
                                     func.max(T.c.length), func.min(T.c.policy_min), func.max(T.c.policy_max),
                                     func.avg(T.c.reward))
                              .group_by(T.c.run, T.c.domain, T.c.status)
                              .order_by(T.c.run, T.c.domain, T.c.status)).all()
            n_shards, shard_bytes = conn.execute(select(func.count(), func.coalesce(func.sum(shards.c.bytes), 0))).one()
            n_runs = conn.execute(select(func.count()).select_from(runs)).scalar_one()
            n_versions = conn.execute(select(func.count()).select_from(policy_versions)).scalar_one()
        groups = [{"run": r, "domain": d, "status": s, "trajectories": int(c), "tokens": int(t or 0),
                   "max_length": int(m or 0), "policy_min": int(pmin), "policy_max": int(pmax),
                   "mean_reward": float(rw) if rw is not None else None}
                  for r, d, s, c, t, m, pmin, pmax, rw in by]
        return {"catalog": self._safe_url(), "schema_version": SCHEMA_VERSION, "runs": int(n_runs),
                "policy_versions": int(n_versions), "shards": int(n_shards), "shard_bytes": int(shard_bytes),
                "trajectories": sum(g["trajectories"] for g in groups), "tokens": sum(g["tokens"] for g in groups),
                "by_run_domain_status": groups}
