"""Run one command isolated: bubblewrap namespaces, rlimits, a dedicated uid, a wall clock, bounded output.

Each execution gets:
- bubblewrap: the minimal filesystem view of `view.py` (read-only binds of the interpreter and the
  shared libraries, fresh /dev and /proc, a private size-capped tmpfs /tmp; nothing of the host's
  project tree, homes, /tmp, run directories, sockets or /sys), no network (--unshare-net), its own pid,
  ipc and uts namespaces, an empty environment (--clearenv), a new session, and death with its parent;
- the seccomp filter of `syscall_filter.py` (no new namespaces, no mount, ptrace, bpf, io_uring, ...),
  loaded by bubblewrap just before the tool starts; when the service is not root and bubblewrap maps a
  user namespace, also --disable-userns. What this machine cannot provide is listed in
  `Isolator.missing`, and the Isolator refuses to start unless told to accept weaker isolation;
- rlimits CPU, AS (memory), NPROC, FSIZE set inside the sandbox, before the tool runs: by `prlimit` for any
  command, by a short prelude in the interpreter for Python tools (two execs fewer); not by a
  preexec_fn, as running Python between fork and exec in a multi-threaded gRPC server can deadlock;
- a uid of its own: RLIMIT_NPROC counts tasks per real uid and root ignores it, so when the service runs
  as root every concurrent execution drops to a distinct unprivileged uid (`setpriv`, or the prelude)
  taken from a pool: a fork bomb exhausts only its own uid's budget, never a neighbour's;
- a fresh sandbox per execution, which may be started ahead of the call (`prestart`): it boots and drops
  privileges, then waits for its program on stdin, so namespace and interpreter start-up leave the call's
  critical path without any sandbox ever running two programs;
- a wall clock: on expiry or on too much output the whole process group is SIGKILLed; killing
  bubblewrap's pid-1 reaper takes the pid namespace down with it, and every process still owned by
  the execution's uid is swept;
- where the machine lets the service create memory cgroups (`memcg.py`) and the limits ask for it, one
  memory bound on the whole execution (every process and its /tmp), whose out-of-memory kills the
  service counts from the kernel.
"""
from __future__ import annotations

import marshal
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rewards.sandbox import memcg, syscall_filter, view
from rewards.sandbox.types import Limits, RunOutcome

UID_BASE = 61000  # execution uids are UID_BASE + slot; chosen far from distribution-assigned ids
PIPE_BYTES = 64 << 10  # Linux default pipe buffer: a write of at most this never blocks on an empty pipe
UID_RANGE = 256   # slots 0..255 (max_concurrent <= 256; the benchmark and tests use slots above the service's)
CENSUS_AFTER_S, CENSUS_EVERY_S = 0.3, 0.1  # a run longer than 0.3 s has its tasks counted every 0.1 s


# Runs first in the sandboxed interpreter (argv: uid cpu_s as_bytes nproc fsize_bytes): rlimits, the uid
# drop, then it waits for the program (marshal of (code, argv)) on stdin and runs it as __main__. The
# wait lets the service start a sandbox before a call arrives (see Isolator.prestart).
_PRELUDE = """\
import os, resource, sys
uid, cpu, mem, nproc, fsize = (int(v) for v in sys.argv[1:6])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getuid() == 0:
        sys.exit("sandbox: could not drop privileges")
import marshal
code, args = marshal.loads(sys.stdin.buffer.read())  # blocks until the call is logged and sent
sys.argv[:] = ["-c", *args]
del os, resource, marshal, uid, cpu, mem, nproc, fsize, args
exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


BWRAP_ENV = {"PATH": "/usr/bin:/bin"}  # bubblewrap itself runs with this environment, not the service's


# Runs in a probe sandbox: is the filter in force, and does it refuse a new user namespace?
_PROBE = """\
import ctypes, os
status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.unshare(0x10000000)
print('Seccomp', status['Seccomp'].strip(), 'unshare', ctypes.get_errno() if rc != 0 else 0)
"""


def prelude_command(python: str, limits: Limits, uid: int, nproc: int) -> list[str]:
    """The interpreter running the prelude: limits, drop to `uid` (-1: stay), wait for its program on stdin.
    In a sandbox it is bubblewrap's command; the benchmark also runs it bare, as the unsandboxed baseline."""
    numbers = (uid, limits.cpu_s, limits.address_space_bytes, nproc, limits.file_size_bytes)
    return [python, "-I", "-S", "-c", _PRELUDE, *map(str, numbers)]


def encode_program(code: str, args: list[str]) -> bytes:
    """What the prelude reads on stdin: the program's source and its argv."""
    return marshal.dumps((code, list(args)))


