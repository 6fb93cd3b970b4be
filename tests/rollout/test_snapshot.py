"""KV snapshots: round trip, and every kind of bad snapshot is rejected with its reason."""
import pytest
import torch

from rollout.snapshot import SnapshotRejected, SnapshotStore, decode, encode

TOK = list(range(10, 30))


def _kv():
    g = torch.Generator().manual_seed(0)
    return {f"{kv}.{i}": torch.randn(2, 20, 8, generator=g) for i in range(2) for kv in "kv"}


@pytest.mark.parametrize("uri", ["local", "pyarrow"])
def test_round_trip_through_a_store(tmp_path, uri):
    store = SnapshotStore(tmp_path / "kv" if uri == "local" else f"file://{tmp_path}/kv")
    kv = _kv()
    store.put("traj/1", encode("traj/1", TOK, kv, 3, "fp"))
    h, got = decode(store.get("traj/1"), "traj/1", TOK + [5, 6], 3, "fp", torch.float32)
    assert h.token_count == 20 and all(torch.equal(got[k], kv[k]) for k in kv)
    h, got = store.load("traj/1", TOK + [5, 6], 3, "fp", torch.float32)  # the fast local path, or bytes
    assert h.token_count == 20 and all(torch.equal(got[k], kv[k]) for k in kv)
    assert store.get("other") is None and len(store.ids_on_disk()) == 1
    assert store.delete("traj/1") and store.get("traj/1") is None


def test_mem_fs_store():
    store = SnapshotStore("mock://kvstore")
    store.put("a", b"xyz")
    assert store.get("a") == b"xyz" and store.delete("a") and store.get("a") is None


def test_a_remote_store_sweeps_the_temp_keys_of_writers_that_died(tmp_path):
    """A write that never reached its move leaves `.NAME.tmp.*` on the object store; opening the store removes
    such keys older than the grace, and no other object."""
    import os
    import time

    import rollout.snapshot as snap

    root = tmp_path / "kv"
    store = SnapshotStore(f"local://{root}")
    store.put("a", b"xyz")
    name = store._name("a")
    dead, live = root / f".{name}.tmp.0123456789ab", root / f".{name}.tmp.ba9876543210"
    dead.write_bytes(b"half"), live.write_bytes(b"half")
    old = time.time() - snap.REMOTE_TEMP_GRACE_S - 60
    os.utime(dead, (old, old))
    os.utime(root / name, (old, old))  # an old snapshot stays
    SnapshotStore(f"local://{root}")
    assert not dead.exists() and live.exists() and store.get("a") == b"xyz"


@pytest.fixture(params=["c", "python"])
def reader(request, monkeypatch):
    """Both checked readers: the C one (rollout/_kvread.c) and the pool of Python threads."""
    import rollout.snapshot as snap
    if request.param == "c" and snap._kvread is None:
        pytest.skip("rollout._kvread is not built (no compiler at install)")
    monkeypatch.setattr(snap, "READER", request.param)
    return request.param


def _blocked(monkeypatch, block: int, read_bytes: int):
    import rollout.snapshot as snap
    monkeypatch.setattr(snap, "BLOCK_TOKENS", block)
    monkeypatch.setattr(snap, "READ_BYTES", read_bytes)
    return snap


