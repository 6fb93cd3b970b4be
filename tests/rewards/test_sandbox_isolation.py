"""Hostile tool input is contained, reported with its reason, and a concurrent benign call still succeeds.

Real bubblewrap, real gRPC server, real environment log; skipped only where bwrap is absent.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from rewards.sandbox import types as T
from rewards.sandbox.isolation import UID_BASE, _tasks_of_uid, probe

REASON = probe()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"sandbox isolation unavailable: {REASON}")

MAX_CONCURRENT = 4
# This module's service runs on slots no other test's service takes: services on one host with overlapping
# slots share execution uids, so one's sweep after a kill takes the other's execution down and one's
# waiting sandboxes count as the other's leftovers (the suite runs files side by side).
FIRST_SLOT = 160
PROCESSES = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import SandboxServer

    cfg = SandboxConfig(log_dir=tmp_path_factory.mktemp("sandbox"), max_concurrent=MAX_CONCURRENT, first_slot=FIRST_SLOT, wall_s=10.0,
                        cpu_s=1, address_space_mb=256, processes=PROCESSES, file_size_mb=4, tmp_mb=16,
                        output_bytes=32 << 10)
    srv = SandboxServer(cfg, token="isolation-test-token")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from rewards.sandbox.client import SandboxClient

    with SandboxClient(server.target, "isolation-test-token", timeout_s=30, retries=0) as c:
        yield c


_ids = iter(range(10**6))


def _sid(name: str) -> str:
    return f"{name}-{next(_ids)}-{os.getpid()}"


def _pool_leftovers() -> int:
    """Tasks under the execution uids beyond each slot's one pre-started, waiting sandbox."""
    return sum(max(len(_tasks_of_uid(UID_BASE + s)) - 1, 0) for s in range(FIRST_SLOT, FIRST_SLOT + MAX_CONCURRENT))


def run_with_benign(client, code: str, timeout_ms: int = 0, start_delay_s: float = 0.3):
    """Run hostile `code` and, while it runs, a benign calculator call; return (hostile, benign, peak tasks)."""
    out = {}
    peak = [0]
    done = threading.Event()

    def hostile():
        try:
            out["hostile"] = client.execute(_sid("hostile"), 0, "python", code, timeout_ms=timeout_ms)
        finally:
            done.set()

    def sample():  # peak count of tasks owned by the execution uids while the hostile call runs
        while not done.is_set():
            peak[0] = max(peak[0], max(len(_tasks_of_uid(UID_BASE + s)) for s in range(FIRST_SLOT, FIRST_SLOT + MAX_CONCURRENT)))
            time.sleep(0.02)

    threads = [threading.Thread(target=hostile), threading.Thread(target=sample)]
    for t in threads:
        t.start()
    time.sleep(start_delay_s)
    benign = client.execute(_sid("benign"), 0, "calc", "37*41")
    benign_done_during = not done.is_set()
    for t in threads:
        t.join(60)
    return out["hostile"], benign, peak[0], benign_done_during


def _assert_benign(benign):
    assert benign.result.ok, benign.result
    assert benign.result.output.strip() == "1517"


def test_benign_calls_work(client):
    code = ("import os\n"
            "status = dict(line.split(':\\t') for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
            "print(os.getuid() >= 61000 or os.getuid() == 65534, sorted(os.environ), status['CapEff'], status['NoNewPrivs'])\n")
    res = client.execute(_sid("ok"), 0, "python", code)
    assert res.result.ok, res.result
    # unprivileged uid, clean environment, no capability, no way to gain one
    assert res.result.output.strip() == "True ['HOME', 'LANG', 'PATH', 'PWD'] 0000000000000000 1"


def test_fork_bomb_is_contained(client):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    hostile, benign, peak, during = run_with_benign(client, code, timeout_ms=3000)
    assert not hostile.result.ok
    assert hostile.result.error_kind == T.PROCESS_LIMIT, hostile.result
    assert peak <= PROCESSES, f"{peak} tasks under one execution uid, limit {PROCESSES}"
    assert peak >= PROCESSES // 2, f"the fork bomb never got going (peak {peak}): the test proves nothing"
    _assert_benign(benign)
    assert during, "the benign call should finish while the fork bomb is still running"
    assert _pool_leftovers() == 0, "processes of the fork bomb survived its execution"


def test_memory_hog_is_contained(client):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    hostile, benign, _, _ = run_with_benign(client, code, start_delay_s=0.0)
    assert hostile.result.error_kind == T.MEMORY_LIMIT, hostile.result
    assert "MemoryError" in hostile.result.error
    _assert_benign(benign)


