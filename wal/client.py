"""RemoteWAL: the TokenLog interface over the gRPC log service, with reconnect and idempotent retry.

`append` validates and packs locally and queues the chunk; `commit` sends the queued chunks as one
AppendRequest(commit=true) on the append stream and waits for its acknowledgement. If the stream
breaks (server restart, network), the client reconnects and resends every request not yet
acknowledged; the server treats exact repeats as no-ops, so a retry neither loses nor duplicates a
token. Errors that retrying cannot fix (gap, rewrite, finalized, malformed) raise the matching wal
exception and drop the queued chunks of that batch. Retries are bounded by `retry_s`.
"""
from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from typing import Sequence

import grpc

from wal import codec
from wal import wal_pb2 as pb
from wal.base import TokenLog
from wal.errors import ConflictError, FinalizedError, GapError, LogClosedError, RemoteError, WALError
from wal.server import ERROR_KEY, SERVICE
from wal.store import _index

_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
          grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
_ERRORS = {"GapError": GapError, "ConflictError": ConflictError, "FinalizedError": FinalizedError,
           "CodecError": codec.CodecError}
_END = object()
_MAX_UNACKED = 16  # requests held for resending before an append forces a commit


class AuthError(WALError, PermissionError):
    """The service refused the shared secret."""


def _to_exception(err: grpc.RpcError) -> Exception:
    kind = dict(err.trailing_metadata() or ()).get(ERROR_KEY, "")
    code, details = err.code(), err.details()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(details)
    if kind in _ERRORS:
        return _ERRORS[kind](details)
    return RemoteError(f"WAL service: {code.name}: {details}")


