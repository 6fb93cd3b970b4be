"""Planner (pure numpy over light metadata): seeded shuffle (per trajectory, or per GRPO group so a
group's members stay adjacent and in one minibatch), optional ordering by teacher (OPD keeps one
teacher head resident), split of trajectories longer than the per-rank budget into contiguous token
ranges, packing into minibatches of R rank bins under the budget, and rank balancing. Its cost grows
with the number of trajectories, not with the number of tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dataplane import packing
from dataplane.types import Plan, Selection


@dataclass
class Layout:
    """Segments sorted by (minibatch, rank, stream order): segment k is tokens [start, stop) of trajectory
    traj[k]; bin b = m*R + r holds segments bin_offsets[b]:bin_offsets[b+1]."""

    traj: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    bin_offsets: np.ndarray
    balanced: np.ndarray


def shuffle(n: int, group: np.ndarray | None, seed: int, epoch: int, teacher: np.ndarray | None = None) -> np.ndarray:
    """Seeded order of trajectory indices: a permutation of trajectories, or of groups (members adjacent,
    in their given order); then stably by teacher when `teacher` is given (a group by its first member's). O(n) when group codes are
    already sorted (the catalog returns them so), else one stable sort."""
    rng = np.random.Generator(np.random.PCG64([int(seed), int(epoch)]))
    if group is None:
        order = rng.permutation(n)
    else:
        group = np.asarray(group)
        if n and not (group[1:] >= group[:-1]).all():
            by_group = np.argsort(group, kind="stable")
            return by_group[shuffle(n, group[by_group], seed, epoch, None if teacher is None else teacher[by_group])]
        head = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]])) if n else np.zeros(0, np.int64)
        size = np.diff(np.concatenate([head, [n]]))
        perm = rng.permutation(head.shape[0])
        new_size = size[perm]
        new_head = np.concatenate([[0], np.cumsum(new_size)[:-1]]) if n else head
        order = np.arange(n, dtype=np.int64) + np.repeat(head[perm] - new_head, new_size)
    if teacher is not None:
        t = np.asarray(teacher)[order]
        if group is not None and n:  # a group moves with the teacher of its first member: it stays whole
            g = np.asarray(group)[order]
            head = np.maximum.accumulate(np.where(np.concatenate([[True], g[1:] != g[:-1]]), np.arange(n), 0))
            t = t[head]
        if t.size and 0 <= t.min() and t.max() < 32768:
            t = t.astype(np.int16)  # numpy sorts 16-bit keys stably by radix: O(n)
        order = order[np.argsort(t, kind="stable")]
    return order.astype(np.int64)


def layout(length: np.ndarray, tokens_per_rank: int, ranks: int = 1, seed: int = 0, epoch: int = 0,
           group: np.ndarray | None = None, teacher: np.ndarray | None = None) -> Layout:
    """Plan arrays from per-trajectory lengths (and optional group / teacher codes)."""
    if tokens_per_rank < 1 or ranks < 1:
        raise ValueError(f"tokens_per_rank ({tokens_per_rank}) and ranks ({ranks}) must be >= 1")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed ({seed}) and epoch ({epoch}) must be >= 0")
    length = np.asarray(length, dtype=np.int64)
    order = shuffle(length.shape[0], group, seed, epoch, teacher)
    owner, start, stop = packing.split(length[order], tokens_per_rank)
    traj = order[owner]
    group_start = None
    if group is not None:  # first segment of each segment's group, in stream order
        g = np.asarray(group)[traj]
        idx = np.arange(traj.shape[0], dtype=np.int64)
        change = np.ones(traj.shape[0], dtype=bool)
        change[1:] = g[1:] != g[:-1]
        group_start = np.maximum.accumulate(np.where(change, idx, 0))
    bins, balanced = packing.pack(stop - start, tokens_per_rank, ranks, group_start)
    key = bins.astype(np.uint16) if bins.size and bins.max() < 65536 else bins  # 16-bit keys: numpy's O(n) radix sort
    perm = np.argsort(key, kind="stable")
    counts = np.bincount(bins, minlength=balanced.shape[0] * ranks)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Layout(traj[perm], start[perm], stop[perm], offsets, balanced)


def make_plan(sel: Selection, tokens_per_rank: int, ranks: int = 1, seed: int = 0, epoch: int = 0,
              group_aware: bool = False, by_teacher: bool = False, store_root: str = "") -> Plan:
    lay = layout(sel.length, tokens_per_rank, ranks, seed, epoch,
                 group=sel.group if group_aware else None, teacher=sel.teacher if by_teacher else None)
    return Plan(store_root=store_root, tokens_per_rank=int(tokens_per_rank), ranks=int(ranks), seed=int(seed),
                epoch=int(epoch), group_aware=bool(group_aware), by_teacher=bool(by_teacher),
                ids=sel.ids, seq=sel.seq, length=sel.length, group=sel.group, teacher=sel.teacher, reward=sel.reward,
                shard=sel.shard, row=sel.row, checksum=sel.checksum, shard_paths=list(sel.shard_paths),
                teachers=list(sel.teachers), seg_traj=lay.traj, seg_start=lay.start, seg_stop=lay.stop,
                bin_offsets=lay.bin_offsets, balanced=lay.balanced)
