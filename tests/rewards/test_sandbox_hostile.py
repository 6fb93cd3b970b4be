"""Hostile tool code against the real service: every escape attempt fails with its specific error, and a
healthy client keeps being served within its deadline meanwhile.

Real bubblewrap, real seccomp filter, real gRPC, a real WAL service and PostgreSQL port on the host.
Each attempt first checks on the host that its target exists or answers, so a view or filter that let it
through would fail the test. The resource attacks (fork bomb, memory hog, loop, huge output) live in
test_sandbox_isolation.py.
"""
from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

import rewards
from rewards.sandbox import types as T
from rewards.sandbox.isolation import UID_BASE, probe

REASON = probe()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"sandbox isolation unavailable: {REASON}")

MAX_CONCURRENT = 3
SECRET = "hostile-suite-secret-7f3a"  # in the service's environment: must never be readable in a sandbox
BENIGN_DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from rewards.sandbox.client import SandboxClient
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import SandboxServer
    from wal.config import ServeConfig
    from wal.server import Server as WALServer

    run_dir = tmp_path_factory.mktemp("run")
    os.environ["POSTRAIN_HOSTILE_SECRET"] = SECRET
    wal = WALServer(run_dir / "wal", ServeConfig(port=0))
    cfg = SandboxConfig(log_dir=run_dir / "sandbox", max_concurrent=MAX_CONCURRENT, wall_s=10.0, cpu_s=2,
                        address_space_mb=256, processes=16, tmp_mb=8)
    srv = SandboxServer(cfg, token="hostile-suite-token")
    hostile = SandboxClient(srv.target, "hostile-suite-token", timeout_s=30, retries=0)
    healthy = SandboxClient(srv.target, "hostile-suite-token", timeout_s=BENIGN_DEADLINE_S, retries=0)
    yield {"srv": srv, "wal": wal, "run_dir": run_dir, "hostile": hostile, "healthy": healthy}
    hostile.close()
    healthy.close()
    srv.stop()
    wal.stop()
    os.environ.pop("POSTRAIN_HOSTILE_SECRET", None)


_ids = iter(range(10**6))


def attack(env, code: str):
    """Run hostile `code`; meanwhile a second client makes healthy calls, each within its deadline."""
    out, done = {}, threading.Event()

    def run():
        try:
            out["res"] = env["hostile"].execute(f"hostile-{next(_ids)}", 0, "python", code).result
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    healthy = []
    while not done.is_set() or not healthy:
        t0 = time.monotonic()
        res = env["healthy"].execute(f"healthy-{next(_ids)}", 0, "calc", "37*41", deadline_s=BENIGN_DEADLINE_S)
        healthy.append((res.result.ok and res.result.output.strip() == "1517", time.monotonic() - t0))
    t.join(60)
    assert all(ok and secs < BENIGN_DEADLINE_S for ok, secs in healthy), healthy
    return out["res"]


def assert_refused(res, error: str, kind: str = T.TOOL_ERROR):
    assert not res.ok and res.error_kind == kind, res
    assert error in res.error, res


# -- host files -------------------------------------------------------------------------------------

def host_targets(env) -> dict[str, Path]:
    wal_segment = next(p for p in (env["run_dir"] / "wal").rglob("*") if p.is_file())
    return {
        "shadow": Path("/etc/shadow"),
        "passwd": Path("/etc/passwd"),
        "run_dir_wal": wal_segment,
        "service_state": next(p for p in (env["run_dir"] / "sandbox").rglob("*") if p.is_file()),
        "project_source": Path(rewards.__file__).resolve(),
        "home": next((p for p in sorted(Path.home().iterdir()) if p.is_file()), Path.home() / "absent"),
        "host_tmp": Path(env["run_dir"]).resolve(),
        "sys": Path("/sys/kernel"),
        "run_sockets": Path("/run"),
        "usr_local": Path("/usr/local"),
    }


@pytest.mark.parametrize("name", ["shadow", "passwd", "run_dir_wal", "service_state", "project_source", "home",
                                  "host_tmp", "sys", "run_sockets", "usr_local"])
def test_host_files_are_not_there(env, name):
    target = host_targets(env)[name]
    assert target.exists(), f"{target} missing on the host: the test would prove nothing"
    code = f"import os\np = {str(target)!r}\nprint(os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read(64))\n"
    assert_refused(attack(env, code), "FileNotFoundError")


def test_the_view_is_minimal(env):
    import sys

    prefix_top = Path(os.path.realpath(sys.executable)).parts[1]
    code = "import os\nprint(sorted(os.listdir('/')), sorted(os.listdir('/etc')))\n"
    res = attack(env, code)
    assert res.ok, res
    top = {"bin", "dev", "etc", "lib", "proc", "tmp", "usr", prefix_top} | ({"lib64"} if os.path.exists("/lib64") else set())
    assert res.output.strip() == f"{sorted(top)} {['ld.so.cache', 'ld.so.conf', 'ld.so.conf.d']}"


