"""Worker (in one process, real WAL and snapshot store): a graceful preemption at a random token resumes
to exactly the uninterrupted trajectory, by KV restore or, when the snapshot is bad, by re-prefill."""
import random

import pytest

from rollout.config import EngineConfig
from rollout.sampling import SamplingParams
from rollout.types import Request
from rollout.worker import RolloutWorker, WorkerSpec

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=40)


def _spec(tmp, ckpt, name, batch=4):
    return WorkerSpec(name=name, checkpoint=str(ckpt), wal_path=str(tmp / name / "wal"),
                      snapshot_uri=str(tmp / name / "kv"), seed=11, engine=EngineConfig(max_batch=batch, strict=True))


def _requests(n, offset=0):
    return [Request(f"arith-{i + offset}", "arith", f"add {100 + 7 * i}+{30 + 11 * i}=", PARAMS) for i in range(n)]


def _drain(w, limit=10_000):
    out = {}
    for _ in range(limit):
        rep = w.run(8)
        for f in rep.finished:
            out[f.traj_id] = f
        w.finalize([f.traj_id for f in rep.finished])
        if rep.idle:
            return out
    raise AssertionError("worker did not finish")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_ckpt):
    tmp = tmp_path_factory.mktemp("ref")
    w = RolloutWorker(_spec(tmp, tiny_ckpt, "ref"))
    w.submit(_requests(3))
    out = _drain(w)
    w.close()
    return out


def _interrupt(tmp, ckpt, rng, damage=None):
    spec = _spec(tmp, ckpt, "w")
    w = RolloutWorker(spec)
    w.submit(_requests(3))
    for _ in range(rng.randint(1, 12)):
        w.run(1)
    assert w.preempt() > 0
    if damage:
        damage(w.store)
    w2 = RolloutWorker(spec, policy_version=1 if damage == "stale" else 0)
    w2.submit(_requests(3))
    out = _drain(w2)
    w2.close()
    return out, w2.counters


def _check(out, reference):
    assert set(out) == set(reference)
    for t, f in reference.items():
        assert out[t].tokens == f.tokens and out[t].logprobs == pytest.approx(f.logprobs, abs=0)


def _trials(n):
    return [pytest.param(i, id=f"trial{i}") for i in range(n)]


@pytest.mark.parametrize("trial", _trials(4))
def test_resume_after_preemption_equals_uninterrupted(tmp_path, tiny_ckpt, reference, trial):
    out, c = _interrupt(tmp_path, tiny_ckpt, random.Random(trial))
    _check(out, reference)
    assert c["kv_restore"] >= 1 and c["reprefill"] == 0, dict(c)


def test_a_split_resume_after_preemption_equals_uninterrupted(tmp_path, tiny_ckpt, monkeypatch):
    """Not strict, snapshots in blocks of 4 tokens: the resumes re-prefill a head while reading the rest."""
    import os

    import rollout.restore as restore
    import rollout.snapshot as snap

    monkeypatch.setattr(snap, "BLOCK_TOKENS", 4)
    monkeypatch.setattr(restore, "SPLIT_ON_CPU", True)

    def spec(name):
        return WorkerSpec(name=name, checkpoint=str(tiny_ckpt), wal_path=str(tmp_path / name / "wal"),
                          snapshot_uri=str(tmp_path / name / "kv"), seed=11, engine=EngineConfig(max_batch=4, strict=False))

    ref = RolloutWorker(spec("ref"))
    ref.submit(_requests(3))
    want = _drain(ref)
    ref.close()
    w = RolloutWorker(spec("w"))
    w.submit(_requests(3))
    for _ in range(12):
        w.run(1)
    assert w.preempt() > 0
    for path in w.store.ids_on_disk():  # resumed elsewhere: the snapshots are cold there
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    w2 = RolloutWorker(spec("w"))
    w2.submit(_requests(3))
    out, c = _drain(w2), w2.counters
    w2.close()
    assert set(out) == set(want) and all(out[t].tokens == f.tokens for t, f in want.items())
    assert all(out[t].logprobs == pytest.approx(f.logprobs, abs=1e-4) for t, f in want.items())
    assert c["kv_restore"] >= 1 and c["kv_restore_split"] >= 1 and c["reprefill"] == 0, dict(c)


