"""The gRPC shell around SandboxService: shared-secret auth, bounded messages, status codes, serve().

Auth: every RPC carries metadata `authorization: Bearer <token>`; a missing or wrong token is
UNAUTHENTICATED (compared in constant time). Requests above `max_request_bytes` are refused by gRPC
itself (RESOURCE_EXHAUSTED) before any handler runs.
"""
from __future__ import annotations

import hmac
import os
import secrets
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import NamedTuple

import grpc

import wal
from core.errors import UserError
from wal.errors import ConflictError, GapError, LogClosedError, WALError
from rewards.sandbox import sandbox_pb2 as pb
from rewards.sandbox import sandbox_pb2_grpc as pb_grpc
from rewards.sandbox.config import RESPONSE_LIMIT_BYTES, SandboxConfig
from rewards.sandbox.isolation import Isolator, probe
from rewards.sandbox.service import Refused, SandboxService, Slots
from rewards.sandbox.tools import Toolbox

TOKEN_ENV = "POSTRAIN_SANDBOX_TOKEN"
TOKEN_FILE = "token"


def _abort_unauthenticated(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong sandbox token (metadata 'authorization: Bearer <token>')")


class TokenAuth(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()
        self._deny = grpc.unary_unary_rpc_method_handler(_abort_unauthenticated)

    def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode(), self._expected):
            return continuation(handler_call_details)
        return self._deny


def _wal_status(exc: WALError) -> grpc.StatusCode:
    if isinstance(exc, (ConflictError, GapError)):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, LogClosedError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class _Undecodable(NamedTuple):
    """A request that did not parse: the handler answers INVALID_ARGUMENT, naming why."""

    why: str


def _parse(message):
    """The request deserializer: a message, or `_Undecodable` (gRPC's own answered INTERNAL, naming nothing)."""
    def parse(raw: bytes):
        try:
            return message.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError, and invalid UTF-8 in a string field
            return _Undecodable(f"{message.__name__} does not parse: {type(exc).__name__}: {exc}"[:300])
    return parse


def _handlers(servicer) -> grpc.GenericRpcHandler:
    """The service's methods, their requests parsed by `_parse`."""
    def method(fn, request):
        def handle(req, context):
            if isinstance(req, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, req.why)
            return fn(req, context)
        return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=_parse(request),
                                                   response_serializer=lambda m: m.SerializeToString())
    return grpc.method_handlers_generic_handler("postrain.sandbox.Sandbox", {
        "Execute": method(servicer.Execute, pb.ExecuteRequest),
        "Entries": method(servicer.Entries, pb.EntriesRequest),
        "Info": method(servicer.Info, pb.InfoRequest),
    })


