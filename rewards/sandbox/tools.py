"""The tools the sandbox serves, and how a raw isolated run becomes a ToolOutcome with a reason.

    calc     the bounded calculator (`rewards.calculator`), run isolated in a fresh interpreter
    python   a short Python snippet (stdin-free, stdlib only), run isolated
    counter  deliberately non-idempotent: increments a counter kept in the service's state dir (out of
             any sandbox's reach); `counter: NAME [HOLD_MS]` holds HOLD_MS before incrementing, so a
             test can crash the service mid-call
"""
from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import rewards.calculator
from core.atomic import write_atomic
from rewards.sandbox import types as T
from rewards.sandbox.isolation import PIPE_BYTES, Isolator, encode_program
from rewards.sandbox.types import Limits, RunOutcome, ToolOutcome

TOOLS = ("calc", "python", "counter")
TOOL_NAME_RE = re.compile(r"[a-z_]{1,32}")  # as in rewards.protocol
MAX_ARGS_CHARS = {"calc": rewards.calculator.MAX_EXPR_CHARS, "python": 16384, "counter": 64}
MAX_HOLD_MS = 10_000
_COUNTER_RE = re.compile(r"([a-z0-9_]{1,32})(?:\s+(\d{1,5}))?")
_CALC_EXIT_ERROR = 3

# Runs inside the sandbox: runs the source of rewards/calculator.py, handed over with the call (the
# sandbox needs no view of the repository, and not the `rewards` package, whose __init__ pulls every
# domain), and prints the value, or the CalcError on stdout with exit code 3.
_CALC_SOURCE = Path(rewards.calculator.__file__).read_text()
_CALC_ENTRY = (
    "import sys\n"
    "ns = {'__name__': 'calculator'}\n"
    "exec(compile(sys.argv[1], 'calculator.py', 'exec'), ns)\n"
    "try:\n"
    "    print(ns['calculate'](sys.argv[2]))\n"
    "except ns['CalcError'] as exc:\n"
    "    print(exc)\n"
    "    sys.exit(3)\n"
)


def calc_program(expr: str) -> tuple[str, list[str]]:
    """(code, argv) of the calculator tool for interpreter flags -I -S (fresh, stdlib only)."""
    return _CALC_ENTRY, [_CALC_SOURCE, expr]


def calc_command(python: str, expr: str) -> list[str]:
    """The same calculator as one command line (what the benchmark's plain subprocess baseline runs)."""
    code, argv = calc_program(expr)
    return [python, "-I", "-S", "-c", code, *argv]


def check_args(tool: str, args: str) -> str | None:
    """None if `tool` exists and `args` is acceptable input for it, else why not (the tool does not run)."""
    if tool not in TOOLS:
        return f"unknown tool {tool[:32]!r}; known: {', '.join(TOOLS)}"
    if tool == "calc" and (len(args) > MAX_ARGS_CHARS[tool] or "\x00" in args):
        try:  # the calculator's own words, which a verifier recomputing the call expects
            rewards.calculator.calculate(args)
        except rewards.calculator.CalcError as exc:
            return str(exc)
    if len(args) > MAX_ARGS_CHARS[tool]:
        return f"args of {tool} longer than {MAX_ARGS_CHARS[tool]} chars ({len(args)})"
    if "\x00" in args:
        return "args contain a NUL character"
    if tool == "python":  # characters bound the source; the sandbox's stdin bounds its bytes
        size = len(encode_program(args, []))
        if size > PIPE_BYTES:
            return f"args of python are {size} bytes encoded; the limit is {PIPE_BYTES}"
    if tool == "counter":
        m = _COUNTER_RE.fullmatch(args.strip())
        if m is None:
            return "counter args must be 'NAME [HOLD_MS]' with NAME in [a-z0-9_]{1,32}"
        if m.group(2) and int(m.group(2)) > MAX_HOLD_MS:
            return f"counter HOLD_MS above {MAX_HOLD_MS}"
    return None