@pytest.mark.slow
@pytest.mark.parametrize("trial", _trials(50))
def test_resume_after_preemption_equals_uninterrupted_50(tmp_path, tiny_ckpt, reference, trial):
    out, c = _interrupt(tmp_path, tiny_ckpt, random.Random(1000 + trial))
    _check(out, reference)


def _corrupt(store):
    for p in store.ids_on_disk():
        with open(p, "r+b") as f:
            f.seek(-3, 2)
            b = f.read(1)
            f.seek(-3, 2)
            f.write(bytes([b[0] ^ 0xFF]))


def _delete(store):
    import os
    for p in store.ids_on_disk():
        os.unlink(p)


@pytest.mark.parametrize("damage,reason", [(_corrupt, "snapshot_corrupt"), (_delete, "snapshot_missing")])
def test_bad_snapshot_falls_back_to_reprefill(tmp_path, tiny_ckpt, reference, damage, reason):
    out, c = _interrupt(tmp_path, tiny_ckpt, random.Random(7), damage)
    _check(out, reference)
    assert c["kv_restore"] == 0 and c["reprefill"] == c[reason] == c["resumed"] - c["resumed_complete"] >= 1, dict(c)


def test_a_preemption_whose_snapshots_fail_to_write_still_releases_the_wal(tmp_path, tiny_ckpt, reference):
    """The snapshot directory replaced by a file: every write fails in the kernel. The preemption counts the
    failures, writes nothing, still releases the WAL, and the next worker re-prefills from it."""
    import os
    import shutil

    spec = _spec(tmp_path, tiny_ckpt, "w")
    w = RolloutWorker(spec)
    w.submit(_requests(3))
    for _ in range(4):
        w.run(1)
    in_flight = len(w.engine.seqs)
    shutil.rmtree(spec.snapshot_uri)
    open(spec.snapshot_uri, "w").close()
    assert w.preempt() == 0 and w.counters["snapshots_failed"] == in_flight >= 1
    os.unlink(spec.snapshot_uri)
    w2 = RolloutWorker(spec)  # opens the WAL: the preemption released it
    w2.submit(_requests(3))
    out = _drain(w2)
    w2.close()
    _check(out, reference)
    assert w2.counters["snapshot_missing"] == w2.counters["reprefill"] >= 1 and w2.counters["kv_restore"] == 0


def test_stale_snapshot_falls_back_to_reprefill(tmp_path, tiny_ckpt, reference):
    """Same weights under a newer policy version: the snapshot is stale; the re-prefill still agrees."""
    spec = _spec(tmp_path, tiny_ckpt, "w")
    w = RolloutWorker(spec)
    w.submit(_requests(3))
    for _ in range(5):
        w.run(1)
    w.preempt()
    w2 = RolloutWorker(spec, policy_version=1)
    w2.submit(_requests(3))
    out = _drain(w2)
    assert w2.counters["snapshot_stale"] == w2.counters["reprefill"] >= 1 and w2.counters["kv_restore"] == 0
    for t, f in reference.items():
        assert out[t].tokens == f.tokens
        assert out[t].policy_versions == sorted(out[t].policy_versions) and out[t].policy_versions[0] == 0
    assert any(1 in f.policy_versions for f in out.values())  # tokens drawn after the restart record v1


def test_commit_order_tokens_are_durable_before_exposed(tmp_path, tiny_ckpt):
    """Whatever a run() reports as committed is already in the WAL (read back by a fresh handle)."""
    import wal
    spec = _spec(tmp_path, tiny_ckpt, "w")
    w = RolloutWorker(spec)
    w.submit(_requests(2))
    seen = {}
    for _ in range(3):
        for t, (s, toks) in w.run(2).committed.items():
            seen.setdefault(t, [])
            assert len(seen[t]) <= s
            seen[t] = seen[t][:s] + toks
    w.close()
    log = wal.open(spec.wal_path)
    for t, toks in seen.items():
        assert log.tokens(t)[-len(toks):] == toks
    log.close()


