"""bench.opd_merge finds a pipeline run's base and teachers from its stage manifests, whose paths are
relative to the directory the pipeline ran in, also when the bench runs from another directory."""
import json
from pathlib import Path

from bench.opd_merge import teachers_of_run


def _manifest(path: Path, outputs: dict) -> None:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"outputs": {k: {"path": v} for k, v in outputs.items()}}))


def test_relative_manifest_paths_resolve_inside_the_run(tmp_path, monkeypatch):
    run = tmp_path / "clone" / "runs" / "default"
    _manifest(run / "sft", {"base": "runs/default/sft/final"})
    _manifest(run / "specialists", {"arith": "runs/default/sft/final", "calc": "runs/default/specialists/calc/final"})
    monkeypatch.chdir(tmp_path)  # not the clone the pipeline ran in
    base, teachers = teachers_of_run(run)
    assert base == run / "sft" / "final"
    assert teachers == {"arith": run / "sft" / "final", "calc": run / "specialists" / "calc" / "final"}


def test_absolute_manifest_paths_are_kept(tmp_path):
    run = tmp_path / "runs" / "x"
    _manifest(run / "sft", {"base": "/models/base"})
    _manifest(run / "specialists", {"calc": "/models/calc"})
    assert teachers_of_run(run) == (Path("/models/base"), {"calc": Path("/models/calc")})
