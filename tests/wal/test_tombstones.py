"""A finalized trajectory stays finalized after retention reclaims its finalize record: reads, appends
and finalize behave as for one whose record is still in the log, across reopen; the tombstone file's
torn tail is cut and a bit flip before valid frames is refused."""
from __future__ import annotations

import random

import pytest

import wal
from wal import tombstones


def _finalize_and_reclaim(directory, n: int) -> wal.WALConfig:
    cfg = wal.WALConfig(segment_bytes=4096, compact_live_fraction=0.5)
    w = wal.open(directory, cfg)
    for i in range(n):
        w.append(f"s{i}", 0, list(range(20)), [-0.5] * 20, 0)
        w.commit()
        w.finalize(f"s{i}")
    w.append("live", 0, [1, 2], [-1.0, -2.0], 0)
    w.commit()
    w.reclaim()
    stats = w.stats()
    assert stats["finalized_forgotten"] > 0, "no finalize record was reclaimed: the test would prove nothing"
    w.close()
    return cfg


def _assert_finalized(w, traj: str) -> None:
    with pytest.raises(wal.FinalizedError):
        w.tokens(traj)
    with pytest.raises(wal.FinalizedError):
        w.append(traj, 0, list(range(20)), [-0.5] * 20, 0)
    with pytest.raises(wal.FinalizedError):
        w.append_step([traj, "live"], [0, 2], [7, 3], [-0.1, -0.3], 0)


def test_forgotten_finalized_trajectory_raises_like_a_finalized_one(tmp_path):
    cfg = _finalize_and_reclaim(tmp_path, 200)
    w = wal.open(tmp_path, cfg)
    assert w.trajectories() == ["live"]
    forgotten = sorted(tombstones.read(tmp_path, mutate=False))
    remembered = [f"s{i}" for i in range(200) if f"s{i}" not in forgotten]
    assert forgotten and remembered
    for traj in (forgotten[0], forgotten[-1], remembered[-1]):
        _assert_finalized(w, traj)
    disk = w.stats()["next_lsn"]
    w.finalize(forgotten[0])  # idempotent: nothing written, the id stays finalized
    assert w.stats()["next_lsn"] == disk
    _assert_finalized(w, forgotten[0])
    w.append("fresh", 0, [5], [-0.5], 0)  # an id never finalized is not affected
    w.commit()
    assert w.tokens("fresh") == [5] and w.tokens("live") == [1, 2]
    w.close()


@pytest.mark.parametrize("seed", range(6))
def test_tombstone_file_torn_tail_is_cut_and_bitflip_refused(tmp_path, seed):
    rng = random.Random(seed)
    cfg = _finalize_and_reclaim(tmp_path, 200)
    path = tmp_path / tombstones.FILE_NAME
    data = path.read_bytes()
    ids = tombstones.read(tmp_path, mutate=False)
    assert len(ids) > 3
    # a torn append: the tail cut at a random byte or zero-filled; the file opens, the complete frames are kept
    cut = rng.randrange(len(data) // 2, len(data))
    path.write_bytes(data[:cut] + (b"\0" * (len(data) - cut) if seed % 2 else b""))
    kept = tombstones.read(tmp_path, mutate=False)
    assert kept < ids or cut == len(data)
    w = wal.open(tmp_path, cfg)
    assert w.stats()["finalized_forgotten"] == len(kept)
    w.close()
    assert path.stat().st_size <= cut
    # canary: one bit flipped in the first frame, valid frames after it: refused, never read past
    path.write_bytes(data)
    flipped = bytearray(data)
    flipped[rng.randrange(0, 12)] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(flipped))
    with pytest.raises(wal.CorruptionError, match="tombstone"):
        wal.open(tmp_path, cfg)
