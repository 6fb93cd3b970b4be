"""Errors of the WAL. Operating errors a caller is expected to handle; each message names the thing."""
from __future__ import annotations


class WALError(Exception):
    """Base of every WAL error."""


class GapError(WALError, ValueError):
    """An append would leave a hole: its start is past the trajectory's end (or a seq skips ahead)."""


class ConflictError(WALError, ValueError):
    """An append rewrites a recorded position with different content (this is what forbids re-sampling)."""


class FinalizedError(WALError):
    """The trajectory was finalized: it is in the data plane and takes no more appends."""


class CorruptionError(WALError):
    """A bad record is followed by valid ones: committed data is damaged. Open with repair=True to cut there."""


class LogClosedError(WALError):
    """The log was closed, or poisoned by a failed write/fsync (the durable state is then unknown)."""


class LockedError(WALError):
    """Another process has the WAL directory open."""


class RemoteError(WALError):
    """The gRPC log service failed a request for a reason other than the ones above."""
