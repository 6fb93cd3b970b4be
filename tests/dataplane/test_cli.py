"""`postrain data stats|plan` as subprocesses; the shipped config parses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dataplane
from dataplane.config import DataPlaneFile
from core.config import load

from .conftest import make_records

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_shipped_config_parses():
    cfg = load(DataPlaneFile, ROOT / "configs" / "dataplane.toml").dataplane
    assert cfg.tokens_per_rank >= 1 and cfg.prefetch <= 8


def test_stats_and_plan(tmp_path):
    dp = dataplane.open(tmp_path / "c.db", tmp_path / "s")
    recs = make_records(50, max_len=400)
    dp.put(recs)
    dp.close()
    res = _cli("data", "stats", "--catalog", str(tmp_path / "c.db"), "--store", str(tmp_path / "s"), "--verify", "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["trajectories"] == 50 and st["tokens"] == sum(r.length for r in recs) and st["problems"] == []
    out = tmp_path / "plan.json"
    res = _cli("data", "plan", "--catalog", str(tmp_path / "c.db"), "--store", str(tmp_path / "s"), "--domain", "arith",
               "--tokens-per-rank", "300", "--ranks", "2", "--seed", "4", "--group-aware", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    plan = dataplane.Plan.from_json(json.loads(out.read_text()))
    assert summary["trajectories"] == 25 == plan.ids.shape[0] and plan.ranks == 2 and plan.group_aware
    assert summary["tokens"] == sum(r.length for r in recs if r.domain == "arith")
    assert sum(b.num_tokens for r in (0, 1) for b in dataplane.loader(plan, rank=r)) == summary["tokens"]


def test_errors_are_one_line(tmp_path):
    res = _cli("data", "stats", "--catalog", str(tmp_path / "nope.db"), "--json")
    assert res.returncode != 0 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    res = _cli("data", "plan", "--catalog", str(tmp_path / "nope.db"), "--tokens-per-rank", "0")
    assert res.returncode != 0 and "tokens_per_rank" in res.stderr and "Traceback" not in res.stderr
