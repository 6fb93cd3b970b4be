"""TokenWAL semantics: contiguity, no rewrite, idempotent repeats, durable reads, group commit under
threads, retention (reclaim and compaction) with a long-lived trajectory, and the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

import wal
from wal import codec, segments


def test_append_rules(tmp_path):
    w = wal.open(tmp_path)
    with pytest.raises(wal.GapError):
        w.append("t", 1, [1], [-1.0], 0)  # a trajectory starts at position 0
    assert w.append("t", 0, [1, 2, 3], [-1.0, -2.0, -3.0], 0) == 3
    w.append("t", 1, [2, 3, 4], [-2.0, -3.0, -4.0], 0)  # overlap repeats exactly, the rest extends
    w.commit()
    assert w.tokens("t") == [1, 2, 3, 4]
    with pytest.raises(wal.ConflictError, match="rewrites position 2"):
        w.append("t", 2, [9], [-3.0], 0)
    with pytest.raises(wal.ConflictError, match="log-prob"):
        w.append("t", 2, [3], [-3.5], 0)
    with pytest.raises(wal.ConflictError, match="policy version"):
        w.append("t", 2, [3], [-3.0], 1)
    with pytest.raises(wal.GapError, match="gap"):
        w.append("t", 5, [6], [-6.0], 0)
    with pytest.raises(ValueError):
        w.append("t", 4, [5, 6], [-5.0], 0)
    with pytest.raises(ValueError):
        w.append("", 0, [5], [-5.0], 0)
    with pytest.raises(ValueError):
        w.append("t", 4, [5], [-5.0], -1)
    before = w.stats()["next_lsn"]
    w.append("t", 0, [1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], 0)
    assert w.stats()["next_lsn"] == before, "an exact repeat writes nothing"
    w.append("t", 4, np.array([5], dtype=np.int64), np.array([-5.0], dtype=np.float32), 0)  # numpy in
    w.append("t", 5, [], [], 0)
    w.commit()
    assert w.tokens("t") == [1, 2, 3, 4, 5] and w.length("t") == 5
    assert w.tokens("unknown") == [] and w.length("unknown") == 0
    w.close()
    with pytest.raises(wal.LogClosedError):
        w.append("t", 5, [6], [-6.0], 0)


def test_reads_show_committed_tokens_only(tmp_path):
    w = wal.open(tmp_path)
    w.append("t", 0, [1, 2], [-1.0, -2.0], 0)
    assert w.tokens("t") == [] and w.trajectories() == []
    w.commit()
    w.append("t", 2, [3], [-3.0], 0)
    assert w.tokens("t") == [1, 2] and w.logprobs("t") == [-1.0, -2.0] and w.policy_versions("t") == [0, 0]
    w.commit()
    assert w.tokens("t") == [1, 2, 3]
    w.close()


def test_large_append_is_split_into_records(tmp_path):
    w = wal.open(tmp_path, wal.WALConfig(max_record_tokens=100))
    w.append("t", 0, list(range(1050)), [-0.5] * 1050, 4)
    w.commit()
    assert w.stats()["next_lsn"] == 11
    w.close()
    w = wal.open(tmp_path)
    assert w.tokens("t") == list(range(1050)) and set(w.policy_versions("t")) == {4}
    w.close()


def test_group_commit_many_threads(tmp_path):
    w = wal.open(tmp_path)
    n_threads, steps = 8, 40
    errors = []

    def worker(k):
        try:
            for s in range(steps):
                w.append(f"t{k}", s * 2, [k, s], [-1.0, -2.0], 0)
                w.commit()
                # commit returned: everything this thread appended is durable and readable
                assert w.length(f"t{k}") == (s + 1) * 2
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats = w.stats()
    assert stats["fsyncs"] < n_threads * steps, "commits of concurrent appenders should share fsyncs"
    w.close()
    w = wal.open(tmp_path)
    for k in range(n_threads):
        assert w.tokens(f"t{k}") == [v for s in range(steps) for v in (k, s)]
    w.close()


def test_retention_bounds_disk_and_keeps_live_data(tmp_path):
    cfg = wal.WALConfig(segment_bytes=8192, compact_live_fraction=0.5)
    w = wal.open(tmp_path, cfg)
    env = w.envlog()
    env.invoke("sb", 0, b"keep me")
    env.result("sb", 0, b"kept")
    long_len = 0
    peak = 0
    for i in range(400):  # many short trajectories finalized, one long one never
        w.append(f"s{i}", 0, list(range(20)), [-0.5] * 20, 0)
        w.append("long", long_len, [i], [-float(i)], i // 100)
        long_len += 1
        w.commit()
        w.finalize(f"s{i}")
        if i % 50 == 49:
            w.reclaim()
            peak = max(peak, w.stats()["disk_bytes"])
    w.reclaim()
    stats = w.stats()
    written = stats["bytes_written"]
    assert stats["reclaimed_segments"] > 10
    assert stats["disk_bytes"] < written / 4, f"disk {stats['disk_bytes']} of {written} written: retention did not reclaim"
    assert stats["finalized_remembered"] < 400, "finalize records are reclaimed too"
    assert stats["finalized_remembered"] + stats["finalized_forgotten"] == 400, "each finalized id in the log or the tombstones"
    w.close()
    w = wal.open(tmp_path, cfg)
    assert w.trajectories() == ["long"]
    assert w.tokens("long") == list(range(400))
    assert w.logprobs("long") == [-float(i) for i in range(400)]
    assert w.policy_versions("long") == [i // 100 for i in range(400)]
    assert w.envlog().entries("sb") == [wal.EnvEntry(0, b"keep me", b"kept")]
    w.close()


def test_background_reclaim_runs_after_segment_roll(tmp_path):
    w = wal.open(tmp_path, wal.WALConfig(segment_bytes=4096))
    for i in range(300):
        w.append(f"s{i}", 0, list(range(10)), [-0.5] * 10, 0)
        w.finalize(f"s{i}")
    import time

    deadline = time.monotonic() + 20
    while w.stats()["reclaimed_segments"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.stats()["reclaimed_segments"] > 0
    w.close()


def test_reclaim_reads_no_segment_until_a_finalize_could_have_freed_one(tmp_path):
    """A roll over live records only (nothing finalized since the last pass) reads no segment: the
    pass would find nothing to free and compete with the committers for the GIL; a finalize re-arms it."""
    w = wal.open(tmp_path, wal.WALConfig(segment_bytes=4096))
    w.reclaim()  # the pass after open (its finalized set came from replay)
    for i in range(60):
        w.append("live", 10 * i, list(range(10)), [-0.5] * 10, 0)
        w.append(f"s{i}", 0, list(range(10)), [-0.5] * 10, 0)
        w.commit()
    assert w.stats()["segments"] > 3
    before = w.stats()["scanned_segments"]
    assert w.reclaim() == 0 and w.stats()["scanned_segments"] == before
    for i in range(60):
        w.finalize(f"s{i}")
    w.reclaim()
    stats = w.stats()
    assert stats["scanned_segments"] > before and stats["reclaimed_segments"] > 0
    w.close()
    w = wal.open(tmp_path)
    assert w.trajectories() == ["live"] and w.tokens("live") == list(range(10)) * 60
    w.close()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "deploy.cli", "wal", *args], capture_output=True, text=True, timeout=120)


def test_cli_verify_and_dump(tmp_path):
    w = wal.open(tmp_path)
    w.append("a", 0, [1, 2], [-1.0, -2.0], 0)
    w.append("b", 0, [3], [-3.0], 1)
    w.append_step(["c", "a"], [0, 2], [4, 5], [-4.0, -5.0], 2)  # one STEP record
    w.commit()
    w.finalize("b")
    w.close()
    end = segments.scan(tmp_path, lambda rec: None, mutate=False).tail_offset  # the zero-filled reserve follows
    with open(segments.list_segments(tmp_path)[-1][1], "r+b") as f:
        f.seek(end)
        f.write(b"\x07\x00\x00\x05")  # a torn tail
    r = _cli("verify", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["records"] == 4 and report["trajectories"] == 2 and report["finalized"] == 1
    assert report["step_records"] == 1 and report["tokens_records"] == 2 and report["live_tokens"] == 4
    assert report["tokens"] == 5 and report["torn_bytes_cut"] == 4 and report["corruption"] == [] and report["segments"] == 1
    r = _cli("dump", str(tmp_path), "--traj", "a")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert rows == [{"lsn": 0, "type": "tokens", "start": 0, "policy_version": 0, "tokens": [1, 2], "logprobs": [-1.0, -2.0]},
                    {"lsn": 2, "type": "tokens", "start": 2, "policy_version": 2, "tokens": [5], "logprobs": [-5.0],
                     "step_trajectories": 2}]
    # corrupt the first record: verify reports it and fails
    seg = segments.list_segments(tmp_path)[-1][1]
    data = bytearray(seg.read_bytes())
    data[segments.codec.SEGMENT_HEAD_BYTES + 12] ^= 1
    seg.write_bytes(bytes(data))
    r = _cli("verify", str(tmp_path), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["corruption"][0]["valid_records_follow"]
    r = _cli("serve", "--dir", str(tmp_path), "--port", "0")
    assert r.returncode == 2 and "corrupt" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_a_directory_that_holds_no_log(tmp_path):
    """A mistyped path, or the parent of a pool's logs, is named as not a log, never verified as an empty one."""
    for k in range(2):
        wal.open(tmp_path / "wal" / str(k)).close()
    (tmp_path / "wal" / "notes").mkdir()
    for args in (("verify", str(tmp_path / "wal")), ("dump", str(tmp_path / "wal"), "--traj", "a")):
        r = _cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "is not a WAL directory" in r.stderr and "the logs in it: 0, 1\n" in r.stderr, r.stderr
    r = _cli("verify", str(tmp_path / "wal" / "notes"))
    assert r.returncode == 2 and "is not a WAL directory" in r.stderr and "logs in it" not in r.stderr, r.stderr
    r = _cli("verify", str(tmp_path / "wal" / "1"))
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout + r.stderr


