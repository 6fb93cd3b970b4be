"""Direct commits (wal/direct.py): a log committing with O_DIRECT + RWF_DSYNC leaves the bytes a log
committing with pwrite + fdatasync leaves, across block boundaries, extents, rolls and reopens; over a
recycled segment it recovers every record; a file system that refuses direct writes sends the log back
to the page cache with nothing lost; the switch turns it off. Each test runs with the commit in C
(wal/_commitc.c, where it is built) and in Python."""
from __future__ import annotations

import errno
import gc
import logging
import os
from pathlib import Path

import numpy as np
import pytest

import wal
from core import fileio
from wal import log as wal_log
from wal import segments
from wal.direct import BLOCK, DirectWriter


@pytest.fixture(autouse=True, params=["c", "python"])
def commit_path(request, monkeypatch):
    """The commit in C (skipped where it is not built) or in Python (the C module set aside)."""
    if request.param == "c":
        if wal_log._commitc is None:
            pytest.skip("wal._commitc is not built here")
    else:
        monkeypatch.setattr(wal_log, "_commitc", None)
    return request.param


def _direct_here(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(2 * BLOCK))
    w = DirectWriter.open(probe, 100)
    if w is None:
        pytest.skip("no O_DIRECT / RWF_DSYNC on this platform or file system")
    w.close()


