"""wal: token-granular write-ahead log — record format, segments, group commit, recovery, retention,
gRPC log service; also the per-sandbox environment log.

    types.py      records (tokens, finalize, env invoke/result/release), EnvEntry, packed dtypes
    errors.py     GapError, ConflictError, FinalizedError, CorruptionError, LogClosedError, …
    codec.py      pure frame codec: length + CRC32C (a flush's first frame marked), encode/decode, segment header, token packing
    segments.py   segment files (preallocated, zero-filled; written through core.fileio), recovery scan (zero tail = clean end, torn last flush cut, corruption refused)
    log.py        Log: appends + leader/follower group commit + segment roll, poisoned on I/O error
    direct.py     DirectWriter: a commit's blocks written with O_DIRECT + RWF_DSYNC (else pwrite + fdatasync)
    _commitc.c    Log.commit's common case (a direct write into the reserve) in one C call; Python without it
    index.py      per-trajectory token index: contiguity, no rewrite, idempotent repeats, durable reads
    stepgroup.py  batched-decode fast path of the index: steps over the same trajectories kept as rows, merged on any other access
    _stepc.c      that fast path's step (check, STEP frame, row copy; the store's whole step for TokenWAL) and merge in C; Python without it
    envindex.py   per-sandbox environment index with the same rules
    store.py      Store: log + both indexes, replay on open, retention (reclaim / compaction)
    tombstones.py finalized ids whose finalize records retention reclaimed (finalized.log), so they stay finalized
    config.py     WALConfig (log) and ServeConfig (gRPC service)
    base.py       TokenLog: the interface of the in-process and remote logs
    tokenwal.py   TokenWAL: the in-process backend
    envlog.py     EnvLog: per-sandbox environment log (invoke/result/release, durable on return)
    verify.py     read-only scan for `postrain wal verify` / `dump`
    wal.proto     gRPC service; wal_pb2.py / wal_pb2_grpc.py are generated from it (grpcio-tools)
    grpc_poller.py  `grpc`, loaded with the poller that polls in the waiting thread (fewer thread wake-ups per step)
    server.py     gRPC log service (auth, bounded messages, streaming append with durable acks)
    sharded.py    ShardedWAL: one TokenLog over several services, shard = crc32(trajectory id) mod n
    client.py     RemoteWAL: TokenLog over gRPC (append stream on grpc.aio in the caller's thread), reconnects and retries idempotently
"""
from __future__ import annotations

from pathlib import Path

from wal.base import TokenLog
from wal.config import WALConfig
from wal.envlog import EnvLog
from wal.errors import (
    ConflictError,
    CorruptionError,
    FinalizedError,
    GapError,
    LockedError,
    LogClosedError,
    RemoteError,
    WALError,
)
from wal.tokenwal import TokenWAL
from wal.types import Committed, EnvEntry

__all__ = ["open", "open_envlog", "connect", "TokenLog", "TokenWAL", "EnvLog", "EnvEntry", "Committed", "WALConfig",
           "WALError", "GapError", "ConflictError", "FinalizedError", "CorruptionError", "LogClosedError",
           "LockedError", "RemoteError"]


def open(path: str | Path, config: WALConfig | None = None, *, repair: bool = False) -> TokenWAL:  # noqa: A001
    """Open (or create) the WAL directory `path`, recovering it first; see TokenWAL."""
    return TokenWAL(path, config, repair=repair)


def open_envlog(path: str | Path, config: WALConfig | None = None, *, repair: bool = False) -> EnvLog:
    """Open (or create) an environment log directory; see EnvLog."""
    return EnvLog(path, config, repair=repair)


def connect(address: str, token: str | None = None, **kwargs):
    """A TokenLog served by `postrain wal serve` at host:port (gRPC); see wal.client.RemoteWAL. Several
    comma-separated addresses: one log sharded over those services by trajectory id (wal.sharded)."""
    from wal.client import RemoteWAL
    from wal.sharded import ShardedWAL, parse_addresses

    addresses = parse_addresses(address)
    if len(addresses) == 1:
        return RemoteWAL(addresses[0], token=token, **kwargs)
    logs = []
    try:
        for a in addresses:
            logs.append(RemoteWAL(a, token=token, **kwargs))
    except BaseException:
        for log in logs:
            log.close()
        raise
    return ShardedWAL(logs)