def test_infinite_loop_is_killed_at_the_wall_clock(client):
    hostile, benign, _, during = run_with_benign(client, "while True:\n    pass\n", timeout_ms=800)
    assert hostile.result.error_kind == T.TIMEOUT, hostile.result
    assert hostile.result.exit_code == -9
    assert 700 <= hostile.result.wall_ms < 3000
    _assert_benign(benign)
    assert _pool_leftovers() == 0


def test_cpu_limit(client):
    # 1 s of CPU within 9 s of wall clock: holds even when the loop gets only a ninth of a core
    hostile, benign, _, _ = run_with_benign(client, "while True:\n    pass\n", timeout_ms=9000)
    assert hostile.result.error_kind == T.CPU_LIMIT, hostile.result
    _assert_benign(benign)


def test_network_is_unreachable(client, server):
    # the service itself listens on 127.0.0.1: reachable from the host, not from inside a sandbox
    code = ("import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {server.port}), timeout=2)\n"
            "print('connected')\n")
    hostile, benign, _, _ = run_with_benign(client, code, start_delay_s=0.0)
    assert not hostile.result.ok and hostile.result.error_kind == T.TOOL_ERROR, hostile.result
    assert "connected" not in hostile.result.output
    assert "Errno" in hostile.result.error
    _assert_benign(benign)


def test_writes_outside_tmp_are_refused(client, server, tmp_path):
    outside = Path(__file__).resolve().parent / f"escape-{os.getpid()}.txt"
    counter_file = Path(server.cfg.log_dir) / "counters" / "victim"
    client.execute(_sid("counter"), 0, "counter", "victim")
    assert counter_file.read_text() == "1"
    code = ("import os, sys\n"
            "fails = 0\n"
            f"for path in [{str(outside)!r}, {str(counter_file)!r}, '/etc/escape']:\n"
            "    try:\n"
            "        open(path, 'w').write('999')\n"
            "    except OSError as exc:\n"
            "        fails += 1\n"
            "        print(type(exc).__name__, exc.strerror)\n"
            "open('/tmp/inside', 'w').write('ok')\n"
            "print('tmp', open('/tmp/inside').read())\n"
            "sys.exit(0 if fails == 3 else 1)\n")
    hostile, benign, _, _ = run_with_benign(client, code, start_delay_s=0.0)
    assert hostile.result.ok, hostile.result
    assert "Read-only file system" in hostile.result.output
    assert "tmp ok" in hostile.result.output  # its private /tmp is writable
    assert not outside.exists()
    assert counter_file.read_text() == "1"  # the service's state is out of reach
    _assert_benign(benign)


def test_huge_output_is_cut_and_killed(client):
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    hostile, benign, _, _ = run_with_benign(client, code, start_delay_s=0.0)
    assert hostile.result.error_kind == T.OUTPUT_LIMIT, hostile.result
    assert len(hostile.result.output) <= 32 << 10
    _assert_benign(benign)
    assert _pool_leftovers() == 0


@pytest.mark.parametrize("code, words", [
    ("open('/tmp/big', 'wb').write(b'x' * (8 << 20))\n", "File too large"),  # one file above RLIMIT_FSIZE (4 MiB)
    ("for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (3 << 20))\n", "No space left"),  # fills /tmp (16 MiB)
])
def test_file_size_and_tmp_limits(client, code, words):
    hostile, benign, _, _ = run_with_benign(client, code, start_delay_s=0.0)
    assert hostile.result.error_kind == T.FILE_SIZE_LIMIT, hostile.result
    assert words in hostile.result.error
    _assert_benign(benign)


def test_generic_command_runner_applies_limits():
    """Isolator.run (any program: prlimit + setpriv instead of the Python prelude) enforces the same bounds."""
    from rewards.sandbox.isolation import Isolator

    iso = Isolator()
    limits = T.Limits(wall_s=5, processes=7, file_size_bytes=1 << 20, address_space_bytes=300 << 20)
    out = iso.run(["/bin/sh", "-c", "id -u; grep -E '^Max (processes|file size|address space)' /proc/self/limits; "
                   "echo x > /etc/escape"], limits, slot=90)
    lines = out.stdout.decode().splitlines()
    assert lines[1].split()[3:5] == [str(1 << 20), str(1 << 20)], out  # Max file size: soft, hard
    assert lines[2].split()[2:4] == ["7", "7"], out                    # Max processes: soft, hard
    assert lines[3].split()[3:5] == [str(300 << 20)] * 2, out          # Max address space: the memory limit
    assert os.geteuid() != 0 or lines[0] == str(UID_BASE + 90)
    assert out.exit_code != 0 and b"Read-only file system" in out.stderr
    import sys

    hog = iso.run([os.path.realpath(sys.executable), "-I", "-S", "-c", "x = bytearray(400 << 20)"], limits, slot=90)
    assert hog.exit_code == 1 and b"MemoryError" in hog.stderr, hog  # any command, not only the python tool
    slow = iso.run(["/bin/sh", "-c", "sleep 30"], limits._replace(wall_s=0.5), slot=90)
    assert slow.timed_out and slow.wall_ms < 3000 and not _tasks_of_uid(UID_BASE + 90)


