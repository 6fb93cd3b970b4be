"""The per-sandbox environment log: ordering rules, idempotent repeats, durability, threads."""
from __future__ import annotations

import threading

import pytest

import wal


def test_invoke_result_roundtrip_and_reopen(tmp_path):
    log = wal.open_envlog(tmp_path / "env")
    log.invoke("sb1", 0, b"ls -l")
    assert log.get("sb1", 0) == wal.EnvEntry(0, b"ls -l", None)
    log.result("sb1", 0, b"total 0\n")
    log.invoke("sb1", 1, b"cat x")
    log.invoke("sb2", 0, b"")
    log.close()
    log = wal.open_envlog(tmp_path / "env")
    assert log.entries("sb1") == [wal.EnvEntry(0, b"ls -l", b"total 0\n"), wal.EnvEntry(1, b"cat x", None)]
    assert log.get("sb2", 0) == wal.EnvEntry(0, b"", None)
    assert log.get("sb2", 1) is None and log.get("nope", 0) is None and log.entries("nope") == []
    assert log.sandboxes() == ["sb1", "sb2"]
    log.close()


def test_exact_repeats_are_idempotent_and_changes_conflict(tmp_path):
    log = wal.open_envlog(tmp_path)
    log.invoke("s", 0, b"rm -rf /tmp/x")
    log.invoke("s", 0, b"rm -rf /tmp/x")
    with pytest.raises(wal.ConflictError):
        log.invoke("s", 0, b"rm -rf /tmp/y")
    log.result("s", 0, b"ok")
    log.result("s", 0, b"ok")
    with pytest.raises(wal.ConflictError):
        log.result("s", 0, b"different")
    before = log.stats()["next_lsn"]
    log.invoke("s", 0, b"rm -rf /tmp/x")
    assert log.stats()["next_lsn"] == before, "an exact repeat must not write a record"
    assert log.entries("s") == [wal.EnvEntry(0, b"rm -rf /tmp/x", b"ok")]
    log.close()


def test_gaps_and_result_before_invoke_are_refused(tmp_path):
    log = wal.open_envlog(tmp_path)
    with pytest.raises(wal.GapError):
        log.invoke("s", 1, b"skips 0")
    with pytest.raises(wal.GapError):
        log.result("s", 0, b"no invocation yet")
    log.invoke("s", 0, b"a")
    with pytest.raises(wal.GapError):
        log.invoke("s", 2, b"c")
    with pytest.raises(wal.GapError):
        log.invoke("s", -1, b"neg")
    with pytest.raises(ValueError):
        log.invoke("s", 1, "not bytes")  # type: ignore[arg-type]
    assert log.entries("s") == [wal.EnvEntry(0, b"a", None)]
    log.close()


def test_many_threads_share_fsyncs(tmp_path):
    log = wal.open_envlog(tmp_path)
    n_threads, per = 8, 25
    errors = []

    def worker(k):
        try:
            for i in range(per):
                log.invoke(f"sb{k}", i, f"cmd {k} {i}".encode())
                log.result(f"sb{k}", i, f"out {k} {i}".encode())
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = log.stats()
    assert stats["next_lsn"] == n_threads * per * 2
    assert stats["fsyncs"] < n_threads * per * 2, "group commit should share fsyncs between threads"
    log.close()
    log = wal.open_envlog(tmp_path)
    for k in range(n_threads):
        assert [e.request for e in log.entries(f"sb{k}")] == [f"cmd {k} {i}".encode() for i in range(per)]
        assert [e.response for e in log.entries(f"sb{k}")] == [f"out {k} {i}".encode() for i in range(per)]
    log.close()


def test_envlog_shares_the_token_wal(tmp_path):
    w = wal.open(tmp_path)
    env = w.envlog()
    w.append("t", 0, [5, 6], [-0.5, -0.25], 3)
    env.invoke("sb", 0, b"call")
    # invoke is durable on return, and so is everything appended before it
    assert w.tokens("t") == [5, 6]
    w.close()
    w = wal.open(tmp_path)
    assert w.envlog().entries("sb") == [wal.EnvEntry(0, b"call", None)]
    w.close()


def test_second_process_open_is_refused(tmp_path):
    import subprocess
    import sys

    log = wal.open_envlog(tmp_path)
    code = "import wal,sys\ntry:\n    wal.open_envlog(sys.argv[1])\nexcept wal.LockedError as e:\n    print('locked', e); sys.exit(3)\n"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    log.close()


def test_release_forgets_a_sandbox_and_lets_retention_reclaim_it(tmp_path):
    cfg = wal.WALConfig(segment_bytes=4096)
    log = wal.open_envlog(tmp_path, cfg)
    log.invoke("keep", 0, b"k")
    log.invoke("gone", 0, b"g")
    log.release("gone")
    log.release("gone")  # idempotent
    with pytest.raises(wal.FinalizedError):
        log.invoke("gone", 1, b"after release")
    assert log.entries("gone") == [] and log.get("gone", 0) is None
    for i in range(200):
        sid = f"sb{i}"
        log.invoke(sid, 0, b"x" * 100)
        log.result(sid, 0, b"y" * 100)
        log.release(sid)
    assert log.sandboxes() == ["keep"] and log.entries("sb1") == [] and log.get("sb1", 0) is None
    log._store.reclaim()
    stats = log.stats()
    assert stats["reclaimed_segments"] > 5 and stats["disk_bytes"] < stats["bytes_written"] / 4
    log.close()
    log = wal.open_envlog(tmp_path, cfg)
    assert log.sandboxes() == ["keep"] and log.entries("keep") == [wal.EnvEntry(0, b"k", None)]
    log.close()
