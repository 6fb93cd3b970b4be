"""The sandbox service without gRPC: exactly-once tool calls over the per-sandbox environment log.

One call (sandbox_id, seq, ToolCall):
1. recorded with a result  -> the recorded ToolResult bytes, byte for byte; the tool does not run;
2. running in this process -> wait for that run (a client retry joins it);
3. recorded, no result     -> Refused(ABORTED): invoked before a crash, result never recorded; the caller
                              decides (it is never run twice behind its back);
4. new (seq == next)       -> take an execution slot (bounded wait, bounded queue: back-pressure before
                              anything is logged), log the invocation (durable), run the tool, log the
                              result (durable), only then return it.
A different call at a recorded seq is a conflict; a seq past the next one is a gap.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, NamedTuple

from google.protobuf.message import DecodeError

import wal
from rewards.sandbox import sandbox_pb2 as pb
from rewards.sandbox.tools import TOOL_NAME_RE, TOOLS, Toolbox
from rewards.sandbox.types import MAX_SEQ, ToolOutcome, valid_sandbox_id

ABORTED_DETAIL = "invoked but no result recorded"
LOCK_STRIPES = 64
ENTRIES_PAGE_BYTES = 2 << 20  # an Entries reply stays well under the 4 MiB gRPC message bound


class Refused(Exception):
    """A call the service answers with a gRPC status: `code` is the grpc.StatusCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class EntryView(NamedTuple):
    seq: int
    call: bytes
    result: bytes | None
    in_flight: bool


def encode_result(outcome: ToolOutcome) -> bytes:
    msg = pb.ToolResult(ok=outcome.ok, output=outcome.output, error_kind=outcome.error_kind,
                        error=outcome.error, exit_code=outcome.exit_code, wall_ms=max(outcome.wall_ms, 0))
    return msg.SerializeToString(deterministic=True)


def encode_call(tool: str, args: str, timeout_ms: int) -> bytes:
    return pb.ToolCall(tool=tool, args=args, timeout_ms=timeout_ms).SerializeToString(deterministic=True)


def _check_record(response: bytes, sandbox_id: str, seq: int) -> None:
    """A recorded result must decode before it is handed out (the log's CRC guards the bytes; this the meaning)."""
    try:
        pb.ToolResult.FromString(response)
    except DecodeError:
        raise Refused("DATA_LOSS", f"recorded result of seq {seq} of sandbox {sandbox_id!r} does not decode") from None


class Slots:
    """A bounded pool of execution slots with a bounded queue of waiters (back-pressure)."""

    def __init__(self, n: int, max_queued: int, wait_s: float, first: int = 0):
        # FIFO: the slot idle longest goes first, so its pre-started sandbox has had the most time to boot
        self._free = collections.deque(range(first, first + n))
        self._cond = threading.Condition()
        self._waiting = 0
        self.max_queued, self.wait_s = max_queued, wait_s

    def acquire(self, time_left: float | None) -> int:
        wait = self.wait_s if time_left is None else min(self.wait_s, time_left)
        with self._cond:
            if not self._free:
                if self._waiting >= self.max_queued:
                    raise Refused("RESOURCE_EXHAUSTED", f"all execution slots busy and {self._waiting} calls queued; retry later")
                self._waiting += 1
                try:
                    if not self._cond.wait_for(lambda: self._free, timeout=max(wait, 0)):
                        raise Refused("RESOURCE_EXHAUSTED", f"no execution slot free within {wait:.1f}s; retry later")
                finally:
                    self._waiting -= 1
            return self._free.popleft()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()


