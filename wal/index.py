"""In-memory per-trajectory token index (pure; the caller holds the log's mutex).

Each live trajectory keeps its tokens and log-probs packed (in blocks of 4 Ki positions, no per-token objects), its
policy versions as runs, and the lsns of its records that are not yet durable: reads return the
durable prefix only, so nothing is exposed before it is committed.

The append rule: positions are contiguous from 0. A start past the end is a gap (GapError); an
overlap with recorded positions must repeat them exactly (tokens, log-probs and policy version) or
it is a rewrite (ConflictError); the part of an append that is an exact repeat is acknowledged and
not written again, so a retried append never duplicates.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from wal.errors import ConflictError, FinalizedError, GapError
from wal.stepgroup import StepGroup
from wal.types import LOGPROB_BYTES, LOGPROB_DTYPE, TOKEN_BYTES, TOKEN_DTYPE


# positions per sealed block (16 KiB of ids, 32 KiB of log-probs); a power of two. Small enough that the growing
# arrays stay in malloc's heap: at 64 Ki an append of 512 tokens cost 5.9 us (re-allocations of large, mmapped
# arrays), at 4 Ki 1.4 us.
BLOCK_TOKENS = 1 << 12


class Trajectory:
    """Tokens and log-probs packed in blocks of BLOCK_TOKENS positions: sealed blocks are never
    written again, the newest grows. No object per token, and no append ever copies more
    than one block (one growing bytearray of a million-token trajectory would be re-allocated and
    copied whole, tens of MB, every ~12% of growth: a commit stalled for milliseconds). Policy versions
    as runs, the lsns of records not yet durable, and the id as UTF-8."""

    __slots__ = ("tok", "lp", "tok_blocks", "lp_blocks", "length", "version_runs", "pending", "durable_len", "idb")

    def __init__(self, idb: bytes = b"") -> None:
        self.tok = bytearray()  # packed TOKEN_DTYPE of positions len(tok_blocks) * BLOCK_TOKENS ..
        self.lp = bytearray()  # packed LOGPROB_DTYPE, same positions
        self.tok_blocks: list[bytearray] = []  # sealed: BLOCK_TOKENS positions each
        self.lp_blocks: list[bytearray] = []
        self.length = 0
        self.version_runs: list[tuple[int, int]] = []  # (first position, policy version)
        self.pending: deque = deque()  # (lsn, length after that record), not yet durable
        self.durable_len = 0
        self.idb = idb  # the trajectory id, UTF-8 (what a record carries)

    def add(self, tokens, logprobs, version: int) -> None:
        self.note_version(version)
        self.tok += tokens
        self.lp += logprobs
        self.grown()

    def grown(self) -> None:
        """The rest of `add` for tokens and log-probs appended to `tok` and `lp` directly (by a step
        group's dissolve, after `note_version`): length and sealing."""
        self.length = len(self.tok_blocks) * BLOCK_TOKENS + len(self.tok) // TOKEN_BYTES
        if len(self.tok) >= BLOCK_TOKENS * TOKEN_BYTES:
            self.seal()

    def note_version(self, version: int) -> None:
        """The version run of positions about to be appended at the current length."""
        if not self.version_runs or self.version_runs[-1][1] != version:
            self.version_runs.append((self.length, version))

    def add_record(self, tokens, logprobs, version: int, lsn: int) -> None:
        """`add` for a record appended under `lsn`, not yet durable."""
        self.add(tokens, logprobs, version)
        self.pending.append((lsn, self.length))

    def seal(self) -> None:
        """Move every full block of the growing arrays into the sealed lists."""
        tb, lb = BLOCK_TOKENS * TOKEN_BYTES, BLOCK_TOKENS * LOGPROB_BYTES
        full = len(self.tok) // tb
        if len(self.tok) == tb:  # exactly one block: the arrays themselves become it, nothing copied
            self.tok_blocks.append(self.tok)
            self.lp_blocks.append(self.lp)
            self.tok, self.lp = bytearray(), bytearray()
        elif full:  # a long append: each block and the rest copied once
            tok, lp = self.tok, self.lp
            self.tok_blocks.extend(tok[k * tb:(k + 1) * tb] for k in range(full))
            self.lp_blocks.extend(lp[k * lb:(k + 1) * lb] for k in range(full))
            self.tok, self.lp = tok[full * tb:], lp[full * lb:]

    def packed(self, lo: int, hi: int) -> tuple[bytes, bytes]:
        """Positions lo..hi-1 as (packed tokens, packed log-probs)."""
        if lo >= hi:
            return b"", b""
        return (_gather(self.tok_blocks, self.tok, lo, hi, TOKEN_BYTES),
                _gather(self.lp_blocks, self.lp, lo, hi, LOGPROB_BYTES))

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
    """Trajectories by id, the finalized ids, and at most one StepGroup (the batched-decode fast path):
    any access to `trajs` dissolves the group first, so nothing but the fast path sees its rows unmerged.
    `finalized` holds the ids whose finalize records are in the log, `forgotten` those whose finalize
    records retention reclaimed (the tombstone file); both are finalized to every caller."""

    def __init__(self, durable_lsn: Callable[[], int] = lambda: -1) -> None:
        self._trajs: dict[str, Trajectory] = {}
        self.finalized: set[str] = set()
        self.forgotten: set[str] = set()
        self.group: StepGroup | None = None
        self._dissolved: StepGroup | None = None  # the last group, its row arrays for the next one
        self.durable_lsn = durable_lsn  # the log's durable lsn (which group rows are settled)

    @property
    def trajs(self) -> dict[str, Trajectory]:
        if self.group is not None:
            self.dissolve()
        return self._trajs

    def dissolve(self) -> None:
        g, self.group = self.group, None
        if g is not None:
            g.dissolve(self.durable_lsn())
            self._dissolved = g

    def start_group(self, ids: list[str], trajs: list[Trajectory]) -> StepGroup:
        """Begin a group over these (known, distinct) trajectories at their current lengths."""
        self.dissolve()
        reuse, self._dissolved = self._dissolved, None
        self.group = StepGroup(ids, trajs, [t.idb for t in trajs], reuse)
        return self.group

    def new_part(self, traj_id: str, start: int, tokens: bytes, logprobs: bytes, version: int) -> tuple[int, int] | None:
        """Check an append; returns (first new position, byte offset into tokens) of the part to write,
        or None when all of it is an exact repeat. Raises GapError / ConflictError / FinalizedError."""
        if traj_id in self.finalized or traj_id in self.forgotten:
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
            traj = self.trajs[traj_id] = Trajectory(traj_id.encode("utf-8"))
        if start != traj.length:
            raise AssertionError(f"apply at {start} but trajectory {traj_id!r} has length {traj.length}")
        traj.add_record(tokens, logprobs, version, lsn)

    @staticmethod
    def apply_step(trajs: list[Trajectory], tokens: bytes, logprobs: bytes, version: int, lsn: int) -> None:
        """Record a checked decode step (one STEP record, `lsn`): one token each for `trajs`, each at its
        current length. The batched form of `apply`, without per-item calls."""
        for i, t in enumerate(trajs):
            runs = t.version_runs
            if not runs or runs[-1][1] != version:
                runs.append((t.length, version))
            t.tok += tokens[i * TOKEN_BYTES:(i + 1) * TOKEN_BYTES]
            t.lp += logprobs[i * LOGPROB_BYTES:(i + 1) * LOGPROB_BYTES]
            t.length += 1
            if not t.length & _BLOCK_MASK:
                t.seal()
            t.pending.append((lsn, t.length))

    def finalize(self, traj_id: str) -> bool:
        """Mark finalized and drop from the index; False if it already was."""
        if traj_id in self.finalized or traj_id in self.forgotten:
            return False
        self.trajs.pop(traj_id, None)
        self.finalized.add(traj_id)
        return True

    def read(self, traj_id: str, durable_lsn: int) -> tuple[Trajectory | None, int]:
        if traj_id in self.finalized or traj_id in self.forgotten:
            raise FinalizedError(f"trajectory {traj_id!r} was finalized; its tokens live in the data plane now")
        traj = self.trajs.get(traj_id)
        if traj is None:
            return None, 0
        return traj, traj.settle(durable_lsn)


_BLOCK_MASK = BLOCK_TOKENS - 1


def _gather(blocks: list[bytearray], tail: bytearray, lo: int, hi: int, width: int) -> bytes:
    """Bytes of positions lo..hi-1 from sealed `blocks` and the growing `tail` (`width` bytes each)."""
    parts = []
    b = lo // BLOCK_TOKENS
    while lo < hi:
        first = b * BLOCK_TOKENS
        src = blocks[b] if b < len(blocks) else tail
        end = min(hi, first + BLOCK_TOKENS)
        with memoryview(src) as m:  # released at once: the tail may grow later
            parts.append(bytes(m[(lo - first) * width:(end - first) * width]))
        lo, b = end, b + 1
    return parts[0] if len(parts) == 1 else b"".join(parts)


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
