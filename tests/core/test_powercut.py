"""The power-cut simulator's disk model: synced data always survives; unsynced writes are dropped, kept or
torn at 512-byte sectors (every combination shows up); unsynced directory entries may be missing or
there; a synchronous write is durable on return; renames and exchanges are atomic; a seed is one exact state; files a library wrote enter the
model unsynced; writes through a descriptor the layer did not open are refused."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from core import fileio, powercut


def tree(path: Path) -> dict:
    out = {}
    for p in sorted(path.iterdir()):
        out[p.name] = tree(p) if p.is_dir() else p.read_bytes()
    return out


def images(ops, cut, n, tmp_path, first_seed=0):
    replay = powercut.Replay(ops)
    replay.advance(cut)
    out = []
    for s in range(first_seed, first_seed + n):
        dest = tmp_path / f"img-{cut}-{s}"
        replay.image(s, dest)
        out.append(tree(dest))
    return out


def write_file(path, data, sync=True):
    fd = fileio.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fileio.pwrite_all(fd, data, 0)
    if sync:
        fileio.fsync(fd)
    fileio.close(fd)


def durable_file_open(live: Path, data: bytes) -> int:
    """`live/f` written with `data`, synced with its name; a write descriptor of it."""
    write_file(live / "f", data)
    fileio.fsync_dir(live)
    return fileio.open(live / "f", os.O_WRONLY)


def test_synced_data_and_entries_survive_every_image(tmp_path):
    with powercut.recording(tmp_path / "live") as rec:
        write_file(tmp_path / "live" / "a", b"A" * 1500)
        fileio.fsync_dir(tmp_path / "live")
    for t in images(rec.ops, len(rec.ops), 40, tmp_path):
        assert t == {"a": b"A" * 1500}


def test_unsynced_writes_are_dropped_kept_or_torn_per_sector(tmp_path):
    old, new = bytes([1]) * 4096, bytes([2]) * 4096
    with powercut.recording(tmp_path / "live") as rec:
        fd = durable_file_open(tmp_path / "live", old)
        fileio.pwrite(fd, new, 0)  # not synced
        fileio.close(fd)
    seen = set()
    for t in images(rec.ops, len(rec.ops), 300, tmp_path):
        data = t["f"]
        assert len(data) == 4096
        sectors = tuple(data[i * 512:(i + 1) * 512] in (old[:512], new[:512]) and data[i * 512] for i in range(8))
        assert all(sectors), "every sector is the old or the new one, never a mix inside a sector"
        seen.add(sectors)
    assert (1,) * 8 in seen and (2,) * 8 in seen  # dropped, kept
    assert any(1 in s and 2 in s and s.index(2) > s.index(1) for s in seen)  # torn, a later sector reached the disk
    assert any(1 in s and 2 in s and s.index(1) > s.index(2) for s in seen)
    assert len(seen) > 20


def test_pwrite_sync_is_durable_on_return_and_refused_over_unsynced_writes(tmp_path):
    old, new = bytes([1]) * 4096, bytes([2]) * 1024
    with powercut.recording(tmp_path / "live") as rec:
        fd = durable_file_open(tmp_path / "live", old)
        assert fileio.pwrite_sync(fd, new, 1024) == 1024
        after_sync = len(rec.ops)
        fileio.pwrite(fd, new, 3072)  # not synced
        with pytest.raises(NotImplementedError, match="unsynced"):  # a ranged sync over it: not modelled
            fileio.pwrite_sync(fd, new, 0)
        fileio.close(fd)
    assert (tmp_path / "live" / "f").read_bytes() == old[:1024] + new + old[:1024] + new  # the refused write did not happen
    for t in images(rec.ops, after_sync, 20, tmp_path):
        assert t == {"f": old[:1024] + new + old[:2048]}
    assert any(t["f"][3072:] == old[:1024] for t in images(rec.ops, len(rec.ops), 20, tmp_path, 100))


def test_unsynced_growth_may_leave_zeros_or_a_shorter_file(tmp_path):
    with powercut.recording(tmp_path / "live") as rec:
        write_file(tmp_path / "live" / "f", b"x" * 100)
        fileio.fsync_dir(tmp_path / "live")
        fd = fileio.open(tmp_path / "live" / "f", os.O_WRONLY)
        fileio.pwrite(fd, b"y" * 1000, 100)
        fileio.close(fd)
    shapes = {(len(t["f"]), t["f"][600:601]) for t in images(rec.ops, len(rec.ops), 200, tmp_path)}
    assert (100, b"") in shapes and (1100, b"y") in shapes and (1100, b"\0") in shapes


def test_entries_need_their_directory_fsync(tmp_path):
    with powercut.recording(tmp_path / "live") as rec:
        write_file(tmp_path / "live" / "f", b"data")  # file synced, directory not
        n_before_dir_sync = len(rec.ops)
        fileio.fsync_dir(tmp_path / "live")
    names = [tuple(t) for t in images(rec.ops, n_before_dir_sync, 60, tmp_path)]
    assert ("f",) in names and () in names
    assert all(t == {"f": b"data"} for t in images(rec.ops, len(rec.ops), 30, tmp_path, 100))


def test_rename_and_exchange_are_atomic(tmp_path):
    live = tmp_path / "live"
    with powercut.recording(live) as rec:
        write_file(live / "old", b"1")
        fileio.mkdir(live / "d1")
        fileio.mkdir(live / "d2")
        fileio.fsync_dir(live)
        fileio.rename(live / "old", live / "new")
        try:
            fileio.exchange(live / "d1", live / "d2")
            exchanged = True
        except OSError:
            exchanged = False
        write_file(live / "d1" / "x", b"in d2's inode")
        fileio.fsync_dir(live / "d1")
    for t in images(rec.ops, len(rec.ops), 200, tmp_path):
        assert ("old" in t) != ("new" in t), "a rename moves the name or not; never both, never neither"
        assert set(t) >= {"d1", "d2"}
        if exchanged:  # the synced directory (d2's inode, now named d1) holds x under either name
            assert (t["d1"] == {"x": b"in d2's inode"}) != (t["d2"] == {"x": b"in d2's inode"})


def test_a_seed_is_one_exact_state_and_seeds_differ(tmp_path):
    with powercut.recording(tmp_path / "live") as rec:
        for i in range(6):
            write_file(tmp_path / "live" / f"f{i}", bytes([i]) * 2000, sync=i % 2 == 0)
    a = images(rec.ops, len(rec.ops), 20, tmp_path)
    (tmp_path / "again").mkdir()
    b = images(rec.ops, len(rec.ops), 20, tmp_path / "again")
    assert a == b
    assert len({repr(t) for t in a}) > 10


def test_library_written_files_enter_unsynced_and_outside_writes_are_refused(tmp_path):
    live = tmp_path / "live"
    with powercut.recording(live) as rec:
        fileio.mkdir(live / "ck")
        (live / "ck" / "lib.bin").write_bytes(b"L" * 700)  # written by a library, not through the layer
        cut = len(rec.ops)
        fileio.sync_path(live / "ck" / "lib.bin")
        fileio.fsync_dir(live / "ck")
        fileio.fsync_dir(live)
        with open(live / "raw", "wb") as f:
            f.write(b"r")
            f.flush()
            with pytest.raises(powercut.OutsideLayerError):
                fileio.fsync(f.fileno())
    assert {repr(t.get("ck")) for t in images(rec.ops, cut, 30, tmp_path)} <= {"None", "{}"}
    assert all(t["ck"] == {"lib.bin": b"L" * 700} for t in images(rec.ops, len(rec.ops), 30, tmp_path, 50))


def test_what_existed_before_recording_is_durable_and_cuts_start_after_it(tmp_path):
    (tmp_path / "live" / "sub").mkdir(parents=True)
    (tmp_path / "live" / "sub" / "f").write_bytes(b"before")
    with powercut.recording(tmp_path / "live") as rec:
        fileio.unlink(tmp_path / "live" / "sub" / "f")
    assert all(t == {"sub": {"f": b"before"}} for t in images(rec.ops, rec.start, 10, tmp_path))
    assert {repr(t) for t in images(rec.ops, len(rec.ops), 40, tmp_path, 10)} == {
        repr({"sub": {"f": b"before"}}), repr({"sub": {}})}
    with pytest.raises(ValueError):
        powercut.Replay(rec.ops).advance(len(rec.ops) + 1)
