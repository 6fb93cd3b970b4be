"""Spare segments: once a segment grows past its first extent, the log's helper thread zero-fills the next
segment file off the commit path; commits roll into it (early, when the reserve runs out, or at the cap),
sealed segments are trimmed afterwards, and a spare is never part of the log (removed on open and close)."""
from __future__ import annotations

import time

import wal
from wal import codec, segments
from wal.verify import verify

CFG = dict(segment_bytes=64 << 10, preallocate_bytes=4 << 10, spare_segments=True)
STEP = 64  # tokens per commit: ~800 bytes per record


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def _step(w, i: int) -> None:
    w.append("t", i * STEP, list(range(i, i + STEP)), [-(i % 97) / 7.0] * STEP, i // 100)
    w.commit()


def _expected(n: int) -> list[int]:
    return [t for i in range(n) for t in range(i, i + STEP)]


def _segment_ends(path):
    """(size, end of the last record) of every segment file."""
    out = []
    for base, p in segments.list_segments(path):
        buf = p.read_bytes()
        frames = list(codec.iter_frames(buf, codec.SEGMENT_HEAD_BYTES, base))
        off, _ = frames[-1]
        out.append((len(buf), off + codec.FRAME.size + codec.FRAME.unpack_from(buf, off)[0]))
    return out


def test_commits_roll_into_prepared_spares_and_everything_reads_back(tmp_path):
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    log = w._store.log
    i = 0
    while log._spare is None:  # the first extension asks the helper for a spare
        _step(w, i)
        i += 1
        if i > 20:
            _wait(lambda: log._spare is not None, "the first spare")
    assert (tmp_path / segments.SPARE_NAME).stat().st_size == CFG["segment_bytes"]
    n_segs = len(log.segment_list())
    alloc, budget = log._alloc, (log._alloc - log._pos) // 700 + 1
    for _ in range(budget):  # fill the reserve: the commit that would run past it rolls into the spare
        _step(w, i)
        i += 1
        if log.spares_used:
            break
        assert log._alloc == alloc, "grew the segment although a spare was ready"
    assert log.spares_used == 1 and len(log.segment_list()) == n_segs + 1, "ran out of reserve: rolled into the spare"
    assert log._alloc == CFG["segment_bytes"], "the spare is preallocated whole"
    for _ in range(300):  # past the cap of a few more segments, each rolled into a spare once ready
        _step(w, i)
        i += 1
        if log._spare is None:
            _wait(lambda: log._spare is not None, "the next spare")
    assert log.spares_used >= 4
    assert w.stats()["fsyncs"] == i, "one flush per commit: a roll happens inside a flush"
    w.close()
    assert not (tmp_path / segments.SPARE_NAME).exists(), "close drops the spare"
    ends = _segment_ends(tmp_path)
    assert all(size == end for size, end in ends[:-1]), f"sealed segments are trimmed to their last record: {ends}"
    report = verify(tmp_path)
    assert report["ok"] and report["records"] == i
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    assert w.tokens("t") == _expected(i)
    assert w.policy_versions("t")[-1] == (i - 1) // 100
    w.close()


def test_an_early_roll_starts_the_new_segment_at_the_batch_first_lsn(tmp_path):
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    log = w._store.log
    i = 0
    while log._spare is None:
        _step(w, i)
        i += 1
        if i > 20:
            _wait(lambda: log._spare is not None, "the first spare")
    before = log.bytes_written
    _step(w, i)
    i += 1
    rec = log.bytes_written - before
    while log._pos + 3 * rec <= log._alloc:  # each of these fits
        _step(w, i)
        i += 1
    first = log.next_lsn
    for k in range(3):  # one commit of three records that no longer fit the reserve
        w.append("t", (i + k) * STEP, list(range(i + k, i + k + STEP)), [-((i + k) % 97) / 7.0] * STEP, (i + k) // 100)
    w.commit()
    i += 3
    bases = [b for b, _ in log.segment_list()]
    assert bases[-1] == first, f"the new segment starts at the batch's first record: {bases} vs {first}"
    w.close()
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    assert w.tokens("t") == _expected(i)
    w.close()


def test_a_spare_left_by_a_crash_is_not_part_of_the_log_and_is_removed_on_open(tmp_path):
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    for i in range(5):
        _step(w, i)
    w.close()
    spare = tmp_path / segments.SPARE_NAME
    spare.write_bytes(codec.encode_segment_header(5) + bytes(4000))  # killed inside activate_spare, before the rename
    report = verify(tmp_path)
    assert report["ok"] and report["segments"] == 1 and report["records"] == 5
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    assert not spare.exists()
    assert w.tokens("t") == _expected(5)
    _step(w, 5)
    w.close()


def test_spare_segments_off_by_default_grow_segments_inline(tmp_path):
    assert wal.WALConfig().spare_segments is False
    w = wal.open(tmp_path, wal.WALConfig(**{**CFG, "spare_segments": False}))
    log = w._store.log
    for i in range(200):
        _step(w, i)
        assert not (tmp_path / segments.SPARE_NAME).exists()
    assert log.spares_used == 0 and len(log.segment_list()) >= 3
    ends = _segment_ends(tmp_path)
    assert all(size == end for size, end in ends[:-1]), "sealed before the next segment is created"
    w.close()
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    assert w.tokens("t") == _expected(200)
    w.close()


def test_a_small_log_builds_no_spare(tmp_path):
    """A log that never outgrows its first extent (most tests, short runs) never writes a spare."""
    w = wal.open(tmp_path, wal.WALConfig(spare_segments=True))
    for i in range(50):
        _step(w, i)
    time.sleep(0.05)
    assert not (tmp_path / segments.SPARE_NAME).exists() and w._store.log._spare is None
    w.close()
