"""Every heavy field type survives put -> plan -> loader bit-exactly, through SQLite and PostgreSQL,
memory-mapped local shards and pyarrow.fs filesystems; light fields survive in the catalog."""
from __future__ import annotations

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
from pyarrow._fs import _MockFileSystem

import dataplane
from dataplane import TrajectoryRecord

from .conftest import make_records

EXTRA_TYPES = {
    "f16": lambda rng, L: rng.standard_normal((L, 8)).astype(np.float16),
    "f32_scalar": lambda rng, L: rng.standard_normal(L).astype(np.float32),
    "f64_3d": lambda rng, L: rng.standard_normal((L, 2, 3)),
    "i8": lambda rng, L: rng.integers(-128, 128, (L, 5), dtype=np.int8),
    "i64": lambda rng, L: rng.integers(-(2**62), 2**62, L, dtype=np.int64),
    "u16": lambda rng, L: rng.integers(0, 2**16, (L, 4), dtype=np.uint16),
    "bf16": lambda rng, L: torch.randn(L, 6, generator=torch.Generator().manual_seed(L)).to(torch.bfloat16),
}


def _records(n=12, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        L = int(rng.integers(1, 90))
        recs.append(TrajectoryRecord(
            id=f"x{i:03d}", run="rt", domain="calc", prompt=f"p{i}", group_id=f"g{i // 3}",
            tokens=rng.integers(0, 2**31 - 1, L), loss_mask=rng.integers(0, 2, L).astype(bool),
            logprobs=-rng.random(L), reward=float(rng.standard_normal()), policy_min=2, policy_max=5,
            teacher_id="math" if i % 2 else "code", extras={k: f(rng, L) for k, f in EXTRA_TYPES.items()}))
    return recs


def _check_all(dp, recs, budget=40, ranks=2, **loader_kw):
    by_id = {r.id: r for r in recs}
    plan = dp.plan(tokens_per_rank=budget, ranks=ranks, seed=3)
    seen = {r.id: 0 for r in recs}
    for rank in range(ranks):
        for b in dp.loader(plan, rank=rank, extras=list(EXTRA_TYPES), **loader_kw):
            assert b.extras["bf16"].dtype == torch.bfloat16
            assert b.input_ids.dtype == torch.int64 and b.loss_mask.dtype == torch.bool
            for k, tid in enumerate(b.traj_ids):
                r, s, e = by_id[tid], int(b.seg_start[k]), int(b.seg_stop[k])
                a, c = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
                assert np.array_equal(b.input_ids[a:c].numpy(), np.asarray(r.tokens)[s:e])
                assert np.array_equal(b.loss_mask[a:c].numpy(), np.asarray(r.loss_mask)[s:e])
                assert np.array_equal(b.logprobs[a:c].numpy(), np.asarray(r.logprobs, dtype=np.float32)[s:e])
                assert np.array_equal(b.position_ids[a:c].numpy(), np.arange(s, e))
                for name, v in r.extras.items():
                    got = b.extras[name][a:c]
                    if isinstance(v, torch.Tensor):
                        assert torch.equal(got, v[s:e])
                    else:
                        assert got.numpy().dtype == v.dtype and np.array_equal(got.numpy(), v[s:e])
                seen[tid] += e - s
    assert seen == {r.id: r.length for r in recs}


def test_every_field_type_round_trips(any_dp):
    recs = _records()
    any_dp.put(recs)
    _check_all(any_dp, recs)
    sel = any_dp.select()
    assert sorted(sel.ids.tolist()) == sorted(r.id for r in recs)
    assert set(sel.teachers) == {"math", "code"}
    by_id = {r.id: r for r in recs}
    for i, tid in enumerate(sel.ids):
        assert sel.length[i] == by_id[tid].length
        assert sel.reward[i] == pytest.approx(by_id[tid].reward)
        assert (sel.policy_min[i], sel.policy_max[i]) == (2, 5)
        assert sel.teachers[sel.teacher[i]] == by_id[tid].teacher_id


def test_pyarrow_fs_uri_store(tmp_path):
    recs = _records(seed=1)
    dp = dataplane.open(tmp_path / "c.db", f"file://{tmp_path}/uri_store")  # pyarrow.fs URI, no mmap path
    assert dp.store.local
    dp.put(recs)
    _check_all(dp, recs)
    dp.close()


def test_non_local_filesystem(tmp_path):
    """A filesystem that is not local (in-memory mock, like an object store): uploads + move, no mmap."""
    fs = _MockFileSystem()
    dp = dataplane.open(tmp_path / "c.db", "bucket/prefix", filesystem=fs)
    assert not dp.store.local and not dp.store.use_mmap
    recs = _records(seed=2)
    dp.put(recs)
    assert all(i.type == pafs.FileType.File for i in fs.get_file_info(pafs.FileSelector("bucket/prefix", recursive=True))
               if i.path.endswith(".arrow"))
    _check_all(dp, recs)
    assert dp.verify_shards() == []
    dp.close()


def test_mmap_read_is_zero_copy(sqlite_dp):
    sqlite_dp.put(make_records(5))
    sel = sqlite_dp.select()
    with sqlite_dp.store.open(sel.shard_paths[0]) as rb:
        from dataplane.codec import decode

        _, cols = decode(rb)
        buf = rb.column(rb.schema.get_field_index("tokens")).values.buffers()[1]
        assert cols["tokens"].values.ctypes.data == buf.address  # a view of the map, no copy
        assert not cols["tokens"].values.flags.writeable
        del cols, buf, rb


def test_plan_is_small_json_and_pickle(sqlite_dp):
    import json
    import pickle

    sqlite_dp.put(make_records(40))
    plan = sqlite_dp.plan(tokens_per_rank=128, ranks=3, seed=1, group_aware=True)
    back = dataplane.Plan.from_json(json.loads(json.dumps(plan.to_json())))
    again = pickle.loads(pickle.dumps(back))
    for name in ("ids", "seg_traj", "seg_start", "seg_stop", "bin_offsets", "checksum", "shard", "row"):
        assert np.array_equal(getattr(plan, name), getattr(again, name)), name
    assert again.shard_paths == plan.shard_paths and again.store_root == plan.store_root
    # a rank that holds only the plan reads the same bytes as the data plane's loader
    a = [b.input_ids for b in dataplane.loader(again, rank=1)]
    b = [b.input_ids for b in sqlite_dp.loader(plan, rank=1)]
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