class SandboxService:
    """Thread-safe; one instance per process owns the environment log at `log`."""

    def __init__(self, log: wal.EnvLog, toolbox: Toolbox, slots: Slots, entries_page: int = 256):
        self.log, self.toolbox, self.slots = log, toolbox, slots
        self.entries_page = entries_page
        # Striped locks: a fixed number however many sandboxes come and go (every buffer has a bound).
        self._stripes = [threading.Lock() for _ in range(LOCK_STRIPES)]
        self._inflight: dict[tuple[str, int], Future] = {}  # at most max_concurrent entries

    # -- helpers -------------------------------------------------------------------------------------
    def _sandbox_lock(self, sandbox_id: str) -> threading.Lock:
        return self._stripes[hash(sandbox_id) % LOCK_STRIPES]

    def _next(self, sandbox_id: str) -> int:
        """Next seq of `sandbox_id`: one past its last recorded invocation."""
        entries = self.log.entries(sandbox_id)
        return entries[-1].seq + 1 if entries else 0

    @staticmethod
    def validate(sandbox_id: str, seq: int, tool: str, args: str) -> None:
        if not valid_sandbox_id(sandbox_id):
            raise Refused("INVALID_ARGUMENT", "sandbox_id must match [A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
        if not 0 <= seq < MAX_SEQ:
            raise Refused("INVALID_ARGUMENT", f"seq must be in [0, {MAX_SEQ})")
        if not TOOL_NAME_RE.fullmatch(tool):
            raise Refused("INVALID_ARGUMENT", "tool must match [a-z_]{1,32}")
        # An unknown tool or bad args is the model's mistake, not the client's: it is answered as a logged
        # tool error (see Toolbox.run), so the sandbox's seq stays contiguous and a replay answers the same.

    def _lookup(self, sandbox_id: str, seq: int, call: bytes):
        """Under the sandbox lock: ('done', bytes) | ('join', Future) | ('new', None); raises Refused."""
        entry = self.log.get(sandbox_id, seq)
        if entry is not None:
            if entry.request != call:
                raise Refused("FAILED_PRECONDITION", f"conflict: seq {seq} of sandbox {sandbox_id!r} was invoked with a different call")
            if entry.response is not None:
                _check_record(entry.response, sandbox_id, seq)
                return "done", entry.response
            fut = self._inflight.get((sandbox_id, seq))
            if fut is not None:
                return "join", fut
            raise Refused("ABORTED", f"{ABORTED_DETAIL}: seq {seq} of sandbox {sandbox_id!r} was invoked before a "
                                     "crash and its outcome is unknown; it will not be run again (use the next seq)")
        if seq > 0 and self.log.get(sandbox_id, seq - 1) is None:  # O(1) check; the scan only to explain
            raise Refused("FAILED_PRECONDITION", f"seq gap: sandbox {sandbox_id!r} expects seq {self._next(sandbox_id)}, got {seq}")
        if (sandbox_id, seq - 1) in self._inflight:
            raise Refused("FAILED_PRECONDITION", f"seq {seq - 1} of sandbox {sandbox_id!r} is still running; calls of one sandbox are sequential")
        return "new", None

    @staticmethod
    def _wait(fut: Future, time_left: float | None) -> bytes:
        try:
            return fut.result(timeout=time_left)
        except FutureTimeout:
            raise Refused("DEADLINE_EXCEEDED", "the call is still running; retry the same (sandbox, seq) to join it") from None

    # -- API -----------------------------------------------------------------------------------------
    def execute(self, sandbox_id: str, seq: int, tool: str, args: str, timeout_ms: int = 0,
                time_left: Callable[[], float | None] = lambda: None) -> tuple[bytes, bool]:
        """(serialized ToolResult, replayed). Raises Refused for every call it does not answer."""
        self.validate(sandbox_id, seq, tool, args)
        call = encode_call(tool, args, timeout_ms)
        lock = self._sandbox_lock(sandbox_id)
        with lock:
            state, value = self._lookup(sandbox_id, seq, call)
        if state == "done":
            return value, True
        if state == "join":
            return self._wait(value, time_left()), False
        slot = self.slots.acquire(time_left())  # back-pressure before anything is logged
        try:
            with lock:
                state, value = self._lookup(sandbox_id, seq, call)  # it may have changed while we queued
                if state == "new":
                    self.log.invoke(sandbox_id, seq, call)  # durable before the tool runs
                    fut: Future = Future()
                    self._inflight[(sandbox_id, seq)] = fut
            if state == "done":
                return value, True
            if state == "join":
                return self._wait(value, time_left()), False
            try:
                outcome = self.toolbox.run(tool, args, timeout_ms, slot)
                result = encode_result(outcome)
                self.log.result(sandbox_id, seq, result)  # durable before it is returned
                fut.set_result(result)
            except BaseException as exc:  # the entry stays without result: ABORTED for later callers
                fut.set_exception(Refused("INTERNAL", f"tool call or result logging failed: {type(exc).__name__}: {exc}"))
                raise
            finally:
                with lock:
                    self._inflight.pop((sandbox_id, seq), None)
            return result, False
        finally:
            self.slots.release(slot)

    def entries(self, sandbox_id: str, from_seq: int) -> tuple[list[EntryView], int, bool]:
        """One page of recorded entries from `from_seq`: (entries, next_seq, more)."""
        if not valid_sandbox_id(sandbox_id):
            raise Refused("INVALID_ARGUMENT", "sandbox_id must match [A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
        with self._sandbox_lock(sandbox_id):
            rows = self.log.entries(sandbox_id)
            inflight = {s for (sid, s) in list(self._inflight) if sid == sandbox_id}
        nxt = rows[-1].seq + 1 if rows else 0
        rows = [e for e in rows if e.seq >= from_seq]
        page, size = [], 0
        for e in rows[: self.entries_page]:
            size += len(e.request) + len(e.response or b"")
            if page and size > ENTRIES_PAGE_BYTES:
                break
            page.append(EntryView(e.seq, e.request, e.response, e.seq in inflight))
        return page, nxt, len(rows) > len(page)

    def info(self) -> dict:
        return {"tools": list(TOOLS), "isolated": self.toolbox.isolator is not None}


def time_left_of(deadline: float | None) -> Callable[[], float | None]:
    return lambda: None if deadline is None else deadline - time.monotonic()
