"""Seeded, disjoint train/eval splits: an item belongs to 'eval' iff a stable hash of its key says so."""
from __future__ import annotations

import hashlib
import random
from typing import Callable

SPLITS = ("train", "eval")
EVAL_PERCENT = 10  # share of the item space reserved for eval


def in_split(key: str, split: str) -> bool:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    bucket = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") % 100
    return (bucket < EVAL_PERCENT) == (split == "eval")


def sample(draw: Callable[[random.Random], str], split: str, n: int, seed: int, max_tries: int = 1000) -> list[str]:
    """`n` items from `draw` that fall into `split`; deterministic in (split, n, seed)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{split}:{seed}")
    out: list[str] = []
    tries = 0
    while len(out) < n:
        item = draw(rng)
        tries += 1
        if in_split(item, split):
            out.append(item)
            tries = 0
        elif tries > max_tries:
            raise RuntimeError(f"could not draw a {split} item in {max_tries} tries; the item space is too small")
    return out
