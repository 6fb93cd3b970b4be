"""Simulated power cuts (core.powercut) on the data plane's put: after every cut, each shard the catalog
may show (its insert transaction had started) exists, matches the catalog's file checksum and its rows'
checksums. Builds without the shard file's fsync, or without the parent fsync of a directory makedirs
creates (a new run's shard directory), are caught."""
from __future__ import annotations

import pytest

from bench._power_loss import canaries
from bench._power_loss.cases import run_default
from bench._power_loss.plane_case import PlaneCase
from bench._power_loss.trials import run_trial


def test_put_power_cuts():
    out = run_default("dataplane", recovery_cuts=2)
    assert out.cuts > 200 and out.recovery_cuts > 0 and out.failed == 0, out.first


@pytest.mark.parametrize("canary", [c for c in canaries.EXTRA if c.case == "dataplane"], ids=lambda c: c.name)
def test_a_missing_sync_is_caught(canary):
    assert run_default("dataplane", canary=canary).problems["lost"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 115))
def test_put_many_workloads(seed):
    out = run_trial(PlaneCase(puts=20), seed, images=3, recovery_cuts=4)
    assert out.failed == 0, out.first
