"""Objects and committed trees under pyarrow.fs URIs: real pyarrow filesystems (`file://` through
LocalFileSystem, a SubTreeFileSystem), a writer killed midway, corrupt and hostile manifests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from core.errors import UserError
from dataplane.errors import ChecksumError
from dataplane.remote import MANIFEST, RemoteStore, is_uri

ROOT = Path(__file__).resolve().parents[2]


def _stores(tmp_path):
    yield RemoteStore(f"file://{tmp_path}/uri")
    yield RemoteStore("bucket/prefix", filesystem=pafs.SubTreeFileSystem(str(tmp_path / "sub"), pafs.LocalFileSystem()))


def _tree(d: Path, tag: str) -> Path:
    (d / "model").mkdir(parents=True)
    (d / "model" / "model.safetensors").write_bytes(tag.encode() * 1000)
    (d / "state.json").write_text(json.dumps({"tag": tag}))
    return d


def test_is_uri():
    assert is_uri("s3://b/p") and is_uri("file:///x") and not is_uri("/x/y") and not is_uri("runs/a")


@pytest.mark.parametrize("which", [0, 1])
def test_objects_round_trip(tmp_path, which):
    s = list(_stores(tmp_path))[which]
    assert s.get("a/b.json") is None and not s.exists("a/b.json")
    s.put("a/b.json", b"one")
    s.put("a/b.json", b"two")  # replaced whole
    assert s.get("a/b.json") == b"two"
    assert s.list("a") == ["a/b.json"]  # no temp keys left
    assert s.delete("a/b.json") and not s.delete("a/b.json")
    assert "probe object written, read back, deleted" in s.probe()
    assert s.list("", recursive=True) == []


@pytest.mark.parametrize("which", [0, 1])
def test_tree_round_trip_verifies_every_file(tmp_path, which):
    s = list(_stores(tmp_path))[which]
    src = _tree(tmp_path / "src", "A")
    s.publish_tree("ckpt", "iter_00000001", src)
    assert s.latest_tree("ckpt") == "iter_00000001"
    got = tmp_path / "got"
    m = s.download_tree("ckpt/iter_00000001", got)
    assert set(m["files"]) == {"model/model.safetensors", "state.json"}
    assert (got / "model" / "model.safetensors").read_bytes() == b"A" * 1000
    # a file changed under its manifest: the download refuses it and leaves nothing at the target
    s.put("ckpt/iter_00000001/model/model.safetensors", b"B" * 1000)
    with pytest.raises(ChecksumError, match="sha256 or size differs"):
        s.download_tree("ckpt/iter_00000001", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_hostile_manifest_is_refused(tmp_path):
    s = RemoteStore(f"file://{tmp_path}/uri")
    s.put(f"t/{MANIFEST}", json.dumps({"format": "postrain-tree-1",
                                        "files": {"../../etc/x": {"sha256": "0" * 64, "bytes": 1}}}).encode())
    with pytest.raises(ChecksumError, match="leaves the tree"):
        s.download_tree("t", tmp_path / "out")
    s.put(f"t/{MANIFEST}", b"{not json")
    with pytest.raises(ChecksumError, match="not a postrain-tree-1 manifest"):
        s.manifest("t")


def test_uncommitted_tree_is_not_read(tmp_path):
    s = RemoteStore(f"file://{tmp_path}/uri")
    with pytest.raises(UserError, match="no committed tree"):
        s.download_tree("ckpt/iter_00000009", tmp_path / "x")


def test_exception_between_files_keeps_the_previous_checkpoint(tmp_path):
    s = RemoteStore(f"file://{tmp_path}/uri")
    s.publish_tree("ckpt", "iter_00000001", _tree(tmp_path / "a", "A"))

    def die(i):
        raise OSError("injected: connection lost after the first file")

    with pytest.raises(OSError, match="injected"):
        s.publish_tree("ckpt", "iter_00000002", _tree(tmp_path / "b", "B"), between_files=die)
    assert s.exists("ckpt/iter_00000002/model/model.safetensors")  # half of it is there ...
    assert s.latest_tree("ckpt") == "iter_00000001"  # ... and nobody trusts it
    # a re-save of the committed name cut midway un-commits it first: the reader falls back, never mixes
    with pytest.raises(OSError, match="injected"):
        s.publish_tree("ckpt", "iter_00000001", _tree(tmp_path / "c", "C"), between_files=die)
    assert s.latest_tree("ckpt") is None


_WRITER = """
import os, signal, sys
from dataplane.remote import RemoteStore
s = RemoteStore(sys.argv[1])
s.publish_tree("ckpt", sys.argv[3], sys.argv[2],
               between_files=(lambda i: os.kill(os.getpid(), signal.SIGKILL)) if sys.argv[4] == "kill" else None)
"""


@pytest.mark.parametrize("fs", ["file", "subtree"])
def test_writer_killed_midway_leaves_the_previous_checkpoint(tmp_path, fs):
    uri = f"file://{tmp_path}/uri"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, tag, mode in (("iter_00000001", "A", "ok"), ("iter_00000002", "B", "kill")):
        p = subprocess.run([sys.executable, "-c", _WRITER, uri, str(_tree(tmp_path / tag, tag)), name, mode], env=env)
        assert p.returncode == (-signal.SIGKILL if mode == "kill" else 0)
    s = (RemoteStore(uri) if fs == "file" else
         RemoteStore("uri", filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())))
    assert s.list("ckpt/iter_00000002", recursive=True) == ["ckpt/iter_00000002/model/model.safetensors"]
    assert s.latest_tree("ckpt") == "iter_00000001"
    s.download_tree("ckpt/iter_00000001", tmp_path / "got")
    assert json.loads((tmp_path / "got" / "state.json").read_text()) == {"tag": "A"}


def test_unresolvable_and_unwritable_uris_are_named(tmp_path):
    with pytest.raises(UserError, match=r"storage nosuch://x/y: pyarrow.fs cannot resolve it"):
        RemoteStore("nosuch://x/y")
    with pytest.raises(UserError, match=r"storage file:///proc/postrain-probe/.probe-\w+: cannot write"):
        RemoteStore("file:///proc/postrain-probe").probe()  # writable by nobody, root included
