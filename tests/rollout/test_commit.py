"""AsyncCommitter: one STEP record per decode step, appended on the caller's thread for an in-process
log and in the commit thread otherwise; payloads come back only once durable; failures reach ready()."""
from __future__ import annotations

import threading

import pytest

import wal
from rollout.commit import AsyncCommitter
from rollout.engine import Draw


class Recording:
    """A log that records which thread appended and committed (wraps a real TokenWAL)."""

    def __init__(self, inner, in_memory: bool):
        self.inner, self.appends_in_memory = inner, in_memory
        self.append_threads: list[str] = []
        self.commits = 0
        self.fail_commit = False

    def append_step(self, *a):
        self.append_threads.append(threading.current_thread().name)
        self.inner.append_step(*a)

    def commit(self):
        if self.fail_commit:
            raise wal.LogClosedError("disk gone")
        self.commits += 1
        return self.inner.commit()


def _step(k, ids=("a", "b", "c")):
    return [Draw(t, k, 100 * i + k, -0.5 - i) for i, t in enumerate(ids)]


@pytest.mark.parametrize("in_memory", [True, False])
def test_each_step_is_one_record_and_comes_back_only_when_durable(tmp_path, in_memory):
    inner = wal.open(tmp_path / "w")
    log = Recording(inner, in_memory)
    c = AsyncCommitter(log, max_lag=2)
    assert c.inline is in_memory
    for k in range(30):
        c.submit(_step(k), 1, k)
        for done in c.ready():
            assert inner.length("a") >= done + 1  # durable before it is handed back
    c.ready(wait_all=True)
    c.close()
    assert inner.tokens("b") == [100 + k for k in range(30)] and inner.logprobs("c") == [-2.5] * 30
    assert inner.stats()["next_lsn"] == 30  # one STEP record per step, not one record per trajectory
    main = threading.current_thread().name
    assert set(log.append_threads) == ({main} if in_memory else {"wal-commit"})
    inner.close()


def test_a_failed_commit_is_raised_by_ready_and_nothing_is_exposed(tmp_path):
    inner = wal.open(tmp_path / "w")
    log = Recording(inner, True)
    c = AsyncCommitter(log, max_lag=1)
    c.submit(_step(0), 0, "ok")
    assert c.ready(wait_all=True) == ["ok"]
    log.fail_commit = True
    c.submit(_step(1), 0, "lost")
    with pytest.raises(wal.LogClosedError, match="disk gone"):
        c.ready(wait_all=True)
    log.fail_commit = False
    c.close()
    inner.close()


def test_group_steps_commit_every_n_steps_and_flush_forces_one(tmp_path):
    inner = wal.open(tmp_path / "w")
    log = Recording(inner, True)
    c = AsyncCommitter(log, group_steps=4)
    for k in range(8):
        c.submit(_step(k), 0, k, flush=k == 1)
    assert sorted(c.ready(wait_all=True)) == list(range(8))
    assert log.commits == 3  # steps 0-1 (flushed), 2-5, 6-7 (wait_all)
    c.close()
    inner.close()
    with pytest.raises(ValueError):
        AsyncCommitter(log, group_steps=0)
