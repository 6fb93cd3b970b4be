"""An execution's memory is bounded as a whole: several processes, each within RLIMIT_AS, and /tmp pages
count against one memory cgroup per slot, whose out-of-memory kills the service reads from the kernel.

Real bubblewrap, real cgroups (v1 or v2, whichever the machine has); skipped only where either is missing."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rewards.sandbox import memcg
from rewards.sandbox import types as T
from rewards.sandbox.isolation import Isolator, probe
from rewards.sandbox.tools import Toolbox


def _cgroups_reason() -> str | None:
    try:
        memcg.SlotCgroups().close()
    except memcg.CgroupUnavailable as exc:
        return str(exc)
    return None


REASON = probe() or _cgroups_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"isolation or memory cgroups unavailable: {REASON}")
PYTHON = os.path.realpath(sys.executable)

# Four processes of 60 MiB each: every one within its 1 GiB address space, 240 MiB together.
FOUR_CHILDREN = """\
import os, time
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        b = bytearray(60 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(0.5)
        os._exit(0)
    pids.append(pid)
print([os.waitpid(p, 0)[1] for p in pids])
"""
# 200 MiB written to the private /tmp: tmpfs pages, which no process's address space counts.
FILL_TMP = """\
with open('/tmp/f', 'wb') as f:
    for _ in range(200):
        f.write(b'x' * (1 << 20))
print('wrote')
"""


@pytest.fixture
def isolator():
    iso = Isolator(memory_cgroup="required")
    yield iso
    iso.close()


def _run(iso, tmp_path, code: str, **limits) -> T.ToolOutcome:
    tb = Toolbox(tmp_path, iso, T.Limits(**limits), PYTHON)
    try:
        return tb.run("python", code, 0, 3)
    finally:
        tb.close()


def test_processes_together_over_the_execution_limit_are_killed(isolator, tmp_path):
    out = _run(isolator, tmp_path, FOUR_CHILDREN, memory_bytes=128 << 20)
    assert out.error_kind == T.MEMORY_LIMIT, out
    assert "the kernel killed" in out.error
    free = _run(isolator, tmp_path, FOUR_CHILDREN, memory_bytes=0)  # per process only: the same program passes
    assert free.ok and free.output.strip() == "[0, 0, 0, 0]", free


def test_tmp_pages_count_against_the_execution(isolator, tmp_path):
    big_tmp = {"tmp_bytes": 256 << 20, "file_size_bytes": 256 << 20}
    out = _run(isolator, tmp_path, FILL_TMP, memory_bytes=96 << 20, **big_tmp)
    assert out.error_kind == T.MEMORY_LIMIT and "wrote" not in out.output, out
    assert _run(isolator, tmp_path, FILL_TMP, memory_bytes=512 << 20, **big_tmp).ok


def test_an_out_of_memory_kill_the_tool_imitates_is_not_one(isolator, tmp_path):
    # exit 137 reads as SIGKILL (bwrap's pid 1 reports a killed child so), and the words are the kernel's
    out = _run(isolator, tmp_path, "import sys\nprint('Killed: out of memory', file=sys.stderr)\nsys.exit(137)",
               memory_bytes=128 << 20)
    assert out.error_kind == T.KILLED, out


def test_limits_move_both_ways_and_close_removes_the_cgroups(tmp_path):
    iso = Isolator(memory_cgroup="required")
    cg = iso.cgroups
    slot = Path(cg.procs(7, 64 << 20)).parent
    names = ["memory.max"] if cg.version == 2 else ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    names = [n for n in names if (slot / n).exists()]
    for limit in (64 << 20, 512 << 20, 32 << 20):  # v1 keeps memory + swap >= memory at every step
        cg.procs(7, limit)
        assert [int((slot / n).read_text()) for n in names] == [limit] * len(names)
    assert _run(iso, tmp_path, "print(6 * 7)", memory_bytes=256 << 20).output.strip() == "42"
    iso.close()
    assert not cg.base.exists()


def test_cgroups_of_a_dead_service_are_removed(tmp_path):
    _, parent = memcg.find()
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    left = parent / f"{memcg.PREFIX}{dead}-1"
    (left / "slot-0").mkdir(parents=True)
    alive = parent / f"{memcg.PREFIX}{os.getpid()}-999"
    alive.mkdir()
    try:
        memcg.SlotCgroups().close()
        assert not left.exists()
        assert alive.exists()  # a live service's cgroups stay
    finally:
        for d in (left / "slot-0", left, alive):
            if d.exists():
                d.rmdir()


def test_service_bounds_executions_by_default(tmp_path):
    from rewards.sandbox.client import SandboxClient
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import SandboxServer

    cfg = SandboxConfig(log_dir=tmp_path / "svc", max_concurrent=2, memory_mb=160, memory_cgroup="required")
    srv = SandboxServer(cfg, token="memcg-test-token-0123")
    base = srv.isolator.cgroups.base
    try:
        with SandboxClient(srv.target, "memcg-test-token-0123", timeout_s=30, retries=0) as client:
            hog = client.execute("memcg-hog", 0, "python", FOUR_CHILDREN).result
            assert hog.error_kind == T.MEMORY_LIMIT and "167772160 bytes" in hog.error, hog
            assert client.execute("memcg-ok", 0, "calc", "6*7").result.output.strip() == "42"
    finally:
        srv.stop()
    assert not base.exists()


def test_memory_option_errors_are_one_line(capsys):
    from deploy.cli import main

    assert main(["sandbox", "serve", "--memory-mb", "40", "--log-dir", "/nonexistent/x"]) != 0
    err = capsys.readouterr().err.strip()
    assert "memory_mb (40) must be 0 or at least 64 + tmp_mb" in err and "\n" not in err, err