@pytest.mark.parametrize("read_bytes", [1 << 20, 100])  # several pieces per request; one each
def test_pieces_and_a_flip_in_any_piece(tmp_path, monkeypatch, read_bytes, reader):
    snap = _blocked(monkeypatch, 6, read_bytes)  # 20 tokens: blocks of 6, 6, 6, 2
    kv = _kv()
    data = encode("t", TOK, kv, 0, "fp")
    h = snap.read_header(data)
    assert len(h.checksums) == 4 * 2 * 4 and h.block_tokens == 6
    ranges = [(a, b) for _, a, b in snap.pieces(h.tensors, 6)]
    assert sorted(ranges) == ranges and ranges[0][0] == 0 and ranges[-1][1] == len(data) - h.payload_offset
    assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))  # the pieces tile the payload
    store = SnapshotStore(tmp_path)
    for a, b in ranges[::3] + [ranges[-1]]:
        bad = bytearray(data)
        bad[h.payload_offset + (a + b) // 2] ^= 1
        store.put("t", bytes(bad))
        with pytest.raises(SnapshotRejected) as e:
            store.load("t", TOK, 0, "fp", torch.float32)
        assert e.value.reason == "corrupt"
    store.put("t", data)
    _, got = store.load("t", TOK, 0, "fp", torch.float32)
    assert all(torch.equal(got[k], kv[k]) for k in kv)


@pytest.mark.parametrize("read_bytes", [1 << 20, 100])
@pytest.mark.parametrize("uri", ["local", "pyarrow"])
def test_a_read_from_a_block_holds_the_kv_of_the_tokens_from_there(tmp_path, monkeypatch, read_bytes, uri, reader):
    snap = _blocked(monkeypatch, 6, read_bytes)
    kv = _kv()
    store = SnapshotStore(tmp_path / "kv" if uri == "local" else f"file://{tmp_path}/kv")
    store.put("t", encode("t", TOK, kv, 0, "fp"))
    f = store.open("t", TOK + [1], 0, "fp", torch.float32)
    try:
        assert (f.token_count, f.block_tokens, f.bytes_per_token) == (20, 6, 4 * 2 * 8 * 4)
        for start in (0, 6, 12, 18):
            got = f.read(start)
            assert got.keys() == kv.keys() and all(torch.equal(got[k], kv[k][:, start:]) for k in kv), start
        for start in (-6, 3, 20, 24):
            with pytest.raises(ValueError):
                f.read(start)
    finally:
        f.close()


def test_a_flip_in_a_piece_not_read_is_never_seen_and_never_used(tmp_path, monkeypatch, reader):
    """A read from a block checks exactly the pieces it returns: damage before the block is neither reported
    nor part of what comes back; damage from the block on is rejected."""
    snap = _blocked(monkeypatch, 6, 1 << 20)
    kv = _kv()
    data = encode("t", TOK, kv, 0, "fp")
    h = snap.read_header(data)
    layout = {name: (a, shape) for name, (_, shape, (a, _)) in h.tensors.items()}
    store = SnapshotStore(tmp_path)
    for name in kv:
        a, (H, T, D) = layout[name]
        for head in range(H):
            for token, rejected in ((5, False), (11, False), (12, True), (19, True)):
                bad = bytearray(data)
                bad[h.payload_offset + a + ((head * T + token) * D + 3) * 4] ^= 0x10
                store.put("t", bytes(bad))
                f = store.open("t", TOK, 0, "fp", torch.float32)
                try:
                    if rejected:
                        with pytest.raises(SnapshotRejected):
                            f.read(12)
                    else:
                        got = f.read(12)
                        assert all(torch.equal(got[k], kv[k][:, 12:]) for k in kv)
                finally:
                    f.close()


def test_the_c_reader_checksums_as_crc32c_and_refuses_requests_outside_its_buffer(tmp_path):
    import os

    import crc32c

    import rollout.snapshot as snap
    if snap._kvread is None:
        pytest.skip("rollout._kvread is not built (no compiler at install)")
    kvr = snap._kvread
    data = os.urandom(5000)
    for n in (0, 1, 7, 8, 9, 64, 1001, 4096):
        for off in (0, 1, 3):
            want = crc32c.crc32c(data[off:off + n])
            assert kvr.crc32c(data[off:off + n]) == want and kvr.crc32c(data[off:off + n], True) == want
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        def run(reqs, checks, size=5000, threads=4):
            buf = bytearray(size)
            r = kvr.read_checked(fd, buf, snap.np.array(reqs, snap.np.int64).tobytes(),
                                 snap.np.array(checks, snap.np.int64).tobytes(), threads)
            return r, bytes(buf)

        reqs = [(0, 0, 2000, 0, 1), (2000, 2000, 3000, 1, 3)]
        checks = [(0, 2000, crc32c.crc32c(data[:2000])), (2000, 2500, crc32c.crc32c(data[2000:2500])),
                  (2500, 5000, crc32c.crc32c(data[2500:]))]
        assert run(reqs, checks) == (0, data)
        assert run(reqs, checks[:2] + [(2500, 5000, 1)])[0] == 2  # a wrong checksum
        assert run([(4000, 0, 2000, 0, 0)], [])[0] == 1  # past the end of the file: short
        for bad_reqs, bad_checks in (([(0, 4000, 2000, 0, 0)], []),  # past the buffer
                                     ([(0, -1, 10, 0, 0)], []),
                                     ([(0, 0, 10, 0, 2)], [(0, 10, 0)]),  # more checks than given
                                     ([(0, 0, 10, 0, 1)], [(0, 11, 0)])):  # a check outside its request
            with pytest.raises(ValueError):
                run(bad_reqs, bad_checks)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        kvr.read_checked(fd, bytearray(10), snap.np.array([(0, 0, 10, 0, 0)], snap.np.int64).tobytes(), b"", 1)


def test_cached_tells_a_snapshot_in_the_page_cache(tmp_path):
    """Decided when the file is opened, before its header is read."""
    import os

    store = SnapshotStore(tmp_path)
    store.put("t", encode("t", TOK, _kv(), 0, "fp"))
    f = store.open("t", TOK, 0, "fp", torch.float32)
    assert f.cached()  # just written
    f.close()
    fd = os.open(store.path("t"), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced by the atomic write: the pages can go
    os.close(fd)
    f = store.open("t", TOK, 0, "fp", torch.float32)
    try:
        assert not f.cached() and f.cached() is False
        _, got = f.header, f.read(0)  # the read itself is unaffected
        assert all(torch.equal(got[k], v) for k, v in _kv().items())
    finally:
        f.close()


def test_a_snapshot_read_in_part_is_not_cached(tmp_path):
    """After a split resume only the tails of the rows were read: the file is not in the page cache for the
    next resume, which must not take it for one that reads at memory speed."""
    import os

    import rollout.snapshot as snap
    if snap._kvread is None:
        pytest.skip("rollout._kvread is not built (no compiler at install)")
    g = torch.Generator().manual_seed(1)
    kv = {f"{k}.{i}": torch.randn(2, 4096, 64, generator=g) for i in range(2) for k in "kv"}  # 8 MiB
    toks = list(range(4096))
    store = SnapshotStore(tmp_path)
    store.put("t", encode("t", toks, kv, 0, "fp"))
    path, size = store.path("t"), os.path.getsize(store.path("t"))

    def evict():
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def cached() -> bool:
        f = store.open("t", toks, 0, "fp", torch.float32)
        try:
            return f.cached()
        finally:
            f.close()

    assert cached()
    evict()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly the bytes asked for: no read-ahead
    os.pread(fd, size // 2, size - size // 2)  # the second half, as a tail read leaves it
    assert 0 < snap._kvread.resident(fd, size)[0] < snap._kvread.resident(fd, size)[1]
    os.close(fd)
    assert not cached()
    with open(path, "rb") as f:
        f.read()
    assert cached()


@pytest.mark.parametrize("case,reason", [
    ("missing", "missing"), ("flip", "corrupt"), ("truncate", "corrupt"), ("other_traj", "mismatch"),
    ("wal_diverges", "mismatch"), ("old_version", "stale"), ("other_model", "stale"), ("dtype", "mismatch"),
])
def test_bad_snapshots_are_rejected(tmp_path, case, reason, reader):
    data = encode("t", TOK, _kv(), 3, "fp")
    traj, wal, version, fp, dtype = "t", TOK, 3, "fp", torch.float32
    if case == "missing":
        data = None
    elif case == "flip":
        b = bytearray(data)
        b[-5] ^= 0x40
        data = bytes(b)
    elif case == "truncate":
        data = data[:len(data) // 2]
    elif case == "other_traj":
        traj = "u"
    elif case == "wal_diverges":
        wal = TOK[:5] + [99] + TOK[6:]
    elif case == "old_version":
        version = 4
    elif case == "other_model":
        fp = "fp2"
    elif case == "dtype":
        dtype = torch.bfloat16
    with pytest.raises(SnapshotRejected) as e:
        decode(data, traj, wal, version, fp, dtype)
    assert e.value.reason == reason
    store = SnapshotStore(tmp_path)  # the local fast path rejects the same way
    if data is not None:
        store.put(traj, data)  # stored under the id asked for; the header may name another
    with pytest.raises(SnapshotRejected) as e:
        store.load(traj, wal, version, fp, dtype)
    assert e.value.reason == reason


def test_a_flipped_bit_anywhere_in_the_header_is_rejected_or_harmless(tmp_path):
    """Every single-bit flip of the header (length, metadata, tensor index): the snapshot is rejected as
    corrupt, stale or mismatched, or restores exactly the tensors written; never any other error. A digit of
    a shape or offset is one bit from another digit ('3' ^ 4 = '7'), which only the index checksum sees."""
    import random
    import struct

    kv = _kv()
    data = encode("t", TOK, kv, 3, "fp")
    (n,) = struct.unpack("<Q", data[:8])
    store = SnapshotStore(tmp_path)
    local = random.Random(0).sample(range((8 + n) * 8), 200)
    for bit in range((8 + n) * 8):
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        loads = [lambda: decode(bytes(b), "t", TOK, 3, "fp", torch.float32)]
        if bit in local:  # the local fast path reads the same bytes from a file
            store.put("t", bytes(b))
            loads.append(lambda: store.load("t", TOK, 3, "fp", torch.float32))
        for load in loads:
            try:
                _, got = load()
            except SnapshotRejected:
                continue
            assert got.keys() == kv.keys() and all(torch.equal(got[k], kv[k]) for k in kv), bit
