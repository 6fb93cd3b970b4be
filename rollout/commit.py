"""Commit pipelining: decode steps are made durable in the background while the next steps decode.

`submit(draws, version, payload)` buffers a step's draws; every `group_steps` steps (or at once with
`flush=True`, e.g. when a request stopped and waits for a tool) a background thread appends the
buffered draws to the WAL, one record per trajectory, and commits. `ready()` hands back, in step
order, the payloads whose commit has returned, so the caller exposes a token only once it is
durable. At most `max_lag` commits are outstanding (`ready` waits for the oldest beyond that).
Uncommitted draws lost in a crash are drawn again identically (the RNG is keyed by position), and
no token was exposed before its commit, so nothing acknowledged is lost or sampled twice.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor


class AsyncCommitter:
    def __init__(self, wal, max_lag: int = 4, group_steps: int = 1):
        if max_lag < 1 or group_steps < 1:
            raise ValueError(f"max_lag ({max_lag}) and group_steps ({group_steps}) must be >= 1")
        self.wal, self.max_lag, self.group_steps = wal, max_lag, group_steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="wal-commit")
        self._queue: deque[tuple[Future, list]] = deque()
        self._draws: list = []
        self._payloads: list = []
        self._steps = 0

    def submit(self, draws, version: int, payload, flush: bool = False) -> None:
        self._draws.append((draws, version))
        self._payloads.append(payload)
        self._steps += 1
        if flush or self._steps >= self.group_steps:
            self.flush()

    def flush(self) -> None:
        if not self._steps:
            return
        records: dict[str, list] = {}
        for draws, version in self._draws:
            for d in draws:
                r = records.get(d.req_id)
                if r is not None and r[1] + len(r[2]) == d.position and r[4] == version:
                    r[2].append(d.token)
                    r[3].append(d.logprob)
                else:  # first draw of this trajectory in the group (positions within a group are contiguous)
                    if r is not None:
                        raise AssertionError(f"{d.req_id}: draw at {d.position} does not follow the group")
                    records[d.req_id] = [d.req_id, d.position, [d.token], [d.logprob], version]
        self._queue.append((self._pool.submit(self._write, list(records.values())), self._payloads))
        self._draws, self._payloads, self._steps = [], [], 0

    def _write(self, records: list) -> None:
        for traj, start, tokens, logprobs, version in records:
            self.wal.append(traj, start, tokens, logprobs, version)
        self.wal.commit()

    def ready(self, wait_all: bool = False) -> list:
        """Payloads whose commit is done (with wait_all: flush and wait for all); a failed commit raises here."""
        if wait_all:
            self.flush()
        out = []
        while self._queue and (wait_all or self._queue[0][0].done() or len(self._queue) > self.max_lag):
            fut, payloads = self._queue.popleft()
            fut.result()
            out += payloads
        return out

    def __len__(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        self.ready(wait_all=True)
        self._pool.shutdown(wait=True)
