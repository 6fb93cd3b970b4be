"""Run one command isolated: bubblewrap namespaces, rlimits, a dedicated uid, a wall clock, bounded output.

Each execution gets:
- bubblewrap: read-only root, fresh /dev and /proc, no network (--unshare-net), its own pid, ipc and uts
  namespaces, a private size-capped tmpfs /tmp, an empty environment (--clearenv), a new session, and
  death with its parent; the service's state directories are covered by empty tmpfs mounts;
- rlimits CPU, AS, NPROC, FSIZE set inside the sandbox, before the tool runs: by `prlimit` for any
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
  the execution's uid is swept.
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


class IsolationUnavailable(RuntimeError):
    """bubblewrap (or prlimit/setpriv) is missing or cannot create namespaces here."""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def probe() -> str | None:
    """None when isolated execution works on this machine, else one line saying why not."""
    for tool in ("bwrap", "prlimit", "setpriv"):
        if shutil.which(tool) is None:
            pkg = "bubblewrap" if tool == "bwrap" else "util-linux"
            return f"{tool} not found: install it (apt-get install {pkg})"
    cmd = [bwrap_path(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net",
           "--unshare-pid", "--tmpfs", "/tmp", *([] if os.geteuid() == 0 else ["--unshare-user"]), "true"]
    try:
        res = subprocess.run(cmd, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap cannot run: {exc}"
    if res.returncode != 0:
        return f"bwrap cannot create namespaces here: {res.stderr.decode(errors='replace').strip()[:200]}"
    return None


def _check_slot(slot: int) -> None:
    if not 0 <= slot < UID_RANGE:
        raise ValueError(f"slot {slot} outside [0, {UID_RANGE})")


def _covers(parent: Path, child: Path) -> bool:
    return child == parent or parent in child.parents


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

    `hidden`: host directories the sandbox must not see (state dir, env log; the service user's home always);
    `exposed`: directories under a hidden one that must stay readable (this Python installation always).
    """

    def __init__(self, hidden: list[Path] = (), exposed: list[Path] = ()):
        reason = probe()
        if reason is not None:
            raise IsolationUnavailable(reason)
        if os.geteuid() == 0:  # the sweep kills every task of a slot uid: none may belong to a real account
            taken = [(u.pw_uid, u.pw_name) for u in pwd.getpwall() if UID_BASE <= u.pw_uid < UID_BASE + UID_RANGE]
            if taken:
                raise IsolationUnavailable(f"uid {taken[0][0]} ({taken[0][1]}) lies in the sandbox uid range "
                                           f"[{UID_BASE}, {UID_BASE + UID_RANGE}); move that account or UID_BASE")
        self.bwrap = bwrap_path()
        self.prlimit = shutil.which("prlimit")
        self.setpriv = shutil.which("setpriv")
        self.as_root = os.geteuid() == 0
        # Always hidden: the service user's home. Always readable: this interpreter's installation (it may
        # live under that home, e.g. pyenv), so the Python tools can start once they dropped root.
        self.hidden = [Path(p).resolve() for p in (*hidden, Path.home())]
        self.exposed = [Path(p).resolve() for p in (*exposed, sys.base_prefix, sys.prefix)]

    def _mounts(self, limits: Limits) -> list[str]:
        args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp"]
        covered = [Path("/tmp")]
        for path in sorted(set(self.hidden), key=lambda p: len(p.parts)):
            if path.is_dir() and not any(_covers(c, path) for c in covered):
                args += ["--tmpfs", str(path)]
                covered.append(path)
        for path in self.exposed:
            parent = next((c for c in covered if _covers(c, path) and c != path), None)
            if parent is not None and path.exists():
                # bwrap would create the missing directories 0700: unreadable once the tool drops root
                for anc in reversed(path.parents):
                    if parent in anc.parents:
                        args += ["--perms", "0755", "--dir", str(anc)]
                args += ["--ro-bind", str(path), str(path)]
        return args

    def _namespaces(self) -> list[str]:
        ns = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session", "--clearenv",
              "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
              "--setenv", "LANG", "C.UTF-8", "--chdir", "/tmp", "--hostname", "sandbox"]
        return ns if self.as_root else ["--unshare-user", *ns]

    def argv(self, command: list[str], limits: Limits, uid: int) -> list[str]:
        """The full command line: bwrap [namespaces, mounts] prlimit [limits] [setpriv uid] command."""
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
        return [self.bwrap, *self._mounts(limits), *ns, "--", *rl, *drop, *command]

    def python_argv(self, python: str, limits: Limits, uid: int) -> list[str]:
        """Sandbox for Python tools: the interpreter itself sets the rlimits and drops to `uid` (the
        same steps as prlimit + setpriv, two execs fewer), then waits for its program on stdin.
        Inside bwrap only CAP_SETUID/CAP_SETGID remain for that; after the drop no capability is left
        and no_new_privs (set by bwrap) forbids regaining one."""
        nproc = limits.processes if self.as_root else limits.processes + len(_tasks_of_uid(os.getuid()))
        caps = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if self.as_root else []
        numbers = [str(v) for v in (uid if self.as_root else -1, limits.cpu_s, limits.address_space_bytes, nproc,
                                    limits.file_size_bytes)]
        return [self.bwrap, *self._mounts(limits), *self._namespaces(), *caps, "--",
                python, "-I", "-S", "-c", _PRELUDE, *numbers]

    def prestart(self, python: str, limits: Limits, slot: int) -> subprocess.Popen:
        """Start a Python sandbox for slot `slot` that boots (namespaces, mounts, interpreter, limits, uid
        drop) and then waits, running nothing, until run_python hands it a program. Used once.
        --die-with-parent binds it to the calling *thread*: a sandbox whose starter thread ended is
        found dead by run_python, which then starts a fresh one."""
        _check_slot(slot)
        return subprocess.Popen(self.python_argv(python, limits, UID_BASE + slot), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True)

    def run_python(self, python: str, code: str, args: list[str], limits: Limits, slot: int,
                   started: subprocess.Popen | None = None) -> RunOutcome:
        """Run Python `code` (argv `args`) isolated as slot `slot`, in `started` (from prestart with the same
        python and limits apart from wall_s) if it is still waiting, else in a sandbox started now."""
        if started is None or started.poll() is not None:
            if started is not None:
                self.discard(started)
            started = self.prestart(python, limits, slot)
        program = marshal.dumps((code, list(args)))
        return self._collect(started, limits, UID_BASE + slot, time.monotonic(), program)

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
        proc = subprocess.Popen(self.argv(command, limits, UID_BASE + slot), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        return self._collect(proc, limits, UID_BASE + slot, start, stdin)

    def _collect(self, proc: subprocess.Popen, limits: Limits, uid: int, start: float, stdin: bytes) -> RunOutcome:
        """Feed `stdin`, then read bounded output until exit, the wall clock or the output bound."""
        deadline = start + limits.wall_s
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
        return RunOutcome(code, bytes(out), bytes(err), timed_out, exceeded, wall_ms, peak_tasks)

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
