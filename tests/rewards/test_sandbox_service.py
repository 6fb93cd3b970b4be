"""The sandbox service over real gRPC: replay byte for byte, auth, malformed input, back-pressure, retries."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from rewards import protocol
from rewards.sandbox import sandbox_pb2 as pb
from rewards.sandbox import sandbox_pb2_grpc as pb_grpc
from rewards.sandbox.client import InvocationAborted, SandboxClient, SandboxRefused, SandboxSession
from rewards.sandbox.isolation import probe

TOKEN = "service-token-0123456789"
needs_bwrap = pytest.mark.skipif(probe() is not None, reason=f"sandbox isolation unavailable: {probe()}")


def _server(tmp_path, **kw):
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import SandboxServer

    return SandboxServer(SandboxConfig(log_dir=tmp_path, **kw), token=TOKEN)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if probe() is not None:
        pytest.skip(f"sandbox isolation unavailable: {probe()}")
    srv = _server(tmp_path_factory.mktemp("svc"), max_concurrent=4)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with SandboxClient(server.target, TOKEN, timeout_s=30, retries=0) as c:
        yield c


def _raw_execute(server, token, request, timeout=10):
    channel = grpc.insecure_channel(server.target)
    try:
        stub = pb_grpc.SandboxStub(channel)
        md = () if token is None else (("authorization", f"Bearer {token}"),)
        return stub.Execute(request, timeout=timeout, metadata=md)
    finally:
        channel.close()


def _request(sid="s", seq=0, tool="calc", args="1+1"):
    return pb.ExecuteRequest(sandbox_id=sid, seq=seq, call=pb.ToolCall(tool=tool, args=args))


def test_calc_and_replay_byte_for_byte(client, server):
    first = client.execute("replay", 0, "calc", "37*41")
    assert first.result.ok and first.result.output.strip() == "1517" and not first.replayed
    err = client.execute("replay", 1, "calc", "1/0")
    assert not err.result.ok and err.result.error == "division by zero" and err.text() == "error: division by zero"
    count = client.execute("replay", 2, "counter", "replay")
    again = [client.execute("replay", 0, "calc", "37*41"), client.execute("replay", 1, "calc", "1/0"),
             client.execute("replay", 2, "counter", "replay")]
    for original, repeat in zip([first, err, count], again):
        assert repeat.replayed
        assert repeat.raw == original.raw  # the recorded bytes, not a re-execution
    assert server.service.toolbox.read_counter("replay") == 1
    entries, nxt = client.entries("replay")
    assert nxt == 3 and [e.seq for e in entries] == [0, 1, 2]
    assert [e.result.raw for e in entries] == [first.raw, err.raw, count.raw]
    assert entries[0].call.tool == "calc" and entries[0].call.args == "37*41"


def test_session_fast_forward_and_protocol_calls(client):
    s = SandboxSession(client, "ff")
    assert s.run_call(protocol.Call("calc", "6*7")) == "42"
    assert s.call("counter", "ff").result.output == "1"
    resumed = SandboxSession(client, "ff")  # e.g. a new rollout worker after a preemption
    history = resumed.fast_forward()
    assert resumed.next_seq == 2 and [h.result.result.output.strip() for h in history] == ["42", "1"]
    assert resumed.call("counter", "ff").result.output == "2"


def test_conflict_and_gap_are_refused(client):
    client.execute("cg", 0, "calc", "2+2")
    with pytest.raises(SandboxRefused) as exc:
        client.execute("cg", 0, "calc", "2+3")
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and "conflict" in exc.value.details
    with pytest.raises(SandboxRefused) as exc:
        client.execute("cg", 5, "calc", "1")
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and "expects seq 1" in exc.value.details
    assert client.entries("cg")[1] == 1  # nothing was logged for the refused calls


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_bad_auth_is_refused(server, token):
    with pytest.raises(grpc.RpcError) as exc:
        _raw_execute(server, token, _request(sid="auth"))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in exc.value.details()
    assert server.log.get("auth", 0) is None


@pytest.mark.parametrize("request_, code, words", [
    (_request(sid=""), grpc.StatusCode.INVALID_ARGUMENT, "sandbox_id"),
    (_request(sid="a b/c"), grpc.StatusCode.INVALID_ARGUMENT, "sandbox_id"),
    (_request(sid="x" * 200), grpc.StatusCode.INVALID_ARGUMENT, "sandbox_id"),
    (_request(seq=2**63), grpc.StatusCode.INVALID_ARGUMENT, "seq"),
    (_request(tool="../bin/sh"), grpc.StatusCode.INVALID_ARGUMENT, "tool must match"),
    (_request(tool=""), grpc.StatusCode.INVALID_ARGUMENT, "tool must match"),
    (_request(tool="python", args="x" * (1 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    (pb.ExecuteRequest(sandbox_id="nocall", seq=0), grpc.StatusCode.INVALID_ARGUMENT, "no call"),
])
def test_malformed_requests_are_refused(server, request_, code, words):
    with pytest.raises(grpc.RpcError) as exc:
        _raw_execute(server, TOKEN, request_)
    assert exc.value.code() == code
    assert words in exc.value.details()


@pytest.mark.parametrize("raw,words", [
    (b"\xff\xff\xff\xff", "ExecuteRequest does not parse"),  # not a message
    (b"\x0a\x02\xc3\x28", "ExecuteRequest does not parse"),  # sandbox_id of invalid UTF-8
    (pb.ExecuteRequest(sandbox_id="s", seq=1).SerializeToString()[:-1] + b"\x0a\x09ab", "does not parse"),  # cut short
])
def test_bytes_that_are_no_request_are_refused_as_invalid(server, raw, words):
    """Bytes that do not parse as the request: INVALID_ARGUMENT naming it, where gRPC answered INTERNAL
    ('Exception deserializing request!'); nothing is logged and the service goes on."""
    channel = grpc.insecure_channel(server.target)
    try:
        call = channel.unary_unary("/postrain.sandbox.Sandbox/Execute")
        with pytest.raises(grpc.RpcError) as exc:
            call(raw, timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
    finally:
        channel.close()
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in exc.value.details()
    assert not _raw_execute(server, TOKEN, _request(sid=f"after-{raw.hex()[:16]}")).replayed  # the service goes on


def test_bad_tool_input_is_a_logged_tool_error(client, server):
    """The model's mistakes (unknown tool, bad args) are answered, logged and replayed like any result."""
    cases = [("rm", "-rf /", "unknown tool"), ("calc", "1+" * 200, "longer than"),
             ("counter", "../../etc", "NAME"), ("python", "x" * 20000, "longer than")]
    for seq, (tool, args, words) in enumerate(cases):
        res = client.execute("badargs", seq, tool, args)
        assert not res.result.ok and res.result.error_kind == "tool_error" and words in res.result.error
        assert client.execute("badargs", seq, tool, args).raw == res.raw
    assert client.entries("badargs")[1] == len(cases)
    assert client.execute("badargs", len(cases), "calc", "2*2").result.output.strip() == "4"  # seq stays contiguous


