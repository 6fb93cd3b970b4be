"""The file operations every durable write goes through: open, write, pwrite, pwrite_sync, fsync,
fdatasync, ftruncate, fallocate, sync_file_range, rename, replace, exchange, unlink, mkdir, rmdir and
directory fsync.

By default each name is the `os` function itself (or a few lines around one), so a call costs what
the `os` call costs. Callers look the names up at call time (`fileio.pwrite(...)`, never
`from core.fileio import pwrite`), so `using(backend)` can put another implementation in their
place for a while: `core.powercut` records every operation and builds the on-disk states that a
power cut could leave. Reads (mmap, read, stat, scandir) are not part of the layer; they see the
real files.

The helpers below the primitives (pwrite_all, write_all, sync_path, makedirs, write_file, rmtree) are
made of primitives only, so they follow the installed backend too.
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


def _fsync_dir(path) -> None:
    """fsync of a directory: makes the names created, renamed or removed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fallocate(fd: int, offset: int, length: int) -> None:
    os.posix_fallocate(fd, offset, length)


def _load_sync_file_range():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, ImportError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()  # Linux; elsewhere the caller's final fsync writes everything
_SFR_WAIT_WRITE_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER


def _sync_file_range(fd: int, offset: int, nbytes: int) -> None:
    """Start writing back [offset, offset + nbytes) and wait for it: no flush of the device, no
    metadata, so nothing becomes durable by it. Best effort: errors surface at the caller's fsync."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SFR_WAIT_WRITE_WAIT)


def _load_renameat2():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, ImportError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RWF_DSYNC = getattr(os, "RWF_DSYNC", None)  # Linux >= 4.7 with Python's os.pwritev flags


def _pwrite_sync(fd: int, data, offset: int) -> int:
    """pwrite whose bytes are durable when it returns, as pwrite + fdatasync would make them: one
    pwritev2(RWF_DSYNC) where the platform has it (the write and the flush of its range in one call; on an
    O_DIRECT descriptor over allocated blocks, a FUA write or a single device flush), else the two calls.
    Returns the bytes written (a short count leaves the rest unwritten and nothing promised for it)."""
    if _RWF_DSYNC is not None:
        return os.pwritev(fd, [data], offset, _RWF_DSYNC)
    n = os.pwrite(fd, data, offset)
    getattr(os, "fdatasync", os.fsync)(fd)
    return n


_RENAMEAT2 = _load_renameat2()  # glibc >= 2.28 on Linux >= 3.15
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a, b) -> None:
    """Swap two existing names atomically (renameat2 RENAME_EXCHANGE): a crash leaves each name with
    its old or its new inode, never without one. OSError (ENOSYS, EINVAL) where the platform or the
    filesystem cannot."""
    import ctypes

    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


# --- the primitives (module attributes, replaced by `install`) ---
open = os.open  # noqa: A001  (path, flags, mode=0o777) -> fd
close = os.close
write = os.write  # (fd, data) -> bytes written
pwrite = os.pwrite  # (fd, data, offset) -> bytes written
pwrite_sync = _pwrite_sync  # (fd, data, offset) -> bytes written, durable on return
fsync = os.fsync
fdatasync = getattr(os, "fdatasync", os.fsync)
ftruncate = os.ftruncate
fallocate = _fallocate  # (fd, offset, length)
sync_file_range = _sync_file_range  # (fd, offset, nbytes)
rename = os.rename
replace = os.replace
exchange = _exchange  # (a, b): swap two names atomically
unlink = os.unlink
mkdir = os.mkdir  # (path, mode=0o777)
rmdir = os.rmdir
fsync_dir = _fsync_dir  # (path)

OPS = ("open", "close", "write", "pwrite", "pwrite_sync", "fsync", "fdatasync", "ftruncate", "fallocate", "sync_file_range",
       "rename", "replace", "exchange", "unlink", "mkdir", "rmdir", "fsync_dir")
DEFAULT = {name: globals()[name] for name in OPS}


def install(backend) -> dict:
    """Make `backend`'s methods (an object with every name of OPS, or a dict) the layer's operations;
    returns the operations they replace (pass them back to restore)."""
    get = backend.__getitem__ if isinstance(backend, dict) else lambda name: getattr(backend, name)
    new = {name: get(name) for name in OPS}
    g = globals()
    old = {name: g[name] for name in OPS}
    g.update(new)
    return old


@contextlib.contextmanager
def using(backend):
    """Run the block with `backend` as the I/O layer (process-wide: every thread sees it)."""
    old = install(backend)
    try:
        yield backend
    finally:
        install(old)


# --- helpers made of primitives ---
def pwrite_all(fd: int, data, offset: int) -> None:
    n = pwrite(fd, data, offset)
    if n == len(data):  # the common case: one call
        return
    view, offset = memoryview(data)[n:], offset + n
    while view:
        n = pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[write(fd, view):]


def sync_path(path) -> None:
    """fsync a file written by someone else (a library that wrote it by path)."""
    fd = open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        close(fd)


def makedirs(path, mode: int = 0o777) -> None:
    """mkdir -p, durably: each directory created is made durable in its parent (fsync of the parent),
    so a file later made durable inside it cannot lose its path to a power cut."""
    path = Path(path)
    if path.is_dir():
        return
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for d in reversed(missing):
        try:
            mkdir(d, mode)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # made by someone else meanwhile; they make it durable
        fsync_dir(d.parent)


def write_file(path, data, *, sync: bool = False) -> None:
    """Create or replace `path` with `data`; with sync, fsync it before closing. Its name is durable only
    once the directory is fsynced."""
    fd = open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        if sync:
            fsync(fd)
    finally:
        close(fd)


def rmtree(path) -> None:
    """Remove a directory tree (not durable by itself: fsync the parent afterwards)."""
    for dirpath, dirs, files in os.walk(path, topdown=False):
        for name in files:
            unlink(os.path.join(dirpath, name))
        for name in dirs:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                unlink(full)
            else:
                rmdir(full)
    rmdir(path)
