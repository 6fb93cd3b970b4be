"""The cases by name, and their default trials: what the default test suite runs, and what a canary
must be caught within."""
from __future__ import annotations

import contextlib

CASES = ("wal", "envlog", "dataplane", "snapshot", "checkpoint")

# seeds: recorded workloads (the WAL case's seeds 0, 1, 2 are its three segment configurations);
# cuts: points of each operation log, drawn at random (None: every one), one crash image each
DEFAULT_TRIALS = {
    "wal": {"seeds": range(3), "cuts": 150},
    "envlog": {"seeds": range(2), "cuts": None},
    "dataplane": {"seeds": range(2), "cuts": None},
    "snapshot": {"seeds": range(2), "cuts": None},
    "checkpoint": {"seeds": range(1), "cuts": None},
}


def make_case(name: str):
    """A case object (imports its package only when asked: the WAL cases need no torch)."""
    if name == "wal":
        from bench._power_loss.wal_cases import TokenCase

        return TokenCase()
    if name == "envlog":
        from bench._power_loss.wal_cases import EnvCase

        return EnvCase()
    if name == "dataplane":
        from bench._power_loss.plane_case import PlaneCase

        return PlaneCase()
    if name == "snapshot":
        from bench._power_loss.snapshot_case import SnapshotCase

        return SnapshotCase()
    if name == "checkpoint":
        from bench._power_loss.checkpoint_case import CheckpointCase

        return CheckpointCase()
    raise ValueError(f"unknown power-loss case {name!r}; known: {', '.join(CASES)}")


def run_default(name: str, canary=None, **kwargs):
    """The default trials of case `name` (Outcome), in the build of `canary` when one is given."""
    from bench._power_loss.trials import run_trials

    spec = DEFAULT_TRIALS[name]
    with canary.applied() if canary is not None else contextlib.nullcontext():
        return run_trials(make_case(name), spec["seeds"], cuts=spec["cuts"], **kwargs)
