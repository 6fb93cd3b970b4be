"""The agent loop's tool turns on a real engine, token WAL and sandbox service: the calls that one decode step
paused on go to the service together and their results enter the WAL with one commit; each tool runs once."""
import pytest

import wal
from rewards.sandbox.isolation import probe
from rollout import agent
from rollout.engine import Engine
from rollout.sampling import SamplingParams
from rollout.types import ENV_LOGPROB

TOKEN = "agent-token-0123456789"
PARAMS = SamplingParams(max_new_tokens=40, stop=("</call>",))
CALLS = [(37, 41), (123, 456), (7, 8), (99, 99), (12, 34), (500, 2)]


class CountingWAL:
    """The real token WAL, its commits counted."""

    def __init__(self, log):
        self.log, self.commits = log, 0

    def commit(self):
        self.commits += 1
        return self.log.commit()

    def __getattr__(self, name):
        return getattr(self.log, name)


@pytest.fixture
def service(tmp_path):
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import SandboxServer

    if probe() is not None:
        pytest.skip(f"sandbox isolation unavailable: {probe()}")
    srv = SandboxServer(SandboxConfig(log_dir=tmp_path / "svc", max_concurrent=4), token=TOKEN)
    yield srv
    srv.stop()


def _paused(tiny_policy, log):
    """An engine holding one trajectory per call, each paused on its committed `</call>` (as a resume finds it)."""
    model, tok = tiny_policy
    eng = Engine(model, tok, max_batch=len(CALLS), strict=True)
    plens = {}
    for a, b in CALLS:
        traj = f"calc-{a}x{b}"
        p, c = tok.encode(f"mul {a}*{b}="), tok.encode(f"<call>calc: {a}*{b}</call>")
        log.append(traj, 0, p, [ENV_LOGPROB] * len(p), 0)
        log.append(traj, len(p), c, [-1.0] * len(c), 0)
        eng.add(traj, p + c, [False] * len(p) + [True] * len(c), PARAMS)
        assert eng.seqs[traj].state == "paused"
        plens[traj] = len(p)
    log.commit()
    return eng, plens


@pytest.mark.parametrize("fan_out", [1, 8])
def test_the_calls_of_one_step_share_one_wal_commit_and_each_tool_runs_once(tmp_path, tiny_policy, service, fan_out):
    log = CountingWAL(wal.open(tmp_path / "wal"))
    eng, plens = _paused(tiny_policy, log)
    gateway = agent.ToolGateway(service.target, TOKEN, fan_out=fan_out)
    log.commits = 0
    try:
        out = agent.answer_turns(eng, log, gateway, list(plens.items()), max_calls=4)
    finally:
        gateway.close()
    assert log.commits == 1  # every result durable with one commit, before any of them decodes on
    tok = tiny_policy[1]
    for a, b in CALLS:
        traj = f"calc-{a}x{b}"
        assert out[traj].continued and out[traj].executed and not out[traj].recorded, out[traj]
        seq = eng.seqs[traj]
        assert seq.state == "run"
        assert tok.decode(seq.tokens[plens[traj]:]).endswith(f"</call><result>{a * b}</result>")
        assert log.tokens(traj) == seq.tokens  # the engine decodes on from what the WAL holds
    log.close()

    # a worker that replays the same trajectories (after a crash) gets the recorded results: no tool runs twice
    log2 = CountingWAL(wal.open(tmp_path / "wal2"))
    eng2, plens2 = _paused(tiny_policy, log2)
    gateway = agent.ToolGateway(service.target, TOKEN, fan_out=fan_out)
    try:
        again = agent.answer_turns(eng2, log2, gateway, list(plens2.items()), max_calls=4)
    finally:
        gateway.close()
        log2.close()
    assert all(o.continued and o.recorded and not o.executed for o in again.values()), again
    assert {t: eng2.seqs[t].tokens for t in plens2} == {t: eng.seqs[t].tokens for t in plens}


def test_a_step_with_a_call_over_budget_and_one_without_a_call_ends_those_and_answers_the_rest(
        tmp_path, tiny_policy, service):
    log = CountingWAL(wal.open(tmp_path / "wal"))
    eng, plens = _paused(tiny_policy, log)
    items = list(plens.items())
    gateway = agent.ToolGateway(service.target, TOKEN)
    try:
        spent = agent.answer_turns(eng, log, gateway, items[:2], max_calls=1)  # call number 0 < 1: answered
        over = agent.answer_turns(eng, log, gateway, items[2:3], max_calls=0)  # no call allowed
        none = agent.answer_turns(eng, log, None, items[3:4], max_calls=4)  # no sandbox: the stop ends it
    finally:
        gateway.close()
        log.close()
    assert all(o.continued for o in spent.values())
    assert [(o.continued, o.reason) for o in over.values()] == [(False, "tool call budget (0) spent")]
    assert [(o.continued, o.reason) for o in none.values()] == [(False, "stop string")]


