"""`postrain rollout` as a subprocess: under --chaos every episode completes with the token hashes of the
fault-free run, nothing is lost or re-sampled, everything lands in the data plane and is finalized."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from core import config
from rollout.config import RolloutConfig
from rollout.run import requests_for
from rollout.types import token_hash
from rollout.worker import RolloutWorker, WorkerSpec

ROOT = Path(__file__).resolve().parents[2]
SETS = ["--set", "sampling.max_new_tokens=24", "--set", "engine.max_batch=2", "--set", "pool.steps_per_call=3"]


def _report(p) -> dict:
    return json.loads(p.stdout)  # --json: the report is all of stdout (Ray's notices go to stderr)


def _cli(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "deploy.cli", "rollout", *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(p.stderr[-3000:])
    return p


def _cfg():
    return config.load(RolloutConfig, ROOT / "configs" / "rollout.toml",
                       ["sampling.max_new_tokens=24", "engine.max_batch=2", "pool.steps_per_call=3"])


def test_shipped_config_parses():
    cfg = config.load(RolloutConfig, ROOT / "configs" / "rollout.toml")
    assert cfg.engine.strict and cfg.pool.workers >= 1


def _reference_hashes(tmp, ckpt, domain, n):
    cfg = _cfg()
    w = RolloutWorker(WorkerSpec("ref", str(ckpt), str(tmp / "wal"), str(tmp / "kv"), seed=cfg.pool.seed,
                                 engine=cfg.engine.model_copy(update={"max_batch": 8})))
    w.submit(requests_for(domain, n, cfg))
    out = {}
    while True:
        rep = w.run(16)
        out.update({f.traj_id: token_hash(f.tokens) for f in rep.finished})
        if rep.idle:
            w.close()
            return out


def _check_outputs(out: Path, report: dict, n: int):
    import dataplane
    import wal

    assert report["completed"] == n and report["completion_rate"] == 1.0
    assert report["tokens_lost"] == 0 and report["tokens_resampled"] == 0
    assert set(report) >= {"trajectories", "faults_injected", "resumes", "tokens_lost", "tokens_resampled", "tool_calls"}
    dp = dataplane.open(out / "catalog.db", out / "store")
    sel = dp.select(run=out.name)
    assert sorted(sel.ids.tolist()) == sorted(t["id"] for t in report["trajectories"])
    assert sel.length.tolist() == [{t["id"]: t["length"] for t in report["trajectories"]}[i] for i in sel.ids.tolist()]
    for k in range(report["workers"]):
        log = wal.open(out / "wal" / str(k))
        assert log.trajectories() == []  # every trajectory finalized after the data plane took it
        log.close()


def test_chaos_run_completes_with_the_fault_free_hashes(tmp_path, tiny_ckpt):
    n = 6
    ref = _reference_hashes(tmp_path / "ref", tiny_ckpt, "arith", n)
    out = tmp_path / "chaos"
    p = _cli("--checkpoint", tiny_ckpt, "--domain", "arith", "--n", n, "--workers", 2, "--chaos", 3, "--faults", 3,
             "--out", out, "--json", "--quiet", *SETS)
    report = _report(p)
    assert sum(report["faults_injected"].values()) == 3
    assert (out / "rollout.png").is_file() and (out / "metrics.jsonl").is_file() and (out / "config.json").is_file()
    assert {t["id"]: t["token_hash"] for t in report["trajectories"]} == ref
    _check_outputs(out, report, n)


@pytest.mark.slow
def test_chaos_equals_no_chaos_two_cli_runs(tmp_path, tiny_ckpt):
    args = ["--checkpoint", tiny_ckpt, "--domain", "arith", "--n", 12, "--workers", 2, "--json", "--quiet", *SETS]
    plain = _report(_cli(*args, "--out", tmp_path / "a"))
    chaos = _report(_cli(*args, "--out", tmp_path / "b", "--chaos", 7, "--faults", 10))
    assert sum(chaos["faults_injected"].values()) == 10 and len(chaos["faults_injected"]) == 5
    assert [t["token_hash"] for t in plain["trajectories"]] == [t["token_hash"] for t in chaos["trajectories"]]
    _check_outputs(tmp_path / "b", chaos, 12)


def test_chaos_that_cannot_inject_its_faults_fails_and_says_why(tmp_path, tiny_ckpt):
    p = _cli("--checkpoint", tiny_ckpt, "--domain", "arith", "--n", 1, "--workers", 1, "--chaos", 1, "--faults", 40,
             "--out", tmp_path / "short", "--json", "--quiet", *SETS, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "faults: the run ended after" in p.stderr and "of 40 faults" in p.stderr, p.stderr[-2000:]
    report = _report(p)
    assert 0 < sum(report["faults_injected"].values()) < 40 and report["completed"] == 1


def test_bad_input_is_one_line(tmp_path, tiny_ckpt):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    p = _cli("--checkpoint", tiny_ckpt, "--domain", "arith", "--out", tmp_path / "busy", check=False)
    assert p.returncode != 0 and "not empty" in p.stderr and "Traceback" not in p.stderr
    p = _cli("--checkpoint", tiny_ckpt, "--domain", "nope", "--out", tmp_path / "o", check=False)
    assert p.returncode != 0 and "unknown domain" in p.stderr and "Traceback" not in p.stderr
    p = _cli("--checkpoint", tmp_path, "--domain", "arith", "--out", tmp_path / "o2", check=False)
    assert p.returncode != 0 and "checkpoint" in p.stderr and "Traceback" not in p.stderr
