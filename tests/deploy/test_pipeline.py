"""`postrain pipeline --quick` end to end as a user runs it (subprocesses, real stages): manifests, report
files, resume after SIGKILL inside a stage, reruns after a config change, and bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
STAGE_DIRS = ("sft", "specialists", "merge", "evaluate")


def pipeline(runs: Path, *args: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "pipeline", "--runs", str(runs), "--quick", *args],
                         capture_output=True, text=True, timeout=timeout, env=ENV)
    if check and res.returncode != 0:
        raise AssertionError(f"pipeline {' '.join(args)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return res


def figures(run: Path) -> dict:
    rep = json.loads((run / "report.json").read_text())
    return {k: rep[k] for k in ("pass_at_1", "retention", "specialist_gain", "trained", "faults")}


def walls(run: Path) -> dict:
    return {s: json.loads((run / s / "manifest.json").read_text())["wall_s"] for s in STAGE_DIRS}


@pytest.fixture(scope="module")
def calm(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("pipe")
    t0 = time.monotonic()
    res = pipeline(runs, "--name", "calm")
    run = runs / "calm"
    run.joinpath("took_s").write_text(f"{time.monotonic() - t0:.1f}")
    assert "merged" in res.stdout and "report:" in res.stdout
    return run


def test_quick_pipeline_writes_every_stage_and_the_report(calm):
    for stage in STAGE_DIRS:
        doc = json.loads((calm / stage / "manifest.json").read_text())
        assert doc["status"] == "done" and doc["outputs"] and doc["wall_s"] >= 0
        assert all(len(o["sha256"]) == 64 for o in doc["outputs"].values())
    rep = json.loads((calm / "report.json").read_text())
    domains = ["arith", "reverse", "calc"]
    assert rep["domains"] == domains and rep["trained"] == domains
    assert set(rep["pass_at_1"]) == {"base", "merged", *(f"specialist:{d}" for d in domains)}
    assert all(set(row) == set(domains) for row in rep["pass_at_1"].values())
    assert set(rep["specialist_gain"]) == set(domains) and rep["stages"]["evaluate"]["status"] == "done"
    for name in ("report.md", "report.html", "grpo.png"):
        assert (calm / name).stat().st_size > 500, name
    html = (calm / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3 and "<table>" in html  # self-contained: sft, grpo, opd
    assert "| merged |" in (calm / "report.md").read_text()
    assert json.loads((calm / "merge" / "run" / "opd_run.json").read_text())["teachers"][0]["name"] == "arith:0"


def test_rerun_keeps_every_finished_stage(calm, tmp_path):
    before = walls(calm)
    res = pipeline(calm.parent, "--name", "calm")
    assert res.stderr.count("done earlier, kept") == 4, res.stderr
    assert walls(calm) == before


def test_killed_inside_specialists_resumes_without_redoing_sft(tmp_path, calm):
    runs = tmp_path
    args = [sys.executable, "-m", "deploy.cli", "pipeline", "--runs", str(runs), "--quick", "--name", "k"]
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = runs / "k"
    deadline = time.monotonic() + 600
    # kill once a specialist has checkpointed (the middle of the stage), with the stage unfinished
    while not list((run / "specialists").glob("*/checkpoints/latest")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "specialists" / "manifest.json").exists()
    sft_wall = json.loads((run / "sft" / "manifest.json").read_text())["wall_s"]
    res = pipeline(runs, "--name", "k")
    assert "sft: done earlier, kept" in res.stderr and "specialists: done" in res.stderr
    assert json.loads((run / "sft" / "manifest.json").read_text())["wall_s"] == sft_wall
    assert figures(run) == figures(calm)


def test_a_changed_opd_setting_reruns_merge_and_evaluate_only(tmp_path, calm):
    import shutil

    runs = tmp_path
    shutil.copytree(calm, runs / "c", symlinks=True)
    # the copy's manifests name the original's paths: point them at the copy
    for m in (runs / "c").rglob("manifest.json"):
        m.write_text(m.read_text().replace(str(calm), str(runs / "c")))
    before = walls(runs / "c")
    res = pipeline(runs, "--name", "c", check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    res = pipeline(runs, "--name", "c", "--set", 'quick.merge.set=["loop.prompts_per_iteration=6","loop.minibatches=1",'
                   '"loop.eval_every=0","loop.checkpoint_every=1","engine.strict=true","sampling.max_new_tokens=8",'
                   '"eval.n=8","eval.max_new_tokens=8","pool.workers=1","opd.teacher_workers=0","optim.lr=1e-4"]',
                   check=False)
    assert res.returncode == 2 and "another pipeline config" in res.stderr and "--force" in res.stderr
    res = pipeline(runs, "--name", "c", "--force", "--set", 'quick.merge.set=["loop.prompts_per_iteration=6",'
                   '"loop.minibatches=1","loop.eval_every=0","loop.checkpoint_every=1","engine.strict=true",'
                   '"sampling.max_new_tokens=8","eval.n=8","eval.max_new_tokens=8","pool.workers=1",'
                   '"opd.teacher_workers=0","optim.lr=1e-4"]')
    after = walls(runs / "c")
    assert after["sft"] == before["sft"] and after["specialists"] == before["specialists"]
    assert "merge: runs again: its settings changed" in res.stderr and "evaluate: done in" in res.stderr
    results = runs / "c" / "evaluate" / "results.json"
    results.write_text(results.read_text().replace('"n"', '"n" ', 1))  # a damaged output
    res = pipeline(runs, "--name", "c", "--force", "--set", 'quick.merge.set=["loop.prompts_per_iteration=6",'
                   '"loop.minibatches=1","loop.eval_every=0","loop.checkpoint_every=1","engine.strict=true",'
                   '"sampling.max_new_tokens=8","eval.n=8","eval.max_new_tokens=8","pool.workers=1",'
                   '"opd.teacher_workers=0","optim.lr=1e-4"]')
    assert "evaluate: runs again: output results" in res.stderr and "does not match its sha256" in res.stderr
    assert "merge: done earlier, kept" in res.stderr


@pytest.mark.parametrize("sets, needle", [
    (["pipeline.domains=[\"arith\",\"nope\"]"], "unknown domain(s) ['nope']"),
    (["distill.x=1"], "unknown key 'distill'"),
    (["pipeline.budget_min=1"], "do not fit pipeline.budget_min"),
    (["merge.config=nope.toml"], "[merge] config 'nope.toml' not found"),
    (['specialists.shares={"nope": 2}'], "specialists.shares names domain(s) ['nope'] outside pipeline.domains"),
    (['specialists.shares={"calc": 0}'], "specialists.shares must be > 0"),
    (['merge.set=["loop.final=best"]'], "merge choose a policy by their own eval"),
    (['specialists.set=["loop.patience=3"]'], "specialists (arith), specialists (reverse), specialists (calc) choose"),
])
def test_bad_config_fails_before_any_stage(tmp_path, sets, needle):
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "pipeline", "--runs", str(tmp_path), "--name", "x",
                          *(a for kv in sets for a in ("--set", kv))], capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert not (tmp_path / "x" / "sft").exists()


def test_a_missing_teacher_fails_before_any_stage(tmp_path):
    cfg = tmp_path / "opd_with_teacher.toml"
    cfg.write_text('[opd.teachers]\ncalc = "/nonexistent/teacher"\n')
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "pipeline", "--runs", str(tmp_path), "--name", "y",
                          "--set", f"merge.config={cfg}"], capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 2 and "teacher for calc (/nonexistent/teacher) does not exist" in res.stderr, res.stderr


@pytest.mark.parametrize("args, needle", [
    (["--runs", "file:///shared/runs"], "--runs file:///shared/runs is a pyarrow.fs URI"),
    (["--runs", "gs://b/runs", "--dry-run"], "--runs gs://b/runs is a pyarrow.fs URI"),  # before it probes a path
    (["--runs", "runs", "--set", "merge.init=s3://b/base"], "merge.init s3://b/base is a pyarrow.fs URI"),
])
def test_a_uri_is_one_error_saying_what_takes_one(tmp_path, args, needle):
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "pipeline", "--name", "u", *args], capture_output=True,
                         text=True, timeout=120, env={**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                         cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr
    assert "run `postrain grpo` / `opd` / `rollout` with --out URI stage by stage" in lines[0]
    assert list(tmp_path.iterdir()) == [], "nothing was written, not even a directory named like the URI"


def test_a_base_good_on_every_domain_trains_no_specialist_and_merges_nothing(tmp_path):
    res = pipeline(tmp_path, "--name", "strong", "--set", "quick.specialists.skip_at=0.0")
    assert "the merged model is the student" in res.stdout + res.stderr
    run = tmp_path / "strong"
    rep = json.loads((run / "report.json").read_text())
    assert rep["trained"] == [] and set(rep["pass_at_1"]) == {"base", "merged"}
    assert rep["pass_at_1"]["merged"] == rep["pass_at_1"]["base"]
    assert not (run / "merge" / "run").exists()  # no OPD process ran


def test_report_regenerates_from_a_run_directory(calm, tmp_path):
    (calm / "report.json").unlink()
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "report", str(calm), "--json"], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert res.returncode == 0 and json.loads(res.stdout)["pass_at_1"] and (calm / "report.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "deploy.cli", "report", str(tmp_path)], capture_output=True, text=True,
                         timeout=60, env=ENV)
    assert bad.returncode == 2 and "not a pipeline run" in bad.stderr


def test_the_specialists_budget_is_split_by_shares():
    from deploy.pipeline_config import SpecialistsStage

    st = SpecialistsStage(budget_s=1200, shares={"calc": 2})
    assert st.budgets_s(["arith", "reverse", "calc"]) == {"arith": 300, "reverse": 300, "calc": 600}
    assert st.budgets_s(["calc"]) == {"calc": 1200}  # the only one training takes the whole stage
    assert st.budgets_s(["arith", "reverse"]) == {"arith": 600, "reverse": 600}
    both = SpecialistsStage(budget_s=1200, parallel=2, shares={"calc": 2})
    assert both.budgets_s(["arith", "calc"]) == {"arith": 800, "calc": 1200}  # none longer than the stage


def test_time_a_stage_leaves_goes_to_the_stages_after_it(tmp_path):
    from deploy import manifest
    from deploy.pipeline import Pipeline
    from deploy.pipeline_config import PipelineConfig

    cfg = PipelineConfig.model_validate({"sft": {"budget_s": 200}, "specialists": {"budget_s": 1200, "shares": {"calc": 2}},
                                         "merge": {"budget_s": 240}, "evaluate": {"budget_s": 30}})
    p = Pipeline(cfg, "carry", runs=tmp_path, quiet=True)
    assert p._carry_s("specialists") == 0.0  # nothing finished yet
    manifest.write(p.run_dir / "sft", settings="s", inputs={}, outputs={}, wall_s=150.0)
    assert p._carry_s("specialists") == 50.0  # SFT ended 50 s early
    manifest.write(p.run_dir / "specialists", settings="s", inputs={}, outputs={}, wall_s=1290.0)
    assert p._carry_s("merge") == 50.0 - 90.0  # the specialists overran by 90 s: the merge gives it back
    d = p.run_dir / "specialists"
    assert p._sequential_budgets(d, ["arith", "reverse", "calc"], ["arith", "reverse", "calc"], 1200) == {
        "arith": 300, "reverse": 300, "calc": 600}
    (d / "arith").mkdir(parents=True)
    (d / "arith" / "metrics.jsonl").write_text(json.dumps({"time_s": 100.0, "stage": "train"}) + "\n")
    # arith ended after 100 s of its 300: reverse and calc share the 1,100 s left by their shares
    assert p._sequential_budgets(d, ["arith", "reverse", "calc"], ["reverse", "calc"], 1200) == {
        "reverse": pytest.approx(1100 / 3), "calc": pytest.approx(2200 / 3)}
    off = Pipeline(cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"carry_over": False})}),
                   "off", runs=tmp_path, quiet=True)
    manifest.write(off.run_dir / "sft", settings="s", inputs={}, outputs={}, wall_s=150.0)
    assert off._carry_s("merge") == 0.0
