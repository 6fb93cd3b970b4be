"""A benchmark's command line refuses counts, durations and lists that describe no measurement when it
is parsed (exit 2, the option named), before any work: `bench wal --rounds 0` used to run for minutes
and end in a statistics error, `--bs 0` in a database error."""
from __future__ import annotations

import argparse
import importlib

import pytest

from core.cli_args import nonneg_ints, positive_float, positive_int, positive_ints

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


def test_the_types_take_what_describes_a_measurement():
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5
    assert positive_ints("1, 64,512") == [1, 64, 512] and nonneg_ints("0,1") == [0, 1]
    for bad in ("0", "-2", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    for bad in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(bad)
    for bad in (",", "1,1", "1,0"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ints(bad)
