"""Simulated power cuts (core.powercut) on learner checkpoints: after every cut each visible iteration
verifies, every acknowledged one is there with its digests, and `latest` finds the last save (or the
one in flight). A build that skips the files' fsync is caught; so is re-saving an iteration with two
renames instead of one atomic exchange (the acknowledged iteration is under neither name between them)."""
from __future__ import annotations

import pytest

from bench._power_loss import canaries
from bench._power_loss.cases import run_default
from bench._power_loss.checkpoint_case import CheckpointCase
from bench._power_loss.trials import run_trial, run_trials
from core import fileio


def test_checkpoint_power_cuts():
    out = run_default("checkpoint", recovery_cuts=2)
    assert out.cuts > 100 and out.recovery_cuts > 0 and out.failed == 0, out.first


@pytest.mark.parametrize("canary", [c for c in canaries.EXTRA if c.case == "checkpoint"], ids=lambda c: c.name)
def test_unsynced_checkpoint_files_are_caught(canary):
    assert run_default("checkpoint", canary=canary).failed > 0


def test_resaving_with_two_renames_loses_the_iteration_in_between(monkeypatch):
    def unavailable(a, b):
        raise OSError(38, "renameat2 unavailable (simulated)")

    monkeypatch.setitem(fileio.DEFAULT, "exchange", unavailable)  # the recorder calls the real operation from here
    out = run_trials(CheckpointCase(), range(3))
    assert out.problems["lost"] > 0, "between the two renames the acknowledged iteration is under neither name"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 106))
def test_checkpoint_many_workloads(seed):
    out = run_trial(CheckpointCase(saves=6), seed, images=3, recovery_cuts=4)
    assert out.failed == 0, out.first
