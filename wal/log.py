"""The log: segments plus group commit. Knows frames and lsns, not what records mean.

Group commit: `append_locked` only adds an encoded frame to an in-memory batch (under `mutex`);
`commit()` returns once everything appended before it is durable. Flushes take turns on one flush lock:
whoever holds it takes the whole pending batch, writes it and fdatasyncs once while others keep
appending; a committer that gets the lock next finds its records already durable (another flush took
them) or flushes what is pending now. A single writer pays no thread hand-off, N concurrent writers
share fsyncs, and a waiting committer costs one blocked lock acquire (no condition variable, no
notify: at 4 gRPC streams the notifications and wake-ups of a Condition were ~10% of the service's
GIL-held time).

Commit I/O: the segment is zero-filled ahead of the write position (`preallocate_bytes` at a time,
fsynced once), so a commit overwrites existing blocks and changes no metadata to journal. Such a commit
is one direct, synchronous write of the blocks it touches (wal/direct.py: O_DIRECT + RWF_DSYNC, durable
on return), or where the platform cannot, one `pwrite` of the joined batch then `fdatasync`. The direct
case with no roll is one C call where wal/_commitc.c is built (the same steps; anything else goes to
`_flush`). When the batch runs past the preallocated end, the next extent is zero-filled in the same
flush and a full `fsync` makes the new size durable too. A segment that reaches the cap is sealed and
the next one created (preallocated, see segments.py).

Spare segments (`spare_segments`, off by default): once a segment has grown past its first extent, a
helper thread zero-fills the next segment file whole (`segment_bytes`) off the commit path. A flush
whose batch would run past the reserve then rolls into the ready spare instead of growing the file
(header + fdatasync + rename: no zero-fill inline), and so does a roll at the cap; the sealed segment's
unused reserve is cut by the helper afterwards. Without a spare ready, commits grow the file as above.

Recycling (`recycle_segments`, on by default): a segment that retention reclaims whole, of at least
`segment_bytes`, becomes the spare instead of being deleted (segments.recycle), unless a spare is held
already: the log then moves on into blocks that exist, with no zeros written and no size change to
journal, once its reclaimed segments come round (as PostgreSQL renames old WAL segments into future ones).

A failed write or fsync poisons the log (after a failed fsync the kernel may have dropped the dirty
pages, so the durable state is unknown): every later call raises LogClosedError; reopen to recover.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import Callable

from core import fileio
from wal import codec, segments
from wal.direct import DirectWriter
from wal.errors import LockedError, LogClosedError
from wal.segments import ScanReport
from wal.types import Record

try:  # Log.commit in one C call (wal/_commitc.c); built by `pip install` where a compiler is, else the Python below
    from wal import _commitc
except ImportError:
    _commitc = None


class Log:
    # slots: the commit paths in C read and write these attributes on every step; a slot is a fixed offset in
    # the object, where an instance dict costs a hash lookup in memory the write's wait has cooled
    __slots__ = ("directory", "_lock_fd", "segment_bytes", "preallocate_bytes", "report", "_segments", "_fd", "_pos",
                 "_alloc", "_active_path", "_direct", "mutex", "_flush_lock", "_on_roll", "_batch", "_batch_bytes",
                 "_next_lsn", "_durable_lsn", "_error", "_closed", "fsyncs", "bytes_written", "spares_used",
                 "direct_writes", "segments_recycled", "recycle_segments", "_spare_lock", "_spare", "_spare_wanted",
                 "_trims", "_helper_stop", "_helper_wake", "_helper")

    def __init__(self, directory: str | Path, *, segment_bytes: int, on_record: Callable[[Record], None],
                 repair: bool = False, on_roll: Callable[[], None] | None = None, preallocate_bytes: int = 1 << 20,
                 spare_segments: bool = False, recycle_segments: bool = True, direct_io: bool = True):
        self.directory = Path(directory)
        if not self.directory.exists():
            fileio.makedirs(self.directory)
        elif not self.directory.is_dir():
            raise NotADirectoryError(f"WAL path {self.directory} exists and is not a directory")
        self._lock_fd = _lock_directory(self.directory)
        self.segment_bytes = segment_bytes
        self.preallocate_bytes = preallocate_bytes
        try:
            self.report: ScanReport = segments.scan(self.directory, on_record, mutate=True, repair=repair)
            self._segments = segments.list_segments(self.directory)
            if not self._segments:
                base = self.report.next_lsn
                self._fd = segments.create_segment(self.directory, base, self._first_extent())
                self._segments = [(base, self.directory / segments.segment_name(base))]
                self._pos = codec.SEGMENT_HEAD_BYTES
            else:
                self._fd = fileio.open(self._segments[-1][1], os.O_WRONLY)
                self._pos = self.report.tail_offset
            fileio.fsync(self._fd)  # what a killed writer left in the page cache becomes durable before we build on it
            self._alloc = os.fstat(self._fd).st_size  # zero-filled and durable up to here
            if self._pos > self._alloc or self._pos < codec.SEGMENT_HEAD_BYTES:
                raise AssertionError(f"WAL {self.directory}: write position {self._pos} outside the segment ({self._alloc} bytes)")
            self._active_path = self._segments[-1][1]
            # None: commits through the page cache (switched off, no reserve to write into, or not available here)
            self._direct = DirectWriter.open(self._active_path, self._pos) if direct_io and preallocate_bytes > 0 else None
        except BaseException:
            if getattr(self, "_fd", None) is not None:
                fileio.close(self._fd)
            fileio.close(self._lock_fd)
            raise
        self.mutex = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time
        self._on_roll = on_roll
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._next_lsn = self.report.next_lsn
        self._durable_lsn = self._next_lsn - 1
        self._error: BaseException | None = None
        self._closed = False
        self.fsyncs = 0
        self.bytes_written = 0
        self.spares_used = 0
        self.direct_writes = 0  # flushes written by the DirectWriter
        self.segments_recycled = 0
        self.recycle_segments = recycle_segments
        # the spare segment and the sealed segments still to trim, handed over under _spare_lock
        self._spare_lock = threading.Lock()
        self._spare: tuple[int, int, str] | None = None  # (fd, size, file name) of a ready spare
        self._spare_wanted = False
        self._trims: list[tuple[Path, int]] = []
        self._helper_stop = False
        self._helper_wake = threading.Event()
        self._helper = None
        if spare_segments and preallocate_bytes > 0:
            self._helper = threading.Thread(target=self._helper_loop, name=f"wal-spare:{self.directory}", daemon=True)
            self._helper.start()

    # --- appending (caller holds `mutex`) ---
    def append_locked(self, encode: Callable[..., bytes | None], *args) -> int | None:
        """Add encode(*args, lsn, mark) to the batch and return its lsn; mark is codec.FLUSH_MARK for the
        first frame of a batch (the next flush takes the whole batch, so that frame starts a flush), else 0.
        An encode that returns None adds nothing, and so returns None. `args` spare a per-step path (a
        batched decode's rows) a closure per call."""
        self.check_open()
        lsn = self._next_lsn
        frame = encode(*args, lsn, 0 if self._batch else codec.FLUSH_MARK)
        if frame is None:
            return None
        self._batch.append(frame)
        self._batch_bytes += len(frame)
        self._next_lsn = lsn + 1
        return lsn

    def check_failed(self) -> bool:
        """Whether check_open would raise (a poisoned or closed log)."""
        return self._error is not None or self._closed

    def check_open(self) -> None:
        if self._error is not None:
            raise LogClosedError(f"WAL {self.directory} failed a write or fsync ({self._error}); reopen it to recover")
        if self._closed:
            raise LogClosedError(f"WAL {self.directory} is closed")

    @property
    def batch_bytes(self) -> int:
        return self._batch_bytes

    @property
    def durable_lsn(self) -> int:
        """Every record with lsn <= this is on disk (-1: none yet)."""
        return self._durable_lsn

    @property
    def next_lsn(self) -> int:
        return self._next_lsn

    # --- group commit ---
    def commit(self, upto: int | None = None) -> int:
        """Block until every record appended before this call (or up to lsn `upto`) is durable."""
        if upto is None and _commitc is not None:  # the same steps in C (wal/_commitc.c); None: not its case
            durable = _commitc.commit(self, fileio.pwrite_sync)
            if durable is not None:
                return durable
        # Read without the mutex: each read is of one int, and the durable lsn only grows, so a durable lsn
        # seen at or past the target stays so (a stale one only sends us to the flush lock below).
        target = self._next_lsn - 1 if upto is None else upto
        durable = self._durable_lsn
        if durable >= target:
            return durable
        with self._flush_lock:
            with self.mutex:
                if self._durable_lsn >= target:  # the flush before ours took our records
                    return self._durable_lsn
                self.check_open()
                frames, self._batch, self._batch_bytes = self._batch, [], 0
                last = self._next_lsn - 1
            self._flush(frames, last)
            return last

    def _flush(self, frames: list[bytes], last: int) -> None:
        """Write and sync frames ..last (holding the flush lock, not the mutex: appends go on meanwhile)."""
        first = last - len(frames) + 1
        rolled: list[tuple[int, Path]] = []
        try:
            data = b"".join(frames)
            if self._pos + len(data) > self._alloc and self._pos > codec.SEGMENT_HEAD_BYTES and self._spare is not None:
                rolled.append(self._roll(first))  # the reserve ran out and the next segment is ready: start it
            end = self._pos + len(data)
            direct, written = self._direct, False
            if direct is not None and direct.fits(self._pos, len(data), self._alloc):  # preallocated blocks only
                written = direct.write(data, self._pos)  # written and flushed in one call
                if written:
                    self.direct_writes += 1
                else:  # refused by the file system: the page cache from now on
                    self._stop_direct()
            if not written:
                fileio.pwrite_all(self._fd, data, self._pos)
                if end <= self._alloc:
                    fileio.fdatasync(self._fd)  # overwrote preallocated blocks: data only, no size change
                else:  # past the preallocated end: reserve the next extent in the same flush, size made durable
                    alloc = max(end, min(end + self.preallocate_bytes, self.segment_bytes))
                    segments.zero_fill(self._fd, end, alloc)
                    fileio.fsync(self._fd)
                    self._alloc = alloc
                    self._want_spare()
                if self._direct is not None:
                    self._direct.wrote(data, self._pos)
            self._pos = end
            if end >= self.segment_bytes:
                rolled.append(self._roll(last + 1))
        except BaseException as exc:
            self._flush_failed(exc)
        with self.mutex:
            self.fsyncs += 1
            self.bytes_written += len(data)
            self._segments.extend(rolled)
            self._durable_lsn = last
        if rolled and self._on_roll is not None:
            self._on_roll()

    def _flush_failed(self, exc: BaseException) -> None:
        """A flush failed past the point where its batch was taken: poison the log and raise."""
        with self.mutex:
            self._error = exc
        raise LogClosedError(f"WAL {self.directory}: write/fsync failed: {exc}") from exc

    def _roll(self, base: int) -> tuple[int, Path]:
        """Seal the active segment at the write position and start the segment `base` (holding the flush
        lock, not the mutex): the ready spare when there is one, else a new file built inline."""
        old_fd, old_end, old_alloc, old_path = self._fd, self._pos, self._alloc, self._active_path
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is None:
            if old_alloc > old_end:  # drop the unused reserve, durably, before the next segment exists
                fileio.ftruncate(old_fd, old_end)
                fileio.fsync(old_fd)
            fd = segments.create_segment(self.directory, base, self._first_extent())
            alloc = os.fstat(fd).st_size
        else:
            fd, alloc, name = spare
            try:
                segments.activate_spare(self.directory, fd, base, name)
            except BaseException:
                fileio.close(fd)
                raise
            self.spares_used += 1
            if self._helper is not None:  # else the sealed segment keeps its reserve (recovery accepts it)
                with self._spare_lock:
                    if old_alloc > old_end:
                        self._trims.append((old_path, old_end))
                self._helper_wake.set()  # trim the sealed segment, build the next spare
        fileio.close(old_fd)
        self._fd, self._pos, self._alloc = fd, codec.SEGMENT_HEAD_BYTES, alloc
        self._active_path = self.directory / segments.segment_name(base)
        if self._direct is not None:
            self._direct.close()
            self._direct = DirectWriter.open(self._active_path, self._pos)
        return base, self._active_path

    def _stop_direct(self) -> None:
        """The file system refused a direct write: commits go through the page cache from now on."""
        logging.getLogger("wal").warning("WAL %s: direct writes refused; committing with pwrite + fdatasync", self.directory)
        self._direct.close()
        self._direct = None

    # --- the helper thread: spare segments and trims, off the commit path ---
    def _want_spare(self) -> None:
        if self._helper is not None and not self._spare_wanted:
            self._spare_wanted = True
            self._helper_wake.set()

    def _helper_loop(self) -> None:
        while True:
            self._helper_wake.wait()
            self._helper_wake.clear()
            with self._spare_lock:
                trims, self._trims = self._trims, []
                build = self._spare_wanted and self._spare is None and not self._helper_stop
            for path, size in trims:
                try:
                    segments.trim(path, size)
                except OSError as exc:  # recovery trims it on the next open
                    logging.getLogger("wal").warning("could not trim sealed segment %s: %s", path, exc)
            if build:
                try:
                    fd = segments.build_spare(self.directory, self.segment_bytes)
                except OSError as exc:  # commits grow the segment inline instead
                    logging.getLogger("wal").warning("could not prepare a spare segment in %s: %s", self.directory, exc)
                    with self._spare_lock:
                        self._spare_wanted = False
                    continue
                with self._spare_lock:
                    if not self._helper_stop and self._spare is None:
                        self._spare, fd = (fd, self.segment_bytes, segments.SPARE_NAME), None
                if fd is not None:  # stopping, or a recycled segment became the spare meanwhile
                    _drop_spare(self.directory, fd)
            with self._spare_lock:
                if self._helper_stop and not self._trims:
                    return

    def _first_extent(self) -> int:
        """Size of a new segment file: header plus the first preallocated extent, within the cap."""
        return min(codec.SEGMENT_HEAD_BYTES + self.preallocate_bytes, max(self.segment_bytes, 0))

    # --- segments (retention) ---
    def sealed_segments(self) -> list[tuple[int, Path]]:
        """Segments no longer written to, oldest first (caller holds `mutex`)."""
        return list(self._segments[:-1])

    def segment_list(self) -> list[tuple[int, Path]]:
        return list(self._segments)

    def delete_oldest(self, base: int) -> None:
        """Remove the oldest sealed segment (its live records were copied forward and committed), or keep
        its file as the spare (`recycle_segments`)."""
        with self.mutex:
            self.check_open()
            if len(self._segments) < 2 or self._segments[0][0] != base:
                raise AssertionError(f"segment {base} is not the oldest sealed segment")
            path = self._segments.pop(0)[1]
        if self._recycle(path):
            return
        fileio.unlink(path)
        fileio.fsync_dir(self.directory)

    def _recycle(self, path: Path) -> bool:
        """Make a reclaimed segment the spare when none is held and it is full size; False: delete it."""
        if not self.recycle_segments or self.preallocate_bytes == 0:
            return False
        with self._spare_lock:
            if self._spare is not None or self._helper_stop or self._closed:
                return False
        size = path.stat().st_size
        if size < self.segment_bytes:
            return False
        fd, name = segments.recycle(self.directory, path)
        with self._spare_lock:
            if self._spare is None and not self._helper_stop and not self._closed:
                self._spare, fd = (fd, size, name), None
                self.segments_recycled += 1
        if fd is not None:  # a spare appeared, or the log closed, meanwhile
            _drop_spare(self.directory, fd, name)
        return True

    def disk_bytes(self) -> int:
        """Bytes of the segment files and of a spare held (built ahead, or a recycled segment)."""
        with self._spare_lock:
            spare = self._spare
        total = spare[1] if spare is not None else 0
        for _, p in self.segment_list():
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._error is None:
                self.commit()
        finally:
            with self._flush_lock:  # no flush running; later commits find the log closed
                with self.mutex:
                    self._closed = True
            self._stop_helper()
            if self._direct is not None:
                self._direct.close()
            fileio.close(self._fd)
            fileio.close(self._lock_fd)

    def _stop_helper(self) -> None:
        """Finish pending trims, then drop the spare (open would delete it anyway)."""
        with self._spare_lock:
            self._helper_stop = True
        if self._helper is not None:
            self._helper_wake.set()
            self._helper.join()
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            _drop_spare(self.directory, spare[0], spare[2])


def _drop_spare(directory: Path, fd: int, name: str = segments.SPARE_NAME) -> None:
    fileio.close(fd)
    try:
        fileio.unlink(directory / name)
    except FileNotFoundError:
        pass


def _lock_directory(directory: Path) -> int:
    fd = fileio.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fileio.close(fd)
        raise LockedError(f"WAL directory {directory} is open in another process (close it, or use that process's service)") from None
    return fd
