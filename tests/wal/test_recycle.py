"""Recycled segments: a segment that retention reclaims whole becomes a later segment without zeros being
written; its old frames (lower lsns) end it on recovery like zeros do, frames of a torn last flush among
them are cut by zeroing (the file keeps its blocks), damage with a later flush after it is still
corruption, and the vectorised search for valid frames agrees with a frame-by-frame one."""
from __future__ import annotations

import random

import numpy as np
import pytest

import wal
from wal import codec, segments
from wal.errors import CorruptionError
from wal.verify import verify

SEG = 16 << 10
CFG = dict(segment_bytes=SEG, preallocate_bytes=SEG, compact_live_fraction=0.5, retain_bytes=1 << 30)
N = 60  # tokens per record: ~760 bytes


def _toks(traj: str, start: int, n: int = N) -> list[int]:
    return [(hash(traj) % 1000 + start + i) % 50_000 for i in range(n)]


def _lps(start: int, n: int = N) -> list[float]:
    return [-((start + i) % 89) / 11.0 for i in range(n)]


def _write(w, traj: str, records: int) -> None:
    start = w.length(traj) if traj in w.trajectories() else 0
    for r in range(records):
        w.append(traj, start + r * N, _toks(traj, start + r * N), _lps(start + r * N), 0)
        w.commit()


def _recycled_log(path):
    """A log whose active segment was written over a reclaimed one; returns (wal, live trajectory)."""
    w = wal.open(path, wal.WALConfig(**CFG))
    log = w._store.log
    k = 0
    while log.segments_recycled == 0:  # fill segments with trajectories that finish, reclaim them
        _write(w, f"done-{k}", SEG // (N * 12) + 1)
        w.finalize(f"done-{k}")
        k += 1
        w._store.reclaim()
        assert k < 40, "no segment was recycled"
    held = [p for p in path.iterdir() if p.name.startswith(segments.RECYCLE_PREFIX)]
    assert len(held) == 1 and held[0].stat().st_size >= SEG
    used = log.spares_used
    while log.spares_used == used:  # roll into it
        _write(w, "live", 4)
    active = segments.list_segments(path)[-1][1]
    assert codec.segment_header(active.read_bytes()[:codec.SEGMENT_HEAD_BYTES]) == (log.segment_list()[-1][0], True)
    return w, "live"


def test_a_reclaimed_segment_is_written_over_in_place(tmp_path):
    w, live = _recycled_log(tmp_path)
    log = w._store.log
    size = log._active_path.stat().st_size
    alloc = log._alloc
    _write(w, live, 6)
    assert log._alloc == alloc and log._active_path.stat().st_size == size  # no zeros written, no growth
    assert w.stats()["recycled_segments"] >= 1
    want = w.tokens(live)
    w.close()
    w = wal.open(tmp_path, wal.WALConfig(**CFG))  # stale frames after the end are not records
    assert w.tokens(live) == want and w.recovery.torn_bytes_cut == 0 and w.recovery.corruption == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(segments.RECYCLE_PREFIX)]
    _write(w, live, 2)
    w.close()
    report = verify(tmp_path)
    assert report["corruption"] == [] and report["torn_bytes_cut"] == 0


def _frames(path):
    active = segments.list_segments(path)[-1][1]
    buf = active.read_bytes()
    base = segments.list_segments(path)[-1][0]
    return active, buf, [(off, rec) for off, rec in codec.iter_frames(buf, codec.SEGMENT_HEAD_BYTES, base)]


def test_a_torn_flush_among_stale_frames_is_zeroed_and_never_comes_back(tmp_path):
    w, live = _recycled_log(tmp_path)
    _write(w, live, 1)
    kept = w.tokens(live)
    # one flush of three records, the first of which never reached the disk (a power cut's hole)
    n = w.length(live)
    for r in range(3):
        w.append(live, n + r * N, _toks(live, n + r * N), _lps(n + r * N), 0)
    w.commit()
    w.close()
    active, buf, frames = _frames(tmp_path)
    first, _ = frames[-3]
    assert codec.starts_flush(buf, first) and not codec.starts_flush(buf, frames[-2][0])
    data = bytearray(buf)
    data[first:frames[-2][0]] = bytes(frames[-2][0] - first)
    active.write_bytes(bytes(data))
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    assert w.tokens(live) == kept and w.recovery.torn_bytes_cut > 0 and w.recovery.corruption == []
    assert active.stat().st_size == len(buf)  # cut by zeroing, not truncating: the blocks stay
    # a record as long as the lost one ends where the torn frames began: were they still there, the next
    # of them would read as its successor
    n = w.length(live)
    other = _toks("other", n)
    w.append(live, n, other, _lps(n), 0)
    w.commit()
    w.close()
    _, buf2, frames2 = _frames(tmp_path)
    assert frames2[-1][0] == first and codec.FRAME.size + codec.FRAME.unpack_from(buf2, first)[0] == frames[-2][0] - first
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    assert w.tokens(live) == kept + other and w.recovery.corruption == []
    w.close()


