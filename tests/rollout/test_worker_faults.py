"""Worker faults on real components (WAL, snapshot store, engine): a snapshot store that fails, a prompt that
cannot be admitted, a trajectory that ended on the context, logits that are not finite, a commit that fails,
ids too long for a file name, temp files of a writer killed mid-write. None of them may lose a trajectory or
leave the WAL locked."""
import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import wal
from dataplane.remote import RemoteStore
from rollout.config import EngineConfig
from rollout.engine import NonFiniteLogits
from rollout.sampling import SamplingParams
from rollout.snapshot import SnapshotStore
from rollout.types import ENV_LOGPROB, Request
from rollout.worker import RolloutWorker
from tests.rollout.test_worker import PARAMS, _check, _drain, _requests, _spec, reference  # noqa: F401  (the fixture)

REPO = Path(__file__).resolve().parents[2]


class FailingFS(pafs.FileSystemHandler):
    """A local directory as a pyarrow filesystem whose writes, reads or deletes fail on demand, as an object
    store that stops answering (503) does: `fail({"write"}, after=1)` lets one write through, fails the rest."""

    def __init__(self):
        self.inner, self.failing, self.after = pafs.LocalFileSystem(), set(), 0

    def fail(self, kinds=(), after=0):
        self.failing, self.after = set(kinds), after

    def _op(self, kind):
        if kind in self.failing:
            if self.after > 0:
                self.after -= 1
            else:
                raise OSError(errno.EIO, f"{kind}: service unavailable (503)")

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def get_type_name(self):
        return "failing"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.inner.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError(errno.EPERM, "not here")

    def delete_file(self, path):
        self._op("delete")
        self.inner.delete_file(path)

    def move(self, src, dest):
        self.inner.move(src, dest)

    def copy_file(self, src, dest):
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path):
        self._op("read")
        return self.inner.open_input_stream(path)

    def open_input_file(self, path):
        self._op("read")
        return self.inner.open_input_file(path)

    def open_output_stream(self, path, metadata):
        self._op("write")
        return self.inner.open_output_stream(path)

    def open_append_stream(self, path, metadata):
        self._op("write")
        return self.inner.open_append_stream(path)


def _remote_worker(tmp, ckpt):
    """A worker whose snapshot store is remote (a pyarrow filesystem), with a handle to make that store fail."""
    spec = _spec(tmp, ckpt, "w")
    spec.snapshot_uri = "mock://kv"
    w = RolloutWorker(spec)
    fs = FailingFS()
    w.store._remote = RemoteStore(str(tmp / "remote-kv"), filesystem=pafs.PyFileSystem(fs))
    return w, fs


def test_a_remote_store_that_fails_a_write_mid_suspend_loses_no_trajectory(tmp_path, tiny_ckpt, reference):
    """The store fails from the second of three snapshot writes on: the failures are counted, the suspend goes
    on, every request is queued again, and all three finish as uninterrupted (one from its snapshot, two
    re-prefilled)."""
    w, fs = _remote_worker(tmp_path, tiny_ckpt)
    w.submit(_requests(3))
    w.run(3)
    fs.fail({"write"}, after=1)
    assert w.suspend() == ["arith-0", "arith-1", "arith-2"]
    assert (w.counters["snapshots_written"], w.counters["snapshots_failed"]) == (1, 2)
    assert [r.traj_id for r in w.queue] == ["arith-0", "arith-1", "arith-2"] and not w.engine.seqs
    fs.fail()
    out = _drain(w)
    w.close()
    _check(out, reference)
    assert (w.counters["kv_restore"], w.counters["reprefill"], w.counters["snapshot_missing"]) == (1, 2, 2)


def test_a_remote_store_that_fails_reads_and_deletes_is_an_unreadable_snapshot(tmp_path, tiny_ckpt, reference):
    """Snapshots written, then the store fails every read and delete: each resume re-prefills (`unreadable`),
    each finalize leaves its snapshot (counted), and the trajectories finish as uninterrupted."""
    w, fs = _remote_worker(tmp_path, tiny_ckpt)
    w.submit(_requests(3))
    w.run(3)
    w.suspend()
    fs.fail({"read", "delete"})
    out = _drain(w)
    w.close()
    _check(out, reference)
    c = w.counters
    assert c["snapshot_unreadable"] == c["reprefill"] == c["snapshots_undeleted"] == 3 and c["kv_restore"] == 0


