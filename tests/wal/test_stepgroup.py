"""The batched-decode fast path (StepGroup) against item-by-item appends: same reads (tokens, log-probs,
versions, committed length) at every point, same log after reopening, same errors, whatever mix of
steps, membership changes, policy versions, commits, reads and group capacity a seeded run draws."""
from __future__ import annotations

import numpy as np
import pytest

import wal
from wal import stepgroup


def _same(a, b, ids) -> None:
    for t in ids:
        assert a.length(t) == b.length(t), t
        assert a.tokens(t) == b.tokens(t) and a.logprobs(t) == b.logprobs(t), t
        assert a.policy_versions(t) == b.policy_versions(t), t


@pytest.fixture(params=["c", "c-row", "python"])
def step_impl(request, monkeypatch):
    """The step: Store._step_fast in one C call (`stepgroup.store_step`, what TokenWAL.append_step tries
    first), the Python _step_fast around the C row encoder, or the Python that both replace."""
    if request.param == "python":
        monkeypatch.setattr(stepgroup, "_stepc", None)
    elif stepgroup._stepc is None or stepgroup.store_step is None:
        pytest.fail("wal._stepc is not built: `make install` compiles it (needs a C compiler)")
    if request.param != "c":
        monkeypatch.setattr(stepgroup, "store_step", None)
    return request.param


@pytest.mark.parametrize("seed,max_rows,tile_rows", [(0, 3, 16), (1, 1024, 16), (2, 1, 16), (3, 7, 2), (4, 1024, 3)])
def test_step_group_reads_equal_item_by_item_appends(tmp_path, monkeypatch, step_impl, seed, max_rows, tile_rows):
    monkeypatch.setattr(stepgroup, "MAX_ROWS", max_rows)  # small groups: dissolved and restarted often
    if tile_rows != stepgroup.TILE_ROWS:  # the tiled transposition (partial last tiles included); else one copy
        monkeypatch.setattr(stepgroup, "TILE_ROWS", tile_rows)
        monkeypatch.setattr(stepgroup, "_TILED_MIN_COLUMNS", 1)
    rng = np.random.default_rng(seed)
    a, b = wal.open(tmp_path / "a"), wal.open(tmp_path / "b")
    pool = [f"traj-{k}" for k in range(40)]
    ids = pool[:24]
    version = 0
    for step in range(300):
        u = rng.random()
        if u < 0.04:  # membership changes (a request finished, another joined)
            ids = [t for t in ids if rng.random() > 0.2] + [t for t in pool if t not in ids and rng.random() < 0.1]
            ids = ids or pool[:3]
        if u > 0.97:
            version += 1
        known = b._store.tokens.trajs  # the reference's appended (not only committed) lengths
        pos = [known[t].length if t in known else 0 for t in ids]
        toks = rng.integers(0, 50_000, len(ids), dtype=np.int32)
        lps = -rng.random(len(ids))
        form = rng.integers(3)  # the same step given as numpy arrays, lists, or a tuple of ids
        if form == 0:
            a.append_step(ids, np.asarray(pos, np.int64), toks, lps, version)
        elif form == 1:
            a.append_step(list(ids), pos, toks.tolist(), lps.tolist(), version)
        else:
            a.append_step(tuple(ids), np.asarray(pos, np.uint32), toks, lps, version)
        for k, t in enumerate(ids):
            b.append(t, pos[k], toks[k:k + 1], lps[k:k + 1], version)
        if rng.random() < 0.5:
            a.commit()
            b.commit()
        if rng.random() < 0.1:  # a read in the middle of a group (sees the committed prefix only)
            _same(a, b, pool)
        t = ids[0]
        if rng.random() < 0.05 and a.length(t):  # an exact repeat of a committed token: acknowledged, not written
            a.append_step([t], [a.length(t) - 1], a.tokens(t)[-1:], a.logprobs(t)[-1:], a.policy_versions(t)[-1])
    _same(a, b, pool)
    a.commit()
    b.commit()
    _same(a, b, pool)
    assert a.stats()["live_tokens"] == b.stats()["live_tokens"] > 0
    a.close()
    b.close()
    a, b = wal.open(tmp_path / "a"), wal.open(tmp_path / "b")  # replayed from the logs
    _same(a, b, pool)
    a.close()
    b.close()


