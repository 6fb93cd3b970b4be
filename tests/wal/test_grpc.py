"""The gRPC log service: round trips, error statuses, auth, bounded and malformed messages, and a
server SIGKILLed mid-stream and restarted while a client keeps appending (no loss, no duplicate)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

import wal
from wal import wal_pb2 as pb
from wal.client import AuthError
from wal.config import ServeConfig
from wal.server import SERVICE, Server
from wal.verify import verify


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path / "log", ServeConfig(port=0, max_message_bytes=1 << 20))
    yield srv
    srv.stop(0)


def test_remote_roundtrip_and_errors(server):
    c = wal.connect(server.address, retry_s=5)
    c.append("a", 0, [1, 2, 3], [-0.1, -0.2, -0.3], 0)
    c.append("b", 0, [7], [-7.0], 2)
    assert c.tokens("a") == [], "nothing is readable before it is committed"
    c.commit()
    c.append("a", 3, [4], [-0.4], 1)
    c.append("a", 0, [1, 2], [-0.1, -0.2], 0)  # exact repeat: acknowledged, not duplicated
    assert c.commit() >= 0
    assert c.tokens("a") == [1, 2, 3, 4] and c.logprobs("a") == [-0.1, -0.2, -0.3, -0.4]
    assert c.policy_versions("a") == [0, 0, 0, 1]
    assert c.length("a") == 4 and c.length("nobody") == 0
    assert c.trajectories() == ["a", "b"]
    c.append("a", 9, [1], [-1.0], 1)
    with pytest.raises(wal.GapError, match="gap"):
        c.commit()
    c.append("a", 1, [99], [-0.2], 0)
    with pytest.raises(wal.ConflictError, match="rewrites position 1"):
        c.commit()
    c.finalize("b")
    assert c.trajectories() == ["a"]
    c.append("b", 1, [8], [-8.0], 2)
    with pytest.raises(wal.FinalizedError):
        c.commit()
    with pytest.raises(wal.FinalizedError):
        c.tokens("b")
    stats = c.stats()
    assert stats["trajectories"] == 1 and stats["live_tokens"] == 4
    c.append("a", 4, [5], [-0.5], 1)  # the client still works after errors
    c.commit()
    assert c.tokens("a") == [1, 2, 3, 4, 5]
    c.close()


def test_client_called_inside_a_running_event_loop(server):
    """A caller with an asyncio loop of its own (an async actor, say): the append stream's private loop then runs
    on a helper thread instead of the caller's."""
    async def main():
        c = wal.connect(server.address)
        for s in range(3):
            c.append("a", s, [s], [-0.5], 0)
            c.commit()
        c.append("a", 9, [9], [-0.5], 0)
        with pytest.raises(wal.GapError):
            c.commit()
        got = c.tokens("a")
        c.close()
        return got

    assert asyncio.run(main()) == [0, 1, 2]


def test_grpc_poller_choice_leaves_the_environment_alone():
    """wal.grpc_poller picks gRPC's poller for a process that has not loaded grpc, then removes the variable (child
    processes choose for themselves); an explicit GRPC_EXPERIMENTS is kept as it is."""
    code = ("import os, sys; import wal.client; assert 'grpc' in sys.modules; "
            "print(os.environ.get('GRPC_EXPERIMENTS', '<unset>'))")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "<unset>", out.stderr
    out = subprocess.run([sys.executable, "-c", code], env={**env, "GRPC_EXPERIMENTS": "-event_engine_dns"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "-event_engine_dns", out.stderr


def test_long_trajectory_reads_in_chunks(tmp_path):
    srv = Server(tmp_path, ServeConfig(port=0, max_read_tokens=1000))
    try:
        c = wal.connect(srv.address)
        n = 5500
        c.append("long", 0, list(range(n)), [-(i % 7) / 7 for i in range(n)], 3)
        c.commit()
        assert c.tokens("long") == list(range(n))
        assert c.policy_versions("long") == [3] * n
        c.close()
    finally:
        srv.stop(0)


def test_bad_auth_is_refused(tmp_path):
    srv = Server(tmp_path, ServeConfig(port=0), token="s3cret")
    try:
        for token in (None, "wrong"):
            c = wal.connect(srv.address, token=token, retry_s=5)
            c.append("a", 0, [1], [-1.0], 0)
            with pytest.raises(AuthError, match="token"):
                c.commit()
            with pytest.raises(AuthError):
                c.trajectories()
            c.close()
        good = wal.connect(srv.address, token="s3cret")
        good.append("a", 0, [1], [-1.0], 0)
        good.commit()
        assert good.tokens("a") == [1]
        good.close()
    finally:
        srv.stop(0)


def test_non_loopback_without_token_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without a token"):
        Server(tmp_path, ServeConfig(host="0.0.0.0", port=0))


def _raw_call(address, method, payload: bytes, stream=False):
    ch = grpc.insecure_channel(address)
    try:
        if stream:
            call = ch.stream_stream(f"/{SERVICE}/{method}")
            return list(call(iter([payload]), timeout=10))
        return ch.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=10)
    finally:
        ch.close()


def test_malformed_messages_get_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server.address, "Read", b"\xff\xff\xff\xff garbage")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed ReadRequest" in e.value.details()
    bad = pb.AppendRequest(batch_id=1, commit=True, chunks=[pb.TokenChunk(traj_id="t", start=0, tokens=b"\1\2\3", logprobs=b"")])
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server.address, "Append", bad.SerializeToString(), stream=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "multiple of 4" in e.value.details()
    bad = pb.AppendRequest(batch_id=2, commit=True, chunks=[pb.TokenChunk(traj_id="t", start=0, tokens=b"\1\0\0\0", logprobs=b"\0" * 4)])
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server.address, "Append", bad.SerializeToString(), stream=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in e.value.details()
    nan = pb.AppendRequest(batch_id=3, commit=True, chunks=[pb.TokenChunk(traj_id="t", start=0, tokens=b"\1\0\0\0", logprobs=b"\xff" * 8)])
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server.address, "Append", nan.SerializeToString(), stream=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in e.value.details()
    assert wal.connect(server.address).trajectories() == [], "refused messages must not write anything"


