"""argparse types the command lines share: a count, a duration or a list that cannot describe the work
asked for (0 iterations, 0 rounds, a negative budget, a batch of 0) is refused when the command is
parsed, with the option's name, not after a Ray cluster started or minutes later as a statistics or
database error."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def nonneg_int(text: str) -> int:
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return n


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not x > 0 or x == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return x


def positive_ints(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1, at least one, none repeated."""
    return _ints(text, positive_int)


def nonneg_ints(text: str) -> list[int]:
    """Comma-separated whole numbers >= 0 (seeds), at least one, none repeated."""
    return _ints(text, nonneg_int)


def _ints(text: str, each) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must list at least one whole number, got {text!r}")
    out = [each(t) for t in items]
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"lists a number twice: {text!r}")
    return out


RUN_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def run_name_problem(text: str) -> str | None:
    """What is wrong with `text` as a run's name, or None: a name is one directory under the runs directory
    (letters, digits, '.', '_', '-'; not starting with '.'; at most 128 characters), so `--name ../x` or
    `--name ''` cannot put a run's files elsewhere."""
    if not 0 < len(text) <= 128 or text.startswith(".") or not set(text) <= RUN_NAME_CHARS:
        return (f"must be one directory name of letters, digits, '.', '_' and '-' (not starting with '.', at "
                f"most 128 characters), got {text!r}")
    return None


def run_name(text: str) -> str:
    problem = run_name_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
