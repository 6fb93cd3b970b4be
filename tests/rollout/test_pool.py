"""The pool on real Ray actors, its hooks driven by the chaos layer: SIGKILL, ray.kill and preemption
(with corrupted or deleted snapshots) lose no committed token, sample none twice, and every trajectory
completes exactly as without faults; a preemption keeps its worker. A non-idempotent tool runs once per call although its caller is killed mid-call."""
import os
import signal
import threading
import time


import wal
from chaos.pool_faults import PoolInjector
from chaos.schedule import Fault
from rollout.config import EngineConfig, PoolConfig
from rollout.pool import RolloutPool
from rollout.sampling import SamplingParams
from rollout.types import ENV_LOGPROB, Request
from rollout.worker import RolloutWorker, WorkerSpec
from wal.verify import dump

PARAMS = SamplingParams(max_new_tokens=30)
ENGINE = EngineConfig(max_batch=2, strict=True)


def _requests(n):
    return [Request(f"arith-{i}", "arith", f"add {i * 13}+{i * 7}=", PARAMS) for i in range(n)]


def _reference(tmp, ckpt, reqs):
    w = RolloutWorker(WorkerSpec("ref", str(ckpt), str(tmp / "ref" / "wal"), str(tmp / "ref" / "kv"), seed=0,
                                 engine=EngineConfig(max_batch=8, strict=True)))
    w.submit(reqs)
    out = {}
    while True:
        rep = w.run(16)
        out.update({f.traj_id: f for f in rep.finished})
        if rep.idle:
            w.close()
            return out


def _positions_contiguous(run_dir, workers, traj):
    recs = [r for k in range(workers) for r in dump(run_dir / "wal" / str(k), traj) if r["type"] == "tokens"]
    recs.sort(key=lambda r: r["lsn"])
    end = 0
    for r in recs:
        assert r["start"] == end, f"{traj}: record at {r['start']} after position {end}"
        end += len(r["tokens"])
    return end


def test_faults_lose_nothing_and_resample_nothing(tmp_path, tiny_ckpt):
    reqs = _requests(6)
    ref = _reference(tmp_path, tiny_ckpt, reqs)
    run_dir = tmp_path / "run"
    pool = RolloutPool(tiny_ckpt, run_dir, PoolConfig(workers=2, steps_per_call=3), ENGINE, use_tools=False)
    from core.hf import load_policy
    pool.update_weights(load_policy(tiny_ckpt)[0].state_dict(), 2)  # same weights, new version: replacements too
    chaos = PoolInjector([Fault("sigkill", 0, 1), Fault("preempt", 1, 0), Fault("actor_kill", 0, 1),
                          Fault("snapshot_corrupt", 1, 0), Fault("snapshot_delete", 0, 1)], seed=1)
    try:
        res = pool.run(reqs, chaos)
        chaos.finish(pool)
    finally:
        pool.close()
    assert set(res.finished) == set(ref)
    for t, f in ref.items():
        assert res.finished[t].tokens == f.tokens, t
        assert _positions_contiguous(run_dir, 2, t) == len(f.tokens)
    assert res.tokens_lost == 0 and res.tokens_resampled == 0
    assert all(set(f.policy_versions) == {2} for f in res.finished.values())  # every token records its policy
    summary = chaos.summary()
    assert summary["injected"] == summary["survived"] == {k: 1 for k in ("sigkill", "preempt", "actor_kill",
                                                                          "snapshot_corrupt", "snapshot_delete")}
    assert res.replacements == 2  # the kills; the preemptions resumed on their own workers
    assert res.counters["suspended"] >= 3 and res.counters["kv_restore"] >= 1
    assert res.counters["snapshot_corrupt"] >= 1 and res.counters["snapshot_missing"] >= 1


def _seed_wal_with_a_call(run_dir, tok, prompt, call, traj="calc-x"):
    """A trajectory whose committed tokens end with a complete tool call (as if sampled)."""
    log = wal.open(run_dir / "wal" / "0")
    p, c = tok.encode(prompt), tok.encode(call)
    log.append(traj, 0, p, [ENV_LOGPROB] * len(p), 0)
    log.append(traj, len(p), c, [-1.0] * len(c), 0)
    log.commit()
    log.close()


