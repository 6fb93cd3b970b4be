"""bench.pipeline: each target takes the worse run, and an unfinished run is refused."""
import json

import pytest

from bench import pipeline
from core.errors import UserError


def _report(seed, wall, gain, retention, done=True):
    stages = {s: {"status": "done" if done else "started", "wall_s": 60.0}
              for s in ("sft", "specialists", "merge", "evaluate")}
    return {"name": "default", "stages": stages, "wall_min": wall, "specialist_gain_min": gain,
            "specialist_gain": {"arith": gain}, "retention": {"arith": retention, "calc": 1.0},
            "retention_min": retention, "pass_at_1": {}, "trained": ["arith"],
            "config": {"pipeline": {"seed": seed}}}


def _write(tmp_path, name, report):
    d = tmp_path / name
    d.mkdir()
    (d / "report.json").write_text(json.dumps(report))
    return d


def test_targets_take_the_worse_run(tmp_path):
    a = _write(tmp_path, "a", _report(0, 28.0, 0.30, 0.99))
    b = _write(tmp_path, "b", _report(1, 31.0, 0.08, 0.96))
    out = tmp_path / "pipeline.json"
    assert pipeline.main(["--run", str(a), "--run", str(b), "--out", str(out),
                          "--copy-reports", str(tmp_path / "copies")]) == 0
    t = json.loads(out.read_text())["targets"]
    assert t["wall_min_cpu"]["value"] == 31.0 and t["wall_min_cpu"]["met"] is False
    assert t["specialist_gain_min"]["value"] == 0.08 and t["specialist_gain_min"]["met"] is False
    assert t["retention_min"]["value"] == 0.96 and t["retention_min"]["met"] is True
    assert sorted(p.name for p in (tmp_path / "copies").iterdir()) == ["pipeline_seed0.json", "pipeline_seed1.json"]


def test_unfinished_or_duplicate_runs_are_refused(tmp_path):
    a = _write(tmp_path, "a", _report(0, 28.0, 0.3, 0.99, done=False))
    with pytest.raises(UserError, match="not finished"):
        pipeline.main(["--run", str(a)])
    b = _write(tmp_path, "b", _report(0, 28.0, 0.3, 0.99))
    c = _write(tmp_path, "c", _report(0, 29.0, 0.3, 0.99))
    with pytest.raises(UserError, match="same pipeline.seed"):
        pipeline.main(["--run", str(b), "--run", str(c)])
