"""powercut: simulated power cuts for code that writes through `core.fileio`.

    disk.py       the disk model (pure): durable state, unsynced operations, seeded crash images
    recorder.py   Recorder: the fileio backend that does each operation for real and logs it

Use: record a workload, then build crash images at any points of its operation log and run recovery
on each::

    with powercut.recording(live_dir) as rec:
        ...                                   # the workload; rec.mark(x) after each acknowledgement
    replay = powercut.Replay(rec.ops)
    for cut in sorted(cuts):
        replay.advance(cut)                   # the state after rec.ops[:cut]
        replay.image(seed, fresh_dir)         # one state a power cut there could leave (seeded)
        ...                                   # recover from fresh_dir, check what rec.marks promised
"""
from __future__ import annotations

import contextlib

from core import fileio
from core.powercut.disk import SECTOR, STYLES, Disk, write_tree
from core.powercut.recorder import OutsideLayerError, Recorder

__all__ = ["Disk", "OutsideLayerError", "Recorder", "Replay", "SECTOR", "STYLES", "image", "recording"]


@contextlib.contextmanager
def recording(root):
    """Record every fileio operation under `root` (created if missing) while the block runs."""
    rec = Recorder(root)
    with fileio.using(rec):
        yield rec


class Replay:
    """The disk model fed an operation log up to a point; crash images of that point."""

    def __init__(self, ops: list[tuple]):
        self.ops = ops
        self.disk = Disk()
        self.at = 0

    def advance(self, cut: int) -> None:
        """Apply operations until the state after ops[:cut] (cuts only move forward)."""
        if cut < self.at or cut > len(self.ops):
            raise ValueError(f"cannot move from operation {self.at} to {cut} (log of {len(self.ops)})")
        apply, ops = self.disk.apply, self.ops
        while self.at < cut:
            apply(ops[self.at])
            self.at += 1

    def image(self, seed: int, dest) -> str:
        """Write one crash image of the current point under `dest` (must not exist); returns its style."""
        style, tree = self.disk.crash_image(seed)
        write_tree(tree, dest)
        return style


def image(ops: list[tuple], cut: int, seed: int, dest) -> str:
    """The crash image of (operation log, cut, seed) under `dest`: the same three give the same bytes."""
    replay = Replay(ops)
    replay.advance(cut)
    return replay.image(seed, dest)