def test_oversized_message_is_refused(server):
    c = wal.connect(server.address, retry_s=5, max_message_bytes=8 << 20, max_pending_bytes=8 << 20)
    n = 200_000  # 2.4 MB of payload against the server's 1 MiB bound
    c.append("big", 0, [1] * n, [-1.0] * n, 0)
    with pytest.raises(wal.RemoteError, match="RESOURCE_EXHAUSTED"):
        c.commit()
    c.append("small", 0, [1], [-1.0], 0)
    c.commit()
    assert c.trajectories() == ["small"]
    c.close()


# --- server killed mid-stream --------------------------------------------------------------------

def _start_server(directory, port: int) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "wal", "serve", "--dir", str(directory), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"on 127\.0\.0\.1:(\d+)", line)
    assert m, f"server did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc, int(m.group(1))


def _tok(t: int, p: int) -> int:
    return (t * 100_003 + p * 13) % 32_000


def test_server_sigkilled_mid_stream_client_finishes_without_loss_or_duplicate(tmp_path):
    _kill_server_mid_stream(tmp_path, (20, 70))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_server_sigkilled_at_random_steps(tmp_path, seed):
    import random

    rng = random.Random(seed)
    _kill_server_mid_stream(tmp_path, tuple(sorted(rng.sample(range(1, 110), 3))))


