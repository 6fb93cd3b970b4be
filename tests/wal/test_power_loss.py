"""Simulated power cuts (core.powercut) on the token WAL and the environment log: after every cut of the
recorded workloads, everything acknowledged is there, recovery opens the log, nothing but the written
prefix is there and the log takes the next token. The two canaries (no commit fdatasync; no directory
fsync after a new segment) are caught within the default trials. And the recovery rule that a power
cut needs: a hole inside the last flush, with that flush's later frames intact after it, is a torn
tail; a hole followed by a frame of a later flush is corruption."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import wal
from bench._power_loss import canaries
from bench._power_loss.cases import DEFAULT_TRIALS, run_default
from bench._power_loss.trials import image_seed, reproduce, run_trial
from bench._power_loss.wal_cases import CONFIGS, EnvCase, TokenCase
from wal import codec, segments


@pytest.mark.parametrize("seed", DEFAULT_TRIALS["wal"]["seeds"])
def test_token_wal_power_cuts(seed):
    out = run_trial(TokenCase(), seed, cuts=DEFAULT_TRIALS["wal"]["cuts"], recovery_cuts=2)
    assert out.cuts >= DEFAULT_TRIALS["wal"]["cuts"] and out.recovery_cuts > 0
    assert out.failed == 0, out.first


@pytest.mark.parametrize("seed", DEFAULT_TRIALS["envlog"]["seeds"])
def test_envlog_power_cuts(seed):
    out = run_trial(EnvCase(), seed, cuts=DEFAULT_TRIALS["envlog"]["cuts"])
    assert out.cuts > 150 and out.failed == 0, out.first


@pytest.mark.parametrize("canary", canaries.CANARIES, ids=lambda c: c.name)
def test_canary_is_caught_within_the_default_trials(canary):
    assert run_default(canary.case, canary=canary).problems["lost"] > 0, f"{canary.name}: the removed sync went unseen"


def test_a_reported_failure_is_reproduced_exactly(tmp_path):
    ops = reproduce(EnvCase(), 7, 120, image_seed(7, 120, 0), tmp_path / "a")
    assert reproduce(EnvCase(), 7, 120, image_seed(7, 120, 0), tmp_path / "b") == ops
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*"))
    assert files and files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*"))
    assert all((tmp_path / "a" / f).is_dir() or (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
               for f in files)


def test_the_workload_covers_every_segment_configuration():
    cfgs = [TokenCase().config(s) for s in DEFAULT_TRIALS["wal"]["seeds"]]
    assert [(c.spare_segments, c.recycle_segments, c.direct_io) for c in cfgs] == [c[2:] for c in CONFIGS]


def _flush_of_three(path, commit_between: bool):
    w = wal.open(path, wal.WALConfig(preallocate_bytes=4096))
    w.append("t", 0, [1], [-1.0], 0)
    w.commit()
    for k in range(3):
        w.append("t", 1 + 40 * k, [k + 2] * 40, [-0.5] * 40, 0)  # frames of ~500 B: one per sector or so
        if commit_between:
            w.commit()
    w.commit()
    w.close()
    seg = segments.list_segments(path)[-1][1]
    buf = seg.read_bytes()
    starts = [off for off, _ in codec.iter_frames(buf, codec.SEGMENT_HEAD_BYTES, 0)]
    return seg, buf, starts


def test_a_hole_inside_the_last_flush_is_a_torn_tail(tmp_path):
    seg, buf, starts = _flush_of_three(tmp_path / "w", commit_between=False)
    assert codec.starts_flush(buf, starts[1]) and not codec.starts_flush(buf, starts[2])
    data = bytearray(buf)
    data[starts[1]:starts[2]] = bytes(starts[2] - starts[1])  # the flush's first frame never reached the disk
    seg.write_bytes(bytes(data))
    w = wal.open(tmp_path / "w")  # no CorruptionError: nothing of that flush was acknowledged
    assert w.tokens("t") == [1] and w.recovery.torn_bytes_cut > 0 and w.recovery.corruption == []
    w.close()


def test_a_hole_followed_by_a_later_flush_is_corruption(tmp_path):
    seg, buf, starts = _flush_of_three(tmp_path / "w", commit_between=True)
    assert all(codec.starts_flush(buf, s) for s in starts)
    data = bytearray(buf)
    data[starts[1]:starts[2]] = bytes(starts[2] - starts[1])
    seg.write_bytes(bytes(data))
    shutil.copytree(tmp_path / "w", tmp_path / "v")
    with pytest.raises(wal.CorruptionError, match="not a torn tail"):
        wal.open(tmp_path / "w")
    w = wal.open(tmp_path / "v", repair=True)
    assert w.tokens("t") == [1] and w.recovery.repaired
    w.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 130))
def test_token_wal_many_workloads(seed):
    out = run_trial(TokenCase(steps=150), seed, images=3, recovery_cuts=4)
    assert out.failed == 0, out.first


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 110))
def test_envlog_many_workloads(seed):
    out = run_trial(EnvCase(calls=120), seed, images=3, recovery_cuts=4)
    assert out.failed == 0, out.first


def test_a_batched_decode_step_starts_a_flush_only_as_the_first_frame_of_its_batch(tmp_path):
    """The step group's per-step path marks its frame like every other append: a flush's first frame
    only (recovery tells a hole in the last flush from corruption by the mark of a later one)."""
    w = wal.open(tmp_path / "w")
    ids = ["a", "b", "c"]
    w.append_step(ids, [0, 0, 0], [1, 2, 3], [-1.0] * 3, 0)  # starts the group (general path)
    w.commit()
    for k in range(1, 4):  # the group's next rows (fast path): one flush alone, then two in one flush
        w.append_step(ids, np.full(3, k, np.int64), np.arange(3, dtype=np.int32), -np.ones(3), 0)
        if k != 2:
            w.commit()
    w.close()
    buf = segments.list_segments(tmp_path / "w")[-1][1].read_bytes()
    starts = [off for off, _ in codec.iter_frames(buf, codec.SEGMENT_HEAD_BYTES, 0)]
    assert [codec.starts_flush(buf, s) for s in starts] == [True, True, True, False]
