"""The WAL's batched-decode step in C (wal/_stepc.c) against the Python step it replaces
(StepGroup._encode_row_py): byte-identical frames and identical groups for every step the fast path
takes, and None with nothing changed for every step it must leave to the general path."""
from __future__ import annotations

import numpy as np
import pytest

from wal import codec, stepgroup
from wal.index import Trajectory
from wal.stepgroup import StepGroup
from wal.types import STEP, StepRecord

_stepc = stepgroup._stepc


def test_the_c_step_is_built():
    assert _stepc is not None, "wal._stepc is not built: `make install` compiles it (needs a C compiler)"


def _group(n: int, base: int = 0, reuse=None) -> StepGroup:
    ids = [f"traj-{k:05d}-" + "x" * (k % 7) for k in range(n)]
    trajs = [Trajectory(i.encode()) for i in ids]
    for t in trajs:
        t.length = base
    return StepGroup(ids, trajs, [t.idb for t in trajs], reuse)


def _state(g: StepGroup):
    return (g.rows, g.next_B.tobytes(), g.tok_RB[:g.rows].tobytes(), g.lp_RB[:g.rows].tobytes(), list(g.version_R),
            list(g.lsn_R))


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
@pytest.mark.parametrize("seed,n", [(0, 1), (1, 5), (2, 64), (3, 512), (4, 3000)])
def test_c_and_python_write_the_same_frames_and_rows(monkeypatch, seed, n):
    rng = np.random.default_rng(seed)
    base = int(rng.integers(0, 1 << 40))
    c, py = _group(n, base), _group(n, base)
    for r in range(12):
        tok = rng.integers(0, 1 << 31, n, dtype=np.int32)
        lp = -rng.random(n) * 30
        lp[rng.random(n) < 0.1] = -np.inf  # a log-probability, not a NaN: taken
        pos = c.next_B.copy()
        version, lsn, mark = int(rng.integers(0, 1 << 62)), int(rng.integers(1, 1 << 62)), int(rng.choice([0, codec.FLUSH_MARK]))
        fc = c.encode_row(pos, tok, lp, version, lsn, mark)
        monkeypatch.setattr(stepgroup, "_stepc", None)
        fp = py.encode_row(pos, tok, lp, version, lsn, mark)
        monkeypatch.setattr(stepgroup, "_stepc", _stepc)
        assert fc is not None and fc == fp, f"row {r}: the frames differ"
        assert _state(c) == _state(py)
        rec = codec.decode(fc)  # a whole, checked frame of the step
        assert isinstance(rec, StepRecord) and rec.lsn == lsn and rec.policy_version == version
        assert codec.starts_flush(fc, 0) == (mark == codec.FLUSH_MARK)
        assert bytes(rec.tokens) == tok.tobytes() and bytes(rec.logprobs) == lp.tobytes() and list(rec.starts) == pos.tolist()
    # the frame is what the codec's own encoder writes, and decodes back
    assert fc == codec.encode_step_record(lsn, [t.idb for t in c.trajs], pos.tobytes(), version, tok.tobytes(),
                                          lp.tobytes(), mark)


