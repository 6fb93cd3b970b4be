"""Torn and corrupted tails: truncation at every byte of the last records, bit flips in the tail and in
the middle (the middle must be reported), torn segment headers, damage in an earlier segment."""
from __future__ import annotations

import random
import shutil

import pytest

import wal
from wal import codec, cuts, segments
from wal.verify import verify


def _tok(traj: int, pos: int) -> int:
    return (traj * 7919 + pos * 31) % 50000


def _build(path, n_records=12, per=3, config=None):
    """One trajectory, `n_records` records of `per` tokens; returns the frame end offsets of the last segment."""
    w = wal.open(path, config)
    for r in range(n_records):
        start = r * per
        w.append("t", start, [_tok(0, p) for p in range(start, start + per)], [-0.01 * p for p in range(start, start + per)], r // 4)
        w.commit()
    w.close()
    seg = segments.list_segments(path)[-1][1]
    buf = seg.read_bytes()
    ends = [off + codec.FRAME.size + codec.FRAME.unpack_from(buf, off)[0]
            for off, _ in codec.iter_frames(buf, codec.SEGMENT_HEAD_BYTES, segments.list_segments(path)[-1][0])]
    return seg, buf, ends


def _expect_prefix(path, n_tokens):
    w = wal.open(path)
    assert w.tokens("t") == [_tok(0, p) for p in range(n_tokens)]
    assert w.logprobs("t") == [-0.01 * p for p in range(n_tokens)]
    rep = w.recovery
    w.append("t", n_tokens, [1], [-1.0], 9)  # the log stays writable after recovery
    w.commit()
    w.close()
    return rep


def test_truncation_at_every_byte_of_the_last_records(tmp_path):
    src = tmp_path / "src"
    seg, buf, ends = _build(src)
    per = 3
    first = ends[-4]  # every byte offset inside the last three records
    for cut in range(first, ends[-1] + 1):  # (past ends[-1] lies the zero-filled reserve)
        d = tmp_path / f"c{cut}"
        shutil.copytree(src, d)
        with open(d / seg.name, "r+b") as f:
            f.truncate(cut)
        whole = sum(1 for e in ends if e <= cut)
        rep = _expect_prefix(d, whole * per)
        # trailing zero bytes of a cut frame cannot be told from the zero-filled reserve: the non-zero part is cut
        torn = buf[ends[whole - 1]:cut].rstrip(b"\0")
        assert rep.torn_bytes_cut == len(torn)
        if rep.torn_bytes_cut:
            kept = [p for p in (d / segments.TORN_DIR).iterdir()]
            assert len(kept) == 1 and kept[0].read_bytes() == torn, "cut bytes must be kept aside"
        shutil.rmtree(d)


def test_bit_flips_in_the_last_record_cut_it_as_torn(tmp_path):
    src = tmp_path / "src"
    seg, buf, ends = _build(src)
    rng = random.Random(1234)
    lo = ends[-2]
    for bit in rng.sample(range(lo * 8, ends[-1] * 8), 40):
        d = tmp_path / f"b{bit}"
        shutil.copytree(src, d)
        data = bytearray(buf)
        data[bit // 8] ^= 1 << (bit % 8)
        (d / seg.name).write_bytes(bytes(data))
        rep = _expect_prefix(d, (len(ends) - 1) * 3)
        assert rep.torn_bytes_cut == ends[-1] - lo
        shutil.rmtree(d)


def test_bit_flips_in_a_middle_record_are_reported_not_skipped(tmp_path):
    src = tmp_path / "src"
    seg, buf, ends = _build(src)
    rng = random.Random(99)
    mid_lo, mid_hi = ends[4], ends[5]  # record 5 of 12
    for bit in rng.sample(range(mid_lo * 8, mid_hi * 8), 30):
        d = tmp_path / f"m{bit}"
        shutil.copytree(src, d)
        data = bytearray(buf)
        data[bit // 8] ^= 1 << (bit % 8)
        (d / seg.name).write_bytes(bytes(data))
        with pytest.raises(wal.CorruptionError, match="corrupt"):
            wal.open(d)
        assert (d / seg.name).read_bytes() == bytes(data), "a refused open must not modify the log"
        report = verify(d)
        assert report["corruption"] and report["corruption"][0]["offset"] == mid_lo
        assert report["corruption"][0]["valid_records_follow"]
        shutil.rmtree(d)


def test_canary_corrupted_middle_record_is_detected_and_repair_keeps_the_prefix(tmp_path):
    seg, buf, ends = _build(tmp_path)
    data = bytearray(buf)
    data[ends[2] + 20] ^= 0xFF  # canary: damage record 3's payload
    seg.write_bytes(bytes(data))
    with pytest.raises(wal.CorruptionError):
        wal.open(tmp_path)
    w = wal.open(tmp_path, repair=True)
    assert w.recovery.repaired
    assert w.tokens("t") == [_tok(0, p) for p in range(9)]
    w.close()
    kept = b"".join(p.read_bytes() for p in sorted((tmp_path / segments.TORN_DIR).iterdir()))
    assert kept == bytes(data[ends[2]:])
    assert verify(tmp_path)["corruption"] == []


def _multi_segment(path):
    cfg = wal.WALConfig(segment_bytes=4096)
    w = wal.open(path, cfg)
    for i in range(300):
        w.append(f"t{i % 3}", i // 3 * 4, [i, i, i, i], [-1.0] * 4, 0)
        w.commit()
    w.close()
    segs = segments.list_segments(path)
    assert len(segs) >= 3
    return cfg, segs


def test_damage_in_an_earlier_segment_is_corruption(tmp_path):
    cfg, segs = _multi_segment(tmp_path)
    first = segs[0][1]
    data = bytearray(first.read_bytes())
    data[-3] ^= 4  # the tail of a sealed segment: later segments hold valid data
    first.write_bytes(bytes(data))
    with pytest.raises(wal.CorruptionError):
        wal.open(tmp_path, cfg)
    assert verify(tmp_path)["corruption"][0]["segment"] == first.name


def test_missing_middle_segment_is_corruption(tmp_path):
    cfg, segs = _multi_segment(tmp_path)
    segs[1][1].unlink()
    with pytest.raises(wal.CorruptionError, match="gap between segments"):
        wal.open(tmp_path, cfg)


def test_torn_segment_header_is_cut(tmp_path):
    cfg, segs = _multi_segment(tmp_path)
    w = wal.open(tmp_path, cfg)
    lengths = {t: w.length(t) for t in w.trajectories()}
    nxt = w.stats()["next_lsn"]
    w.close()
    (tmp_path / segments.segment_name(nxt + 1000)).unlink(missing_ok=True)
    # a crash right after creating the next segment, before its header was complete
    torn = tmp_path / segments.segment_name(nxt)
    if torn.exists():
        torn.unlink()
    last_base = segments.list_segments(tmp_path)[-1][0]
    torn.write_bytes(codec.encode_segment_header(nxt)[:7])
    w = wal.open(tmp_path, cfg)
    assert w.recovery.torn_bytes_cut == 7
    assert {t: w.length(t) for t in w.trajectories()} == lengths
    assert segments.list_segments(tmp_path)[-1][0] == last_base
    w.close()


def _hole(d, extra: int = 0):
    """A segment of valid frames leaving a hole in trajectory A: positions 0..1, then 5..6 (the records of
    2..4 lost, as with a segment file gone), and `extra` records of trajectory B after them."""
    tok = lambda *t: codec.pack_tokens(list(t))  # noqa: E731
    lp = lambda n: codec.pack_logprobs([-0.5] * n, n)  # noqa: E731
    d.mkdir()
    frames = [codec.encode_segment_header(0), codec.encode_tokens(0, "A", 0, 0, tok(1, 2), lp(2), codec.FLUSH_MARK),
              codec.encode_tokens(1, "A", 5, 0, tok(6, 7), lp(2))]
    frames += [codec.encode_tokens(2 + i, "B", i, 0, tok(i), lp(1)) for i in range(extra)]
    (d / segments.segment_name(0)).write_bytes(b"".join(frames))


def test_a_repaired_hole_stays_cut_after_the_trajectory_goes_on_past_it(tmp_path):
    """Repair keeps A's prefix and records the cut durably; the writer goes on from the prefix over the cut
    positions with other tokens; later opens, plain or repairing, see what the writer wrote."""
    d = tmp_path / "w"
    _hole(d)
    with pytest.raises(wal.CorruptionError, match="hole"):
        wal.open(d)
    w = wal.open(d, repair=True)
    assert w.tokens("A") == [1, 2] and w.recovery.repaired and (d / cuts.FILE_NAME).is_file()
    w.append("A", 2, [3, 4, 5, 60, 70], [-0.5] * 5, 0)
    w.commit()
    w.close()
    for repair in (False, True):
        w = wal.open(d, repair=repair)
        assert w.tokens("A") == [1, 2, 3, 4, 5, 60, 70] and not w.recovery.repaired
        w.close()


def test_retention_never_copies_a_cut_record_forward(tmp_path):
    """Compaction copies the live records of the oldest segment to the head under new lsns; a cut record
    copied so would escape its cut. The segment holding the cut goes; the log opens plain afterwards."""
    d = tmp_path / "w"
    _hole(d, extra=3)
    cfg = wal.WALConfig(segment_bytes=4096, preallocate_bytes=4096, retain_bytes=0, recycle_segments=False)
    w = wal.open(d, cfg, repair=True)
    w.append("A", 2, [3, 4, 5], [-0.5] * 3, 0)  # up to the cut's first position, not over it
    w.commit()
    for i in range(60):  # roll past the first segment
        w.append("B", 3 + 16 * i, [i] * 16, [-0.5] * 16, 0)
        w.commit()
    for _ in range(4):  # retain_bytes=0: every pass compacts the oldest sealed segments, copies included
        if segments.segment_name(0) not in [p.name for p in d.iterdir()]:
            break
        w.reclaim()
    assert segments.segment_name(0) not in [p.name for p in d.iterdir()], "the segment holding the cut is gone"
    w.close()
    w = wal.open(d, cfg)  # a copy of A@5..6 would be deferred here and resurrect tokens the writer never saw
    assert w.tokens("A") == [1, 2, 3, 4, 5] and len(w.tokens("B")) == 3 + 60 * 16
    w.close()


def _read_ahead_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "wal-read-ahead"]


def test_the_read_ahead_stays_one_segment_ahead_and_stops_with_the_scan(tmp_path, monkeypatch):
    """The scan's reader thread opens the segment being scanned and the next, never further, and is gone
    when the scan returns or raises."""
    import os
    import threading

    _, segs = _multi_segment(tmp_path)
    order = {p.name: i for i, (_, p) in enumerate(segs)}
    opened, real_open = [], os.open

    def logged_open(path, *args, **kw):
        if threading.current_thread().name == "wal-read-ahead":
            opened.append(order[os.path.basename(path)])
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", logged_open)
    first_base = segs[0][0]
    seen_at: list[int] = []

    def on_record(rec):
        seg = max(i for i, (base, _) in enumerate(segs) if base <= rec.lsn)
        if not seen_at or seen_at[-1] != seg:
            import time
            time.sleep(0.02)  # time for the reader to run ahead, if it would
            seen_at.append(seg)
            assert max(opened, default=0) <= seg + 1, (seg, opened)

    report = segments.scan(tmp_path, on_record, mutate=False)
    assert report.segments == len(segs) and seen_at == list(range(len(segs))) and first_base == 0
    assert sorted(opened) == list(range(len(segs))) and not _read_ahead_threads()

    data = bytearray(segs[1][1].read_bytes())
    data[-3] ^= 4
    segs[1][1].write_bytes(bytes(data))
    with pytest.raises(wal.CorruptionError):
        segments.scan(tmp_path, lambda rec: None, mutate=True)
    assert not _read_ahead_threads()
