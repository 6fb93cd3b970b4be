"""core.cli_args: the argparse types take counts, durations and lists that describe work, and refuse the
rest with a message argparse prints after the option's name."""
from __future__ import annotations

import argparse

import pytest

from core.cli_args import nonneg_ints, positive_float, positive_int, positive_ints, run_name, run_name_problem


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


def test_a_run_name_is_one_directory_under_the_runs_directory():
    for good in ("default", "seed1", "calc-v2.1_b"):
        assert run_name(good) == good and run_name_problem(good) is None
    for bad in ("", ".", "..", "../x", "a/b", "/abs", ".hidden", "a b", "x" * 129, "naïve"):
        assert run_name_problem(bad)
        with pytest.raises(argparse.ArgumentTypeError):
            run_name(bad)