def test_damage_followed_by_a_later_flush_is_still_corruption(tmp_path):
    w, live = _recycled_log(tmp_path)
    _write(w, live, 3)  # three flushes
    w.close()
    active, buf, frames = _frames(tmp_path)
    off, _ = frames[-2]
    data = bytearray(buf)
    data[off + 20] ^= 0x40
    active.write_bytes(bytes(data))
    with pytest.raises(CorruptionError):
        wal.open(tmp_path, wal.WALConfig(**CFG))
    assert verify(tmp_path)["corruption"]


def _sealed_recycled(path):
    """A log whose recycled segment is sealed (the log rolled on past it): (wal, live, its path, its base)."""
    w, live = _recycled_log(path)
    log = w._store.log
    recycled = log._active_path
    while log._active_path == recycled:
        _write(w, live, 2)
    return w, live, recycled, int(recycled.name.split(".")[0])


def test_a_sealed_recycled_segment_with_stale_frames_after_its_end_opens(tmp_path):
    w, live, recycled, base = _sealed_recycled(tmp_path)
    want = w.tokens(live)
    w.close()
    sealed = recycled.read_bytes()
    end = codec.SEGMENT_HEAD_BYTES + sum(codec.FRAME.size + codec.FRAME.unpack_from(sealed, o)[0]
                                         for o, _ in codec.iter_frames(sealed, codec.SEGMENT_HEAD_BYTES, base))
    tail = bytes(_stale_frames(base, 2000))
    recycled.write_bytes(sealed[:end] + tail)  # as if killed before the roll's trim: the old frames stay
    w = wal.open(tmp_path, wal.WALConfig(**CFG))
    assert w.tokens(live) == want and w.recovery.corruption == []
    assert recycled.stat().st_size == end  # trimmed on open, as a sealed segment's zero reserve is
    w.close()


def test_retention_refuses_a_sealed_recycled_segment_damaged_in_the_middle(tmp_path):
    w, live, recycled, base = _sealed_recycled(tmp_path)
    data = bytearray(recycled.read_bytes())
    offs = [o for o, _ in codec.iter_frames(bytes(data), codec.SEGMENT_HEAD_BYTES, base)]
    data[offs[len(offs) // 2] + 20] ^= 0x10  # records after it stay valid: not the segment's end
    recycled.write_bytes(bytes(data))
    w.finalize(live)
    with pytest.raises(CorruptionError, match="does not decode to its end"):
        w._store._segment_records(base, recycled)
    w.close()


def _stale_frames(below: int, nbytes: int) -> bytearray:
    out, lsn = bytearray(), max(0, below - 400)
    while len(out) < nbytes:
        out += codec.encode_tokens(lsn, "old", lsn, 0, np.arange(7, dtype=np.int32).tobytes(),
                                   np.full(7, -0.5).tobytes())
        lsn += 1
    return out[:nbytes]


def _slow_find_valid_after(buf, off, last_lsn, stop=None):
    """The frame-by-frame search the vectorised one replaces."""
    n = len(buf)
    hi = n - codec.FRAME.size - codec.BODY.size + 1
    for p in range(off + 1, hi if stop is None else min(hi, stop)):
        body_len, _ = codec.FRAME.unpack_from(buf, p)
        if body_len < codec.BODY.size or body_len > codec.MAX_BODY_BYTES or p + codec.FRAME.size + body_len > n:
            continue
        lsn, _ = codec.BODY.unpack_from(buf, p + codec.FRAME.size)
        if not (last_lsn < lsn <= last_lsn + codec.MAX_LSN_JUMP):
            continue
        if codec.read_frame(buf, p, None)[2] is None:
            return p
    return None


@pytest.mark.parametrize("seed", range(12))
def test_vectorised_search_finds_what_a_frame_by_frame_search_finds(seed):
    rng = random.Random(seed)
    buf = bytearray(rng.randbytes(rng.randrange(0, 300)))
    lsn = rng.randrange(0, 1000)
    for _ in range(rng.randrange(1, 8)):  # stale frames, live frames and noise, in any order
        kind = rng.random()
        n = rng.randrange(1, 40)
        at = lsn + rng.randrange(1, 30) if kind < 0.4 else max(0, lsn - rng.randrange(1, 500))
        frame = codec.encode_tokens(at, f"t{rng.randrange(9)}", rng.randrange(100), 0,
                                    np.arange(n, dtype=np.int32).tobytes(), np.full(n, -0.25).tobytes(),
                                    codec.FLUSH_MARK if rng.random() < 0.5 else 0)
        if rng.random() < 0.3:  # damaged
            frame = bytearray(frame)
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        buf += frame + rng.randbytes(rng.randrange(0, 50))
    buf = bytes(buf)
    for off in (0, 5, len(buf) // 3):
        for stop in (None, len(buf) // 2):
            want = _slow_find_valid_after(buf, off, lsn, stop)
            assert codec.find_valid_after(buf, off, lsn, stop) == want
            dense = codec.find_valid_after(buf, off, lsn, stop, dense=True)
            assert dense is None or dense == want  # the dense bound only narrows the lsns it accepts
