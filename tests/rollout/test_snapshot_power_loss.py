"""Simulated power cuts (core.powercut) on KV snapshots: after every cut each trajectory's snapshot is a
whole one that was put (and loads) or absent (and load rejects it as missing), and an acknowledged put
with nothing started since is there. A build whose atomic write skips the temp file's fsync is caught."""
from __future__ import annotations

import pytest

from bench._power_loss import canaries
from bench._power_loss.cases import run_default
from bench._power_loss.snapshot_case import SnapshotCase
from bench._power_loss.trials import run_trial


def test_snapshot_power_cuts():
    out = run_default("snapshot", recovery_cuts=2)
    assert out.cuts > 150 and out.recovery_cuts > 0 and out.failed == 0, out.first


@pytest.mark.parametrize("canary", [c for c in canaries.EXTRA if c.case == "snapshot"], ids=lambda c: c.name)
def test_an_unsynced_atomic_write_is_caught(canary):
    assert run_default("snapshot", canary=canary).problems["wrong"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 110))
def test_snapshot_many_workloads(seed):
    out = run_trial(SnapshotCase(ops=50), seed, images=3, recovery_cuts=4)
    assert out.failed == 0, out.first
