"""Put visibility: a trajectory is visible only after its shard is durable; a process killed (SIGKILL)
between the shard write and the catalog insert leaves nothing half-visible; a rejected put makes nothing
visible and leaves no orphan."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import dataplane
from core import fileio

from .conftest import make_records

CHILD = textwrap.dedent("""
    import sys, time
    import dataplane
    from tests.dataplane.conftest import make_records
    dp = dataplane.open(sys.argv[1], sys.argv[2])
    def stall(*a, **k):  # the shard is durable now; the catalog insert never happens
        print("DURABLE", flush=True)
        time.sleep(120)
    dp.catalog.insert_shard = stall
    dp.put(make_records(8, id_prefix="crash"))
""")


def _run_until_durable(catalog, store) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(catalog), str(store)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        line = proc.stdout.readline()
        assert line.strip() == "DURABLE", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def test_kill_between_shard_write_and_catalog_insert(tmp_path):
    catalog, store = tmp_path / "cat.db", tmp_path / "store"
    dp = dataplane.open(catalog, store)
    dp.put(make_records(5, id_prefix="before"))
    _run_until_durable(catalog, store)
    # the shard file is there and complete, the trajectories are not visible, anywhere
    assert len(dp.store.list()) == 2
    assert sorted(dp.select(status=None).ids.tolist()) == [f"before{i:05d}" for i in range(5)]
    assert dp.stats()["trajectories"] == 5 and dp.stats()["shards"] == 1
    plan = dp.plan(tokens_per_rank=1000)
    assert sum(b.num_tokens for b in dp.loader(plan)) == plan.num_tokens
    # the same trajectories can be put again (their ids were never taken) ...
    dp.put(make_records(8, id_prefix="crash"))
    assert dp.stats()["trajectories"] == 13
    # ... and gc removes the orphan only once it is old enough not to be a put in flight
    assert dp.gc(min_age_s=3600)["orphans_deleted"] == []
    removed = dp.gc(min_age_s=0)["orphans_deleted"]
    assert len(removed) == 1 and len(dp.store.list()) == 2
    assert dp.verify_shards() == []
    dp.close()


def test_rejected_put_leaves_nothing(sqlite_dp):
    sqlite_dp.put(make_records(4))
    files = sqlite_dp.store.list()
    dup = make_records(6)[2:]  # t00002, t00003 already exist
    with pytest.raises(dataplane.BadRecordError, match="already in the catalog.*t00002"):
        sqlite_dp.put(dup)
    assert sqlite_dp.store.list() == files  # the shard written for it was removed
    assert sqlite_dp.stats()["trajectories"] == 4


@pytest.mark.parametrize("mutate, match", [
    (lambda r: setattr(r, "loss_mask", r.loss_mask[:-1]), "loss_mask has shape"),
    (lambda r: setattr(r, "status", "weird"), "status 'weird'"),
    (lambda r: setattr(r, "policy_max", -1), "policy range"),
    (lambda r: r.logprobs.__setitem__(0, float("nan")), "logprobs must be finite"),
    (lambda r: setattr(r, "tokens", r.tokens[:0]), "empty token sequence|has shape"),
    (lambda r: r.extras.__setitem__("h", r.tokens[:-1].astype("float32")), "first axis"),
    (lambda r: setattr(r, "id", "a\x00b"), "without NUL"),
    (lambda r: setattr(r, "loss_mask", r.loss_mask * 2 + 1), "only 0/1"),
])
def test_bad_records_are_rejected_before_anything_is_written(sqlite_dp, mutate, match):
    recs = make_records(3)
    mutate(recs[1])
    with pytest.raises(dataplane.BadRecordError, match=match):
        sqlite_dp.put(recs)
    assert sqlite_dp.store.list() == [] and sqlite_dp.stats()["trajectories"] == 0


def test_inconsistent_extras_in_one_put(sqlite_dp):
    recs = make_records(2, extras=True)
    recs[1].extras["hidden"] = recs[1].extras["hidden"].astype("float32")
    with pytest.raises(dataplane.BadRecordError, match="separate calls"):
        sqlite_dp.put(recs)
    assert sqlite_dp.store.list() == []


def test_shard_write_is_atomic(tmp_path, monkeypatch):
    """A failure while writing the shard (disk full at fsync) leaves no file behind and nothing visible."""
    dp = dataplane.open(tmp_path / "c.db", tmp_path / "s")

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        dp.put(make_records(3))
    monkeypatch.undo()
    assert dp.store.list() == [] and dp.stats()["trajectories"] == 0
    assert [p for p in (tmp_path / "s").rglob("*") if p.is_file()] == []  # not even the temp file
    dp.close()


WRITER = textwrap.dedent("""
    import sys
    import dataplane
    from tests.dataplane.conftest import make_records
    dp = dataplane.open(sys.argv[1], sys.argv[2])
    for k in range(5):  # several small puts each, interleaving with the other writers
        dp.put(make_records(10, seed=k, id_prefix=f"w{sys.argv[3]}-{k}-"))
    dp.close()
""")


def test_concurrent_writers_share_one_sqlite_catalog(tmp_path):
    catalog, store = tmp_path / "cat.db", tmp_path / "store"
    dataplane.open(catalog, store).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(catalog), str(store), str(w)], cwd=os.getcwd(),
                              stderr=subprocess.PIPE, text=True) for w in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    dp = dataplane.open(catalog, store)
    assert dp.stats()["trajectories"] == 150 and dp.stats()["shards"] == 15
    plan = dp.plan(tokens_per_rank=500, ranks=2)
    assert sum(b.num_tokens for r in (0, 1) for b in dp.loader(plan, rank=r)) == plan.num_tokens
    assert dp.verify_shards() == []
    dp.close()
