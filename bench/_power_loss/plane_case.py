"""Power-cut case for the data plane's put: shard file durable before the catalog transaction.

The catalog is SQLite (WAL mode, synchronous=FULL): its own durability is SQLite's, so the catalog
file lives outside the simulated disk. From the moment a catalog transaction that inserts a shard
starts, the catalog may show that shard after a power cut (the commit may complete), so its file
must be durable by then. Property after each cut: every shard the catalog may show exists, has the
file checksum the catalog holds, opens as a shard of its rows, and each row has its row checksum.
Deletions (delete + gc) are in the workload too: a shard stops being required once the catalog
transaction that drops it has returned (the file is deleted only after that).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import dataplane
from dataplane import TrajectoryRecord
from dataplane import codec as dcodec
from dataplane.store import ShardStore


def records(seed: int, n: int, run: str, prefix: str) -> list[TrajectoryRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(1, 400))
        out.append(TrajectoryRecord(
            id=f"{prefix}{i:04d}", run=run, domain="arith", prompt=f"p{i // 4}", group_id=f"g{i // 4}",
            tokens=rng.integers(0, 50_000, L, dtype=np.int64), loss_mask=rng.integers(0, 2, L),
            logprobs=-rng.random(L).astype(np.float32), reward=float(i % 2), policy_min=0, policy_max=1))
    return out


@dataclass
class Shown:
    shards: dict = field(default_factory=dict)  # relative path -> (file crc32c, row checksums) the catalog may show
    dropped: set = field(default_factory=set)


class PlaneCase:
    name = "dataplane"
    new_state = Shown

    def __init__(self, puts: int = 10):
        self.puts = puts

    @staticmethod
    def note(state: Shown, mark) -> None:
        if mark[0] == "insert":
            state.shards[mark[1]] = (mark[2], mark[3])
        elif mark[0] == "dropped":
            state.dropped.add(mark[1])

    def run(self, live: Path, rec, seed: int) -> None:
        rng = random.Random(seed)
        catalog = live.parent / "catalog.db"  # SQLite's durability is its own: not on the simulated disk
        dp = dataplane.open(catalog, live / "store", shard_bytes=6000)
        insert, drop = dp.catalog.insert_shard, dp.catalog.drop_empty_shards

        def insert_shard(shard_row, traj_rows):
            rec.mark(("insert", shard_row["path"], int(shard_row["checksum"]), [int(r["checksum"]) for r in traj_rows]))
            return insert(shard_row, traj_rows)

        def drop_empty_shards():
            gone = drop()
            for rel in gone:
                rec.mark(("dropped", rel))
            return gone

        dp.catalog.insert_shard, dp.catalog.drop_empty_shards = insert_shard, drop_empty_shards
        ids: list[str] = []
        for k in range(self.puts):
            run = f"run-{rng.randrange(3)}"  # new runs appear: their shard directories are created by a put
            recs = records(seed * 100 + k, rng.randint(1, 12), run, f"s{seed}-{k}-")
            dp.put(recs)
            ids += [r.id for r in recs]
            if rng.random() < 0.3 and ids:
                gone = rng.sample(ids, min(len(ids), rng.randint(1, 10)))
                dp.delete(gone)
                ids = [i for i in ids if i not in set(gone)]
                dp.gc(min_age_s=3600)
        dp.close()

    def check(self, image: Path, state: Shown) -> list:
        problems = []
        store = ShardStore(image / "store")
        for rel, (crc, rows) in state.shards.items():
            if rel in state.dropped:
                continue
            if not store.exists(rel):
                problems.append(("lost", f"shard {rel}: the catalog may show it, the file is missing"))
                continue
            if store.checksum(rel) != crc:
                problems.append(("lost", f"shard {rel}: the file does not match the catalog's checksum"))
                continue
            with store.open(rel) as batch:
                got = row_checksums(batch)
            if got != rows:
                problems.append(("lost", f"shard {rel}: its rows' checksums are not the catalog's"))
        return problems


def row_checksums(batch) -> list[int]:
    """Each row's checksum, recomputed from the shard (what the loader verifies against the catalog)."""
    _, cols = dcodec.decode(batch)
    return [dcodec.row_checksum([c.values[c.offsets[i]:c.offsets[i + 1]] for c in cols.values()])
            for i in range(batch.num_rows)]