class IsolationUnavailable(RuntimeError):
    """bubblewrap (or prlimit/setpriv) is missing or cannot create namespaces here, or a required layer
    (the seccomp filter, no nested user namespaces) is missing and weaker isolation was not accepted."""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _bwrap_run(args: list[str], pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess | str:
    try:
        return subprocess.run([bwrap_path(), *args], capture_output=True, timeout=10, env=BWRAP_ENV, pass_fds=pass_fds)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap cannot run: {exc}"


def probe() -> str | None:
    """None when isolated execution works on this machine, else one line saying why not."""
    for tool in ("bwrap", "prlimit", "setpriv"):
        if shutil.which(tool) is None:
            pkg = "bubblewrap" if tool == "bwrap" else "util-linux"
            return f"{tool} not found: install it (apt-get install {pkg})"
    res = _bwrap_run([*view.mount_args(sys.executable, 1 << 20), "--unshare-net", "--unshare-pid",
                      *([] if os.geteuid() == 0 else ["--unshare-user"]), "--", "true"])
    if isinstance(res, str):
        return res
    if res.returncode != 0:
        return f"bwrap cannot create namespaces here: {res.stderr.decode(errors='replace').strip()[:200]}"
    return None


def bwrap_supports(flag: str) -> bool:
    try:
        out = subprocess.run([bwrap_path(), "--help"], capture_output=True, text=True, timeout=10, env=BWRAP_ENV)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return f"{flag} " in out.stdout + out.stderr


def hardening(python: str) -> tuple[bytes | None, bool, list[str]]:
    """(seccomp program or None, use --disable-userns, what is missing) on this machine and bubblewrap.

    Each layer is tried for real: the filter must be in force in a probe sandbox (`Seccomp: 2`) and must
    refuse unshare(CLONE_NEWUSER) there."""
    missing = []
    program, reason = None, None
    if not bwrap_supports("--seccomp"):
        reason = "bubblewrap lacks --seccomp (needs 0.3 or newer)"
    else:
        try:
            program = syscall_filter.build_filter()
        except syscall_filter.FilterUnavailable as exc:
            reason = str(exc)
    if program is not None:
        fd = syscall_filter.program_fd(program)
        try:
            res = _bwrap_run([*view.mount_args(python, 1 << 20), "--unshare-net", "--unshare-pid",
                              *([] if os.geteuid() == 0 else ["--unshare-user"]), "--seccomp", str(fd), "--",
                              python, "-I", "-S", "-c", _PROBE], pass_fds=(fd,))
        finally:
            os.close(fd)
        out = res if isinstance(res, str) else (res.stdout + res.stderr).decode(errors="replace").strip()
        if isinstance(res, str) or res.returncode != 0 or out != "Seccomp 2 unshare 1":
            program, reason = None, f"the kernel did not apply it ({out[:200]})"
    if program is None:
        missing.append(f"seccomp filter: {reason}")
    # Nested user namespaces: the filter refuses unshare/clone(CLONE_NEW*) for everyone; a service that is not
    # root also maps a user namespace, in which bubblewrap can forbid nested ones (--disable-userns, 0.8+).
    disable_userns = os.geteuid() != 0 and bwrap_supports("--disable-userns")
    if program is None and not disable_userns:
        missing.append("no nested user namespaces: needs the seccomp filter"
                       + ("" if os.geteuid() == 0 else " or bubblewrap 0.8+ (--disable-userns)"))
    return program, disable_userns, missing


def _check_slot(slot: int) -> None:
    if not 0 <= slot < UID_RANGE:
        raise ValueError(f"slot {slot} outside [0, {UID_RANGE})")


def _tasks_of_uid(uid: int) -> list[int]:
    """Pids of every process whose real uid is `uid` (read from /proc)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(entry.name))
                        break
        except (OSError, ValueError):
            continue
    return pids


class Isolator:
    """Builds and runs the bubblewrap command line for one execution.

    `hidden`: host directories the sandbox must not see even where they lie inside a read-only bind of the
    view (the state directory; always the service user's home, the project source and this interpreter's
    virtual environment). `allow_weaker`: start even when a layer is missing (listed in `.missing`).
    `memory_cgroup`: "auto" bounds an execution's memory by a cgroup where this machine allows one (else
    `.memory_note` says why not), "required" refuses to start without, "off" uses none; the bound itself is
    Limits.memory_bytes (0: none).
    """

    def __init__(self, hidden: list[Path] = (), allow_weaker: bool = False, memory_cgroup: str = "auto"):
        if memory_cgroup not in ("auto", "required", "off"):
            raise ValueError(f"memory_cgroup {memory_cgroup!r}: choose auto, required or off")
        reason = probe()
        if reason is not None:
            raise IsolationUnavailable(reason)
        self.seccomp, self.disable_userns, self.missing = hardening(os.path.realpath(sys.executable))
        if self.missing and not allow_weaker:
            raise IsolationUnavailable("weaker isolation than required, missing: " + "; ".join(self.missing)
                                       + " (--allow-weaker-isolation runs without it)")
        if os.geteuid() == 0:  # the sweep kills every task of a slot uid: none may belong to a real account
            taken = [(u.pw_uid, u.pw_name) for u in pwd.getpwall() if UID_BASE <= u.pw_uid < UID_BASE + UID_RANGE]
            if taken:
                raise IsolationUnavailable(f"uid {taken[0][0]} ({taken[0][1]}) lies in the sandbox uid range "
                                           f"[{UID_BASE}, {UID_BASE + UID_RANGE}); move that account or UID_BASE")
        self.bwrap = bwrap_path()
        self.prlimit = shutil.which("prlimit")
        self.setpriv = shutil.which("setpriv")
        self.as_root = os.geteuid() == 0
        project = Path(__file__).resolve().parents[2]
        self.hidden = [Path(p).resolve() for p in (*hidden, Path.home(), project, sys.prefix)]
        self._views: dict[tuple[str, int], list[str]] = {}
        self.cgroups, self.memory_note = None, "memory cgroups off"
        if memory_cgroup != "off":
            try:
                self.cgroups, self.memory_note = memcg.SlotCgroups(), None
            except memcg.CgroupUnavailable as exc:
                if memory_cgroup == "required":
                    raise IsolationUnavailable(f"no memory cgroup for the executions: {exc}") from None
                self.memory_note = f"no memory cgroup ({exc}): memory is bounded per process only"

    def close(self) -> None:
        """Remove the slots' memory cgroups (after every sandbox of this Isolator has ended)."""
        if self.cgroups is not None:
            if self.as_root:
                for slot in self.cgroups.slots():
                    self._sweep(UID_BASE + slot)
            self.cgroups.close()

    def _mounts(self, python: str, limits: Limits) -> list[str]:
        key = (python, limits.tmp_bytes)
        if key not in self._views:  # a handful of keys: one interpreter, the configured tmp sizes
            self._views[key] = view.mount_args(python, limits.tmp_bytes, self.hidden)
        return self._views[key]

    def _namespaces(self) -> list[str]:
        ns = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session", "--clearenv",
              "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
              "--setenv", "LANG", "C.UTF-8", "--chdir", "/tmp", "--hostname", "sandbox"]
        if self.as_root:
            return ns
        return ["--unshare-user", *(["--disable-userns"] if self.disable_userns else []), *ns]

    def _popen(self, argv: list[str], slot: int, limits: Limits) -> subprocess.Popen:
        """Start bubblewrap `argv` as slot `slot`, with the seccomp filter (`--seccomp FD`, a fresh pipe) inserted
        before `--`, inside the slot's memory cgroup where there is one and `limits` ask for it."""
        fd = syscall_filter.program_fd(self.seccomp) if self.seccomp is not None else None
        try:
            if fd is not None:
                at = argv.index("--")
                argv = [*argv[:at], "--seccomp", str(fd), *argv[at:]]
            if self.cgroups is not None and limits.memory_bytes:
                argv = self.cgroups.enter_argv(slot, limits.memory_bytes, argv)
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, close_fds=True, env=BWRAP_ENV,
                                    pass_fds=() if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)

    def argv(self, command: list[str], limits: Limits, uid: int) -> list[str]:
        """The full command line: bwrap [namespaces, mounts] prlimit [limits] [setpriv uid] command
        (the seccomp filter's `--seccomp FD` is added before `--` when the sandbox starts)."""
        ns = self._namespaces()
        # Non-root: NPROC counts every task of the service user, so the budget sits on top of what runs now.
        nproc = limits.processes if self.as_root else limits.processes + len(_tasks_of_uid(os.getuid()))
        # soft < hard: the soft CPU limit delivers SIGXCPU (reported as cpu_limit); hard is the backstop
        rl = [self.prlimit, f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.address_space_bytes}",
              f"--nproc={nproc}", f"--fsize={limits.file_size_bytes}", "--core=0", "--"]
        drop = []
        if self.as_root:
            drop = [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return [self.bwrap, *self._mounts(os.path.realpath(sys.executable), limits), *ns, "--", *rl, *drop, *command]

    def python_argv(self, python: str, limits: Limits, uid: int) -> list[str]:
        """Sandbox for Python tools: the interpreter itself sets the rlimits and drops to `uid` (the
        same steps as prlimit + setpriv, two execs fewer), then waits for its program on stdin.
        Inside bwrap only CAP_SETUID/CAP_SETGID remain for that; after the drop no capability is left
        and no_new_privs (set by bwrap) forbids regaining one."""
        nproc = limits.processes if self.as_root else limits.processes + len(_tasks_of_uid(os.getuid()))
        caps = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if self.as_root else []
        return [self.bwrap, *self._mounts(python, limits), *self._namespaces(), *caps, "--",
                *prelude_command(python, limits, uid if self.as_root else -1, nproc)]

    def prestart(self, python: str, limits: Limits, slot: int) -> subprocess.Popen:
        """Start a Python sandbox for slot `slot` that boots (namespaces, mounts, interpreter, limits, uid
        drop) and then waits, running nothing, until run_python hands it a program. Used once.
        --die-with-parent binds it to the calling *thread*: a sandbox whose starter thread ended is
        found dead by run_python, which then starts a fresh one."""
        _check_slot(slot)
        return self._popen(self.python_argv(python, limits, UID_BASE + slot), slot, limits)

    def run_python(self, python: str, code: str, args: list[str], limits: Limits, slot: int,
                   started: subprocess.Popen | None = None) -> RunOutcome:
        """Run Python `code` (argv `args`) isolated as slot `slot`, in `started` (from prestart with the same
        python and limits apart from wall_s) if it is still waiting, else in a sandbox started now."""
        if started is None or started.poll() is not None:
            if started is not None:
                self.discard(started)
            started = self.prestart(python, limits, slot)
        program = encode_program(code, args)
        return self.collect(started, limits, UID_BASE + slot, time.monotonic(), program)

    def discard(self, proc: subprocess.Popen) -> None:
        """Kill and reap a sandbox that will not be used."""
        self._kill(proc)
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                f.close()

    def run(self, command: list[str], limits: Limits, slot: int, stdin: bytes = b"") -> RunOutcome:
        """Run any `command` isolated as execution slot `slot` (its uid is UID_BASE + slot)."""
        _check_slot(slot)
        start = time.monotonic()
        proc = self._popen(self.argv(command, limits, UID_BASE + slot), slot, limits)
        return self.collect(proc, limits, UID_BASE + slot, start, stdin)

    def collect(self, proc: subprocess.Popen, limits: Limits, uid: int, start: float, stdin: bytes) -> RunOutcome:
        """Feed `stdin`, then read bounded output until exit, the wall clock or the output bound."""
        deadline = start + limits.wall_s
        slot = uid - UID_BASE
        oom_before = self.cgroups.oom_kills(slot) if self.cgroups is not None else 0
        if len(stdin) > PIPE_BYTES:
            self.discard(proc)
            raise ValueError(f"stdin of {len(stdin)} bytes exceeds {PIPE_BYTES}: it could block past the wall clock")
        try:
            proc.stdin.write(stdin)  # fits the pipe buffer: never blocks, whatever the sandbox does
        except BrokenPipeError:
            pass
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, err = bytearray(), bytearray()
        timed_out = exceeded = False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        # A pidfd turns "bwrap exited" into one more selector event: no polling wait(timeout), whose
        # sleeps would add up to tens of milliseconds to every call.
        pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, None)
        peak_tasks = 0
        next_census = start + CENSUS_AFTER_S  # quick calls pay no /proc scan
        try:
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if self.as_root and now >= next_census:  # long runs only: how close is it to RLIMIT_NPROC?
                    peak_tasks = max(peak_tasks, len(_tasks_of_uid(uid)))
                    next_census = now + CENSUS_EVERY_S
                for key, _ in sel.select(min(deadline, next_census) - now):
                    if key.data is None:  # the pidfd: bwrap exited; drain what is left in the pipes
                        sel.unregister(key.fileobj)
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = key.data
                    room = limits.output_bytes - len(buf)
                    buf += chunk[:max(room, 0)]
                    if len(chunk) > room:
                        exceeded = True
                        break
                if exceeded:
                    break
            if not (timed_out or exceeded):
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.001))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            killed = timed_out or exceeded or proc.poll() is None
            if killed:
                self._kill(proc)
            proc.wait()
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            proc.stdout.close()
            proc.stderr.close()
            # A normal exit needs no sweep: bwrap's pid 1 exits only after the kernel has reaped every other
            # task of its pid namespace. After a kill that teardown is asynchronous, and the uid is reused next.
            if killed and self.as_root:
                self._sweep(uid)
        wall_ms = int((time.monotonic() - start) * 1000)
        code = proc.returncode
        if 128 < code < 128 + 65:  # bwrap's pid 1 reports a child killed by signal N as exit 128 + N
            code = -(code - 128)
        oom_kills = self.cgroups.oom_kills(slot) - oom_before if self.cgroups is not None else 0
        return RunOutcome(code, bytes(out), bytes(err), timed_out, exceeded, wall_ms, peak_tasks, oom_kills)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @staticmethod
    def _sweep(uid: int) -> None:
        """Kill whatever still runs as the execution's uid (normally nothing: the pid namespace died)."""
        for _ in range(50):  # bounded: a task may fork once more between scan and kill
            pids = _tasks_of_uid(uid)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        print(f"sandbox: uid {uid} still has tasks after sweeping", file=sys.stderr)