def test_back_pressure_refuses_before_logging(tmp_path):
    if probe() is not None:
        pytest.skip(probe())
    srv = _server(tmp_path, max_concurrent=1, max_queued=0)
    try:
        with SandboxClient(srv.target, TOKEN, retries=0) as c:
            holder = threading.Thread(target=c.execute, args=("busy", 0, "counter", "bp 2000"))
            holder.start()
            deadline = time.monotonic() + 20
            while not any(e.in_flight for e in c.entries("busy")[0]) and time.monotonic() < deadline:
                time.sleep(0.02)  # until the holder owns the only slot
            with pytest.raises(SandboxRefused) as exc:
                c.execute("other", 0, "calc", "1+1")
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert srv.log.get("other", 0) is None  # refused before anything was logged
            holder.join()
            # with retries the same call gets through once the slot is free
            with SandboxClient(srv.target, TOKEN, retries=8, backoff_s=0.1) as patient:
                assert patient.execute("other", 0, "calc", "1+1").result.output.strip() == "2"
    finally:
        srv.stop()


def test_client_retry_after_deadline_joins_the_running_call(client, server):
    # each attempt's deadline (0.3 s) is shorter than the call (1.2 s): the retries must join, not re-run
    with SandboxClient(server.target, TOKEN, timeout_s=0.3, retries=20, backoff_s=0.05) as impatient:
        res = impatient.execute("join", 0, "counter", "join 1200")
    assert res.result.ok and res.result.output == "1"
    assert server.service.toolbox.read_counter("join") == 1
    assert client.execute("join", 0, "counter", "join 1200").raw == res.raw


def test_info(client):
    info = client.info()
    assert list(info.tools) == ["calc", "python", "counter"] and info.isolated and info.max_concurrent == 4


