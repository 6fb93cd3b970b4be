"""Records and limits of the tool sandbox: what an isolated run returns and what bounds it."""
from __future__ import annotations

import re
from typing import NamedTuple

# Error kinds of a ToolResult (the `error_kind` field); "" means the call succeeded.
TOOL_ERROR = "tool_error"            # the tool ran and failed (non-zero exit, calculator error, bad args)
TIMEOUT = "timeout"                  # wall-clock limit: the whole process tree was killed
CPU_LIMIT = "cpu_limit"              # RLIMIT_CPU
MEMORY_LIMIT = "memory_limit"        # RLIMIT_AS, or the execution's memory cgroup
PROCESS_LIMIT = "process_limit"      # RLIMIT_NPROC (fork bomb)
FILE_SIZE_LIMIT = "file_size_limit"  # RLIMIT_FSIZE or the tmpfs size
OUTPUT_LIMIT = "output_limit"        # stdout/stderr beyond the bound: killed
KILLED = "killed"                    # died of another signal

SANDBOX_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_SEQ = 2**62


class Limits(NamedTuple):
    """Bounds of one isolated execution. Every field is a hard limit enforced by the kernel or the runner."""

    wall_s: float = 5.0                # wall clock; then SIGKILL of the whole process tree
    cpu_s: int = 4                     # RLIMIT_CPU (seconds of CPU per process)
    address_space_bytes: int = 1 << 30  # RLIMIT_AS per process
    processes: int = 32                # RLIMIT_NPROC for the execution's own uid
    file_size_bytes: int = 8 << 20     # RLIMIT_FSIZE: largest file it may write
    tmp_bytes: int = 32 << 20          # size of its private /tmp (tmpfs)
    output_bytes: int = 64 << 10       # stdout and stderr each; beyond: killed, output_limit
    memory_bytes: int = 0              # the whole execution's memory (a cgroup, where there is one); 0: none


class RunOutcome(NamedTuple):
    """What one isolated process tree did."""

    exit_code: int          # >= 0 exit status; -N: killed by signal N
    stdout: bytes           # at most Limits.output_bytes
    stderr: bytes
    timed_out: bool
    output_exceeded: bool
    wall_ms: int
    peak_tasks: int = 0     # most tasks seen under the execution's uid (sampled every 0.1 s; root only)
    oom_kills: int = 0      # processes the kernel killed for the execution's memory cgroup (read by the service)


class ToolOutcome(NamedTuple):
    """A tool's answer before it is encoded into the wire/log record (sandbox.proto ToolResult)."""

    ok: bool
    output: str
    error_kind: str = ""
    error: str = ""
    exit_code: int = 0
    wall_ms: int = 0


def valid_sandbox_id(sandbox_id: str) -> bool:
    return isinstance(sandbox_id, str) and SANDBOX_ID_RE.fullmatch(sandbox_id) is not None