class RemoteWAL(TokenLog):
    def __init__(self, address: str, token: str | None = None, *, retry_s: float = 60.0,
                 max_message_bytes: int = 16 << 20, max_pending_bytes: int = 4 << 20):
        self.address = address
        self.retry_s = retry_s
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self._max_msg = max_message_bytes
        self._max_pending = min(max_pending_bytes, max_message_bytes // 2)
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1_000),
            ("grpc.enable_retries", 0)])  # resending after a reconnect is ours; C-core's retry buffering only costs CPU
        ser = lambda m: m.SerializeToString()  # noqa: E731
        self._append_rpc = self._channel.stream_stream(f"/{SERVICE}/Append", request_serializer=ser,
                                                       response_deserializer=pb.AppendAck.FromString)
        self._unary = {name: self._channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=ser, response_deserializer=out.FromString)
                       for name, out in (("Read", pb.ReadReply), ("Trajectories", pb.TrajectoriesReply),
                                         ("Finalize", pb.CommitReply), ("Stats", pb.StatsReply))}
        self._lock = threading.Lock()
        self._batch_ids = itertools.count(1)
        self._chunks: list[pb.TokenChunk] = []
        self._chunk_bytes = 0
        self._unacked: list[pb.AppendRequest] = []  # sent (or to send) on the current stream, not yet acknowledged
        self._stream = None
        self._requests: queue.Queue | None = None
        self._closed = False
        self.reconnects = 0

    # --- append stream ---
    def append(self, traj_id: str, start: int, tokens: Sequence[int], logprobs: Sequence[float], policy_version: int) -> int:
        tok = codec.pack_tokens(tokens)
        n = len(tok) // 4
        lp = codec.pack_logprobs(logprobs, n)
        start, policy_version = _index(start, "start"), _index(policy_version, "policy_version")
        if start < 0:
            raise GapError(f"trajectory {traj_id!r}: start {start} is negative")
        if policy_version < 0:
            raise codec.CodecError(f"policy_version must be >= 0, got {policy_version}")
        codec._id_bytes(traj_id, "traj_id")
        with self._lock:
            self._check_open()
            self._chunks.append(pb.TokenChunk(traj_id=traj_id, start=start, policy_version=policy_version, tokens=tok, logprobs=lp))
            self._chunk_bytes += len(tok) + len(lp) + len(traj_id) + 32
            if self._chunk_bytes >= self._max_pending:
                if len(self._unacked) >= _MAX_UNACKED:
                    self._commit_locked()  # bound what is held for resending
                else:
                    self._send(commit=False)  # stream it now; the ack of the next commit covers it
        return start + n

    def append_step(self, traj_ids: Sequence[str], positions: Sequence[int], tokens: Sequence[int],
                    logprobs: Sequence[float], policy_version: int) -> None:
        """One batched decode step, queued as one-token chunks (packed once)."""
        tok = codec.pack_tokens(tokens)
        n = len(tok) // 4
        lp = codec.pack_logprobs(logprobs, n)
        if len(traj_ids) != n or len(positions) != n:
            raise codec.CodecError(f"append_step: {len(traj_ids)} trajectory ids, {len(positions)} positions, {n} tokens; "
                                   f"there must be one of each per trajectory")
        starts = [_index(p, "position") for p in positions]
        policy_version = _index(policy_version, "policy_version")
        if policy_version < 0 or (starts and min(starts) < 0):
            raise codec.CodecError("positions and policy_version must be >= 0")
        for t in traj_ids:
            codec._id_bytes(t, "traj_id")
        chunk = pb.TokenChunk
        with self._lock:
            self._check_open()
            self._chunks.extend(chunk(traj_id=t, start=starts[i], policy_version=policy_version,
                                      tokens=tok[i * 4:i * 4 + 4], logprobs=lp[i * 8:i * 8 + 8])
                                for i, t in enumerate(traj_ids))
            self._chunk_bytes += 12 * n + sum(len(t) + 32 for t in traj_ids)
            if self._chunk_bytes >= self._max_pending:
                if len(self._unacked) >= _MAX_UNACKED:
                    self._commit_locked()
                else:
                    self._send(commit=False)

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosedError(f"connection to WAL service {self.address} is closed")

    def _open_stream(self) -> None:
        self._requests = q = queue.Queue()

        def gen():
            while True:
                item = q.get()
                if item is _END:
                    return
                yield item

        self._stream = self._append_rpc(gen(), metadata=self._md)
        for req in self._unacked:  # resend what the broken stream never acknowledged
            q.put(req)

    def _send(self, commit: bool) -> pb.AppendRequest:
        req = pb.AppendRequest(batch_id=next(self._batch_ids), chunks=self._chunks, commit=commit)
        self._chunks, self._chunk_bytes = [], 0
        self._unacked.append(req)
        if self._stream is None:
            self._open_stream()
        else:
            self._requests.put(req)
        return req

    def commit(self) -> int:
        with self._lock:
            self._check_open()
            return self._commit_locked()

    def _commit_locked(self) -> int:
        """Send the queued chunks with commit=true and wait for the ack, reconnecting and resending as needed."""
        req = self._send(commit=True)
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                ack = next(self._stream)
                if ack.batch_id != req.batch_id:
                    raise RemoteError(f"WAL service acknowledged batch {ack.batch_id}, expected {req.batch_id}")
                self._unacked.clear()
                return ack.durable_lsn
            except (grpc.RpcError, StopIteration) as exc:
                self._drop_stream()
                if isinstance(exc, grpc.RpcError) and exc.code() not in _RETRY:
                    self._unacked.clear()
                    raise _to_exception(exc) from None
                self._await_server(deadline, exc)
                self.reconnects += 1
                self._open_stream()

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._requests.put(_END)
            self._stream.cancel()
        self._stream = self._requests = None

    def _await_server(self, deadline: float, exc: BaseException) -> None:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise grpc.FutureTimeoutError()
            grpc.channel_ready_future(self._channel).result(timeout=remaining)
        except grpc.FutureTimeoutError:
            self._unacked.clear()
            raise RemoteError(f"WAL service {self.address} unreachable for {self.retry_s:.0f}s "
                              f"(last error: {getattr(exc, 'details', lambda: exc)()}); unacknowledged appends were not confirmed") from None

    # --- unary calls, retried while the server is unreachable ---
    def _call(self, name: str, request):
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                return self._unary[name](request, metadata=self._md, wait_for_ready=True,
                                         timeout=max(0.1, deadline - time.monotonic()))
            except grpc.RpcError as exc:
                if exc.code() not in _RETRY or time.monotonic() >= deadline:
                    raise _to_exception(exc) from None
                time.sleep(0.05)

    def _read(self, traj_id: str) -> tuple[bytes, bytes, list[int]]:
        tok, lp, versions = [], [], []
        pos, length = 0, None
        while length is None or pos < length:
            rep = self._call("Read", pb.ReadRequest(traj_id=traj_id, from_position=pos))
            length = rep.committed_length if length is None else length
            if rep.from_position != pos or (not rep.tokens and pos < length):
                break  # the trajectory was finalized or shrank under us: return what was read consistently
            tok.append(rep.tokens)
            lp.append(rep.logprobs)
            versions.extend(rep.policy_versions)
            pos += len(rep.tokens) // 4
        return b"".join(tok), b"".join(lp), versions

    def tokens(self, traj_id: str) -> list[int]:
        return codec.unpack_tokens(self._read(traj_id)[0])

    def logprobs(self, traj_id: str) -> list[float]:
        return codec.unpack_logprobs(self._read(traj_id)[1])

    def policy_versions(self, traj_id: str) -> list[int]:
        return self._read(traj_id)[2]

    def length(self, traj_id: str) -> int:
        rep = self._call("Read", pb.ReadRequest(traj_id=traj_id, from_position=2**63))
        return rep.committed_length

    def trajectories(self) -> list[str]:
        return list(self._call("Trajectories", pb.TrajectoriesRequest()).traj_ids)

    def finalize(self, traj_id: str) -> None:
        with self._lock:
            pending = bool(self._chunks) or bool(self._unacked)
        if pending:
            self.commit()  # appends before a finalize must land before it
        self._call("Finalize", pb.FinalizeRequest(traj_id=traj_id))

    def stats(self) -> dict:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._chunks:
                self.commit()
        finally:
            with self._lock:
                self._closed = True
                self._drop_stream()
                self._channel.close()
