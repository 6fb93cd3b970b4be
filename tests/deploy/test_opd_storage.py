"""`postrain opd` with a pyarrow.fs URI run directory (`file://` through pyarrow's LocalFileSystem) and the
student and teachers read from URIs: the run publishes committed checkpoint trees, its run files and its
shards (the teacher hidden-state cache among them) there; a damaged teacher or a damaged published
checkpoint is refused with one error; `--dry-run` checks the student and every teacher URI; a run stopped after a checkpoint and resumed on another "machine"
from the URI alone repeats the uninterrupted run's metrics and ignores a checkpoint whose upload was cut
short."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from core.errors import UserError
from dataplane.remote import MANIFEST, RemoteStore
from deploy.opd_loop import run_opd
from deploy.run_storage import STAGING_ENV, RunStorage
from tests.deploy.test_opd_loop import BASE, ENV, _cfg, _rows, _seeded, _teachers, models  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def published(tmp_path_factory, models):
    """The student and both teachers as committed trees under a `file://` URI."""
    root = f"file://{tmp_path_factory.mktemp('ckpts')}"
    store = RemoteStore(root)
    for name in ("student", "arith", "calc"):
        store.upload_tree(models[name], name)
    return {name: f"{root}/{name}" for name in ("student", "arith", "calc")}


def _uri_teachers(published):
    return [("arith", published["arith"], 1.0), ("calc", published["calc"], 1.0)]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, published):
    """An OPD run into a URI, stopped once iteration 1 is checkpointed (of 2), on "machine 1"."""
    root = tmp_path_factory.mktemp("opd_uri")
    uri = f"file://{root}/run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STAGING_ENV, str(root / "machine1"))
        s = RunStorage(uri, "opd")
        s.prepare(catalog="")
        out = run_opd(_cfg(*s.overrides()), published["student"], _uri_teachers(published), s.local, iterations=2,
                      quiet=True, stop_after=1, storage=s)
    assert out["iterations_done"] == 1 and out["final"] is None
    return root, uri


def _cli(published, uri, *extra, staging):
    args = [sys.executable, "-m", "deploy.cli", "opd", "--student", published["student"], "--out", uri,
            "--iterations", "2", *(f"--teacher={d}={p}" for d, p, _ in _uri_teachers(published)),
            *(a for kv in BASE for a in ("--set", kv)), *extra]
    return subprocess.run(args, env={**ENV, STAGING_ENV: str(staging)}, capture_output=True, text=True, timeout=600)


def test_a_stopped_run_leaves_committed_trees_and_refuses_damage(stopped, published, models):
    root, uri = stopped
    remote = RemoteStore(uri)
    assert remote.dirs("checkpoints") == ["iter_00000001"] and remote.latest_tree("checkpoints") == "iter_00000001"
    files = remote.manifest("checkpoints/iter_00000001")["files"]
    assert "catalog.db" in files and any(k.startswith("model/") for k in files)
    assert remote.manifest("final") is None  # stopped: no final policy
    for name in ("opd_run.json", "config.json", "metrics.jsonl", "teacher_eval.json"):
        assert remote.exists(name), name
    rows = [json.loads(line) for line in remote.get("metrics.jsonl").decode().splitlines()]
    assert [r["iteration"] for r in rows if r["stage"] == "train"] == [1]
    run = json.loads(remote.get("opd_run.json"))  # the URIs name the checkpoints, not this machine's staging copies
    assert run["student"] == published["student"]
    assert [t["path"] for t in run["teachers"]] == [published["arith"], published["calc"]]
    runs = remote.dirs("dataplane/store/shards")  # rollouts and the teacher cache, written there directly
    assert {"it000000", "it000000.cache"} <= set(runs), runs

    # a teacher damaged in storage: refused before any work
    bad = RemoteStore(published["calc"])
    good = bad.get("model.safetensors")
    bad.put("model.safetensors", good[:-8] + b"\0" * 8)
    try:
        with pytest.raises(UserError, match=f"checkpoint {published['calc']}: .*/calc/model.safetensors: sha256 or "
                           "size differs"):
            run_opd(_cfg(), published["student"], _uri_teachers(published), root / "never", iterations=1, quiet=True)
    finally:
        bad.put("model.safetensors", good)
    assert not (root / "never").exists()

    # a damaged file in the published checkpoint: --resume is one error naming it, nothing is trained
    victim = "checkpoints/iter_00000001/model/model.safetensors"
    blob = remote.get(victim)
    remote.put(victim, blob[:-8] + b"\0" * 8)
    try:
        res = _cli(published, uri, "--resume", staging=root / "machine3")
    finally:
        remote.put(victim, blob)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert f"--resume: the latest checkpoint is damaged: {uri}/{victim}: sha256 or size differs" in err[0]
    assert f"delete {uri}/checkpoints/iter_00000001 to resume from the one before it" in err[0]
    assert [r["stage"] for r in map(json.loads, remote.get("metrics.jsonl").decode().splitlines())] == \
        [r["stage"] for r in rows]
    with pytest.raises(UserError, match=f"run directory {uri} is not empty"):  # a fresh run never writes over it
        RunStorage(uri, "opd").prepare()


def test_dry_run_checks_the_student_and_every_teacher_uri(tmp_path, published, models):
    import shutil

    shutil.copytree(models["calc"], tmp_path / "unpublished")  # files, no manifest: not a committed checkpoint
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "opd", "--student", published["student"],
                          "--teacher", f"arith={published['arith']}", "--teacher", f"calc=file://{tmp_path}/unpublished",
                          "--iterations", "1", "--out", f"file://{tmp_path}/run", "--dry-run"],
                         env=ENV, capture_output=True, text=True, timeout=300)
    rows = [ln.split(None, 2) for ln in res.stdout.splitlines() if ln.startswith("  checkpoint")]
    assert [r[1] for r in rows] == ["ok", "ok", "FAILED"], res.stdout
    assert rows[0][2].startswith(f"{published['student']}: committed") and published["arith"] in rows[1][2]
    assert f"checkpoint file://{tmp_path}/unpublished: no committed checkpoint there" in rows[2][2]
    assert res.returncode == 2 and "checks failed (checkpoint)" in res.stderr
    assert not (tmp_path / "run").exists(), "a dry run leaves nothing behind"


@pytest.mark.slow
def test_resumed_from_the_uri_repeats_the_uninterrupted_run(tmp_path, stopped, published, models):
    root, uri = stopped
    calm = tmp_path / "calm"  # local paths throughout: the same weights, so the same metrics
    run_opd(_cfg(), models["student"], _teachers(models), calm, iterations=2, quiet=True)
    remote = RemoteStore(uri)
    # an upload of checkpoint 2 cut short before its manifest: invisible to the resume
    remote.put("checkpoints/iter_00000002/model/model.safetensors", b"half of a checkpoint")
    res = _cli(published, uri, "--resume", "--json", staging=root / "machine2")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["out"] == uri and summary["final"] == f"{uri}/final" and summary["iterations_done"] == 2
    got = tmp_path / "got"
    got.mkdir()
    (got / "metrics.jsonl").write_bytes(remote.get("metrics.jsonl"))
    assert [_seeded(r) for r in _rows(calm, "train")] == [_seeded(r) for r in _rows(got, "train")]
    assert [_seeded(r) for r in _rows(calm, "eval")] == [_seeded(r) for r in _rows(got, "eval")]
    assert len(_rows(got, "teacher_eval")) == 2  # teacher_eval.json came back: the teachers were not re-evaluated
    assert remote.manifest("final") is not None and remote.latest_tree("checkpoints") == "iter_00000002"
    for d in remote.dirs("checkpoints"):  # every tree there is committed; the cut-short upload was redone
        assert remote.exists(f"checkpoints/{d}/{MANIFEST}"), d
    assert remote.exists("opd.png")