def test_serve_config_file_parses_and_bounds_are_enforced(tmp_path):
    from core.config import load
    from core.errors import UserError
    from wal.config import WALFileConfig

    (tmp_path / "wal.toml").write_text('[wal]\nsegment_bytes = 1048576\n[serve]\nport = 6000\nmax_message_bytes = 1048576\n')
    cfg = load(WALFileConfig, tmp_path / "wal.toml")
    assert cfg.wal.segment_bytes == 1 << 20 and cfg.serve.port == 6000 and cfg.serve.host == "127.0.0.1"
    with pytest.raises(UserError, match="segment_bytes"):
        load(WALFileConfig, tmp_path / "wal.toml", ["wal.segment_bytes=10"])
    with pytest.raises(UserError, match="unknown key"):
        load(WALFileConfig, tmp_path / "wal.toml", ["serve.prot=1"])


def test_failed_fsync_poisons_the_log_and_reopen_recovers(tmp_path, monkeypatch):
    from core import fileio

    w = wal.open(tmp_path)
    w.append("t", 0, [1, 2], [-1.0, -2.0], 0)
    w.commit()

    def broken(fd):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(fileio, "fsync", broken)
    monkeypatch.setattr(fileio, "fdatasync", broken)  # commits within the preallocated reserve use fdatasync
    monkeypatch.setattr(fileio, "pwrite_sync", lambda fd, data, offset: broken(fd))  # or a direct write
    w.append("t", 2, [3], [-3.0], 0)
    with pytest.raises(wal.LogClosedError, match="injected"):
        w.commit()
    with pytest.raises(wal.LogClosedError):  # after a failed fsync the durable state is unknown: refuse everything
        w.append("t", 3, [4], [-4.0], 0)
    with pytest.raises(wal.LogClosedError):
        w.tokens("t")
    monkeypatch.undo()
    w.close()
    w = wal.open(tmp_path)
    got = w.tokens("t")
    assert got[:2] == [1, 2] and got in ([1, 2], [1, 2, 3])  # the acknowledged prefix survives
    w.append("t", len(got), [9], [-9.0], 0)
    w.commit()
    w.close()


