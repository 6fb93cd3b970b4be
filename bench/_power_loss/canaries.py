"""Canaries: builds with one sync removed, which the simulator must catch.

A canary compiles a function again from its own source with the one line that makes a sync removed
(replaced by `pass`, or the synchronous call in it by its plain form), and puts it in the function's
place while the trials run: the code under test is the real code minus that sync, nothing else. Three
are the targets of the power-loss benchmark (CANARIES); the others show that each case's properties can
fail (EXTRA).
"""
from __future__ import annotations

import contextlib
import inspect
import textwrap
from dataclasses import dataclass


def mutant(func, needle: str, occurrence: int | None = None, replacement: str | None = None):
    """`func` compiled from its source without the line containing `needle`: the only one, or the
    `occurrence`-th of several (Python indexing: -1 is the last); with `replacement`, that line keeps
    everything but the needle, which becomes `replacement`."""
    src = textwrap.dedent(inspect.getsource(func))
    lines = src.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if needle in line]
    if not hits or (occurrence is None and len(hits) != 1):
        raise AssertionError(f"{func.__qualname__}: {len(hits)} lines contain {needle!r}; a canary removes exactly one")
    i = hits[0 if occurrence is None else occurrence]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    if replacement is None:
        lines[i] = f"{indent}pass  # canary: {needle} removed\n"
    else:
        lines[i] = lines[i].rstrip("\n").replace(needle, replacement) + f"  # canary: {needle} -> {replacement}\n"
    ns: dict = {}
    exec(compile("".join(lines), inspect.getsourcefile(func), "exec"), func.__globals__, ns)  # noqa: S102
    return ns[func.__name__]


@dataclass(frozen=True)
class Canary:
    name: str
    what: str  # the sync removed, in words
    owner: str  # "module:attribute" or "module:Class.method": where the code under test looks the function up
    needle: str
    case: str  # the case whose default trials must catch it
    occurrence: int | None = None  # which of several lines with the needle (None: it must be the only one)
    replacement: str | None = None  # the needle replaced by this instead of its line removed

    def _target(self):
        import importlib

        mod_name, attr = self.owner.split(":")
        obj = importlib.import_module(mod_name)
        *path, name = attr.split(".")
        for part in path:
            obj = getattr(obj, part)
        return obj, name

    @contextlib.contextmanager
    def applied(self):
        """The build with the line removed, for the duration of the block."""
        obj, name = self._target()
        original = getattr(obj, name)
        setattr(obj, name, mutant(original, self.needle, self.occurrence, self.replacement))
        try:
            yield
        finally:
            setattr(obj, name, original)


def _direct_write_canary() -> Canary:
    """The RWF_DSYNC of the direct commit where the log sends it: the write function Log.commit hands
    wal/_commitc.c where that is built, else DirectWriter.write's call."""
    from wal import log

    what = "the RWF_DSYNC of the WAL commit's direct write (an O_DIRECT pwrite: sent, not flushed)"
    if log._commitc is not None:
        return Canary("wal_commit_direct_dsync", what, "wal.log:Log.commit", "_commitc.commit(self, fileio.pwrite_sync)",
                      "wal", replacement="_commitc.commit(self, fileio.pwrite)")
    return Canary("wal_commit_direct_dsync", what, "wal.direct:DirectWriter.write", "fileio.pwrite_sync(self.fd", "wal",
                  replacement="fileio.pwrite(self.fd")


CANARIES = (
    Canary("wal_commit_fdatasync", "the WAL commit's fdatasync (a commit within the preallocated reserve)",
           "wal.log:Log._flush", "fileio.fdatasync(self._fd)", "wal"),
    _direct_write_canary(),
    Canary("wal_segment_dir_fsync", "the directory fsync after a new segment is renamed into place (segment roll/create)",
           "wal.segments:create_segment", "fileio.fsync_dir(directory)", "wal"),
)

EXTRA = (
    Canary("snapshot_file_fsync", "the fsync of a synced file write (write_atomic's temp file: KV snapshots)",
           "core.fileio:write_file", "fsync(fd)", "snapshot"),
    Canary("shard_file_fsync", "the fsync of a synced file write (write_atomic's temp file: data-plane shards)",
           "core.fileio:write_file", "fsync(fd)", "dataplane"),
    Canary("makedirs_parent_fsync", "the parent fsync after each directory makedirs creates (data plane run directories)",
           "core.fileio:makedirs", "fsync_dir(d.parent)", "dataplane"),
    Canary("checkpoint_file_fsync", "the fsync of each checkpoint file before the directory is renamed into place",
           "learner.checkpoint:_fsync_tree", "fileio.sync_path(", "checkpoint"),
    Canary("envlog_commit_fdatasync", "the commit fdatasync, seen from the environment log",
           "wal.log:Log._flush", "fileio.fdatasync(self._fd)", "envlog"),
)