def test_weight_update_mid_trajectory_records_versions(tmp_path, tiny_ckpt, tiny_policy):
    w = RolloutWorker(_spec(tmp_path, tiny_ckpt, "w"))
    w.submit(_requests(2))
    for _ in range(3):
        w.run(1)
    w.update_weights({k: v.clone() for k, v in tiny_policy[0].state_dict().items()}, 7)
    out = _drain(w)
    for f in out.values():
        v = f.policy_versions
        assert v == sorted(v) and v[0] == 0 and v[-1] == 7  # tokens before the update say 0, after it 7


@pytest.mark.parametrize("group", [1, 3])
def test_async_committer_exposes_only_durable_steps(tmp_path, group):
    import wal
    from rollout.commit import AsyncCommitter
    from rollout.engine import Draw

    log = wal.open(tmp_path / "w")
    c = AsyncCommitter(log, max_lag=2, group_steps=group)
    for step in range(20):
        c.submit([Draw("t", step, step + 3, -0.5), Draw("u", step, 7, -0.25)], 0, step, flush=step == 10)
        for done in c.ready():
            assert len(log.tokens("t")) >= done + 1  # a step comes back only once its tokens are durable
            assert len(log.tokens("u")) >= done + 1
        assert len(c) <= 2
    c.ready(wait_all=True)
    assert len(c) == 0
    assert log.tokens("t") == [s + 3 for s in range(20)] and log.logprobs("u") == [-0.25] * 20
    c.close()
    log.close()


def test_finalized_trajectory_is_reported_not_redone(tmp_path, tiny_ckpt):
    spec = _spec(tmp_path, tiny_ckpt, "w")
    w = RolloutWorker(spec)
    w.submit(_requests(1))
    out = _drain(w)  # finishes and finalizes
    w.close()
    w2 = RolloutWorker(spec)
    w2.submit(_requests(1))
    rep = w2.run(4)
    assert rep.already_final == list(out) and not rep.finished and rep.idle
    w2.close()


def test_resume_through_the_wal_service(tmp_path, tiny_ckpt, reference):
    """The cluster path: workers log to `postrain wal serve` over gRPC instead of an in-process WAL."""
    from wal.config import ServeConfig
    from wal.server import Server

    srv = Server(tmp_path / "served", ServeConfig(port=0), token="t0k")
    try:
        spec = _spec(tmp_path, tiny_ckpt, "w")
        spec.wal_addr, spec.wal_token = srv.address, "t0k"
        w = RolloutWorker(spec)
        w.submit(_requests(3))
        for _ in range(6):
            w.run(1)
        w.preempt()
        w2 = RolloutWorker(spec)
        w2.submit(_requests(3))
        out = _drain(w2)
        w2.close()
        _check(out, reference)
        assert w2.counters["kv_restore"] >= 1
        assert srv.wal.trajectories() == []  # all finalized on the service
    finally:
        srv.stop()