def test_numpy_integer_positions_are_accepted_and_floats_refused(tmp_path):
    w = wal.open(tmp_path)
    w.append("t", np.int64(0), [1], [-1.0], np.int32(2))
    with pytest.raises(ValueError, match="start must be an integer"):
        w.append("t", 1.0, [2], [-2.0], 2)
    w.commit()
    assert w.policy_versions("t") == [2]
    env = w.envlog()
    env.invoke("sb", np.int64(0), b"x")
    with pytest.raises(ValueError):
        env.invoke("sb", "1", b"y")
    w.close()


def test_append_step_equals_one_append_per_trajectory(tmp_path):
    rng = np.random.default_rng(0)
    a, b = wal.open(tmp_path / "a"), wal.open(tmp_path / "b")
    ids = [f"t{k}" for k in range(37)]
    for step in range(20):
        toks = rng.integers(0, 1000, len(ids)).tolist()
        lps = (-rng.random(len(ids))).tolist()
        a.append_step(ids, [step] * len(ids), toks, lps, step // 7)
        for k, t in enumerate(ids):
            b.append(t, step, [toks[k]], [lps[k]], step // 7)
        a.commit()
        b.commit()
    a.append_step(ids[:3], [0, 0, 0], [a.tokens(t)[0] for t in ids[:3]], [a.logprobs(t)[0] for t in ids[:3]], 0)  # exact repeats
    a.append_step(["t0", "t0"], [20, 21], [5, 6], [-0.5, -0.6], 2)  # one trajectory twice in a step
    b.append("t0", 20, [5, 6], [-0.5, -0.6], 2)
    a.commit()
    b.commit()
    for t in ids:
        assert a.tokens(t) == b.tokens(t) and a.logprobs(t) == b.logprobs(t) and a.policy_versions(t) == b.policy_versions(t)
    before = a.stats()["next_lsn"]
    with pytest.raises(wal.GapError):
        a.append_step(["t1", "t2"], [20, 99], [1, 2], [-1.0, -2.0], 2)
    with pytest.raises(wal.ConflictError):
        a.append_step(["t1", "t2"], [20, 0], [1, 2], [-1.0, -2.0], 2)
    with pytest.raises(ValueError):
        a.append_step(["t1", "t2"], [20], [1, 2], [-1.0, -2.0], 2)
    assert a.stats()["next_lsn"] == before, "a failing step writes nothing"
    a.close()
    b.close()
    a = wal.open(tmp_path / "a")
    assert a.tokens("t0")[-2:] == [5, 6]
    a.close()


def test_index_packs_one_token_appends_and_reads_any_range(tmp_path):
    w = wal.open(tmp_path)
    n = 64 * 3 + 5
    for p in range(n):
        w.append_step(["t"], [p], [p], [-p / 100], p // 50)
    w.commit()
    traj = w._store.tokens.trajs["t"]
    assert type(traj.tok) is bytearray and len(traj.tok) == 4 * n and len(traj.lp) == 8 * n  # no object per token
    assert traj.tok_blocks == [] and traj.lp_blocks == []  # under one block: nothing sealed yet
    assert len(traj.version_runs) == n // 50 + 1
    for lo, hi in [(0, n), (3, 70), (63, 65), (n - 1, n), (10, 10)]:
        tok, lp, versions, length = w.read_packed("t", lo, hi)
        assert np.frombuffer(tok, "<i4").tolist() == list(range(lo, hi)) and length == n
        assert np.frombuffer(lp, "<f8").tolist() == [-p / 100 for p in range(lo, hi)]
        assert versions == [p // 50 for p in range(lo, hi)]
    w.close()


def test_compaction_copies_only_the_live_items_of_a_step(tmp_path):
    """A STEP record holds several trajectories; once one of them is finalized, a compacted copy must
    leave its item out (its finalize record may be reclaimed next, and the copy must not revive it)."""
    w = wal.open(tmp_path, wal.WALConfig(segment_bytes=4096, compact_live_fraction=1.0))
    for p in range(60):  # steps of three trajectories, two of which get finalized
        w.append_step(["dead1", "live", "dead2"], [p, p, p], [p, p + 1, p + 2], [-0.5, -0.25, -0.125], p // 20)
        w.commit()
    w.finalize("dead1")
    w.finalize("dead2")
    for p in range(60, 400):  # the live one goes on alone: segments roll, the old ones are compacted
        w.append_step(["live"], [p], [p + 1], [-0.25], p // 20)
        w.commit()
    w.reclaim()
    st = w.stats()
    assert st["reclaimed_segments"] > 0 and st["copied_records"] > 0
    w.close()
    for _ in range(2):  # reopen twice: the copies replay cleanly, and again after another compaction
        w = wal.open(tmp_path, wal.WALConfig(segment_bytes=4096, compact_live_fraction=1.0))
        assert w.trajectories() == ["live"]
        assert w.tokens("live") == [p + 1 for p in range(400)] and w.policy_versions("live") == [p // 20 for p in range(400)]
        w.reclaim()
        w.close()


def test_append_packed_equals_append_and_checks_what_pack_checks(tmp_path):
    w = wal.open(tmp_path)
    toks, lps = [5, 2**31 - 1, 0], [-0.5, -1e-9, 0.0]
    w.append("a", 0, toks, lps, 3)
    w.append_packed("b", 0, np.asarray(toks, "<i4").tobytes(), np.asarray(lps, "<f8").tobytes(), 3)
    w.append_packed("b", 0, np.asarray(toks, "<i4").tobytes(), np.asarray(lps, "<f8").tobytes(), 3)  # exact repeat
    w.commit()
    assert w.tokens("b") == w.tokens("a") == toks and w.logprobs("b") == lps and w.policy_versions("b") == [3] * 3
    bad = [(np.asarray([1, -2], "<i4").tobytes(), np.zeros(2).tobytes(), "negative"),
           (np.asarray([1, 2], "<i4").tobytes(), np.asarray([0.0, np.nan]).tobytes(), "NaN"),
           (np.asarray([1, 2], "<i4").tobytes(), np.zeros(3).tobytes(), "per token"),
           (b"\x01\x00\x00", b"", "per token")]
    for tok, lp, why in bad:
        with pytest.raises(codec.CodecError, match=why):
            w.append_packed("c", 0, tok, lp, 0)
    with pytest.raises(wal.ConflictError):
        w.append_packed("b", 1, np.asarray([7], "<i4").tobytes(), np.asarray([-1e-9]).tobytes(), 3)
    assert "c" not in w.trajectories()
    w.close()


def test_index_blocks_cross_boundaries_for_bulk_and_step_appends(tmp_path):
    """Positions past BLOCK_TOKENS go to sealed blocks (no append copies more than one block); reads,
    exact repeats and conflicts work across block edges, for bulk appends and one-token steps."""
    from wal.errors import ConflictError
    from wal.index import BLOCK_TOKENS

    w = wal.open(tmp_path)
    n_bulk = 2 * BLOCK_TOKENS + 123  # one append spanning three blocks
    ids = np.arange(n_bulk, dtype=np.int32)
    w.append("bulk", 0, ids, -ids / 7.0, 1)
    first = BLOCK_TOKENS - 3  # one-token steps over a block edge
    w.append("step", 0, np.arange(first, dtype=np.int32), np.zeros(first), 0)
    for p in range(first, BLOCK_TOKENS + 5):
        w.append_step(["step"], [p], [p], [-1.0], 2)
    w.commit()
    bulk, step = w._store.tokens.trajs["bulk"], w._store.tokens.trajs["step"]
    assert len(bulk.tok_blocks) == 2 and len(bulk.tok) == 4 * 123 and len(bulk.lp_blocks[1]) == 8 * BLOCK_TOKENS
    assert len(step.tok_blocks) == 1 and len(step.tok) == 4 * 5
    for lo, hi in [(0, n_bulk), (BLOCK_TOKENS - 1, BLOCK_TOKENS + 1), (5, 2 * BLOCK_TOKENS + 7), (n_bulk - 2, n_bulk)]:
        tok, lp, versions, _ = w.read_packed("bulk", lo, hi)
        assert np.array_equal(np.frombuffer(tok, "<i4"), ids[lo:hi]) and versions == [1] * (hi - lo)
        assert np.array_equal(np.frombuffer(lp, "<f8"), -ids[lo:hi] / 7.0)
    got = w.tokens("step")
    assert got == list(range(BLOCK_TOKENS + 5))
    assert w.logprobs("step")[first - 1:first + 1] == [0.0, -1.0]
    w.append("bulk", BLOCK_TOKENS - 2, ids[BLOCK_TOKENS - 2:BLOCK_TOKENS + 2], -ids[BLOCK_TOKENS - 2:BLOCK_TOKENS + 2] / 7.0, 1)
    bad = ids[BLOCK_TOKENS - 2:BLOCK_TOKENS + 2].copy()
    bad[3] += 1  # a rewrite just past the edge
    with pytest.raises(ConflictError, match=f"position {BLOCK_TOKENS + 1}"):
        w.append("bulk", BLOCK_TOKENS - 2, bad, -ids[BLOCK_TOKENS - 2:BLOCK_TOKENS + 2] / 7.0, 1)
    w.close()
    w = wal.open(tmp_path)  # replayed from the log into the same blocks
    assert w.tokens("bulk") == ids.tolist() and w.tokens("step") == got
    w.close()


def test_finalize_many_is_one_commit_and_survives_a_reopen(tmp_path):
    """finalize_many marks every id (an unknown or already finalized one is skipped) with one fsync, and
    a reopened log holds them finalized."""
    w = wal.open(tmp_path)
    for i in range(6):
        w.append(f"t{i}", 0, [1, 2, 3], [-0.5] * 3, 0)
    w.commit()
    w.finalize("t0")
    before = w.stats()["fsyncs"]
    w.finalize_many([f"t{i}" for i in range(5)] + ["never-seen"])
    assert w.stats()["fsyncs"] == before + 1
    assert w.trajectories() == ["t5"]
    w.close()
    w = wal.open(tmp_path)
    assert w.trajectories() == ["t5"]
    with pytest.raises(wal.FinalizedError):
        w.append("t3", 3, [4], [-0.5], 0)
    w.close()


def test_a_step_naming_a_trajectory_twice_is_checked_whole_before_anything_is_written(tmp_path):
    w = wal.open(tmp_path / "w")
    before = w.stats()["next_lsn"]
    with pytest.raises(wal.GapError):  # e's two items are fine; f's leaves a gap: nothing of the step is written
        w.append_step(["e", "e", "f"], [0, 1, 5], [10, 11, 12], [-0.1, -0.2, -0.3], 0)
    with pytest.raises(wal.ConflictError, match="twice"):  # one position, two tokens
        w.append_step(["e", "e"], [0, 0], [10, 11], [-0.1, -0.2], 0)
    with pytest.raises(wal.GapError):  # the second item skips past the first
        w.append_step(["e", "e"], [0, 2], [10, 11], [-0.1, -0.2], 0)
    w.commit()
    assert w.stats()["next_lsn"] == before and w.tokens("e") == [] and w.trajectories() == []
    w.append_step(["e", "e", "f", "e"], [0, 1, 0, 1], [10, 11, 12, 11], [-0.1, -0.2, -0.3, -0.2], 0)  # a repeat too
    w.append_step(["e", "f", "e"], [1, 1, 2], [11, 13, 14], [-0.2, -0.4, -0.5], 0)  # a repeat of the log, then new
    w.commit()
    assert w.tokens("e") == [10, 11, 14] and w.tokens("f") == [12, 13] and w.logprobs("f") == [-0.3, -0.4]
    w.close()


def test_values_out_of_range_or_of_the_wrong_kind_are_refused_by_name(tmp_path):
    w = wal.open(tmp_path / "w")
    for call in (lambda: w.append("t", 0, [1], [-0.1], 2 ** 64), lambda: w.append_step(["t"], [0], [1], [-0.1], 2 ** 64)):
        with pytest.raises(codec.CodecError, match="policy_version"):
            call()
    w.append("t", 0, [1], [-0.1], 2 ** 64 - 1)  # the largest a record holds
    with pytest.raises(codec.CodecError, match="not valid Unicode"):
        w.append("t\ud800", 0, [1], [-0.1], 0)
    for read in (w.tokens, w.length):
        with pytest.raises(codec.CodecError, match="non-empty string"):
            read(["t"])
    for bad in (["-0.5"], [b"3"], [None]):  # never parsed as numbers
        with pytest.raises(codec.CodecError, match="floats"):
            w.append("t", 1, [2], bad, 0)
    w.commit()
    assert w.tokens("t") == [1] and w.policy_versions("t") == [2 ** 64 - 1]
    w.close()
    for read in (lambda: w.length("t"), w.trajectories, lambda: w.tokens("t")):  # a closed log answers nothing
        with pytest.raises(wal.LogClosedError):
            read()
