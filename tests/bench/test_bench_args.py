"""A benchmark's command line refuses counts, durations and lists that describe no measurement when it
is parsed (exit 2, the option named), before any work, not minutes later as a statistics or database
error."""
from __future__ import annotations

import importlib

import pytest

BAD = [
    ("bench.wal", ["--rounds", "0"], "--rounds"),
    ("bench.wal", ["--seconds", "-1"], "--seconds"),
    ("bench.wal", ["--seconds", "nan"], "--seconds"),
    ("bench.wal", ["--bs", "0"], "--bs"),
    ("bench.wal", ["--bs", "64"], "the targets need 64 and 512"),
    ("bench.wal", ["--bs", "64,512,64"], "--bs"),
    ("bench.grpo", ["--steps", "0"], "--steps"),
    ("bench.rollout", ["--parts", "decode,foo"], "--parts"),
    ("bench.opd_merge", ["--budget-s", "0"], "--budget-s"),
    ("bench.opd_merge", ["--seeds", "-1"], "--seeds"),
    ("bench.dataplane", ["--ranks", "0"], "--ranks"),
    ("bench.cluster", ["--streams", "x"], "--streams"),
    ("bench.sandbox", ["--pairs", "0"], "--pairs"),
    ("bench.power_loss", ["--cuts", "0"], "--cuts"),
    ("bench.drill", ["--sft-steps", "0"], "--sft-steps"),
    ("bench.wal_grpc_floor", ["--rounds", "0"], "--rounds"),
]


@pytest.mark.parametrize("module, argv, says", BAD, ids=[f"{m} {' '.join(a)}" for m, a, _ in BAD])
def test_a_command_line_that_describes_no_measurement_is_refused_when_parsed(module, argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
