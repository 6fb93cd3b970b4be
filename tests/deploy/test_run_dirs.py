"""Run directories kept whole: a resume under other settings is refused (grpo, opd) or starts the stage over
(pipeline); manifests survive a move or another working directory; one process per run directory; damaged
records and metrics are one clear error naming the file; the config checks that guard a run's start."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from core import config
from core.errors import UserError
from core.rundir import RunDir
from deploy import manifest
from deploy.commands._common import default_config
from deploy.grpo_config import GRPOLoopConfig
from deploy.grpo_loop import GRPOLoop
from deploy.opd_config import OPDLoopConfig
from deploy.opd_loop import OPDLoop
from deploy.pipeline import Pipeline
from deploy.pipeline_config import PipelineConfig
from tests.distill.opd_fixtures import save_tiny

GRPO = ["sampling.max_new_tokens=8", "eval.max_new_tokens=8", "eval.n=8", "learner.device=cpu", "pool.workers=1",
        "loop.prompts_per_iteration=4", "loop.group_size=4", "loop.eval_every=0", "loop.checkpoint_every=1"]
OPD = ["sampling.max_new_tokens=8", "eval.max_new_tokens=8", "eval.n=6", "learner.device=cpu", "pool.workers=1",
       "loop.prompts_per_iteration=6", "loop.minibatches=1", "opd.teacher_workers=1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"a": save_tiny(root / "a", 32, seed=1), "b": save_tiny(root / "b", 32, seed=2),
            "t": save_tiny(root / "t", 48, seed=3)}


def _release(run) -> None:
    """Let go of the run directory `run` (a pipeline, a GRPO or OPD loop) locked, as its process's exit would."""
    lock = getattr(run, "_lock", None)
    if lock is not None:
        lock.close()


def _grpo(out, init, *sets, resume=False, iterations=2):
    """Set up a GRPO run (its records, lock, config) without running it."""
    _release(GRPOLoop(config.load(GRPOLoopConfig, None, GRPO + list(sets)), "reverse", init, out, iterations,
                      resume=resume))


def _opd(out, student, teacher, *sets, resume=False):
    _release(OPDLoop(config.load(OPDLoopConfig, None, OPD + list(sets)), student, [("arith", str(teacher), 1.0)],
                     out, 2, resume=resume))


# -- 1. a resume under other settings -----------------------------------------------------------------------
def test_grpo_resume_with_other_settings_is_refused_naming_them(tmp_path, models):
    out = tmp_path / "run"
    _grpo(out, models["a"])
    saved = (out / "config.json").read_text()
    with pytest.raises(UserError, match=r"started with other settings \(config \(optim\.lr"):
        _grpo(out, models["a"], "optim.lr=0.05", resume=True)
    with pytest.raises(UserError, match=r"started with other settings \(init\)"):
        _grpo(out, models["b"], resume=True)
    assert (out / "config.json").read_text() == saved  # the refused resume wrote nothing
    _grpo(out, models["a"], "loop.time_budget_s=99", resume=True, iterations=3)  # when it ends is no identity


def test_opd_resume_with_other_settings_is_refused_naming_them(tmp_path, models):
    out = tmp_path / "run"
    _opd(out, models["a"], models["t"])
    with pytest.raises(UserError, match=r"started with other settings \(config \(optim\.lr"):
        _opd(out, models["a"], models["t"], "optim.lr=0.05", resume=True)
    with pytest.raises(UserError, match=r"started with other settings \(student\)"):
        _opd(out, models["b"], models["t"], resume=True)
    _opd(out, models["a"], models["t"], "loop.time_budget_s=99", resume=True)


def test_opd_resume_finds_its_teachers_moved_but_not_others(tmp_path, models):
    out, moved = tmp_path / "run", tmp_path / "moved" / "t"
    _opd(out, models["a"], models["t"])
    shutil.copytree(models["t"], moved)  # the same weights elsewhere: a run directory holding its teachers moved
    _opd(out, models["a"], moved, resume=True)
    assert json.loads((out / "opd_run.json").read_text())["teachers"][0]["path"] == str(moved)
    with pytest.raises(UserError, match="other teachers"):  # other weights under the moved name
        shutil.rmtree(moved)
        shutil.copytree(models["b"], moved)
        _opd(out, models["a"], moved, resume=True)


def _pipeline(runs, *sets, force=False, chaos=None):
    cfg = config.load(PipelineConfig, default_config("pipeline"), list(sets))
    return Pipeline(cfg, "p", runs=runs, quiet=True, force=force, chaos=chaos)


