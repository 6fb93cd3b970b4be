"""StepGroup: the batched-decode fast path of the token index (pure; the caller holds the log's mutex).

A decode loop appends one token to each of the same B trajectories step after step. Handling that
item by item costs about a microsecond of Python per trajectory per step (at B = 512 four times the
disk's fdatasync). A group holds such a run of steps as rows instead: row r of `tok_RB` / `lp_RB`
(preallocated, `capacity` rows) is step r, column j is trajectory ids[j]; a step whose ids are the
group's (the same list, compared element-wise) and whose positions are each column's next one is one
row copy, whatever B.

The group is an overlay of the index: its trajectories' objects do not see its rows until it is
dissolved (`dissolve`), which the index does before anyone else looks at a trajectory, and when the
group is full. Dissolving transposes the rows into columns (in tiles of TILE_ROWS rows, which stay in
cache) and adds each column to its trajectory in one piece (blocks, version runs, length) and the not
yet durable rows to its pending list, so reads after it are exactly those of item-by-item appends.
"""
from __future__ import annotations

import bisect
import sys
from array import array

import numpy as np

from wal.types import LOGPROB_BYTES, LOGPROB_DTYPE, TOKEN_BYTES, TOKEN_DTYPE

ROW_BYTES_CAP = 32 << 20  # tokens + log-probs held per group before it is dissolved
# Rows per group: one index block (BLOCK_TOKENS), so a group that starts block-aligned (a batch decoded from
# position 0) hands each trajectory one whole block, allocated once, instead of growing its tail four times
# (1,024 rows: 3.7 us more CPU per step at B = 512, most of it re-allocating the tails as they grow).
MAX_ROWS = 4096  # = index.BLOCK_TOKENS (tests/wal/test_stepgroup.py checks)
TILE_ROWS = 16  # rows per tile of the transposition; 1024 x 512 float64 in 16-row tiles: 1.0 ms, whole: 2.9 ms
_TILED_MIN_COLUMNS = 64  # narrower groups transpose in one copy