def test_tool_runs_exactly_once_across_a_kill_mid_call(tmp_path, tiny_ckpt, tiny_policy):
    run_dir = tmp_path / "run"
    prompt = "mul 123*456="
    _seed_wal_with_a_call(run_dir, tiny_policy[1], prompt, "<call>counter: hits 1600</call>")
    _seed_wal_with_a_call(run_dir, tiny_policy[1], "mul 37*41=", "<call>calc: 37*41</call>", traj="calc-y")
    pool = RolloutPool(tiny_ckpt, run_dir, PoolConfig(workers=1, steps_per_call=4), ENGINE, use_tools=True)
    killed = []

    # The worker is blocked in the tool call (it holds 1.6 s): kill it there. The call finishes and is
    # recorded before the replacement (a new process, >= 1 s to start) asks again; a replacement that
    # asked while it still ran would join that run instead (also exactly once, not counted as recorded).
    def killer():
        time.sleep(1.2)
        os.kill(pool.slots[0].pid, signal.SIGKILL)
        killed.append(pool.slots[0].pid)

    try:
        threading.Thread(target=killer, daemon=True).start()
        params = SamplingParams(max_new_tokens=40, stop=("</call>",))
        res = pool.run([Request("calc-x", "calc", prompt, params), Request("calc-y", "calc", "mul 37*41=", params)])
        counter = pool.sandbox.service._toolbox.read_counter("hits") if hasattr(pool.sandbox.service, "_toolbox") \
            else int((run_dir / "sandbox" / "counters" / "hits").read_text())
    finally:
        pool.close()
    assert killed and res.replacements >= 1
    assert counter == 1, f"the counter tool ran {counter} times"
    text = res.finished["calc-x"].completion
    assert "<call>counter: hits 1600</call><result>1</result>" in text
    assert res.counters["tool_recorded"] >= 1  # the replacement reused the recorded result
    y = res.finished["calc-y"]
    assert "<call>calc: 37*41</call><result>1517</result>" in y.completion  # the calculator ran in the sandbox
    n_result = len(tiny_policy[1].encode("<result>1517</result>"))
    start = len(tiny_policy[1].encode("mul 37*41=<call>calc: 37*41</call>"))
    assert y.loss_mask[start:start + n_result] == [False] * n_result  # result tokens are loss-masked
    assert y.loss_mask[start - 1] and not any(y.loss_mask[:len(tiny_policy[1].encode("mul 37*41="))])


def test_a_worker_starting_after_a_kill_holds_up_no_other_worker(tmp_path, tiny_ckpt):
    """No spare: the killed worker's replacement is a cold actor (seconds to start). The pool keeps calling the
    other worker meanwhile: its trajectories show new committed tokens in rounds where the replacement starts."""
    reqs = [Request(f"arith-{i}", "arith", f"add {i * 13}+{i * 7}=", SamplingParams(max_new_tokens=60))
            for i in range(8)]
    pool = RolloutPool(tiny_ckpt, tmp_path / "run", PoolConfig(workers=2, steps_per_call=2), ENGINE, use_tools=False)
    other = [r.traj_id for i, r in enumerate(reqs) if i % 2 == 1]  # worker 1's
    during: list[int] = []  # worker 1's committed positions in each round while worker 0's replacement starts
    state = {"rounds": 0}

    def observer(p):
        state["rounds"] += 1
        if state["rounds"] == 3:
            p.kill(0)
        if p.starting(0):
            during.append(sum(p.seen(t) for t in other))

    try:
        res = pool.run(reqs, observer)
    finally:
        pool.close()
    assert res.replacements == 1 and len(res.finished) == len(reqs)
    assert res.tokens_lost == 0 and res.tokens_resampled == 0
    assert len(during) >= 2 and during[-1] > during[0], during


def test_a_worker_that_dies_starting_is_a_bounded_replacement(tmp_path):
    """The first actors die in their constructor (the checkpoint cannot load): each death is a replacement,
    and the pool stops at its bound with the cause, before it has run anything."""
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    try:
        RolloutPool(bad, tmp_path / "run", PoolConfig(workers=1, max_replacements=1, call_timeout_s=120),
                    ENGINE, use_tools=False)
    except RuntimeError as exc:
        assert "replacements reached the bound" in str(exc) and "worker 0" in str(exc), exc
    else:
        raise AssertionError("a pool whose workers cannot start must fail")


def test_an_observer_caps_the_steps_per_call_and_the_requests_in_flight(tmp_path, tiny_ckpt):
    """Fault injection needs rounds of a few steps: an observer's `steps_per_call` and `max_in_flight` cap the
    pool's own, so a short batch that one long, wide call would finish still has requests in flight to hit;
    the tokens are those of the reference decode."""
    reqs = _requests(6)

    class Rounds:
        def __init__(self, steps_per_call=None, max_in_flight=None):
            self.steps_per_call, self.max_in_flight, self.rounds = steps_per_call, max_in_flight, 0

        def __call__(self, pool):
            self.rounds += 1

    engine = EngineConfig(max_batch=8, strict=True)
    pool = RolloutPool(tiny_ckpt, tmp_path / "run", PoolConfig(workers=1, steps_per_call=64), engine, use_tools=False)
    try:
        wide, short, narrow = Rounds(), Rounds(steps_per_call=2), Rounds(steps_per_call=2, max_in_flight=1)
        runs = [pool.run(reqs[:2], wide), pool.run(reqs[2:4], short), pool.run(reqs[4:], narrow)]
    finally:
        pool.close()
    ref = _reference(tmp_path, tiny_ckpt, reqs)
    assert {t: f.tokens for r in runs for t, f in r.finished.items()} == {t: f.tokens for t, f in ref.items()}
    new = {r.traj_id: len(ref[r.traj_id].tokens) - len(r.prompt) for r in reqs}  # tokens drawn (char tokenizer)
    assert wide.rounds <= 2, wide.rounds
    assert short.rounds >= max(new[r.traj_id] for r in reqs[2:4]) // 2 > 2, short.rounds
    assert narrow.rounds >= sum(new[r.traj_id] for r in reqs[4:]) // 2 > short.rounds // 2 + 1, narrow.rounds
