"""gRPC log service: a TokenWAL behind `postrain wal serve`.

- Append is a bidirectional stream: each AppendRequest carries many chunks; with commit=true the reply
  (AppendAck) comes once everything up to it is durable and carries the durable lsn. Streams of many
  clients run on their own server threads and share the log's group commit.
- Errors come back as gRPC statuses with a `wal-error` trailer naming the wal exception:
  FAILED_PRECONDITION (gap, rewrite, finalized), INVALID_ARGUMENT (malformed message or payload),
  UNAUTHENTICATED (missing or wrong shared secret), RESOURCE_EXHAUSTED (message over the size bound,
  enforced by gRPC itself). Chunks before a failing one are committed before the status is sent.
- Requests are parsed inside the handlers (raw bytes in), so a malformed message gets a clear
  INVALID_ARGUMENT instead of gRPC's generic deserialisation error.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
from concurrent import futures
from pathlib import Path

from google.protobuf.message import DecodeError

from wal import codec
from wal import wal_pb2 as pb
from wal.config import ServeConfig, WALConfig
from wal.errors import ConflictError, FinalizedError, GapError, LogClosedError, WALError
from wal.grpc_poller import grpc
from wal.tokenwal import TokenWAL

SERVICE = "postrain.wal.v1.TokenLog"
ERROR_KEY = "wal-error"
log = logging.getLogger("wal.server")


def _abort(context, code, kind: str, message: str):
    context.set_trailing_metadata(((ERROR_KEY, kind),))
    context.abort(code, message)


def _parse(cls, raw: bytes, context):
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "CodecError", f"malformed {cls.__name__}: {exc}")


class TokenLogService:
    def __init__(self, wal: TokenWAL, serve: ServeConfig):
        self.wal = wal
        self.serve = serve

    def _fail(self, context, exc: Exception):
        if isinstance(exc, (GapError, ConflictError, FinalizedError)):
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, type(exc).__name__, str(exc))
        if isinstance(exc, codec.CodecError):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "CodecError", str(exc))
        if isinstance(exc, LogClosedError):
            _abort(context, grpc.StatusCode.UNAVAILABLE, "LogClosedError", str(exc))
        raise exc

    def Append(self, request_iterator, context):
        for raw in request_iterator:
            req = _parse(pb.AppendRequest, raw, context)
            for i, ch in enumerate(req.chunks):
                try:
                    tok = ch.tokens
                    if len(tok) % 4:
                        raise codec.CodecError(f"chunk {i}: tokens field is {len(tok)} bytes, not a multiple of 4 (int32 LE)")
                    if len(ch.logprobs) != len(tok) * 2:
                        raise codec.CodecError(f"chunk {i}: {len(ch.logprobs)} bytes of logprobs for {len(tok) // 4} tokens "
                                               f"(want 8 bytes, float64 LE, per token)")
                    self.wal.append_packed(ch.traj_id, ch.start, tok, ch.logprobs, ch.policy_version)  # no conversions
                except (WALError, codec.CodecError) as exc:
                    try:
                        self.wal.commit()  # what came before the bad chunk is durable, so the client knows where it stands
                    except WALError:
                        pass
                    self._fail(context, type(exc)(f"batch {req.batch_id} chunk {i}: {exc}"))
            if req.commit:
                try:
                    durable = self.wal.commit()
                except WALError as exc:
                    self._fail(context, exc)
                yield pb.AppendAck(batch_id=req.batch_id, durable_lsn=durable)

    def Read(self, raw, context):
        req = _parse(pb.ReadRequest, raw, context)
        lo = req.from_position
        try:
            tok, lp, versions, n = self.wal.read_packed(req.traj_id, lo, lo + self.serve.max_read_tokens)
        except WALError as exc:
            self._fail(context, exc)
        return pb.ReadReply(tokens=tok, logprobs=lp, policy_versions=versions, from_position=min(lo, n), committed_length=n)

    def Trajectories(self, raw, context):
        _parse(pb.TrajectoriesRequest, raw, context)
        return pb.TrajectoriesReply(traj_ids=self.wal.trajectories())

    def Finalize(self, raw, context):
        req = _parse(pb.FinalizeRequest, raw, context)
        try:
            self.wal.finalize(req.traj_id)
            return pb.CommitReply(durable_lsn=self.wal.commit())
        except (WALError, codec.CodecError) as exc:
            self._fail(context, exc)

    def Stats(self, raw, context):
        _parse(pb.StatsRequest, raw, context)
        return pb.StatsReply(json=json.dumps(self.wal.stats()))

    def handler(self) -> grpc.GenericRpcHandler:
        ser = lambda m: m.SerializeToString()  # noqa: E731
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Append": grpc.stream_stream_rpc_method_handler(self.Append, response_serializer=ser),
            "Read": grpc.unary_unary_rpc_method_handler(self.Read, response_serializer=ser),
            "Trajectories": grpc.unary_unary_rpc_method_handler(self.Trajectories, response_serializer=ser),
            "Finalize": grpc.unary_unary_rpc_method_handler(self.Finalize, response_serializer=ser),
            "Stats": grpc.unary_unary_rpc_method_handler(self.Stats, response_serializer=ser),
        })


class _Auth(grpc.ServerInterceptor):
    """Shared-secret auth: every call must carry `authorization: Bearer <token>` metadata."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "AuthError",
                   "missing or wrong WAL service token (pass token=... to wal.connect)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode(), self._expected):
            return continuation(details)
        return self._deny_stream if details.method.endswith("/Append") else self._deny_unary


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))


class Server:
    """A running log service; `port` is the bound port (useful with port 0)."""

    def __init__(self, directory: str | Path, serve: ServeConfig | None = None, wal_config: WALConfig | None = None,
                 token: str | None = None, repair: bool = False):
        self.serve = serve = serve or ServeConfig()
        if not token and not _is_loopback(serve.host):
            raise ValueError(f"refusing to serve the WAL on non-loopback host {serve.host!r} without a token (--token)")
        self.wal = TokenWAL(directory, wal_config, repair=repair)
        interceptors = [_Auth(token)] if token else []
        opts = [("grpc.max_receive_message_length", serve.max_message_bytes),
                ("grpc.max_send_message_length", serve.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=serve.max_workers, thread_name_prefix="wal-rpc"),
                                   handlers=[TokenLogService(self.wal, serve).handler()], interceptors=interceptors,
                                   options=opts, maximum_concurrent_rpcs=serve.max_workers)
        host = f"[{serve.host}]" if ":" in serve.host else serve.host
        try:
            self.port = self._server.add_insecure_port(f"{host}:{serve.port}")
        except RuntimeError as exc:
            self.wal.close()
            raise OSError(f"cannot bind {serve.host}:{serve.port}: {exc}") from None
        self._server.start()
        self.address = f"{serve.host}:{self.port}"

    def wait(self) -> None:
        self._server.wait_for_termination()

    def stop(self, grace_s: float = 2.0) -> None:
        self._server.stop(grace_s).wait()
        self.wal.close()