class StepGroup:
    __slots__ = ("ids", "trajs", "n", "capacity", "rows", "base_B", "next_B", "next_starts", "tok_RB", "lp_RB",
                 "_tok_mv", "_lp_mv", "_ones_B", "version_R", "lsn_R", "lens", "ids_blob", "key")

    def __init__(self, ids: list[str], trajs: list, idbs: list[bytes], reuse: StepGroup | None = None) -> None:
        """`reuse`: a dissolved group whose row arrays this one may take over (when their shape fits: no
        fresh pages to fault in, ~1.5 us per step at B = 512)."""
        self.ids = list(ids)  # a copy: the caller may reuse and change its list
        self.trajs = trajs  # Trajectory objects, same order
        self.n = len(ids)
        self.capacity = max(1, min(MAX_ROWS, ROW_BYTES_CAP // ((TOKEN_BYTES + LOGPROB_BYTES) * self.n)))
        self.rows = 0
        self.base_B = np.array([t.length for t in trajs], dtype="<i8")  # each trajectory's length at row 0
        self.next_B = self.base_B.copy()  # the positions the next row must carry
        self.next_starts = self.next_B.tobytes()  # the same, packed
        self._ones_B = np.ones(self.n, "<i8")  # next_B += ones: half the cost of += 1 (no scalar conversion)
        if reuse is not None and reuse.rows == 0 and reuse.tok_RB.shape == (self.capacity, self.n):
            self.tok_RB, self.lp_RB = reuse.tok_RB, reuse.lp_RB
        else:
            self.tok_RB = np.empty((self.capacity, self.n), TOKEN_DTYPE)  # row r: the tokens of step r
            self.lp_RB = np.empty((self.capacity, self.n), LOGPROB_DTYPE)
        self._tok_mv = memoryview(self.tok_RB).cast("B")  # the rows as bytes: a step's packed row copies in
        self._lp_mv = memoryview(self.lp_RB).cast("B")
        self.version_R: list[int] = []
        self.lsn_R: list[int] = []  # ascending
        lens = array("H", map(len, idbs))
        if sys.byteorder != "little":
            lens.byteswap()
        self.lens, self.ids_blob = lens.tobytes(), b"".join(idbs)  # what every STEP record of the group carries
        self.key = None  # recovery: the tuple of ids its decoded records share (an identity check per record)

    def matches(self, traj_ids, starts: bytes) -> bool:
        """Whether a step (ids, packed positions) is the group's next row."""
        if self.rows >= self.capacity or starts != self.next_starts:
            return False
        return (traj_ids if type(traj_ids) is list else list(traj_ids)) == self.ids

    def add_row(self, tokens: bytes, logprobs: bytes, version: int, lsn: int) -> None:
        """Step `lsn` (checked: these trajectories, each at its next position; one token each, packed)."""
        r, n = self.rows, self.n
        tb, lb = len(tokens), len(logprobs)
        if tb != n * TOKEN_BYTES or lb != n * LOGPROB_BYTES or r >= self.capacity:
            raise AssertionError(f"step of {tb} B tokens / {lb} B log-probs for a group of {self.n} at row {r}/{self.capacity}")
        self._tok_mv[r * tb:(r + 1) * tb] = tokens
        self._lp_mv[r * lb:(r + 1) * lb] = logprobs
        self.version_R.append(version)
        self.lsn_R.append(lsn)
        self.rows = r + 1
        self.next_B += self._ones_B
        self.next_starts = self.next_B.tobytes()

    def dissolve(self, durable_lsn: int) -> None:
        """Hand every row to the trajectory objects (the group is not used afterwards)."""
        rows, trajs = self.rows, self.trajs
        self.trajs = []  # a dissolved group keeps only its row arrays (for the next group), no trajectory
        if not rows:
            return
        tok = memoryview(_transpose(self.tok_RB[:rows])).cast("B")  # column j: bytes j * rows * TOKEN_BYTES ..
        lp = memoryview(_transpose(self.lp_RB[:rows])).cast("B")
        tw, lw = rows * TOKEN_BYTES, rows * LOGPROB_BYTES
        versions = self.version_R
        cuts = [r for r in range(1, rows) if versions[r] != versions[r - 1]]
        runs = [(lo, hi, versions[lo]) for lo, hi in zip([0, *cuts], [*cuts, rows])]  # (first row, end row, version)
        n_durable = bisect.bisect_right(self.lsn_R, durable_lsn)
        last_durable = self.lsn_R[n_durable - 1] if n_durable else None
        later = self.lsn_R[n_durable:]
        for j, t in enumerate(trajs):
            base = t.length
            if len(runs) == 1:
                t.add(tok[j * tw:(j + 1) * tw], lp[j * lw:(j + 1) * lw], runs[0][2])
            else:
                for lo, hi, v in runs:
                    t.add(tok[j * tw + lo * TOKEN_BYTES:j * tw + hi * TOKEN_BYTES],
                          lp[j * lw + lo * LOGPROB_BYTES:j * lw + hi * LOGPROB_BYTES], v)
            pending = t.pending
            if last_durable is not None:
                pending.append((last_durable, base + n_durable))  # settled by the next read
            for k, lsn in enumerate(later, n_durable + 1):
                pending.append((lsn, base + k))
        tok.release()
        lp.release()
        self.rows = 0
        self.version_R, self.lsn_R = [], []


def _transpose(a_RB: np.ndarray) -> np.ndarray:
    """a_RB.T as a new C-contiguous array. Wide arrays go in tiles of TILE_ROWS rows: a whole strided
    copy misses the cache on every element."""
    rows, n = a_RB.shape
    if n < _TILED_MIN_COLUMNS:
        return np.ascontiguousarray(a_RB.T)
    out_BR = np.empty((n, rows), a_RB.dtype)
    for lo in range(0, rows, TILE_ROWS):
        out_BR[:, lo:lo + TILE_ROWS] = a_RB[lo:lo + TILE_ROWS].T
    return out_BR
