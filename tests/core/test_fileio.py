"""The I/O layer: the default operations are the os functions themselves; a backend swapped in is seen
by every caller and swapped out again; the helpers are made of primitives (so they follow the backend);
makedirs makes each directory it creates durable in its parent; exchange swaps two names."""
from __future__ import annotations

import os

import pytest

from core import fileio


def test_default_operations_are_the_os_functions():
    assert fileio.open is os.open and fileio.pwrite is os.pwrite and fileio.fsync is os.fsync
    assert fileio.fdatasync is getattr(os, "fdatasync", os.fsync) and fileio.rename is os.rename
    assert set(fileio.DEFAULT) == set(fileio.OPS) and all(getattr(fileio, n) is fileio.DEFAULT[n] for n in fileio.OPS)


class Counting:
    """A backend that does the real thing and counts the calls."""

    def __init__(self):
        self.calls = []
        for name in fileio.OPS:
            setattr(self, name, self._wrap(name, fileio.DEFAULT[name]))

    def _wrap(self, name, fn):
        def call(*args):
            self.calls.append((name, *[os.path.basename(a) if isinstance(a, (str, os.PathLike)) else a for a in args[:1]]))
            return fn(*args)
        return call


def test_using_swaps_for_every_caller_and_restores(tmp_path):
    from core.atomic import write_atomic

    backend = Counting()
    with fileio.using(backend):
        write_atomic(tmp_path / "a" / "b" / "f.json", b"{}")
    names = [c[0] for c in backend.calls]
    assert names.count("mkdir") == 2 and names.count("fsync_dir") == 3  # two new directories, then the file's rename
    assert names.index("fsync") < names.index("replace") < len(names) - 1 - names[::-1].index("fsync_dir")
    assert (tmp_path / "a" / "b" / "f.json").read_bytes() == b"{}"
    assert fileio.fsync is os.fsync and fileio.open is os.open  # restored
    backend.calls.clear()
    write_atomic(tmp_path / "g", b"x")
    assert backend.calls == []


def test_makedirs_syncs_the_parent_of_each_directory_it_creates(tmp_path):
    backend = Counting()
    with fileio.using(backend):
        fileio.makedirs(tmp_path / "x" / "y")
        fileio.makedirs(tmp_path / "x" / "y")  # exists: nothing to do
    assert backend.calls == [("mkdir", "x"), ("fsync_dir", tmp_path.name), ("mkdir", "y"), ("fsync_dir", "x")]


def test_exchange_swaps_two_directories_atomically(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from_a").write_text("1")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "from_b").write_text("2")
    try:
        fileio.exchange(tmp_path / "a", tmp_path / "b")
    except OSError as exc:  # a platform without renameat2: callers fall back to two renames
        pytest.skip(f"no RENAME_EXCHANGE here: {exc}")
    assert os.listdir(tmp_path / "a") == ["from_b"] and os.listdir(tmp_path / "b") == ["from_a"]
    with pytest.raises(FileNotFoundError):
        fileio.exchange(tmp_path / "a", tmp_path / "missing")


def test_helpers_write_file_rmtree(tmp_path):
    fileio.write_file(tmp_path / "f", b"abc", sync=True)
    fileio.write_file(tmp_path / "f", b"z")  # replaces
    assert (tmp_path / "f").read_bytes() == b"z"
    (tmp_path / "t" / "u").mkdir(parents=True)
    (tmp_path / "t" / "u" / "v").write_bytes(b"1")
    os.symlink(tmp_path / "f", tmp_path / "t" / "link")
    fileio.rmtree(tmp_path / "t")
    assert not (tmp_path / "t").exists() and (tmp_path / "f").exists()


@pytest.mark.parametrize("limit", [1, 7, 4096, 1 << 20])
def test_pwrite_all_finishes_short_writes(tmp_path, limit):
    """pwrite may write less than asked: pwrite_all writes the rest at the right offsets (one call when
    the first writes everything)."""
    data = os.urandom(10_000)
    calls = []

    def short_pwrite(fd, buf, offset):
        calls.append(offset)
        return os.pwrite(fd, bytes(buf[:limit]), offset)

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"\xff" * 20_000, 0)
        with fileio.using({**fileio.DEFAULT, "pwrite": short_pwrite}):
            fileio.pwrite_all(fd, data, 123)
    finally:
        os.close(fd)
    got = (tmp_path / "f").read_bytes()
    assert got[123:123 + len(data)] == data and got[:123] == b"\xff" * 123 and got[123 + len(data):] == b"\xff" * (20_000 - 123 - len(data))
    assert len(calls) == -(-len(data) // limit) and calls == [123 + k * limit for k in range(len(calls))]
