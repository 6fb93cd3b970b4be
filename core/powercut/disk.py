"""The disk model (pure): what a power cut may leave of files and directories.

Files and directories are inodes numbered by the recorder. Each keeps its durable state (what its
last fsync made durable) and the operations since then, in order:

- a file: writes (offset, the whole 512-byte sectors they touched, as the page cache held them right
  after the write) and size changes (truncate, extending fallocate);
- a directory: names linked (create, mkdir), unlinked (unlink, rmdir), renamed and exchanged.

`fsync` (or fdatasync: data and size are the same thing here) of a file makes its content and size
durable; fsync of a directory makes its names durable. Nothing else does: not close, not
sync_file_range, not the fsync of a file inside the directory.

A crash image starts from the durable state and, for each unsynced operation, decides:
- a write is dropped, kept, or torn: each of its sectors kept or dropped on its own;
- the file's size is the size after some prefix of its unsynced operations (a truncate applies only
  inside that prefix); bytes under that size that no kept write covers read as zeros;
- a directory operation is applied or not, each on its own; a rename is atomic (the name moves or it
  does not, never both names gone), and so is an exchange (both names swap or neither does).
`crash_image(seed)` makes those choices with generators seeded from `seed` (one per inode), so a seed
is one exact state.

Assumed, as ext4 and xfs give: a sector is written whole or not at all; a rename within one directory is
atomic; a file's durable data and size never change after its fsync; inodes are not shared between
names (no hard links). Renames between directories are not modelled (the recorder refuses them).
"""
from __future__ import annotations

import os
import random
import re

SECTOR = 512
_RUNS = re.compile(r"1+")

# image styles: (name, weight)
STYLES = (("durable", 1), ("everything", 1), ("prefix", 3), ("random", 5))


class _File:
    __slots__ = ("durable", "pending", "live")

    def __init__(self, track_live: bool):
        self.durable = bytearray()
        self.pending: list[tuple] = []  # ("w", first byte, sectors) | ("t", size)
        self.live = bytearray() if track_live else None


class _Dir:
    __slots__ = ("durable", "live", "pending")

    def __init__(self):
        self.durable: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.pending: list[tuple] = []  # ("link", name, ino) | ("unlink", name) | ("rename", src, dst, ino)
        #                                 | ("exchange", a, b, ino of a, ino of b)


def _apply_to(buf: bytearray, op: tuple) -> None:
    if op[0] == "w":
        a, blob = op[1], op[2]
        if len(buf) < a:
            buf.extend(bytes(a - len(buf)))
        buf[a:a + len(blob)] = blob
    else:
        _resize(buf, op[1])


def _resize(buf: bytearray, size: int) -> None:
    if size < len(buf):
        del buf[size:]
    else:
        buf.extend(bytes(size - len(buf)))


def _apply_entry(entries: dict, op: tuple) -> None:
    if op[0] == "link":
        entries[op[1]] = op[2]
    elif op[0] == "unlink":
        entries.pop(op[1], None)
    elif op[0] == "exchange":
        _, a, b, ino_a, ino_b = op
        entries[a], entries[b] = ino_b, ino_a
    else:
        _, src, dst, ino = op
        if entries.get(src) == ino:
            del entries[src]
        entries[dst] = ino


