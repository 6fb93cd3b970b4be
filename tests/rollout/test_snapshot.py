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
    assert store.get("other") is None and len(store.ids_on_disk()) == 1
    assert store.delete("traj/1") and store.get("traj/1") is None


def test_mem_fs_store():
    store = SnapshotStore("mock://kvstore")
    store.put("a", b"xyz")
    assert store.get("a") == b"xyz" and store.delete("a") and store.get("a") is None


@pytest.mark.parametrize("case,reason", [
    ("missing", "missing"), ("flip", "corrupt"), ("truncate", "corrupt"), ("other_traj", "mismatch"),
    ("wal_diverges", "mismatch"), ("old_version", "stale"), ("other_model", "stale"), ("dtype", "mismatch"),
])
def test_bad_snapshots_are_rejected(case, reason):
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
