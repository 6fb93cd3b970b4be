"""One process at a time in a run directory: an exclusive `flock` on DIR/.lock, held until the process exits.

Two pipelines, or two `postrain grpo` / `opd` runs, in one directory would delete and overwrite each
other's stages, checkpoints and metrics. The lock is non-blocking: the second one fails at once, naming
the process that holds it. The kernel drops the lock when its holder dies (also on SIGKILL), so a killed
run leaves nothing to clean up. A pipeline locks its run directory; its stages run as child processes that
lock their own output directories below it (the lock file is not inherited: Python opens it close-on-exec).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from core.errors import UserError

NAME = ".lock"


def lock_run_dir(path: str | Path):
    """Create `path` if needed and lock it for this process; the returned file holds the lock (keep it
    open for the whole run). Raises UserError "run directory DIR is in use (pid N)" when another holds it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    f = open(path / NAME, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise UserError(f"run directory {path} is in use (pid {holder})") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f
