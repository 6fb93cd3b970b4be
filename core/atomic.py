"""Atomic file writes: temp file, fsync, rename, fsync of the directory (through core.fileio); the
directory itself is created durably when missing, and a failed write leaves no temp file."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from core import fileio


def fsync_dir(path: Path) -> None:
    fileio.fsync_dir(path)


def write_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    fileio.makedirs(path.parent)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        fileio.write_file(tmp, data, sync=True)
        fileio.replace(tmp, path)
    except BaseException:  # a failed write (disk full at fsync) leaves no temp file behind
        with contextlib.suppress(OSError):
            fileio.unlink(tmp)
        raise
    fileio.fsync_dir(path.parent)