def test_closing_its_pipes_does_not_escape_the_wall_clock(client):
    code = "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass\n"
    hostile, benign, _, _ = run_with_benign(client, code, timeout_ms=800)
    assert hostile.result.error_kind == T.TIMEOUT and hostile.result.wall_ms < 3000, hostile.result
    _assert_benign(benign)
    assert _pool_leftovers() == 0


def test_every_call_gets_a_fresh_sandbox(client):
    """Pre-started sandboxes run one program each: nothing of one call is visible to the next."""
    sid = _sid("fresh")
    first = client.execute(sid, 0, "python", "import os\nopen('/tmp/mark', 'w').write('x')\nprint(os.getpid())\n")
    seen = [client.execute(sid, 1 + i, "python", "import os\nprint(os.path.exists('/tmp/mark'))\n") for i in range(MAX_CONCURRENT + 1)]
    assert first.result.ok and all(s.result.output.strip() == "False" for s in seen), seen


def test_a_dead_prestarted_sandbox_is_replaced(tmp_path):
    import sys

    from rewards.sandbox.isolation import Isolator
    from rewards.sandbox.tools import Toolbox

    tb = Toolbox(tmp_path, Isolator(), T.Limits(), os.path.realpath(sys.executable), slots=1)
    try:
        tb._ready[0].kill()  # e.g. its starter thread ended (--die-with-parent)
        tb._ready[0].wait()
        assert tb.run("calc", "6*7", 0, 0).output == "42"
        assert tb._ready[0].poll() is None  # and the slot is warm again
    finally:
        tb.close()


def test_pure_calc_in_process_when_asked_python_still_isolated(tmp_path):
    import sys

    from rewards.sandbox.isolation import Isolator
    from rewards.sandbox.tools import Toolbox

    tb = Toolbox(tmp_path, Isolator(), T.Limits(), os.path.realpath(sys.executable), slots=1, isolate_pure=False)
    try:
        warm = tb._ready[0]
        assert tb.run("calc", "6*7", 0, 0).output == "42"
        bad = tb.run("calc", "6*", 0, 0)
        assert not bad.ok and bad.error_kind == T.TOOL_ERROR and "syntax" in bad.error
        assert tb._ready[0] is warm  # answered in the service: the slot's sandbox was not used
        out = tb.run("python", "import os\nprint(os.getuid())\n", 0, 0)
        assert out.ok and int(out.output) >= UID_BASE  # python still runs in a sandbox, under its slot's uid
        assert tb._ready[0] is not warm
    finally:
        tb.close()


def test_services_on_one_host_with_their_own_slots_leave_each_other_alone(tmp_path):
    """Two services on this host (the cluster's replicas, each its own slot range): a call on one killed at
    its wall clock has its slot's uid swept, and a call on the other, running then, lives on. With the same
    slots, the sweep killed it ('killed by SIGKILL')."""
    from rewards.sandbox.client import SandboxClient
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import SandboxServer

    def serve(name, first, wall):
        cfg = SandboxConfig(log_dir=tmp_path / name, max_concurrent=1, first_slot=first, wall_s=wall, cpu_s=2,
                            address_space_mb=256, processes=PROCESSES, tmp_mb=8)
        return SandboxServer(cfg, token="replica-test-token")

    a, b = serve("a", 100, 1.0), serve("b", 101, 10.0)
    out = {}
    try:
        with SandboxClient(a.target, "replica-test-token", timeout_s=30, retries=0) as ca, \
                SandboxClient(b.target, "replica-test-token", timeout_s=30, retries=0) as cb:
            def benign():
                out["b"] = cb.execute("victim", 0, "python", "import os, time\ntime.sleep(2.5)\nprint(os.getuid())\n").result

            t = threading.Thread(target=benign)
            t.start()
            time.sleep(0.7)
            hostile = ca.execute("hostile", 0, "python", "while True: pass\n").result
            t.join()
    finally:
        a.stop()
        b.stop()
    assert hostile.error_kind == T.TIMEOUT, hostile
    assert out["b"].ok, out["b"]
    assert os.geteuid() != 0 or out["b"].output.strip() == str(UID_BASE + 101)
