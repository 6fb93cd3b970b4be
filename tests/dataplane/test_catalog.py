"""Catalog: schema version check, WAL mode, selection filters, stats, status/delete, and SQLite and
PostgreSQL giving identical selections and plans for the same seed."""
from __future__ import annotations

import sqlite3

import numpy as np
import pytest
from sqlalchemy import text

import dataplane
from dataplane import schema
from dataplane.schema import SCHEMA_VERSION

from .conftest import make_records


def test_sqlite_is_in_wal_mode(sqlite_dp, tmp_path):
    sqlite_dp.put(make_records(3))
    con = sqlite3.connect(tmp_path / "catalog.db")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


def test_unknown_schema_version_is_refused(any_dp, tmp_path):
    any_dp.put(make_records(2))
    with any_dp.catalog.engine.begin() as conn:
        conn.execute(text("UPDATE dp_meta SET value = '999' WHERE key = 'schema_version'"))
    with pytest.raises(dataplane.SchemaVersionError, match=f"schema version '999'.*reads version {SCHEMA_VERSION}"):
        dataplane.open(any_dp.catalog.url, tmp_path / "other", namespace=any_dp.catalog.namespace)


def test_selection_filters(any_dp):
    recs = make_records(60)
    any_dp.put(recs)
    recs_b = make_records(10, run="run-b", id_prefix="b")
    any_dp.put(recs_b)
    any_dp.set_status(["t00001", "t00002"], "failed")
    sel = any_dp.select(run="run-a", domain="arith", policy_min=1, policy_max=2)
    want = sorted(r.id for r in recs if r.domain == "arith" and r.policy_min >= 1 and r.policy_max <= 2
                  and r.id not in ("t00001", "t00002"))
    assert sorted(sel.ids.tolist()) == want
    assert sorted(any_dp.select(status="failed").ids.tolist()) == ["t00001", "t00002"]
    assert len(any_dp.select(run="run-b")) == 10
    assert len(any_dp.select(status=None)) == 70
    assert set(any_dp.select(teacher="teacher-arith", status=None).ids.tolist()) == {
        r.id for r in recs + recs_b if r.teacher_id == "teacher-arith"}
    # group codes are dense and nondecreasing along the canonical order: members adjacent
    s = any_dp.select(status=None)
    assert (np.diff(s.group) >= 0).all() and (np.diff(s.group) <= 1).all()
    with pytest.raises(dataplane.DataPlaneError, match="status 'nope'"):
        any_dp.select(status="nope")


def test_stats_and_delete(any_dp):
    recs = make_records(20)
    any_dp.put(recs[:10])
    any_dp.put(recs[10:])
    st = any_dp.stats()
    assert st["trajectories"] == 20 and st["tokens"] == sum(r.length for r in recs) and st["shards"] == 2
    assert st["runs"] == 1 and st["policy_versions"] == 4  # versions 0..3 appear in the ranges
    assert any_dp.delete([r.id for r in recs[:10]]) == 10
    out = any_dp.gc(min_age_s=0)
    assert len(out["empty_shards_deleted"]) == 1 and out["orphans_deleted"] == []
    assert any_dp.stats()["shards"] == 1 and len(any_dp.store.list()) == 1


def test_a_catalog_row_naming_a_path_outside_the_store_is_refused(sqlite_dp, tmp_path):
    """A shard path is catalog data: one edited to climb out of the store is never deleted by gc nor read,
    and the rest of gc's work is done."""
    victim = tmp_path / "victim.txt"
    victim.write_text("not a shard")
    recs = make_records(20)
    sqlite_dp.put(recs[:10])
    sqlite_dp.put(recs[10:])
    first = sqlite_dp.store.list()[0]
    with sqlite_dp.catalog.engine.begin() as conn:
        conn.execute(text("UPDATE dp_shards SET path = '../victim.txt' WHERE path = :p"), {"p": first})
    with pytest.raises(dataplane.DataPlaneError, match="not a path under the store"):
        sqlite_dp.verify_shards()
    sqlite_dp.delete([r.id for r in recs])
    with pytest.raises(dataplane.DataPlaneError, match=r"outside the store.*1 empty shards"):
        sqlite_dp.gc(min_age_s=3600)
    assert victim.read_text() == "not a shard" and sqlite_dp.stats()["shards"] == 0
    for rel in ("/etc/passwd", "shards/../../x.arrow", "shards//x.arrow", "x.arrow", "shards"):
        with pytest.raises(dataplane.DataPlaneError):
            sqlite_dp.store.full_path(rel)
    assert sqlite_dp.store.new_path("..").startswith("shards/run/")


