"""Resuming a trajectory from its KV snapshot, split: the engine re-prefills the head of the committed
tokens while another thread reads the KV of the rest from the snapshot, so a resume costs about the longer
of the two parts instead of the whole of either.

A cold snapshot read is bound by the disk and a re-prefill by the accelerator, and on a small model the
two are close: 32k tokens of a 0.5B model are a 384 MB snapshot, read cold in ~185 ms from an H100
host's virtio disk and re-prefilled in ~180 ms. Reading all of it can then never beat recomputing by
much; reading the tail while recomputing the head can, by up to 2x. The KV of a token depends only on
the tokens up to it, so the snapshot's KV of the tail is the KV a prefill of the whole would give.

The split point comes from costs this process has measured (`SplitPolicy`): a head's prefill (a fixed part
and seconds per token, once heads of different sizes were seen; else the lowest rate of the recent heads)
and seconds per byte read cold. Of the whole read, a split at each block boundary and a prefill of every
token (the snapshot left unread, priced by such prefills timed alone: heads beside a read run slower) it
takes the quickest by those costs: a prefill's fixed part (~28 ms for this model on an H100 host, whatever
the head's size up to 6k tokens) makes a short snapshot read whole, and where a cold read is slower than the
prefill of all of it (8k tokens there: 72 ms against 35) the tokens are prefilled. Until both are known the
first resume splits in the middle, which measures both. A snapshot partly in the page cache (a split resume
read its tails) splits like a cold one, but its read teaches no rate: it is neither a cold read nor a warm
one (taken for cold, such reads of cached tails halved the cold rate on an H100 host, and the next cold
resumes split too early). A snapshot in the page cache (written or read here moments ago: a preemption
resumed by the same worker) reads whole: it reads at memory speed, and beside a prefill it read slower than
alone (a 32k resume on an H100 host: split 129 ms against 95 ms whole). A snapshot of fewer than two blocks
cannot split: it is read whole, or left unread where prefills of about its size timed alone were quicker.
A strict engine, `enabled=False` and an engine on the CPU read whole: on the CPU the prefill and the
read share the same cores, so neither gets faster by running beside the other (on a 2-core machine a split
resume of 256 tokens took 2.9x a whole read: 2.1 against 0.7 ms).
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass

import torch

from rollout.snapshot import SnapshotRejected, SnapshotStore


RECOMPUTE = "recompute_quicker"  # Resumed.rejected of a snapshot left unread: re-prefilling all was quicker


@dataclass(frozen=True)
class Resumed:
    prefilled: int  # tokens the engine prefilled (the head, and whatever no KV covered)
    kv_tokens: int  # tokens whose KV came from the snapshot
    head_tokens: int  # tokens re-prefilled while the snapshot's tail was read (0: not split)
    rejected: str  # why the snapshot was not used ("" when it was)


def affine_fit(obs, min_span: float = 1.5) -> tuple[float, float] | None:
    """(fixed seconds, seconds per unit) of the line through two of `obs` [(units, seconds)] closest to all of
    them (least absolute deviations, over the pairs whose sizes span at least `min_span`x: a line through one
    size is noise), or None where no pair gives a cost (a fixed part >= 0, a rate > 0). Not least squares: one
    slow prefill (a new shape's one-time costs, 480 ms against 27 on an H100 host) tilts a least-squares line
    through a handful of heads until no split pays; it moves this one only when it is most of the points."""
    best = None
    for i, (x1, y1) in enumerate(obs):
        for x2, y2 in obs[i + 1:]:
            if max(x1, x2) < min_span * min(x1, x2):
                continue
            slope = (y2 - y1) / (x2 - x1)
            fixed = y1 - slope * x1
            if slope <= 0 or fixed < 0:
                continue
            err = sum(abs(y - fixed - slope * x) for x, y in obs)
            if best is None or err < best[0]:
                best = (err, fixed, slope)
    return None if best is None else best[1:]


class SplitPolicy:
    """Where to split a resume, from the measured costs: the read as a rate per byte (exponential averages,
    weight `alpha` for the newest), the head's prefill as a fixed part plus a rate per token, fitted to the
    last `window` prefills once their sizes differ enough (`affine_fit`; until then a rate alone). The fixed
    part (launches, the host's work, the wait for the device) is what makes short heads dear: at 8k tokens
    on an H100 host a 3k-token head took 16 ms where 8k took 33."""

    def __init__(self, enabled: bool = True, alpha: float = 0.5, split_cached: bool = False, window: int = 8,
                 explore_every: int = 4):
        self.enabled, self.alpha, self.split_cached = enabled, alpha, split_cached
        self.prefill_s_per_token: float | None = None  # average seconds per head token (reported; not the model's)
        self.prefills: collections.deque = collections.deque(maxlen=window)  # (tokens, seconds) of recent heads
        # after this many resumes in a row not split (whole reads, whole prefills), one split measures again:
        # a slow first prefill (a new shape's one-time costs: 480 ms for a 4k head on an H100 host, against
        # 27 ms after) must not keep every later resume from splitting
        self.explore_every, self._unsplit = explore_every, 0
        self.read_s_per_byte: dict[bool, float | None] = {True: None, False: None}  # by `cached`
        # prefills of every token of a resume, nothing read beside them: the cost of leaving a snapshot unread.
        # Heads prefilled beside a tail's read run slower (an 8k resume on an H100 host: 2k-token heads took
        # 83 ms, all 8k tokens alone 35), so a prefill of everything priced by the heads' line loses to a
        # whole read it would beat (134 ms against 64)
        self.alone: collections.deque = collections.deque(maxlen=window)
        self._explored_alone = False  # the last exploration prefilled every token
        self._lock = threading.Lock()

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else self.alpha * new + (1 - self.alpha) * old

    def observe_prefill(self, tokens: int, seconds: float, alone: bool = False) -> None:
        """A head's prefill beside its tail's read, or (`alone`) a prefill of every token, nothing read."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                if alone:
                    self.alone.append((tokens, seconds))
                    return
                self.prefill_s_per_token = self._avg(self.prefill_s_per_token, seconds / tokens)
                self.prefills.append((tokens, seconds))

    def _alone_near(self, tokens: int) -> list[tuple[int, float]]:
        return [(t, s) for t, s in self.alone if max(t, tokens) <= 1.5 * min(t, tokens)]

    def _alone_s(self, tokens: int) -> float | None:
        """The quickest prefill timed alone of a size within 1.5x of `tokens`, scaled to it; None without one
        (the caller holds the lock)."""
        return min((s * tokens / t for t, s in self._alone_near(tokens)), default=None)

    def recompute_s(self, tokens: int, model: tuple[float, float]) -> float:
        """Seconds to prefill `tokens` with nothing read: prefills timed alone (`_alone_s`), else the heads'
        line `model` (dearer: heads run beside a read)."""
        with self._lock:
            alone = self._alone_s(tokens)
        return alone if alone is not None else model[0] + model[1] * tokens

    def observe_read(self, nbytes: int, seconds: float, cached: bool) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.read_s_per_byte[cached] = self._avg(self.read_s_per_byte[cached], seconds / nbytes)

    def prefill_model(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a head's prefill: the fitted line, else the lowest rate of the
        recent heads (a prefill is slowed by one-time costs, never sped up: the lowest is the truest)."""
        with self._lock:
            fit = affine_fit(list(self.prefills))
            rate = min((sec / tok for tok, sec in self.prefills), default=None)
        return fit or (None if rate is None else (0.0, rate))

    def start(self, token_count: int, block: int, bytes_per_token: int, cached: bool) -> int:
        """The first token whose KV is read (a block boundary; 0 reads all; `token_count` reads nothing): of the
        whole read, the split at each block boundary (a split takes the longer of its head's prefill and its
        tail's read) and a prefill of every token, the one the measured costs say is quickest (the earliest of
        equals: reading is what the snapshot is for). A split's tail keeps at least one block. A cached
        snapshot reads whole unless `split_cached`; with nothing measured yet, the split is in the middle.
        A snapshot under two blocks cannot split: it is read whole or left unread (`_unsplittable`)."""
        if not self.enabled or block < 1 or (cached and not self.split_cached):
            return 0
        if token_count < 2 * block:
            return self._unsplittable(token_count, bytes_per_token, cached)
        last = (token_count - 1) // block * block
        model, r = self.prefill_model(), self.read_s_per_byte[cached]
        if model is None or r is None:
            return min(last, int(round(token_count / 2 / block)) * block)
        fixed, p = model
        read = r * bytes_per_token  # seconds per token read

        recompute = self.recompute_s(token_count, model)

        def seconds(at: int) -> float:
            if at == token_count:
                return recompute
            return token_count * read if at == 0 else max(fixed + p * at, read * (token_count - at))

        best = min([*range(0, last + 1, block), token_count], key=seconds)
        with self._lock:
            self._unsplit = self._unsplit + 1 if best in (0, token_count) else 0
            if self._unsplit < self.explore_every:
                return best
            self._unsplit = 0
            # measure again what the costs may misprice: a prefill of every token until two of about this size
            # were timed alone (every other exploration), else the best split (its head)
            if best != token_count and not self._explored_alone and len(self._alone_near(token_count)) < 2:
                self._explored_alone = True
                return token_count
            self._explored_alone = False
        return min(range(block, last + 1, block), key=seconds)

    def _unsplittable(self, token_count: int, bytes_per_token: int, cached: bool) -> int:
        """start() for a snapshot under two blocks: the whole read, or every token prefilled where prefills of
        about this size timed alone were quicker than reading it (2k tokens on an H100 host: a cold read 16.7
        ms, a prefill 15.0). Without those, after `explore_every` whole reads in a row one prefills every
        token, until two of about this size are timed."""
        r = self.read_s_per_byte[cached]
        with self._lock:
            alone = self._alone_s(token_count)
            if r is not None and alone is not None:
                return token_count if alone < r * bytes_per_token * token_count else 0
            self._unsplit += 1
            if self._unsplit < self.explore_every or len(self._alone_near(token_count)) >= 2 or token_count < 1:
                return 0
            self._unsplit = 0
        return token_count


_tail_reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-tail")
SPLIT_ON_CPU = False  # split also when the engine runs on the CPU (tests do, to cover the split on any machine)


def _sync(device) -> None:
    """Wait for the head's prefill: the engine's stream only."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def resume(eng, store: SnapshotStore, policy: SplitPolicy, traj: str, tokens: list[int], sampled: list[bool],
           params, threads: int = 32) -> Resumed:
    """Admit the committed `tokens` of `traj` into `eng`, with as much of its snapshot's KV as pays: split
    (`SplitPolicy`), whole, or none (a rejected snapshot: its reason is returned, the tokens re-prefilled)."""
    try:
        f = store.open(traj, tokens, eng.version, eng.fingerprint, eng.dtype)
    except SnapshotRejected as exc:
        return Resumed(eng.add(traj, tokens, sampled, params), 0, 0, exc.reason)
    future = None
    try:
        n, per_token = f.token_count, f.bytes_per_token
        cached = f.cached()
        measured = cached or f.cold()  # a partly cached file reads at neither rate: its time teaches neither
        on_cpu = torch.device(eng.device).type == "cpu" and not SPLIT_ON_CPU
        start = 0 if eng.strict or on_cpu else policy.start(n, f.block_tokens, per_token, cached)
        rejected: list[str] = []
        t0 = time.perf_counter()
        if start >= n:  # a prefill of every token is quicker than any read of the snapshot
            prefilled = eng.add(traj, tokens, sampled, params)
            _sync(eng.device)
            policy.observe_prefill(prefilled, time.perf_counter() - t0, alone=True)
            return Resumed(prefilled, 0, 0, RECOMPUTE)
        if start == 0:
            try:
                kv = f.read(0, eng.device, threads)
            except SnapshotRejected as exc:
                return Resumed(eng.add(traj, tokens, sampled, params), 0, 0, exc.reason)
            if measured:
                policy.observe_read(n * per_token, f.read_s, cached)
        else:
            future = _tail_reader.submit(f.read, start, eng.device, threads)

            def kv():  # the engine calls this with the head's prefill enqueued
                _sync(eng.device)
                policy.observe_prefill(start, time.perf_counter() - t0)
                try:
                    tail = future.result()
                except SnapshotRejected as exc:
                    rejected.append(exc.reason)
                    return None
                if measured:  # its reads' time (`read_s`), not its upload
                    policy.observe_read((n - start) * per_token, f.read_s, cached)
                return tail
        try:
            prefilled = eng.add(traj, tokens, sampled, params, kv=kv, kv_start=start)
        except ValueError:  # the KV does not fit this engine or is not at a decode point: not admitted
            return Resumed(eng.add(traj, tokens, sampled, params), 0, 0, "mismatch")
        if eng.seqs[traj].state == "done":
            return Resumed(prefilled, 0, 0, "")  # complete before the fault: no KV needed
        if rejected:
            return Resumed(prefilled, 0, start, rejected[0])
        return Resumed(prefilled, n - start, start, "")
    finally:
        if future is not None:  # the tail read must be over before its file is closed
            concurrent.futures.wait([future])
        f.close()