def _fake_stages(p, seen: dict, kill_in: str | None = None):
    """Stage functions that write a file and report what the stage directory held when they began."""
    def stage(name):
        def run(d):
            seen[name] = sorted(x.name for x in d.iterdir()) if d.exists() else []
            (d / "work").mkdir(parents=True, exist_ok=True)
            if name == kill_in:
                raise KeyboardInterrupt  # killed inside the stage: no manifest
            (d / "out.txt").write_text(name)
            return {"out": d / "out.txt"}, {}
        return run
    for name in ("sft", "specialists", "merge", "evaluate"):
        setattr(p, f"_stage_{name}", stage(name))


@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "", ".."])
def test_a_pipeline_named_outside_its_runs_directory_is_refused(tmp_path, name):
    runs = tmp_path / "runs"
    cfg = config.load(PipelineConfig, default_config("pipeline"), [])
    with pytest.raises(UserError, match="run name must be one directory name"):
        Pipeline(cfg, name, runs=runs, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written anywhere"


def test_a_fresh_run_says_no_stage_runs_again_and_a_rerun_says_why(tmp_path, capsys):
    p = _pipeline(tmp_path)
    p.quiet = False
    _fake_stages(p, {})
    p._run_stages()
    _release(p)
    err = capsys.readouterr().err
    assert "runs again" not in err and err.count(": done in") == 4, err  # sft, specialists, merge, evaluate
    p = _pipeline(tmp_path, 'sft.set=["sft.steps=7"]', force=True)
    p.quiet = False
    _fake_stages(p, {})
    p._run_stages()
    _release(p)
    err = capsys.readouterr().err
    assert "sft: runs again: its settings changed" in err
    assert "specialists: runs again: an earlier stage ran again" in err and "merge: runs again" in err


def test_a_stage_interrupted_under_other_settings_starts_over(tmp_path, capsys):
    p = _pipeline(tmp_path)
    _fake_stages(p, {}, kill_in="specialists")
    with pytest.raises(KeyboardInterrupt):
        p._run_stages()
    _release(p)
    seen = {}
    p = _pipeline(tmp_path, 'specialists.set=["optim.lr=0.05"]', force=True)
    p.quiet = False
    _fake_stages(p, seen)
    p._run_stages()
    assert "work" not in seen["specialists"], seen  # nothing of the other settings' stage was resumed
    assert "specialists: runs again: its settings changed" in capsys.readouterr().err
    same = {}  # interrupted and rerun with the same settings: resumed
    _fake_stages(p, same, kill_in="merge")
    (p.run_dir / "merge" / manifest.NAME).unlink()
    with pytest.raises(KeyboardInterrupt):
        p._run_stages()
    _fake_stages(p, same)
    p._run_stages()
    assert "work" in same["merge"], same
    _release(p)


def test_a_specialist_finished_under_other_settings_is_not_kept(tmp_path):
    out = tmp_path / "arith"
    (out / "final").mkdir(parents=True)
    (out / "final" / "w").write_text("x")
    from core.digest import sha256_tree

    (out / "done.json").write_text(json.dumps({"final_sha256": sha256_tree(out / "final"), "settings_hash": "old"}))
    assert not Pipeline._specialist_done(out, "new")
    assert Pipeline._specialist_done(out, "old")


# -- 2. manifests of a moved run, read from another cwd -------------------------------------------------------
def test_manifests_survive_a_move_and_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "rel" / "r"
    (run / "sft" / "final").mkdir(parents=True)
    (run / "sft" / "final" / "w").write_text("weights")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    manifest.write(run / "sft", settings="s", inputs={}, wall_s=1.0,
                   outputs={"base": "rel/r/sft/final", "init": outside})  # cwd-relative, as `--runs rel` gives
    assert manifest.stale_reason(manifest.read("rel/r/sft"), "s", {}) is None
    monkeypatch.chdir("/")
    assert manifest.stale_reason(manifest.read(run / "sft"), "s", {}) is None
    shutil.move(run, tmp_path / "moved")
    doc = manifest.read(tmp_path / "moved" / "sft")
    assert manifest.stale_reason(doc, "s", {}) is None
    assert doc["outputs"]["base"]["path"] == str(tmp_path / "moved" / "sft" / "final")
    assert doc["outputs"]["init"]["path"] == str(outside)  # outside the run directory: absolute
    old = tmp_path / "old" / "sft"  # a manifest from before: paths as given, read as they are
    old.mkdir(parents=True)
    (old / manifest.NAME).write_text(json.dumps({"status": "done", "settings_hash": "s", "inputs": {}, "outputs": {
        "base": {"path": str(tmp_path / "moved" / "sft" / "final"), "sha256": doc["outputs"]["base"]["sha256"]}}}))
    assert manifest.stale_reason(manifest.read(old), "s", {}) is None


# -- 3. one process per run directory ------------------------------------------------------------------------
def _hold_lock(path):
    path.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX);"
            "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path / ".lock")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_run_directory_in_use_is_refused(tmp_path, models):
    holder = _hold_lock(tmp_path / "p")
    try:
        with pytest.raises(UserError, match=rf"^run directory {tmp_path / 'p'} is in use \(pid {holder.pid}\)$"):
            _pipeline(tmp_path)
        assert not (tmp_path / "p" / "pipeline.json").exists()
    finally:
        holder.kill()
        holder.wait()
    holder = _hold_lock(tmp_path / "g")
    try:
        with pytest.raises(UserError, match=rf"is in use \(pid {holder.pid}\)"):
            _grpo(tmp_path / "g", models["a"])
    finally:
        holder.kill()
        holder.wait()
    p = _pipeline(tmp_path)  # the holder died: the lock went with it
    _grpo(p.run_dir / "specialists" / "arith", models["a"])  # a stage's own directory is not the pipeline's
    _release(p)