def test_a_service_fault_is_never_committed_as_a_tool_result(tmp_path, tiny_policy, service):
    """A wrong token (or a service down past the retries) is the service's fault, not the model's: nothing
    enters the trajectory and the call number stays free, so the same calls are answered once it answers
    (they used to be committed as 'error: refused (UNAUTHENTICATED)', and every later call hit a gap)."""
    log = CountingWAL(wal.open(tmp_path / "wal"))
    eng, plens = _paused(tiny_policy, log)
    before = {t: list(log.tokens(t)) for t in plens}
    wrong = agent.ToolGateway(service.target, "not-the-service-token", fan_out=1)
    try:
        with pytest.raises(agent.ToolServiceError, match="UNAUTHENTICATED"):
            agent.answer_turns(eng, log, wrong, list(plens.items()), max_calls=4)
    finally:
        wrong.close()
    assert {t: log.tokens(t) for t in plens} == before and all(eng.seqs[t].state == "paused" for t in plens)
    right = agent.ToolGateway(service.target, TOKEN, fan_out=1)
    try:
        out = agent.answer_turns(eng, log, right, list(plens.items()), max_calls=4)
    finally:
        right.close()
    tok = tiny_policy[1]
    for a, b in CALLS:
        traj = f"calc-{a}x{b}"
        assert out[traj].continued and out[traj].executed
        assert tok.decode(eng.seqs[traj].tokens[plens[traj]:]).endswith(f"</call><result>{a * b}</result>")
    log.close()


def test_a_worker_keeps_a_call_the_service_did_not_answer_and_asks_again(tmp_path, tiny_policy, tiny_ckpt, service):
    """A trajectory resumed paused on its committed call, its worker holding a wrong sandbox token: the run
    commits nothing for the call and counts it; once the service answers, the next run gets the result."""
    from rollout.config import EngineConfig
    from rollout.types import Request
    from rollout.worker import RolloutWorker, WorkerSpec

    tok = tiny_policy[1]
    prompt = "mul 12*34="
    p, c = tok.encode(prompt), tok.encode("<call>calc: 12*34</call>")
    log = wal.open(tmp_path / "wal")
    log.append("calc-1", 0, p, [ENV_LOGPROB] * len(p), 0)
    log.append("calc-1", len(p), c, [-1.0] * len(c), 0)
    log.commit()
    log.close()
    spec = WorkerSpec(name="w", checkpoint=str(tiny_ckpt), wal_path=str(tmp_path / "wal"),
                      snapshot_uri=str(tmp_path / "kv"), seed=1, engine=EngineConfig(max_batch=2, strict=True),
                      sandbox_target=service.target, sandbox_token="not-the-service-token")
    w = RolloutWorker(spec)
    try:
        w.submit([Request("calc-1", "calc", prompt, SamplingParams(max_new_tokens=40, stop=("</call>",)))])
        rep = w.run(2)
        assert w.counters["tool_service_unanswered"] == 1 and not rep.idle and w.counters["tool_executed"] == 0
        assert w.wal.tokens("calc-1") == p + c and w.engine.seqs["calc-1"].state == "paused"
        w.tools.close()
        w.tools = agent.ToolGateway(service.target, TOKEN)
        w.run(2)
        assert w.counters["tool_executed"] == 1
        assert tok.decode(w.wal.tokens("calc-1")[len(p):]).startswith("<call>calc: 12*34</call><result>408</result>")
    finally:
        w.close()


def test_sandbox_ids_are_safe_and_distinct_and_keep_the_names_of_safe_ids():
    from rewards.sandbox.types import valid_sandbox_id

    long = "grpo-calc-run-" + "a" * 120
    ids = [long + "-p1", long + "-p2", "a/b", "a-b", "a b", "añb", "x" * 127, "x" * 128, "calc-37x41"]
    sandboxes = [agent.sandbox_id_of(t) for t in ids]
    assert len(set(sandboxes)) == len(ids) and all(valid_sandbox_id(s) for s in sandboxes)
    assert agent.sandbox_id_of("calc-37x41") == "tcalc-37x41" and agent.sandbox_id_of("x" * 127) == "t" + "x" * 127


def test_trajectories_whose_ids_differ_past_the_sandbox_id_limit_get_their_own_tool_results(
        tmp_path, tiny_policy, service):
    """Two trajectories whose ids share their first 128 characters, each paused on its own call: each gets its
    own result (one sandbox each), not the other's recorded one or a refusal."""
    model, tok = tiny_policy
    log = wal.open(tmp_path / "wal")
    eng = Engine(model, tok, max_batch=2, strict=True)
    base = "grpo-calc-run-" + "a" * 120
    plens = {}
    for traj, (a, b) in [(base + "-p1", (37, 41)), (base + "-p2", (12, 34))]:
        p, c = tok.encode(f"mul {a}*{b}="), tok.encode(f"<call>calc: {a}*{b}</call>")
        log.append(traj, 0, p, [ENV_LOGPROB] * len(p), 0)
        log.append(traj, len(p), c, [-1.0] * len(c), 0)
        eng.add(traj, p + c, [False] * len(p) + [True] * len(c), PARAMS)
        plens[traj] = len(p)
    log.commit()
    gateway = agent.ToolGateway(service.target, TOKEN, fan_out=1)
    try:
        out = {t: agent.answer_turns(eng, log, gateway, [(t, n)], max_calls=4)[t] for t, n in plens.items()}
    finally:
        gateway.close()
        log.close()
    assert all(o.continued and o.executed for o in out.values()), out
    results = {t: tok.decode(eng.seqs[t].tokens[n:]).rsplit("<result>", 1)[-1] for t, n in plens.items()}
    assert results == {base + "-p1": "1517</result>", base + "-p2": "408</result>"}
