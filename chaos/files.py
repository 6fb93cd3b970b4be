"""Damage to files, as a drill does it: flip one bit, cut a tail, delete."""
from __future__ import annotations

import os
import random


def flip_bit(path: str, rng: random.Random, lo: int = 0, hi: int | None = None) -> int:
    """Flip one random bit of `path` in bytes [lo, hi); returns the byte offset."""
    size = os.path.getsize(path)
    hi = size if hi is None else min(hi, size)
    if hi <= lo:
        raise ValueError(f"{path}: no bytes in [{lo}, {hi}) to flip")
    off = rng.randrange(lo, hi)
    with open(path, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([b ^ (1 << rng.randrange(8))]))
        fh.flush()
        os.fsync(fh.fileno())
    return off


def zero_range(path: str, begin: int, end: int) -> None:
    """Overwrite [begin, end) of `path` with zeros (a write that never reached the disk)."""
    with open(path, "r+b") as fh:
        fh.seek(begin)
        fh.write(bytes(end - begin))
        fh.flush()
        os.fsync(fh.fileno())