def _bad_steps(g: StepGroup):
    """(name, positions, tokens, log-probs, version) of steps the fast path must not take."""
    n = g.n
    pos, tok, lp = g.next_B.copy(), np.arange(n, dtype=np.int32), -np.linspace(0.1, 3, n)
    neg = tok.copy()
    neg[n // 2] = -1
    nan = lp.copy()
    nan[-1] = np.nan
    later = pos.copy()
    later[0] += 1
    wide_tok, wide_lp, wide_pos = np.zeros((n, 2), np.int32), np.zeros((n, 2)), np.zeros((n, 2), np.int64)
    wide_pos[:, 0] = pos
    yield "tokens int64", pos, tok.astype(np.int64), lp, 0
    yield "tokens uint32", pos, tok.astype(np.uint32), lp, 0
    yield "tokens big-endian", pos, tok.astype(">i4"), lp, 0
    yield "log-probs float32", pos, tok, lp.astype(np.float32), 0
    yield "positions int32", pos.astype(np.int32), tok, lp, 0
    yield "positions uint64", pos.astype(np.uint64), tok, lp, 0
    yield "tokens as a tuple", pos, tuple(tok.tolist()), lp, 0
    yield "a bool in a list of tokens", pos, [True] + tok.tolist()[1:], lp, 0
    yield "a numpy int in a list of tokens", pos, [np.int32(0)] + tok.tolist()[1:], lp, 0
    yield "a float in a list of tokens", pos, [0.0] + tok.tolist()[1:], lp, 0
    yield "a token past int32 in a list", pos, tok.tolist()[:-1] + [1 << 31], lp, 0
    yield "a negative token in a list", pos, neg.tolist(), lp, 0
    yield "a list of tokens one short", pos, tok.tolist()[:-1], lp, 0
    yield "an int in a list of log-probs", pos, tok, [0] + lp.tolist()[1:], 0
    yield "a NaN in a list of log-probs", pos, tok, nan.tolist(), 0
    yield "a numpy float in a list of log-probs", pos, tok, [np.float64(-1.0)] + lp.tolist()[1:], 0
    yield "a numpy int in a list of positions", [np.int64(pos[0])] + pos.tolist()[1:], tok, lp, 0
    yield "not the next position, in a list", later.tolist(), tok, lp, 0
    yield "a position past int64 in a list", pos.tolist()[:-1] + [1 << 63], tok, lp, 0
    yield "tokens as bytes", pos, tok.tobytes(), lp, 0
    yield "one token short", pos, tok[:-1], lp, 0
    yield "one log-prob more", pos, tok, np.append(lp, -1.0), 0
    yield "strided tokens", pos, wide_tok[:, 0], lp, 0
    yield "strided log-probs", pos, tok, wide_lp[:, 1], 0
    yield "strided positions", wide_pos[:, 0], tok, lp, 0
    yield "2-D tokens", pos, tok.reshape(1, n), lp, 0
    yield "a negative token", pos, neg, lp, 0
    yield "a NaN", pos, tok, nan, 0
    yield "not the next position", later, tok, lp, 0
    yield "the previous positions", pos - 1, tok, lp, 0
    yield "a negative version", pos, tok, lp, -1
    yield "a version past u64", pos, tok, lp, 1 << 64


@pytest.mark.parametrize("impl", ["c", "python"])
def test_steps_off_the_fast_path_change_nothing(monkeypatch, impl):
    if impl == "python":
        monkeypatch.setattr(stepgroup, "_stepc", None)
    elif _stepc is None:
        pytest.skip("wal._stepc not built (test_the_c_step_is_built fails)")
    g = _group(9, 17)
    g.encode_row(g.next_B.copy(), np.arange(9, dtype=np.int32), -np.ones(9), 3, 1, codec.FLUSH_MARK)
    before = _state(g)
    for name, pos, tok, lp, version in _bad_steps(g):
        if impl == "python" and (version < 0 or version >= 1 << 64 or name.startswith("strided")):
            continue  # Store._step_fast refuses these versions first; numpy copies strided arrays (C leaves them)
        assert g.encode_row(pos, tok, lp, version, 2, 0) is None, name
        assert _state(g) == before, name


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
def test_a_full_group_and_bad_arguments():
    g = _group(4)
    g.capacity = 2
    step = lambda: (g.next_B.copy(), np.zeros(4, np.int32), np.zeros(4))  # noqa: E731
    assert g.encode_row(*step(), 0, 1, 0) is not None and g.encode_row(*step(), 0, 2, 0) is not None
    assert g.encode_row(*step(), 0, 3, 0) is None and g.rows == 2  # full: the caller starts a new group
    pos, tok, lp = step()
    with pytest.raises(TypeError, match="14 arguments"):
        _stepc.encode_row(tok, lp, pos)
    with pytest.raises(TypeError, match="bytes"):
        _stepc.encode_row(tok, lp, pos, g.next_B, g.tok_RB, g.lp_RB, 0, bytearray(8), g.ids_blob, 0, 1, 0, STEP, codec.crc32c)
    with pytest.raises(ValueError, match="one u16"):
        _stepc.encode_row(tok, lp, pos, g.next_B, g.tok_RB, g.lp_RB, 0, b"\0" * 6, g.ids_blob, 0, 1, 0, STEP, codec.crc32c)
    with pytest.raises(ValueError, match="u32"):
        _stepc.encode_row(tok, lp, pos, g.next_B, g.tok_RB, g.lp_RB, 0, g.lens, g.ids_blob, 0, 1, 1 << 33, STEP, codec.crc32c)
    with pytest.raises(TypeError, match="int64"):
        _stepc.encode_row(tok, lp, pos, g.next_B.astype(np.int32), g.tok_RB, g.lp_RB, 0, g.lens, g.ids_blob, 0, 1, 0, STEP,
                          codec.crc32c)

    def broken(_):
        raise RuntimeError("checksum failed")
    g = _group(4)
    before = _state(g)
    with pytest.raises(RuntimeError, match="checksum failed"):  # raised, and the group is as it was
        _stepc.encode_row(*step()[1:], step()[0], g.next_B, g.tok_RB, g.lp_RB, 0, g.lens, g.ids_blob, 0, 1, 0, STEP,
                          broken)
    assert _state(g) == before


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
def test_a_step_that_is_a_view_of_the_rows():
    """A caller may hand back a row of the group's own arrays (memmove, not memcpy)."""
    g = _group(6)
    tok, lp = np.arange(6, dtype=np.int32) + 40, -np.arange(6) / 3
    g.encode_row(g.next_B.copy(), tok, lp, 0, 1, 0)
    frame = g.encode_row(g.next_B.copy(), g.tok_RB[0], g.lp_RB[0], 0, 2, 0)
    assert frame is not None and g.tok_RB[1].tolist() == tok.tolist() and g.lp_RB[1].tolist() == lp.tolist()


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
@pytest.mark.parametrize("dtype,n,rows", [(np.int32, 1, 1), (np.int32, 37, 100), (np.float64, 512, 300), (np.float64, 16, 0)])
def test_append_columns_is_a_transpose(dtype, n, rows):
    rng = np.random.default_rng(n)
    a = (rng.random((rows + 5, n)) * 1e6).astype(dtype)
    outs = [bytearray(b"head%d" % j) for j in range(n)]
    assert _stepc.append_columns(a, rows, outs) is None
    for j in range(n):
        assert bytes(outs[j]) == b"head%d" % j + a[:rows, j].tobytes()


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
def test_append_columns_refuses_and_changes_nothing():
    a = np.zeros((4, 3), np.float64)
    outs = [bytearray(b"x") for _ in range(3)]
    for args, err in (((a, 5, outs), ValueError), ((a, 2, outs[:2]), ValueError), ((a[:, :2], 2, outs[:2]), ValueError),
                      ((a.astype(np.int16), 2, outs), ValueError), ((a, 2, tuple(outs)), TypeError),
                      ((a, 2, [*outs[:2], b"x"]), TypeError), ((a, -1, outs), ValueError)):
        with pytest.raises(err):
            _stepc.append_columns(*args)
        assert outs == [bytearray(b"x")] * 3
    held = memoryview(outs[2])  # an exported bytearray cannot grow: the ones grown before it are cut back
    with pytest.raises(BufferError):
        _stepc.append_columns(a, 2, outs)
    held.release()
    assert outs == [bytearray(b"x")] * 3


@pytest.mark.parametrize("impl", ["c", "python"])
@pytest.mark.parametrize("n", [1, 64, 512])
def test_a_step_as_lists_is_the_step_as_arrays(monkeypatch, impl, n):
    """The rollout's committer hands a step over as lists of Python ints and floats: the fast path takes it
    and writes what it writes for the same step as numpy arrays."""
    if impl == "python":
        monkeypatch.setattr(stepgroup, "_stepc", None)
    elif _stepc is None:
        pytest.skip("wal._stepc not built (test_the_c_step_is_built fails)")
    rng = np.random.default_rng(n)
    arrays, lists = _group(n, 40), _group(n, 40)
    for r in range(3):
        tok = rng.integers(0, 1 << 31, n, dtype=np.int64).astype(np.int32)
        lp = np.where(rng.random(n) < 0.1, -np.inf, -rng.random(n) * 10.0 ** rng.integers(-300, 300, n))
        fa = arrays.encode_row(arrays.next_B.copy(), tok, lp, r, r + 1, 0)
        fl = lists.encode_row(lists.next_B.tolist(), tok.tolist(), lp.tolist(), r, r + 1, 0)
        assert fa is not None and fl == fa
        assert _state(lists) == _state(arrays)


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
def test_random_steps_give_the_python_answer_or_none():
    """Seeded random steps of every dtype, length, layout and value the arrays can take: the C step returns
    exactly the Python step's frame and group, or None where the Python step takes a layout C leaves to it
    (strided arrays), and never anything else."""
    rng = np.random.default_rng(7)
    dtypes = [np.int32, np.int64, np.uint32, np.float64, np.float32, np.int16, ">i4", ">f8", np.bool_]
    for trial in range(400):
        n = int(rng.integers(1, 40))
        base = int(rng.integers(0, 1000))
        c, py = _group(n, base), _group(n, base)
        for r in range(int(rng.integers(1, 6))):
            def arr(kind_default, make):
                dt = kind_default if rng.random() < 0.85 else dtypes[rng.integers(len(dtypes))]
                m = n + (0 if rng.random() < 0.95 else int(rng.integers(-1, 2)))
                with np.errstate(invalid="ignore", over="ignore"):
                    a = np.asarray(make(max(m, 0))).astype(dt)
                if rng.random() < 0.05:  # a strided view of the same values
                    wide = np.zeros((len(a), 2), a.dtype)
                    wide[:, 0] = a
                    a = wide[:, 0]
                elif rng.random() < 0.2:  # the same values as a list (Python ints, floats or bools)
                    return a.tolist()
                return a

            def spoil(a, bad, p=0.05):  # one element made bad in a few steps
                a = a.copy()
                if len(a) and rng.random() < p:
                    a[rng.integers(len(a))] = bad(a)
                return a
            tok = arr(np.int32, lambda m: spoil(rng.integers(0, 1 << 20, m), lambda a: -1))
            lp = arr(np.float64, lambda m: spoil(-rng.random(m), lambda a: np.nan))
            pos = arr(np.int64, lambda m: spoil(np.resize(c.next_B, m), lambda a: a[0] + 1))
            version = int(rng.integers(0, 5))
            fc = c.encode_row(pos, tok, lp, version, r + 1, 0)
            saved = stepgroup._stepc
            stepgroup._stepc = None
            try:
                fp = py.encode_row(pos, tok, lp, version, r + 1, 0)
            finally:
                stepgroup._stepc = saved
            strided = not all(a.flags.c_contiguous for a in (tok, lp, pos) if isinstance(a, np.ndarray))
            if fc is None and fp is not None:
                assert strided, f"trial {trial}: C refused a step the Python step took"
                py = _group(n, 0)  # the groups part ways here (the general path would take the step)
                break
            assert fc == fp, f"trial {trial} row {r}"
            assert _state(c) == _state(py)


def _run_steps(path, seed: int, c_step, monkeypatch) -> list[int]:
    """A seeded decode through TokenWAL with `c_step` as the store's C step (None: the Python fast path):
    steps as arrays and as lists, a few committed together, a batch past max_batch_bytes, steps the fast
    paths decline (a tuple of ids, a bool or numpy version, a NaN, membership changes). Returns what each
    step did: 0 declined, 1 logged, 2 logged and committed for the batch's size (C step only)."""
    import wal

    monkeypatch.setattr(stepgroup, "store_step", c_step)
    taken = []
    if c_step is not None:
        def counting(*args):
            taken.append(c_step(*args))
            return taken[-1]
        monkeypatch.setattr(stepgroup, "store_step", counting)
    rng = np.random.default_rng(seed)
    w = wal.open(path, wal.WALConfig(max_batch_bytes=1 << 16, segment_bytes=1 << 20))
    ids = [f"t{k}" for k in range(int(rng.integers(100, 300)))]  # 3-8 kB frames: some batches pass 64 kB
    pos = np.zeros(len(ids), np.int64)
    try:
        for s in range(300):
            n = len(ids)
            tok = rng.integers(0, 1 << 31, n, dtype=np.int32)
            lp = -rng.random(n)
            kind = rng.integers(0, 12)
            version = s // 50
            if kind == 0:  # a finished trajectory leaves, a new one joins: another group
                k = int(rng.integers(0, n))
                w.finalize(ids[k])
                ids = ids[:k] + ids[k + 1:] + [f"n{s}"]
                pos = np.concatenate([pos[:k], pos[k + 1:], [0]]).astype(np.int64)
                continue
            if kind == 1:
                w.append_step(tuple(ids), pos, tok, lp, version)
            elif kind == 2:
                w.append_step(ids, pos, tok, lp, np.int64(version))
            elif kind == 3:
                w.append_step(ids, pos.tolist(), tok.tolist(), lp.tolist(), version)
            elif kind == 4:
                bad = lp.copy()
                bad[0] = np.nan
                with pytest.raises(codec.CodecError, match="NaN"):
                    w.append_step(ids, pos, tok, bad, version)
                continue
            elif kind == 5:  # a bool is not the fast paths' version; the general path takes it as an int
                w.append_step(ids, pos, tok, lp, True)
            else:
                w.append_step(list(ids), pos, tok, lp, version)
            pos = pos + 1
            if kind == 11:
                w.commit()
        w.commit()
    finally:
        w.close()
    return taken


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_c_store_step_writes_the_log_the_python_fast_path_writes(tmp_path, monkeypatch, seed):
    """TokenWAL.append_step's C step (Store._step_fast in one call) against the Python fast path: the same
    segment files byte for byte, over a decode that takes, declines and forces commits."""
    taken = _run_steps(tmp_path / "c", seed, stepgroup.store_step, monkeypatch)
    _run_steps(tmp_path / "py", seed, None, monkeypatch)
    assert taken.count(1) > 100 and 2 in taken and 0 in taken
    c_files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert c_files == sorted(p.name for p in (tmp_path / "py").iterdir())
    for name in c_files:
        if (tmp_path / "c" / name).is_file() and name.endswith(".seg"):
            assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "py" / name).read_bytes(), name


