"""Simulated power cuts (core.powercut) on the data plane's put: after every cut, each shard the catalog
may show (its insert transaction had started) exists, matches the catalog's file checksum and its rows'
checksums. Builds without the shard file's fsync, or without the parent fsync of a directory makedirs
creates (a new run's shard directory), are caught."""
from __future__ import annotations

import pytest

from bench._power_loss import canaries
from bench._power_loss.cases import DEFAULT_TRIALS
from bench._power_loss.plane_case import PlaneCase
from bench._power_loss.trials import run_trial, run_trials


@pytest.mark.parametrize("seed", DEFAULT_TRIALS["dataplane"]["seeds"])
def test_put_power_cuts(seed):
    out = run_trial(PlaneCase(), seed, cuts=DEFAULT_TRIALS["dataplane"]["cuts"], recovery_cuts=2)
    assert out.cuts > 100 and out.failed == 0, out.first


@pytest.mark.parametrize("name", ["shard_file_fsync", "makedirs_parent_fsync"])
def test_a_missing_sync_is_caught(name):
    canary = next(c for c in canaries.EXTRA if c.name == name)
    with canary.applied():
        out = run_trials(PlaneCase(), DEFAULT_TRIALS["dataplane"]["seeds"], cuts=DEFAULT_TRIALS["dataplane"]["cuts"])
    assert out.problems["lost"] > 0, out.first


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 115))
def test_put_many_workloads(seed):
    out = run_trial(PlaneCase(puts=20), seed, images=3, recovery_cuts=4)
    assert out.failed == 0, out.first
