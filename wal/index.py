"""In-memory per-trajectory token index (pure; the caller holds the log's mutex).

Each live trajectory keeps its tokens and log-probs packed (chunks of bytes, no per-token objects), its
policy versions as runs, and the lsns of its records that are not yet durable: reads return the
durable prefix only, so nothing is exposed before it is committed.

The append rule: positions are contiguous from 0. A start past the end is a gap (GapError); an
overlap with recorded positions must repeat them exactly (tokens, log-probs and policy version) or
it is a rewrite (ConflictError); the part of an append that is an exact repeat is acknowledged and
not written again, so a retried append never duplicates.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque

import numpy as np

from wal.errors import ConflictError, FinalizedError, GapError
from wal.types import LOGPROB_BYTES, LOGPROB_DTYPE, TOKEN_BYTES, TOKEN_DTYPE


MERGE_CHUNKS = 64


class Trajectory:
    """Tokens and log-probs as lists of packed chunks (appending never copies what is already held;
    a read joins them once and keeps the joined chunk)."""

    __slots__ = ("tok_chunks", "lp_chunks", "chunk_starts", "length", "version_runs", "pending", "durable_len", "unmerged")

    def __init__(self) -> None:
        self.tok_chunks: list[bytes] = []  # packed TOKEN_DTYPE
        self.lp_chunks: list[bytes] = []  # packed LOGPROB_DTYPE
        self.chunk_starts: list[int] = []  # first position of each chunk
        self.length = 0
        self.version_runs: list[tuple[int, int]] = []  # (first position, policy version)
        self.pending: deque = deque()  # (lsn, length after that record), not yet durable
        self.durable_len = 0
        self.unmerged = 0  # chunks added since the last merge

    def add(self, tokens: bytes, logprobs: bytes, version: int) -> None:
        if not self.version_runs or self.version_runs[-1][1] != version:
            self.version_runs.append((self.length, version))
        self.chunk_starts.append(self.length)
        self.tok_chunks.append(tokens)
        self.lp_chunks.append(logprobs)
        self.length += len(tokens) // TOKEN_BYTES
        self.unmerged += 1
        if self.unmerged == MERGE_CHUNKS:  # one-token appends must not leave one Python object per token
            k = MERGE_CHUNKS
            self.tok_chunks[-k:] = [b"".join(self.tok_chunks[-k:])]
            self.lp_chunks[-k:] = [b"".join(self.lp_chunks[-k:])]
            self.chunk_starts[-k:] = [self.chunk_starts[-k]]
            self.unmerged = 0

    def _join(self) -> None:
        if len(self.tok_chunks) > 1:
            self.tok_chunks = [b"".join(self.tok_chunks)]
            self.lp_chunks = [b"".join(self.lp_chunks)]
            self.chunk_starts = [0]
            self.unmerged = 0

    def packed(self, lo: int, hi: int) -> tuple[bytes, bytes]:
        """Positions lo..hi-1 as (packed tokens, packed log-probs)."""
        if lo >= hi:
            return b"", b""
        i = bisect_right(self.chunk_starts, lo) - 1
        j = bisect_left(self.chunk_starts, hi)
        if j - i > 1 and lo == 0 and hi == self.length:
            self._join()
            i, j = 0, 1
        base = self.chunk_starts[i]
        tok = self.tok_chunks[i] if j - i == 1 else b"".join(self.tok_chunks[i:j])
        lp = self.lp_chunks[i] if j - i == 1 else b"".join(self.lp_chunks[i:j])
        a, b = lo - base, hi - base
        return bytes(tok[a * TOKEN_BYTES:b * TOKEN_BYTES]), bytes(lp[a * LOGPROB_BYTES:b * LOGPROB_BYTES])

    def settle(self, durable_lsn: int) -> int:
        while self.pending and self.pending[0][0] <= durable_lsn:
            self.durable_len = self.pending.popleft()[1]
        return self.durable_len

    def versions(self, lo: int, hi: int) -> list[int]:
        out: list[int] = []
        runs = self.version_runs
        for i, (first, version) in enumerate(runs):
            end = runs[i + 1][0] if i + 1 < len(runs) else self.length
            a, b = max(first, lo), min(end, hi)
            if a < b:
                out.extend([version] * (b - a))
        return out


class TokenIndex:
    def __init__(self) -> None:
        self.trajs: dict[str, Trajectory] = {}
        self.finalized: set[str] = set()

    def new_part(self, traj_id: str, start: int, tokens: bytes, logprobs: bytes, version: int) -> tuple[int, int] | None:
        """Check an append; returns (first new position, byte offset into tokens) of the part to write,
        or None when all of it is an exact repeat. Raises GapError / ConflictError / FinalizedError."""
        if traj_id in self.finalized:
            raise FinalizedError(f"trajectory {traj_id!r} is finalized; it takes no more appends")
        traj = self.trajs.get(traj_id)
        end = traj.length if traj is not None else 0
        n = len(tokens) // TOKEN_BYTES
        if start < 0:
            raise GapError(f"trajectory {traj_id!r}: start {start} is negative")
        if start > end:
            raise GapError(f"trajectory {traj_id!r}: append at position {start} leaves a gap; "
                           f"the log holds positions 0..{end - 1} (next expected {end})")
        overlap = min(end - start, n)
        if overlap > 0:
            _check_repeat(traj_id, traj, start, overlap, tokens, logprobs, version)
        if overlap == n:
            return None
        return start + overlap, overlap

    def apply(self, traj_id: str, start: int, tokens: bytes, logprobs: bytes, version: int, lsn: int) -> None:
        """Record an append already checked by new_part (start == current length)."""
        traj = self.trajs.get(traj_id)
        if traj is None:
            traj = self.trajs[traj_id] = Trajectory()
        if start != traj.length:
            raise AssertionError(f"apply at {start} but trajectory {traj_id!r} has length {traj.length}")
        traj.add(bytes(tokens), bytes(logprobs), version)
        traj.pending.append((lsn, traj.length))

    def finalize(self, traj_id: str) -> bool:
        """Mark finalized and drop from the index; False if it already was."""
        if traj_id in self.finalized:
            return False
        self.trajs.pop(traj_id, None)
        self.finalized.add(traj_id)
        return True

    def read(self, traj_id: str, durable_lsn: int) -> tuple[Trajectory | None, int]:
        if traj_id in self.finalized:
            raise FinalizedError(f"trajectory {traj_id!r} was finalized; its tokens live in the data plane now")
        traj = self.trajs.get(traj_id)
        if traj is None:
            return None, 0
        return traj, traj.settle(durable_lsn)


def _check_repeat(traj_id, traj, start, overlap, tokens, logprobs, version) -> None:
    have_tok, have_lp = traj.packed(start, start + overlap)
    if have_tok != tokens[:overlap * TOKEN_BYTES]:
        old = np.frombuffer(have_tok, TOKEN_DTYPE)
        new = np.frombuffer(tokens[:overlap * TOKEN_BYTES], TOKEN_DTYPE)
        i = int(np.flatnonzero(old != new)[0])
        raise ConflictError(f"trajectory {traj_id!r}: append rewrites position {start + i} "
                            f"(recorded token {int(old[i])}, new {int(new[i])}); re-sampling a recorded token is forbidden")
    if have_lp != logprobs[:overlap * LOGPROB_BYTES]:
        old = np.frombuffer(have_lp, LOGPROB_DTYPE)
        new = np.frombuffer(logprobs[:overlap * LOGPROB_BYTES], LOGPROB_DTYPE)
        i = int(np.flatnonzero(old.view(np.int64) != new.view(np.int64))[0])
        raise ConflictError(f"trajectory {traj_id!r}: append repeats position {start + i} with log-prob {new[i]!r}, "
                            f"recorded {old[i]!r}")
    have_versions = set(traj.versions(start, start + overlap))
    if have_versions != {version}:
        raise ConflictError(f"trajectory {traj_id!r}: append repeats positions {start}..{start + overlap - 1} under "
                            f"policy version {version}, recorded {sorted(have_versions)}")
