"""Processes of this host."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts: it exists, we may not signal it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