def test_aborted_is_reported_not_rerun(tmp_path):
    """An invocation logged without result (as after a crash) is ABORTED, never run."""
    if probe() is not None:
        pytest.skip(probe())
    import wal
    from rewards.sandbox.service import encode_call

    log = wal.open_envlog(tmp_path / "envlog")
    log.invoke("crashed", 0, encode_call("counter", "ab", 0))
    log.close()
    srv = _server(tmp_path)
    try:
        with SandboxClient(srv.target, TOKEN, retries=3) as c:
            with pytest.raises(InvocationAborted) as exc:
                c.execute("crashed", 0, "counter", "ab")
            assert exc.value.code == grpc.StatusCode.ABORTED and "invoked but no result recorded" in exc.value.details
            assert srv.service.toolbox.read_counter("ab") == 0
            entries, nxt = c.entries("crashed")
            assert nxt == 1 and entries[0].result is None and not entries[0].in_flight
            assert c.execute("crashed", 1, "counter", "ab").result.output == "1"  # the caller moved on
    finally:
        srv.stop()


def test_entries_are_paged(tmp_path):
    if probe() is not None:
        pytest.skip(probe())
    srv = _server(tmp_path, entries_page=2)
    try:
        with SandboxClient(srv.target, TOKEN) as c:
            raws = [c.execute("paged", seq, "counter", "paged").raw for seq in range(5)]
            entries, nxt = c.entries("paged")  # three pages of at most two
            assert nxt == 5 and [e.result.raw for e in entries] == raws
            assert [e.seq for e in c.entries("paged", from_seq=3)[0]] == [3, 4]
            page = srv.service.entries("paged", 0)
            assert len(page[0]) == 2 and page[2] is True
    finally:
        srv.stop()


def test_toolbox_without_isolation_runs_only_the_pure_calculator(tmp_path):
    from rewards.sandbox.tools import Toolbox
    from rewards.sandbox.types import Limits

    tb = Toolbox(tmp_path, None, Limits(), python="/nonexistent")
    assert tb.run("calc", "37*41", 0, 0).output == "1517"
    assert tb.run("calc", "1/0", 0, 0).error == "division by zero"
    res = tb.run("python", "print(1)", 0, 0)
    assert not res.ok and "bubblewrap" in res.error
    assert tb.run("counter", "n", 0, 0).output == "1"


def test_undecodable_recorded_result_is_data_loss(tmp_path):
    if probe() is not None:
        pytest.skip(probe())
    import wal
    from rewards.sandbox.service import encode_call

    log = wal.open_envlog(tmp_path / "envlog")
    log.invoke("bad", 0, encode_call("calc", "1+1", 0))
    log.result("bad", 0, b"\xff\xff\xff")  # not a ToolResult
    log.close()
    srv = _server(tmp_path)
    try:
        with SandboxClient(srv.target, TOKEN, retries=0) as c:
            with pytest.raises(SandboxRefused) as exc:
                c.execute("bad", 0, "calc", "1+1")
            assert exc.value.code == grpc.StatusCode.DATA_LOSS and "does not decode" in exc.value.details
    finally:
        srv.stop()


