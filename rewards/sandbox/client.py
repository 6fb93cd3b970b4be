"""Python client of the sandbox service: deadlines and bounded retries, safe because calls are keyed.

A call is identified by (sandbox_id, seq); the service runs it at most once and answers a repeat with
the recorded result, so retrying after a timeout, a dropped connection or a service restart can never
run a tool twice. What retrying cannot settle is raised: `InvocationAborted` (the call was invoked before
a crash and its outcome is unknown: the caller decides), `SandboxRefused` (bad auth, bad request,
conflict, gap).
"""
from __future__ import annotations

import random
import time
from typing import NamedTuple

import grpc

from rewards import protocol
from rewards.sandbox import sandbox_pb2 as pb
from rewards.sandbox import sandbox_pb2_grpc as pb_grpc

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)


class SandboxRefused(RuntimeError):
    """The service refused the call for a reason retrying does not fix; `.code` is the grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class InvocationAborted(SandboxRefused):
    """(sandbox, seq) was invoked but no result was recorded (the service crashed mid-call)."""


class Result(NamedTuple):
    result: pb.ToolResult
    raw: bytes       # the exact bytes recorded in the environment log
    replayed: bool   # the service returned the recorded result without running the tool

    def text(self) -> str:
        """The result as the tool protocol shows it to the model: output, or 'error: reason'."""
        r = self.result
        return r.output.strip() if r.ok else protocol.ERROR_PREFIX + (r.error or r.error_kind)


class LoggedEntry(NamedTuple):
    seq: int
    call: pb.ToolCall
    result: Result | None  # None: invoked, no result recorded (or still running: in_flight)
    in_flight: bool


class SandboxClient:
    """`timeout_s` bounds each attempt; `retries` bounds the attempts after the first (backoff with jitter)."""

    def __init__(self, target: str, token: str, timeout_s: float = 30.0, retries: int = 5, backoff_s: float = 0.05):
        self.target = target
        self._connect()
        self._metadata = (("authorization", f"Bearer {token}"),)
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def _connect(self) -> None:
        # A restarted service is reached within ~0.1-1 s: gRPC's own reconnect backoff (1 s, growing 1.6x to
        # 120 s) would keep failing calls fast long after the service is back.
        self._channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", 8 << 20),
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1_000)])
        self._stub = pb_grpc.SandboxStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, request, timeout_s: float | None):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        for attempt in range(self.retries + 1):
            try:
                return getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.ABORTED:
                    raise InvocationAborted(code, exc.details()) from None
                if code not in RETRYABLE or attempt == self.retries:
                    raise SandboxRefused(code, exc.details()) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    # A channel whose connection died can stay in its failed state for ~10 s after the service
                    # is back (seen once grpc.aio clients ran in the process): the next attempt gets a fresh one.
                    self._channel.close()
                    self._connect()
            delay = min(self.backoff_s * 2**attempt, 1.0)
            time.sleep(delay * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def execute(self, sandbox_id: str, seq: int, tool: str, args: str, timeout_ms: int = 0,
                deadline_s: float | None = None) -> Result:
        """Run call `seq` of `sandbox_id` (or get its recorded result). Retries are safe: same key, same call."""
        req = pb.ExecuteRequest(sandbox_id=sandbox_id, seq=seq, call=pb.ToolCall(tool=tool, args=args, timeout_ms=timeout_ms))
        resp = self._call("Execute", req, deadline_s)
        return Result(pb.ToolResult.FromString(resp.result), resp.result, resp.replayed)

    def entries(self, sandbox_id: str, from_seq: int = 0) -> tuple[list[LoggedEntry], int]:
        """Every recorded entry of `sandbox_id` from `from_seq` (all pages), and the next seq it accepts."""
        out: list[LoggedEntry] = []
        while True:
            resp = self._call("Entries", pb.EntriesRequest(sandbox_id=sandbox_id, from_seq=from_seq), None)
            for e in resp.entries:
                res = Result(pb.ToolResult.FromString(e.result), e.result, True) if e.has_result else None
                out.append(LoggedEntry(e.seq, pb.ToolCall.FromString(e.call), res, e.in_flight))
            if not resp.more or not resp.entries:
                return out, resp.next_seq
            from_seq = resp.entries[-1].seq + 1

    def info(self) -> pb.InfoResponse:
        return self._call("Info", pb.InfoRequest(), None)


class SandboxSession:
    """One sandbox seen by one trajectory: keeps the next seq; `fast_forward` resumes after a restart."""

    def __init__(self, client: SandboxClient, sandbox_id: str, next_seq: int = 0):
        self.client, self.sandbox_id, self.next_seq = client, sandbox_id, next_seq

    def fast_forward(self) -> list[LoggedEntry]:
        """Load the sandbox's recorded history and continue after it; returns the history."""
        history, self.next_seq = self.client.entries(self.sandbox_id)
        return history

    def call(self, tool: str, args: str, timeout_ms: int = 0) -> Result:
        """Call `next_seq`; InvocationAborted leaves next_seq where it is: the caller decides (see skip)."""
        res = self.client.execute(self.sandbox_id, self.next_seq, tool, args, timeout_ms)
        self.next_seq += 1
        return res

    def skip(self) -> None:
        """Move past an aborted call: its outcome stays unknown and it is never run again."""
        self.next_seq += 1

    def run_call(self, call: protocol.Call) -> str:
        """Answer a protocol call (`<call>calc: 37*41</call>`) with the text to put in `<result>`."""
        return self.call(call.tool, call.args).text()