def _kill_server_mid_stream(tmp_path, kill_steps: tuple[int, ...]) -> None:
    directory = tmp_path / "log"
    proc, port = _start_server(directory, 0)
    steps, trajs, per = 120, 3, 7
    progress = {"steps": 0}
    errors: list[BaseException] = []

    def client_loop():
        try:
            c = wal.connect(f"127.0.0.1:{port}", retry_s=60)
            for s in range(steps):
                for t in range(trajs):
                    c.append(f"t{t}", s * per, [_tok(t, s * per + i) for i in range(per)],
                             [-(s * per + i) / 1000 for i in range(per)], s // 40)
                c.commit()
                progress["steps"] = s + 1
            progress["reconnects"] = c.reconnects
            c.close()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    th = threading.Thread(target=client_loop)
    th.start()
    try:
        for kill_at in kill_steps:
            deadline = time.monotonic() + 60
            while progress["steps"] < kill_at and time.monotonic() < deadline and th.is_alive():
                time.sleep(0.002)
            assert progress["steps"] < steps, "the client finished before the server was killed"
            os.kill(proc.pid, signal.SIGKILL)  # mid-stream: the client is appending and committing
            proc.wait(timeout=30)
            time.sleep(0.3)
            proc, _ = _start_server(directory, port)
        th.join(timeout=120)
        assert not th.is_alive() and not errors, errors
        assert progress["reconnects"] >= len(kill_steps), "the client should have reconnected after each kill"
        c = wal.connect(f"127.0.0.1:{port}")
        for t in range(trajs):
            assert c.tokens(f"t{t}") == [_tok(t, p) for p in range(steps * per)], "lost or duplicated tokens"
            assert c.logprobs(f"t{t}") == [-p / 1000 for p in range(steps * per)]
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    report = verify(directory)
    assert report["tokens"] == trajs * steps * per, "a retried batch was written twice"
    assert report["ok"]


def test_large_uncommitted_batches_are_streamed_and_bounded(server):
    c = wal.connect(server.address, max_pending_bytes=4096)
    for i in range(400):  # ~80 streamed requests: some forced commits bound what the client holds for resending
        c.append("s", i * 8, list(range(i, i + 8)), [-0.5] * 8, 0)
    assert len(c._unacked) <= 16
    c.commit()
    assert c.tokens("s") == [v for i in range(400) for v in range(i, i + 8)]
    c.close()


def test_remote_append_step(server):
    c = wal.connect(server.address)
    ids = ["x", "y", "z"]
    for step in range(5):
        c.append_step(ids, [step] * 3, [step, step + 10, step + 20], [-0.5, -0.25, -0.125], 1)
        c.commit()
    assert c.tokens("y") == [10, 11, 12, 13, 14] and c.policy_versions("z") == [1] * 5
    c.append_step(["x"], [9], [1], [-1.0], 1)
    with pytest.raises(wal.GapError):
        c.commit()
    c.close()


def test_concurrent_streams_share_fsyncs(server):
    """Group commit through the service: commits of concurrent clients are acknowledged by shared fsyncs."""
    n_clients, steps = 4, 40
    errors = []
    start = threading.Barrier(n_clients)

    def client(k):
        try:
            c = wal.connect(server.address)
            start.wait(timeout=30)
            for s in range(steps):
                c.append(f"c{k}", s * 4, [k, s, k, s], [-1.0] * 4, 0)
                c.commit()
            c.close()
        except BaseException as exc:
            errors.append(exc)

    before = wal.connect(server.address).stats()["fsyncs"]
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    stats = wal.connect(server.address).stats()
    assert stats["fsyncs"] - before < n_clients * steps, "each commit paid its own fsync: no group commit"
    check = wal.connect(server.address)
    for k in range(n_clients):
        assert check.tokens(f"c{k}") == [v for s in range(steps) for v in (k, s, k, s)]


def test_flusher_resolves_every_waiting_stream_after_one_flush_and_passes_errors_on(tmp_path):
    """The service's group commit for its event loop: futures registered after appends resolve with a durable
    lsn covering those appends, in fewer flushes than futures; a failing flush reaches every waiter as the
    log's error."""
    import asyncio

    from core import fileio
    from wal.flusher import Flusher

    w = wal.open(tmp_path)
    log = w._store.log

    async def run():
        f = Flusher(w, asyncio.get_running_loop())
        try:
            for k in range(5):
                w.append(f"t{k}", 0, [k, k + 1], [-0.5, -0.25], 0)
            last = log.next_lsn - 1
            before = log.fsyncs
            got = await asyncio.gather(*(f.commit() for _ in range(5)))
            assert all(d >= last for d in got) and log.durable_lsn >= last
            assert log.fsyncs - before < 5, "the waiting commits shared a flush"
            def broken(fd, data, offset):
                raise OSError(5, "Input/output error (injected)")

            with fileio.using({**fileio.DEFAULT, "pwrite": broken, "pwrite_sync": broken}):  # the next write fails
                w.append("t9", 0, [1], [-1.0], 0)
                return await asyncio.gather(*(f.commit() for _ in range(3)), return_exceptions=True)
        finally:
            f.close()

    errs = asyncio.run(run())
    assert [type(e).__name__ for e in errs] == ["LogClosedError"] * 3, errs
    w.close()


_DYING_CLIENT = """
import sys, wal
c = wal.connect(sys.argv[1])
for s in range(100000):
    c.append("dying", s * 4, [s, s + 1, s + 2, s + 3], [-0.5] * 4, 0)
    if s % 3 == 2:
        c.commit()
        print(s, flush=True)
"""


@pytest.mark.parametrize("seed", range(3))
def test_a_client_sigkilled_mid_stream_leaves_the_service_serving_others(server, seed):
    """A stream whose client dies (appends sent, commit pending or not) ends on the service's loop; the service
    keeps serving, the dead client's acknowledged tokens are there, and a restarted client resumes after them."""
    proc = subprocess.Popen([sys.executable, "-c", _DYING_CLIENT, server.address], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    acked = -1
    try:
        for _ in range(20 + 37 * seed):
            acked = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=30)
    other = wal.connect(server.address)  # a concurrent client is unaffected
    for s in range(20):
        other.append("other", s, [s], [-1.0], 0)
        other.commit()
    assert other.tokens("other") == list(range(20))
    c = wal.connect(server.address)
    have = c.length("dying")
    assert have >= (acked + 1) * 4 and have % 4 == 0, (have, acked)
    s0 = have // 4
    for s in range(s0, s0 + 5):  # resume after what the service holds
        c.append("dying", s * 4, [s, s + 1, s + 2, s + 3], [-0.5] * 4, 0)
    c.commit()
    assert c.tokens("dying") == [s + k for s in range(s0 + 5) for k in range(4)]
    c.close()
    other.close()


def test_packed_steps_interleaved_with_chunks_match_the_in_process_log(server, tmp_path):
    """A decode loop's steps (numpy int32 / float64 / int64, as the engine hands them) travel as packed
    StepChunks; a prompt admitted mid-decode (a chunk) stays in order before the steps that extend it."""
    import numpy as np

    local = wal.open(tmp_path / "local")
    remote = wal.connect(server.address)
    for log in (local, remote):
        log.append("a", 0, [5, 6], [-0.1, -0.2], 0)
        for step in range(6):
            ids = ["a"] if step < 3 else ["a", "b"]
            if step == 3:
                log.append("b", 0, [9], [-0.9], 0)  # admitted between two steps
            pos = np.array([2 + step] + ([1 + step - 3] if step >= 3 else []), dtype=np.int64)
            tok = np.array([100 + step, 200 + step][:len(ids)], dtype=np.int32)
            lp = np.array([-0.5, -0.25][:len(ids)], dtype=np.float64)
            log.append_step(ids, pos, tok, lp, 1)
            if step % 2:
                log.commit()
        log.commit()
    for t in ("a", "b"):
        assert remote.tokens(t) == local.tokens(t) and remote.logprobs(t) == local.logprobs(t)
        assert remote.policy_versions(t) == local.policy_versions(t)
    assert remote.tokens("b") == [9, 203, 204, 205]
    remote.close()
    local.close()


def test_malformed_steps_get_invalid_argument_and_write_nothing(server):
    def step(**kw):
        fields = dict(traj_ids=["t"], positions=(0).to_bytes(8, "little"), tokens=b"\1\0\0\0", logprobs=b"\0" * 8,
                      policy_version=0) | kw
        return pb.AppendRequest(batch_id=1, commit=True, steps=[pb.StepChunk(**fields)]).SerializeToString()

    for bad, words in [(step(positions=b"\0" * 4), "bytes of positions"), (step(tokens=b"\1\0\0"), "of tokens"),
                       (step(traj_ids=["t", "u"]), "2 trajectory ids"), (step(logprobs=b"\xff" * 8), "NaN"),
                       (step(tokens=b"\xff\xff\xff\xff"), "token ids must lie"),
                       (step(positions=(3).to_bytes(8, "little")), "gap")]:
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(server.address, "Append", bad, stream=True)
        assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), e.value
        assert words in e.value.details().lower() or words in e.value.details(), e.value.details()
    assert wal.connect(server.address).trajectories() == [], "refused steps must not write anything"
    ack = pb.AppendAck.FromString(_raw_call(server.address, "Append", step(), stream=True)[0])
    assert ack.takes_steps and wal.connect(server.address).tokens("t") == [1]