def test_uncommitted_rows_stay_hidden_and_errors_leave_the_group_consistent(tmp_path):
    w = wal.open(tmp_path)
    ids = [f"t{k}" for k in range(5)]
    for p in range(4):
        w.append_step(ids, np.full(5, p), np.arange(5) + p, np.full(5, -0.5), 0)
        if p < 2:
            w.commit()
    assert [w.length(t) for t in ids] == [2] * 5  # rows 2 and 3 are not durable yet
    assert w.tokens("t3") == [3, 4]
    w.append_step(ids, np.full(5, 4), np.arange(5), np.full(5, -0.5), 1)  # the group goes on after the read
    with pytest.raises(wal.GapError):
        w.append_step(ids, np.full(5, 9), np.arange(5), np.full(5, -0.5), 1)
    with pytest.raises(wal.ConflictError):
        w.append_step(ids, np.full(5, 4), np.arange(5) + 1, np.full(5, -0.5), 1)
    with pytest.raises(wal.codec.CodecError, match="NaN"):
        w.append_step(ids, np.full(5, 5), np.arange(5), np.full(5, np.nan), 1)
    with pytest.raises(wal.codec.CodecError, match="0..2"):
        w.append_step(ids, np.full(5, 5), -np.arange(5) - 1, np.full(5, -0.5), 1)
    w.finalize("t0")
    with pytest.raises(wal.FinalizedError):
        w.append_step(ids, np.full(5, 5), np.arange(5), np.full(5, -0.5), 1)
    w.append_step(ids[1:], np.full(4, 5), np.arange(4), np.full(4, -0.25), 2)
    w.commit()
    assert w.tokens("t4") == [4, 5, 6, 7, 4, 3] and w.policy_versions("t4") == [0, 0, 0, 0, 1, 2]
    assert w.logprobs("t1")[-2:] == [-0.5, -0.25]
    w.close()
    w = wal.open(tmp_path)
    assert w.trajectories() == ids[1:] and w.tokens("t4") == [4, 5, 6, 7, 4, 3]
    w.close()


def test_a_full_group_is_one_index_block():
    """MAX_ROWS is the index's block size: a group that starts block-aligned hands each trajectory whole blocks."""
    from wal.index import BLOCK_TOKENS

    assert stepgroup.MAX_ROWS == BLOCK_TOKENS


