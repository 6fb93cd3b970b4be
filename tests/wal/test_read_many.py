"""Batched reads and finalizes (`read_many`, `finalize_many`): the same answers as one call per trajectory, in
process, over gRPC (ReadMany / FinalizeMany, one round trip within the service's read bound) and over shards;
a client of an older service without those RPCs falls back to one call per id."""
from __future__ import annotations

import pytest

import wal
from wal import Committed
from wal.config import ServeConfig
from wal.server import Server
from wal.sharded import ShardedWAL


def _fill(log, n_trajs=6, lengths=(3, 60, 1, 17, 250, 9)) -> list[str]:
    ids = [f"t{i}" for i in range(n_trajs)]
    for i, t in enumerate(ids):
        n = lengths[i % len(lengths)]
        log.append(t, 0, [i * 1000 + k for k in range(n)], [-(k % 5) / 5 for k in range(n)], i)
    log.append_step(ids[:3], [lengths[0], lengths[1], lengths[2]], [7, 8, 9], [-0.5, -0.25, -0.125], 99)
    log.commit()
    log.finalize("t3")
    return ids


def _one_by_one(log, ids):
    out = {}
    for t in ids:
        try:
            out[t] = Committed(log.tokens(t), log.logprobs(t), log.policy_versions(t))
        except wal.FinalizedError:
            out[t] = None
    return out


@pytest.fixture
def served(tmp_path):
    servers = []

    def make(name="log", **serve):
        srv = Server(tmp_path / name, ServeConfig(port=0, **serve))
        servers.append(srv)
        return srv
    yield make
    for s in servers:
        s.stop(0)


def _count_calls(client, monkeypatch) -> dict:
    calls: dict = {}
    real = client._call

    def counted(name, request):
        calls[name] = calls.get(name, 0) + 1
        return real(name, request)
    monkeypatch.setattr(client, "_call", counted)
    return calls


def test_read_many_matches_per_id_reads_in_process(tmp_path):
    log = wal.open(tmp_path / "log")
    ids = _fill(log)
    asked = [*ids, "nobody", "t1"]  # unknown ids read as empty; a repeat is answered once, order kept
    got = log.read_many(asked)
    assert list(got) == list(dict.fromkeys(asked))
    assert got == _one_by_one(log, asked)
    assert got["t3"] is None and got["nobody"] == Committed([], [], [])
    assert got["t0"].tokens == [0, 1, 2, 7] and got["t0"].policy_versions == [0, 0, 0, 99]
    log.close()


def test_read_many_over_grpc_is_one_round_trip_within_the_read_bound(served, monkeypatch):
    srv = served(max_read_tokens=100)  # t4 (250 tokens) is longer than a reply: it ends in chunked Reads
    c = wal.connect(srv.address, retry_s=5)
    ids = _fill(c)
    calls = _count_calls(c, monkeypatch)
    got = c.read_many([*ids, "nobody"])
    assert got == _one_by_one(srv.wal, [*ids, "nobody"])
    # t0..t3 fit one reply (t3 is finalized: no tokens); t4 does not: the next reply starts with it, cut at
    # the bound, and the client reads it whole with chunked Reads; t5 and nobody come in a third
    assert calls["ReadMany"] == 3 and calls["Read"] == 3
    calls.clear()
    small = c.read_many(["t0", "t1", "t2", "t3", "t5"])
    assert calls == {"ReadMany": 1} and small["t1"].tokens[-1] == 8
    c.close()


def test_listing_and_reading_more_ids_than_one_message_holds_come_in_pages(served, monkeypatch):
    """3,000 trajectories with 100-byte ids: 300 kB of ids against a 64 kB message bound on both sides. The
    list and the batched read come whole, in several calls, where one reply or request used to exceed the
    bound (RESOURCE_EXHAUSTED)."""
    srv = served(max_message_bytes=1 << 16)
    log = wal.connect(srv.address, retry_s=10, max_message_bytes=1 << 16)
    ids = [f"{i:05d}-" + "x" * 94 for i in range(3000)]
    for k in range(0, len(ids), 500):
        log.append_step(ids[k:k + 500], [0] * 500, list(range(k, k + 500)), [-0.5] * 500, 0)
        log.commit()
    calls = _count_calls(log, monkeypatch)
    assert log.trajectories() == ids and calls["Trajectories"] >= 5
    got = log.read_many(ids)
    assert [got[t].tokens for t in ids] == [[i] for i in range(3000)] and calls["ReadMany"] >= 5
    log.close()


def test_finalize_many_over_grpc_commits_once_and_commits_queued_appends_first(served, monkeypatch):
    srv = served()
    c = wal.connect(srv.address, retry_s=5)
    ids = [f"f{i}" for i in range(40)]
    for t in ids:
        c.append(t, 0, [1, 2], [-0.1, -0.2], 0)
    c.commit()
    c.finalize_many(ids[:5])
    c.append("late", 0, [5], [-0.5], 0)  # queued, not committed: the finalize commits it first
    calls = _count_calls(c, monkeypatch)
    fsyncs = srv.wal.stats()["fsyncs"]
    c.finalize_many(ids)  # the first five are finalized already: skipped
    assert calls == {"FinalizeMany": 1}
    assert srv.wal.stats()["fsyncs"] - fsyncs <= 2  # the queued append's commit, and one for all 40 finalizes
    assert srv.wal.tokens("late") == [5]
    assert srv.wal.trajectories() == ["late"]
    with pytest.raises(wal.FinalizedError):
        c.tokens("f39")
    c.close()


def test_sharded_read_many_and_finalize_many_go_to_each_trajectorys_shard(served):
    a, b = served("a"), served("b")
    log = wal.connect(f"{a.address},{b.address}", retry_s=5)
    assert isinstance(log, ShardedWAL)
    ids = _fill(log, n_trajs=12)
    got = log.read_many(ids)
    assert list(got) == ids and got == _one_by_one(log, ids)
    assert a.wal.trajectories() and b.wal.trajectories()  # both shards hold some
    log.finalize_many(ids[:8])
    assert sorted(log.trajectories()) == sorted(ids[8:])
    assert all(v is None for v in list(log.read_many(ids).values())[:8])
    log.close()


def test_a_service_without_the_batched_rpcs_is_read_one_id_at_a_time(served, monkeypatch):
    import wal.server as srv_mod

    full = srv_mod.TokenLogService.handler

    def older(self):  # the handler of a service built before ReadMany and FinalizeMany
        h = full(self)
        h._method_handlers = {k: v for k, v in h._method_handlers.items() if not k.endswith(("ReadMany", "FinalizeMany"))}
        return h
    monkeypatch.setattr(srv_mod.TokenLogService, "handler", older)
    srv = served()
    c = wal.connect(srv.address, retry_s=5)
    ids = _fill(c)
    assert c.read_many(ids) == _one_by_one(srv.wal, ids)
    c.finalize_many(["t0", "t1"])
    assert not c._batched and sorted(srv.wal.trajectories()) == ["t2", "t4", "t5"]
    c.close()