def test_steps_sent_to_a_service_that_does_not_take_them_fail_unacknowledged(server, monkeypatch):
    """An older service ignores StepChunks (an unknown field) and acks without `takes_steps`: the client
    refuses that ack instead of reporting the steps durable; chunks alone still work."""
    import wal.server as srv_mod

    monkeypatch.setattr(srv_mod, "_ack", lambda batch_id, durable: pb.AppendAck(batch_id=batch_id,
                                                                                 durable_lsn=durable).SerializeToString())
    c = wal.connect(server.address, retry_s=5)
    c.append("a", 0, [1], [-1.0], 0)
    c.commit()
    c.append_step(["a"], [1], [2], [-1.0], 0)
    with pytest.raises(wal.RemoteError, match="does not take packed decode steps"):
        c.commit()
    c.close()


def test_appends_go_on_while_a_commit_waits_for_its_ack(server, monkeypatch):
    """A decode loop appends its next steps while a background commit waits for the service (the client does
    not hold its queue lock across the round trip)."""
    import asyncio
    import threading
    import time

    import wal.server as srv_mod

    slow = srv_mod.TokenLogService._commit

    async def slow_commit(self, concurrent):
        await asyncio.sleep(0.5)
        return await slow(self, concurrent)

    monkeypatch.setattr(srv_mod.TokenLogService, "_commit", slow_commit)
    c = wal.connect(server.address, retry_s=5)
    c.append_step(["a", "b"], [0, 0], [1, 2], [-1.0, -1.0], 0)
    committer = threading.Thread(target=c.commit)
    committer.start()
    time.sleep(0.1)  # the commit is waiting for its ack
    t0 = time.monotonic()
    for pos in range(1, 6):
        c.append_step(["a", "b"], [pos, pos], [1, 2], [-1.0, -1.0], 0)
    took = time.monotonic() - t0
    committer.join(10)
    c.commit()
    assert took < 0.2, f"appends waited {took:.3f} s for the commit in flight"
    assert c.tokens("a") == [1] * 6 and c.tokens("b") == [2] * 6
    c.close()
