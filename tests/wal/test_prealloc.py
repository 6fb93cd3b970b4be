"""Preallocated segments: the zero-filled reserve after the last record is a clean end; non-zero bytes
there are a torn tail (cut, kept aside); zeroed records with valid ones after them, or a zeroed tail of a
sealed segment, are still corruption; truncated segments and a crash while building a segment recover."""
from __future__ import annotations

import os

import pytest

import wal
from wal import codec, segments
from wal.verify import verify


def _write(path, n=10, config=None):
    w = wal.open(path, config)
    for r in range(n):
        w.append("t", r * 4, [r, r + 1, r + 2, r + 3], [-0.5 - r] * 4, 0)
        w.commit()
    w.close()
    base, seg = segments.list_segments(path)[-1]
    buf = seg.read_bytes()
    ends = [off + codec.FRAME.size + codec.FRAME.unpack_from(buf, off)[0]
            for off, _ in codec.iter_frames(buf, codec.SEGMENT_HEAD_BYTES, base)]
    return seg, buf, ends


def _tokens(n):
    return [t for r in range(n) for t in (r, r + 1, r + 2, r + 3)]


def test_zero_filled_reserve_is_a_clean_end_and_commits_do_not_grow_the_file(tmp_path):
    seg, buf, ends = _write(tmp_path)
    assert len(buf) >= ends[-1] + (1 << 19), "the active segment must be preallocated ahead of the last record"
    assert buf[ends[-1]:] == bytes(len(buf) - ends[-1])
    w = wal.open(tmp_path)
    assert w.tokens("t") == _tokens(10)
    rep = w.recovery
    assert rep.torn_bytes_cut == 0 and rep.torn_files == [] and rep.corruption == []
    assert rep.tail_offset == ends[-1] and rep.preallocated_bytes == len(buf) - ends[-1]
    size = seg.stat().st_size
    for r in range(10, 20):  # appends inside the reserve overwrite it: the file size does not change
        w.append("t", r * 4, [r, r + 1, r + 2, r + 3], [-0.5 - r] * 4, 0)
        w.commit()
        assert seg.stat().st_size == size
    w.close()
    assert not (tmp_path / segments.TORN_DIR).exists()
    assert verify(tmp_path)["ok"] and verify(tmp_path)["torn_bytes_cut"] == 0


def test_no_preallocation_grows_the_file_exactly(tmp_path):
    seg, buf, ends = _write(tmp_path, config=wal.WALConfig(preallocate_bytes=0))
    assert len(buf) == ends[-1]
    w = wal.open(tmp_path, wal.WALConfig(preallocate_bytes=0))
    assert w.tokens("t") == _tokens(10)
    w.close()


@pytest.mark.parametrize("where", [0, 1, 7, 8, 100, 4095, 300_000])
def test_a_flipped_bit_in_the_reserve_is_a_torn_tail_reported_and_kept(tmp_path, where):
    """Nothing committed lies past the last record, so a non-zero byte there cannot hide lost data; but it
    is not silently ignored either: it is cut as a torn tail (reported, kept aside), exactly like garbage
    at the end of a grown file."""
    seg, buf, ends = _write(tmp_path)
    data = bytearray(buf)
    data[ends[-1] + where] ^= 0x10
    seg.write_bytes(bytes(data))
    report = verify(tmp_path)
    assert report["ok"] and report["torn_bytes_cut"] == where + 1
    w = wal.open(tmp_path)
    assert w.tokens("t") == _tokens(10)
    assert w.recovery.torn_bytes_cut == where + 1
    kept = list((tmp_path / segments.TORN_DIR).iterdir())
    assert len(kept) == 1 and kept[0].read_bytes() == bytes(data[ends[-1]:ends[-1] + where + 1])
    w.append("t", 40, [7], [-7.0], 0)  # writable again; the cut segment is re-extended
    w.commit()
    w.close()
    w = wal.open(tmp_path)
    assert w.tokens("t") == _tokens(10) + [7] and w.recovery.torn_bytes_cut == 0
    w.close()


def test_a_zeroed_record_followed_by_valid_records_is_corruption(tmp_path):
    """A zero frame header is a clean end only when nothing valid follows it."""
    seg, buf, ends = _write(tmp_path)
    data = bytearray(buf)
    data[ends[3]:ends[4]] = bytes(ends[4] - ends[3])  # record 5 of 10 reads as zeros (a lost page)
    seg.write_bytes(bytes(data))
    with pytest.raises(wal.CorruptionError, match="corrupt"):
        wal.open(tmp_path)
    assert seg.read_bytes() == bytes(data), "a refused open must not modify the log"
    report = verify(tmp_path)
    assert report["corruption"][0]["offset"] == ends[3] and report["corruption"][0]["valid_records_follow"]


