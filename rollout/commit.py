"""Commit pipelining: decode steps are made durable in the background while the next steps decode.

`submit(draws, version, payload)` records a step's draws as one `append_step` (one STEP record);
every `group_steps` steps (or at once with `flush=True`, e.g. when a request stopped and waits for a
tool) a background thread commits. `ready()` hands back, in step order, the payloads whose commit has
returned, so the caller exposes a token only once it is durable. At most `max_lag` commits are
outstanding (`ready` waits for the oldest beyond that).

Where the append runs: an in-process log (`appends_in_memory`) is appended to on the caller's thread
(a few list operations per step, nothing blocks), so the commit thread holds the GIL only briefly
around its `pwrite` + `fdatasync` and does not contend with the decode loop for it; a remote log
(whose append may wait behind a commit's round trip) is appended to by the commit thread.

Uncommitted draws lost in a crash are drawn again identically (the RNG is keyed by position), and
no token was exposed before its commit, so nothing acknowledged is lost or sampled twice.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from operator import attrgetter

_IDS, _POS, _TOK, _LP = attrgetter("req_id"), attrgetter("position"), attrgetter("token"), attrgetter("logprob")


class AsyncCommitter:
    def __init__(self, wal, max_lag: int = 4, group_steps: int = 1):
        if max_lag < 1 or group_steps < 1:
            raise ValueError(f"max_lag ({max_lag}) and group_steps ({group_steps}) must be >= 1")
        self.wal, self.max_lag, self.group_steps = wal, max_lag, group_steps
        self.inline = bool(getattr(wal, "appends_in_memory", False))
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._done = 0  # the last job whose commit returned (or failed)
        self._errors: dict[int, BaseException] = {}
        self._queue: deque[tuple[int, list]] = deque()  # (job, payloads) not yet handed back
        self._seq = 0
        self._draws: list = []
        self._payloads: list = []
        self._thread = threading.Thread(target=self._run, name="wal-commit", daemon=True)
        self._thread.start()

    def submit(self, draws, version: int, payload, flush: bool = False) -> None:
        if self.inline:
            self._append(draws, version)
        else:
            self._draws.append((draws, version))
        self._payloads.append(payload)
        if flush or len(self._payloads) >= self.group_steps:
            self.flush()

    def flush(self) -> None:
        if not self._payloads:
            return
        self._seq += 1
        self._jobs.put((self._seq, self._draws))
        self._queue.append((self._seq, self._payloads))
        self._draws, self._payloads = [], []

    def call(self, fn) -> None:
        """Run `fn()` on the commit thread, after the commits submitted before it (a finalize that must not
        hold up decoding). `ready()` hands nothing back for it; `ready(wait_all=True)` waits for it and raises
        its error."""
        self.flush()
        self._seq += 1
        self._jobs.put((self._seq, fn))
        self._queue.append((self._seq, []))

    def _append(self, draws, version: int) -> None:
        if draws:
            self.wal.append_step(list(map(_IDS, draws)), list(map(_POS, draws)), list(map(_TOK, draws)),
                                 list(map(_LP, draws)), version)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            seq, steps = job
            err = None
            try:
                if callable(steps):
                    steps()
                else:
                    for draws, version in steps:
                        self._append(draws, version)
                    self.wal.commit()
            except BaseException as exc:  # handed to the caller by ready()
                err = exc
            with self._cv:
                if err is not None:
                    self._errors[seq] = err
                self._done = seq
                self._cv.notify_all()

    def ready(self, wait_all: bool = False) -> list:
        """Payloads whose commit is done (with wait_all: flush and wait for all); a failed commit raises here."""
        if wait_all:
            self.flush()
        out = []
        while self._queue:
            seq = self._queue[0][0]
            if self._done < seq:
                if not (wait_all or len(self._queue) > self.max_lag):
                    break
                with self._cv:
                    self._cv.wait_for(lambda: self._done >= seq)
            _, payloads = self._queue.popleft()
            if seq in self._errors:
                raise self._errors.pop(seq)
            out += payloads
        return out

    def __len__(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        try:
            self.ready(wait_all=True)
        finally:
            self._jobs.put(None)
            self._thread.join()