class Servicer(pb_grpc.SandboxServicer):
    def __init__(self, service: SandboxService, cfg: SandboxConfig):
        self.service, self.cfg = service, cfg

    def _run(self, context, fn):
        try:
            return fn()
        except Refused as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except WALError as exc:
            context.abort(_wal_status(exc), f"environment log: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bug or an I/O error: a clear status, not UNKNOWN
            context.abort(grpc.StatusCode.INTERNAL, f"sandbox service: {type(exc).__name__}: {exc}")

    def Execute(self, request, context):
        call = request.call

        def go():
            result, replayed = self.service.execute(request.sandbox_id, request.seq, call.tool, call.args,
                                                    call.timeout_ms, context.time_remaining)
            return pb.ExecuteResponse(result=result, replayed=replayed)

        if not request.HasField("call"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request has no call")
        return self._run(context, go)

    def Entries(self, request, context):
        def go():
            views, nxt, more = self.service.entries(request.sandbox_id, request.from_seq)
            rows = [pb.Entry(seq=v.seq, call=v.call, result=v.result or b"", has_result=v.result is not None,
                             in_flight=v.in_flight) for v in views]
            return pb.EntriesResponse(entries=rows, next_seq=nxt, more=more)

        return self._run(context, go)

    def Info(self, request, context):
        cfg = self.cfg
        return pb.InfoResponse(tools=self.service.info()["tools"], max_concurrent=cfg.max_concurrent,
                               max_queued=cfg.max_queued, max_request_bytes=cfg.max_request_bytes,
                               max_output_bytes=cfg.output_bytes, isolated=self.service.toolbox.isolator is not None)


MIN_TOKEN_CHARS = 16


def resolve_token(token: str | None, log_dir: Path) -> str:
    """The shared secret: --token, else $POSTRAIN_SANDBOX_TOKEN, else LOG_DIR/token (made 0600 if absent,
    whole or not at all: written to a temporary file, synced, then linked into place). A secret shorter
    than MIN_TOKEN_CHARS is refused: an empty one would let `Bearer ` in."""
    where = "--token" if token else f"${TOKEN_ENV}"
    token = token or os.environ.get(TOKEN_ENV)
    path = Path(log_dir) / TOKEN_FILE
    if not token:
        where = str(path)
        if not path.exists():
            tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # never over a token another process made meanwhile
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        token = path.read_text()
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise UserError(f"sandbox token from {where} has {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed "
                        f"(an empty file is left by a crash while it was written: delete it and a new one is made)")
    return token


class SandboxServer:
    """A running service: `.port`, `.stop()`. Owns its env log (opened at LOG_DIR/envlog)."""

    def __init__(self, cfg: SandboxConfig, token: str | None = None):
        self.cfg = cfg
        log_dir = Path(cfg.log_dir).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.token = resolve_token(token, log_dir)
        python = os.path.realpath(sys.executable)
        self.isolator = None
        if cfg.require_isolation or probe() is None:
            self.isolator = Isolator(hidden=[log_dir], allow_weaker=cfg.allow_weaker_isolation,
                                     memory_cgroup=cfg.memory_cgroup)
            if self.isolator.missing:
                print("sandbox: WEAKER isolation, missing: " + "; ".join(self.isolator.missing), file=sys.stderr)
            if self.isolator.memory_note and cfg.memory_cgroup != "off" and cfg.memory_mb:
                print(f"sandbox: {self.isolator.memory_note}", file=sys.stderr)
        else:
            print(f"sandbox: WITHOUT isolation ({probe()}): calc runs in-process, python is refused", file=sys.stderr)
        self.log = wal.open_envlog(log_dir / "envlog")
        toolbox = Toolbox(log_dir, self.isolator, cfg.limits(), python, slots=cfg.max_concurrent,
                          isolate_pure=cfg.isolate_pure_tools, first_slot=cfg.first_slot)
        self.toolbox = toolbox
        self.service = SandboxService(self.log, toolbox, Slots(cfg.max_concurrent, cfg.max_queued, cfg.queue_wait_s,
                                                               cfg.first_slot), cfg.entries_page)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.rpc_threads, thread_name_prefix="sandbox-rpc"),
            interceptors=[TokenAuth(self.token)],
            options=[("grpc.max_receive_message_length", cfg.max_request_bytes),
                     ("grpc.max_send_message_length", RESPONSE_LIMIT_BYTES),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=cfg.max_concurrent + cfg.max_queued + 32,
        )
        self._server.add_generic_rpc_handlers((_handlers(Servicer(self.service, cfg)),))
        try:
            self.port = self._server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        except RuntimeError:  # grpc raises this when the address is taken
            self.port = 0
        if self.port == 0:
            self._close_parts()
            raise OSError(f"cannot bind {cfg.host}:{cfg.port} (address in use?)")
        self._server.start()
        self._stopped = threading.Event()

    @property
    def target(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    def wait(self) -> None:
        self._server.wait_for_termination()

    def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._server.stop(grace_s).wait()
        self._close_parts()

    def _close_parts(self) -> None:
        self.toolbox.close()
        if self.isolator is not None:
            self.isolator.close()
        self.log.close()