@pytest.mark.skipif(_stepc is None, reason="wal._stepc not built (test_the_c_step_is_built fails)")
def test_the_c_store_step_declines_what_is_not_the_groups_next_row(tmp_path):
    """0, with nothing changed, for a step the Python path must take: ids not a list or not the group's,
    a version that is not an int in 0..2^64-1, a full group, a poisoned or closed log."""
    import wal

    w = wal.open(tmp_path)
    s = w._store
    ids = ["a", "b", "c"]
    tok, lp = np.array([1, 2, 3], np.int32), np.array([-1.0, -2.0, -3.0])
    w.append_step(ids, np.zeros(3, np.int64), tok, lp, 0)  # starts the group
    step = stepgroup.store_step
    before = (s.log.next_lsn, s.log.batch_bytes, s.tokens.group.rows)
    for args in ((tuple(ids), 1, 0), (["a", "b", "x"], 1, 0), (["a", "b"], 1, 0), (ids, 1, True), (ids, 1, -1),
                 (ids, 1, 1 << 64), (ids, 1, np.int64(0)), (ids, 1, 0.0), (ids, 2, 0)):
        got, pos = args[0], np.full(3, args[1], np.int64)
        assert step(s, got, pos, tok, lp, args[2]) == 0, args
        assert (s.log.next_lsn, s.log.batch_bytes, s.tokens.group.rows) == before
    assert step(s, ids, np.ones(3, np.int64), tok, lp, (1 << 64) - 1) == 1  # the largest version
    s.tokens.group.capacity = s.tokens.group.rows  # full
    assert step(s, ids, np.full(3, 2, np.int64), tok, lp, 0) == 0
    s.tokens.group.capacity = 4096
    s.log._error = OSError("injected")
    assert step(s, ids, np.full(3, 2, np.int64), tok, lp, 0) == 0
    s.log._error = None
    w.close()
    assert step(s, ids, np.full(3, 2, np.int64), tok, lp, 0) == 0
    assert s.log.mutex.acquire(blocking=False), "the store's mutex was left held"
