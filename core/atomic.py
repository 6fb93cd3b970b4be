"""Atomic file writes: temp file, fsync, rename, fsync of the directory (through core.fileio)."""
from __future__ import annotations

import os
from pathlib import Path

from core import fileio


def fsync_dir(path: Path) -> None:
    fileio.fsync_dir(path)


def write_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    fileio.makedirs(path.parent)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = fileio.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fileio.write_all(fd, data)
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    fileio.replace(tmp, path)
    fileio.fsync_dir(path.parent)
