"""Seeded crash tests: a writer subprocess is SIGKILLed at random points; after reopening, every
acknowledged token (and env entry, and finalize) is there, nothing else is out of order, positions
are contiguous, and a new writer resumes from the committed end. One seed reproduces one trial."""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

import wal

sys.path.insert(0, str(Path(__file__).parent))
import crash_writer  # noqa: E402
from crash_writer import logprob, token  # noqa: E402


def _spawn(directory: Path, seed: int, seg_bytes: int, prealloc: str) -> tuple[int, object]:
    """Fork the writer (the parent has already imported everything, so a trial costs no start-up)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: write acknowledgements into the pipe until killed
        code = 1
        try:
            os.close(read_fd)
            crash_writer.main([str(directory), str(seed), str(seg_bytes), *prealloc.split()], os.fdopen(write_fd, "w"))
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_fd)
    return pid, os.fdopen(read_fd, "r")


def _run_and_kill(directory: Path, seed: int, seg_bytes: int, prealloc: str, rng: random.Random) -> tuple[dict, set, dict]:
    """Start the writer, let it acknowledge a random amount of work, SIGKILL it at a random moment."""
    pid, acks = _spawn(directory, seed, seg_bytes, prealloc)
    acked: dict[str, int] = {}
    finalized: set[str] = set()
    env: dict[str, int] = {}
    try:
        assert acks.readline().strip() == "ready", "writer failed to start"
        target = rng.randrange(1, 200)
        n = 0
        deadline = time.monotonic() + 30
        while n < target and time.monotonic() < deadline:
            line = acks.readline()
            if not line:
                break
            n += _note(line, acked, finalized, env)
        time.sleep(rng.random() * 0.01)  # land anywhere inside the next append/commit/roll/reclaim
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    for line in acks.read().splitlines(keepends=True):  # lines written before the kill were acknowledged too
        _note(line, acked, finalized, env)
    acks.close()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the writer died before the kill"
    return acked, finalized, env


def _note(line: str, acked: dict, finalized: set, env: dict) -> int:
    if not line.endswith("\n"):
        return 0  # a half-written line was never an acknowledgement
    kind, *rest = line.split()
    if kind == "A":
        for item in rest:
            t, k = item.split(":")
            acked[t] = max(acked.get(t, 0), int(k))
        return 1
    if kind == "F":
        finalized.add(rest[0])
    if kind == "f":
        finalized.add("?" + rest[0])
    if kind == "R":
        env.setdefault("released", set()).add(rest[0])
    if kind == "r":
        env.setdefault("released", set()).add("?" + rest[0])
    if kind == "E":
        env[rest[0]] = max(env.get(rest[0], 0), int(rest[1]))
    return 0


def _check(directory: Path, acked: dict, finalized: set, env: dict) -> None:
    w = wal.open(directory)
    live = set(w.trajectories())
    for traj, n in acked.items():
        if traj in finalized:
            assert traj not in live, f"{traj} was finalized (acknowledged) but is live again"
            with pytest.raises(wal.FinalizedError):  # also once retention has reclaimed its finalize record
                w.tokens(traj)
            continue
        if traj not in live and "?" + traj in finalized:
            with pytest.raises(wal.FinalizedError):  # started, not acknowledged: durable, since it is not live
                w.tokens(traj)
            continue
        got = w.tokens(traj) if traj in live else []
        assert len(got) >= n, f"{traj}: {n} tokens acknowledged, only {len(got)} after recovery"
        assert got == [token(traj, p) for p in range(len(got))], f"{traj}: recovered tokens are not the written prefix"
        assert w.logprobs(traj) == [logprob(traj, p) for p in range(len(got))]
        assert w.policy_versions(traj) == [p // 50 for p in range(len(got))]
    for traj in live:  # unacknowledged trajectories may exist, but only as a contiguous written prefix
        got = w.tokens(traj)
        assert got == [token(traj, p) for p in range(len(got))]
    envlog = w.envlog()
    released = env.get("released", set())
    for sb, n in env.items():
        if sb == "released":
            continue
        entries = envlog.entries(sb)
        if sb in released or ("?" + sb in released and entries == []):
            assert entries == [], f"{sb} was released (acknowledged) but its entries are back"
            continue
        assert len(entries) >= n
        assert [e.request for e in entries[:n]] == [f"{sb} call {i}".encode() for i in range(n)]
        assert [e.response for e in entries[:n]] == [f"{sb} result {i}".encode() for i in range(n)]
    w.close()


def _trial(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    directory = tmp_path / f"wal-{seed}"
    seg_bytes = rng.choice([4096, 16384, 1 << 20])
    # segments preallocated whole / grown inline 1 KiB at a time / grown, then rolled into spare segments
    prealloc = ("1048576", "1024", "1024 spare")[seed % 3]
    acked, finalized, env = {}, set(), {}
    for _ in range(2):  # kill, recover and resume, kill again: recovery continues after the committed end
        a, f, e = _run_and_kill(directory, seed * 10 + _, seg_bytes, prealloc, rng)
        for t, k in a.items():
            acked[t] = max(acked.get(t, 0), k)
        finalized |= f
        for s, k in e.items():
            if s == "released":
                env.setdefault("released", set()).update(k)
            else:
                env[s] = max(env.get(s, 0), k)
        _check(directory, acked, finalized, env)


@pytest.mark.parametrize("seed", range(20))
def test_sigkill_writer(tmp_path, seed):
    _trial(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1000, 1500))
def test_sigkill_writer_slow(tmp_path, seed):
    _trial(tmp_path, seed)
