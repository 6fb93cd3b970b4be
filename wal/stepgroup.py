"""StepGroup: the batched-decode fast path of the token index (pure; the caller holds the log's mutex).

A decode loop appends one token to each of the same B trajectories step after step. Handling that
item by item costs about a microsecond of Python per trajectory per step (at B = 512 four times the
disk's fdatasync). A group holds such a run of steps as rows instead: row r (`tok_rows[r]`, `lp_rows[r]`,
the packed arrays as the step gave them) is step r, column j is trajectory ids[j]; a step whose ids are the group's (the same list, compared
element-wise) and whose positions are each column's next one is one row copy, whatever B.

The group is an overlay of the index: its trajectories' objects do not see its rows until it is
dissolved (`dissolve`), which the index does before anyone else looks at a trajectory, and when the
group is full (`capacity` rows). Dissolving adds each column to its trajectory in one piece (blocks,
version runs, length) and the not yet durable rows to its pending list, so reads after it are exactly
those of item-by-item appends.
"""
from __future__ import annotations

import bisect
import sys
from array import array

import numpy as np

from wal.types import LOGPROB_BYTES, LOGPROB_DTYPE, TOKEN_BYTES, TOKEN_DTYPE

ROW_BYTES_CAP = 8 << 20  # tokens + log-probs held per group before it is dissolved
MAX_ROWS = 1024


class StepGroup:
    __slots__ = ("ids", "trajs", "n", "capacity", "rows", "base_B", "next_starts", "tok_rows", "lp_rows",
                 "version_R", "lsn_R", "lens", "ids_blob")

    def __init__(self, ids: list[str], trajs: list, idbs: list[bytes]) -> None:
        self.ids = list(ids)  # a copy: the caller may reuse and change its list
        self.trajs = trajs  # Trajectory objects, same order
        self.n = len(ids)
        self.capacity = max(1, min(MAX_ROWS, ROW_BYTES_CAP // ((TOKEN_BYTES + LOGPROB_BYTES) * self.n)))
        self.rows = 0
        self.base_B = np.array([t.length for t in trajs], dtype="<i8")  # each trajectory's length at row 0
        self.next_starts = self.base_B.tobytes()  # packed positions the next row must carry
        self.tok_rows: list[bytes] = []  # row r: the packed tokens of step r (column j: trajectory ids[j])
        self.lp_rows: list[bytes] = []
        self.version_R: list[int] = []
        self.lsn_R: list[int] = []  # ascending
        lens = array("H", map(len, idbs))
        if sys.byteorder != "little":
            lens.byteswap()
        self.lens, self.ids_blob = lens.tobytes(), b"".join(idbs)  # what every STEP record of the group carries

    def matches(self, traj_ids, starts: bytes) -> bool:
        """Whether a step (ids, packed positions) is the group's next row."""
        if self.rows >= self.capacity or starts != self.next_starts:
            return False
        return (traj_ids if type(traj_ids) is list else list(traj_ids)) == self.ids

    def add_row(self, tokens: bytes, logprobs: bytes, version: int, lsn: int) -> None:
        """Step `lsn` (checked: these trajectories, each at its next position; one token each)."""
        self.tok_rows.append(tokens)
        self.lp_rows.append(logprobs)
        self.version_R.append(version)
        self.lsn_R.append(lsn)
        self.rows += 1
        self.next_starts = (self.base_B + self.rows).tobytes()

    def dissolve(self, durable_lsn: int) -> None:
        """Hand every row to the trajectory objects (the group is not used afterwards)."""
        rows, n = self.rows, self.n
        if not rows:
            return
        tok_BR = np.frombuffer(b"".join(self.tok_rows), TOKEN_DTYPE).reshape(rows, n).T.copy()
        lp_BR = np.frombuffer(b"".join(self.lp_rows), LOGPROB_DTYPE).reshape(rows, n).T.copy()
        versions = self.version_R
        cuts = [r for r in range(1, rows) if versions[r] != versions[r - 1]]
        runs = [(lo, hi, versions[lo]) for lo, hi in zip([0, *cuts], [*cuts, rows])]  # (first row, end row, version)
        n_durable = bisect.bisect_right(self.lsn_R, durable_lsn)
        last_durable = self.lsn_R[n_durable - 1] if n_durable else None
        later = self.lsn_R[n_durable:]
        for j, t in enumerate(self.trajs):
            tok, lp = tok_BR[j].tobytes(), lp_BR[j].tobytes()
            base = t.length
            if len(runs) == 1:
                t.add(tok, lp, runs[0][2])
            else:
                for lo, hi, v in runs:
                    t.add(tok[lo * TOKEN_BYTES:hi * TOKEN_BYTES], lp[lo * LOGPROB_BYTES:hi * LOGPROB_BYTES], v)
            pending = t.pending
            if last_durable is not None:
                pending.append((last_durable, base + n_durable))  # settled by the next read
            for k, lsn in enumerate(later, n_durable + 1):
                pending.append((lsn, base + k))
        self.rows = 0
        self.tok_rows, self.lp_rows, self.version_R, self.lsn_R = [], [], [], []