@pytest.mark.parametrize("field,value,needle", [
    ("id", "t\ud800", "not valid Unicode"), ("group_id", "g\x00", "NUL"), ("group_id", "g" * 301, "301 characters"),
    ("run", "r" * 201, "201 characters"), ("domain", 7, "must be a string"), ("teacher_id", "\udfff", "not valid Unicode"),
])
def test_a_record_whose_names_the_catalog_cannot_keep_is_refused_alike_on_both_backends(any_dp, field, value, needle):
    from dataclasses import replace

    recs = make_records(3)
    recs[1] = replace(recs[1], **{field: value})
    with pytest.raises(dataplane.BadRecordError, match=needle):
        any_dp.put(recs)
    assert any_dp.stats()["trajectories"] == 0 and any_dp.store.list() == []


def test_policy_versions(sqlite_dp):
    sqlite_dp.publish_policy_version("run-z", 7, "ckpt/7")
    sqlite_dp.publish_policy_version("run-z", 7, "ckpt/7b")
    with sqlite_dp.catalog.engine.connect() as conn:
        rows = conn.execute(text("SELECT run, version, checkpoint FROM dp_policy_versions")).all()
    assert [tuple(r) for r in rows] == [("run-z", 7, "ckpt/7b")]


def test_postgres_and_sqlite_plan_identically(sqlite_dp, pg_dp):
    recs = make_records(120, seed=5, max_len=500, extras=True)
    # different insertion order and shard split: the canonical order must not depend on them
    sqlite_dp.put(recs[:70])
    sqlite_dp.put(recs[70:])
    pg_dp.put(list(reversed(recs)))
    a, b = sqlite_dp.select(), pg_dp.select()
    for name in ("ids", "length", "group", "teacher", "reward", "policy_min", "policy_max", "checksum"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.teachers == b.teachers
    for kw in ({"group_aware": True}, {"by_teacher": True}, {}):
        pa_, pb = sqlite_dp.plan(a, tokens_per_rank=400, ranks=3, seed=11, **kw), pg_dp.plan(b, tokens_per_rank=400, ranks=3, seed=11, **kw)
        for name in ("seg_start", "seg_stop", "bin_offsets", "balanced"):
            assert np.array_equal(getattr(pa_, name), getattr(pb, name)), name
        assert np.array_equal(pa_.ids[pa_.seg_traj], pb.ids[pb.seg_traj])
        # and the bytes they load are the same
        for ra, rb in zip(sqlite_dp.loader(pa_, rank=2, extras=["hidden"]), pg_dp.loader(pb, rank=2, extras=["hidden"])):
            assert ra.traj_ids == rb.traj_ids
            assert np.array_equal(ra.input_ids.numpy(), rb.input_ids.numpy())
            assert np.array_equal(ra.extras["hidden"].numpy(), rb.extras["hidden"].numpy())
    other = sqlite_dp.plan(a, tokens_per_rank=400, ranks=3, seed=12)
    assert not np.array_equal(other.ids[other.seg_traj], pa_.ids[pa_.seg_traj])


def test_bad_catalog_url(tmp_path):
    with pytest.raises(dataplane.DataPlaneError, match="expected sqlite"):
        dataplane.open("mysql://x/y", tmp_path / "s")
    with pytest.raises(dataplane.DataPlaneError, match="cannot open"):
        dataplane.open("postgresql://postgres@127.0.0.1:1/none", tmp_path / "s")


def test_reads_do_not_wait_for_a_writer(sqlite_dp, tmp_path):
    import time

    sqlite_dp.put(make_records(5))
    other = sqlite3.connect(tmp_path / "catalog.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    other.execute("UPDATE dp_trajectories SET reward = 0.5")
    t = time.perf_counter()
    assert len(sqlite_dp.select()) == 5 and sqlite_dp.stats()["trajectories"] == 5
    assert time.perf_counter() - t < 5  # not queued behind the writer (the busy timeout is 60 s)
    other.execute("ROLLBACK")
    other.close()


def test_meta_round_trips_and_stays_out_of_selections(any_dp):
    recs = make_records(4)
    recs[1].meta = {"teacher": "t-arith", "tokens_hash": "ab" * 8, "stop": 7}
    any_dp.put(recs)
    assert any_dp.meta([r.id for r in recs]) == {recs[1].id: recs[1].meta}
    assert any_dp.meta([]) == {}
    bad = make_records(1, id_prefix="bad")
    bad[0].meta = {"x": float("nan")}
    with pytest.raises(dataplane.BadRecordError, match="meta is not JSON-able"):
        any_dp.put(bad)
    assert len(any_dp.select(status=None)) == 4  # the rejected put made nothing visible


def test_a_version_1_catalog_is_migrated_in_place(any_dp, tmp_path):
    recs = make_records(3)
    any_dp.put(recs)
    with any_dp.catalog.engine.begin() as conn:  # what a catalog written before the meta column looks like
        conn.execute(text("ALTER TABLE dp_trajectories DROP COLUMN meta"))
        conn.execute(text("ALTER TABLE dp_trajectories DROP COLUMN pack"))
        conn.execute(text("UPDATE dp_meta SET value = '1' WHERE key = 'schema_version'"))
    any_dp.close()
    dp = dataplane.open(any_dp.catalog.url, tmp_path / "again", namespace=any_dp.catalog.namespace)
    try:
        assert sorted(dp.select().ids.tolist()) == sorted(r.id for r in recs)
        assert dp.stats()["schema_version"] == SCHEMA_VERSION
        more = make_records(1, id_prefix="m")
        more[0].meta = {"k": 1}
        dp.put(more)
        assert dp.meta([more[0].id]) == {more[0].id: {"k": 1}}
    finally:
        dp.close()


def _same_selection(a, b) -> None:
    for name in ("ids", "seq", "length", "group", "teacher", "reward", "policy_min", "policy_max", "shard", "row",
                 "checksum"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), name
    assert a.shard_paths == b.shard_paths and a.teachers == b.teachers


def test_a_version_2_catalog_gets_packed_metadata_in_place(any_dp, tmp_path, monkeypatch):
    """Version 2 had no packed records: opening fills them for every row (in batches), and selections and
    plans come out exactly as from the catalog written by this version."""
    recs = make_records(70, seed=5) + make_records(9, seed=6, run="run-z", id_prefix="z")
    for k, r in enumerate(recs):
        r.reward = [0.1 + 0.2, 1 / 3, -2.5e-300][k % 3]
        r.teacher_id = [None, "tb", "tä"][k % 3]
    any_dp.put(recs[:40])
    any_dp.put(recs[40:])
    any_dp.set_status([recs[3].id], "failed")
    want = any_dp.select(status=None)
    with any_dp.catalog.engine.begin() as conn:
        conn.execute(text("ALTER TABLE dp_trajectories DROP COLUMN pack"))
        conn.execute(text("UPDATE dp_meta SET value = '2' WHERE key = 'schema_version'"))
    any_dp.close()
    monkeypatch.setattr(schema, "PACK_FILL_BATCH", 16)  # several batches
    dp = dataplane.open(any_dp.catalog.url, tmp_path / "again", namespace=any_dp.catalog.namespace)
    try:
        got = dp.select(status=None)
        _same_selection(got, want)
        assert dp.select().ids.tolist() == [i for i in want.ids.tolist() if i != recs[3].id]
        p1 = dp.plan(got, tokens_per_rank=400, ranks=3, seed=1, group_aware=True, by_teacher=True)
        p2 = dp.plan(want, tokens_per_rank=400, ranks=3, seed=1, group_aware=True, by_teacher=True)
        assert p1.to_json() == p2.to_json()
    finally:
        dp.close()


def test_a_version_3_catalog_gets_names_in_its_packed_records(any_dp, tmp_path):
    """Version 3's records held the fixed-width header only: opening rewrites them."""
    recs = make_records(30, seed=7)
    any_dp.put(recs)
    want = any_dp.select(status=None)
    header = "substr(pack, 1, 56)" if any_dp.catalog.url.startswith("sqlite") else "substring(pack from 1 for 56)"
    with any_dp.catalog.engine.begin() as conn:
        conn.execute(text(f"UPDATE dp_trajectories SET pack = {header}"))
        conn.execute(text("UPDATE dp_meta SET value = '3' WHERE key = 'schema_version'"))
    any_dp.close()
    dp = dataplane.open(any_dp.catalog.url, tmp_path / "again", namespace=any_dp.catalog.namespace)
    try:
        _same_selection(dp.select(status=None), want)
    finally:
        dp.close()


def test_rows_without_packed_metadata_are_one_clear_error(sqlite_dp):
    sqlite_dp.put(make_records(3))
    with sqlite_dp.catalog.engine.begin() as conn:
        conn.execute(text("UPDATE dp_trajectories SET pack = NULL WHERE id = 't00001'"))
    with pytest.raises(dataplane.DataPlaneError, match="1 selected trajectories have no packed metadata"):
        sqlite_dp.select()


def test_selection_matches_a_python_reference_for_awkward_values(any_dp):
    """Bulk column transfer: rewards that need 17 digits, non-ASCII ids and group ids, several runs and
    teachers, empty teacher; the selection must equal one built row by row in Python (bytewise order)."""
    recs = make_records(40, seed=3) + make_records(12, seed=4, run="run-é", id_prefix="ü")
    for k, r in enumerate(recs):
        r.reward = [0.1 + 0.2, 1 / 3, -2.5e-300, 1e300 / 7, 0.0][k % 5]
        r.group_id = ("grp-ß" if k % 3 == 0 else "grp-a") + str(k // 4)
        r.teacher_id = [None, "tb", "ta", "tč"][k % 4]
    any_dp.put(recs[:30])
    any_dp.put(recs[30:])
    sel = any_dp.select(status=None)
    ref = sorted(recs, key=lambda r: (r.run.encode(), r.group_id.encode(), r.id.encode()))
    assert sel.ids.tolist() == [r.id for r in ref]
    assert sel.reward.tolist() == [r.reward for r in ref]  # exact, not 15 digits
    assert sel.length.tolist() == [r.length for r in ref]
    keys = [(r.run.encode(), r.group_id.encode()) for r in ref]
    assert sel.group.tolist() == [sorted(set(keys)).index(k) for k in keys]
    names = sorted({(r.teacher_id or "") for r in recs}, key=str.encode)
    assert sel.teachers == names and [sel.teachers[c] for c in sel.teacher] == [r.teacher_id or "" for r in ref]
    assert [sel.shard_paths[s] for s in sel.shard][:1] and sel.checksum.dtype == np.uint32
    assert len(any_dp.select(run="nothing-here")) == 0


def _reference_selection(dp, status=None) -> dataplane.Selection:
    """The selection built row by row in Python from a plain SELECT of the columns (no bulk transfer, no
    packed records): bytewise (run, group id, id) order, dense codes."""
    from dataplane.types import Selection

    q = ("SELECT seq, id, run, group_id, coalesce(teacher_id, ''), length, reward, policy_min, policy_max, shard_id,"
         " row, checksum FROM dp_trajectories" + ("" if status is None else f" WHERE status = '{status}'"))
    with dp.catalog.engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(text(q)).all()]
        paths = dict(conn.execute(text("SELECT id, path FROM dp_shards")).all())
    rows.sort(key=lambda r: (r[2].encode(), r[3].encode(), r[1].encode()))
    keys = [(r[2].encode(), r[3].encode()) for r in rows]
    group_of = {k: g for g, k in enumerate(sorted(set(keys)))}
    teachers = sorted({r[4] for r in rows}, key=str.encode)
    shard_ids = sorted({r[9] for r in rows})
    col = lambda k, dtype=np.int64: np.array([r[k] for r in rows], dtype=dtype)  # noqa: E731
    return Selection(ids=np.array([r[1] for r in rows], dtype=str), seq=col(0), length=col(5),
                     group=np.array([group_of[k] for k in keys], dtype=np.int64),
                     teacher=np.array([teachers.index(r[4]) for r in rows], dtype=np.int64), reward=col(6, np.float64),
                     policy_min=col(7), policy_max=col(8), shard=np.array([shard_ids.index(r[9]) for r in rows]),
                     row=col(10), checksum=col(11, np.uint32), shard_paths=[paths[s] for s in shard_ids],
                     teachers=teachers)


@pytest.mark.parametrize("shuffled", [False, True])
def test_bulk_select_and_plan_equal_a_row_by_row_reference(any_dp, shuffled):
    """On a seeded catalog, the bulk select (packed records, group ranks, ids compared only where a group
    arrives out of id order) gives the same arrays, and so the same plan, as the row-by-row reference;
    `shuffled` puts members of a group out of id order, so that the ids must be sorted too."""
    rng = np.random.default_rng(11)
    recs = make_records(300, seed=11, group_size=6) + make_records(40, seed=12, run="run-b", id_prefix="b")
    for r in recs:
        r.group_id = f"{int(rng.integers(0, 1 << 30)):08x}"[:3] + r.group_id  # groups not in id order
        r.teacher_id = [None, "tz", "ta", "tő"][int(rng.integers(0, 4))]
        r.reward = float(rng.standard_normal())
    if shuffled:
        recs = [recs[k] for k in rng.permutation(len(recs))]
    for k in range(0, len(recs), 70):
        any_dp.put(recs[k:k + 70])
    any_dp.set_status([r.id for r in recs[::9]], "failed")
    for status in (None, "complete"):
        got, want = any_dp.select(status=status), _reference_selection(any_dp, status)
        _same_selection(got, want)
        for group_aware, by_teacher in ((True, False), (False, True), (True, True)):
            kw = dict(tokens_per_rank=500, ranks=4, seed=3, epoch=2, group_aware=group_aware, by_teacher=by_teacher)
            assert any_dp.plan(got, **kw).to_json() == any_dp.plan(want, **kw).to_json()
