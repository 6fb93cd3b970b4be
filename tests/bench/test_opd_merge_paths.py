"""bench.opd_merge finds a pipeline run's base and teachers from its stage manifests: paths relative to the
run directory (what the pipeline writes), or, in older manifests, to the directory the pipeline ran in, also
when the bench runs from another directory."""
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


def test_paths_the_pipeline_writes_relative_to_its_run_directory(tmp_path, monkeypatch):
    from deploy import manifest

    run = tmp_path / "runs" / "seed1"
    for stage, outputs in (("sft", {"base": run / "sft" / "final"}),
                           ("specialists", {"arith": run / "specialists" / "arith" / "final"})):
        for p in outputs.values():
            p.mkdir(parents=True)
            (p / "config.json").write_text("{}")
        manifest.write(run / stage, settings="s", inputs={}, outputs=outputs, wall_s=1.0)
    assert json.loads((run / "sft" / "manifest.json").read_text())["outputs"]["base"]["path"] == "sft/final"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert teachers_of_run(run) == (run / "sft" / "final", {"arith": run / "specialists" / "arith" / "final"})
