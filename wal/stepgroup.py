"""StepGroup: the batched-decode fast path of the token index (pure; the caller holds the log's mutex).

A decode loop appends one token to each of the same B trajectories step after step. Handling that
item by item costs about a microsecond of Python per trajectory per step (at B = 512 four times the
disk's fdatasync). A group holds such a run of steps as rows instead: row r of `tok_RB` / `lp_RB`
(preallocated, `capacity` rows) is step r, column j is trajectory ids[j]; a step whose ids are the
group's (the same list, compared element-wise) and whose positions are each column's next one is one
row copy, whatever B.

The group is an overlay of the index: its trajectories' objects do not see its rows until it is
dissolved (`dissolve`), which the index does before anyone else looks at a trajectory, and when the
group is full. Dissolving appends each column to its trajectory in one piece (in C, wal/_stepc.c; where
rows carry several versions, or without the C module, through a copy transposed in tiles of TILE_ROWS
rows), then its version runs, length and blocks, and the not yet durable rows to its pending list, so
reads after it are exactly those of item-by-item appends.

The step itself (`encode_row`: checks, STEP frame, row copy) is one C call where the module is built and
the same operations in numpy and bytes otherwise (`_encode_row_py`), byte for byte the same.
"""
from __future__ import annotations

import bisect
import sys
from array import array

import numpy as np

from wal import codec
from wal.types import LOGPROB_BYTES, LOGPROB_DTYPE, STEP, TOKEN_BYTES, TOKEN_DTYPE

try:  # the step in one C call (wal/_stepc.c); built by `pip install` where a compiler is, else the Python below
    from wal import _stepc
except ImportError:  # pragma: no cover - exercised by tests that clear it
    _stepc = None
# Store._step_fast in one C call, for TokenWAL.append_step (None: a module built before it, or none)
store_step = getattr(_stepc, "step", None)
if store_step is not None:
    _stepc.configure(codec.FLUSH_MARK, STEP, codec.crc32c)

ROW_BYTES_CAP = 32 << 20  # tokens + log-probs held per group before it is dissolved
# Rows per group: one index block (BLOCK_TOKENS), so a group that starts block-aligned (a batch decoded from
# position 0) hands each trajectory one whole block, allocated once, instead of growing its tail four times
# (1,024 rows: 3.7 us more CPU per step at B = 512, most of it re-allocating the tails as they grow).
MAX_ROWS = 4096  # = index.BLOCK_TOKENS (tests/wal/test_stepgroup.py checks)
_TOKENS, _LOGPROBS, _POSITIONS = codec._TOKEN_NP, codec._LOGPROB_NP, np.dtype("<i8")  # a step's arrays on the fast path
TILE_ROWS = 16  # rows per tile of the transposition; 1024 x 512 float64 in 16-row tiles: 1.0 ms, whole: 2.9 ms
_TILED_MIN_COLUMNS = 64  # narrower groups transpose in one copy


def _from_list(values, n: int, kind: type, dtype: np.dtype):
    """A list of n values of exactly `kind` (what the rollout's committer hands over) as an array of `dtype`,
    or None when it does not fit; anything but a list is returned as it is."""
    if type(values) is not list:
        return values
    if len(values) != n or not all(type(v) is kind for v in values):
        return None
    try:
        return np.array(values, dtype)
    except OverflowError:
        return None