def _last_line(data: bytes, limit: int = 300) -> str:
    lines = [ln for ln in data.decode("utf-8", errors="replace").strip().splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def classify(run: RunOutcome, limits: Limits) -> tuple[str, str]:
    """(error_kind, reason) of an isolated run; ("", "") if it exited 0 within every bound.

    The output bound, the wall clock, the out-of-memory kills of the execution's cgroup and the task census
    are observed by the service. The rest is read from what the tool did, its exit status and its stderr,
    which the tool controls: a tool can make its own failure read as a limit it did not hit."""
    err = run.stderr.decode("utf-8", errors="replace")
    fork_failed = ("BlockingIOError" in err or "Resource temporarily unavailable" in err
                   or run.peak_tasks >= limits.processes)
    if run.output_exceeded:
        return T.OUTPUT_LIMIT, f"output above {limits.output_bytes} bytes: process tree killed"
    if run.oom_kills:
        return T.MEMORY_LIMIT, (f"execution memory limit {limits.memory_bytes} bytes (all its processes and /tmp): "
                                f"the kernel killed {run.oom_kills} process{'es' if run.oom_kills > 1 else ''}")
    if run.timed_out:
        if fork_failed:
            return T.PROCESS_LIMIT, f"hit the process limit ({limits.processes}); killed at the wall clock ({limits.wall_s:g}s)"
        return T.TIMEOUT, f"wall clock {limits.wall_s:g}s exceeded: process tree killed"
    if run.exit_code == -signal.SIGXCPU:
        return T.CPU_LIMIT, f"CPU time limit {limits.cpu_s}s exceeded (SIGXCPU)"
    if run.exit_code == -signal.SIGXFSZ:
        return T.FILE_SIZE_LIMIT, f"file size limit {limits.file_size_bytes} bytes exceeded (SIGXFSZ)"
    if run.exit_code < 0:
        return T.KILLED, f"killed by {signal.Signals(-run.exit_code).name}"
    if run.exit_code == 0:
        return "", ""
    last = _last_line(run.stderr)
    if "MemoryError" in err:
        return T.MEMORY_LIMIT, f"address space limit {limits.address_space_bytes} bytes: {last}"
    if fork_failed:
        return T.PROCESS_LIMIT, f"process limit {limits.processes}: {last}"
    if "File too large" in err or "No space left on device" in err:
        return T.FILE_SIZE_LIMIT, f"file size limit {limits.file_size_bytes} bytes / tmp {limits.tmp_bytes} bytes: {last}"
    return T.TOOL_ERROR, last or f"exit code {run.exit_code}"


class Toolbox:
    """Runs one tool call. Isolated tools go through `isolator` as execution slot `slot`."""

    def __init__(self, state_dir: Path, isolator: Isolator | None, limits: Limits, python: str, slots: int = 0,
                 isolate_pure: bool = True, first_slot: int = 0):
        self.isolate_pure = isolate_pure
        self.counter_dir = Path(state_dir) / "counters"
        self.counter_dir.mkdir(parents=True, exist_ok=True)
        self.isolator = isolator
        self.limits = limits
        self.python = python
        self._counter_lock = threading.Lock()
        # One pre-started Python sandbox per execution slot: it boots while no call needs it and runs
        # exactly one program (a fresh sandbox every call); the slot's owner replaces it after use.
        self._ready: dict[int, subprocess.Popen] = {}
        self.warm_slots = slots if isolator is not None else 0
        self._closed = False
        if isolator is not None:
            for slot in range(first_slot, first_slot + slots):
                self._ready[slot] = isolator.prestart(python, limits, slot)

    def close(self) -> None:
        """Kill the pre-started sandboxes (and start no more)."""
        self._closed = True
        while self._ready:
            _, proc = self._ready.popitem()
            self.isolator.discard(proc)

    def _run_python(self, code: str, args: list[str], limits: Limits, slot: int) -> RunOutcome:
        started = self._ready.pop(slot, None)
        try:
            return self.isolator.run_python(self.python, code, args, limits, slot, started)
        finally:
            if slot < self.warm_slots and not self._closed:  # keep the slot warm for its next call
                self._ready[slot] = self.isolator.prestart(self.python, self.limits, slot)

    def read_counter(self, name: str) -> int:
        path = self.counter_dir / name
        return int(path.read_text()) if path.exists() else 0

    def run(self, tool: str, args: str, timeout_ms: int, slot: int) -> ToolOutcome:
        reason = check_args(tool, args)
        if reason is not None:
            return ToolOutcome(False, "", T.TOOL_ERROR, reason)
        limits = self.limits
        if timeout_ms:
            limits = limits._replace(wall_s=min(limits.wall_s, timeout_ms / 1000))
        if tool == "counter":
            return self._counter(args, limits)
        if tool == "calc" and (self.isolator is None or not self.isolate_pure):
            try:  # pure and bounded: the same answer as the isolated run, minus the process
                return ToolOutcome(True, str(rewards.calculator.calculate(args)))
            except rewards.calculator.CalcError as exc:
                return ToolOutcome(False, "", T.TOOL_ERROR, str(exc))
        if self.isolator is None:  # only with require_isolation=false
            return ToolOutcome(False, "", T.TOOL_ERROR, f"the {tool} tool needs bubblewrap, which this service lacks")
        if tool == "calc":
            run = self._run_python(*calc_program(args), limits, slot)
            out = run.stdout.decode("utf-8", errors="replace").strip()
            if run.exit_code == _CALC_EXIT_ERROR and not (run.timed_out or run.output_exceeded):
                return ToolOutcome(False, "", T.TOOL_ERROR, out[:300], run.exit_code, run.wall_ms)
        else:
            run = self._run_python(args, [], limits, slot)
            out = run.stdout.decode("utf-8", errors="replace")
        kind, reason = classify(run, limits)
        return ToolOutcome(not kind, out, kind, reason, run.exit_code, run.wall_ms)

    def _counter(self, args: str, limits: Limits) -> ToolOutcome:
        start = time.monotonic()
        m = _COUNTER_RE.fullmatch(args.strip())
        name, hold_ms = m.group(1), int(m.group(2) or 0)
        if hold_ms / 1000 > limits.wall_s:
            return ToolOutcome(False, "", T.TIMEOUT, f"hold {hold_ms} ms exceeds the wall clock {limits.wall_s:g}s")
        time.sleep(hold_ms / 1000)
        with self._counter_lock:
            value = self.read_counter(name) + 1
            write_atomic(self.counter_dir / name, str(value).encode())
        return ToolOutcome(True, str(value), wall_ms=int((time.monotonic() - start) * 1000))