@pytest.mark.parametrize("prompt", ["", "1" * 300], ids=["empty", "past_max_len"])
def test_a_prompt_that_cannot_be_admitted_is_refused_at_submit(tmp_path, tiny_ckpt, prompt):
    w = RolloutWorker(_spec(tmp_path, tiny_ckpt, "w"))
    try:
        bad = [Request("ok-0", "arith", "add 1+2=", PARAMS), Request("bad", "arith", prompt, PARAMS)]
        with pytest.raises(ValueError, match="request 'bad': a prompt of"):
            w.submit(bad)
        assert not w.queue and not w.reqs  # nothing of the call queued
        w.submit(bad[:1])
        assert set(_drain(w)) == {"ok-0"}
    finally:
        w.close()


def test_an_error_admitting_one_request_loses_none_of_its_batch(tmp_path, tiny_ckpt):
    """The WAL holds another prompt under the second id of an admission batch: the run raises naming it, the
    first request is admitted and the failed one and the rest are queued again, nothing dropped."""
    spec = _spec(tmp_path, tiny_ckpt, "w")
    log = wal.open(spec.wal_path)
    log.append("clash", 0, [5, 6, 7], [ENV_LOGPROB] * 3, 0)
    log.commit()
    log.close()
    w = RolloutWorker(spec)
    try:
        w.submit([Request(t, "arith", "add 1+2=", PARAMS) for t in ("ok-0", "clash", "ok-1")])
        with pytest.raises(ValueError, match="'clash': the WAL holds another prompt"):
            w.run(2)
        assert list(w.engine.seqs) == ["ok-0"] and [r.traj_id for r in w.queue] == ["clash", "ok-1"]
    finally:
        w.close()


def test_a_trajectory_that_ended_on_the_context_resumes_as_complete(tmp_path, tiny_ckpt):
    """A prompt of max_len - 1 tokens draws one token and ends on the context with max_len tokens; the worker
    dies before the pool's acknowledgement. Its replacement admits it as complete (no KV needed) beside the
    other request of its batch, and reports the same trajectory."""
    spec = _spec(tmp_path, tiny_ckpt, "w", batch=2)
    spec.engine = EngineConfig(max_batch=2, strict=True, max_len=64)
    w = RolloutWorker(spec)
    prompt = "add " + "1" * 59
    assert len(w.engine.tok.encode(prompt)) == 63
    reqs = [Request("edge", "arith", prompt, PARAMS), Request("other", "arith", "add 1+2=", PARAMS)]
    w.submit(reqs)
    first = {f.traj_id: f for f in w.run(1).finished}
    w.close()
    assert first["edge"].stop_reason == "context" and len(first["edge"].tokens) == 64
    w2 = RolloutWorker(spec)
    w2.submit(reqs)
    out = _drain(w2)
    w2.close()
    assert set(out) == {"edge", "other"} and out["edge"].tokens == first["edge"].tokens
    assert w2.counters["resumed_complete"] == 1


@pytest.mark.parametrize("chunk", [1, 4])
def test_logits_that_are_not_finite_fail_the_worker_before_anything_is_accepted(tmp_path, tiny_ckpt, chunk):
    """Weights whose final norm is infinite: the run raises naming the trajectory, the position and the policy
    version, the engine holds exactly what the WAL holds, every later run refuses, and the WAL is released for
    a replacement that finishes the trajectories."""
    spec = _spec(tmp_path, tiny_ckpt, "w")
    spec.engine = EngineConfig(max_batch=4, strict=False, decode_chunk=chunk)
    w = RolloutWorker(spec)
    w.submit(_requests(2))
    w.run(3)
    state = {k: v.clone() for k, v in w.engine.model.state_dict().items()}
    final_norm = next(k for k in state if "norm" in k and "layers" not in k)
    state[final_norm][:] = float("inf")
    w.update_weights(state, 1)
    with pytest.raises(NonFiniteLogits, match=r"trajectory 'arith-\d', position \d+: the logits of policy version 1"):
        w.run(2)
    assert {t: len(s.tokens) for t, s in w.engine.seqs.items()} == {t: w.wal.length(t) for t in w.engine.seqs}
    with pytest.raises(RuntimeError, match="worker w failed .*NonFiniteLogits"):
        w.run(2)
    w.close()
    w2 = RolloutWorker(spec)
    w2.submit(_requests(2))
    assert set(_drain(w2)) == {"arith-0", "arith-1"}
    w2.close()


