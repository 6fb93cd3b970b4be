"""A run directory as a pyarrow.fs URI (`file://` through pyarrow's LocalFileSystem): a fresh run needs an
empty URI, checkpoints and run files are published there and come back verified on resume (on another
machine: a fresh staging directory), `--init` reads a committed checkpoint; a GRPO run stopped after a
checkpoint and resumed from the URI alone repeats the uninterrupted run's metrics."""
from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3

import pytest

from core.errors import UserError
from dataplane.remote import RemoteStore
from deploy.run_storage import STAGING_ENV, RunStorage, local_checkpoint
from tests.deploy.test_grpo_loop import _cfg, _rows, _seeded, uninterrupted  # noqa: F401  (the fixture)


def _ckpt(d, tag: str):
    (d / "model").mkdir(parents=True)
    (d / "model" / "model.safetensors").write_bytes(tag.encode() * 64)
    (d / "state.json").write_text(json.dumps({"tag": tag}))
    return d


def test_publish_and_resume_elsewhere(tmp_path, monkeypatch):
    uri = f"file://{tmp_path}/runs/a"
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "machine1"))
    s = RunStorage(uri, "grpo")
    assert s.local.parent.parent == tmp_path / "machine1" and s.local.name == "a" and s.overrides() == [
        f"pool.snapshot_uri={uri}/kv", f"loop.store={uri}/dataplane/store"]
    s.catalog = s.local / "dataplane" / "catalog.db"
    s.prepare()
    (s.local / "metrics.jsonl").write_text('{"iteration": 1}\n')
    s.catalog.parent.mkdir()
    with contextlib.closing(sqlite3.connect(s.catalog)) as db:
        db.executescript("pragma journal_mode=wal; create table t(x); insert into t values (7);")
    RemoteStore(uri).put("checkpoints/iter_00000000/model/part", b"an upload cut short")
    for i in (1, 2, 3):
        s.publish_checkpoint(_ckpt(s.local / "checkpoints" / f"iter_0000000{i}", str(i)), keep=2)
    remote = RemoteStore(uri)
    assert remote.dirs("checkpoints") == ["iter_00000002", "iter_00000003"]  # keep=2; the cut-short one gone
    with pytest.raises(UserError, match=f"run directory {uri} is not empty"):
        RunStorage(uri, "grpo").prepare()
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "machine2"))  # another machine resumes from the URI alone
    r = RunStorage(uri, "grpo")
    r.prepare(resume=True, catalog="")  # the loop's default catalog: back from the checkpoint
    assert r.catalog == r.local / "dataplane" / "catalog.db"
    with contextlib.closing(sqlite3.connect(r.catalog)) as db:  # the catalog came with the checkpoint
        assert db.execute("select x from t").fetchall() == [(7,)]
    assert not (r.local / "checkpoints" / "iter_00000003" / "catalog.db").exists()
    assert (r.local / "checkpoints" / "latest").read_text() == "iter_00000003"
    assert json.loads((r.local / "checkpoints" / "iter_00000003" / "state.json").read_text()) == {"tag": "3"}
    assert (r.local / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    # a checkpoint file damaged in storage: the resume refuses it instead of loading it
    remote.put("checkpoints/iter_00000003/model/model.safetensors", b"x" * 64)
    with pytest.raises(UserError, match="--resume: the latest checkpoint is damaged: .*iter_00000003/model/"
                       "model.safetensors: sha256 or size differs.*delete file://.*/checkpoints/iter_00000003 to resume"):
        RunStorage(uri, "grpo").prepare(resume=True)


def test_local_checkpoint_reads_committed_trees_only(tmp_path, monkeypatch):
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "stage"))
    assert local_checkpoint(str(tmp_path / "plain")) == str(tmp_path / "plain")  # a path is left alone
    remote = RemoteStore(f"file://{tmp_path}/store")
    remote.upload_tree(_ckpt(tmp_path / "src", "A"), "base")
    got = local_checkpoint(f"file://{tmp_path}/store/base")
    assert json.loads(open(f"{got}/state.json").read()) == {"tag": "A"}
    remote.upload_tree(_ckpt(tmp_path / "src2", "B"), "run/final")  # a run directory's final/
    assert json.loads(open(f"{local_checkpoint(f'file://{tmp_path}/store/run')}/state.json").read()) == {"tag": "B"}
    shutil.copytree(tmp_path / "src", tmp_path / "store" / "unpublished")  # files without a manifest
    with pytest.raises(UserError, match="checkpoint file://.*/unpublished: no committed checkpoint there"):
        local_checkpoint(f"file://{tmp_path}/store/unpublished")