def _workload(path: Path, direct: bool, reopen_every: int = 23) -> dict:
    """Appends of 1 to 700 tokens (frames from ~70 B to ~8.5 kB) and decode steps, a commit after each,
    the log closed and reopened now and then; returns the stats summed over the opens."""
    cfg = wal.WALConfig(segment_bytes=96 << 10, preallocate_bytes=12 << 10, recycle_segments=False, direct_io=direct)
    rng = np.random.default_rng(5)
    lengths: dict[str, int] = {}
    totals = {"fsyncs": 0, "direct_writes": 0}
    w = wal.open(path, cfg)
    for i in range(160):
        if i and i % reopen_every == 0:
            for k in totals:
                totals[k] += w.stats()[k]
            w.close()
            w = wal.open(path, cfg)
        if i % 5 == 4:  # a decode step over three trajectories
            ids = ["s0", "s1", "s2"]
            pos = [lengths.get(t, 0) for t in ids]
            w.append_step(ids, pos, [i, i + 1, i + 2], [-0.5, -0.25, -0.125], 1)
            for t in ids:
                lengths[t] = lengths.get(t, 0) + 1
        else:
            t = f"t{i % 7}"
            n = int(rng.integers(1, 700))
            start = lengths.get(t, 0)
            w.append(t, start, ((np.arange(n) + start) % 50_000).tolist(), (-rng.random(n)).tolist(), i // 40)
            lengths[t] = start + n
        w.commit()
    for k in totals:
        totals[k] += w.stats()[k]
    w.close()
    return totals


def test_direct_commits_leave_the_bytes_buffered_commits_leave(tmp_path):
    _direct_here(tmp_path)
    a = _workload(tmp_path / "direct", True)
    b = _workload(tmp_path / "buffered", False)
    assert b["direct_writes"] == 0
    assert 0 < a["direct_writes"] < a["fsyncs"], a  # most commits direct; those past the reserve grow the file
    assert a["direct_writes"] > a["fsyncs"] // 2, a
    seg_a = segments.list_segments(tmp_path / "direct")
    seg_b = segments.list_segments(tmp_path / "buffered")
    assert len(seg_a) > 3 and [p.name for _, p in seg_a] == [p.name for _, p in seg_b]
    for (_, pa), (_, pb) in zip(seg_a, seg_b):
        assert pa.read_bytes() == pb.read_bytes(), pa.name
    x, y = wal.open(tmp_path / "direct"), wal.open(tmp_path / "buffered")
    try:
        assert x.trajectories() == y.trajectories() and len(x.trajectories()) == 10
        for t in x.trajectories():
            assert x.read_packed(t) == y.read_packed(t)
    finally:
        x.close()
        y.close()


def test_direct_commits_over_recycled_segments_recover_every_record(tmp_path):
    _direct_here(tmp_path)
    cfg = wal.WALConfig(segment_bytes=64 << 10, preallocate_bytes=16 << 10, compact_live_fraction=0.9)
    w = wal.open(tmp_path / "w", cfg)
    rng = np.random.default_rng(1)
    want: dict[str, list[int]] = {}
    for gen in range(6):  # trajectories written, finalized, reclaimed: their segments come round again
        for i in range(40):
            t = f"g{gen}-{i % 4}"
            n = int(rng.integers(50, 400))
            toks = rng.integers(0, 1000, n).tolist()
            w.append(t, len(want.get(t, [])), toks, [-0.5] * n, gen)
            want.setdefault(t, []).extend(toks)
            w.commit()
        if gen < 5:
            w.finalize_many([t for t in want if t.startswith(f"g{gen}-")])
            w.reclaim()
    stats = w.stats()
    w.close()
    assert stats["recycled_segments"] > 0 and stats["direct_writes"] > stats["fsyncs"] // 2, stats
    w = wal.open(tmp_path / "w", cfg)
    try:
        assert w.recovery.torn_bytes_cut == 0
        for t, toks in want.items():
            if t.startswith("g5-"):
                assert w.tokens(t) == toks
    finally:
        w.close()


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, caplog):
    _direct_here(tmp_path)

    def refuse(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument (injected)")

    w = wal.open(tmp_path / "w")
    w.append("t", 0, [1, 2], [-1.0, -2.0], 0)
    w.commit()
    assert w.stats()["direct_writes"] == 1
    with caplog.at_level(logging.WARNING, logger="wal"), fileio.using({**fileio.DEFAULT, "pwrite_sync": refuse}):
        for k in range(3):
            w.append("t", 2 + k, [3 + k], [-3.0], 0)
            w.commit()
    assert "direct writes refused" in caplog.text
    s = w.stats()
    assert s["direct_writes"] == 1 and s["fsyncs"] == 4  # the three later commits through pwrite + fdatasync
    w.append("t", 5, [6], [-6.0], 0)  # and the log stays on the page cache
    w.commit()
    assert w.stats()["direct_writes"] == 1
    w.close()
    w = wal.open(tmp_path / "w")
    assert w.tokens("t") == [1, 2, 3, 4, 5, 6]
    w.close()


def test_a_failed_direct_write_poisons_the_log_and_reopen_recovers(tmp_path):
    _direct_here(tmp_path)

    def broken(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error (injected)")

    w = wal.open(tmp_path / "w")
    w.append("t", 0, [1], [-1.0], 0)
    w.commit()
    with fileio.using({**fileio.DEFAULT, "pwrite_sync": broken}):
        w.append("t", 1, [2], [-2.0], 0)
        with pytest.raises(wal.LogClosedError, match="injected"):
            w.commit()
    with pytest.raises(wal.LogClosedError):
        w.append("t", 2, [3], [-3.0], 0)
    w.close()
    w = wal.open(tmp_path / "w")
    assert w.tokens("t") == [1]
    w.close()


def test_the_switch_and_a_file_system_without_o_direct(tmp_path):
    w = wal.open(tmp_path / "off", wal.WALConfig(direct_io=False))
    w.append("t", 0, [1], [-1.0], 0)
    w.commit()
    assert w.stats()["direct_writes"] == 0 and w.stats()["fsyncs"] == 1
    w.close()

    def no_direct(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument (no O_DIRECT here)")
        return os.open(path, flags, mode)

    with fileio.using({**fileio.DEFAULT, "open": no_direct}):
        w = wal.open(tmp_path / "nodirect")
        w.append("t", 0, [1], [-1.0], 0)
        w.commit()
        assert w.stats()["direct_writes"] == 0
        w.close()
    w = wal.open(tmp_path / "nodirect")
    assert w.tokens("t") == [1]
    w.close()


def test_a_short_direct_write_poisons_the_log_and_reopen_recovers(tmp_path):
    _direct_here(tmp_path)

    def short(fd, data, offset):
        return fileio.DEFAULT["pwrite_sync"](fd, memoryview(data)[:BLOCK], offset) if len(data) > BLOCK else 0

    w = wal.open(tmp_path / "w")
    w.append("t", 0, [1], [-1.0], 0)
    w.commit()
    with fileio.using({**fileio.DEFAULT, "pwrite_sync": short}):
        w.append("t", 1, list(range(2, 800)), [-2.0] * 798, 0)  # ~9.6 kB: one block of three written
        with pytest.raises(wal.LogClosedError, match="wrote|short"):
            w.commit()
    with pytest.raises(wal.LogClosedError):
        w.commit()
    w.close()
    w = wal.open(tmp_path / "w")
    assert w.tokens("t") == [1]  # the torn frame is cut at recovery
    w.close()


def test_the_commit_path_in_use(tmp_path, monkeypatch, commit_path):
    """In C a commit into the reserve does not go through Log._flush; a commit past it does (in both)."""
    _direct_here(tmp_path)
    calls = []
    flush = wal_log.Log._flush
    monkeypatch.setattr(wal_log.Log, "_flush", lambda self, frames, last: (calls.append(last), flush(self, frames, last)))
    w = wal.open(tmp_path / "w", wal.WALConfig(preallocate_bytes=16 << 10))
    for k in range(4):
        w.append("t", k, [k], [-1.0], 0)
        assert w.commit() == k
    assert len(calls) == (0 if commit_path == "c" else 4)
    w.append("t", 4, list(range(5000)), [-1.0] * 5000, 0)  # 60 kB: past the 16 KiB reserve, the file grows
    w.commit()
    assert len(calls) == (1 if commit_path == "c" else 5)
    s = w.stats()
    assert s["direct_writes"] == 4 and s["fsyncs"] == 5, s
    w.close()
    w = wal.open(tmp_path / "w")
    assert w.length("t") == 5004
    w.close()


def test_a_write_kept_by_the_backend_stays_readable_after_the_log_closes(tmp_path):
    """The bytes handed to pwrite_sync are a view that holds the staging buffer: a backend that keeps it
    (as a recorder might) reads what was written after the writer has let the buffer go."""
    _direct_here(tmp_path)
    kept = []

    def keep(fd, data, offset):
        kept.append((data, bytes(data)))
        return fileio.DEFAULT["pwrite_sync"](fd, data, offset)

    w = wal.open(tmp_path / "w")
    with fileio.using({**fileio.DEFAULT, "pwrite_sync": keep}):
        for k in range(3):
            w.append("t", k, [k + 1], [-1.0], 0)
            w.commit()
    w.close()
    del w
    gc.collect()
    assert len(kept) == 3
    view, copy = kept[-1]  # the buffer is reused: the last write's view still holds what it wrote
    assert bytes(view) == copy
