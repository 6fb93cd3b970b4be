"""The best eval of a training run so far: early stopping (`loop.patience`) and `final/` = the best policy
(`loop.final = "best"`).

A policy whose eval beats every earlier one (ties keep the earlier) is saved as `OUT/best/it{k}/`. An older
best is deleted only once a checkpoint at or after the newer one is durable: a run resumed from its latest
checkpoint drops the bests saved after it (that part of the run is repeated) and still finds the best of
the evals before it on disk.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable

from core import fileio

_DIR = re.compile(r"^it(\d+)$")


class BestPolicy:
    def __init__(self, root: str | Path, *, save: bool, write: Callable[[Path], None]):
        """`write(dir)` saves the run's current policy (a new best's, or the last one for final/)."""
        self.root, self.save, self._write = Path(root), save, write
        self.iteration: int | None = None  # of the best eval so far
        self.pass_at_1 = float("-inf")
        self.evals_since = 0  # evals after the best one that did not beat it

    def resume(self, evals: list[tuple[int, float]], start: int) -> None:
        """Rebuild from the eval rows of iterations <= start (a run resumed from its checkpoint at `start`)."""
        for i, p in sorted(evals):
            if i <= start:
                self._observe(i, p)
        for i, path in self._saved():
            if i > start:
                shutil.rmtree(path)

    def observe(self, iteration: int, pass_at_1: float) -> bool:
        """One eval's result, its policy current; a new best's is saved when saving is on. True when it is a
        new best."""
        if not self._observe(iteration, pass_at_1):
            return False
        if self.save:
            tmp = self.root / f"it{iteration}.tmp"
            if tmp.exists():
                shutil.rmtree(tmp)
            self._write(tmp)
            dest = self.root / f"it{iteration}"
            if dest.exists():  # the same iteration saved by an attempt that was interrupted after it
                shutil.rmtree(dest)
            fileio.rename(tmp, dest)
            fileio.fsync_dir(self.root)
        return True

    def _observe(self, iteration: int, pass_at_1: float) -> bool:
        if pass_at_1 > self.pass_at_1:
            self.iteration, self.pass_at_1, self.evals_since = iteration, pass_at_1, 0
            return True
        self.evals_since += 1
        return False

    def after_checkpoint(self, iteration: int) -> None:
        """A checkpoint at `iteration` is durable: a run resumed from it needs the best as of it (the latest
        saved at or before it) and repeats everything after, so the bests before that one go."""
        covered = [(i, path) for i, path in self._saved() if i <= iteration]
        for _, path in covered[:-1]:
            shutil.rmtree(path)

    @property
    def value(self) -> float | None:
        """The best eval's score (None before any eval)."""
        return None if self.iteration is None else self.pass_at_1

    def exhausted(self, patience: int) -> bool:
        """`patience` evals in a row brought no new best (patience 0: never)."""
        return patience > 0 and self.evals_since >= patience

    def path(self) -> Path | None:
        """The saved policy of the best eval, when there is one."""
        if self.iteration is None:
            return None
        p = self.root / f"it{self.iteration}"
        return p if p.is_dir() else None

    def write_final(self, dest: Path) -> Path:
        """final/: a copy of the best eval's saved policy when saving is on and there is one, else the current
        (last) policy."""
        best = self.path() if self.save else None
        if best is None:
            self._write(dest)
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        return Path(shutil.copytree(best, dest))

    def _saved(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for entry in self.root.iterdir():
            m = _DIR.match(entry.name)
            if m and entry.is_dir():
                out.append((int(m.group(1)), entry))
            elif entry.name.endswith(".tmp"):
                shutil.rmtree(entry, ignore_errors=True)  # a save cut short
        return sorted(out)
