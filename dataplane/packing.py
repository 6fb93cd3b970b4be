"""Packing kernels (pure numpy, no Python loop over trajectories): split long sequences, cut a
segment stream into minibatches of R rank bins under a token budget, balance the bins.

Every step is a vectorised next-fit: `nf[s]` is where a bin that starts at segment s ends. A minibatch
is R consecutive next-fit bins (so R bins of <= budget always exist for it); the chain of minibatch
starts from segment 0 is found by pointer doubling, O(n log M) with n segments and M minibatches.
Inside each minibatch a greedy longest-first assignment (vectorised across minibatches, R segments
per round to the R least-loaded ranks) balances the ranks; where it would overflow a rank, the
next-fit bins are kept.
"""
from __future__ import annotations

import numpy as np


def split(lengths: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of <= budget tokens: (owner index into `lengths`, start, stop), owners in input order,
    each owner's pieces contiguous and in token order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not lengths.size or int(lengths.max()) <= budget:  # nothing to split
        return np.arange(lengths.shape[0], dtype=np.int64), np.zeros_like(lengths), lengths.copy()
    pieces = np.maximum(1, -(-lengths // budget))
    owner = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), pieces)
    first = np.concatenate([[0], np.cumsum(pieces)[:-1]])
    k = np.arange(owner.shape[0], dtype=np.int64) - np.repeat(first, pieces)
    start = k * budget
    stop = np.minimum(start + budget, lengths[owner])
    return owner, start, stop


def next_fit_ends(seg_len: np.ndarray, budget: int) -> np.ndarray:
    """[n+1]: nf[s] = end (exclusive) of a next-fit bin of `budget` tokens starting at s; nf[n] = n."""
    n = seg_len.shape[0]
    csum = np.concatenate([[0], np.cumsum(seg_len, dtype=np.int64)])
    nf = np.searchsorted(csum, csum[:-1] + budget, side="right") - 1
    nf = np.maximum(nf, np.arange(1, n + 1))  # a segment longer than `budget` gets a bin of its own
    return np.concatenate([nf, [n]]).astype(np.int64)


def power(f: np.ndarray, k: int) -> np.ndarray:
    """f composed k times (f is a map on 0..n stored as an array)."""
    out = np.arange(f.shape[0], dtype=np.int64)
    base = f
    while k:
        if k & 1:
            out = base[out]
        k >>= 1
        if k:
            base = base[base]
    return out


def chain(nxt: np.ndarray) -> np.ndarray:
    """Starts 0, nxt[0], nxt[nxt[0]], ... below n = len(nxt) - 1 (nxt[s] > s, nxt[n] = n); by doubling."""
    n = nxt.shape[0] - 1
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.zeros(1, dtype=np.int64)
    jump = nxt
    while True:
        new = jump[starts]
        starts = np.concatenate([starts, new])
        if new[0] == n:
            break
        jump = jump[jump]
    return starts[starts < n]


def minibatch_starts(seg_len: np.ndarray, budget: int, ranks: int, group_start: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(nf, mb [M+1]): minibatch m holds segments mb[m]:mb[m+1]. With `group_start` (first segment of
    each segment's group), a minibatch ends before a group that would straddle it, unless that group
    alone fills the minibatch."""
    n = seg_len.shape[0]
    nf = next_fit_ends(seg_len, budget)
    ends = power(nf, ranks)
    nxt = ends.copy()
    if group_start is not None and n:
        e = ends[:-1]
        gs = np.concatenate([group_start, [n]])[e]
        nxt[:-1] = np.where(gs > np.arange(n), gs, e)
    return nf, np.concatenate([chain(nxt), [n]])


def next_fit_ranks(nf: np.ndarray, mb: np.ndarray, ranks: int) -> np.ndarray:
    """Rank of each segment when the minibatch is cut into R consecutive next-fit bins."""
    n = int(mb[-1])
    b, ends = mb[:-1].copy(), mb[1:]
    cols = [b]
    for _ in range(1, ranks):
        b = np.minimum(nf[b], ends)
        cols.append(b)
    flat = np.stack(cols, axis=1).reshape(-1)
    return (np.searchsorted(flat, np.arange(n), side="right") - 1) % ranks


def _large_first(seg_len: np.ndarray, mb: np.ndarray, large: int) -> np.ndarray:
    """Permutation grouping segments by minibatch: the segments longer than `large` first, longest first,
    then the rest in stream order. Only the (few) long ones are sorted."""
    n, m_count = seg_len.shape[0], mb.shape[0] - 1
    mb_of = np.repeat(np.arange(m_count, dtype=np.int64), np.diff(mb))
    is_large = seg_len > large
    big = np.flatnonzero(is_large)
    big = big[np.lexsort((-seg_len[big], mb_of[big]))]
    small = np.flatnonzero(~is_large)
    n_big = np.bincount(mb_of[big], minlength=m_count)
    n_small = np.diff(mb) - n_big
    order = np.empty(n, dtype=np.int64)
    big_first = np.concatenate([[0], np.cumsum(n_big)[:-1]])
    small_first = np.concatenate([[0], np.cumsum(n_small)[:-1]])
    m_big, m_small = mb_of[big], mb_of[small]
    order[mb[:-1][m_big] + np.arange(big.shape[0]) - big_first[m_big]] = big
    order[mb[:-1][m_small] + n_big[m_small] + np.arange(small.shape[0]) - small_first[m_small]] = small
    return order


def greedy_ranks(seg_len: np.ndarray, mb: np.ndarray, ranks: int, budget: int, large: int,
                 max_rounds: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Greedy balance in rounds, vectorised across minibatches: segments longer than `large` first
    (longest first), then the others in stream order; each round the next R segments, longest first,
    go to the R ranks, least loaded first. Keeps max-min <= the longest segment (a round only adds a
    larger item to a smaller load). If the minibatch holds at most R*(budget - large) tokens the short
    segments can never overflow a rank. Returns (rank per segment, ok [M]); ok is False where a rank
    would exceed `budget` or the minibatch needs more than `max_rounds` rounds."""
    n, m_count = seg_len.shape[0], mb.shape[0] - 1
    order = _large_first(seg_len, mb, large)
    counts = np.diff(mb)
    loads = np.zeros((m_count, ranks), dtype=np.int64)
    seg_rank = np.zeros(n, dtype=np.int64)
    rounds = -(-counts // ranks)
    by_count = np.argsort(-counts, kind="stable")
    neg_sorted = -counts[by_count]
    eligible = rounds <= max_rounds
    slot = np.arange(ranks)
    for q in range(int(min(max_rounds, rounds.max(initial=0)))):
        k = int(np.searchsorted(neg_sorted, -q * ranks, side="left"))  # minibatches with > q*R segments
        act = by_count[:k]
        act = act[eligible[act]]
        if act.shape[0] == 0:
            break
        idx = mb[act][:, None] + q * ranks + slot
        valid = idx < mb[act + 1][:, None]
        segs = order[np.minimum(idx, n - 1)]
        lens = np.where(valid, seg_len[segs], -1)
        by_len = np.argsort(-lens, axis=1, kind="stable")  # longest first, ties in stream order
        segs, lens, valid = (np.take_along_axis(a, by_len, axis=1) for a in (segs, lens, valid))
        rank_of_slot = np.argsort(loads[act], axis=1, kind="stable")  # least loaded first
        loads[act[:, None], rank_of_slot] += np.maximum(lens, 0)  # a permutation per row: no repeated index
        seg_rank[segs[valid]] = rank_of_slot[valid]
    ok = eligible & (loads.max(axis=1, initial=0) <= budget)
    return seg_rank, ok


def relabel(bins: np.ndarray, m_count: int, ranks: int) -> np.ndarray:
    """Renumber the ranks of each minibatch by the stream position of their last segment (empty ranks
    last). Ranks are interchangeable, so budgets and balance are unchanged; it makes the full-budget
    pieces of a split trajectory land on increasing ranks."""
    last = np.full(m_count * ranks, -1, dtype=np.int64)
    np.maximum.at(last, bins, np.arange(bins.shape[0], dtype=np.int64))
    key = np.where(last < 0, np.iinfo(np.int64).max, last).reshape(m_count, ranks)
    order = np.argsort(key, axis=1, kind="stable")
    new_rank = np.empty_like(order)
    np.put_along_axis(new_rank, order, np.broadcast_to(np.arange(ranks), order.shape), axis=1)
    return (bins // ranks) * ranks + new_rank.reshape(-1)[bins]


def pack(seg_len: np.ndarray, budget: int, ranks: int, group_start: np.ndarray | None = None,
         slack: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bin [n] = minibatch * R + rank, balanced [M]) for a stream of segments of <= budget tokens.
    Minibatches are cut as R next-fit bins of `budget - slack` tokens, leaving the greedy balance room
    to even out ranks without passing `budget` (default slack: budget/16; segments up to `slack` long
    then never overflow a rank). Minibatches the greedy pass would overflow are retried longest-first
    throughout; the few that still overflow keep their next-fit bins (`balanced` False)."""
    seg_len = np.asarray(seg_len, dtype=np.int64)
    if seg_len.size and int(seg_len.max()) > budget:
        raise ValueError("segments must be split to the budget before packing")
    if slack is None:
        slack = 0 if ranks == 1 else budget // 16
    cut_budget = max(1, budget - slack)
    nf, mb = minibatch_starts(seg_len, cut_budget, ranks, group_start)
    m_count = mb.shape[0] - 1
    mb_of = np.repeat(np.arange(m_count, dtype=np.int64), np.diff(mb))
    rank, ok = greedy_ranks(seg_len, mb, ranks, budget, large=max(slack, 1))
    if not ok.all():  # retry those minibatches longest-first throughout (LPT), then keep next-fit bins
        retry = np.flatnonzero(~ok)
        counts = np.diff(mb)[retry]
        members = np.flatnonzero(~ok[mb_of])  # their segments, minibatch by minibatch
        sub_mb = np.concatenate([[0], np.cumsum(counts)])
        sub_rank, sub_ok = greedy_ranks(seg_len[members], sub_mb, ranks, budget, large=0)
        ok[retry] = sub_ok
        use = sub_ok[np.repeat(np.arange(retry.shape[0]), counts)]
        rank[members[use]] = sub_rank[use]
        if not ok.all():
            rank = np.where(ok[mb_of], rank, next_fit_ranks(nf, mb, ranks))
    bins = mb_of * ranks + rank
    return (relabel(bins, m_count, ranks) if ranks > 1 else bins), ok
