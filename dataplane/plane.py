"""DataPlane: the catalog and the shard store together. `put` makes a trajectory visible only after its
shard is durable (shard first, then one catalog transaction); `select` / `plan` read metadata only;
`loader` streams heavy fields per minibatch."""
from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np

from dataplane import codec, planner, schema
from dataplane.catalog import Catalog
from dataplane.errors import BadRecordError, DataPlaneError, StaleRowError
from dataplane.streaming import Loader
from dataplane.store import ShardStore
from dataplane.types import STATUSES, Plan, Selection, TrajectoryRecord


def _row_bytes(rec: TrajectoryRecord) -> int:
    extra = sum(getattr(v, "nbytes", 0) or np.asarray(v).nbytes for v in rec.extras.values())
    return rec.length * 9 + extra


def _meta_json(rec: TrajectoryRecord) -> str | None:
    if rec.meta is None:
        return None
    try:
        return json.dumps(rec.meta, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRecordError(f"trajectory {rec.id!r}: meta is not JSON-able: {exc}") from None


class DataPlane:
    def __init__(self, catalog: Catalog, store: ShardStore, shard_bytes: int = 256 << 20):
        self.catalog, self.store, self.shard_bytes = catalog, store, int(shard_bytes)

    # -- write ---------------------------------------------------------------------------------------
    def put(self, records: list[TrajectoryRecord]) -> list[str]:
        """Store finished trajectories: shard files first (atomic, fsynced), then one catalog transaction
        per shard. Returns the shard paths written. A crash in between leaves an orphan file (see `gc`),
        never a half-visible trajectory; a rejected record makes nothing of its shard visible."""
        records = list(records)
        seen: set[str] = set()
        for r in records:
            if not isinstance(r, TrajectoryRecord):
                raise BadRecordError(f"put expects TrajectoryRecord, got {type(r).__name__}")
            if not isinstance(r.id, str) or not r.id or "\x00" in r.id:
                raise BadRecordError(f"trajectory id {r.id!r}: expected a non-empty string without NUL")
            _check_names(r)
            if r.id in seen:
                raise BadRecordError(f"trajectory {r.id!r} appears twice in one put")
            seen.add(r.id)
            if r.status not in STATUSES:
                raise BadRecordError(f"trajectory {r.id!r}: status {r.status!r} not in {STATUSES}")
            if not (0 <= r.policy_min <= r.policy_max):
                raise BadRecordError(f"trajectory {r.id!r}: policy range [{r.policy_min}, {r.policy_max}] is not ordered")
            if not np.isfinite(r.reward):
                raise BadRecordError(f"trajectory {r.id!r}: reward {r.reward} is not finite")
            if r.meta is not None and not isinstance(r.meta, dict):
                raise BadRecordError(f"trajectory {r.id!r}: meta must be a dict, got {type(r.meta).__name__}")
        chunks, by_run = [], defaultdict(list)
        for r in records:
            by_run[r.run].append(r)
        for run, recs in by_run.items():  # one run per shard; shards near `shard_bytes`
            cur, size = [], 0
            for r in recs:
                if cur and size + _row_bytes(r) > self.shard_bytes:
                    chunks.append((run, cur))
                    cur, size = [], 0
                cur.append(r)
                size += _row_bytes(r)
            if cur:
                chunks.append((run, cur))
        paths = []
        for run, recs in chunks:
            batch, checksums = codec.encode(recs)
            rel = self.store.new_path(run)
            nbytes, crc = self.store.write(rel, batch)
            del batch
            rows = [{"id": r.id, "run": r.run, "domain": r.domain, "prompt": r.prompt, "group_id": r.group_id,
                     "length": r.length, "policy_min": int(r.policy_min), "policy_max": int(r.policy_max),
                     "reward": float(r.reward), "status": r.status, "teacher_id": r.teacher_id, "row": i,
                     "checksum": c, "meta": _meta_json(r)} for i, (r, c) in enumerate(zip(recs, checksums))]
            try:
                self.catalog.insert_shard({"path": rel, "run": run, "rows": len(recs), "bytes": nbytes,
                                           "checksum": crc}, rows)
            except BaseException:
                self.store.delete(rel)  # never visible; leave no orphan behind when we can help it
                raise
            paths.append(rel)
        return paths

    def publish_policy_version(self, run: str, version: int, checkpoint: str | None = None) -> None:
        self.catalog.publish_policy_version(run, version, checkpoint)

    def set_status(self, ids: list[str], status: str) -> int:
        return self.catalog.set_status(list(ids), status)

    def delete(self, ids: list[str]) -> int:
        """Forget trajectories (their bytes go when `gc` finds their shard empty)."""
        return self.catalog.delete(list(ids))

    # -- read ----------------------------------------------------------------------------------------
    def select(self, run=None, domain=None, status=("complete",), policy_min=None, policy_max=None,
               teacher=None) -> Selection:
        return self.catalog.select(run=run, domain=domain, status=status, policy_min=policy_min,
                                   policy_max=policy_max, teacher=teacher)

    def meta(self, ids) -> dict[str, dict]:
        """The catalog `meta` of each trajectory in `ids` that has one (metadata only)."""
        return self.catalog.meta(ids)

    def plan(self, selection: Selection | None = None, *, tokens_per_rank: int, ranks: int = 1, seed: int = 0,
             epoch: int = 0, group_aware: bool = False, by_teacher: bool = False, **filters) -> Plan:
        sel = selection if selection is not None else self.select(**filters)
        return planner.make_plan(sel, tokens_per_rank, ranks, seed, epoch, group_aware, by_teacher,
                                 store_root=self.store.root)

    def check_plan(self, plan: Plan) -> None:
        """Raise StaleRowError if trajectories of the plan were deleted from the catalog since (one
        range query on catalog keys, however long the plan)."""
        if not plan.seq.size:
            return
        seq, ids = self.catalog.ids_between(int(plan.seq.min()), int(plan.seq.max()))
        order = np.argsort(seq)
        seq, ids = seq[order], ids[order]
        at = np.minimum(np.searchsorted(seq, plan.seq), max(seq.size - 1, 0))
        ok = (seq[at] == plan.seq) & (ids[at] == plan.ids.astype(object)) if seq.size else np.zeros(plan.seq.size, bool)
        if not ok.all():
            gone = np.flatnonzero(~ok)
            named = ", ".join(f"{str(plan.ids[i])!r} (shard file {self.store.full_path(plan.shard_paths[plan.shard[i]])}, "
                              f"row {int(plan.row[i])})" for i in gone[:3])
            raise StaleRowError(f"{gone.size} trajectories of the plan are no longer in the catalog, e.g. {named}; "
                                "re-plan")

    def loader(self, plan: Plan, rank: int = 0, prefetch: int = 1, verify: bool = True, extras=(),
               check: bool = True, minibatches=None, threads: int = 2) -> Loader:
        if check:
            self.check_plan(plan)
        return Loader(plan, self.store, rank=rank, prefetch=prefetch, verify=verify, extras=extras,
                      minibatches=minibatches, threads=threads)

    # -- upkeep ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.catalog.stats() | {"store": self.store.root}

    def verify_shards(self) -> list[str]:
        """Check every catalogued shard exists and matches its checksum; returns one line per problem."""
        problems = []
        for _, path, _, _, crc in self.catalog.shard_rows():
            if not self.store.exists(path):
                problems.append(f"missing shard file {self.store.full_path(path)}")
            elif self.store.checksum(path) != int(crc):
                problems.append(f"checksum mismatch in shard file {self.store.full_path(path)}")
        return problems

    def gc(self, min_age_s: float = 3600.0) -> dict:
        """Delete shard files no trajectory needs: shards whose rows were all deleted, and orphans of
        interrupted puts older than `min_age_s` (younger ones may belong to a put in flight)."""
        dropped, refused = self.catalog.drop_empty_shards(), []
        for rel in dropped:
            try:
                self.store.delete(rel)
            except DataPlaneError:  # a catalog row naming a path outside the store: nothing there is deleted
                refused.append(rel)
        known = {p for _, p, *_ in self.catalog.shard_rows()}
        orphans = []
        now = time.time()
        for rel in self.store.list():
            if rel in known:
                continue
            info = self.store.fs.get_file_info(self.store.full_path(rel))
            age = now - info.mtime.timestamp() if info.mtime is not None else float("inf")
            if age >= min_age_s:
                self.store.delete(rel)
                orphans.append(rel)
        if refused:
            raise DataPlaneError(f"gc: the catalog named shard paths outside the store, left alone: {refused[:5]} "
                                 f"({len(refused)} in all); {len(dropped) - len(refused)} empty shards and "
                                 f"{len(orphans)} orphans deleted")
        return {"empty_shards_deleted": dropped, "orphans_deleted": orphans}

    def close(self) -> None:
        self.catalog.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_NAMES = ("id", "run", "domain", "group_id", "teacher_id", "prompt")  # the catalog's text columns


def _check_names(r: TrajectoryRecord) -> None:
    """Every text field the catalog keeps: a string (teacher_id may be None), UTF-8 encodable, without NUL
    (PostgreSQL refuses it), within its column's length. Both backends then take the same records."""
    for name in _NAMES:
        value = getattr(r, name)
        if value is None and name == "teacher_id":
            continue
        if not isinstance(value, str):
            raise BadRecordError(f"trajectory {r.id!r}: {name} must be a string, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRecordError(f"trajectory {r.id!r}: {name} is not valid Unicode ({exc.reason} at {exc.start})") from None
        if "\x00" in value:
            raise BadRecordError(f"trajectory {r.id!r}: {name} contains NUL")
        limit = getattr(schema.trajectories.c[name].type, "length", None)
        if limit is not None and len(value) > limit:
            raise BadRecordError(f"trajectory {r.id!r}: {name} is {len(value)} characters; the catalog keeps {limit}")