def _committed_steps(path, n: int) -> "wal.WALConfig":
    """n committed 4-token appends to one trajectory in 4 KiB segments; returns the config used."""
    cfg = wal.WALConfig(segment_bytes=4096)
    w = wal.open(path, cfg)
    for i in range(n):
        w.append("t", i * 4, [i] * 4, [-1.0] * 4, 0)
        w.commit()
    w.close()
    return cfg


def test_zeroed_tail_of_a_sealed_segment_is_a_gap(tmp_path):
    cfg = _committed_steps(tmp_path, 200)
    segs = segments.list_segments(tmp_path)
    assert len(segs) >= 3
    sealed = segs[0][1]
    data = bytearray(sealed.read_bytes())
    assert len(data) <= 4096 + 200, "a sealed segment is truncated to its last record"
    offs = [off for off, _ in codec.iter_frames(bytes(data), codec.SEGMENT_HEAD_BYTES, segs[0][0])]
    data[offs[-2]:] = bytes(len(data) - offs[-2])  # its last two records read as zeros: looks like a clean end ...
    sealed.write_bytes(bytes(data))
    with pytest.raises(wal.CorruptionError, match="gap between segments"):  # ... but the next segment does not follow on
        wal.open(tmp_path, cfg)


def test_sealed_segment_left_with_its_reserve_by_a_crash_is_accepted_and_trimmed(tmp_path):
    cfg = _committed_steps(tmp_path, 100)
    first = segments.list_segments(tmp_path)[0][1]
    size = first.stat().st_size
    with open(first, "r+b") as f:  # a crash between the roll and the truncate of the sealed segment
        f.truncate(size + 3000)
    w = wal.open(tmp_path, cfg)
    assert w.tokens("t") == [i for i in range(100) for _ in range(4)]
    assert w.recovery.corruption == [] and w.recovery.torn_bytes_cut == 0
    w.close()
    assert first.stat().st_size == size


@pytest.mark.parametrize("keep", ["data_end", "inside_reserve"])
def test_truncated_preallocated_segment_recovers_and_stays_writable(tmp_path, keep):
    seg, buf, ends = _write(tmp_path)
    cut = ends[-1] if keep == "data_end" else ends[-1] + 333
    with open(seg, "r+b") as f:
        f.truncate(cut)
    w = wal.open(tmp_path)
    assert w.tokens("t") == _tokens(10) and w.recovery.torn_bytes_cut == 0
    for r in range(10, 300):  # runs past the old file end: the reserve is extended again
        w.append("t", r * 4, [r, r + 1, r + 2, r + 3], [-0.5 - r] * 4, 0)
        w.commit()
    w.close()
    assert seg.stat().st_size > ends[-1] + 290 * 40
    w = wal.open(tmp_path)
    assert w.tokens("t") == _tokens(300) and w.recovery.torn_bytes_cut == 0
    w.close()


def test_crash_while_building_the_next_segment(tmp_path):
    """A segment is built as `<name>.tmp` and renamed: a crash mid-preallocation leaves only the .tmp,
    which is not part of the log and is removed on open."""
    seg, buf, ends = _write(tmp_path)
    nxt = tmp_path / (segments.segment_name(10) + segments.TMP_SUFFIX)
    nxt.write_bytes(codec.encode_segment_header(10) + bytes(5000))  # header and a part of the zeros
    report = verify(tmp_path)
    assert report["ok"] and report["segments"] == 1 and report["records"] == 10
    w = wal.open(tmp_path)
    assert not nxt.exists()
    assert w.tokens("t") == _tokens(10) and w.recovery.torn_bytes_cut == 0
    w.append("t", 40, [1], [-1.0], 0)
    w.commit()
    w.close()
    assert [b for b, _ in segments.list_segments(tmp_path)] == [0]


def test_create_segment_is_complete_before_its_name_appears(tmp_path):
    fd = segments.create_segment(tmp_path, 42, 10_000)
    os.close(fd)
    path = tmp_path / segments.segment_name(42)
    data = path.read_bytes()
    assert len(data) == 10_000 and codec.decode_segment_header(data) == 42
    assert data[codec.SEGMENT_HEAD_BYTES:] == bytes(10_000 - codec.SEGMENT_HEAD_BYTES)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    with pytest.raises(FileExistsError):
        segments.create_segment(tmp_path, 42, 100)
