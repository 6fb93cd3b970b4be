"""`postrain bench power-loss` runs end to end on a tiny budget (the dash maps to bench/power_loss.py) and
prints the JSON with the four targets; the canaries are caught and nothing acknowledged is lost."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_power_loss_smoke(tmp_path):
    out_file = tmp_path / "power_loss.json"
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "power-loss", "--json", "--cuts", "100",
                        "--ab-rounds", "1", "--ab-chunks", "2", "--no-extra-canaries", "--out", str(out_file)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert json.loads(out_file.read_text()) == out
    assert set(out["targets"]) >= {"simulated_cuts", "acknowledged_lost", "canaries_caught", "wal_step_b512_slowdown"}
    for t in out["targets"].values():
        assert set(t) == {"value", "goal", "met"}
    assert set(out["cases"]) == {"wal", "envlog", "dataplane", "snapshot", "checkpoint"}
    assert all(c["cuts"] > 0 for c in out["cases"].values()) and out["simulated_cuts"] >= 100
    assert out["targets"]["acknowledged_lost"]["value"] == 0 and out["targets"]["canaries_caught"]["met"]
    assert out["wal_step_ab"]["before_steps_per_cpu_s"] > 0 and out["device"]
    assert out["meta"]["commit"] and out["meta"]["date_utc"] and out["meta"]["machine"]


def test_the_docs_show_the_committed_figures():
    r = subprocess.run([sys.executable, "docs/power_loss_figures.py", "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_step_ab_bypasses_exactly_the_flush_io(tmp_path):
    """The A/B's 'before' is this tree's commit with the flush's pwrite and fdatasync, and the direct
    write's pwritev2, straight on os; code that no longer reads as expected is refused rather than
    measured unchanged."""
    from bench._power_loss import step_ab

    step_ab.export_tree("HEAD", tmp_path / "t")
    step_ab.bypass_layer(tmp_path / "t")
    text = (tmp_path / "t" / "wal" / "log.py").read_text()
    assert "os.pwrite(self._fd, data, self._pos)" in text and "os.fdatasync(self._fd)" in text
    assert "fileio.pwrite_all(self._fd, data, self._pos)" not in text
    direct = (tmp_path / "t" / "wal" / "direct.py").read_text()
    assert "os.pwritev(self.fd, [mv[:total]], pos - t, os.RWF_DSYNC)" in direct and "fileio.pwrite_sync" not in direct
    with pytest.raises(RuntimeError, match="exactly one"):
        step_ab.bypass_layer(tmp_path / "t")  # already rewritten