def test_close_after_a_failed_commit_releases_the_wal(tmp_path, tiny_ckpt, monkeypatch):
    spec = _spec(tmp_path, tiny_ckpt, "w")
    w = RolloutWorker(spec)
    w.submit(_requests(2))
    w.run(2)

    def failing():
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(w.wal, "commit", failing)  # the disk fails: every commit from now on
    with pytest.raises(OSError):
        w.run(2)
    with pytest.raises(OSError):
        w.close()  # the commit's error, after every part is closed
    assert not w.committer._thread.is_alive()
    wal.open(spec.wal_path).close()  # the lock is free


def test_an_id_too_long_for_a_file_name_still_snapshots_and_finalizes(tmp_path, tiny_ckpt):
    w = RolloutWorker(_spec(tmp_path, tiny_ckpt, "w"))
    long_id = "grpo-calc-" + "x" * 240
    w.submit([Request(long_id, "arith", "add 1+2=", SamplingParams(max_new_tokens=4))])
    assert [f.traj_id for f in _drain(w).values()] == [long_id]  # finalized, snapshot deleted
    w.submit([Request(long_id + "b", "arith", "add 1+2=", PARAMS)])
    w.run(2)
    assert w.suspend() == [long_id + "b"] and w.counters["snapshots_written"] == 1
    assert all(len(f".{Path(p).name}.tmp.4194304") <= 255 for p in w.store.ids_on_disk())  # its temp name fits too
    _drain(w)
    w.close()
    assert w.counters["kv_restore"] == 1 and not w.store.ids_on_disk()
    digest = hashlib.blake2b(b"arith-0", digest_size=4).hexdigest()
    assert w.store._name("arith-0") == f"arith-0-{digest}.kv.safetensors"  # short ids keep their snapshots' names


CHILD = """
import sys, time
from core import atomic, fileio
real = fileio.fsync
def slow(fd):  # the fsync of a large snapshot: the process is killed here
    real(fd)
    print("in fsync", flush=True)
    time.sleep(60)
fileio.fsync = slow
atomic.write_atomic(sys.argv[1], b"kv" * 4096)
"""


def _killed_mid_write(path: str) -> int:
    """Write `path` atomically in a child process, SIGKILLed during the temp file's fsync; the child's pid."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, path], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "in fsync"
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    return p.pid


def test_temp_files_of_writers_killed_mid_write_are_removed(tmp_path):
    """A dead writer's temp file goes when its trajectory's snapshot is deleted, or when a store is opened once it
    is older than TEMP_GRACE_S; a live writer's stays (the directory is shared by the pool's workers)."""
    kv = tmp_path / "kv"
    store = SnapshotStore(kv)
    dead = _killed_mid_write(store.path("a"))
    young = kv / f".{store._name('a')}.tmp.{dead}"
    old_dead = kv / f".{store._name('b')}.tmp.{dead}"
    old_live = kv / f".{store._name('c')}.tmp.{os.getpid()}"
    assert young.is_file()
    for p in (old_dead, old_live):
        p.write_bytes(b"kv")
        os.utime(p, (time.time() - 120, time.time() - 120))
    store = SnapshotStore(kv)  # a replacement opens the store
    assert young.is_file() and not old_dead.exists() and old_live.is_file()
    assert not store.delete("a") and not young.exists() and old_live.is_file()