def test_dry_run_probes_the_uri(tmp_path):
    from tests.deploy.test_cluster_config import postrain

    RemoteStore(f"file://{tmp_path}/base").upload_tree(_ckpt(tmp_path / "src", "A"), "")
    args = ["grpo", "--domain", "reverse", "--init", f"file://{tmp_path}/base", "--iterations", "1", "--dry-run", "--out"]
    res = postrain(*args, f"file://{tmp_path}/run")
    assert res.returncode == 0, res.stderr
    rows = {ln.split()[0]: ln for ln in res.stdout.splitlines()[1:-1]}
    assert f"ok      run directory file://{tmp_path}/run (local): probe object written, read back, deleted" in rows["storage"]
    assert f"ok      file://{tmp_path}/base: committed, 2 files, 76 bytes" in rows["checkpoint"]
    assert not (tmp_path / "run").exists(), "a dry run leaves nothing behind"
    args[4] = f"file://{tmp_path}/src"  # files, no manifest: not a committed checkpoint
    res = postrain(*args, "file:///proc/postrain-run")
    assert res.returncode == 2 and "storage   FAILED  storage file:///proc/postrain-run/.probe-" in res.stdout
    assert f"checkpoint FAILED  checkpoint file://{tmp_path}/src: no committed checkpoint there" in res.stdout
    assert "cannot write" in res.stdout and "2 of 5 checks failed (storage, checkpoint)" in res.stderr


@pytest.mark.slow
def test_grpo_resumed_from_a_uri_repeats_the_uninterrupted_run(tmp_path, monkeypatch, reverse_base, uninterrupted):
    from deploy.grpo_loop import run_grpo

    uri = f"file://{tmp_path}/uri-run"
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "machine1"))
    s = RunStorage(uri, "grpo")
    s.catalog = s.local / "dataplane" / "catalog.db"
    s.prepare()
    first = run_grpo(_cfg(*s.overrides()), "reverse", reverse_base, s.local, iterations=2, quiet=True,
                     stop_after=1, storage=s)
    assert first["iterations_done"] == 1
    remote = RemoteStore(uri)
    assert remote.latest_tree("checkpoints") == "iter_00000001"
    assert remote.list("dataplane/store/shards", recursive=True) and remote.exists("metrics.jsonl")
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "machine2"))  # resumed from what the URI holds
    r = RunStorage(uri, "grpo")
    r.catalog = r.local / "dataplane" / "catalog.db"
    r.prepare(resume=True)
    assert r.catalog.is_file()  # the catalog as of the checkpoint, from the URI
    run_grpo(_cfg(*r.overrides()), "reverse", reverse_base, r.local, iterations=2, quiet=True, resume=True,
             storage=r)
    got = tmp_path / "got"
    got.mkdir()
    (got / "metrics.jsonl").write_bytes(remote.get("metrics.jsonl"))
    assert [_seeded(x) for x in _rows(uninterrupted, "train")] == [_seeded(x) for x in _rows(got, "train")]
    assert remote.manifest("final") is not None and remote.latest_tree("checkpoints") == "iter_00000002"


def test_storage_verb_pushes_and_pulls_a_checkpoint(tmp_path, capsys):
    from deploy.cli import main

    uri = f"file://{tmp_path}/s/base"
    assert main(["storage", "push", str(_ckpt(tmp_path / "src", "A")), uri]) == 0
    assert main(["storage", "pull", uri, str(tmp_path / "got")]) == 0
    assert json.loads((tmp_path / "got" / "state.json").read_text()) == {"tag": "A"}
    assert main(["storage", "check", uri]) == 0
    out = capsys.readouterr().out
    assert f"2 files, 76 bytes -> {uri} (committed)" in out and "sha256 verified" in out


def test_storage_pull_keeps_a_directory_that_holds_files(tmp_path, capsys):
    """A pull into a directory with files in it (a typo, `.`, a home directory) deletes nothing unless asked."""
    from deploy.cli import main

    uri = f"file://{tmp_path}/s/base"
    assert main(["storage", "push", str(_ckpt(tmp_path / "src", "A")), uri]) == 0
    keep = tmp_path / "work"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    assert main(["storage", "pull", uri, str(keep)]) == 2
    assert "is not empty" in capsys.readouterr().err and (keep / "notes.txt").read_text() == "mine"
    assert main(["storage", "pull", uri, str(keep / "notes.txt")]) == 2
    assert "is not a directory" in capsys.readouterr().err and (keep / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert main(["storage", "pull", uri, str(tmp_path / "empty")]) == 0
    assert main(["storage", "pull", uri, str(keep), "--replace"]) == 0
    assert sorted(p.name for p in keep.iterdir()) == sorted(p.name for p in (tmp_path / "empty").iterdir())
