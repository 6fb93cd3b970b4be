"""Split resume: the head re-prefilled while the snapshot's tail is read gives the KV and the draws of a
whole restore; a damaged tail, a KV that does not fit and a missing snapshot fall back to re-prefill with
their reason; the split point follows the measured rates."""
import pytest
import torch

import rollout.snapshot as snap
from rollout import restore
from rollout.engine import Engine
from rollout.sampling import SamplingParams
from rollout.snapshot import SnapshotStore, encode

P = SamplingParams(temperature=1.0, max_new_tokens=60, ignore_eos=True)
BLOCK = 8


@pytest.fixture
def blocks(monkeypatch):
    monkeypatch.setattr(snap, "BLOCK_TOKENS", BLOCK)
    monkeypatch.setattr(restore, "SPLIT_ON_CPU", True)


def _run(eng, rid):
    while eng.seqs[rid].state == "run":
        eng.accept(eng.step())
    return eng.seqs[rid].tokens


def _snapshotted(tiny_policy, tmp_path, steps=40):
    """A trajectory decoded `steps` tokens, its snapshot stored, and the tokens it went on to draw."""
    model, tok = tiny_policy
    prompt = tok.encode("add 58+7=")
    eng = Engine(model, tok, seed=3, max_batch=2)
    eng.add("r", prompt, [False] * len(prompt), P)
    for _ in range(steps):
        eng.accept(eng.step())
    seq = eng.seqs["r"]
    kv, covered = eng.export_kv("r")
    store = SnapshotStore(tmp_path / "kv")
    store.put("r", encode("r", seq.tokens[:covered], kv, eng.version, eng.fingerprint))
    tokens, sampled = list(seq.tokens), list(seq.sampled)
    return store, tokens, sampled, kv, covered, _run(eng, "r")


def _slot_kv(eng, rid, n):
    s = eng.seqs[rid].slot
    return [t[s, :, :n].clone() for t in eng.kv.k + eng.kv.v]


