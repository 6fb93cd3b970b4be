"""Power-cut case for KV snapshots (rollout.snapshot.SnapshotStore on a local directory).

A writer snapshots a few trajectories as they grow (each put replaces the last) and deletes some.
Property after each cut, per trajectory: the store holds a whole snapshot that was put for it, which
`load` accepts against that snapshot's tokens, or nothing, which `load` rejects as "missing"; and a
put acknowledged with nothing started on that trajectory since is there. A delete is not durable
(no directory fsync): a deleted snapshot may come back, whole (the WAL is finalized by then, so it
is never loaded).
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollout import snapshot as snap

FINGERPRINT = "powercut-model"


def kv(traj: str, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{traj}:{n}".encode()))
    return {f"layer{i}.{kind}": torch.randn(2, n, 8, generator=g) for i in range(2) for kind in ("k", "v")}


def tokens(traj: str, n: int) -> list[int]:
    return [(int(traj.split("-")[1]) * 31 + p) % 1000 for p in range(n)]


def encoded(traj: str, n: int) -> bytes:
    return snap.encode(traj, tokens(traj, n), kv(traj, n), policy_version=n // 100, fingerprint=FINGERPRINT)


@dataclass
class Puts:
    versions: dict = field(default_factory=dict)  # traj -> [(token count, bytes)] of every put (the bytes of two
    #                                               puts of one count may differ: safetensors orders its metadata freely)
    settled: dict = field(default_factory=dict)  # traj -> token count acknowledged last, or None after a delete
    busy: set = field(default_factory=set)  # trajectories with a put or delete started and not returned


class SnapshotCase:
    name = "snapshot"
    new_state = Puts

    def __init__(self, ops: int = 24):
        self.ops = ops

    @staticmethod
    def note(state: Puts, mark) -> None:
        kind, traj = mark[0], mark[1]
        if kind == "put":
            state.versions.setdefault(traj, []).append((mark[2], mark[3]))
            state.busy.add(traj)
        elif kind == "del":
            state.busy.add(traj)
        else:
            state.busy.discard(traj)
            state.settled[traj] = mark[2] if kind == "put_ok" else None

    def run(self, live: Path, rec, seed: int) -> None:
        rng = random.Random(seed)
        store = snap.SnapshotStore(live / "snap")
        counts: dict[str, int] = {}
        for _ in range(self.ops):
            traj = f"t-{rng.randrange(4)}"
            if traj in counts and rng.random() < 0.15:
                rec.mark(("del", traj))
                store.delete(traj)
                rec.mark(("del_ok", traj))
                del counts[traj]
                continue
            n = counts.get(traj, 0) + rng.choice([1, 7, 40, 300])
            data = encoded(traj, n)
            rec.mark(("put", traj, n, data))
            store.put(traj, data)
            rec.mark(("put_ok", traj, n))
            counts[traj] = n

    def check(self, image: Path, state: Puts) -> list:
        problems = []
        store = snap.SnapshotStore(image / "snap")
        for traj, versions in state.versions.items():
            data = store.get(traj)
            settled = state.settled.get(traj, None)
            must = settled is not None and traj not in state.busy
            if data is None:
                if must:
                    problems.append(("lost", f"{traj}: the snapshot of {settled} tokens was acknowledged, it is gone"))
                try:
                    store.load(traj, [], 0, FINGERPRINT, torch.float32)
                    problems.append(("wrong", f"{traj}: no snapshot, yet load accepted one"))
                except snap.SnapshotRejected as exc:
                    if exc.reason != "missing":
                        problems.append(("wrong", f"{traj}: no snapshot, rejected as {exc.reason} instead of missing"))
                continue
            n = next((k for k, v in versions if v == data), None)
            if n is None:
                problems.append(("wrong", f"{traj}: the stored snapshot ({len(data)} B) is none that was put (not whole)"))
                continue
            if must and n != settled:
                problems.append(("lost", f"{traj}: the snapshot of {settled} tokens was acknowledged, the store holds {n}"))
            try:
                h, got = store.load(traj, tokens(traj, n), n // 100, FINGERPRINT, torch.float32)
            except snap.SnapshotRejected as exc:
                problems.append(("wrong", f"{traj}: a whole snapshot was rejected: {exc}"))
                continue
            want = kv(traj, n)
            if h.token_count != n or any(not torch.equal(got[k], want[k]) for k in want):
                problems.append(("wrong", f"{traj}: the restored KV is not the one put"))
        return problems