def test_the_numpy_fast_path_checks_what_the_general_path_checks(tmp_path, monkeypatch, step_impl):
    """Steps as a decode loop holds them (int32 / float64 / int64 arrays) take Store._step_fast (in one C
    call where it is built); a bad value, another dtype or shape, a numpy version or a closed log leaves it
    for the general path, which logs or refuses exactly as it does for any other input. The Python fast
    path never takes a step the C one declined."""
    from wal.store import Store

    fast_hits = []  # one per step: whether a fast path took it
    after_c = []  # what the Python fast path did with steps the C one declined
    original = Store._step_fast
    c_step = stepgroup.store_step

    def counting(self, *args):
        done = original(self, *args)
        (after_c if c_step is not None else fast_hits).append(done)
        return done

    def c_counting(*args):
        taken = c_step(*args)
        fast_hits.append(bool(taken))
        return taken

    if c_step is not None:
        monkeypatch.setattr(stepgroup, "store_step", c_counting)
    w = wal.open(tmp_path)
    Store._step_fast = counting
    try:
        ids = [f"t{k}" for k in range(6)]
        tok = lambda p: (np.arange(6, dtype=np.int32) * 7 + p).astype(np.int32)  # noqa: E731
        lp = lambda p: np.linspace(-3.0, -0.1, 6) - p  # noqa: E731
        pos = lambda p: np.full(6, p, np.int64)  # noqa: E731
        w.append_step(ids, pos(0), tok(0), lp(0), 0)  # starts the group (general path)
        w.append_step(ids, pos(1), tok(1), lp(1), 0)
        assert fast_hits[-1] is True
        bad_tok = tok(2)
        bad_tok[4] = -5
        bad_lp = lp(2)
        bad_lp[3] = np.nan
        for args, err in (((ids, pos(2), bad_tok, lp(2), 0), "0..2"), ((ids, pos(2), tok(2), bad_lp, 0), "NaN"),
                          ((ids, pos(2), tok(2), lp(2), -1), "policy_version")):
            with pytest.raises(wal.codec.CodecError, match=err):
                w.append_step(*args)
            assert fast_hits[-1] is False
        inf_lp = lp(2)
        inf_lp[0] = -np.inf
        w.append_step(ids, pos(2), tok(2), inf_lp, 0)  # -inf is a log-probability, not NaN; the group went on
        assert fast_hits[-1] is True
        for args, err in (((ids, pos(4), tok(3), lp(3), 0), "gap"), ((ids, pos(1), tok(3), lp(3), 0), "rewrites")):
            with pytest.raises((wal.GapError, wal.ConflictError), match=err):
                w.append_step(*args)  # checked item by item (the group is merged into the index first)
            assert fast_hits[-1] is False
        # other dtypes and a numpy version: the general path (which starts a new group), same result
        w.append_step(ids, pos(3).astype(np.uint32), tok(3).astype(np.int64), lp(3).astype(np.float32), np.int64(1))
        assert fast_hits[-1] is False
        w.append_step(ids, pos(4), tok(4), lp(4), 1)
        assert fast_hits[-1] is True
        w.commit()
        for j, t in enumerate(ids):
            assert w.tokens(t) == [j * 7 + p for p in range(5)]
            assert w.logprobs(t)[:2] == [lp(0)[j], lp(1)[j]] and w.logprobs(t)[2] == inf_lp[j]
            assert w.logprobs(t)[3] == float(np.float32(lp(3)[j])) and w.policy_versions(t) == [0, 0, 0, 1, 1]
        w.close()
        with pytest.raises(wal.LogClosedError):
            w.append_step(ids, pos(5), tok(5), lp(5), 1)
        assert fast_hits[-1] is False and True not in after_c
    finally:
        Store._step_fast = original
    w = wal.open(tmp_path)
    assert w.tokens("t5") == [35 + p for p in range(5)]
    w.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replayed_step_runs_equal_item_by_item_appends(tmp_path, monkeypatch, seed):
    """Recovery replays a run of STEP records over the same trajectories as rows of a step group (one row copy
    per record). Reopened logs (small segments: runs cross segment ends, retention copies steps forward without
    finalized items) read exactly as item-by-item appends do, and the row path is taken."""
    from wal.store import Store

    monkeypatch.setattr(stepgroup, "MAX_ROWS", 50)  # full groups restart during replay
    rows = [0]
    replay_step = Store._replay_step

    def counting(self, rec):
        took = replay_step(self, rec)
        rows[0] += took
        return took

    monkeypatch.setattr(Store, "_replay_step", counting)
    rng = np.random.default_rng(seed)
    # retain_bytes under two segments: sealed segments are compacted whatever their live fraction, so whole
    # live STEP records are copied forward (the same ids at old positions: repeats on replay)
    cfg = wal.WALConfig(segment_bytes=64 << 10, preallocate_bytes=16 << 10, compact_live_fraction=0.6,
                        retain_bytes=96 << 10)
    a, b = wal.open(tmp_path / "a", cfg), wal.open(tmp_path / "b", cfg)
    pool = [f"traj-{k}" for k in range(60)]
    ids, done, version = pool[:16], set(), 0
    for step in range(400):
        u = rng.random()
        if u < 0.03:  # a request finished (finalized) or others joined
            gone = [t for t in ids if rng.random() < 0.15]
            a.finalize_many(gone)
            b.finalize_many(gone)
            done.update(gone)
            ids = [t for t in ids if t not in done] + [t for t in pool if t not in ids and t not in done and rng.random() < 0.2]
            ids = ids or [t for t in pool if t not in done][:2]
        if u > 0.98:
            version += 1
        known = b._store.tokens.trajs
        pos = [known[t].length if t in known else 0 for t in ids]
        toks = rng.integers(0, 50_000, len(ids), dtype=np.int32)
        lps = -rng.random(len(ids))
        a.append_step(ids, np.asarray(pos, np.int64), toks, lps, version)
        for k, t in enumerate(ids):
            b.append(t, pos[k], toks[k:k + 1], lps[k:k + 1], version)
        a.commit()
        b.commit()
        if step % 150 == 149:  # reopen in the middle: replay, then go on appending after it
            a.close()
            b.close()
            a, b = wal.open(tmp_path / "a", cfg), wal.open(tmp_path / "b", cfg)
            _same(a, b, [t for t in pool if t not in done])
    live = [t for t in pool if t not in done]
    a.close()
    b.close()
    a, b = wal.open(tmp_path / "a", cfg), wal.open(tmp_path / "b", cfg)
    _same(a, b, live)
    for t in done:
        with pytest.raises(wal.FinalizedError):
            a.tokens(t)
    segs = a._store.log.segment_list()
    assert len(segs) > 1 or segs[0][0] > 0, f"the run should span several segments (some reclaimed): {a.stats()}"
    assert rows[0] > 100, f"only {rows[0]} STEP records replayed as group rows over three reopens"
    assert a.stats()["live_tokens"] == b.stats()["live_tokens"] > 0
    a.close()
    b.close()
