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


@pytest.mark.parametrize("seed,max_rows,tile_rows", [(0, 3, 16), (1, 1024, 16), (2, 1, 16), (3, 7, 2), (4, 1024, 3)])
def test_step_group_reads_equal_item_by_item_appends(tmp_path, monkeypatch, seed, max_rows, tile_rows):
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