class StepGroup:
    __slots__ = ("ids", "trajs", "n", "capacity", "rows", "base_B", "next_B", "tok_RB", "lp_RB",
                 "_tok_flat", "_lp_flat", "_tok_mv", "_lp_mv", "_ones_B", "version_R", "lsn_R", "lens", "ids_blob", "key")

    def __init__(self, ids: list[str], trajs: list, idbs: list[bytes], reuse: StepGroup | None = None) -> None:
        """`reuse`: a dissolved group whose row memory this one may take over, whatever its width, when it
        is large enough: no fresh pages to fault in (~1.5 pages a step at B = 512), also after a batch's
        membership changed."""
        self.ids = list(ids)  # a copy: the caller may reuse and change its list
        self.trajs = trajs  # Trajectory objects, same order
        self.n = len(ids)
        self.capacity = max(1, min(MAX_ROWS, ROW_BYTES_CAP // ((TOKEN_BYTES + LOGPROB_BYTES) * self.n)))
        self.rows = 0
        self.base_B = np.array([t.length for t in trajs], dtype="<i8")  # each trajectory's length at row 0
        self.next_B = self.base_B.copy()  # the positions the next row must carry
        self._ones_B = np.ones(self.n, "<i8")  # next_B += ones: half the cost of += 1 (no scalar conversion)
        need = self.capacity * self.n
        if reuse is not None and reuse.rows == 0 and reuse._tok_flat.size >= need:  # any width that fits
            self._tok_flat, self._lp_flat = reuse._tok_flat, reuse._lp_flat
        else:
            self._tok_flat, self._lp_flat = np.empty(need, TOKEN_DTYPE), np.empty(need, LOGPROB_DTYPE)
        self.tok_RB = self._tok_flat[:need].reshape(self.capacity, self.n)  # row r: the tokens of step r
        self.lp_RB = self._lp_flat[:need].reshape(self.capacity, self.n)
        self._tok_mv = memoryview(self.tok_RB).cast("B")  # the rows as bytes: a step's packed row copies in
        self._lp_mv = memoryview(self.lp_RB).cast("B")
        self.version_R: list[int] = []
        self.lsn_R: list[int] = []  # ascending
        lens = array("H", map(len, idbs))
        if sys.byteorder != "little":
            lens.byteswap()
        self.lens, self.ids_blob = lens.tobytes(), b"".join(idbs)  # what every STEP record of the group carries
        self.key = None  # recovery: the tuple of ids its decoded records share (an identity check per record)

    @property
    def next_starts(self) -> bytes:
        """The positions the next row must carry, packed (little-endian u64)."""
        return self.next_B.tobytes()

    def matches(self, traj_ids, starts: bytes) -> bool:
        """Whether a step (ids, packed positions) is the group's next row."""
        if self.rows >= self.capacity or starts != self.next_starts:
            return False
        return self.same_ids(traj_ids)

    def same_ids(self, traj_ids) -> bool:
        """Whether a step's ids are the group's, in order."""
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

    def encode_row(self, positions, tokens, logprobs, version: int, lsn: int, mark: int) -> bytes | None:
        """The STEP frame of a step as a decode loop holds it (int32 tokens, float64 log-probs, int64
        positions: numpy arrays of the group's width, or lists of exactly int / float / int as the rollout's
        committer hands them over; `version` an int >= 0) that is the group's next row,
        taken as row `lsn`: the frame, after the row is added. None, with nothing changed, for any other
        step (other types or shapes, a negative token, a NaN, other positions, a full group): the general
        path takes it and raises what it raises. The caller checked the ids (`matches`)."""
        r = self.rows
        if r >= self.capacity:
            return None
        if _stepc is not None:
            frame = _stepc.encode_row(tokens, logprobs, positions, self.next_B, self.tok_RB, self.lp_RB, r, self.lens,
                                      self.ids_blob, version, lsn, mark, STEP, codec.crc32c)
            if frame is not None:
                self.version_R.append(version)
                self.lsn_R.append(lsn)
                self.rows = r + 1
            return frame
        return self._encode_row_py(positions, tokens, logprobs, version, lsn, mark)

    def _encode_row_py(self, positions, tokens, logprobs, version: int, lsn: int, mark: int) -> bytes | None:
        """encode_row without the C module: the same checks, the same bytes, the same row."""
        shape = (self.n,)
        tokens = _from_list(tokens, self.n, int, _TOKENS)
        logprobs = _from_list(logprobs, self.n, float, _LOGPROBS)
        positions = _from_list(positions, self.n, int, _POSITIONS)
        if (type(tokens) is not np.ndarray or type(logprobs) is not np.ndarray or type(positions) is not np.ndarray
                or tokens.shape != shape or logprobs.shape != shape or positions.shape != shape
                or tokens.dtype != _TOKENS or logprobs.dtype != _LOGPROBS or positions.dtype != _POSITIONS):
            return None
        if self.n and (codec._has_negative(tokens) or codec._has_nan(logprobs)):
            return None
        starts = positions.tobytes()
        if starts != self.next_B.tobytes():
            return None
        tok, lp = tokens.tobytes(), logprobs.tobytes()
        frame = codec.encode_step_blob(lsn, self.n, self.lens, self.ids_blob, starts, version, tok, lp, mark)
        self.add_row(tok, lp, version, lsn)
        return frame

    def dissolve(self, durable_lsn: int) -> None:
        """Hand every row to the trajectory objects (the group is not used afterwards)."""
        rows, trajs = self.rows, self.trajs
        self.trajs = []  # a dissolved group keeps only its row arrays (for the next group), no trajectory
        if not rows:
            return
        versions = self.version_R
        cuts = [r for r in range(1, rows) if versions[r] != versions[r - 1]]
        runs = [(lo, hi, versions[lo]) for lo, hi in zip([0, *cuts], [*cuts, rows])]  # (first row, end row, version)
        bases = [t.length for t in trajs]
        if _stepc is not None and len(runs) == 1:  # one version: each column appended in place, in C
            for t in trajs:
                t.note_version(runs[0][2])
            _stepc.append_columns(self.tok_RB, rows, [t.tok for t in trajs])
            _stepc.append_columns(self.lp_RB, rows, [t.lp for t in trajs])
            for t in trajs:
                t.grown()
        else:
            self._add_columns(trajs, rows, runs)
        n_durable = bisect.bisect_right(self.lsn_R, durable_lsn)
        last_durable = self.lsn_R[n_durable - 1] if n_durable else None
        later = self.lsn_R[n_durable:]
        for t, base in zip(trajs, bases):
            pending = t.pending
            if last_durable is not None:
                pending.append((last_durable, base + n_durable))  # settled by the next read
            for k, lsn in enumerate(later, n_durable + 1):
                pending.append((lsn, base + k))
        self.rows = 0
        self.version_R, self.lsn_R = [], []

    def _add_columns(self, trajs: list, rows: int, runs: list[tuple[int, int, int]]) -> None:
        """dissolve's columns through a transposed copy, one `add` per version run."""
        tok = memoryview(_transpose(self.tok_RB[:rows])).cast("B")  # column j: bytes j * rows * TOKEN_BYTES ..
        lp = memoryview(_transpose(self.lp_RB[:rows])).cast("B")
        tw, lw = rows * TOKEN_BYTES, rows * LOGPROB_BYTES
        for j, t in enumerate(trajs):
            for lo, hi, v in runs:
                t.add(tok[j * tw + lo * TOKEN_BYTES:j * tw + hi * TOKEN_BYTES],
                      lp[j * lw + lo * LOGPROB_BYTES:j * lw + hi * LOGPROB_BYTES], v)
        tok.release()
        lp.release()


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
