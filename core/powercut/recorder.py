"""Recorder: a `core.fileio` backend that does every operation for real and logs it for the disk model.

Paths under `root` are tracked; anything else passes straight through. The live files are real (in a
tmpfs when the caller picks one), so the code under test reads, maps and stats them as usual; the log
holds what a replay needs to build crash images at any point (`ops`), and `mark(obj)` puts the
caller's acknowledgements between the operations (`marks`: (number of operations before it, obj)).

What existed under `root` when recording started is durable. Files and directories that a library
wrote by itself (safetensors, torch.save) enter the model when the layer first touches them (a sync
by path, an fsync of their directory, a rename): created and written then, not yet synced.
"""
from __future__ import annotations

import os
import threading

from core import fileio
from core.powercut.disk import Disk


class OutsideLayerError(AssertionError):
    """A tracked file was written or synced through a descriptor the layer did not open."""


class Recorder:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self._real_root = os.path.realpath(self.root)  # what /proc/self/fd links name
        self.disk = Disk(track_live=True)
        self.ops: list[tuple] = []
        self.marks: list[tuple[int, object]] = []
        self._lock = threading.RLock()
        self._fds: dict[int, list] = {}  # fd -> [ino, position]
        self._next_ino = 1
        self._adopt_tree(0, self.root)
        self._log(("syncall",))
        self.start = len(self.ops)  # cuts before this would lose what existed before recording

    # --- bookkeeping ---
    def mark(self, obj) -> None:
        """Note an acknowledgement (or an intent) at this point of the operation log."""
        with self._lock:
            self.marks.append((len(self.ops), obj))

    def _log(self, op: tuple) -> None:
        self.disk.apply(op)
        self.ops.append(op)

    def _new(self, parent: int, name: str, is_dir: bool) -> int:
        ino = self._next_ino
        self._next_ino += 1
        self._log(("create", parent, name, ino, is_dir))
        return ino

    def _adopt(self, parent: int, name: str, real: str) -> int | None:
        """Enter a file or directory that exists on disk but not in the model (written by a library)."""
        if os.path.isdir(real) and not os.path.islink(real):
            return self._new(parent, name, True)
        if not os.path.isfile(real):
            return None
        ino = self._new(parent, name, False)
        with open(real, "rb") as f:
            data = f.read()
        if data:
            self._log(self.disk.sectors_after_write(ino, 0, data))
        return ino

    def _adopt_tree(self, ino: int, real: str) -> None:
        for entry in sorted(os.scandir(real), key=lambda e: e.name):
            child = self._adopt(ino, entry.name, entry.path)
            if child is not None and self.disk.is_dir(child):
                self._adopt_tree(child, entry.path)

    def _reconcile(self, ino: int, real: str) -> None:
        """Bring a directory's names in the model in line with the disk (a library's creations)."""
        live = self.disk.dirs[ino].live
        names = set()
        for entry in sorted(os.scandir(real), key=lambda e: e.name):
            names.add(entry.name)
            if entry.name not in live:
                self._adopt(ino, entry.name, entry.path)
        for gone in sorted(set(live) - names):
            self._log(("unlink", ino, gone))

    def _split(self, path) -> tuple[int, str, str] | None:
        """(parent inode, name, real path) of a tracked path, or None outside the root."""
        real = os.path.abspath(os.fspath(path))
        rel = os.path.relpath(real, self.root)
        if rel == "." or rel == ".." or rel.startswith(".." + os.sep):
            return None
        parts = rel.split(os.sep)
        ino, where = 0, self.root
        for part in parts[:-1]:
            where = os.path.join(where, part)
            child = self._child(ino, part, where)
            if child is None or not self.disk.is_dir(child):
                raise FileNotFoundError(2, "no such directory", where)
            ino = child
        return ino, parts[-1], real

    def _child(self, parent: int, name: str, real: str) -> int | None:
        ino = self.disk.dirs[parent].live.get(name)
        if ino is None and os.path.lexists(real):
            ino = self._adopt(parent, name, real)
        return ino

    def _dir_ino(self, path) -> tuple[int | None, str]:
        real = os.path.abspath(os.fspath(path))
        if real == self.root:
            return 0, real
        where = self._split(real)
        if where is None:
            return None, real
        return self._child(where[0], where[1], real), real

    def _tracked_fd(self, fd: int):
        entry = self._fds.get(fd)
        if entry is None:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return None
            if target == self._real_root or target.startswith(self._real_root + os.sep):
                raise OutsideLayerError(f"{target} is written or synced through fd {fd}, which core.fileio did not open")
        return entry

    # --- the fileio operations ---
    def open(self, path, flags: int, mode: int = 0o777) -> int:  # noqa: A003
        with self._lock:
            where = self._split(path)
            if where is None:
                return os.open(path, flags, mode)
            parent, name, real = where
            ino = self._child(parent, name, real)
            fd = os.open(path, flags, mode)
            if ino is None:
                ino = self._new(parent, name, False)
            elif flags & os.O_TRUNC and not self.disk.is_dir(ino) and self.disk.size(ino):
                self._log(("trunc", ino, 0))
            self._fds[fd] = [ino, 0, bool(flags & os.O_APPEND)]
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            os.close(fd)
            self._fds.pop(fd, None)

    def write(self, fd: int, data) -> int:
        with self._lock:
            n = os.write(fd, data)
            entry = self._tracked_fd(fd)
            if entry is not None and n:
                ino, pos, append = entry
                off = self.disk.size(ino) if append else pos
                self._log(self.disk.sectors_after_write(ino, off, memoryview(data)[:n]))
                entry[1] = off + n
            return n

    def pwrite(self, fd: int, data, offset: int) -> int:
        with self._lock:
            n = os.pwrite(fd, data, offset)
            entry = self._tracked_fd(fd)
            if entry is not None and n:
                self._log(self.disk.sectors_after_write(entry[0], offset, memoryview(data)[:n]))
            return n

    def pwrite_sync(self, fd: int, data, offset: int) -> int:
        """A write durable on return: the write, then the file's sync. Exact only where the file has no
        other unsynced operation (the sync would make those durable too, which a ranged sync does not):
        refused otherwise, before anything is written."""
        with self._lock:
            entry = self._tracked_fd(fd)
            if entry is not None and self.disk.pending(entry[0]):
                raise NotImplementedError(f"pwrite_sync on fd {fd} over unsynced operations of the same file is not modelled")
            n = fileio.DEFAULT["pwrite_sync"](fd, data, offset)
            if entry is not None and n:
                self._log(self.disk.sectors_after_write(entry[0], offset, memoryview(data)[:n]))
                self._log(("sync", entry[0]))
            return n

    def fsync(self, fd: int) -> None:
        with self._lock:
            os.fsync(fd)
            entry = self._tracked_fd(fd)
            if entry is not None:
                self._log(("sync", entry[0]))

    fdatasync = fsync  # data and size: the model's durable state of a file is just that

    def ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            os.ftruncate(fd, size)
            entry = self._tracked_fd(fd)
            if entry is not None:
                self._log(("trunc", entry[0], size))

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        with self._lock:
            os.posix_fallocate(fd, offset, length)
            entry = self._tracked_fd(fd)
            if entry is not None and offset + length > self.disk.size(entry[0]):
                self._log(("trunc", entry[0], offset + length))  # a larger size, reading zeros

    def sync_file_range(self, fd: int, offset: int, nbytes: int) -> None:
        with self._lock:
            self._tracked_fd(fd)
            fileio.DEFAULT["sync_file_range"](fd, offset, nbytes)  # write-back only: nothing becomes durable

    def rename(self, src, dst) -> None:
        with self._lock:
            s, d = self._split(src), self._split(dst)
            if s is None and d is None:
                return os.rename(src, dst)
            if s is None or d is None or s[0] != d[0]:
                raise NotImplementedError(f"rename {src} -> {dst}: only renames within one tracked directory are modelled")
            ino = self._child(s[0], s[1], s[2])
            os.rename(src, dst)
            if self.disk.is_dir(ino):
                self._reconcile(ino, d[2])
            self._log(("rename", s[0], s[1], d[1]))

    replace = rename

    def exchange(self, a, b) -> None:
        with self._lock:
            s, d = self._split(a), self._split(b)
            if s is None and d is None:
                return fileio.DEFAULT["exchange"](a, b)
            if s is None or d is None or s[0] != d[0]:
                raise NotImplementedError(f"exchange {a} <-> {b}: only exchanges within one tracked directory are modelled")
            ino_a, ino_b = self._child(s[0], s[1], s[2]), self._child(d[0], d[1], d[2])
            fileio.DEFAULT["exchange"](a, b)
            for ino, real in ((ino_a, d[2]), (ino_b, s[2])):
                if ino is not None and self.disk.is_dir(ino):
                    self._reconcile(ino, real)
            self._log(("exchange", s[0], s[1], d[1]))

    def unlink(self, path) -> None:
        with self._lock:
            where = self._split(path)
            if where is not None:
                self._child(where[0], where[1], where[2])
            os.unlink(path)
            if where is not None and where[1] in self.disk.dirs[where[0]].live:
                self._log(("unlink", where[0], where[1]))

    def rmdir(self, path) -> None:
        with self._lock:
            where = self._split(path)
            os.rmdir(path)
            if where is not None and where[1] in self.disk.dirs[where[0]].live:
                self._log(("unlink", where[0], where[1]))

    def mkdir(self, path, mode: int = 0o777) -> None:
        with self._lock:
            where = self._split(path)
            os.mkdir(path, mode)
            if where is not None:
                self._new(where[0], where[1], True)

    def fsync_dir(self, path) -> None:
        with self._lock:
            ino, real = self._dir_ino(path)
            fileio.DEFAULT["fsync_dir"](real)
            if ino is not None:
                self._reconcile(ino, real)
                self._log(("sync", ino))
