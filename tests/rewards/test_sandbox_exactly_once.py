"""The non-idempotent counter runs exactly once per call across client retries, SIGKILL and restart.

The service runs as a real child process (`postrain sandbox serve`) and is killed with SIGKILL.
"""
from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from rewards.sandbox.client import InvocationAborted, SandboxClient
from rewards.sandbox.isolation import probe
from rewards.sandbox.launch import ServerProcess

TOKEN = "exactly-once-token"
pytestmark = pytest.mark.skipif(probe() is not None, reason=f"sandbox isolation unavailable: {probe()}")


def _counter(log_dir) -> int:
    path = log_dir / "counters" / "c"
    return int(path.read_text()) if path.exists() else 0


def _descendants(root: int) -> dict[int, int]:
    """pid -> real uid of every live descendant of `root` (other services on the machine share the slot uids)."""
    parent, uid = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(ln.split(":\t", 1) for ln in open(f"/proc/{entry.name}/status").read().splitlines() if ":\t" in ln)
        except OSError:
            continue
        parent[int(entry.name)], uid[int(entry.name)] = int(fields["PPid"]), int(fields["Uid"].split()[0])
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        for child, pp in parent.items():
            if pp == p and child not in out:
                out[child] = uid[child]
                todo.append(child)
    return out


def _busy(pids) -> bool:
    """One of `pids` has used at least 0.2 s of CPU (the looping tool, not a waiting sandbox)."""
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[11]) + int(fields[12]) >= 0.2 * os.sysconf("SC_CLK_TCK"):  # utime + stime
            return True
    return False


