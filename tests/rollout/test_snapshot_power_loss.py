"""Simulated power cuts (core.powercut) on KV snapshots: after every cut each trajectory's snapshot is a
whole one that was put (and loads) or absent (and load rejects it as missing), and an acknowledged put
with nothing started since is there. A build whose atomic write skips the temp file's fsync is caught."""
from __future__ import annotations

import pytest

from bench._power_loss import canaries
from bench._power_loss.cases import DEFAULT_TRIALS
from bench._power_loss.snapshot_case import SnapshotCase
from bench._power_loss.trials import run_trial, run_trials


@pytest.mark.parametrize("seed", DEFAULT_TRIALS["snapshot"]["seeds"])
def test_snapshot_power_cuts(seed):
    out = run_trial(SnapshotCase(), seed, cuts=DEFAULT_TRIALS["snapshot"]["cuts"], recovery_cuts=2)
    assert out.cuts > 80 and out.failed == 0, out.first


def test_an_unsynced_atomic_write_is_caught():
    canary = next(c for c in canaries.EXTRA if c.name == "atomic_file_fsync")
    with canary.applied():
        out = run_trials(SnapshotCase(), DEFAULT_TRIALS["snapshot"]["seeds"], cuts=DEFAULT_TRIALS["snapshot"]["cuts"])
    assert out.problems["wrong"] > 0, out.first


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 110))
def test_snapshot_many_workloads(seed):
    out = run_trial(SnapshotCase(ops=50), seed, images=3, recovery_cuts=4)
    assert out.failed == 0, out.first