def test_process_environments_hold_no_secret(env):
    assert os.environ["POSTRAIN_HOSTILE_SECRET"] == SECRET
    code = ("import os\n"
            "seen = b''\n"
            "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    try:\n"
            "        seen += open(f'/proc/{pid}/environ', 'rb').read()\n"
            "    except OSError as exc:\n"
            "        print(pid, type(exc).__name__)\n"
            "print(seen)\n"
            "open('/proc/1/environ', 'rb').read()\n")
    res = attack(env, code)
    assert SECRET not in res.output and SECRET not in res.error
    if os.geteuid() == 0:  # bubblewrap's pid 1 is root: its environment is closed to the slot uid
        assert_refused(res, "PermissionError")


# -- writes and symlinks ------------------------------------------------------------------------------

@pytest.mark.parametrize("path, error", [
    ("/escape", "Read-only file system"),
    ("/etc/ld.so.conf", "Read-only file system"),
    ("/usr/lib/escape", "Read-only file system"),
    ("/dev/escape", "PermissionError"),
    ("/dev/shm/escape", "PermissionError"),  # /dev is an uncapped tmpfs: closed to the tool
    ("/proc/sys/kernel/hostname", "PermissionError"),
])
def test_writes_outside_tmp_fail(env, path, error):
    assert_refused(attack(env, f"open({path!r}, 'w').write('x')\n"), error)


def test_symlink_tricks_in_tmp(env):
    victim = env["run_dir"] / "victim.txt"
    victim.write_text("host")
    shadow_via_pid1 = "/proc/1/root/etc/shadow"
    code = ("import os\n"
            f"os.symlink({str(victim)!r}, '/tmp/to_host')\n"
            f"os.symlink({shadow_via_pid1!r}, '/tmp/to_pid1_root')\n"
            "os.symlink('/proc/1/cwd', '/tmp/to_pid1_cwd')\n"
            "for link in ('/tmp/to_host', '/tmp/to_pid1_root', '/tmp/to_pid1_cwd'):\n"
            "    try:\n"
            "        open(link, 'w').write('pwned')\n"
            "        print(link, 'WRITTEN')\n"
            "    except OSError as exc:\n"
            "        print(link, type(exc).__name__)\n"
            "os.link('/usr/bin/true', '/tmp/hard')\n")  # a hard link out of /tmp: another filesystem
    res = attack(env, code)
    assert "WRITTEN" not in res.output, res
    assert "/tmp/to_host FileNotFoundError" in res.output, res
    if os.geteuid() == 0:
        assert "/tmp/to_pid1_root PermissionError" in res.output, res
    assert_refused(res, "Invalid cross-device link")
    assert victim.read_text() == "host"


# -- network ------------------------------------------------------------------------------------------

def _connect_code(port: int) -> str:
    return f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"


@pytest.mark.parametrize("service", ["postgresql", "wal"])
def test_host_services_are_unreachable(env, service):
    port = 5432 if service == "postgresql" else env["wal"].port
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        pytest.skip(f"nothing listens on 127.0.0.1:{port} on the host")
    res = attack(env, _connect_code(port))
    assert "connected" not in res.output
    assert_refused(res, "ConnectionRefusedError")  # its own empty network namespace: nothing listens there


# -- namespaces and dangerous system calls ------------------------------------------------------------

_SYSCALL = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\n"
            "def call(rc):\n"
            "    if rc == -1:\n"
            "        e = ctypes.get_errno()\n"
            "        raise OSError(e, os.strerror(e))\n"
            "    print('succeeded', rc)\n")

_NR = {"x86_64": {"clone": 56, "clone3": 435, "bpf": 321, "perf_event_open": 298, "io_uring_setup": 425,
                  "userfaultfd": 323, "keyctl": 250},
       "aarch64": {"clone": 220, "clone3": 435, "bpf": 280, "perf_event_open": 241, "io_uring_setup": 425,
                   "userfaultfd": 282, "keyctl": 219}}.get(platform.machine())

