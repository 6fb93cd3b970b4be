"""Loader reads: corruption anywhere in a row that is read is caught (a later piece of a split row, a
column the caller did not ask for), for local (`pread`) and non-local (copy) stores alike; the bytes
delivered are exactly the stored bytes of the planned ranges; output buffers are reused once released
and never while a batch is held."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dataplane
from dataplane import TrajectoryRecord

from .conftest import make_records


def _flip(path: Path, needle: bytes, at: int = 1) -> None:
    raw = bytearray(path.read_bytes())
    pos = raw.find(needle)
    assert pos >= 0 and raw.find(needle, pos + 1) < 0  # the bytes are where we think, once
    raw[pos + at] ^= 0x10
    path.write_bytes(bytes(raw))


def _only_shard(dp) -> Path:
    (rel,) = dp.store.list()
    return Path(dp.store.full_path(rel))


def _long(n=3000, seed=1):
    rng = np.random.default_rng(seed)
    return TrajectoryRecord(id="long", run="r", domain="arith", prompt="p", group_id="g",
                            tokens=rng.integers(0, 1 << 30, n, dtype=np.int64), loss_mask=rng.integers(0, 2, n),
                            logprobs=-rng.random(n).astype(np.float32), reward=1.0)


@pytest.mark.parametrize("local", [True, False])
def test_flip_in_a_later_piece_of_a_split_row_is_caught(tmp_path, local):
    dp = dataplane.open(tmp_path / "c.db", tmp_path / "store", use_mmap=local)  # pread, or copy from memory
    rec = _long()
    dp.put([rec])
    plan = dp.plan(tokens_per_rank=1000)  # 3 pieces: [0, 1000), [1000, 2000), [2000, 3000)
    assert plan.summary()["split_trajectories"] == 1
    whole = np.concatenate([b.input_ids.numpy() for b in dp.loader(plan)])
    assert np.array_equal(whole, rec.tokens)
    # one flipped bit in token 2500, inside the last piece only
    _flip(_only_shard(dp), np.asarray(rec.tokens[2500:2504], dtype=np.int32).tobytes())
    with pytest.raises(dataplane.ChecksumError, match=r"trajectory 'long' \(shard file .*\.arrow, row 0\): checksum"):
        list(dp.loader(plan))
    dp.close()


def test_flip_in_a_column_not_asked_for_is_caught(sqlite_dp):
    recs = make_records(6, extras=True)
    sqlite_dp.put(recs)
    plan = sqlite_dp.plan(tokens_per_rank=10_000)
    assert sum(b.num_tokens for b in sqlite_dp.loader(plan)) == plan.num_tokens  # extras not requested
    score = np.asarray(recs[2].extras["score"], dtype=np.float32)
    _flip(_only_shard(sqlite_dp), score.tobytes())
    with pytest.raises(dataplane.ChecksumError, match=r"trajectory 't00002' \(shard file .*row 2\): checksum"):
        list(sqlite_dp.loader(plan))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_flipped_bit_in_a_shard_footer_is_a_data_plane_error(sqlite_dp, seed):
    """150 seeded single-bit flips in a shard's last 700 bytes (schema, footer, metadata): each load either
    succeeds or fails with a DataPlaneError naming the file, never with whatever the parser raised."""
    recs = make_records(8, extras=True, seed=seed)
    sqlite_dp.put(recs)
    plan = sqlite_dp.plan(tokens_per_rank=10_000)
    path = _only_shard(sqlite_dp)
    pristine = path.read_bytes()
    rng = np.random.default_rng(seed)
    raised = 0
    for pos in rng.integers(max(0, len(pristine) - 700), len(pristine), 150):
        data = bytearray(pristine)
        data[pos] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(data))
        try:
            for _ in sqlite_dp.loader(plan, prefetch=0, extras=["hidden", "score"]):
                pass
        except dataplane.DataPlaneError as exc:
            assert str(path) in str(exc)
            raised += 1
    path.write_bytes(pristine)
    assert raised > 0


def test_the_loader_s_memory_follows_the_data_not_the_token_budget(sqlite_dp):
    """A budget of 2^28 tokens per rank over a few thousand tokens: the loader's buffers are sized by the
    largest bin, so its allocations stay at kilobytes (sized by the budget, one was 2 GiB)."""
    import tracemalloc

    sqlite_dp.put(make_records(10))
    plan = sqlite_dp.plan(tokens_per_rank=1 << 28)
    tracemalloc.start()
    try:
        got = sum(b.num_tokens for b in sqlite_dp.loader(plan, prefetch=0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == plan.num_tokens and peak < 32 << 20


def test_bytes_delivered_are_the_stored_bytes_of_the_planned_ranges(sqlite_dp):
    recs = make_records(40, max_len=700)
    sqlite_dp.put(recs)
    plan = sqlite_dp.plan(tokens_per_rank=500, ranks=2)  # some rows split
    assert plan.summary()["split_trajectories"] > 0
    delivered = read = 0
    for r in range(2):
        loader = sqlite_dp.loader(plan, rank=r)
        for b in loader:
            assert b.bytes_delivered == b.num_tokens * 9  # int32 token + uint8 mask + float32 log-prob
            delivered += b.bytes_delivered
            read += b.bytes_read
    assert delivered == plan.num_tokens * 9
    assert read > delivered  # split rows' first pieces read the rest of the row to verify it
    extra = sum(b.bytes_read - b.bytes_delivered for r in range(2) for b in sqlite_dp.loader(plan, rank=r, verify=False))
    assert extra == 0  # without verification only the planned ranges are read


def test_output_buffers_are_reused_once_released_and_never_while_held(sqlite_dp):
    sqlite_dp.put(make_records(200, max_len=50))
    plan = sqlite_dp.plan(tokens_per_rank=100)
    loader = sqlite_dp.loader(plan, prefetch=0)
    b = loader.build(0)
    del b
    pooled = {k: [id(x) for x in v] for k, v in loader._pool.free.items()}
    for m in range(1, 6):
        b = loader.build(m)
        del b
    assert {k: [id(x) for x in v] for k, v in loader._pool.free.items()} == pooled  # no fresh buffers
    kept = loader.build(6)
    snapshot = kept.input_ids.clone()
    other = loader.build(7)
    assert kept.input_ids.data_ptr() != other.input_ids.data_ptr()
    assert bool((kept.input_ids == snapshot).all())


def test_building_threads_yield_the_same_batches_in_order(sqlite_dp):
    sqlite_dp.put(make_records(300, max_len=400))
    plan = sqlite_dp.plan(tokens_per_rank=800, ranks=2, seed=3)

    def epoch(r, **kw):
        return [(b.minibatch, b.traj_ids, b.input_ids.clone(), b.position_ids.clone(), b.cu_seqlens.clone(),
                 b.loss_mask.clone(), b.logprobs.clone()) for b in sqlite_dp.loader(plan, rank=r, **kw)]

    for r in range(2):
        ref = epoch(r, prefetch=0)
        assert [x[0] for x in ref] == list(range(plan.num_minibatches))
        for kw in ({"prefetch": 1, "threads": 2}, {"prefetch": 3, "threads": 3}):
            got = epoch(r, **kw)
            assert [x[:2] for x in got] == [x[:2] for x in ref]
            assert all(all(bool((a == b).all()) for a, b in zip(g[2:], w[2:])) for g, w in zip(got, ref))
    with pytest.raises(dataplane.DataPlaneError, match="threads 0"):
        sqlite_dp.loader(plan, threads=0)


def _mapped_shard_kb() -> int:
    """Resident kB of this process's mappings of shard files (page-cache pages mapped into its tables)."""
    kb, name = 0, ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            name = head[5] if len(head) > 5 else ""
        elif head[0] == "Rss:" and name.endswith(".arrow"):
            kb += int(head[1])
    return kb