def test_concurrent_duplicates_run_once_and_next_seq_waits(client, server):
    """Two callers send the same (sandbox, seq) at once: one runs it, the other joins; seq+1 meanwhile is refused."""
    out = []
    threads = [threading.Thread(target=lambda: out.append(client.execute("dup", 0, "counter", "dup 800")))
               for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while not any(e.in_flight for e in client.entries("dup")[0]) and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(SandboxRefused) as exc:
        client.execute("dup", 1, "calc", "1+1")
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and "still running" in exc.value.details
    for t in threads:
        t.join()
    assert len(out) == 2 and out[0].raw == out[1].raw and out[0].result.output == "1"
    assert server.service.toolbox.read_counter("dup") == 1


def test_many_sandboxes_at_once(client, server):
    """20 trajectories x 5 counter calls in parallel: every call counted once, every value handed out once."""
    from concurrent.futures import ThreadPoolExecutor

    def trajectory(k):
        return [client.execute(f"many-{k}", seq, "counter", "many").result.output for seq in range(5)]

    with ThreadPoolExecutor(20) as pool:
        values = [int(v) for vs in pool.map(trajectory, range(20)) for v in vs]
    assert sorted(values) == list(range(1, 101))
    assert server.service.toolbox.read_counter("many") == 100


RECONNECT_SCRIPT = r'''
from wal import grpc_poller  # noqa: F401  first: grpc loads with the log service's poller, as in a rollout worker
import sys, threading, time
from pathlib import Path
from chaos.drill import DrillContext
from chaos.wal_service_drill import wal_service_kill
from rewards.sandbox.client import InvocationAborted, SandboxClient
from rewards.sandbox.launch import ServerProcess

work = Path(sys.argv[1])
assert wal_service_kill(DrillContext(work / "wal"), 2).passed  # grpc.aio clients lived through restarts here
srv = ServerProcess(work / "svc", "reconnect-drill-token")
client = SandboxClient(srv.target, "reconnect-drill-token", timeout_s=30, retries=400, backoff_s=0.05)
for seq in range(2):
    out = {}

    def call():
        try:
            out["result"] = client.execute("drill", seq, "counter", "c 600")
        except InvocationAborted:
            out["aborted"] = True
        out["t"] = time.monotonic()

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.3)  # the call is running in the service
    t_kill = time.monotonic()
    srv.kill()
    srv = ServerProcess(work / "svc", "reconnect-drill-token", port=srv.port)
    caller.join(60)
    print(round(out["t"] - t_kill, 3), flush=True)
client.close()
srv.kill()
'''


@needs_bwrap
def test_a_restarted_service_is_reached_at_once_by_a_call_in_flight(tmp_path):
    """SIGKILL of the service during a call, restart on the same port: the caller's retries reach the new
    service within a few seconds, also in a process whose grpc.aio channels (the WAL client's) went through a
    reconnect before, with grpc loaded by `wal` (its poller): there a failed sync channel stayed failed ~10 s
    after the service was back, until the client took a fresh channel."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", RECONNECT_SCRIPT, str(tmp_path)], cwd=root, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert all(float(x) < 5.0 for x in p.stdout.split()), p.stdout


def test_an_empty_or_short_token_is_refused_and_a_made_one_is_whole_and_private(tmp_path, monkeypatch):
    """An empty token file (a crash while it was written) used to let 'Bearer ' in."""
    import os
    import stat

    from core.errors import UserError
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import TOKEN_ENV, TOKEN_FILE, SandboxServer, resolve_token

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    made = resolve_token(None, tmp_path)
    path = tmp_path / TOKEN_FILE
    assert len(made) >= 16 and path.read_text().strip() == made and resolve_token(None, tmp_path) == made
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and [p.name for p in tmp_path.iterdir()] == [TOKEN_FILE]
    path.write_text("\n")
    with pytest.raises(UserError, match="0 characters"):
        resolve_token(None, tmp_path)
    with pytest.raises(UserError, match="from --token has 5"):
        resolve_token("short", tmp_path)
    monkeypatch.setenv(TOKEN_ENV, "   ")
    with pytest.raises(UserError):
        resolve_token(None, tmp_path)
    with pytest.raises(UserError):
        SandboxServer(SandboxConfig(log_dir=tmp_path))


def test_tool_input_errors_match_what_a_verifier_recomputes(tmp_path):
    """A calc call the calculator refuses is answered in the calculator's own words (the calc verifier
    recomputes the call and compares: other words made an honest transcript look forged), and python source
    within the character bound but over the sandbox's stdin bytes is a tool error, not a failed call."""
    from rewards import calc, protocol
    from rewards.calculator import CalcError, calculate
    from rewards.sandbox.isolation import PIPE_BYTES
    from rewards.sandbox.tools import MAX_ARGS_CHARS, check_args

    for args in ("1+" * 120 + "1", "1\x002"):
        with pytest.raises(CalcError) as exc:
            calculate(args)
        assert check_args("calc", args) == str(exc.value)
        completion = (f"{protocol.CALL_OPEN}calc: {args}{protocol.CALL_CLOSE}"
                      + protocol.format_result(protocol.ERROR_PREFIX + check_args("calc", args)) + "6")
        assert "does not match" not in calc.Calc().verify("mul 2*3=", completion).reason
    code = "#" + "\U0001F600" * (MAX_ARGS_CHARS["python"] - 1)  # within the characters, 4 bytes each
    assert f"limit is {PIPE_BYTES}" in check_args("python", code)


def test_a_config_whose_entries_could_not_be_sent_is_refused(tmp_path):
    from pydantic import ValidationError

    from rewards.sandbox.config import SandboxConfig

    with pytest.raises(ValidationError, match="reply bound"):
        SandboxConfig(log_dir=tmp_path, output_bytes=8 << 20)
    with pytest.raises(ValidationError, match="reply bound"):
        SandboxConfig(log_dir=tmp_path, max_request_bytes=2 << 20, output_bytes=2 << 20)
    SandboxConfig(log_dir=tmp_path, max_request_bytes=1 << 20, output_bytes=2 << 20)
