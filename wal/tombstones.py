"""Tombstones: the finalized trajectories whose finalize records retention has reclaimed.

A finalize record is deleted with the oldest segment once the token records it kills are gone. The
id must still read as finalized afterwards (a late read or append of it is a resume that would
re-sample a trajectory already in the data plane), so before that segment is deleted its finalize
records are appended, as the same frames, to `finalized.log` in the log directory and synced. A
crash between the sync and the delete leaves an id in both places, which is harmless. On open a torn
tail (a bad frame with no valid one after it) is cut: the segment holding those records was not yet
deleted. A bad frame followed by valid ones is corruption.
"""
from __future__ import annotations

import os
from pathlib import Path

from core import fileio
from wal import codec, segments
from wal.errors import CorruptionError
from wal.types import FinalizeRecord

FILE_NAME = "finalized.log"


def read(directory: Path, *, mutate: bool) -> set[str]:
    """The ids in `directory`'s tombstone file (none when it is absent). With mutate, a torn tail is cut."""
    path = Path(directory) / FILE_NAME
    try:
        buf = path.read_bytes()
    except FileNotFoundError:
        return set()
    ids: set[str] = set()
    off, last_lsn = 0, -1
    while off < len(buf):
        rec, end, why = codec.read_frame(buf, off, None)
        if why is not None or type(rec) is not FinalizeRecord:
            if codec.find_valid_after(buf, off, last_lsn) is not None:
                raise CorruptionError(f"tombstone file {path}: bad frame at offset {off} "
                                      f"({why or 'not a finalize record'}) with valid frames after it")
            if mutate:  # torn tail: its finalize records are still in the segment that was not deleted
                segments.truncate(path, off)
            break
        ids.add(rec.traj_id)
        off, last_lsn = end, max(last_lsn, rec.lsn)
    return ids


def append(directory: Path, records: list[FinalizeRecord]) -> None:
    """Durably add these finalize records (before the segment holding them is deleted)."""
    if not records:
        return
    path = Path(directory) / FILE_NAME
    created = not path.exists()
    fd = fileio.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fileio.write_all(fd, b"".join(codec.encode_finalize(r.lsn, r.traj_id) for r in records))
        fileio.fdatasync(fd)
    finally:
        fileio.close(fd)
    if created:
        fileio.fsync_dir(directory)