# -- 4. the SQLite catalog stays in a run directory whose path has '?' or '%XX' -------------------------------
def test_a_catalog_path_with_url_characters_stays_where_it_was_asked(tmp_path):
    import dataplane

    for name in ("run?a", "run%41b"):
        d = tmp_path / name
        dp = dataplane.open(str(d / "catalog.db"), str(d / "store"))
        dp.close()
        assert (d / "catalog.db").is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert not (tmp_path / "run").exists()  # the path cut at '?' (where the catalog went)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run%41b", "run?a"]  # no folder of a quoted name


# -- 5 and 12. metrics.jsonl: a cut-off last line, a damaged one, time across resumes ---------------------------
def test_metrics_with_a_cut_off_last_line_are_read_and_appended_to(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"time_s": 5.0, "stage": "train"}\n{"stage": "train", "rollo')
    run = RunDir(tmp_path)
    assert run.read_metrics() == [{"time_s": 5.0, "stage": "train"}]
    run.log(stage="eval")
    rows = run.read_metrics()
    assert [r["stage"] for r in rows] == ["train", "eval"]
    assert rows[-1]["time_s"] >= 5.0  # a resumed process counts on from the run's time so far
    (tmp_path / "metrics.jsonl").write_text('{"stage": "a"}\n{"stage": \n{"stage": "b"}\n')
    with pytest.raises(UserError, match=r"metrics\.jsonl line 2 is damaged"):
        RunDir(tmp_path).read_metrics()


def test_the_pipeline_reads_a_childs_metrics_while_it_appends(tmp_path):
    """The live progress line and the budget spent read metrics.jsonl while the stage's process writes it: a
    row half written is no row yet, and does not stop the pipeline."""
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"time_s": 40.0, "stage": "eval", "eval_pass_at_1": 0.25}\n'
                 '{"time_s": 41.5, "stage": "train"}\n{"time_s": 60.0, "stage": "eval", "eval_pass_at_1": 0.')
    assert Pipeline._latest(m) == "pass@1 pass_at_1 0.25"
    assert Pipeline._spent(tmp_path) == 41.5  # the last whole row, not 0 (a whole budget again)
    pad = "".join(f'{{"time_s": {i}.0, "stage": "train", "pad": "{"x" * 200}"}}\n' for i in range(400))
    m.write_text(pad + '{"time_s": 500.0, "stage": "eval", "eval_pass_at_1_arith": 0.5}\n')  # past the window
    assert Pipeline._latest(m) == "pass@1 arith 0.50" and Pipeline._spent(tmp_path) == 500.0
    assert Pipeline._latest(tmp_path / "none.jsonl") == "" and Pipeline._spent(tmp_path / "none") == 0.0


# -- 6. chaos is a setting of the stages that inject faults only ---------------------------------------------
def test_chaos_changes_the_settings_of_the_fault_injecting_stages_only(tmp_path):
    calm = _pipeline(tmp_path / "a")
    chaos = _pipeline(tmp_path / "b", chaos=7)
    assert calm._settings("sft") == chaos._settings("sft")
    assert calm._settings("evaluate") == chaos._settings("evaluate")
    assert calm._settings("specialists") != chaos._settings("specialists")
    assert calm._settings("merge") != chaos._settings("merge")
    _release(calm)
    _release(chaos)


