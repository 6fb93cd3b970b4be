"""The trial driver: record one workload through `core.powercut`, cut its operation log at many points,
build seeded crash images there, run recovery on each and collect what the case's properties say.

A case is an object with
    name                              short name for reports
    run(live, rec, seed)              the workload, writing under `live`; rec.mark(x) after each acknowledgement
    new_state() / note(state, mark)   what the marks before a cut promise (folded in order)
    check(image, state) -> problems   recover from `image` and list violations as (kind, detail)
Kinds: "lost" (something acknowledged is not there, including a catalog row whose shard is gone or
damaged), "refused" (recovery raised on a state that only lost unacknowledged data), "wrong" (data that
was never written, or a file that is not whole).
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from core import powercut

KINDS = ("lost", "refused", "wrong")


def scratch_root() -> Path:
    """Where live files and crash images go: a tmpfs when there is one (nothing here needs a real disk)."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def image_seed(trial_seed: int, cut: int, k: int) -> int:
    """The seed of the k-th image at `cut` of the trial `trial_seed` (one exact crash state)."""
    return (trial_seed * 1_000_003 + cut) * 16 + k


@dataclass
class Outcome:
    case: str
    trials: int = 0
    ops: int = 0
    cuts: int = 0  # crash images checked
    recovery_cuts: int = 0  # of those, images of a cut during recovery from another image
    problems: Counter = field(default_factory=Counter)  # kind -> images with at least one problem of it
    styles: Counter = field(default_factory=Counter)
    first: list = field(default_factory=list)  # the first few failures: (trial seed, cut, image seed, kind, detail)
    record_s: float = 0.0
    check_s: float = 0.0

    @property
    def failed(self) -> int:
        return sum(self.problems.values())

    def add(self, other: "Outcome") -> None:
        for k in ("trials", "ops", "cuts", "recovery_cuts", "record_s", "check_s"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.problems.update(other.problems)
        self.styles.update(other.styles)
        self.first.extend(other.first[:max(0, 5 - len(self.first))])

    def to_json(self) -> dict:
        return {"trials": self.trials, "operations": self.ops, "cuts": self.cuts, "recovery_cuts": self.recovery_cuts,
                "images_with_problems": {k: self.problems.get(k, 0) for k in KINDS}, "styles": dict(self.styles),
                "record_s": round(self.record_s, 2), "check_s": round(self.check_s, 2),
                "first_failures": [list(f) for f in self.first]}


def run_trial(case, seed: int, *, cuts: int | None = None, images: int = 1, recovery_cuts: int = 0,
              workdir: Path | None = None) -> Outcome:
    """One recorded workload of `case`; `cuts` points of its log (all when None), `images` crash images
    each; for `recovery_cuts` > 0, recovery from some images is itself recorded and cut that many times."""
    out = Outcome(case.name, trials=1)
    base = Path(tempfile.mkdtemp(prefix=f"powercut-{case.name}-", dir=workdir or scratch_root()))
    try:
        t0 = time.perf_counter()
        live = base / "live"
        with powercut.recording(live) as rec:
            case.run(live, rec, seed)
        out.record_s = time.perf_counter() - t0
        out.ops = len(rec.ops)
        t0 = time.perf_counter()
        _cut_all(case, seed, rec, base, out, cuts, images, recovery_cuts)
        out.check_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def _cut_all(case, seed, rec, base: Path, out: Outcome, cuts, images, recovery_cuts) -> None:
    n = len(rec.ops)
    rng = random.Random(seed)
    span = range(rec.start, n + 1)
    points = list(span) if cuts is None or cuts >= len(span) else sorted(rng.sample(span, cuts))
    replay = powercut.Replay(rec.ops)
    state = case.new_state()
    marks, mi = rec.marks, 0
    image = base / "image"
    for cut in points:
        replay.advance(cut)
        while mi < len(marks) and marks[mi][0] <= cut:
            case.note(state, marks[mi][1])
            mi += 1
        for k in range(images):
            s = image_seed(seed, cut, k)
            out.styles[replay.image(s, image)] += 1
            _judge(out, case, image, state, (seed, cut, s))
            if recovery_cuts and k == 0 and rng.random() < 0.25:
                _cut_recovery(case, image, state, base, out, (seed, cut, s), recovery_cuts, rng)
            shutil.rmtree(image)


def _judge(out: Outcome, case, image: Path, state, where: tuple) -> None:
    out.cuts += 1
    try:
        problems = case.check(image, state)
    except Exception as exc:  # a checker that cannot even look is a failure of the recovery it runs
        problems = [("refused", f"{type(exc).__name__}: {exc}")]
    for kind in {k for k, _ in problems}:
        out.problems[kind] += 1
    if problems and len(out.first) < 5:
        kind, detail = problems[0]
        out.first.append((*where, kind, detail[:300]))


def _cut_recovery(case, image: Path, state, base: Path, out: Outcome, where, count: int, rng) -> None:
    """Power fails again while recovery runs on `image`: record recovery, then check images of its cuts."""
    again = base / "again"
    shutil.copytree(image, again, symlinks=True)
    try:
        with powercut.recording(again) as rec:
            try:
                case.check(again, state)  # recovery (and the checks, which only read) on the copy
            except Exception:  # noqa: BLE001  (judged on the original image already)
                pass
        replay = powercut.Replay(rec.ops)
        span = range(rec.start, len(rec.ops) + 1)
        for cut in sorted(rng.sample(span, min(count, len(span)))):
            replay.advance(cut)
            img = base / "image2"
            s = where[2] * 7919 + cut
            out.styles[replay.image(s, img)] += 1
            out.recovery_cuts += 1
            _judge(out, case, img, state, (*where, "recovery", cut, s))
            shutil.rmtree(img)
    finally:
        shutil.rmtree(again, ignore_errors=True)


def reproduce(case, trial_seed: int, cut: int, seed: int, dest: Path) -> list[tuple]:
    """Record the workload of `trial_seed` again and write the crash image (cut, seed) of a reported
    failure under `dest`; returns the operation log. Exact where the workload's operations do not
    depend on thread timing (the WAL's retention and spare-segment threads can move a few)."""
    base = Path(tempfile.mkdtemp(prefix=f"powercut-{case.name}-", dir=scratch_root()))
    try:
        with powercut.recording(base / "live") as rec:
            case.run(base / "live", rec, trial_seed)
        powercut.image(rec.ops, cut, seed, dest)
        return rec.ops
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_trials(case, seeds, **kwargs) -> Outcome:
    total = Outcome(case.name, trials=0)
    for seed in seeds:
        total.add(run_trial(case, seed, **kwargs))
    return total
