"""The data plane benchmark's select + plan part runs in child processes: each child gets a command line
its parser accepts, and a child that fails makes the benchmark fail (exit 1, the part named) instead of
recording unmet targets."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dataplane.conftest import _pg_reachable

ROOT = Path(__file__).resolve().parents[2]
PG = "postgresql://postgres@127.0.0.1:5432/test"


def _run(tmp_path: Path, pg: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.dataplane", "--json", "--only", "select_plan", "--n-1m", "2000",
           "--repeats-1m", "1", "--pg", pg, "--dir", str(tmp_path)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_select_plus_plan_runs_on_both_catalogs(tmp_path):
    reason = _pg_reachable()
    if reason:
        pytest.skip(reason)
    res = _run(tmp_path, PG)
    assert res.returncode == 0, res.stderr[-2000:]
    targets = json.loads(res.stdout.strip().splitlines()[-1])["targets"]
    for name in ("sqlite", "postgresql"):
        value = targets[f"select_plus_plan_1m_s_{name}"]["value"]
        assert value is not None and value > 0


def test_a_failed_child_fails_the_benchmark_and_names_the_part(tmp_path):
    res = _run(tmp_path, "postgresql://postgres@127.0.0.1:1/none")  # nothing listens on port 1
    assert res.returncode == 1
    assert "select + plan on postgresql" in res.stderr
    assert "select + plan on sqlite" not in res.stderr