# -- 7. damaged run records ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body", ['{"config_hash": "ab', "[]", '{"config_hash": 5}'])
def test_a_damaged_pipeline_json_is_named_and_force_replaces_it(tmp_path, body):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "pipeline.json").write_text(body)
    with pytest.raises(UserError, match=rf"^{tmp_path / 'p' / 'pipeline.json'} is damaged: .*--force"):
        _pipeline(tmp_path)
    p = _pipeline(tmp_path, force=True)
    assert json.loads((tmp_path / "p" / "pipeline.json").read_text())["config_hash"]
    _release(p)


@pytest.mark.parametrize("body", ['{"domain": "rev', '{"init": "x"}', '{"domain": "reverse", "settings": 3}'])
def test_a_damaged_grpo_run_json_is_named(tmp_path, models, body):
    out = tmp_path / "run"
    _grpo(out, models["a"])
    (out / "grpo_run.json").write_text(body)
    with pytest.raises(UserError, match=rf"^{out / 'grpo_run.json'} is damaged: "):
        _grpo(out, models["a"], resume=True)


def test_a_damaged_results_json_is_named_by_the_report(tmp_path):
    from deploy.pipeline_report import collect

    (tmp_path / "evaluate").mkdir()
    (tmp_path / "pipeline.json").write_text(json.dumps({"config_hash": "x", "config": {}}))
    (tmp_path / "evaluate" / "results.json").write_text('{"pass_at_1": {"base"')
    with pytest.raises(UserError, match=r"results\.json is damaged: not JSON"):
        collect(tmp_path)


# -- 8. sft into a directory that holds a run ----------------------------------------------------------------
def test_sft_refuses_an_out_that_holds_a_run(tmp_path):
    from deploy.job import run_sft
    from deploy.job_config import JobConfig

    cfg = config.load(JobConfig, None, ["policy.hidden_size=32", "policy.num_layers=1", "policy.num_heads=2",
                                        "policy.num_kv_heads=1", "policy.intermediate_size=64", "sft.threads=1",
                                        "sft.steps=1"])
    run_sft(cfg, tmp_path / "s", quiet=True)
    rows = (tmp_path / "s" / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="already holds a run"):
        run_sft(cfg, tmp_path / "s", quiet=True)
    assert (tmp_path / "s" / "metrics.jsonl").read_text() == rows


# -- 9. seeds within what their users take ---------------------------------------------------------------------
@pytest.mark.parametrize("cls, key", [("deploy.job_config:JobConfig", "policy.seed"),
                                      ("deploy.job_config:JobConfig", "sft.seed"),
                                      ("deploy.grpo_config:GRPOLoopConfig", "loop.seed"),
                                      ("deploy.opd_config:OPDLoopConfig", "loop.seed"),
                                      ("deploy.pipeline_config:PipelineConfig", "pipeline.seed")])
def test_a_seed_out_of_range_is_a_config_error(cls, key):
    import importlib

    mod, name = cls.split(":")
    with pytest.raises(UserError, match=rf"{key}: Input should be less than or equal"):
        config.load(getattr(importlib.import_module(mod), name), None, [f"{key}=99999999999999999999"])


# -- 10. an error raised inside a Ray actor ------------------------------------------------------------------
def test_an_error_from_a_ray_actor_prints_as_its_own_line():
    from ray.exceptions import RayTaskError

    from deploy.cli import _one_line

    remote = RayTaskError("f", "Traceback (most recent call last):\n  \x1b[36mray::f\x1b[39m\nUserError: bad key",
                          UserError("config: bad key")).as_instanceof_cause()
    assert _one_line(remote) == "config: bad key"


# -- 11. engine.device -----------------------------------------------------------------------------------------
def test_engine_device_is_checked():
    import torch

    from deploy.grpo_loop import check_engine_device

    for bad in ("gpu0", "cuda:x", "mps"):
        with pytest.raises(UserError, match="engine.device"):
            config.load(GRPOLoopConfig, None, [f"engine.device={bad}"])
    config.load(GRPOLoopConfig, None, ["engine.device=cuda:1"])
    check_engine_device("grpo", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"engine.device = 'cuda' but this machine has no CUDA device"):
            check_engine_device("grpo", "cuda")
    with pytest.raises(UserError, match=r"engine.device = 'cuda:99'"):
        check_engine_device("grpo", "cuda:99")
