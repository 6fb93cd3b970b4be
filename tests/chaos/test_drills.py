"""`postrain drill`: every drill's fast variant passes on real processes, files and Ray actors; a drill
that could not inject its faults fails and says why; a planted invariant violation fails the verdict."""
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chaos import wal_drills
from chaos.catalog import DRILLS
from chaos.drill import DrillContext, DrillResult, Event
from wal.segments import nonzero_end

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "deploy.cli", "drill", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _report(p) -> dict:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(next(line for line in reversed(p.stdout.splitlines()) if line.startswith("{")))


def test_every_drill_fast_variant_passes(tmp_path):
    """`postrain drill --all --fast`: every drill of the catalog on real processes, files, Ray actors and a
    3-node local Ray cluster, each with its fast fault count; all pass."""
    report = _report(_cli("--all", "--fast", "--seed", 3, "--out", tmp_path, "--json"))
    assert [d["name"] for d in report["drills"]] == list(DRILLS)
    kinds = 0
    for d in report["drills"]:
        want = DRILLS[d["name"]].fast_faults
        assert d["verdict"] == "pass" and d["failures"] == [], d
        assert d["faults_injected"] == d["faults_survived"] == d["faults_asked"] == want * len(d["by_kind"]), d
        assert all(k["injected"] == k["survived"] == want for k in d["by_kind"].values()), d
        kinds += len(d["by_kind"])
    assert report["fault_kinds"] == kinds >= len(DRILLS) and report["trials"] == "fast"
    assert report["faults_total"] == sum(DRILLS[d["name"]].fast_faults * len(d["by_kind"]) for d in report["drills"])
    assert report["tokens_lost"] == report["tokens_resampled"] == report["duplicate_side_effects"] == 0
    assert report["completion_rate"] == 1.0
    by_name = {d["name"]: d for d in report["drills"]}
    # learner-kill: SIGKILL of `postrain grpo` mid-iteration and --resume; the metrics equal the uninterrupted run's
    assert by_name["learner-kill"]["detail"]["calm_rows"] == 3
    # node-loss: a worker node of the local 3-node cluster killed mid-decode; its worker came back on a surviving
    # node, nothing committed lost or sampled twice, every trajectory ends as in the calm decode
    loss = by_name["node-loss"]
    assert loss["hashes_equal"] and all(loss["detail"]["committed_positions_at_each_kill"]), loss
    assert loss["detail"]["replacements"] >= 1 and 0 < loss["recovery_p50_s"] < 60
    assert json.loads((tmp_path / "drill.json").read_text())["verdict"] == "pass"
    assert (tmp_path / "drill.png").stat().st_size > 10_000


@pytest.mark.slow
def test_learner_kill_and_node_loss_with_more_faults(tmp_path):
    """The two costliest drills with two faults each (a second kill of a resumed lineage, a second node lost)."""
    report = _report(_cli("learner-kill", "node-loss", "--trials", 2, "--seed", 3, "--out", tmp_path, "--json"))
    for d in report["drills"]:
        assert d["verdict"] == "pass" and d["faults_injected"] == d["faults_survived"] == 2, d
    loss = report["drills"][1]
    assert len(loss["detail"]["committed_positions_at_each_kill"]) == 2 and loss["detail"]["replacements"] >= 2


def test_list_and_bad_input():
    p = _cli("--list")
    assert p.returncode == 0 and all(name in p.stdout for name in DRILLS)
    for args, msg in [(["nope"], "unknown drill"), ([], "--all"), (["wal-kill", "--trials", 0], "--trials"),
                      (["--all", "--fast", "--trials", 2], "--fast")]:
        p = _cli(*args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_drill_that_injected_fewer_faults_than_asked_fails_and_says_why(tmp_path):
    r = DrillResult("x", {"sigkill": 3}, events=[Event("sigkill", 0.1, 0.2)], shortfall="the run ended after 4 rounds")
    assert not r.passed and r.failures() == ["injected 1 of 3 sigkill faults (the run ended after 4 rounds)"]
    # a real drill on a log with a single segment has no earlier segment to damage: nothing injected, it fails
    one_segment = wal_drills.BITFLIP_CONFIG | {"segment_bytes": 4 << 20}
    res = wal_drills.wal_bitflip(DrillContext(tmp_path), 2, config=one_segment)
    assert res.injected == {} and not res.passed
    assert res.failures() == ["injected 0 of 2 wal_bitflip faults (the base log has a single segment: "
                              "no earlier segment to damage)"]
    # the same drill on its own configuration injects both and passes
    assert wal_drills.wal_bitflip(DrillContext(tmp_path / "b"), 2).passed


def test_a_planted_lost_token_fails_the_verdict(tmp_path):
    """Drop the last acknowledged flush from a copy of a WAL: the audit counts the lost tokens, the verdict fails."""
    log = tmp_path / "wal"
    sink = io.StringIO()
    wal_drills.writer(str(log), 5, sink, wal_drills.KILL_CONFIG | {"segment_bytes": 4 << 20}, max_acks=12)
    acked, finalized = {}, set()
    for line in sink.getvalue().splitlines():
        wal_drills._read_acks(line, acked, finalized)
    assert wal_drills.audit(log, acked, finalized) == (0, 0)

    copy = tmp_path / "copy"
    shutil.copytree(log, copy)
    seg = max(copy.glob("*.seg"))
    data = seg.read_bytes()
    end = nonzero_end(data, 0)
    with open(seg, "r+b") as fh:  # the last acknowledged commit never reached the disk
        fh.seek(end - 16)
        fh.write(bytes(16))
    lost, resampled = wal_drills.audit(copy, acked, finalized)
    planted = DrillResult("wal-kill", {"wal_sigkill": 1}, events=[Event("wal_sigkill", 0.0, 0.01)],
                          tokens_lost=lost, tokens_resampled=resampled)
    assert lost >= 1 and not planted.passed and f"{lost} tokens lost" in planted.failures()
