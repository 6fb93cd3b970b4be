"""The log service at cluster scale: many concurrent writer streams, back-pressure that clients wait out
(bounded, then one clear error), and one log sharded over several services by trajectory id."""
from __future__ import annotations

import threading

import pytest

import wal
from wal import codec
from wal.config import ServeConfig
from wal.server import Server
from wal.sharded import ShardedWAL, parse_addresses, shard_of


def _writer(address: str, name: str, rounds: int, out: dict, retry_s: float = 60.0) -> None:
    try:
        log = wal.connect(address, retry_s=retry_s)
        try:
            for i in range(rounds):
                log.append(name, i, [i + 1], [-0.5], 0)
                log.commit()
            out[name] = ("ok", log.overload_waits)
        finally:
            log.close()
    except Exception as exc:
        out[name] = ("error", exc)


def test_overload_is_back_pressure_that_clients_wait_out(tmp_path):
    # a service that holds 4 concurrent calls, 16 clients appending and committing at once
    srv = Server(tmp_path / "log", ServeConfig(port=0, max_workers=4))
    try:
        out: dict = {}
        threads = [threading.Thread(target=_writer, args=(srv.address, f"t{k:02d}", 20, out)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert {k: v[0] for k, v in out.items()} == {f"t{k:02d}": "ok" for k in range(16)}
        assert sum(v[1] for v in out.values()) > 0, "no client met the bound: the test did not overload the service"
        reader = wal.connect(srv.address, retry_s=10)
        assert all(reader.tokens(f"t{k:02d}") == list(range(1, 21)) for k in range(16))
        reader.close()
    finally:
        srv.stop(0)


def test_overload_past_the_bound_is_one_clear_error(tmp_path):
    srv = Server(tmp_path / "log", ServeConfig(port=0, max_workers=2))
    hold = [wal.connect(srv.address, retry_s=5) for _ in range(2)]
    try:
        for k, h in enumerate(hold):  # two open append streams occupy both slots
            h.append(f"h{k}", 0, [1], [-1.0], 0)
            h.commit()
        out: dict = {}
        _writer(srv.address, "late", 1, out, retry_s=1.0)
        status, exc = out["late"]
        assert status == "error" and isinstance(exc, wal.RemoteError)
        assert "refused this client for load" in str(exc) and "max_workers" in str(exc)
    finally:
        for h in hold:
            h.close()
        srv.stop(0)


def test_sharded_log_routes_by_trajectory_and_reads_back(tmp_path):
    servers = [Server(tmp_path / f"s{k}", ServeConfig(port=0)) for k in range(3)]
    try:
        spec = ",".join(s.address for s in servers)
        log = wal.connect(spec, retry_s=10)
        assert isinstance(log, ShardedWAL)
        ids = [f"traj-{i}" for i in range(30)]
        log.append_step(ids, [0] * 30, list(range(30)), [-0.1] * 30, 0)
        log.append(ids[0], 1, [7, 8], [-0.2, -0.3], 1)
        log.commit()
        log.finalize(ids[1])
        assert log.tokens(ids[0]) == [0, 7, 8] and log.policy_versions(ids[0]) == [0, 1, 1]
        assert sorted(log.trajectories()) == sorted(ids[:1] + ids[2:])
        with pytest.raises(wal.FinalizedError):
            log.tokens(ids[1])
        log.close()
        # each trajectory sits on its shard alone, and every shard got some
        per_shard = [set(wal.connect(s.address, retry_s=5).trajectories()) for s in servers]
        for i, t in enumerate(ids[2:], 2):
            assert [t in p for p in per_shard] == [k == shard_of(t, 3) for k in range(3)]
        assert all(per_shard)
        # a second client (another worker) finds the same trajectories where the first put them
        again = wal.connect(spec, retry_s=10)
        assert [again.tokens(t) for t in ids[2:]] == [[i] for i in range(2, 30)]
        again.close()
    finally:
        for s in servers:
            s.stop(0)


def test_a_sharded_step_is_checked_whole_before_any_shard_gets_its_part(tmp_path):
    """A NaN in the part of a later shard: no shard queues anything, so the next commit writes nothing."""
    servers = [Server(tmp_path / f"s{k}", ServeConfig(port=0)) for k in range(2)]
    try:
        log = wal.connect(",".join(s.address for s in servers), retry_s=10)
        ids = [f"traj{i}" for i in range(8)]
        assert len({shard_of(t, 2) for t in ids}) == 2
        lps = [-0.1] * 8
        lps[max(range(8), key=lambda i: (shard_of(ids[i], 2), i))] = float("nan")  # on the shard served last
        with pytest.raises(codec.CodecError, match="NaN"):
            log.append_step(ids, [0] * 8, list(range(8)), lps, 0)
        with pytest.raises(codec.CodecError, match="policy_version"):
            log.append_step(ids, [0] * 8, list(range(8)), [-0.1] * 8, 2 ** 64)
        log.commit()
        assert log.trajectories() == []
        log.append_step(ids, [0] * 8, list(range(8)), [-0.1] * 8, 0)
        log.commit()
        assert [log.tokens(t) for t in ids] == [[i] for i in range(8)]
        log.close()
    finally:
        for s in servers:
            s.stop(0)


def test_shard_map_parsing():
    assert parse_addresses(" a:1, b:2 ,") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="twice"):
        parse_addresses("a:1,a:1")
    assert [shard_of(f"x{i}", 4) for i in range(8)] == [shard_of(f"x{i}", 4) for i in range(8)]
