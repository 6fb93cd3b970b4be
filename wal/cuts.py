"""Repair cuts: the records an open with repair=True dropped, kept dropped on every later open.

A trajectory with a hole (records lost to corruption in the middle of the log) opens under repair as
its contiguous prefix; the records past the hole stay in their segments. The writer then goes on from
the prefix, and its new records take the same positions with other tokens. Replayed again, the old
records would contradict the new ones and the log could not be opened. So before a repaired log takes
an append, each cut is written to `repaired.json` in the log directory (atomically, synced):
trajectory, kept length, last lsn cut. A token record of that trajectory at or past the kept length
with an lsn up to the cut's is dead: replay skips it and retention never copies it forward (a copy
would take a new lsn and escape the cut).
"""
from __future__ import annotations

import json
from pathlib import Path

from core.atomic import write_atomic
from wal.errors import CorruptionError

FILE_NAME = "repaired.json"

Cuts = dict[str, list[tuple[int, int]]]  # trajectory -> [(kept length, last lsn cut)]


def read(directory: Path) -> Cuts:
    """The cuts recorded in `directory` (none when the file is absent); CorruptionError when it does not parse."""
    path = Path(directory) / FILE_NAME
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise CorruptionError(f"repair cuts {path}: not JSON ({exc})") from None
    out: Cuts = {}
    try:
        for traj_id, kept, lsn in doc["cuts"]:
            if type(traj_id) is not str or type(kept) is not int or type(lsn) is not int or kept < 0 or lsn < 0:
                raise TypeError
            out.setdefault(traj_id, []).append((kept, lsn))
    except (KeyError, TypeError, ValueError):
        raise CorruptionError(f"repair cuts {path}: want {{\"cuts\": [[trajectory, kept length, lsn], ...]}}") from None
    return out


def write(directory: Path, cuts: Cuts) -> None:
    """Replace the cuts file with `cuts`, durably."""
    rows = [[t, kept, lsn] for t, pairs in sorted(cuts.items()) for kept, lsn in pairs]
    write_atomic(Path(directory) / FILE_NAME, json.dumps({"cuts": rows}).encode())


def is_cut(cuts: Cuts, traj_id: str, start: int, lsn: int) -> bool:
    """Whether a token record of `traj_id` at `start` with `lsn` was dropped by a repair."""
    return any(start >= kept and lsn <= last for kept, last in cuts.get(traj_id, ()))