def test_split_resume_equals_a_whole_restore(tiny_policy, tmp_path, blocks):
    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    whole = Engine(model, tok, seed=3, max_batch=2)
    r0 = restore.resume(whole, store, restore.SplitPolicy(enabled=False), "r", tokens, sampled, P)
    assert (r0.kv_tokens, r0.head_tokens, r0.rejected) == (covered, 0, "")
    split = Engine(model, tok, seed=3, max_batch=2)
    policy = restore.SplitPolicy(split_cached=True)  # the snapshot was just written: in the page cache
    r = restore.resume(split, store, policy, "r", tokens, sampled, P)
    start = restore.SplitPolicy().start(covered, BLOCK, 1, False)  # nothing measured yet: about the middle
    assert covered >= 2 * BLOCK and r.head_tokens == start > 0 and r.kv_tokens == covered - start
    assert r.prefilled == start + (len(tokens) - 1 - covered) and r.rejected == ""
    for a, b in zip(_slot_kv(whole, "r", covered), _slot_kv(split, "r", covered)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _run(split, "r") == _run(whole, "r") == want
    assert policy.prefill_s_per_token > 0 and policy.read_s_per_byte[True] or policy.read_s_per_byte[False]


def test_the_tail_comes_from_the_snapshot_not_from_a_prefill(tiny_policy, tmp_path, blocks):
    """A snapshot whose tail KV was scaled (checksums recomputed: a valid snapshot of other KV) restores the
    scaled tail and a freshly prefilled head."""
    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, _ = _snapshotted(tiny_policy, tmp_path)
    odd = {k: v.clone() for k, v in kv.items()}
    for v in odd.values():
        v[:, BLOCK:] *= 2
    store.put("r", encode("r", tokens[:covered], odd, 0, Engine(model, tok).fingerprint))
    eng = Engine(model, tok, seed=3, max_batch=2)
    policy = restore.SplitPolicy(split_cached=True)
    policy.observe_prefill(1, 1.0)  # a second a token prefilled; 4 s a token read: one block read beside the rest
    bpt = sum(t.shape[0] * t.shape[2] * t.element_size() for t in kv.values())
    policy.read_s_per_byte[True] = policy.read_s_per_byte[False] = 4.0 / bpt
    r = restore.resume(eng, store, policy, "r", tokens, sampled, P)
    last = (covered - 1) // BLOCK * BLOCK
    assert r.head_tokens == last and r.kv_tokens == covered - last
    got = _slot_kv(eng, "r", covered)
    for name, t in zip([f"k.{i}" for i in range(len(eng.kv.k))] + [f"v.{i}" for i in range(len(eng.kv.v))], got):
        torch.testing.assert_close(t[:, last:], odd[name][:, last:])
        torch.testing.assert_close(t[:, :last], kv[name][:, :last], rtol=1e-5, atol=1e-5)


def test_a_damaged_tail_is_rejected_and_the_rest_re_prefilled(tiny_policy, tmp_path, blocks):
    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    path = store.path("r")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x20  # the last piece: every read reads it
    open(path, "wb").write(bytes(data))
    eng = Engine(model, tok, seed=3, max_batch=2)
    r = restore.resume(eng, store, restore.SplitPolicy(split_cached=True), "r", tokens, sampled, P)
    assert r.rejected == "corrupt" and r.kv_tokens == 0 and r.head_tokens > 0
    assert r.prefilled == len(tokens) - 1
    reprefilled = Engine(model, tok, seed=3, max_batch=2)
    reprefilled.add("r", tokens, sampled, P)
    for a, b in zip(_slot_kv(reprefilled, "r", covered), _slot_kv(eng, "r", covered)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _run(eng, "r") == want
    whole = Engine(model, tok, seed=3, max_batch=2)
    r = restore.resume(whole, store, restore.SplitPolicy(enabled=False), "r", tokens, sampled, P)
    assert (r.rejected, r.kv_tokens, r.prefilled) == ("corrupt", 0, len(tokens) - 1) and _run(whole, "r") == want


def test_a_cold_snapshot_splits_with_the_default_policy(tiny_policy, tmp_path, blocks):
    import os

    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    fd = os.open(store.path("r"), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced when written: the pages can go
    os.close(fd)
    eng = Engine(model, tok, seed=3, max_batch=2)
    policy = restore.SplitPolicy()
    r = restore.resume(eng, store, policy, "r", tokens, sampled, P)
    assert r.head_tokens > 0 and r.kv_tokens == covered - r.head_tokens and _run(eng, "r") == want
    assert policy.read_s_per_byte[False] is not None  # a cold read teaches the cold rate


def test_the_read_rate_counts_the_reads_not_what_follows_them(tiny_policy, tmp_path, blocks, monkeypatch):
    """The tail's upload waits for the head's prefill on the engine's stream; the policy's read rate must
    not count that wait as reading (stood in for here by a pause after the reads)."""
    import os
    import time

    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    views = snap._views
    monkeypatch.setattr(snap, "_views", lambda buf, layout: (time.sleep(0.2), views(buf, layout))[1])
    for split in (True, False):
        fd = os.open(store.path("r"), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        policy = restore.SplitPolicy(enabled=split)
        eng = Engine(model, tok, seed=3, max_batch=2)
        r = restore.resume(eng, store, policy, "r", tokens, sampled, P)
        assert (r.head_tokens > 0) == split and _run(eng, "r") == want
        f = store.open("r", tokens, eng.version, eng.fingerprint, eng.dtype)
        nbytes = (covered - r.head_tokens) * f.bytes_per_token
        f.close()
        assert 0 < policy.read_s_per_byte[False] * nbytes < 0.1


def test_a_partly_cached_snapshot_splits_and_teaches_no_rate(tiny_policy, tmp_path, blocks, monkeypatch):
    """Half its pages in the page cache (what a split resume leaves): not cached, so it splits, but its read
    is neither a cold nor a warm one, and the rates stay as they were."""
    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    monkeypatch.setattr(snap, "_resident_fraction", lambda fd, size: 0.5)
    policy = restore.SplitPolicy()
    policy.observe_read(1000, 0.001, cached=False)
    eng = Engine(model, tok, seed=3, max_batch=2)
    r = restore.resume(eng, store, policy, "r", tokens, sampled, P)
    assert r.head_tokens > 0 and r.kv_tokens == covered - r.head_tokens and _run(eng, "r") == want
    assert policy.read_s_per_byte == {False: 1e-6, True: None} and policy.prefill_s_per_token is not None


def test_a_kv_that_does_not_fit_and_a_missing_snapshot_fall_back(tiny_policy, tmp_path, blocks):
    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    wrong = {k: v[:1] for k, v in kv.items()}  # one kv head of two: a valid snapshot of another model's shape
    store.put("r", encode("r", tokens[:covered], wrong, 0, Engine(model, tok).fingerprint))
    for policy in (restore.SplitPolicy(split_cached=True), restore.SplitPolicy(enabled=False)):
        eng = Engine(model, tok, seed=3, max_batch=2)
        r = restore.resume(eng, store, policy, "r", tokens, sampled, P)
        assert (r.rejected, r.kv_tokens, r.prefilled) == ("mismatch", 0, len(tokens) - 1)
        assert eng.capacity == 1 and _run(eng, "r") == want
    eng = Engine(model, tok, seed=3, max_batch=2)
    r = restore.resume(eng, store, restore.SplitPolicy(), "other", tokens, sampled, P)
    assert r.rejected == "missing" and _run(eng, "other")


class _FailingReads(SnapshotStore):
    """Opens and validates as the store does, then points the file's descriptor at a directory: every read
    of the payload fails in the kernel (EISDIR), as reads from a failing disk do."""

    def open(self, *args, **kwargs):
        import os

        f = super().open(*args, **kwargs)
        d = os.open(self._local, os.O_RDONLY | os.O_DIRECTORY)
        os.dup2(d, f.fd)
        os.close(d)
        return f


@pytest.mark.parametrize("reader", ["c", "python"])
def test_a_snapshot_that_fails_to_read_is_re_prefilled(tiny_policy, tmp_path, blocks, monkeypatch, reader):
    """An I/O error reading the payload (split: in the tail's thread; whole: in the caller's) rejects the
    snapshot as unreadable; the tokens are re-prefilled and the engine holds the request once."""
    if reader == "c" and snap._kvread is None:
        pytest.skip("the C reader is not built here")
    monkeypatch.setattr(snap, "READER", reader)
    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    failing = _FailingReads(store.uri)
    for policy in (restore.SplitPolicy(split_cached=True), restore.SplitPolicy(enabled=False)):
        eng = Engine(model, tok, seed=3, max_batch=2)
        r = restore.resume(eng, failing, policy, "r", tokens, sampled, P)
        assert (r.rejected, r.kv_tokens, r.prefilled) == ("unreadable", 0, len(tokens) - 1)
        assert eng.capacity == 1 and _run(eng, "r") == want


def test_a_snapshot_whose_header_fails_to_read_is_re_prefilled(tiny_policy, tmp_path, blocks):
    """A directory where the snapshot file should be: it opens, and its header read fails (EISDIR)."""
    import os

    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    os.unlink(store.path("r"))
    os.mkdir(store.path("r"))
    eng = Engine(model, tok, seed=3, max_batch=2)
    r = restore.resume(eng, store, restore.SplitPolicy(), "r", tokens, sampled, P)
    assert (r.rejected, r.kv_tokens, r.prefilled) == ("unreadable", 0, len(tokens) - 1) and _run(eng, "r") == want


def test_an_engine_on_the_cpu_reads_whole(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setattr(snap, "BLOCK_TOKENS", BLOCK)
    model, tok = tiny_policy
    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    eng = Engine(model, tok, seed=3, max_batch=2)
    r = restore.resume(eng, store, restore.SplitPolicy(split_cached=True), "r", tokens, sampled, P)
    assert (r.head_tokens, r.kv_tokens, r.rejected) == (0, covered, "") and _run(eng, "r") == want


def test_the_split_point_follows_the_rates():
    assert restore.SplitPolicy().start(64, 8, 100, True) == 0  # a cached snapshot reads whole
    p = restore.SplitPolicy(split_cached=True)
    assert p.start(15, 8, 100, False) == 0  # under two blocks: read whole
    assert p.start(64, 8, 100, False) == 32  # nothing measured: the middle
    p.observe_prefill(100, 1.0)  # 10 ms a token
    p.observe_read(1000, 1.0, cached=False)  # 1 ms a byte: 100 ms a token read cold
    p.observe_read(1000, 0.001, cached=True)  # 1 us a byte: 0.1 ms a token warm
    assert p.start(64, 8, 100, False) == 64  # reading is 10x dearer: prefill all (0.64 s; the last block read: 0.8)
    assert p.start(64, 8, 100, True) == 0  # warm reading is 100x cheaper: read it all
    p.observe_read(1000, 0.1, cached=False)  # 0.1 ms a byte now: the average moves half way
    assert p.read_s_per_byte[False] == pytest.approx(0.5 * 1e-3 + 0.5 * 1e-4)
    assert p.start(64, 8, 100, False) == 56  # 55 ms a token read against 10 ms a prefill: 54 of 64 tokens
    p.observe_prefill(100, 10.0)  # one slow head (100 ms a token): the lowest recent rate still counts
    assert p.start(64, 8, 100, False) == 56
    for _ in range(8):  # slow heads only, a window of them: 100 ms a token against 55 read, reading more pays
        p.observe_prefill(100, 10.0)
    assert p.start(64, 8, 100, False) == 24  # 2.4 s of head against 2.2 s of tail
    q = restore.SplitPolicy()
    q.observe_prefill(1000, 1.0)
    q.read_s_per_byte[False] = 1e-5  # a token: 1 ms either way at 100 bytes
    assert q.start(64, 8, 100, False) == 32 and q.start(4096, 1024, 100, False) == 2048
    assert q.start(4000, 1024, 100, False) == 2048 and q.start(2100, 1024, 100, False) == 1024
    assert restore.SplitPolicy(enabled=False).start(64, 8, 100, False) == 0


def test_a_line_is_fitted_only_through_heads_of_different_sizes():
    assert restore.affine_fit([(1000, 0.01), (1200, 0.0115)]) is None  # within 1.5x of each other: noise
    fixed, rate = restore.affine_fit([(1024, 0.0064 + 1024 * 3e-6), (4096, 0.0064 + 4096 * 3e-6), (2048, 0.0064 + 2048 * 3e-6)])
    assert fixed == pytest.approx(0.0064) and rate == pytest.approx(3e-6)
    assert restore.affine_fit([(1000, 0.02), (3000, 0.01)]) is None  # a falling line is not a cost
    assert restore.affine_fit([(1000, 0.001), (3000, 0.01)]) is None  # nor is a negative fixed part


def test_the_split_counts_the_fixed_cost_of_a_head_prefill():
    """Heads of 2k-4k tokens that cost 6.4 ms + 3 us a token (an H100 host at 8k tokens), a read of 6 us a
    token: the split balances the fixed part too, so the head is longer than by the rate alone."""
    n, block, bpt = 8192, 1024, 12 * 1024
    policy = restore.SplitPolicy()
    for head in (2048, 3072, 4096, 3072):
        policy.observe_prefill(head, 0.0064 + head * 3e-6)
    policy.observe_read(bpt * 5120, 5120 * 6e-6, cached=False)
    at = (n * 6e-6 - 0.0064) / (3e-6 + 6e-6)  # 6.4 ms + 3 us·at = 6 us·(n − at)
    assert policy.start(n, block, bpt, False) == round(at / block) * block == 5120
    rate_only = restore.SplitPolicy()  # the same costs seen at one head size: a rate alone, the fixed part in it
    for _ in range(4):
        rate_only.observe_prefill(3072, 0.0064 + 3072 * 3e-6)
    rate_only.observe_read(bpt * 5120, 5120 * 6e-6, cached=False)
    assert rate_only.start(n, block, bpt, False) == 4096


def test_a_split_that_would_cost_more_than_the_whole_read_reads_whole():
    """A 2k-token snapshot on an H100 host: the middle split's head took 29.5 ms (the prefill's fixed part)
    and its 1k-token tail 11.8 ms cold. Split again it would take ~29.5 ms, read whole ~23.6: it reads whole.
    An 8k snapshot still splits: by the same rates 2k + 6k take ~71 ms, a whole read ~94."""
    bpt = 12 * 1024
    policy = restore.SplitPolicy()
    assert policy.start(2048, 1024, bpt, False) == 1024  # nothing measured: the middle
    policy.observe_prefill(1024, 0.0295)
    policy.observe_read(1024 * bpt, 0.0118, cached=False)
    assert policy.start(2048, 1024, bpt, False) == 0
    assert policy.start(8192, 1024, bpt, False) == 2048


def test_a_slow_first_head_does_not_keep_later_resumes_from_splitting():
    """An H100 host at 8k tokens: the first split's 4k head took 480 ms (a new shape's one-time costs), 27 ms
    after. Priced at the first, every split loses to the whole read (~76 ms); after `explore_every` whole reads
    one split measures the head again, and from then on the resumes split."""
    bpt, n = 12 * 1024, 8192
    policy = restore.SplitPolicy(explore_every=3)
    assert policy.start(n, 1024, bpt, False) == 4096
    policy.observe_prefill(4096, 0.48)
    policy.observe_read(4096 * bpt, 0.038, cached=False)
    choices = [policy.start(n, 1024, bpt, False) for _ in range(3)]
    assert choices == [0, 0, n]  # the third whole read in a row: every token prefilled, never timed alone
    policy.observe_prefill(n, 0.120, alone=True)  # dearer than the whole read (~76 ms)
    choices = [policy.start(n, 1024, bpt, False) for _ in range(3)]
    assert choices[:2] == [0, 0] and 0 < choices[2] < n  # the next exploration measures a split's head
    policy.observe_prefill(choices[2], 0.027)
    assert all(0 < policy.start(n, 1024, bpt, False) < n for _ in range(5))


def test_a_prefill_of_every_token_is_priced_by_prefills_timed_alone():
    """An 8k resume on an H100 host: heads prefilled beside their tails' reads took 75-83 ms for 1-2k tokens
    (the first, 4k, 792 ms), a whole cold read 64 ms, all 8k tokens prefilled alone 35 ms. Priced by the
    heads' line (66 ms + 8.2 us a token: 134 ms) the prefill lost to the whole read on every resume (0.46x a
    re-prefill); one exploration times it alone, and from then on the snapshot is left unread."""
    bpt, n = 12 * 1024, 8192
    policy = restore.SplitPolicy()
    for head, sec in ((4096, 0.792), (1024, 0.0749), (1024, 0.0224), (2048, 0.0833)):
        policy.observe_prefill(head, sec)
    policy.observe_read(n * bpt, 0.064, cached=False)
    assert policy.recompute_s(n, policy.prefill_model()) == pytest.approx(0.134, abs=0.002)
    choices = [policy.start(n, 1024, bpt, False) for _ in range(4)]
    assert choices == [0, 0, 0, n]  # the fourth whole read in a row: an exploration prefills every token
    policy.observe_prefill(n, 0.035, alone=True)
    assert policy.recompute_s(n, policy.prefill_model()) == pytest.approx(0.035)
    assert policy.recompute_s(6000, policy.prefill_model()) == pytest.approx(0.035 * 6000 / n)  # scaled
    assert policy.recompute_s(4096, policy.prefill_model()) > 0.1  # 2x smaller: the heads' line again
    assert [policy.start(n, 1024, bpt, False) for _ in range(3)] == [n] * 3
    assert 0 < policy.start(n, 1024, bpt, False) < n  # every explore_every-th: a split's head timed again
    assert policy.start(n, 1024, bpt, False) == n
    assert policy.start(n, 1024, bpt, True) == 0  # a snapshot in the page cache still reads whole


def test_a_snapshot_under_two_blocks_is_read_or_left_unread_by_the_measured_costs():
    """A 2k resume on an H100 host: its snapshot covers 2,047 tokens, under two blocks, so it cannot split;
    it was read whole at 16.7 ms cold where a prefill of every token took 15.0. After `explore_every` whole
    reads one prefills every token, and from then on the quicker of the two is taken; on a host where the
    prefill took 31.5 ms the snapshot is read again."""
    bpt, n = 12 * 1024, 2047
    policy = restore.SplitPolicy()
    choices = [policy.start(n, 1024, bpt, False) for _ in range(4)]
    assert choices == [0, 0, 0, n]  # nothing timed alone: the fourth whole read in a row explores
    policy.observe_read(n * bpt, 0.0167, cached=False)
    policy.observe_prefill(n, 0.0150, alone=True)
    assert [policy.start(n, 1024, bpt, False) for _ in range(6)] == [n] * 6
    assert policy.start(n, 1024, bpt, True) == 0  # in the page cache: read whole
    slow = restore.SplitPolicy()
    slow.observe_read(n * bpt, 0.0167, cached=False)
    slow.observe_prefill(n, 0.0315, alone=True)
    assert [slow.start(n, 1024, bpt, False) for _ in range(6)] == [0] * 6
    assert [restore.SplitPolicy(enabled=False).start(n, 1024, bpt, False) for _ in range(6)] == [0] * 6


def test_one_slow_head_among_several_does_not_tilt_the_prefill_line():
    """Heads of 1-2k tokens that took 28-31 ms (a prefill's fixed part on an H100 host) and a first 4k head
    that took 150 ms of one-time costs: the least-squares line through them has a negative fixed part (no line
    at all), the line through two of them closest to all passes by the slow one."""
    obs = [(4096, 0.150), (2048, 0.030), (2048, 0.031), (1024, 0.028)]
    fixed, rate = restore.affine_fit(obs)
    assert 0.024 <= fixed <= 0.027 and 1.5e-6 <= rate <= 3.5e-6
    bpt, n = 12 * 1024, 8192
    policy = restore.SplitPolicy()
    for head, sec in obs:
        policy.observe_prefill(head, sec)
    policy.observe_read(n * bpt, 0.072, cached=False)
    assert 0 < policy.start(n, 1024, bpt, False) < n  # the head prefilled beside the tail's read


def test_a_snapshot_slower_to_read_than_to_recompute_is_left_unread(tiny_policy, tmp_path, blocks):
    """Where reading even one block costs more than prefilling every token (a slow remote store), the tokens
    are prefilled and the snapshot is not read: the resume continues exactly as a restore would."""
    model, tok = tiny_policy
    import os

    store, tokens, sampled, kv, covered, want = _snapshotted(tiny_policy, tmp_path)
    fd = os.open(store.path("r"), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # not in the page cache, which reads whole
    os.close(fd)
    policy = restore.SplitPolicy()
    policy.observe_prefill(8, 0.0100)  # 10 ms + ~0.1 ms a token
    policy.observe_prefill(32, 0.0125)
    policy.read_s_per_byte[False] = 1.0  # a second a byte
    assert policy.start(covered, BLOCK, 100, False) == covered
    eng = Engine(model, tok, seed=3, max_batch=2)
    r = restore.resume(eng, store, policy, "r", tokens, sampled, P)
    assert (r.kv_tokens, r.head_tokens, r.rejected) == (0, 0, restore.RECOMPUTE) and r.prefilled >= covered
    assert _run(eng, "r") == want
    assert policy.alone[-1][0] == r.prefilled  # the prefill of all of them, timed alone, prices the next