def _wait_in_flight(client: SandboxClient, sandbox_id: str, seq: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries, _ = client.entries(sandbox_id)
        if any(e.seq == seq and e.in_flight for e in entries):
            return
        time.sleep(0.02)
    raise AssertionError(f"seq {seq} never became in flight")


def test_counter_exactly_once_across_retries_sigkill_and_restart(tmp_path):
    log_dir = tmp_path / "svc"
    srv = ServerProcess(log_dir, TOKEN)
    port = srv.port
    client = SandboxClient(srv.target, TOKEN, timeout_s=10, retries=40, backoff_s=0.05)
    try:
        # 1. three calls complete
        done = [client.execute("traj", seq, "counter", "c") for seq in range(3)]
        assert [r.result.output for r in done] == ["1", "2", "3"] and _counter(log_dir) == 3

        # 2. SIGKILL after they completed; after restart every retry is a byte-identical replay
        srv.kill()
        srv = ServerProcess(log_dir, TOKEN, port=port)
        for seq, first in enumerate(done):
            again = client.execute("traj", seq, "counter", "c")
            assert again.replayed and again.raw == first.raw
        assert _counter(log_dir) == 3

        # 3. SIGKILL mid-call (invocation durable, tool holding before its increment): the client's
        #    retries reach the restarted service, which reports the call as aborted and never re-runs it
        outcome = {}

        def caller():
            try:
                outcome["result"] = client.execute("traj", 3, "counter", "c 5000")
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = exc

        t = threading.Thread(target=caller)
        t.start()
        _wait_in_flight(client, "traj", 3)
        srv.kill()
        srv = ServerProcess(log_dir, TOKEN, port=port)
        t.join(60)
        assert isinstance(outcome.get("error"), InvocationAborted), outcome
        assert outcome["error"].code == grpc.StatusCode.ABORTED
        assert "invoked but no result recorded" in outcome["error"].details
        assert _counter(log_dir) == 3  # killed during the hold: never incremented, and not run again
        with pytest.raises(InvocationAborted):
            client.execute("traj", 3, "counter", "c 5000")
        assert _counter(log_dir) == 3

        # 4. the service is down when the call is made: the client retries until it is back, once
        srv.kill()
        restarted = {}
        restarter = threading.Timer(0.8, lambda: restarted.setdefault("srv", ServerProcess(log_dir, TOKEN, port=port)))
        restarter.start()
        res = client.execute("traj", 4, "counter", "c")
        restarter.join()
        srv = restarted["srv"]
        assert res.result.output == "4" and not res.replayed
        assert client.execute("traj", 4, "counter", "c").raw == res.raw
        assert _counter(log_dir) == 4

        # the log tells the whole story: four results, one invocation without result
        entries, nxt = client.entries("traj")
        assert nxt == 5
        assert [e.result.result.output if e.result else None for e in entries] == ["1", "2", "3", None, "4"]
    finally:
        client.close()
        srv.kill()


def test_sigkill_takes_running_sandboxes_down(tmp_path):
    """A killed service leaves no sandboxed process behind (bwrap --die-with-parent + pid namespace)."""
    from rewards.sandbox.isolation import UID_BASE

    if os.geteuid() != 0:
        pytest.skip("per-slot uids (and this census of them) exist only when the service runs as root")
    srv = ServerProcess(tmp_path / "svc", TOKEN, extra=["--max-concurrent", "2"])
    client = SandboxClient(srv.target, TOKEN, timeout_s=10, retries=0)

    def call():
        try:
            client.execute("loop", 0, "python", "while True: pass")
        except Exception:  # noqa: BLE001 - UNAVAILABLE when the service dies
            pass

    t = threading.Thread(target=call)
    try:
        t.start()
        _wait_in_flight(client, "loop", 0)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            mine = _descendants(srv.proc.pid)
            slot_tasks = [p for p, uid in mine.items() if UID_BASE <= uid < UID_BASE + 2]
            if _busy(slot_tasks):
                break
            time.sleep(0.05)
        assert _busy(slot_tasks), "the loop should be running under a slot uid"
        srv.kill()
        t.join(30)
        deadline = time.monotonic() + 5
        alive = list(mine)
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in mine if os.path.exists(f"/proc/{p}")]
        assert not alive, f"left behind by the killed service: {alive}"
    finally:
        client.close()
        srv.kill()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_counter_at_most_once_under_random_sigkill(tmp_path, seed):
    """Seeded kill -9 at random moments while a client keeps calling. Every increment of the counter must
    be explained by exactly one logged call: the values in recorded results strictly increase, and each
    jump between consecutive recorded values is covered by aborted (invoked, no result) calls in between."""
    import random

    rng = random.Random(seed)
    log_dir = tmp_path / "svc"
    srv = ServerProcess(log_dir, TOKEN)
    port = srv.port
    client = SandboxClient(srv.target, TOKEN, timeout_s=10, retries=60, backoff_s=0.05)
    stop = threading.Event()
    seq = [0]

    def caller():
        while not stop.is_set():
            try:
                client.execute("rand", seq[0], "counter", f"c {rng.randrange(0, 120)}")
            except InvocationAborted:
                pass  # the caller's decision: move on
            except Exception:  # noqa: BLE001 - e.g. retries exhausted while the service restarts
                continue
            seq[0] += 1

    t = threading.Thread(target=caller)
    t.start()
    try:
        for _ in range(8):
            time.sleep(rng.uniform(0.1, 0.8))
            srv.kill()
            srv = ServerProcess(log_dir, TOKEN, port=port)
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(60)
    try:
        entries, _ = client.entries("rand")
    finally:
        client.close()
        srv.kill()
    outputs = [int(e.result.result.output) if e.result else None for e in entries]
    assert _unexplained_increments(outputs, _counter(log_dir)) is None
    assert sum(v is not None for v in outputs) >= 5, "too few calls completed for the test to mean anything"


def _unexplained_increments(outputs: list[int | None], counter: int) -> str | None:
    """None if every increment of the counter is explained by one logged call, else what is not.

    `outputs`: per seq, the counter value the call returned, or None for a call aborted by a crash
    (it may or may not have incremented before dying)."""
    last, aborted = 0, 0
    for seq, v in enumerate(outputs):
        if v is None:
            aborted += 1
            continue
        if not (v > last and v - last - 1 <= aborted):
            return f"seq {seq} returned {v} after {last} with {aborted} aborted call(s) in between"
        last, aborted = v, 0
    if counter - last > aborted:
        return f"counter at {counter}, last recorded {last}, only {aborted} aborted call(s) after it"
    return None


def test_the_checker_catches_a_hidden_rerun():
    """Canary: the checker of the random-kill test must flag a re-executed call."""
    assert _unexplained_increments([1, 2, None, 4, 5], 5) is None      # the aborted call had incremented
    assert _unexplained_increments([1, 2, None, 3], 3) is None         # it had not
    assert _unexplained_increments([1, 3, 4], 4) is not None           # something ran 2 without a log entry
    assert _unexplained_increments([1, 2, 3], 4) is not None           # a replay re-ran the tool
    assert _unexplained_increments([1, None, 2], 4) is not None        # two increments, one aborted call
