"""The WAL benchmark runs end to end (tiny budget) and prints the JSON that docs/wal.md quotes."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys


def test_bench_wal_smoke(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.wal", "--json", "--seconds", "0.3", "--rounds", "1", "--bs", "64,512",
                        "--scan-mb", "2", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["device"] and set(out["targets"]) == {"step_b512_vs_raw_fdatasync", "step_b64_vs_raw_fdatasync",
                                                     "step_b512_vs_raw_direct_dsync",
                                                     "inproc_vs_sqlite_blob_b512", "grpc_4_clients_vs_1",
                                                     "recovery_scan_cold_mb_s"}
    assert out["meta"]["commit"] and out["meta"]["date_utc"] and out["meta"]["machine"]
    b512 = out["configs"]["b512"]
    direct = "raw_direct_step_dsync" in b512  # the platform and tmp_path's file system take O_DIRECT + RWF_DSYNC
    for name, t in out["targets"].items():
        assert set(t) - {"note"} == {"value", "goal", "met"}
        assert t["value"] > 0 if direct or name != "step_b512_vs_raw_direct_dsync" else t["value"] is None
    if direct:  # the log's direct commit against the same direct I/O without the log
        assert out["targets"]["step_b512_vs_raw_direct_dsync"]["value"] == b512["paired_ratio_step_steady_vs_raw_direct_step_dsync"]
        assert b512["raw_direct_step_dsync"]["steps_s"] > 0 and b512["paired_ratio_raw_direct_step_dsync_vs_raw_prealloc_step_fdatasync"] > 0  # the bounds on the SQLite target: the disk's, and the log's own frame written raw
    assert b512["paired_ratio_floor_vs_sqlite_blob"] > 0 and b512["paired_ratio_raw_prealloc_vs_sqlite_blob_steady"] > 0
    blob = out["targets"]["inproc_vs_sqlite_blob_b512"]  # both sides in steady state; the fresh files' ratio beside it
    assert blob["value"] == b512["paired_ratio_inproc_steady_vs_sqlite_blob_steady"]
    assert f"{b512['paired_ratio_raw_prealloc_vs_sqlite_blob_steady']}x" in blob["note"]
    assert f"{b512['paired_ratio_inproc_vs_sqlite_blob']}x" in blob["note"]
    cfg = out["configs"]["b512"]
    assert all(cfg[m]["steps_s"] > 0 for m in ("raw_fsync", "inproc", "sqlite_rows", "sqlite_blob", "inproc_batched", "inproc_step", "inproc_step_steady",
                                              "inproc_step_lists", "raw_prealloc_step_fdatasync", "raw_prealloc_fdatasync",
                                              "floor_1byte_fdatasync", "inproc_steady", "sqlite_blob_steady"))
    assert out["grpc"]["b512_clients4"]["tokens_s"] > 0 and out["recovery_scan"]["mb_s"] > 0 < out["recovery_scan"]["cold_mb_s"]
    assert out["recovery_scan_steps"]["records"] > 0 and out["recovery_scan_steps"]["mb_s"] > 0
    for scan in (out["recovery_scan"], out["recovery_scan_steps"]):  # opens in new processes, and in one beside them
        assert all(scan[k] > 0 for k in ("cold_mb_s", "mb_s", "cold_mb_s_same_process", "mb_s_same_process", "cpu_mb_s"))
        assert len(scan["cold_mb_s_runs"]) == len(scan["cold_mb_s_same_process_runs"]) == out["rounds"]
    assert all(out["grpc"][f"b512_clients{n}"]["server_cpu_us_per_step"] > 0 for n in (1, 4))
    assert list(tmp_path.iterdir()) == [], "the benchmark cleans up after itself"


def test_sqlite_steady_state_inserts_into_pages_it_freed(tmp_path):
    """The steady SQLite baseline's timed inserts reuse the pages its untimed setup freed: the database
    does not grow while timed, and only the timed rows are left."""
    from bench.wal import sqlite_blob_steady

    rate = sqlite_blob_steady(tmp_path, 64, 0.05)
    con = sqlite3.connect(tmp_path / "blob.db")
    try:
        rows = con.execute("SELECT COUNT(*), SUM(traj = 'traj-000001') FROM chunk").fetchone()
        free = con.execute("PRAGMA freelist_count").fetchone()[0]
    finally:
        con.close()
    assert rate > 0 and rows[0] == rows[1] > 0
    assert free > 0, "the timed inserts grew the database instead of reusing its free pages"


def test_the_steady_log_has_written_every_row_the_timed_step_group_takes_over(tmp_path):
    """A long run's step groups write over row memory its first group already wrote, so its steps fault in
    no fresh pages; the steady log's untimed decode leaves it so: every row of the memory the timed group
    takes over holds the warm decode's tokens."""
    from bench.wal import _step_arrays, _steady_log
    from wal.stepgroup import MAX_ROWS

    w = _steady_log(tmp_path, 64)
    try:
        rows = w._store.tokens._dissolved.tok_RB
        assert rows.shape == (MAX_ROWS, 64)
        assert (rows == _step_arrays(64)[0]).all(axis=1).sum() == MAX_ROWS, "rows the timed steps will fault in"
    finally:
        w.close()


def test_a_recovery_open_runs_in_a_new_process_and_checks_what_it_reopened(tmp_path):
    """The recovery target's open is timed first thing in a new interpreter, and a log that does not hold
    what was written fails the measurement there and here alike."""
    import numpy as np
    import pytest

    import wal
    from bench.wal import _open_in_new_process, open_timed

    w = wal.open(tmp_path / "log")
    w.append("t", 0, np.arange(100, dtype=np.int32), -np.ones(100), 0)
    w.commit()
    w.close()
    o = _open_in_new_process(tmp_path / "log", 100)
    assert o["bytes"] > 100 * 12 and o["s"] > 0 and o["cpu_s"] >= 0
    with pytest.raises(RuntimeError, match="holds 100 live tokens"):
        open_timed(tmp_path / "log", 101)
    with pytest.raises(RuntimeError, match="an open failed in its process"):
        _open_in_new_process(tmp_path / "log", 101)


def test_bench_wal_grpc_floor_smoke(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.wal_grpc_floor", "--json", "--seconds", "0.3", "--rounds", "1",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    for mode in ("echo", "fdatasync"):
        for n in (1, 4):
            m = out[mode][f"clients{n}"]
            assert m["steps_s"] > 0 and m["server_cpu_us"] >= 0 and m["cpu_us_per_step"] > 0
    assert out["bound"]["max_ratio_4_vs_1"] > 0 and out["cores"] >= 1
    assert list(tmp_path.iterdir()) == [], "the benchmark cleans up after itself"