ATTEMPTS = {
    "unshare_user": ("call(libc.unshare(0x10000000))", "PermissionError"),
    "unshare_net_mount": ("call(libc.unshare(0x40000000 | 0x00020000))", "PermissionError"),
    "clone_newuser": ("call(libc.syscall(NR['clone'], 0x10000000 | 17, 0, 0, 0, 0))", "PermissionError"),
    "clone3": ("buf = ctypes.create_string_buffer(88)\ncall(libc.syscall(NR['clone3'], buf, 88))",
               "Function not implemented"),
    "setns": ("fd = os.open('/proc/self/ns/net', os.O_RDONLY)\ncall(libc.setns(fd, 0))", "PermissionError"),
    "mount": ("call(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))", "PermissionError"),
    "ptrace_attach": ("pid = os.fork()\nif pid == 0:\n    import time; time.sleep(5); os._exit(0)\n"
                      "try:\n    call(libc.ptrace(16, pid, 0, 0))\nfinally:\n    os.kill(pid, 9)", "PermissionError"),
    "ptrace_traceme": ("call(libc.ptrace(0, 0, 0, 0))", "PermissionError"),
    "bpf": ("call(libc.syscall(NR['bpf'], 0, 0, 0))", "PermissionError"),
    "perf_event_open": ("call(libc.syscall(NR['perf_event_open'], 0, 0, -1, -1, 0))", "PermissionError"),
    "io_uring": ("params = ctypes.create_string_buffer(120)\ncall(libc.syscall(NR['io_uring_setup'], 4, params))",
                 "PermissionError"),
    "userfaultfd": ("call(libc.syscall(NR['userfaultfd'], 0))", "PermissionError"),
    "keyctl": ("call(libc.syscall(NR['keyctl'], 0, -3, 0))", "PermissionError"),  # KEYCTL_GET_KEYRING_ID
    "personality": ("call(libc.personality(0x0040000))", "PermissionError"),  # ADDR_NO_RANDOMIZE
    # memory outside RLIMIT_AS: memfd pages and System V segments outlive the mappings the limit counts
    "memfd_create": ("fd = os.memfd_create('x')\nos.posix_fallocate(fd, 0, 8 << 20)\nprint('succeeded', fd)",
                     "PermissionError"),
    "shmget": ("call(libc.shmget(0, 8 << 20, 0o1600))", "PermissionError"),  # IPC_PRIVATE, IPC_CREAT | 0600
    "open_files": ("fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(300)]\nprint('succeeded', len(fds))",
                   "Too many open files"),  # RLIMIT_NOFILE: 256
    "unshare_command": ("import subprocess, sys\n"
                        "r = subprocess.run(['unshare', '-Urn', 'id'], capture_output=True, text=True)\n"
                        "print(r.stdout)\nsys.exit(r.stderr.strip())", "Operation not permitted"),
}


@pytest.mark.skipif(_NR is None, reason=f"no syscall table for {platform.machine()}")
@pytest.mark.parametrize("name", sorted(ATTEMPTS))
def test_namespace_and_kernel_attack_surface_is_closed(env, name):
    body, error = ATTEMPTS[name]
    res = attack(env, f"{_SYSCALL}NR = {_NR!r}\n{body}\n")
    assert "succeeded" not in res.output and "uid=0" not in res.output, res
    assert_refused(res, error)


def test_filter_in_force_and_benign_syscalls_allowed(env):
    code = ("import os, threading, subprocess, ctypes\n"
            "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
            "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"  # clone3 -> ENOSYS -> clone
            "pid = os.fork()\n"
            "if pid == 0:\n    os._exit(7)\n"
            "child = os.waitpid(pid, 0)[1] >> 8\n"
            "sh = subprocess.run(['/bin/sh', '-c', 'echo sh'], capture_output=True, text=True).stdout.strip()\n"
            "libc = ctypes.CDLL(None)\n"
            "libc.personality.argtypes = [ctypes.c_ulong]\n"
            "query = libc.personality(0xffffffff)\n"
            "print(status['Seccomp'].strip(), status['NoNewPrivs'].strip(), child, sh, query)\n")
    res = attack(env, code)
    assert res.ok, res
    assert res.output.split() == ["2", "1", "7", "sh", "0"], res


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x32 system calls exist on x86_64 only")
def test_foreign_abi_system_calls_kill_the_tool(env):
    # unshare through the x32 ABI (syscall bit 30): a filter keyed on native numbers must not let it pass
    code = f"{_SYSCALL}call(libc.syscall(0x40000000 | 272, 0x10000000))\n"
    res = attack(env, code)
    assert "succeeded" not in res.output
    assert_refused(res, "SIGSYS", kind=T.KILLED)


# -- signals ------------------------------------------------------------------------------------------

def test_signals_reach_no_other_process(env):
    # Victims: a host process under an unprivileged uid, the service itself, and a neighbour sandbox running a
    # long call on another slot. ESRCH, not EPERM, shows the pid namespace hides them (not only the uid).
    # (The victim's uid lies in the sandbox range but above any slot: other services on this machine sweep
    # the slot uids after a killed run.)
    victim_uid = UID_BASE + 250
    victims = [subprocess.Popen(["sleep", "60"], user=victim_uid, group=victim_uid, extra_groups=[])
               ] if os.geteuid() == 0 else []
    neighbour = {}

    def long_call():
        neighbour["res"] = env["healthy"].execute(f"neighbour-{next(_ids)}", 0, "python",
                                                  "import time\ntime.sleep(2)\nprint('alive')\n").result

    t = threading.Thread(target=long_call)
    t.start()
    time.sleep(0.5)
    try:
        pids = [v.pid for v in victims] + [os.getpid()]
        code = ("import os, signal\n"
                "os.kill(-1, signal.SIGKILL)\n"  # everything it may signal: only its own namespace
                f"for pid in {pids!r}:\n"
                "    os.kill(pid, signal.SIGKILL)\n")
        res = attack(env, code)
        assert_refused(res, "ProcessLookupError")
        t.join(30)
        assert neighbour["res"].ok and neighbour["res"].output.strip() == "alive", neighbour
        assert all(v.poll() is None for v in victims), "a host process was killed from inside a sandbox"
    finally:
        for v in victims:
            v.send_signal(signal.SIGKILL)
            v.wait()