def test_a_worker_over_the_wal_service_reads_and_finalizes_a_batch_per_call(tmp_path, tiny_ckpt, reference, monkeypatch):
    """Admission and finishing read every trajectory of the call with one ReadMany, and the pool's
    acknowledgements finalize with one FinalizeMany: the round trips to the service do not grow with the
    number of trajectories (one Read per trajectory and per field cost the cluster rollout half its speed)."""
    from wal.config import ServeConfig
    from wal.server import Server

    srv = Server(tmp_path / "served", ServeConfig(port=0), token="t0k")
    try:
        spec = _spec(tmp_path, tiny_ckpt, "w", batch=8)
        spec.wal_addr, spec.wal_token = srv.address, "t0k"
        w = RolloutWorker(spec)
        calls: dict = {}
        real = w.wal._call
        monkeypatch.setattr(w.wal, "_call", lambda name, req: calls.update({name: calls.get(name, 0) + 1}) or real(name, req))
        w.submit(_requests(8))
        runs, out = 0, {}
        while True:
            rep = w.run(8)
            runs += 1
            out.update({f.traj_id: f for f in rep.finished})
            w.finalize([f.traj_id for f in rep.finished])
            if rep.idle and not rep.finished:
                break
        w.close()
        assert len(out) == 8 and srv.wal.trajectories() == []
        assert set(calls) <= {"ReadMany", "FinalizeMany"}, calls
        assert calls["ReadMany"] <= 2 * runs and calls["FinalizeMany"] <= runs
        for t, f in reference.items():  # the same trajectories as the in-process reference
            assert out[t].tokens == f.tokens and out[t].logprobs == f.logprobs
    finally:
        srv.stop()


def test_cuda_graphs_setting_needs_the_fast_path_and_is_a_no_op_on_a_cpu(tmp_path, tiny_ckpt):
    with pytest.raises(ValueError, match="engine.cuda_graphs needs engine.strict = false"):
        EngineConfig(cuda_graphs=True, strict=True)
    outs = []
    for name, graphs in (("plain", False), ("graphs", True)):
        spec = WorkerSpec(name=name, checkpoint=str(tiny_ckpt), wal_path=str(tmp_path / name / "wal"),
                          snapshot_uri=str(tmp_path / name / "kv"), seed=11,
                          engine=EngineConfig(max_batch=4, strict=False, cuda_graphs=graphs, device="cpu"))
        w = RolloutWorker(spec)
        assert w.engine.static is None  # CUDA graphs are CUDA-only: the CPU keeps its eager (lean) decode
        w.submit(_requests(3))
        outs.append({t: f.tokens for t, f in _drain(w).items()})
        w.close()
    assert outs[0] == outs[1] and len(outs[0]) == 3


def test_chunked_decode_worker_commits_what_the_one_step_worker_commits(tmp_path, tiny_ckpt):
    """`engine.decode_chunk` > 1: the worker's WAL, stream and finished trajectories equal the one-step
    fast path's (requests stop at EOS inside chunks; a preemption mid-run resumes from the snapshots)."""
    with pytest.raises(ValueError, match="engine.decode_chunk > 1 needs engine.strict = false"):
        EngineConfig(decode_chunk=4, strict=True)
    outs = []
    for name, chunk in (("one", 1), ("chunk", 6)):
        spec = WorkerSpec(name=name, checkpoint=str(tiny_ckpt), wal_path=str(tmp_path / name / "wal"),
                          snapshot_uri=str(tmp_path / name / "kv"), seed=11,
                          engine=EngineConfig(max_batch=4, strict=False, decode_chunk=chunk))
        w = RolloutWorker(spec)
        assert (w.engine.chunk is not None) == (chunk > 1)
        w.submit(_requests(5))
        spans = [span for _ in range(2) for span in w.run(8).committed.items()]
        assert spans
        assert w.preempt() > 0
        w2 = RolloutWorker(spec)
        w2.submit(_requests(5))
        out = _drain(w2)
        w2.close()
        for t, (start, toks) in spans:  # what was streamed before the preemption is what the trajectory holds
            assert out[t].tokens[start:start + len(toks)] == toks
        outs.append((out, w2.counters["kv_restore"]))
    (one, _), (chunked, restored) = outs
    assert len(one) == 5 and restored >= 1 and any(f.stop_reason == "eos" for f in one.values())
    assert {t: (f.tokens, f.stop_reason) for t, f in chunked.items()} == {t: (f.tokens, f.stop_reason) for t, f in one.items()}
    for t, f in one.items():  # the same arithmetic over all slots instead of the running ones: rounding apart
        assert chunked[t].logprobs == pytest.approx(f.logprobs, abs=1e-6)