def test_a_build_maps_no_shard_page_however_many_shards_it_touches(tmp_path):
    """RSS must not grow with the number of shards a minibatch reads from (a 10x larger dataset spreads
    a minibatch over 10x more shards): ids and offsets are copied out at open, heavy ranges `pread`."""
    dp = dataplane.open(tmp_path / "c.db", tmp_path / "store")
    for k in range(12):  # 12 shards, every minibatch reads from most of them
        dp.put(make_records(60, seed=k, max_len=2000, id_prefix=f"s{k}-"))
    plan = dp.plan(tokens_per_rank=40_000, seed=1)
    loader = dp.loader(plan, prefetch=0)
    seen, shards = [], []
    orig = loader._copy_shard

    def copy_shard(st, *args):
        out = orig(st, *args)
        seen.append(_mapped_shard_kb())
        shards.append(args[1])
        return out

    loader._copy_shard = copy_shard
    tokens = sum(b.num_tokens for b in loader)
    assert tokens == plan.num_tokens and len(set(shards)) == 12 and len(shards) > 24
    assert max(seen) == 0, seen  # no page of any shard map resident while building
    dp.close()


def test_verification_reads_use_a_fixed_scratch_whatever_the_row_length(tmp_path, monkeypatch):
    from dataplane import streaming

    monkeypatch.setattr(streaming, "VERIFY_CHUNK_BYTES", 1000)  # rows of 3000 tokens: 12 kB per column
    dp = dataplane.open(tmp_path / "c.db", tmp_path / "store")
    rec = _long()
    dp.put([rec])
    plan = dp.plan(tokens_per_rank=1000)
    loader = dp.loader(plan, prefetch=0)
    assert np.array_equal(np.concatenate([b.input_ids.numpy() for b in loader]), rec.tokens)
    assert loader.bytes_read > loader.bytes_delivered  # the rest of the split row was read, chunk by chunk
    assert all(st.scratch.nbytes <= 1000 for st in loader._states)
    _flip(_only_shard(dp), np.asarray(rec.tokens[2500:2504], dtype=np.int32).tobytes())
    with pytest.raises(dataplane.ChecksumError, match=r"trajectory 'long' .*checksum"):
        list(dp.loader(plan, prefetch=0))
    dp.close()