class Disk:
    """Inodes, their durable state and their unsynced operations. Root is inode 0 (always durable).

    Operations are tuples (what the recorder logs and a replay feeds back):
        ("create", parent, name, ino, is_dir)   ("write", ino, first, sectors)   ("trunc", ino, size)
        ("sync", ino)   ("unlink", parent, name)   ("rename", parent, src, dst)   ("exchange", parent, a, b)
        ("syncall",)
    With track_live, files also keep their live bytes (the recorder needs them to log whole sectors).
    """

    def __init__(self, track_live: bool = False):
        self.track_live = track_live
        self.files: dict[int, _File] = {}
        self.dirs: dict[int, _Dir] = {0: _Dir()}

    # --- the live view ---
    def is_dir(self, ino: int) -> bool:
        return ino in self.dirs

    def size(self, ino: int) -> int:
        return len(self.files[ino].live)

    def pending(self, ino: int) -> int:
        """The file's operations since its last sync."""
        return len(self.files[ino].pending)

    def sectors_after_write(self, ino: int, offset: int, data) -> tuple:
        """Apply a write to the live bytes; the ("write", …) operation to log: whole sectors it touched."""
        live = self.files[ino].live
        end = offset + len(data)
        if len(live) < offset:
            live.extend(bytes(offset - len(live)))
        live[offset:end] = data
        a = offset - offset % SECTOR
        b = min(-(-end // SECTOR) * SECTOR, len(live))
        return ("write", ino, a, bytes(live[a:b]))

    # --- operations ---
    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "write":
            self.files[op[1]].pending.append(("w", op[2], op[3]))
        elif kind == "sync":
            self._sync(op[1])
        elif kind == "trunc":
            f = self.files[op[1]]
            f.pending.append(("t", op[2]))
            if f.live is not None:
                _resize(f.live, op[2])
        elif kind == "create":
            _, parent, name, ino, is_dir = op
            if is_dir:
                self.dirs[ino] = _Dir()
            else:
                self.files[ino] = _File(self.track_live)
            d = self.dirs[parent]
            d.live[name] = ino
            d.pending.append(("link", name, ino))
        elif kind == "unlink":
            d = self.dirs[op[1]]
            d.live.pop(op[2])
            d.pending.append(("unlink", op[2]))
        elif kind == "rename":
            _, parent, src, dst = op
            d = self.dirs[parent]
            ino = d.live.pop(src)
            d.live[dst] = ino
            d.pending.append(("rename", src, dst, ino))
        elif kind == "exchange":
            _, parent, a, b = op
            d = self.dirs[parent]
            ino_a, ino_b = d.live[a], d.live[b]
            d.live[a], d.live[b] = ino_b, ino_a
            d.pending.append(("exchange", a, b, ino_a, ino_b))
        elif kind == "syncall":
            for ino in list(self.files) + list(self.dirs):
                self._sync(ino)
        else:
            raise ValueError(f"unknown disk operation {kind!r}")

    def _sync(self, ino: int) -> None:
        d = self.dirs.get(ino)
        if d is not None:
            d.durable = dict(d.live)
            d.pending = []
            return
        f = self.files[ino]
        for op in f.pending:
            _apply_to(f.durable, op)
        f.pending = []

    # --- crash images ---
    def crash_image(self, seed: int) -> tuple[str, dict]:
        """(style, tree) of one state a power cut now could leave: tree maps names to bytes (files)
        or to trees (directories). The choices for each inode come from a generator of (seed, inode),
        so they do not depend on the order of names (a random file name does not change the state)."""
        style = random.Random(seed).choices([s for s, _ in STYLES], [w for _, w in STYLES])[0]
        return style, self._tree(0, seed, style, 0)

    def _tree(self, ino: int, seed: int, style: str, depth: int) -> dict:
        if depth > 64:
            raise AssertionError("directory cycle in the disk model")
        rng = _rng(seed, ino)
        d = self.dirs[ino]
        entries = dict(d.durable)
        n = len(d.pending)
        keep = _choose(rng, style, n)
        for i, op in enumerate(d.pending):
            if keep(i):
                _apply_entry(entries, op)
        out = {}
        for name in sorted(entries):
            child = entries[name]
            out[name] = self._tree(child, seed, style, depth + 1) if child in self.dirs else self._file(child, seed, style)
        return out

    def _file(self, ino: int, seed: int, style: str) -> bytes:
        f = self.files[ino]
        rng = _rng(seed, ino)
        if not f.pending:
            return bytes(f.durable)
        n = len(f.pending)
        buf = bytearray(f.durable)
        size = len(buf)
        if style == "durable":
            return bytes(buf)
        if style == "everything":
            meta, keep = n, lambda i: "all"
        elif style == "prefix":  # written back in order up to some op, that one torn
            k = rng.randint(0, n)
            meta = rng.randint(0, n)
            keep = lambda i: "all" if i < k else ("torn" if i == k else "none")  # noqa: E731
        else:
            meta = rng.choice((0, n, rng.randint(0, n)))
            keep = lambda i: rng.choice(("all", "none", "torn"))  # noqa: E731
        for i, op in enumerate(f.pending):
            if op[0] == "t":
                if i < meta:
                    size = op[1]
                    _resize(buf, size)
                continue
            a, blob = op[1], op[2]
            if i < meta:
                size = max(size, a + len(blob))
            how = keep(i)
            if how == "none":
                continue
            if how == "all":
                _apply_to(buf, op)
                continue
            nsec = -(-len(blob) // SECTOR)
            bits = format(rng.getrandbits(nsec), f"0{nsec}b") if nsec else ""
            for m in _RUNS.finditer(bits):
                s, e = m.start() * SECTOR, min(m.end() * SECTOR, len(blob))
                _apply_to(buf, ("w", a + s, blob[s:e]))
        _resize(buf, size)
        return bytes(buf)


def _rng(seed: int, ino: int) -> random.Random:
    return random.Random((seed << 32) | ino)


def _choose(rng: random.Random, style: str, n: int):
    """Which of a directory's n unsynced operations a crash image applies."""
    if style == "durable" or n == 0:
        return lambda i: False
    if style == "everything":
        return lambda i: True
    if style == "prefix":
        k = rng.randint(0, n)
        return lambda i: i < k
    return lambda i: rng.random() < 0.5


def write_tree(tree: dict, dest) -> None:
    """Materialise a crash image under `dest` (created; must not exist) with plain os calls."""
    os.mkdir(dest)
    for name, node in tree.items():
        path = os.path.join(dest, name)
        if isinstance(node, dict):
            write_tree(node, path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(node)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
