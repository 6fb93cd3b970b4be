"""Heavy-field store: immutable Arrow IPC shard files under a root (local path or `pyarrow.fs` URI),
written atomically (temp, fsync, rename, fsync dir), checksummed (crc32c of the file), and read back
memory-mapped and zero-copy where the filesystem is local.

On a local root every write, directory creation and delete goes through `core.fileio` (so the
power-cut simulator sees it); remote filesystems through `dataplane.remote` (temp key, then a move
onto the name: they have no fsync to get wrong). A `file://` URI is local: memory-mapped and fsynced."""
from __future__ import annotations

import mmap
import os
import re
import uuid
from contextlib import contextmanager
from pathlib import Path

import google_crc32c
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc

from core import fileio
from core.atomic import write_atomic
from dataplane.errors import ChecksumError, DataPlaneError, ShardMissingError
from dataplane.remote import RemoteStore, is_uri


class MappedShard:
    """An open shard: its record batch (views of the map) and the map itself."""

    def __init__(self, path: str, mm: mmap.mmap | None, source, batch: pa.RecordBatch, file=None, address: int = 0):
        self.path, self.mm, self.source, self.batch = path, mm, source, batch
        self.file = file  # local shards: the open file, for `pread` into caller buffers
        self.address = address  # of the file's byte 0 in the map

    def file_offset(self, view) -> int:
        """Byte offset in the file of a numpy view of this shard's map."""
        return view.__array_interface__["data"][0] - self.address

    def drop_pages(self) -> None:
        """Unmap this process's pages of the file (the page cache keeps them): bounds RSS while open."""
        if self.mm is not None:
            self.mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.batch = None
        self.source.close()
        self.source = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view escaped; the map closes when the last view is collected
                pass
            self.mm = None


class ShardStore:
    """Shards live at `<root>/<relative path>`; the catalog stores only relative paths, so a store can move."""

    def __init__(self, root: str | os.PathLike, filesystem: pafs.FileSystem | None = None, use_mmap: bool = True,
                 create: bool = True):
        """`create=False` (a reader: stats, plans) leaves a missing root missing; its shards then fail to read."""
        root = str(root)
        if filesystem is not None or is_uri(root):
            self.remote = RemoteStore(root, filesystem)
            self.fs, self.base = self.remote.fs, self.remote.base
        else:
            self.fs, self.base = pafs.LocalFileSystem(), str(Path(root).resolve())
        self.root = root
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.use_mmap = use_mmap and self.local
        if create and self.local:
            fileio.makedirs(self.base)
        elif create:
            self.fs.create_dir(self.base, recursive=True)

    def full_path(self, rel: str) -> str:
        """Where the shard (or shard directory) `rel` of the catalog lives. A catalog row is data: a path that
        could name anything outside the store's `shards/` (absolute, `..`, empty parts) is refused."""
        parts = rel.split("/") if isinstance(rel, str) else []
        if len(parts) < 2 or parts[0] != "shards" or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
            raise DataPlaneError(f"shard path {rel!r} is not a path under the store's shards/ directory")
        return f"{self.base}/{rel}"

    @staticmethod
    def new_path(run: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:64].strip(".") or "run"
        return f"shards/{safe}/{uuid.uuid4().hex}.arrow"

    # -- write ---------------------------------------------------------------------------------------
    def write(self, rel: str, batch: pa.RecordBatch) -> tuple[int, int]:
        """Write one record batch as an IPC file, durably; returns (bytes, crc32c of the file)."""
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        buf = sink.getvalue()
        crc = int(google_crc32c.value(buf))
        if self.local:  # its directories created durably, the shard durable before its name appears
            write_atomic(Path(self.full_path(rel)), buf)
        else:  # object stores have no fsync; a completed upload followed by a move is their commit
            self.remote.put(rel, buf)
        return buf.size, crc

    # -- read ----------------------------------------------------------------------------------------
    def map(self, rel: str, who: str = "") -> MappedShard:
        """Open a shard: memory-mapped (zero-copy) on local disks, else read through pyarrow.fs."""
        path = self.full_path(rel)
        what = f"shard file {path}" + (f" (needed by {who})" if who else "")
        mm = f = None
        address = 0
        try:
            if self.use_mmap:
                # Python's mmap, not pa.memory_map: Arrow advises WILLNEED on every read of a map, which
                # costs ~1 ms per shard opened; and Python's map can drop its pages (MADV_DONTNEED).
                # The file stays open: the loader `pread`s heavy ranges into its own buffers.
                f = open(path, "rb", buffering=0)
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                whole = pa.py_buffer(mm)
                address = whole.address
                source = pa.BufferReader(whole)
            else:
                source = self.fs.open_input_file(path)
        except FileNotFoundError:
            raise ShardMissingError(f"{what} does not exist: deleted, moved, or wrong store root "
                                    f"{self.root!r}?") from None
        except ValueError as exc:  # mmap of an empty file
            f.close()
            raise ChecksumError(f"{what} is not a readable shard (corrupt or truncated): {exc}") from None
        try:
            reader = ipc.open_file(source)
            if reader.num_record_batches != 1:
                raise pa.ArrowInvalid(f"{reader.num_record_batches} record batches, expected 1")
            batch = reader.get_batch(0)
        except (pa.ArrowException, OSError) as exc:  # any Arrow error: a damaged footer raises several kinds
            source.close()
            if f is not None:
                f.close()
            raise ChecksumError(f"{what} is not a readable shard (corrupt or truncated): {exc}") from None
        return MappedShard(path, mm, source, batch, f, address)

    @contextmanager
    def open(self, rel: str, who: str = ""):
        """Yield the shard's record batch. Everything that views it must be dropped before the context
        ends: the map is closed then."""
        shard = self.map(rel, who)
        try:
            yield shard.batch
        finally:
            shard.close()

    def checksum(self, rel: str) -> int:
        path = self.full_path(rel)
        try:
            with self.fs.open_input_file(path) as f:
                crc = 0
                while chunk := f.read(64 << 20):
                    crc = google_crc32c.extend(crc, chunk)
                return int(crc)
        except FileNotFoundError:
            raise ShardMissingError(f"shard file {path} does not exist") from None

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.full_path(rel)).type == pafs.FileType.File

    def delete(self, rel: str) -> None:
        try:
            if self.local:
                fileio.unlink(self.full_path(rel))
            else:
                self.fs.delete_file(self.full_path(rel))
        except FileNotFoundError:
            pass

    def list(self) -> list[str]:
        """Relative paths of every shard file (temp files of interrupted writes excluded)."""
        sel = pafs.FileSelector(f"{self.base}/shards", recursive=True, allow_not_found=True)
        n = len(self.base) + 1
        return sorted(i.path[n:] for i in self.fs.get_file_info(sel)
                      if i.type == pafs.FileType.File and i.path.endswith(".arrow") and not i.base_name.startswith("."))
